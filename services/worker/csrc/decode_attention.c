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
#include <omp.h>

#include "kernels.h"

#define SPAN_MIN_KEYS 64   /* keys per work item at least: smaller spans cost more to merge than they gain */
/* keys per work item at most where the spans are batch-invariant (row_span): a 512-token prefill
 * of SmolLM2 run as decode rows, 30 layers, 146 ms of attention at 64 keys against 122 at 256
 * (medians of 5); a step of 20 requests at 600 keys 34.0 against 27.7 ms, as fast as spans cut for
 * the batch (27.8). (Measured before the AVX-512 path scored 16 keys at a time; a span of 256 is
 * now one run of it.) */
#define SPAN_FIXED_KEYS 256
#define SPAN_ONE_KEYS 128 /* ... and a row of at most this many keys one item */
#define SPANS_PER_THREAD 4 /* where spans are cut for the batch: enough items that uneven contexts still balance */

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

#define PASS_HEADS 4    /* query heads per pass of the scores at most: head size 64 (2 at 128) */
#define VALUE_HEADS 6   /* query heads per pass of the values at most: head size 64 (2 at 128), sums in 24 registers */
#define RUN_FLOATS 4096 /* scores held per run: RUN_FLOATS / heads keys a run, at most RUN_KEYS */
#define RUN_KEYS 256

#define PF_AHEAD 192    /* lines the prefetches run ahead of the reads (two tiles of bfloat16 keys, SmolLM2) */

/* The span's reads in the order attend_span_avx512 makes them -- per run, its keys, then its
 * values; per key, its slot's lines -- walked ahead of the compute to prefetch them into L2. */
typedef struct {
    const char *kv;
    const int64_t *table;
    int64_t block_stride, side_bytes, key_bytes, block_size, end, run; /* strides in bytes */
    int64_t run_start, key, side;
    const char *at, *key_end; /* the next line; the end of the key's lines */
} lines_t;

/* Point c at its key's first line. */
static inline void lines_at_key(lines_t *c) {
    c->at = c->kv + c->table[c->key / c->block_size] * c->block_stride + c->key % c->block_size * c->key_bytes +
            c->side * c->side_bytes;
    c->key_end = c->at + c->key_bytes;
}

/* Prefetches the next k lines into L2 (fewer at the span's end). */
static inline void prefetch_some(lines_t *c, int64_t k) {
    for (; k > 0 && c->key < c->end; k--) {
        _mm_prefetch(c->at, _MM_HINT_T1);
        c->at += 64;
        if (c->at < c->key_end) continue;
        const int64_t run_end = c->run_start + c->run < c->end ? c->run_start + c->run : c->end;
        if (++c->key < run_end) {
            if (c->key % c->block_size) { /* the next slot of the block: its lines follow */
                c->key_end += c->key_bytes;
                continue;
            }
        } else if (c->side == 0) { /* the run's values */
            c->side = 1, c->key = c->run_start;
        } else { /* the next run's keys */
            c->side = 0, c->run_start = c->key = run_end;
            if (c->key == c->end) return;
        }
        lines_at_key(c);
    }
}

/* Keys in the tile from key `at`: up to 16, within its block, before `end`, at most `room`. */
static inline int64_t tile_len(int64_t at, int64_t end, int64_t block_size, int64_t room) {
    int64_t k = block_size - at % block_size;
    k = k < 16 ? k : 16;
    k = k < end - at ? k : end - at;
    return k < room ? k : room;
}

/* r[t] (16 lanes of 32 bits each, t < 16) -> r[e]: lane t holds what lane e of r[t] held. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* r[4a + b]: rows 4a..4a+3, elements b, b + 4, b + 8, b + 12 in its four 128-bit lanes */
    for (int a = 0; a < 16; a += 4) {
        r[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
        r[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
        r[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
        r[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int b = 0; b < 4; b++) {
        const __m512i lo = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88), hi = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xdd);
        const __m512i lo2 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
        const __m512i hi2 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xdd);
        t[b] = _mm512_shuffle_i32x4(lo, lo2, 0x88);
        t[b + 8] = _mm512_shuffle_i32x4(lo, lo2, 0xdd);
        t[b + 4] = _mm512_shuffle_i32x4(hi, hi2, 0x88);
        t[b + 12] = _mm512_shuffle_i32x4(hi, hi2, 0xdd);
    }
    for (int e = 0; e < 16; e++) r[e] = t[e];
}

/* The scores of up to 16 keys (rows t < nt, `slot` elements apart from element k0 of the pool)
 * for NH query heads of size D, with the keys, not the elements, in the lanes: a score is a sum of
 * FMAs, with no horizontal sum per key. 16 keys' 32-bit words at a time are transposed in
 * registers (a word: one float32 element, or a pair of bfloat16 ones, widened by a shift and a
 * mask), and each transposed word is multiplied by its query element broadcast from memory. Even
 * and odd elements sum apart, each in element order, then together: the same operations on either
 * pool type, so the two give the same bits. Writes scale * key t's score for head j to
 * s[j * stride + t0 + t] for every t < 16 (rows past nt score 0: a later tile overwrites them),
 * and prefetches `per` lines of pf per word. */
static inline __attribute__((always_inline)) void score_tile(const float *restrict q, const void *kv, int64_t k0,
                                                             int64_t slot, int nt, const int NH, const int D,
                                                             float scale, float *s, int64_t stride, int t0,
                                                             lines_t *pf, int64_t per, const int bf) {
    const int per_word = bf ? 2 : 1, words = D / per_word;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 even[PASS_HEADS], odd[PASS_HEADS];
    for (int j = 0; j < NH; j++) even[j] = odd[j] = _mm512_setzero_ps();
    for (int w0 = 0; w0 < words; w0 += 16) {
        __m512i r[16];
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++)
            r[t] = t < nt ? _mm512_loadu_si512(kv_addr(kv, k0 + t * slot + w0 * per_word, bf)) : _mm512_setzero_si512();
        transpose16(r);
#pragma GCC unroll 16
        for (int e = 0; e < 16; e++) {
            prefetch_some(pf, per);
            const int i = (w0 + e) * per_word; /* the element (bfloat16: the first of the pair) */
            if (bf) {
                const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(r[e], 16));
                const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(r[e], high));
                for (int j = 0; j < NH; j++) {
                    even[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * D + i]), lo, even[j]);
                    odd[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * D + i + 1]), hi, odd[j]);
                }
            } else {
                const __m512 x = _mm512_castsi512_ps(r[e]);
                for (int j = 0; j < NH; j++) {
                    if (i % 2 == 0) even[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * D + i]), x, even[j]);
                    else odd[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * D + i]), x, odd[j]);
                }
            }
        }
    }
    for (int j = 0; j < NH; j++)
        _mm512_storeu_ps(s + j * stride + t0, _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_add_ps(even[j], odd[j])));
}

/* acc[j] += sum over the tile's keys t < nt of p[j * stride + t] * value t, for NH query heads
 * h0 + j of size 16 V, head h's values those of KV head h / group: element (h / group) D of each
 * slot, the slots `slot` elements apart from element v0. Key by key, each KV head's values once
 * for its heads, so the reads go through the slots in address order. Over a bfloat16 pool each 32
 * elements of acc are held as their 16 even ones then their 16 odd ones (a shift and a mask widen
 * them so), put back in order once the span is done. Prefetches `per` lines of pf per key. */
static inline __attribute__((always_inline)) void value_tile(const float *p, int64_t stride, const void *kv,
                                                             int64_t v0, int64_t slot, int nt, float *restrict acc,
                                                             int64_t h0, int64_t group, const int NH, const int V,
                                                             lines_t *pf, int64_t per, const int bf) {
    const int D = 16 * V;
    __m512 a[VALUE_HEADS][8], x[8];
    int64_t off[VALUE_HEADS];
    int fresh[VALUE_HEADS]; /* head j's KV head differs from head j - 1's: load its values */
    for (int j = 0; j < NH; j++) {
        off[j] = (h0 + j) / group * D;
        fresh[j] = j == 0 || off[j] != off[j - 1];
        for (int d = 0; d < V; d++) a[j][d] = _mm512_loadu_ps(acc + j * D + 16 * d);
    }
    for (int t = 0; t < nt; t++) {
        prefetch_some(pf, per);
        for (int j = 0; j < NH; j++) {
            if (fresh[j]) {
                const int64_t v = v0 + t * slot + off[j];
                if (bf)
                    for (int d = 0; d < V; d += 2) {
                        const __m512i w = _mm512_loadu_si512(kv_addr(kv, v + 16 * d, bf));
                        x[d] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                        x[d + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
                    }
                else
                    for (int d = 0; d < V; d++) x[d] = _mm512_loadu_ps((const float *)kv + v + 16 * d);
            }
            const __m512 pj = _mm512_set1_ps(p[j * stride + t]);
            for (int d = 0; d < V; d++) a[j][d] = _mm512_fmadd_ps(pj, x[d], a[j][d]);
        }
    }
    for (int j = 0; j < NH; j++)
        for (int d = 0; d < V; d++) _mm512_storeu_ps(acc + j * D + 16 * d, a[j][d]);
}

/* attend_span for head_dim = 16 * V (V = 4 or 8, a compile-time constant). The span goes in
 * runs of up to RUN_KEYS keys, each cut into tiles of up to 16 keys within a block. A run is
 * scored tile by tile, every head (score_tile, the query heads that share a KV head in passes of
 * up to PASS_HEADS), then one softmax step per head over the whole run (a running max and sum
 * across runs), then its values are summed tile by tile, key by key, in passes of up to
 * VALUE_HEADS query heads of whichever KV heads (value_tile: with SmolLM2's 9 heads two passes
 * over a tile's values, each in address order, where a pass per KV head made three, each 2 lines
 * of every 6: one request, gguf, 1 GB read before each step, 3-4% faster with the two cores apart,
 * 1-2% with them sharing a cache). One softmax step a run, not a block: its max, exp and rescale
 * are a chain of dependent steps per head, which once per 16 keys took most of the time (512
 * keys, one thread: ~27 of 30 us a layer). Tile by tile,
 * every head, reads each tile's keys (then values) in address order. The prefetches run PF_AHEAD
 * lines ahead of those reads (lines_t), a tile's worth a few per word or key while it computes, so
 * the memory streams during the compute: issued all at once they would queue behind the core's few
 * outstanding misses. One tile ahead, restarted at each tile, they stalled at every run's and
 * span's first tile (one request, 512-800 keys, 30 layers after a 512 MB read: 4-7% slower). */
static inline __attribute__((always_inline)) void attend_span_avx512(
    const float *restrict q, const void *kv, int64_t block_stride, int64_t side_stride, const int64_t *table,
    int64_t start, int64_t end, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
    float *restrict acc, float *restrict mx, float *restrict sm, const int V, const int bf) {
    const int64_t D = 16 * V, group = num_heads / num_kv_heads, slot = num_kv_heads * D;
    const int per_pass = PASS_HEADS * 4 / V, words = (int)D / (bf ? 2 : 1);
    const int64_t passes = num_kv_heads * ((group + per_pass - 1) / per_pass);
    int run = (int)(RUN_FLOATS / num_heads) / 16 * 16;
    run = run < 16 ? 16 : run > RUN_KEYS ? RUN_KEYS : run;
    const int64_t stride = run + 16, key_bytes = slot * (bf ? 2 : 4), lines_per_key = (key_bytes + 63) / 64;
    const int value_heads = V == 4 ? VALUE_HEADS : 2;
    const int64_t sweeps = (num_heads + value_heads - 1) / value_heads, per_value = (lines_per_key + sweeps - 1) / sweeps;
    float s[RUN_FLOATS + 16 * MAX_HEADS] __attribute__((aligned(64)));
    int64_t tile_at[RUN_KEYS]; /* a tile's first key, in elements of the pool */
    int tile_keys[RUN_KEYS], tile_first[RUN_KEYS];
    lines_t pf = {(const char *)kv, table, block_stride * (bf ? 2 : 4), side_stride * (bf ? 2 : 4), key_bytes,
                  block_size, end, run, start, start, 0, 0, 0};
    lines_at_key(&pf);
    prefetch_some(&pf, PF_AHEAD);
    for (int64_t h = 0; h < num_heads; h++) {
        mx[h] = -INFINITY;
        sm[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num_heads * D);
#define EACH_PASS(CALL)                                                                                   \
    for (int64_t g = 0; g < num_kv_heads; g++)                                                            \
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += per_pass) {                              \
            const int nh = (g + 1) * group - h0 < per_pass ? (int)((g + 1) * group - h0) : per_pass;      \
            switch (nh) { /* the heads a compile-time count, so their sums stay in registers */           \
            case 1: CALL(1); break;                                                                       \
            case 2: CALL(2); break;                                                                       \
            case 3: if (V == 4) CALL(3); break;                                                           \
            default: if (V == 4) CALL(4); break;                                                          \
            }                                                                                             \
        }
    for (int64_t pos = start; pos < end;) {
        int num_tiles = 0, n = 0; /* this run's tiles and keys */
        int64_t at = pos;
        for (; at < end && n < run; num_tiles++) {
            const int64_t k = tile_len(at, end, block_size, run - n);
            tile_at[num_tiles] = table[at / block_size] * block_stride + at % block_size * slot;
            tile_keys[num_tiles] = (int)k;
            tile_first[num_tiles] = n;
            n += (int)k;
            at += k;
        }
        for (int i = 0; i < num_tiles; i++) { /* scores; the prefetches a tile's lines further on */
            const int64_t per = (tile_keys[i] * lines_per_key + passes * words - 1) / (passes * words);
#define SCORE(NH) score_tile(q + h0 * D, kv, tile_at[i] + g * D, slot, tile_keys[i], NH, (int)D, scale, \
                             s + h0 * stride, stride, tile_first[i], &pf, per, bf)
            EACH_PASS(SCORE)
#undef SCORE
        }
        for (int64_t h = 0; h < num_heads; h++) { /* the run's softmax step */
            float *sh = s + h * stride;
            __m512 vm = _mm512_set1_ps(mx[h]);
            for (int t = 0; t < n; t += 16) {
                const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
                vm = _mm512_mask_max_ps(vm, live, vm, _mm512_loadu_ps(sh + t));
            }
            const float m = _mm512_reduce_max_ps(vm);
            __m512 sum = _mm512_setzero_ps();
            for (int t = 0; t < n; t += 16) {
                const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
                const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sh + t), _mm512_set1_ps(m)));
                _mm512_storeu_ps(sh + t, e);
                sum = _mm512_mask_add_ps(sum, live, sum, e);
            }
            const float correction = exp_nonpositive(mx[h] - m); /* ~0 on the first run */
            mx[h] = m;
            sm[h] = sm[h] * correction + _mm512_reduce_add_ps(sum);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(acc + h * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + d), _mm512_set1_ps(correction)));
        }
        for (int i = 0; i < num_tiles; i++) /* values; the prefetches as for the scores */
            for (int64_t h0 = 0; h0 < num_heads; h0 += value_heads) {
                const int nh = num_heads - h0 < value_heads ? (int)(num_heads - h0) : value_heads;
#define VALUE(NH) value_tile(s + h0 * stride + tile_first[i], stride, kv, tile_at[i] + side_stride, slot, tile_keys[i], \
                             acc + h0 * D, h0, group, NH, V, &pf, per_value, bf)
                switch (nh) { /* the heads a compile-time count, so their sums stay in registers */
                case 1: VALUE(1); break;
                case 2: VALUE(2); break;
                case 3: if (V == 4) VALUE(3); break;
                case 4: if (V == 4) VALUE(4); break;
                case 5: if (V == 4) VALUE(5); break;
                default: if (V == 4) VALUE(6); break;
                }
#undef VALUE
            }
        pos += n;
    }
#undef EACH_PASS
    if (bf) /* acc's elements back in order */
        for (int64_t i = 0; i < num_heads * D; i += 32) {
            const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
            const __m512 even = _mm512_loadu_ps(acc + i), odd = _mm512_loadu_ps(acc + i + 16);
            _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(even, lo, odd));
            _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(even, hi, odd));
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

/* Keys per span of a row of `ctx` keys where the spans are batch-invariant: a function of the row's
 * own length, so its result does not depend on the batch. An even number of equal spans (whole
 * blocks) of at most SPAN_FIXED_KEYS, so that two threads share a request alone evenly (spans of
 * 256 left one thread 512 keys and the other 288 at 800: one request, 30 layers after a 512 MB
 * read, 0.88 -> 0.82 ms); one span for a short row. */
static int64_t row_span(int64_t ctx, int64_t block_size) {
    const int64_t parts = ctx <= SPAN_ONE_KEYS ? 1 : 2 * ((ctx + 2 * SPAN_FIXED_KEYS - 1) / (2 * SPAN_FIXED_KEYS));
    const int64_t span = (ctx + parts - 1) / parts;
    return (span + block_size - 1) / block_size * block_size;
}

/* The work items of a step: row r's are items [first[r], first[r + 1]), spans[r] keys each (the last
 * one fewer). Spans cut for `span_threads` threads, or batch-invariant where it is 0 (see
 * paged_decode_attention_spans). first: [num_rows + 1], spans: [num_rows]; returns the item count. */
int64_t decode_attention_plan(const int64_t *ctx_lens, int64_t num_rows, int64_t block_size, int span_threads,
                              int64_t *first, int64_t *spans) {
    /* Cut for the batch: whole blocks, about SPANS_PER_THREAD items per thread over the batch (one
     * for a request alone, which shares evenly without them). */
    int64_t span = 0;
    if (span_threads > 0) {
        int64_t total = 0;
        for (int64_t r = 0; r < num_rows; r++) total += ctx_lens[r];
        const int64_t items = (int64_t)span_threads * (num_rows > 1 ? SPANS_PER_THREAD : 1);
        span = (total + items - 1) / items;
        span = span > SPAN_MIN_KEYS ? span : SPAN_MIN_KEYS;
        span = (span + block_size - 1) / block_size * block_size;
    }
    first[0] = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        spans[r] = span ? span : row_span(ctx_lens[r], block_size);
        first[r + 1] = first[r] + (ctx_lens[r] + spans[r] - 1) / spans[r];
    }
    return first[num_rows];
}

/* The row whose items include item i (first as decode_attention_plan fills it). */
static int64_t item_row(const int64_t *first, int64_t num_rows, int64_t i) {
    int64_t lo = 0, hi = num_rows - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Every thread of a team calls it: the items shared out, then each row's partial softmaxes merged
 * into out, by the row shared out where `own_out` is 0, else each thread every row into its own out
 * (the fused decode step's threads each keep a copy: no second meeting). part: per item its acc
 * [H, D], max [H] and sum [H]. */
static void attention_share(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16, int64_t block_stride,
                            int64_t side_stride, const int64_t *block_ids, int64_t max_blocks, const int64_t *ctx_lens,
                            const int64_t *first, const int64_t *spans, float *part, float *out, int own_out,
                            int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale) {
    const int64_t part_size = num_heads * (head_dim + 2);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < first[num_rows]; i++) {
        const int64_t r = item_row(first, num_rows, i), start = (i - first[r]) * spans[r];
        const int64_t end = start + spans[r] < ctx_lens[r] ? start + spans[r] : ctx_lens[r];
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
    const int64_t t = own_out ? 0 : omp_get_thread_num(), nt = own_out ? 1 : omp_get_num_threads();
    for (int64_t r = num_rows * t / nt; r < num_rows * (t + 1) / nt; r++) {
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

/* paged_decode_attention_spans with its items planned (decode_attention_plan) and `part` scratch
 * for num_heads * (head_dim + 2) floats an item. Called inside a parallel region (decode_step.c),
 * every thread of the team calls it, each with its own `out`, which it returns complete; elsewhere
 * it runs on num_threads threads of its own. */
void decode_attention_planned(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16, int64_t block_stride,
                              int64_t side_stride, const int64_t *block_ids, int64_t max_blocks,
                              const int64_t *ctx_lens, const int64_t *first, const int64_t *spans, float *part,
                              float *out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int num_threads) {
    const int team = omp_in_parallel();
    ON_TEAM(num_threads, attention_share(q, q_row_stride, kv, kv_bf16, block_stride, side_stride, block_ids, max_blocks,
                                         ctx_lens, first, spans, part, out, team, num_rows, num_heads, num_kv_heads,
                                         head_dim, block_size, scale));
}

/* q: [R, H, D] rows `q_row_stride` floats apart (heads contiguous); out: [R, H, D] contiguous.
 * kv: the layer's view of a float32 pool, or of a bfloat16 one where kv_bf16 (strides in elements).
 * block_ids: [R, max_blocks]; ctx_lens: [R] keys per request (the new token's included, >= 1).
 * The spans are cut for `span_threads` threads and run on `num_threads`: the result depends on the
 * first only, so a caller may run it on fewer threads than it was cut for. span_threads 0: each
 * row's spans by its own length (row_span) whatever the batch, so its result depends on its own
 * query and keys alone (batch-invariant: a query gets the same bits decoded alone, beside others,
 * or as a row of a prefill chunk). Returns 0, or -1 (out untouched) without memory for its scratch. */
int paged_decode_attention_spans(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16,
                                  int64_t block_stride, int64_t side_stride, const int64_t *block_ids,
                                  int64_t max_blocks, const int64_t *ctx_lens, float *out, int64_t num_rows,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int span_threads, int num_threads) {
    int64_t *first = malloc(sizeof(int64_t) * (2 * num_rows + 1)), *spans = first + num_rows + 1;
    float *part = 0;
    if (first) {
        const int64_t num_items = decode_attention_plan(ctx_lens, num_rows, block_size, span_threads, first, spans);
        part = malloc(sizeof(float) * num_heads * (head_dim + 2) * num_items);
    }
    if (!part) {
        free(first);
        return -1;
    }
    decode_attention_planned(q, q_row_stride, kv, kv_bf16, block_stride, side_stride, block_ids, max_blocks, ctx_lens,
                             first, spans, part, out, num_rows, num_heads, num_kv_heads, head_dim, block_size, scale,
                             num_threads);
    free(part);
    free(first);
    return 0;
}
