/* Native CPU kernels for the worker's float32 forward (services/worker/cpu_kernels.py).
 *
 * Paged decode attention, straight from the block-first KV pool.
 *
 * Each single-token query reads its request's keys and values where they lie, block by block,
 * once: no gathered copy of the context (the torch path copies it, then SDPA reads the copy),
 * one pass with a running softmax per block. Work is split over (request, KV head) pairs on
 * torch's own OpenMP threads (this library links the libgomp torch has already loaded).
 *
 * Layout (services/worker/attention.py has the diagram): a layer's view of the pool is
 *   kv[block * block_stride + side * side_stride + slot * KV * D + kv_head * D + d]
 * with side 0 = K, 1 = V. The G = H / KV query heads of a KV head share its keys.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

int paged_attention_limits(int64_t *group, int64_t *head_dim, int64_t *block_size) {
    *group = MAX_GROUP;
    *head_dim = MAX_HEAD_DIM;
    *block_size = MAX_BLOCK;
    return 0;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* q: [R, H, D] rows `q_row_stride` floats apart (heads contiguous); out: [R, H, D] contiguous.
 * block_ids: [R, max_blocks]; ctx_lens: [R] keys per request (the new token's included). */
void paged_decode_attention_f32(const float *q, int64_t q_row_stride, const float *kv, int64_t block_stride,
                                int64_t side_stride, const int64_t *block_ids, int64_t max_blocks,
                                const int64_t *ctx_lens, float *out, int64_t num_rows, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_rows; r++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const float *qh = q + r * q_row_stride + h * group * head_dim; /* [G, D] */
            float acc[MAX_GROUP][MAX_HEAD_DIM];
            float run_max[MAX_GROUP], run_sum[MAX_GROUP];
            float scores[MAX_GROUP][MAX_BLOCK];
            for (int64_t g = 0; g < group; g++) {
                memset(acc[g], 0, sizeof(float) * head_dim);
                run_max[g] = -INFINITY;
                run_sum[g] = 0.0f;
            }
            const int64_t ctx = ctx_lens[r];
            const int64_t *table = block_ids + r * max_blocks;
            for (int64_t start = 0; start < ctx; start += block_size) {
                const int64_t n = ctx - start < block_size ? ctx - start : block_size;
                const float *kb = kv + table[start / block_size] * block_stride + h * head_dim;
                const float *vb = kb + side_stride;
                for (int64_t g = 0; g < group; g++) {
                    float m = run_max[g];
                    for (int64_t t = 0; t < n; t++) {
                        scores[g][t] = scale * dot(qh + g * head_dim, kb + t * slot_stride, head_dim);
                        m = scores[g][t] > m ? scores[g][t] : m;
                    }
                    const float correction = expf(run_max[g] - m);
                    run_max[g] = m;
                    run_sum[g] *= correction;
                    float *a = acc[g];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) a[d] *= correction;
                    for (int64_t t = 0; t < n; t++) {
                        const float p = expf(scores[g][t] - m);
                        const float *v = vb + t * slot_stride;
                        run_sum[g] += p;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
                    }
                }
            }
            float *o = out + (r * num_heads + h * group) * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float inv = 1.0f / run_sum[g];
                for (int64_t d = 0; d < head_dim; d++) o[g * head_dim + d] = acc[g][d] * inv;
            }
        }
    }
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

/* gate_up: [T, 2n] (gate columns, then up columns) -> out: [T, n] = silu(gate) * up. */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t num_rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
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
