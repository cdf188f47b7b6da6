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

/* The chunk of keys at `pos` (at most CHUNK, within its block and before `end`): its first key's
 * address in the layer's view of the pool, and in *n how many keys it holds. */
static inline const float *chunk_at(const float *kv, int64_t block_stride, const int64_t *table, int64_t pos,
                                    int64_t end, int64_t block_size, int64_t slot, int64_t *n) {
    const int64_t in_block = pos % block_size;
    int64_t k = block_size - in_block;
    k = k < CHUNK ? k : CHUNK;
    *n = k < end - pos ? k : end - pos;
    return kv + table[pos / block_size] * block_stride + in_block * slot;
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
        int64_t n;
        const float *kb = chunk_at(kv, block_stride, table, pos, end, block_size, slot, &n);
        const float *vb = kb + side_stride;
        if (pos + n < end) { /* the next chunk's block lies elsewhere: start bringing it into L2 */
            int64_t next_n;
            const float *nk = chunk_at(kv, block_stride, table, pos + n, end, block_size, slot, &next_n);
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

#ifdef __AVX512F__
#include <immintrin.h>

#define PASS_REGS 16 /* accumulator registers of one pass: its query heads x head_dim / 16 */

/* exp_nonpositive on 16 lanes. */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* attend_span for head_dim = 16 * V (V = 4 or 8, a compile-time constant), in registers. Per
 * chunk, the query heads that share a KV head go in passes of PASS_REGS / V heads: each key and
 * value is loaded once per pass for all of its heads, and the pass's accumulators stay in
 * registers through the chunk. The next chunk's lines are prefetched (into L2) a few per key
 * while this chunk computes, so the memory streams during the compute: issued all at once they
 * would queue behind the core's few outstanding misses and stall it (20 requests x 600 keys,
 * 30 layers: 43.7 ms with the loop above, 40.3 in registers, 35.8 with the spread prefetch;
 * with the keys in cache 16.2, 10.0 and 12.1 ms). */
static inline __attribute__((always_inline)) void attend_span_avx512(
    const float *restrict q, const float *kv, int64_t block_stride, int64_t side_stride, const int64_t *table,
    int64_t start, int64_t end, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
    float *restrict acc, float *restrict mx, float *restrict sm, const int V) {
    const int64_t D = 16 * V, group = num_heads / num_kv_heads, slot = num_kv_heads * D;
    const int per_pass = PASS_REGS / V;
    const int64_t num_passes = num_kv_heads * ((group + per_pass - 1) / per_pass);
    for (int64_t h = 0; h < num_heads; h++) {
        mx[h] = -INFINITY;
        sm[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num_heads * D);
    float s[PASS_REGS / 4][CHUNK] __attribute__((aligned(64)));
    for (int64_t pos = start; pos < end;) {
        int64_t n;
        const float *kb = chunk_at(kv, block_stride, table, pos, end, block_size, slot, &n);
        const float *vb = kb + side_stride;
        /* The next chunk: its K lines then its V lines, pf_step of them per key visited. */
        const float *nk = kb;
        int64_t pf_lines = 0, pf_i = 0;
        if (pos + n < end) {
            int64_t next_n;
            nk = chunk_at(kv, block_stride, table, pos + n, end, block_size, slot, &next_n);
            pf_lines = next_n * slot / 16;
        }
        const int64_t pf_step = (2 * pf_lines + 2 * n * num_passes - 1) / (2 * n * num_passes);
#define PREFETCH_SOME()                                                                   \
    for (int64_t i = 0; i < pf_step && pf_i < 2 * pf_lines; i++, pf_i++)                 \
        _mm_prefetch((const char *)(pf_i < pf_lines ? nk + pf_i * 16 : nk + side_stride + (pf_i - pf_lines) * 16), \
                     _MM_HINT_T1);
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const float *kg = kb + g * D, *vg = vb + g * D;
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += per_pass) {
                const int nh = (g + 1) * group - h0 < per_pass ? (int)((g + 1) * group - h0) : per_pass;
                __m512 qv[PASS_REGS / 4][8], a[PASS_REGS / 4][8], x[8];
                for (int j = 0; j < nh; j++)
                    for (int d = 0; d < V; d++) qv[j][d] = _mm512_loadu_ps(q + (h0 + j) * D + 16 * d);
                for (int64_t t = 0; t < n; t++) { /* scores */
                    PREFETCH_SOME();
                    for (int d = 0; d < V; d++) x[d] = _mm512_loadu_ps(kg + t * slot + 16 * d);
                    for (int j = 0; j < nh; j++) {
                        __m512 p = _mm512_mul_ps(qv[j][0], x[0]);
                        for (int d = 1; d < V; d++) p = _mm512_fmadd_ps(qv[j][d], x[d], p);
                        s[j][t] = scale * _mm512_reduce_add_ps(p);
                    }
                }
                for (int j = 0; j < nh; j++) { /* running softmax; a[j] = the accumulator rescaled */
                    const int64_t h = h0 + j;
                    float m = mx[h];
                    for (int64_t t = 0; t < n; t++) m = s[j][t] > m ? s[j][t] : m;
                    __m512 sum = _mm512_setzero_ps();
                    for (int64_t t = 0; t < n; t += 16) {
                        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
                        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s[j] + t), _mm512_set1_ps(m)));
                        _mm512_storeu_ps(s[j] + t, e);
                        sum = _mm512_mask_add_ps(sum, live, sum, e);
                    }
                    const float correction = exp_nonpositive(mx[h] - m); /* ~0 on the first chunk */
                    mx[h] = m;
                    sm[h] = sm[h] * correction + _mm512_reduce_add_ps(sum);
                    const __m512 c = _mm512_set1_ps(correction);
                    for (int d = 0; d < V; d++) a[j][d] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + 16 * d), c);
                }
                for (int64_t t = 0; t < n; t++) { /* values */
                    PREFETCH_SOME();
                    for (int d = 0; d < V; d++) x[d] = _mm512_loadu_ps(vg + t * slot + 16 * d);
                    for (int j = 0; j < nh; j++) {
                        const __m512 p = _mm512_set1_ps(s[j][t]);
                        for (int d = 0; d < V; d++) a[j][d] = _mm512_fmadd_ps(p, x[d], a[j][d]);
                    }
                }
                for (int j = 0; j < nh; j++)
                    for (int d = 0; d < V; d++) _mm512_storeu_ps(acc + (h0 + j) * D + 16 * d, a[j][d]);
            }
        }
#undef PREFETCH_SOME
        pos += n;
    }
}
#endif

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
#ifdef __AVX512F__
            if (head_dim == 64) /* the common sizes, unrolled at compile time */
                attend_span_avx512(qr, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads,
                                   block_size, scale, acc, mx, sm, 4);
            else if (head_dim == 128)
                attend_span_avx512(qr, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads,
                                   block_size, scale, acc, mx, sm, 8);
            else
#endif
            if (head_dim == 64)
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

/* ------------------------------------------------------------ paged prefill attention (AVX-512)
 * The queries of one prefill chunk of one request against every key before them, causal, read
 * from the pool like decode's (the chunk's own keys are written there before attention). A work
 * item is a tile of query rows that share a KV head: QT = PF_ROWS / G positions x the G heads of
 * the group, one row per 16-lane register column (PF_X registers of 16 rows). The queries are held
 * transposed, Q^T [D][rows], so both products are outer products that keep every key's and
 * value's element a broadcast operand and a tile's rows in the lanes: S^T[t] = sum_d K[t][d] Q^T[d]
 * (8 keys at a time, 24 accumulators), O^T[d] += sum_t V[t][d] P^T[t] (8 elements of the head at
 * a time). The running softmax's max, sum and correction are then vectors over the rows, and the
 * causal mask is a lane compare of each row's position with the key's. A 512-token prompt, 30
 * layers, on a 2-core Zen 5: torch's CPU flash attention 115 ms, this kernel 31 ms (README,
 * "Benchmarks"). */
#ifdef __AVX512F__
#define PF_X 3                /* 16-row registers per tile */
#define PF_ROWS (16 * PF_X)   /* query rows per tile */
#define PF_KEYS 8             /* keys per score pass; elements per value pass */

/* S^T[t][rows] = scale * K[t] . Q^T for T keys (T a compile-time constant). */
static inline __attribute__((always_inline)) void pf_scores(const float *restrict kt, int64_t slot,
                                                           const float *restrict qt, int64_t D, float scale,
                                                           float *restrict st, const int T) {
    __m512 acc[PF_KEYS][PF_X];
    for (int t = 0; t < T; t++)
        for (int x = 0; x < PF_X; x++) acc[t][x] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 qv[PF_X];
        for (int x = 0; x < PF_X; x++) qv[x] = _mm512_load_ps(qt + d * PF_ROWS + 16 * x);
        for (int t = 0; t < T; t++) {
            const __m512 k = _mm512_set1_ps(kt[t * slot + d]);
            for (int x = 0; x < PF_X; x++) acc[t][x] = _mm512_fmadd_ps(k, qv[x], acc[t][x]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int t = 0; t < T; t++)
        for (int x = 0; x < PF_X; x++) _mm512_store_ps(st + t * PF_ROWS + 16 * x, _mm512_mul_ps(acc[t][x], s));
}

/* O^T[d] = O^T[d] * corr + sum_t V[t][d] P^T[t] for the head's elements, PF_KEYS at a time. */
static inline void pf_values(const float *restrict vt, int64_t slot, const float *restrict pt, int64_t n,
                             int64_t D, const __m512 *corr, float *restrict ot) {
    for (int64_t d0 = 0; d0 < D; d0 += PF_KEYS) {
        __m512 acc[PF_KEYS][PF_X];
        for (int e = 0; e < PF_KEYS; e++)
            for (int x = 0; x < PF_X; x++)
                acc[e][x] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + e) * PF_ROWS + 16 * x), corr[x]);
        for (int64_t t = 0; t < n; t++) {
            __m512 p[PF_X];
            for (int x = 0; x < PF_X; x++) p[x] = _mm512_load_ps(pt + t * PF_ROWS + 16 * x);
            for (int e = 0; e < PF_KEYS; e++) {
                const __m512 v = _mm512_set1_ps(vt[t * slot + d0 + e]);
                for (int x = 0; x < PF_X; x++) acc[e][x] = _mm512_fmadd_ps(v, p[x], acc[e][x]);
            }
        }
        for (int e = 0; e < PF_KEYS; e++)
            for (int x = 0; x < PF_X; x++) _mm512_store_ps(ot + (d0 + e) * PF_ROWS + 16 * x, acc[e][x]);
    }
}

/* q: [q_len, H, D] rows `q_row_stride` floats apart (heads contiguous), the chunk's queries at
 * positions num_cached .. num_cached + q_len - 1; table: the request's blocks (covering them);
 * out: [q_len, H, D] contiguous. head_dim a multiple of PF_KEYS; H / KV <= PF_ROWS. */
void paged_prefill_attention_f32(const float *q, int64_t q_row_stride, const float *kv, int64_t block_stride,
                                 int64_t side_stride, const int64_t *table, int64_t num_cached, int64_t q_len,
                                 float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int num_threads) {
    const int64_t D = head_dim, group = num_heads / num_kv_heads, slot = num_kv_heads * D;
    const int64_t qt_len = PF_ROWS / group; /* positions per tile */
    const int64_t num_tiles = (q_len + qt_len - 1) / qt_len, num_items = num_tiles * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        float *qt = aligned_alloc(64, sizeof(float) * D * PF_ROWS);
        float *ot = aligned_alloc(64, sizeof(float) * D * PF_ROWS);
        float *st = aligned_alloc(64, sizeof(float) * CHUNK * PF_ROWS);
        int32_t pos[PF_ROWS] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            /* The last tiles (the most keys) first, so the short ones fill in at the end. */
            const int64_t tile = num_tiles - 1 - item / num_kv_heads, g = item % num_kv_heads;
            const int64_t i0 = tile * qt_len, n_pos = q_len - i0 < qt_len ? q_len - i0 : qt_len;
            const int64_t used = n_pos * group; /* rows past it repeat the last one, never written */
            for (int64_t r = 0; r < PF_ROWS; r++) {
                const int64_t rr = r < used ? r : used - 1, i = i0 + rr / group, h = g * group + rr % group;
                pos[r] = (int32_t)(num_cached + i);
                const float *qr = q + i * q_row_stride + h * D;
                for (int64_t d = 0; d < D; d++) qt[d * PF_ROWS + r] = qr[d];
            }
            memset(ot, 0, sizeof(float) * D * PF_ROWS);
            __m512 mx[PF_X], sm[PF_X];
            __m512i rpos[PF_X];
            for (int x = 0; x < PF_X; x++) {
                mx[x] = _mm512_set1_ps(-INFINITY);
                sm[x] = _mm512_setzero_ps();
                rpos[x] = _mm512_load_si512(pos + 16 * x);
            }
            const int64_t first_diag = num_cached + i0, end = num_cached + i0 + n_pos; /* keys [0, end) */
            for (int64_t p = 0; p < end;) {
                int64_t n;
                const float *kb = chunk_at(kv, block_stride, table, p, end, block_size, slot, &n) + g * D;
                const float *vb = kb + side_stride;
                int64_t t = 0;
                for (; t + PF_KEYS <= n; t += PF_KEYS) pf_scores(kb + t * slot, slot, qt, D, scale, st + t * PF_ROWS, PF_KEYS);
                for (; t < n; t++) pf_scores(kb + t * slot, slot, qt, D, scale, st + t * PF_ROWS, 1);
                if (p + n > first_diag) /* keys past some row's position: masked out for it */
                    for (t = 0; t < n; t++)
                        for (int x = 0; x < PF_X; x++) {
                            const __mmask16 late = _mm512_cmplt_epi32_mask(rpos[x], _mm512_set1_epi32((int32_t)(p + t)));
                            float *s = st + t * PF_ROWS + 16 * x;
                            _mm512_store_ps(s, _mm512_mask_mov_ps(_mm512_load_ps(s), late, _mm512_set1_ps(-INFINITY)));
                        }
                __m512 corr[PF_X];
                for (int x = 0; x < PF_X; x++) {
                    __m512 m = mx[x];
                    for (t = 0; t < n; t++) m = _mm512_max_ps(m, _mm512_load_ps(st + t * PF_ROWS + 16 * x));
                    __m512 sum = _mm512_setzero_ps();
                    for (t = 0; t < n; t++) {
                        float *s = st + t * PF_ROWS + 16 * x;
                        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_load_ps(s), m));
                        _mm512_store_ps(s, e);
                        sum = _mm512_add_ps(sum, e);
                    }
                    corr[x] = exp16_nonpositive(_mm512_sub_ps(mx[x], m)); /* ~0 on the first chunk */
                    sm[x] = _mm512_fmadd_ps(sm[x], corr[x], sum);
                    mx[x] = m;
                }
                pf_values(vb, slot, st, n, D, corr, ot);
                p += n;
            }
            float inv[PF_ROWS] __attribute__((aligned(64)));
            for (int x = 0; x < PF_X; x++) _mm512_store_ps(inv + 16 * x, _mm512_div_ps(_mm512_set1_ps(1.0f), sm[x]));
            for (int64_t r = 0; r < used; r++) {
                float *o = out + ((i0 + r / group) * num_heads + g * group + r % group) * D;
                for (int64_t d = 0; d < D; d++) o[d] = ot[d * PF_ROWS + r] * inv[r];
            }
        }
        free(st);
        free(ot);
        free(qt);
    }
}
#endif

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

/* ------------------------------------------------------------ prefill matmul on AMX (bf16x3)
 * y[M, N] = x[M, K] . W^T (+ bias) for the many rows of a prefill chunk, on the AMX tile unit,
 * at float32's accuracy less a few bits. Each float32 value is split into two bfloat16 parts,
 * v = hi + lo (hi = v rounded to bfloat16, lo = the remainder rounded again: 16 bits of
 * mantissa together), and x . w = xh.wh + xh.wl + xl.wh, the three products accumulated in
 * float32 by the tile unit (xl.wl, below 2^-16 of the product, is left out). Three bfloat16
 * products cost less than one float32 product on AVX-512: measured 1.6-2.2x faster than
 * oneDNN's float32 GEMM at 512 rows, ~4e-6 off relative to the output's scale (plain float32:
 * ~5e-7; a single bfloat16 product: ~3e-3).
 *
 * W is packed once, [N / 16][K / 32][hi, lo][16][32] bfloat16: per 16 output columns and 32
 * inputs, one B tile per part in the tile unit's pair-interleaved layout (tile row r holds
 * inputs 2r and 2r + 1 of the 16 columns), 4 bytes a weight as float32. x is split per call.
 * A C tile is 16 rows by 16 columns; a work item is 32 rows by 32 columns (four C tiles, so four
 * accumulations are in flight), 16 rows or 16 columns at the edges; items are taken column pair
 * by column pair so each thread's weights stay in L2. The kernel reads its tiles from L2 at
 * about a third of the tile unit's peak (README, "Benchmarks").
 * Built where the compiler targets AMX; the kernel runs only after `amx_enable` got the
 * kernel's permission for the tile state. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* rows of every tile */
#define AMX_K 32    /* bfloat16 inputs per A tile row (64 bytes) */
#define AMX_N 16    /* float32 columns per C tile */
#define AMX_TILE_ELEMS (AMX_ROWS * AMX_K)
/* C tile c += A.B in bf16x3: the two small terms first (tile numbers are immediates, hence a macro) */
#define DP_BF16X3(c, ah, al, bh, bl) \
    do {                             \
        _tile_dpbf16ps(c, al, bh);   \
        _tile_dpbf16ps(c, ah, bl);   \
        _tile_dpbf16ps(c, ah, bh);   \
    } while (0)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

static inline uint16_t bf16_round(float f) { /* round to nearest even; finite inputs */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void bf16_split(float v, uint16_t *hi, uint16_t *lo) {
    *hi = bf16_round(v);
    *lo = bf16_round(v - bf16_value(*hi)); /* exact difference: the two share an exponent range */
}

/* w: [N, K] float32 -> out: [N / 16][K / 32][2][16][32] bfloat16 (N % 16 == K % 32 == 0). */
void pack_bf16x3(const float *w, int64_t N, int64_t K, uint16_t *out) {
    const int64_t num_kb = K / AMX_K;
#pragma omp parallel for collapse(2)
    for (int64_t nb = 0; nb < N / AMX_N; nb++)
        for (int64_t kb = 0; kb < num_kb; kb++) {
            uint16_t *hi = out + (nb * num_kb + kb) * 2 * AMX_TILE_ELEMS, *lo = hi + AMX_TILE_ELEMS;
            for (int r = 0; r < AMX_ROWS; r++)
                for (int c = 0; c < AMX_N; c++)
                    for (int j = 0; j < 2; j++) {
                        const int64_t at = r * AMX_K + 2 * c + j;
                        bf16_split(w[(nb * AMX_N + c) * K + kb * AMX_K + 2 * r + j], hi + at, lo + at);
                    }
        }
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void tiles_configure(void) { /* every tile 16 rows of 64 bytes; per thread */
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = AMX_ROWS;
    _tile_loadconfig(&c);
}

/* 16 rows by 16 or 32 columns (the edges of the 32 x 32 items). Tiles: 0, 1 C (columns n, n + 16);
 * 2, 3 A (xh, xl); 4, 5 B of n (hi, lo); 6, 7 B of n + 16. */
static inline void amx_item(const uint16_t *xh, const uint16_t *xl, int64_t K, const uint16_t *w0, int two,
                            float *c0, float *c1) {
    const int64_t num_kb = K / AMX_K;
    const uint16_t *w1 = w0 + num_kb * 2 * AMX_TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < num_kb; kb++) {
        _tile_loadd(2, xh + kb * AMX_K, K * 2);
        _tile_loadd(3, xl + kb * AMX_K, K * 2);
        const uint16_t *b0 = w0 + kb * 2 * AMX_TILE_ELEMS, *b1 = w1 + kb * 2 * AMX_TILE_ELEMS;
        _tile_loadd(4, b0, 64);
        _tile_loadd(5, b0 + AMX_TILE_ELEMS, 64);
        if (two) {
            _tile_loadd(6, b1, 64);
            _tile_loadd(7, b1 + AMX_TILE_ELEMS, 64);
        }
        DP_BF16X3(0, 2, 3, 4, 5);
        if (two) DP_BF16X3(1, 2, 3, 6, 7);
    }
    _tile_stored(0, c0, AMX_N * 4);
    if (two) _tile_stored(1, c1, AMX_N * 4);
}

/* 32 rows by 32 columns: four C tiles (0 rows r, n; 1 r, n + 16; 2 r + 16, n; 3 r + 16, n + 16),
 * so four accumulation chains are in flight; 4, 5 A (xh, xl), 6, 7 B (hi, lo), reloaded. */
static inline void amx_item_2x2(const uint16_t *xh, const uint16_t *xl, int64_t K, const uint16_t *w0, float *c) {
    const int64_t num_kb = K / AMX_K, next_rows = AMX_ROWS * K;
    const uint16_t *w1 = w0 + num_kb * 2 * AMX_TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < num_kb; kb++) {
        const uint16_t *b0 = w0 + kb * 2 * AMX_TILE_ELEMS, *b1 = w1 + kb * 2 * AMX_TILE_ELEMS;
        _tile_loadd(4, xh + kb * AMX_K, K * 2);
        _tile_loadd(5, xl + kb * AMX_K, K * 2);
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b0 + AMX_TILE_ELEMS, 64);
        DP_BF16X3(0, 4, 5, 6, 7);
        _tile_loadd(6, b1, 64);
        _tile_loadd(7, b1 + AMX_TILE_ELEMS, 64);
        DP_BF16X3(1, 4, 5, 6, 7);
        _tile_loadd(4, xh + next_rows + kb * AMX_K, K * 2);
        _tile_loadd(5, xl + next_rows + kb * AMX_K, K * 2);
        DP_BF16X3(3, 4, 5, 6, 7);
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b0 + AMX_TILE_ELEMS, 64);
        DP_BF16X3(2, 4, 5, 6, 7);
    }
    _tile_stored(0, c, AMX_N * 4);
    _tile_stored(1, c + AMX_ROWS * AMX_N, AMX_N * 4);
    _tile_stored(2, c + 2 * AMX_ROWS * AMX_N, AMX_N * 4);
    _tile_stored(3, c + 3 * AMX_ROWS * AMX_N, AMX_N * 4);
}

/* x: [M, K] rows ldx apart; w: packed by pack_bf16x3; bias: [N] or NULL; y: [M, N] rows ldy apart.
 * N % 16 == K % 32 == 0. Returns -1 (y untouched) where the split copy of x cannot be allocated. */
int linear_amx_bf16x3(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M <= 0) return 0;
    const int64_t num_mb = (M + AMX_ROWS - 1) / AMX_ROWS, rows_padded = num_mb * AMX_ROWS;
    const int64_t num_nb = N / AMX_N, num_pairs = (num_nb + 1) / 2, num_mb2 = (num_mb + 1) / 2;
    uint16_t *xs = aligned_alloc(64, (size_t)(rows_padded * K * 2 * sizeof(uint16_t)));
    if (!xs) return -1;
    uint16_t *xh = xs, *xl = xs + rows_padded * K;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows_padded; m++)
            for (int64_t k = 0; k < K; k++) {
                if (m < M) bf16_split(x[m * ldx + k], xh + m * K + k, xl + m * K + k);
                else xh[m * K + k] = xl[m * K + k] = 0;
            }
        tiles_configure();
        float c[4][AMX_ROWS * AMX_N] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_pairs * num_mb2; item++) {
            const int64_t nb = 2 * (item / num_mb2), m0 = (item % num_mb2) * 2 * AMX_ROWS;
            const int two = nb + 1 < num_nb, tall = m0 + AMX_ROWS < M;
            const uint16_t *wn = w + nb * (K / AMX_K) * 2 * AMX_TILE_ELEMS;
            if (two && tall) {
                amx_item_2x2(xh + m0 * K, xl + m0 * K, K, wn, c[0]);
            } else {
                amx_item(xh + m0 * K, xl + m0 * K, K, wn, two, c[0], c[1]);
                if (tall) amx_item(xh + (m0 + AMX_ROWS) * K, xl + (m0 + AMX_ROWS) * K, K, wn, two, c[2], c[3]);
            }
            for (int t = 0; t < 4; t++) {
                const int64_t n = (nb + (t & 1)) * AMX_N, r0 = m0 + (t >> 1) * AMX_ROWS;
                if (n >= N || r0 >= M) continue;
                const int64_t rows = M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS;
                const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
                for (int64_t r = 0; r < rows; r++)
                    _mm512_storeu_ps(y + (r0 + r) * ldy + n, _mm512_add_ps(_mm512_load_ps(c[t] + r * AMX_N), b));
            }
        }
        _tile_release();
    }
    free(xs);
    return 0;
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
