#include "kernels.h"

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

/* S^T[t][rows] = scale * K[t] . Q^T for T keys (T a compile-time constant), K[0] at element kt of
 * the pool (float32, or bfloat16 where bf). */
static inline __attribute__((always_inline)) void pf_scores(const void *kv, int64_t kt, int64_t slot,
                                                           const float *restrict qt, int64_t D, float scale,
                                                           float *restrict st, const int T, const int bf) {
    __m512 acc[PF_KEYS][PF_X];
    for (int t = 0; t < T; t++)
        for (int x = 0; x < PF_X; x++) acc[t][x] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 qv[PF_X];
        for (int x = 0; x < PF_X; x++) qv[x] = _mm512_load_ps(qt + d * PF_ROWS + 16 * x);
        for (int t = 0; t < T; t++) {
            const __m512 k = _mm512_set1_ps(kv_at(kv, kt + t * slot + d, bf));
            for (int x = 0; x < PF_X; x++) acc[t][x] = _mm512_fmadd_ps(k, qv[x], acc[t][x]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int t = 0; t < T; t++)
        for (int x = 0; x < PF_X; x++) _mm512_store_ps(st + t * PF_ROWS + 16 * x, _mm512_mul_ps(acc[t][x], s));
}

/* O^T[d] = O^T[d] * corr + sum_t V[t][d] P^T[t] for the head's elements, PF_KEYS at a time; V[0] at
 * element vt of the pool. */
static inline __attribute__((always_inline)) void pf_values(const void *kv, int64_t vt, int64_t slot,
                                                           const float *restrict pt, int64_t n, int64_t D,
                                                           const __m512 *corr, float *restrict ot, const int bf) {
    for (int64_t d0 = 0; d0 < D; d0 += PF_KEYS) {
        __m512 acc[PF_KEYS][PF_X];
        for (int e = 0; e < PF_KEYS; e++)
            for (int x = 0; x < PF_X; x++)
                acc[e][x] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + e) * PF_ROWS + 16 * x), corr[x]);
        for (int64_t t = 0; t < n; t++) {
            __m512 p[PF_X];
            for (int x = 0; x < PF_X; x++) p[x] = _mm512_load_ps(pt + t * PF_ROWS + 16 * x);
            for (int e = 0; e < PF_KEYS; e++) {
                const __m512 v = _mm512_set1_ps(kv_at(kv, vt + t * slot + d0 + e, bf));
                for (int x = 0; x < PF_X; x++) acc[e][x] = _mm512_fmadd_ps(v, p[x], acc[e][x]);
            }
        }
        for (int e = 0; e < PF_KEYS; e++)
            for (int x = 0; x < PF_X; x++) _mm512_store_ps(ot + (d0 + e) * PF_ROWS + 16 * x, acc[e][x]);
    }
}

#ifdef __AVX512BF16__
/* The same two products on vdpbf16ps, for a bfloat16 pool: each instruction sums two products
 * into each lane, so a pass is half the instructions. S^T[t] += K[t][d, d+1] . Q^T[d, d+1] with the
 * queries rounded to bfloat16 once per tile, held as pairs of elements, QP^T [D / 2][rows], and the
 * key's pair one 32-bit broadcast straight from the pool. O^T[d] += V[t, t+1][d] . P^T[t, t+1] with
 * the probabilities rounded to bfloat16 in pairs of keys, PP^T [n / 2][rows], and the values' pairs
 * from the chunk's V interleaved key by key, VP [n / 2][D] (the odd last key paired with a zero).
 * Products are exact in float32 and summed there; the running softmax (max, sum, correction) stays
 * in float32 over float32 scores: only Q and P are rounded, as a bfloat16 model holds them. */
static inline __attribute__((always_inline)) void pf_scores_bf16(const uint16_t *kv, int64_t kt, int64_t slot,
                                                                const uint32_t *restrict qp, int64_t D,
                                                                float scale, float *restrict st, const int T) {
    __m512 acc[PF_KEYS][PF_X];
    for (int t = 0; t < T; t++)
        for (int x = 0; x < PF_X; x++) acc[t][x] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D / 2; d++) {
        __m512bh qv[PF_X];
        for (int x = 0; x < PF_X; x++) qv[x] = (__m512bh)_mm512_load_si512(qp + d * PF_ROWS + 16 * x);
        for (int t = 0; t < T; t++) {
            uint32_t pair;
            memcpy(&pair, kv + kt + t * slot + 2 * d, sizeof pair);
            const __m512bh k = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int x = 0; x < PF_X; x++) acc[t][x] = _mm512_dpbf16_ps(acc[t][x], qv[x], k);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int t = 0; t < T; t++)
        for (int x = 0; x < PF_X; x++) _mm512_store_ps(st + t * PF_ROWS + 16 * x, _mm512_mul_ps(acc[t][x], s));
}

/* PP^T and VP for the n keys of a chunk (V[0] at element vt of the pool), then O^T as pf_values. */
static inline __attribute__((always_inline)) void pf_values_bf16(const uint16_t *kv, int64_t vt, int64_t slot,
                                                                const float *restrict pt, int64_t n, int64_t D,
                                                                const __m512 *corr, float *restrict ot,
                                                                uint32_t *restrict pp, uint32_t *restrict vp) {
    const int64_t pairs = (n + 1) / 2;
    /* word j of a 32-word vector from a (words 0-15) and b (words 16-31): a[j / 2] or b[j / 2] */
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t j = 0; j < pairs; j++) {
        const int two = 2 * j + 1 < n; /* else the last key, with a zero */
        for (int x = 0; x < PF_X; x++) {
            const __m512 a = _mm512_load_ps(pt + 2 * j * PF_ROWS + 16 * x);
            const __m512 b = two ? _mm512_load_ps(pt + (2 * j + 1) * PF_ROWS + 16 * x) : _mm512_setzero_ps();
            const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a in words 0-15, b in 16-31 */
            _mm512_store_si512(pp + j * PF_ROWS + 16 * x, _mm512_permutexvar_epi16(zip, ab));
        }
        const uint16_t *v0 = kv + vt + 2 * j * slot, *v1 = v0 + slot;
        for (int64_t d = 0; d < D; d += 16) { /* 16 elements of each key, the last group masked */
            const __mmask16 live = D - d >= 16 ? 0xffff : (__mmask16)((1u << (D - d)) - 1);
            const __m256i a = _mm256_maskz_loadu_epi16(live, v0 + d);
            const __m256i b = two ? _mm256_maskz_loadu_epi16(live, v1 + d) : _mm256_setzero_si256();
            const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
            _mm512_mask_storeu_epi32(vp + j * D + d, live, _mm512_permutexvar_epi16(zip, ab));
        }
    }
    for (int64_t d0 = 0; d0 < D; d0 += PF_KEYS) {
        __m512 acc[PF_KEYS][PF_X];
        for (int e = 0; e < PF_KEYS; e++)
            for (int x = 0; x < PF_X; x++)
                acc[e][x] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + e) * PF_ROWS + 16 * x), corr[x]);
        for (int64_t j = 0; j < pairs; j++) {
            __m512bh p[PF_X];
            for (int x = 0; x < PF_X; x++) p[x] = (__m512bh)_mm512_load_si512(pp + j * PF_ROWS + 16 * x);
            for (int e = 0; e < PF_KEYS; e++) {
                const __m512bh v = (__m512bh)_mm512_set1_epi32((int)vp[j * D + d0 + e]);
                for (int x = 0; x < PF_X; x++) acc[e][x] = _mm512_dpbf16_ps(acc[e][x], p[x], v);
            }
        }
        for (int e = 0; e < PF_KEYS; e++)
            for (int x = 0; x < PF_X; x++) _mm512_store_ps(ot + (d0 + e) * PF_ROWS + 16 * x, acc[e][x]);
    }
}
#endif

/* 1 where paged_prefill_attention_f32 can run its products in bfloat16 (bf16_products). */
int prefill_bf16_products(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* q: [q_len, H, D] rows `q_row_stride` floats apart (heads contiguous), the chunk's queries at
 * positions num_cached .. num_cached + q_len - 1; kv: the layer's view of a float32 pool, or of a
 * bfloat16 one where kv_bf16 (strides in elements); table: the request's blocks (covering them);
 * out: [q_len, H, D] contiguous. head_dim a multiple of PF_KEYS; H / KV <= PF_ROWS. bf16_products
 * (a bfloat16 pool, where prefill_bf16_products()): both products on vdpbf16ps, Q and P rounded to
 * bfloat16; otherwise float32 arithmetic, the same to the bit over a pool of either type. Returns 0,
 * or -1 (out incomplete) where a thread found no memory for its tiles. */
int paged_prefill_attention_f32(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16, int64_t block_stride,
                                 int64_t side_stride, const int64_t *table, int64_t num_cached, int64_t q_len,
                                 float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int bf16_products, int num_threads) {
    const int64_t D = head_dim, group = num_heads / num_kv_heads, slot = num_kv_heads * D;
    const int64_t qt_len = PF_ROWS / group; /* positions per tile */
    const int64_t num_tiles = (q_len + qt_len - 1) / qt_len, num_items = num_tiles * num_kv_heads;
#ifndef __AVX512BF16__
    bf16_products = 0;
#endif
    bf16_products = bf16_products && kv_bf16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *qt = aligned_alloc(64, sizeof(float) * D * PF_ROWS);
        float *ot = aligned_alloc(64, sizeof(float) * D * PF_ROWS);
        float *st = aligned_alloc(64, sizeof(float) * CHUNK * PF_ROWS);
        /* bf16_products: QP^T in qt's first half; PP^T and VP */
        uint32_t *pp = aligned_alloc(64, sizeof(uint32_t) * (CHUNK / 2) * PF_ROWS);
        uint32_t *vp = aligned_alloc(64, sizeof(uint32_t) * (CHUNK / 2) * D);
        int32_t pos[PF_ROWS] __attribute__((aligned(64)));
        failed = !(qt && ot && st && pp && vp); /* its items then stay undone */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (failed) continue;
            /* The last tiles (the most keys) first, so the short ones fill in at the end. */
            const int64_t tile = num_tiles - 1 - item / num_kv_heads, g = item % num_kv_heads;
            const int64_t i0 = tile * qt_len, n_pos = q_len - i0 < qt_len ? q_len - i0 : qt_len;
            const int64_t used = n_pos * group; /* rows past it repeat the last one, never written */
            for (int64_t r = 0; r < PF_ROWS; r++) {
                const int64_t rr = r < used ? r : used - 1, i = i0 + rr / group, h = g * group + rr % group;
                pos[r] = (int32_t)(num_cached + i);
                const float *qr = q + i * q_row_stride + h * D;
                if (bf16_products) { /* pairs of bfloat16, rounded to nearest even */
                    uint32_t *qp = (uint32_t *)qt;
                    for (int64_t d = 0; d < D; d += 2)
                        qp[d / 2 * PF_ROWS + r] = float_to_bf16(qr[d]) | (uint32_t)float_to_bf16(qr[d + 1]) << 16;
                } else
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
                const int64_t kb = chunk_at(block_stride, table, p, end, block_size, slot, &n) + g * D;
                const int64_t vb = kb + side_stride;
                int64_t t = 0;
#ifdef __AVX512BF16__
                if (bf16_products) {
                    for (; t + PF_KEYS <= n; t += PF_KEYS)
                        pf_scores_bf16(kv, kb + t * slot, slot, (const uint32_t *)qt, D, scale, st + t * PF_ROWS, PF_KEYS);
                    for (; t < n; t++)
                        pf_scores_bf16(kv, kb + t * slot, slot, (const uint32_t *)qt, D, scale, st + t * PF_ROWS, 1);
                }
#endif
#define SCORES(T, BF) pf_scores(kv, kb + t * slot, slot, qt, D, scale, st + t * PF_ROWS, T, BF)
                if (!bf16_products) {
                    for (; t + PF_KEYS <= n; t += PF_KEYS)
                        if (kv_bf16) SCORES(PF_KEYS, 1); else SCORES(PF_KEYS, 0);
                    for (; t < n; t++)
                        if (kv_bf16) SCORES(1, 1); else SCORES(1, 0);
                }
#undef SCORES
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
#ifdef __AVX512BF16__
                if (bf16_products) pf_values_bf16(kv, vb, slot, st, n, D, corr, ot, pp, vp);
                else
#endif
                if (kv_bf16) pf_values(kv, vb, slot, st, n, D, corr, ot, 1);
                else pf_values(kv, vb, slot, st, n, D, corr, ot, 0);
                p += n;
            }
            float inv[PF_ROWS] __attribute__((aligned(64)));
            for (int x = 0; x < PF_X; x++) _mm512_store_ps(inv + 16 * x, _mm512_div_ps(_mm512_set1_ps(1.0f), sm[x]));
            for (int64_t r = 0; r < used; r++) {
                float *o = out + ((i0 + r / group) * num_heads + g * group + r % group) * D;
                for (int64_t d = 0; d < D; d++) o[d] = ot[d * PF_ROWS + r] * inv[r];
            }
        }
        free(vp);
        free(pp);
        free(st);
        free(ot);
        free(qt);
    }
    return failed ? -1 : 0;
}
#endif
