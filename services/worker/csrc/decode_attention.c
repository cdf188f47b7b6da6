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
 * with side 0 = K, 1 = V; the pool holds float32 or bfloat16 (kernels.h), the queries and the
 * output are float32.
 */
#include "kernels.h"

#define SPAN_MIN_KEYS 64   /* keys per work item at least: smaller spans cost more to merge than they gain */
/* keys per work item where the spans are batch-invariant: a 512-token prefill of SmolLM2 run as
 * decode rows, 30 layers, 146 ms of attention at 64 keys against 122 at 256 (medians of 5); a step
 * of 20 requests at 600 keys 34.0 against 27.7 ms, as fast as spans cut for the batch (27.8); one
 * request at 512 keys still two items, one per thread of this machine. */
#define SPAN_FIXED_KEYS 256
#define SPANS_PER_THREAD 4 /* enough items that uneven contexts still balance */

/* a . the n pool elements from element i. */
static inline float dot(const float *restrict a, const void *kv, int64_t i, int64_t n, const int bf) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < n; j++) s += a[j] * kv_at(kv, i + j, bf);
    return s;
}

/* Keys [start, end) of one request (start a multiple of block_size), every head.
 * q: [H, D]; writes acc: [H, D] (not yet divided by the sum), mx: [H] running max, sm: [H] sum.
 * Loops run head by head over a chunk of keys so that a head's query and accumulator stay in
 * registers while the chunk's keys and values (a few KB) come from L1. */
static inline __attribute__((always_inline)) void attend_span(
    const float *restrict q, const void *kv, int64_t block_stride, int64_t side_stride, const int64_t *table,
    int64_t start, int64_t end, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim,
    int64_t block_size, float scale, float *restrict acc, float *restrict mx, float *restrict sm, const int bf) {
    const int64_t group = num_heads / num_kv_heads, slot = num_kv_heads * head_dim;
    float s[CHUNK];
    for (int64_t h = 0; h < num_heads; h++) {
        mx[h] = -INFINITY;
        sm[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t pos = start; pos < end;) {
        int64_t n;
        const int64_t kb = chunk_at(block_stride, table, pos, end, block_size, slot, &n), vb = kb + side_stride;
        if (pos + n < end) { /* the next chunk's block lies elsewhere: start bringing it into L2 */
            int64_t next_n;
            const int64_t nk = chunk_at(block_stride, table, pos + n, end, block_size, slot, &next_n);
            for (int64_t i = 0; i < next_n * slot; i += bf ? 32 : 16) { /* a 64-byte line */
                __builtin_prefetch(kv_addr(kv, nk + i, bf), 0, 2);
                __builtin_prefetch(kv_addr(kv, nk + side_stride + i, bf), 0, 2);
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t off = (h / group) * head_dim;
            const float *qh = q + h * head_dim;
            float m = mx[h];
            for (int64_t t = 0; t < n; t++) {
                s[t] = scale * dot(qh, kv, kb + t * slot + off, head_dim, bf);
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
                const float p = s[t];
                const int64_t v = vb + t * slot + off;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * kv_at(kv, v + d, bf);
            }
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) ah[d] = a[d];
        }
        pos += n;
    }
}

#ifdef __AVX512F__

#define PASS_REGS 16 /* accumulator registers of one pass: its query heads x head_dim / 16 */

/* attend_span for head_dim = 16 * V (V = 4 or 8, a compile-time constant), in registers. Per
 * chunk, the query heads that share a KV head go in passes of PASS_REGS / V heads: each key and
 * value is loaded once per pass for all of its heads, and the pass's accumulators stay in
 * registers through the chunk. The next chunk's lines are prefetched (into L2) a few per key
 * while this chunk computes, so the memory streams during the compute: issued all at once they
 * would queue behind the core's few outstanding misses and stall it (20 requests x 600 keys,
 * 30 layers: 43.7 ms with the loop above, 40.3 in registers, 35.8 with the spread prefetch;
 * with the keys in cache 16.2, 10.0 and 12.1 ms). */
static inline __attribute__((always_inline)) void attend_span_avx512(
    const float *restrict q, const void *kv, int64_t block_stride, int64_t side_stride, const int64_t *table,
    int64_t start, int64_t end, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
    float *restrict acc, float *restrict mx, float *restrict sm, const int V, const int bf) {
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
        const int64_t kb = chunk_at(block_stride, table, pos, end, block_size, slot, &n), vb = kb + side_stride;
        /* The next chunk: its K lines then its V lines, pf_step of them per key visited. */
        const char *nk = kv_addr(kv, kb, bf), *nv = nk;
        int64_t pf_lines = 0, pf_i = 0;
        if (pos + n < end) {
            int64_t next_n;
            const int64_t next = chunk_at(block_stride, table, pos + n, end, block_size, slot, &next_n);
            nk = kv_addr(kv, next, bf);
            nv = kv_addr(kv, next + side_stride, bf);
            pf_lines = next_n * slot / (bf ? 32 : 16);
        }
        const int64_t pf_step = (2 * pf_lines + 2 * n * num_passes - 1) / (2 * n * num_passes);
#define PREFETCH_SOME()                                                                   \
    for (int64_t i = 0; i < pf_step && pf_i < 2 * pf_lines; i++, pf_i++)                 \
        _mm_prefetch(pf_i < pf_lines ? nk + 64 * pf_i : nv + 64 * (pf_i - pf_lines), _MM_HINT_T1);
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const int64_t kg = kb + g * D, vg = vb + g * D;
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += per_pass) {
                const int nh = (g + 1) * group - h0 < per_pass ? (int)((g + 1) * group - h0) : per_pass;
                __m512 qv[PASS_REGS / 4][8], a[PASS_REGS / 4][8], x[8];
                for (int j = 0; j < nh; j++)
                    for (int d = 0; d < V; d++) qv[j][d] = _mm512_loadu_ps(q + (h0 + j) * D + 16 * d);
                for (int64_t t = 0; t < n; t++) { /* scores */
                    PREFETCH_SOME();
                    for (int d = 0; d < V; d++) x[d] = kv_load16(kv, kg + t * slot + 16 * d, bf);
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
                    for (int d = 0; d < V; d++) x[d] = kv_load16(kv, vg + t * slot + 16 * d, bf);
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

/* One work item: attend_span with the head size a compile-time constant where it is a common one,
 * and the pool's element type (bf) always. */
static inline __attribute__((always_inline)) void attend_item(
    const float *restrict q, const void *kv, int64_t block_stride, int64_t side_stride, const int64_t *table,
    int64_t start, int64_t end, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, float *restrict acc, float *restrict mx, float *restrict sm, const int bf) {
#ifdef __AVX512F__
    if (head_dim == 64)
        attend_span_avx512(q, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads,
                           block_size, scale, acc, mx, sm, 4, bf);
    else if (head_dim == 128)
        attend_span_avx512(q, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads,
                           block_size, scale, acc, mx, sm, 8, bf);
    else
#endif
    if (head_dim == 64)
        attend_span(q, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads, 64, block_size,
                    scale, acc, mx, sm, bf);
    else
        attend_span(q, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads, head_dim,
                    block_size, scale, acc, mx, sm, bf);
}

/* q: [R, H, D] rows `q_row_stride` floats apart (heads contiguous); out: [R, H, D] contiguous.
 * kv: the layer's view of a float32 pool, or of a bfloat16 one where kv_bf16 (strides in elements).
 * block_ids: [R, max_blocks]; ctx_lens: [R] keys per request (the new token's included, >= 1).
 * The spans are cut for `span_threads` threads and run on `num_threads`: the result depends on the
 * first only, so a caller may run it on fewer threads than it was cut for. span_threads 0: spans of
 * SPAN_FIXED_KEYS whatever the batch, so each row's result depends on its own query and keys alone
 * (batch-invariant: a query gets the same bits decoded alone, beside others, or as a row of a
 * prefill chunk). */
void paged_decode_attention_spans(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16,
                                  int64_t block_stride, int64_t side_stride, const int64_t *block_ids,
                                  int64_t max_blocks, const int64_t *ctx_lens, float *out, int64_t num_rows,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int span_threads, int num_threads) {
    /* Span length: whole blocks, about SPANS_PER_THREAD items per thread over the batch. */
    int64_t span = SPAN_FIXED_KEYS;
    if (span_threads > 0) {
        int64_t total = 0;
        for (int64_t r = 0; r < num_rows; r++) total += ctx_lens[r];
        const int64_t items = (int64_t)span_threads * SPANS_PER_THREAD, even = (total + items - 1) / items;
        span = even > SPAN_MIN_KEYS ? even : SPAN_MIN_KEYS;
    }
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
            if (kv_bf16)
                attend_item(qr, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads, head_dim,
                            block_size, scale, acc, mx, sm, 1);
            else
                attend_item(qr, kv, block_stride, side_stride, table, start, end, num_heads, num_kv_heads, head_dim,
                            block_size, scale, acc, mx, sm, 0);
        }
#pragma omp for schedule(static) nowait
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
