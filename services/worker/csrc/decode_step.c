/* A whole decode step in one call (services/worker/fused_decode.py).
 *
 * A step of single-token queries at batch 1 spends a few microseconds per layer in each native
 * kernel and as long again getting there from Python (a ctypes call, an output tensor, a module
 * dispatch), ten times a layer; and after a step has streamed the weights through the caches,
 * each small torch op around the layers (the embedding, the rotary angles, the final norm) costs
 * 25-50 us. This driver calls the same kernels in the same order with the same arguments as
 * the model's forward on CPU (model.py: LlamaModel, DecoderLayer), so the logits and the pool
 * come out the same to the bit; only the trips through Python are gone.
 *
 * x[r] = embed[token_ids[r]]; cos, sin of each position (rope_angles_f32); then per layer
 * (T rows, hidden n, H query heads, KV heads, head size D, MLP width I):
 *   h    = rms_norm(x) * in_norm                 add_rms_norm_f32 (x += down of the layer before)
 *   qkv  = h . Wqkv^T (+ b)         [T, (H + 2 KV) D]
 *   rope on q and k, in place; k and v into their slots of the pool
 *   a    = decode attention(q)      [T, H D]       paged_decode_attention_spans
 *   x   += a . Wo^T; h = rms_norm(x) * post_norm   add_rms_norm_f32
 *   down = silu(h . Wg^T) * (h . Wu^T) . Wd^T     silu_and_mul_f32, or in gate_up's matmul (flag 2)
 * and x += down after the last layer; then the logits of the rows that sample:
 *   rms_norm(x[sample_rows]) * final_norm . Whead^T. Each matmul is one of the library's linear
 * kernels, named per layer by its address (the kernel the model's forward would pick for that
 * many rows).
 */
#include "kernels.h"

void add_rms_norm_f32(float *x, const float *delta, const float *w, float eps, float *out, int64_t num_rows,
                      int64_t n, int num_threads);
void rope_angles_f32(const int64_t *positions, int64_t num_rows, const float *inv_freq, int64_t half, float *cos,
                     float *sin);
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
#define END_WORDS 9

static int matmul(const int64_t *lin, const float *x, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t ldy = lin[1] & 2 ? N / 2 : N;
    if (lin[1] & 1)
        return ((linear_status_fn)lin[0])(x, K, (const void *)lin[2], (const float *)lin[3], y, ldy, M, N, K, threads);
    ((linear_void_fn)lin[0])(x, K, (const void *)lin[2], (const float *)lin[3], y, ldy, M, N, K, threads);
    return 0;
}

/* Every layer over x: [T, n], the residual stream (updated in place, x += down of the last layer
 * included); h: scratch for T * (n + (H + 2 KV) D + H D + n + 3 I) floats. Returns nonzero where a
 * matmul found no memory for its own scratch. */
static int decode_layers(const int64_t *layers, int64_t num_layers, const int64_t *dims, float *x, float *h,
                         const float *cos, const float *sin, void *kv, const int64_t *slot_blocks,
                         const int64_t *slot_offsets, const int64_t *block_ids, const int64_t *ctx_lens, float eps,
                         float scale, int span_threads, int threads) {
    const int64_t T = dims[0], n = dims[1], H = dims[2], KV = dims[3], D = dims[4], I = dims[5];
    const int64_t block_size = dims[6], layer_stride = dims[7], block_stride = dims[8], side_stride = dims[9];
    const int64_t max_blocks = dims[10], nqkv = (H + 2 * KV) * D;
    const int bf = (int)dims[11];
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
    return failed;
}

/* ends: the words around the layers, END_WORDS of them: the embedding [E, n] float32, E, the rotary
 * frequencies [D / 2] float32, the final norm's weight, the head's output width V, its matmul (4
 * words as a layer's).
 * token_ids, positions: [T]; sample_rows: [S] rows of T; logits: [S, V]. kv: the pool,
 * [blocks, layers, 2, block_size, KV, D] with the strides and element type in dims; slot_blocks,
 * slot_offsets: [T]; block_ids: [T, max_blocks]; ctx_lens: [T]. Runs on `threads` threads; the
 * attention's spans are cut for `span_threads` (the model's forward's count; 0: batch-invariant
 * spans), and nothing else depends on the count, so the result is the same on any number of
 * threads. Returns 0; -2 (nothing touched) where a token id or a sample row is out of range; -1
 * without memory for the scratch or a matmul's own (the pool may then hold some of this step's
 * K/V: a re-run writes them again). */
int decode_step_f32(const int64_t *layers, int64_t num_layers, const int64_t *dims, const int64_t *ends,
                    const int64_t *token_ids, const int64_t *positions, const int64_t *sample_rows,
                    int64_t num_samples, float *logits, void *kv, const int64_t *slot_blocks,
                    const int64_t *slot_offsets, const int64_t *block_ids, const int64_t *ctx_lens, float eps,
                    float scale, int span_threads, int threads) {
    const int64_t T = dims[0], n = dims[1], H = dims[2], KV = dims[3], D = dims[4], I = dims[5], half = D / 2;
    const float *embed = (const float *)ends[0];
    const int64_t embed_rows = ends[1], vocab = ends[4];
    for (int64_t r = 0; r < T; r++)
        if (token_ids[r] < 0 || token_ids[r] >= embed_rows) return -2;
    for (int64_t s = 0; s < num_samples; s++)
        if (sample_rows[s] < 0 || sample_rows[s] >= T) return -2;
    const int64_t S = num_samples, scratch = T * (n + (H + 2 * KV) * D + H * D + n + 3 * I);
    float *x = malloc(sizeof(float) * (T * n + 2 * T * half + scratch + 2 * S * n));
    if (!x) return -1;
    float *cos = x + T * n, *sin = cos + T * half, *h = sin + T * half, *rows = h + scratch, *normed = rows + S * n;
    for (int64_t r = 0; r < T; r++) memcpy(x + r * n, embed + token_ids[r] * n, sizeof(float) * n);
    rope_angles_f32(positions, T, (const float *)ends[2], half, cos, sin);
    int failed = decode_layers(layers, num_layers, dims, x, h, cos, sin, kv, slot_blocks, slot_offsets, block_ids,
                               ctx_lens, eps, scale, span_threads, threads);
    if (!failed) {
        for (int64_t s = 0; s < S; s++) memcpy(rows + s * n, x + sample_rows[s] * n, sizeof(float) * n);
        add_rms_norm_f32(rows, 0, (const float *)ends[3], eps, normed, S, n, threads);
        failed |= matmul(ends + 5, normed, logits, S, vocab, n, threads);
    }
    free(x);
    return failed ? -1 : 0;
}
