/* Every transformer layer of a decode step in one call (services/worker/fused_decode.py).
 *
 * A step of single-token queries at batch 1 spends a few microseconds per layer in each native
 * kernel and as long again getting there from Python (a ctypes call, an output tensor, a module
 * dispatch), ten times a layer. This driver calls the same kernels in the same order with the
 * same arguments as the layer-by-layer path (model.py's DecoderLayer), so the result is the same
 * to the bit; only the trips through Python are gone.
 *
 * Per layer (T rows, hidden n, H query heads, KV heads, head size D, MLP width I):
 *   h    = rms_norm(x) * in_norm                 add_rms_norm_f32 (x += down of the layer before)
 *   qkv  = h . Wqkv^T (+ b)         [T, (H + 2 KV) D]
 *   rope on q and k, in place; k and v into their slots of the pool
 *   a    = decode attention(q)      [T, H D]       paged_decode_attention_spans
 *   x   += a . Wo^T; h = rms_norm(x) * post_norm   add_rms_norm_f32
 *   down = silu(h . Wg^T) * (h . Wu^T) . Wd^T     silu_and_mul_f32, or in gate_up's matmul (flag 2)
 * and x += down after the last layer. Each matmul is one of the library's linear kernels, named
 * per layer by its address (the kernel the layer-by-layer path would pick for T rows).
 */
#include "kernels.h"

void add_rms_norm_f32(float *x, const float *delta, const float *w, float eps, float *out, int64_t num_rows,
                      int64_t n, int num_threads);
void rope_f32(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t num_rows, int64_t num_heads,
              int64_t head_dim, int num_threads);
void silu_and_mul_f32(const float *gate_up, float *out, int64_t num_rows, int64_t n, int num_threads);
void write_kv_f32(const float *k, const float *v, int64_t row_stride, void *kv, int bf, int64_t block_stride,
                  int64_t side_stride, const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t num_rows,
                  int64_t width);
void paged_decode_attention_spans(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16,
                                  int64_t block_stride, int64_t side_stride, const int64_t *block_ids,
                                  int64_t max_blocks, const int64_t *ctx_lens, float *out, int64_t num_rows,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int span_threads, int num_threads);

typedef int (*linear_status_fn)(const float *, int64_t, const void *, const float *, float *, int64_t, int64_t,
                                int64_t, int64_t, int);
typedef void (*linear_void_fn)(const float *, int64_t, const void *, const float *, float *, int64_t, int64_t,
                               int64_t, int64_t, int);

/* Words per layer descriptor: in_norm, post_norm, then per matmul (qkv, o, gate_up, down) its
 * kernel's address, flags (1: the kernel returns a status, else void; 2: it writes silu(gate) * up,
 * N / 2 columns), the packed weight, the bias (0: none). */
#define LAYER_WORDS 18
/* dims: T, hidden, H, KV, D, I, block_size, layer_stride, block_stride, side_stride, max_blocks,
 * kv_bf16 (the pool's strides in elements; 1 where they are bfloat16, else float32) */
#define NUM_DIMS 12

static int matmul(const int64_t *lin, const float *x, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t ldy = lin[1] & 2 ? N / 2 : N;
    if (lin[1] & 1)
        return ((linear_status_fn)lin[0])(x, K, (const void *)lin[2], (const float *)lin[3], y, ldy, M, N, K, threads);
    ((linear_void_fn)lin[0])(x, K, (const void *)lin[2], (const float *)lin[3], y, ldy, M, N, K, threads);
    return 0;
}

/* x: [T, n] the residual stream (updated in place); cos, sin: [T, D / 2]; kv: the pool,
 * [blocks, layers, 2, block_size, KV, D] with the strides and element type in dims; slot_blocks, slot_offsets: [T];
 * block_ids: [T, max_blocks]; ctx_lens: [T]. Runs on `threads` threads; the attention's spans are
 * cut for `span_threads` (the layer-by-layer path's count; 0: batch-invariant spans), and nothing
 * else depends on the count,
 * so the result is the same on any number of threads. Returns 0, or -1 without memory for the scratch or
 * a matmul's own (the pool may then hold some of this step's K/V: a re-run writes them again). */
int decode_layers_f32(const int64_t *layers, int64_t num_layers, const int64_t *dims, float *x, const float *cos,
                      const float *sin, void *kv, const int64_t *slot_blocks, const int64_t *slot_offsets,
                      const int64_t *block_ids, const int64_t *ctx_lens, float eps, float scale, int span_threads,
                      int threads) {
    const int64_t T = dims[0], n = dims[1], H = dims[2], KV = dims[3], D = dims[4], I = dims[5];
    const int64_t block_size = dims[6], layer_stride = dims[7], block_stride = dims[8], side_stride = dims[9];
    const int64_t max_blocks = dims[10], nqkv = (H + 2 * KV) * D;
    const int bf = (int)dims[11];
    float *h = malloc(sizeof(float) * T * (n + nqkv + H * D + n + 2 * I + I));
    if (!h) return -1;
    float *qkv = h + T * n, *attn = qkv + T * nqkv, *out = attn + T * H * D, *gu = out + T * n, *act = gu + T * 2 * I;
    int failed = 0;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const int64_t *w = layers + l * LAYER_WORDS;
        char *kv_layer = (char *)kv + l * layer_stride * (bf ? 2 : 4);
        add_rms_norm_f32(x, l ? out : 0, (const float *)w[0], eps, h, T, n, threads);
        failed |= matmul(w + 2, h, qkv, T, nqkv, n, threads);
        rope_f32(qkv, nqkv, cos, sin, T, H + KV, D, threads);
        write_kv_f32(qkv + H * D, qkv + (H + KV) * D, nqkv, kv_layer, bf, block_stride, side_stride, slot_blocks,
                     slot_offsets, T, KV * D);
        paged_decode_attention_spans(qkv, nqkv, kv_layer, bf, block_stride, side_stride, block_ids, max_blocks,
                                     ctx_lens, attn, T, H, KV, D, block_size, scale, span_threads, threads);
        failed |= matmul(w + 6, attn, out, T, n, H * D, threads);
        add_rms_norm_f32(x, out, (const float *)w[1], eps, h, T, n, threads);
        if (w[11] & 2) failed |= matmul(w + 10, h, act, T, 2 * I, n, threads);
        else {
            failed |= matmul(w + 10, h, gu, T, 2 * I, n, threads);
            silu_and_mul_f32(gu, act, T, I, threads);
        }
        failed |= matmul(w + 14, act, out, T, n, I, threads);
    }
    if (!failed)
        for (int64_t i = 0; i < T * n; i++) x[i] += out[i];
    free(h);
    return failed ? -1 : 0;
}
