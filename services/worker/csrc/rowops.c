/* Per-row elementwise ops, KV stores and KV block copies (services/worker/cpu_kernels.py). */
#include "kernels.h"

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

/* The rotary angles of each position: cos[r, i] = cos(positions[r] * inv_freq[i]), sin likewise,
 * [T, half] each, the angle rounded to float32 first as model.rope_cos_sin's is. Scalar cosf and
 * sinf (glibc's, within an ulp): the layers and the fused decode step (decode_step.c) both take
 * their angles from here, so the two give the same bits. */
void rope_angles_f32(const int64_t *positions, int64_t num_rows, const float *inv_freq, int64_t half, float *cos,
                     float *sin) {
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t i = 0; i < half; i++) {
            const float a = (float)positions[r] * inv_freq[i];
            cos[r * half + i] = cosf(a);
            sin[r * half + i] = sinf(a);
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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* silu_mul (kernels.h) on 8 lanes, its operations one for one (the compiler fuses its multiply-adds
 * as these do), so the same bits: the scalar loop does not vectorise (`superinfer bench prefill`
 * shows what it cost). */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 x = _mm256_max_ps(_mm256_min_ps(g, _mm256_sub_ps(_mm256_setzero_ps(), g)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e))), u);
}
#endif

/* gate_up: [T, 2n] (gate columns, then up columns) -> out: [T, n] = silu(gate) * up (kernels.h). */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t num_rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
        for (; i < n; i++) o[i] = silu_mul(g[i], u[i]);
    }
}

/* ------------------------------------------------------------ KV stores
 * A step's new keys and values into their slots of a layer's view of the pool, rounded to
 * bfloat16 as torch rounds where the pool holds bfloat16. On the calling thread: the 30 layers'
 * stores of a 512-token prefill into a bfloat16 pool took 1.65 ms, against 3.90 ms for torch's
 * conversion and index_put (same process, alternating). */

static void store_kv(void *kv, int64_t i, const float *x, int64_t n, int bf) {
    if (!bf) {
        memcpy((float *)kv + i, x, sizeof(float) * n);
        return;
    }
    uint16_t *dst = (uint16_t *)kv + i;
    for (int64_t j = 0; j < n; j++) dst[j] = float_to_bf16(x[j]);
}

/* k, v: [T, width] rows `row_stride` floats apart (width = KV heads x head size, contiguous);
 * kv: a layer's view of the pool, [blocks, 2, block_size, width] with the block and side strides
 * in elements; row t goes to slot slot_offsets[t] of block slot_blocks[t]. */
void write_kv_f32(const float *k, const float *v, int64_t row_stride, void *kv, int bf, int64_t block_stride,
                  int64_t side_stride, const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t num_rows,
                  int64_t width) {
    for (int64_t t = 0; t < num_rows; t++) {
        const int64_t slot = slot_blocks[t] * block_stride + slot_offsets[t] * width;
        store_kv(kv, slot, k + t * row_stride, width, bf);
        store_kv(kv, slot + side_stride, v + t * row_stride, width, bf);
    }
}

/* ------------------------------------------------------------ greedy picks */

/* x: [T, n] contiguous; out[r] = the first index of row r's largest value, a NaN counting as
 * larger than any number (torch's argmax). One pass for the maximum, one that stops at its
 * first occurrence: torch's argmax carries an index per lane and took ~45 us a 49K-id row. */
void argmax_rows_f32(const float *x, int64_t num_rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < num_rows; r++) {
        const float *xr = x + r * n;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < n; i++) {
            m = xr[i] > m ? xr[i] : m;
            nan |= xr[i] != xr[i];
        }
        int64_t i = 0;
        if (nan)
            while (xr[i] == xr[i]) i++;
        else
            while (i < n - 1 && xr[i] != m) i++; /* m is in the row; the bound only guards */
        out[r] = i;
    }
}

/* ------------------------------------------------------------ KV block copies
 * One memcpy per block on the calling (transfer) thread: no OpenMP team. Another team beside
 * the compute thread's would make libgomp count more threads than cores and stop spinning,
 * which makes every parallel region of the forward wait for a futex wake-up. */

void copy_blocks(const char *src, char *dst, int64_t block_bytes, const int64_t *src_ids, const int64_t *dst_ids,
                 int64_t num_pairs) {
    for (int64_t i = 0; i < num_pairs; i++)
        memcpy(dst + dst_ids[i] * block_bytes, src + src_ids[i] * block_bytes, (size_t)block_bytes);
}
