/* Native CPU kernels for the worker's float32 forward (services/worker/cpu_kernels.py).
 *
 * Paged decode attention, straight from the block-first KV pool.
 *
 * Each single-token query reads its request's keys and values where they lie, block by block,
 * once: no gathered copy of the context (the torch path copies it, then SDPA reads the copy),
 * one pass with a running softmax. A work item is a span of whole blocks of one request with
 * all its heads, so the keys and values stream through in address order and each is loaded
 * once for the G = H / KV query heads that share it. Long contexts are split into several
 * spans (flash-decoding), so one request alone still keeps every thread busy; the spans'
 * partial softmaxes are then merged per request. Items run on torch's own OpenMP threads (this
 * library links the libgomp torch has already loaded).
 *
 * Layout (services/worker/attention.py has the diagram): a layer's view of the pool is
 *   kv[block * block_stride + side * side_stride + slot * KV * D + kv_head * D + d]
 * with side 0 = K, 1 = V.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define CHUNK 32           /* keys scored at a time (the scores stay in L1) */
#define SPAN_MIN_KEYS 64   /* keys per work item at least: smaller spans cost more to merge than they gain */
#define SPANS_PER_THREAD 4 /* enough items that uneven contexts still balance */

int paged_attention_limits(int64_t *heads, int64_t *head_dim) {
    *heads = MAX_HEADS;
    *head_dim = MAX_HEAD_DIM;
    return 0;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* exp(x) for x <= 0 in a form the compiler vectorises (libm's expf stays scalar): x = n ln2 + r,
 * |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^7 (relative error < 1e-8, below float's
 * rounding), 2^n from the exponent bits. x is clamped at -87 (2^-126), where exp is 0 for us. */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float n = __builtin_rintf(x * 1.44269504f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f; /* ln2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Keys [start, end) of one request (start a multiple of block_size), every head.
 * q: [H, D]; writes acc: [H, D] (not yet divided by the sum), mx: [H] running max, sm: [H] sum.
 * Loops run head by head over a chunk of keys so that a head's query and accumulator stay in
 * registers while the chunk's keys and values (a few KB) come from L1. */
static inline __attribute__((always_inline)) void attend_span(
    const float *restrict q, const float *kv, int64_t block_stride, int64_t side_stride, const int64_t *table,
    int64_t start, int64_t end, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim,
    int64_t block_size, float scale, float *restrict acc, float *restrict mx, float *restrict sm) {
    const int64_t group = num_heads / num_kv_heads, slot = num_kv_heads * head_dim;
    float s[CHUNK];
    for (int64_t h = 0; h < num_heads; h++) {
        mx[h] = -INFINITY;
        sm[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t pos = start; pos < end;) {
        const int64_t in_block = pos % block_size;
        int64_t n = block_size - in_block;
        n = n < CHUNK ? n : CHUNK;
        n = n < end - pos ? n : end - pos;
        const float *kb = kv + table[pos / block_size] * block_stride + in_block * slot;
        const float *vb = kb + side_stride;
        if (pos + n < end) { /* the next chunk's block lies elsewhere: start bringing it into L2 */
            const int64_t next = pos + n, next_n = end - next < CHUNK ? end - next : CHUNK;
            const float *nk = kv + table[next / block_size] * block_stride + next % block_size * slot;
            for (int64_t i = 0; i < next_n * slot; i += 64 / sizeof(float)) {
                __builtin_prefetch(nk + i, 0, 2);
                __builtin_prefetch(nk + side_stride + i, 0, 2);
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t off = (h / group) * head_dim;
            const float *qh = q + h * head_dim;
            float m = mx[h];
            for (int64_t t = 0; t < n; t++) {
                s[t] = scale * dot(qh, kb + t * slot + off, head_dim);
                m = s[t] > m ? s[t] : m;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                s[t] = exp_nonpositive(s[t] - m);
                sum += s[t];
            }
            const float correction = exp_nonpositive(mx[h] - m); /* ~0 on the first chunk (mx -inf, acc 0) */
            mx[h] = m;
            sm[h] = sm[h] * correction + sum;
            float a[MAX_HEAD_DIM];
            float *ah = acc + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) a[d] = ah[d] * correction;
            for (int64_t t = 0; t < n; t++) {
                const float p = s[t], *v = vb + t * slot + off;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
            }
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) ah[d] = a[d];
        }
        pos += n;
    }
}

/* q: [R, H, D] rows `q_row_stride` floats apart (heads contiguous); out: [R, H, D] contiguous.
 * block_ids: [R, max_blocks]; ctx_lens: [R] keys per request (the new token's included, >= 1). */
void paged_decode_attention_f32(const float *q, int64_t q_row_stride, const float *kv, int64_t block_stride,
                                int64_t side_stride, const int64_t *block_ids, int64_t max_blocks,
                                const int64_t *ctx_lens, float *out, int64_t num_rows, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                int num_threads) {
    /* Span length: whole blocks, about SPANS_PER_THREAD items per thread over the batch. */
    int64_t total = 0;
    for (int64_t r = 0; r < num_rows; r++) total += ctx_lens[r];
    int64_t span = (total + (int64_t)num_threads * SPANS_PER_THREAD - 1) / ((int64_t)num_threads * SPANS_PER_THREAD);
    span = span > SPAN_MIN_KEYS ? span : SPAN_MIN_KEYS;
    span = (span + block_size - 1) / block_size * block_size;

    int64_t *first = malloc(sizeof(int64_t) * (num_rows + 1)); /* first item of each row */
    first[0] = 0;
    for (int64_t r = 0; r < num_rows; r++) first[r + 1] = first[r] + (ctx_lens[r] + span - 1) / span;
    const int64_t num_items = first[num_rows];
    int64_t *item_row = malloc(sizeof(int64_t) * num_items);
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t i = first[r]; i < first[r + 1]; i++) item_row[i] = r;
    /* Per item: acc [H, D], then max [H], then sum [H]. */
    const int64_t part_size = num_heads * (head_dim + 2);
    float *part = malloc(sizeof(float) * part_size * num_items);

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            const int64_t r = item_row[i], start = (i - first[r]) * span;
            const int64_t end = start + span < ctx_lens[r] ? start + span : ctx_lens[r];
            float *acc = part + i * part_size, *mx = acc + num_heads * head_dim, *sm = mx + num_heads;
            const float *qr = q + r * q_row_stride;
            const int64_t *table = block_ids + r * max_blocks;
            if (head_dim == 64) /* the common size, unrolled at compile time */
                attend_span(qr, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads, 64,
                            block_size, scale, acc, mx, sm);
            else
                attend_span(qr, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads, head_dim,
                            block_size, scale, acc, mx, sm);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++) {
            for (int64_t h = 0; h < num_heads; h++) {
                float m = -INFINITY, sum = 0.0f;
                for (int64_t i = first[r]; i < first[r + 1]; i++) {
                    const float *mx = part + i * part_size + num_heads * head_dim;
                    m = mx[h] > m ? mx[h] : m;
                }
                float *o = out + (r * num_heads + h) * head_dim;
                memset(o, 0, sizeof(float) * head_dim);
                for (int64_t i = first[r]; i < first[r + 1]; i++) {
                    const float *acc = part + i * part_size, *mx = acc + num_heads * head_dim, *sm = mx + num_heads;
                    const float w = exp_nonpositive(mx[h] - m);
                    sum += sm[h] * w;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] += w * acc[h * head_dim + d];
                }
                const float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
            }
        }
    }
    free(part);
    free(item_row);
    free(first);
}

/* ------------------------------------------------------------ per-row elementwise ops
 * One call for what eager torch runs as several ops (each with its own dispatch and
 * intermediate tensor). Rows are few at decode, so threads join only for big batches. */

#define PARALLEL_ROWS 64

static inline void rms_norm_row(const float *restrict x, const float *restrict w, float eps, float *restrict out,
                                int64_t n) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* x: [T, n] contiguous; delta: [T, n] or NULL. x += delta (in place), then out = rms_norm(x) * w. */
void add_rms_norm_f32(float *x, const float *delta, const float *w, float eps, float *out, int64_t num_rows,
                      int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++) {
        float *xr = x + r * n;
        if (delta) {
            const float *dr = delta + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
        }
        rms_norm_row(xr, w, eps, out + r * n, n);
    }
}

/* Rotary embedding, half-split layout (HF's rotate_half), in place on the first `num_heads`
 * heads of each row: x: rows `row_stride` floats apart, heads `head_dim` apart; cos, sin:
 * [T, head_dim / 2] (the angles of each position). */
void rope_f32(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t num_rows, int64_t num_heads,
              int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < num_heads; h++) {
            float *a = x + r * row_stride + h * head_dim, *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* gate_up: [T, 2n] (gate columns, then up columns) -> out: [T, n] = silu(gate) * up.
 * sigmoid(g) from e = exp(-|g|) <= 1, so the vectorised exp serves both signs without overflow:
 * 1 / (1 + e) for g >= 0, e / (1 + e) below (libm's expf, scalar, took 10x as long at prefill). */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t num_rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float x = g[i], e = exp_nonpositive(x < 0.0f ? x : -x);
            const float sigmoid = (x < 0.0f ? e : 1.0f) / (1.0f + e);
            o[i] = x * sigmoid * u[i];
        }
    }
}

/* ------------------------------------------------------------ small-batch matmul (AVX-512 only)
 * y[M, N] = x[M, K] . W^T (+ bias), for the few rows of a decode step. W is packed once in
 * panels of 16 output columns, [N / 16][K][16], so a tile streams its weights in address order.
 * A tile is two panels (32 columns) by up to 12 rows: 24 accumulators and the two weight vectors
 * stay in the 32 zmm registers, each weight vector serves every row and each broadcast x value
 * both panels, so the weights are read from memory once per row group (once per step up to
 * 12 rows; later groups find them in L2). Decode at a few rows is bound by that read, where a
 * general GEMM's blocking for large M costs a third more (README, "Benchmarks"). Built only where
 * the compiler targets AVX-512; elsewhere the symbol is absent and the worker keeps its other
 * layouts. */
#ifdef __AVX512F__
#include <immintrin.h>

#define PANEL 16    /* output columns per panel: one zmm register */
#define TILE_ROWS 12
#define PREFETCH_K 32 /* weight rows fetched ahead (2 KiB per panel): the read overlaps the FMAs */

static inline __attribute__((always_inline)) void panel_tile(const float *restrict x, int64_t ldx,
    const float *restrict p0, int64_t K, float *restrict y, int64_t ldy, const float *restrict bias, const int M,
    const int P) {
    const float *restrict p1 = p0 + K * PANEL;
    __m512 a0[TILE_ROWS], a1[TILE_ROWS];
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias && P == 2 ? _mm512_loadu_ps(bias + PANEL) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int i = 0; i < M; i++) {
        a0[i] = b0;
        a1[i] = b1;
    }
    for (int64_t k = 0; k < K; k++) {
        /* Past a panel's end this reads ahead into the next one, or past the weights: a
         * prefetch never faults. */
        _mm_prefetch((const char *)(p0 + (k + PREFETCH_K) * PANEL), _MM_HINT_T0);
        if (P == 2) _mm_prefetch((const char *)(p1 + (k + PREFETCH_K) * PANEL), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(p0 + k * PANEL);
        const __m512 w1 = P == 2 ? _mm512_loadu_ps(p1 + k * PANEL) : w0;
#pragma GCC unroll 12
        for (int i = 0; i < M; i++) {
            const __m512 xi = _mm512_set1_ps(x[i * ldx + k]);
            a0[i] = _mm512_fmadd_ps(xi, w0, a0[i]);
            if (P == 2) a1[i] = _mm512_fmadd_ps(xi, w1, a1[i]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < M; i++) {
        _mm512_storeu_ps(y + i * ldy, a0[i]);
        if (P == 2) _mm512_storeu_ps(y + i * ldy + PANEL, a1[i]);
    }
}

/* One tile of M <= TILE_ROWS rows and P panels, with M and P compile-time constants (so the
 * accumulators are registers). */
#define TILE_CASE(m)                                             \
    case m:                                                      \
        if (P == 2) panel_tile(x, ldx, w, K, y, ldy, bias, m, 2); \
        else panel_tile(x, ldx, w, K, y, ldy, bias, m, 1);        \
        break;

static void panel_tile_rows(const float *x, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy,
                            const float *bias, int64_t M, int P) {
    switch (M) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
    }
}

/* x: [M, K] rows ldx apart; w: [N / 16][K][16]; bias: [N] or NULL; y: [M, N] rows ldy apart.
 * N a multiple of 16. The threads split the panel pairs; rows go in equal groups of <= 12. */
void linear_panels_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy,
                       int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M <= 0) return;
    const int64_t num_panels = N / PANEL, num_pairs = (num_panels + 1) / 2;
    const int64_t num_groups = (M + TILE_ROWS - 1) / TILE_ROWS, group = (M + num_groups - 1) / num_groups;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t pair = 0; pair < num_pairs; pair++) {
        const int64_t p = 2 * pair;
        const int P = p + 1 < num_panels ? 2 : 1;
        for (int64_t m0 = 0; m0 < M; m0 += group) {
            const int64_t rows = M - m0 < group ? M - m0 : group;
            panel_tile_rows(x + m0 * ldx, ldx, w + p * K * PANEL, K, y + m0 * ldy + p * PANEL, ldy,
                            bias ? bias + p * PANEL : 0, rows, P);
        }
    }
}
#endif

/* ------------------------------------------------------------ KV block copies
 * One memcpy per block on the calling (transfer) thread: no OpenMP team. Another team beside
 * the compute thread's would make libgomp count more threads than cores and stop spinning,
 * which makes every parallel region of the forward wait for a futex wake-up. */

void copy_blocks(const char *src, char *dst, int64_t block_bytes, const int64_t *src_ids, const int64_t *dst_ids,
                 int64_t num_pairs) {
    for (int64_t i = 0; i < num_pairs; i++)
        memcpy(dst + dst_ids[i] * block_bytes, src + src_ids[i] * block_bytes, (size_t)block_bytes);
}
