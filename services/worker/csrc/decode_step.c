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
#include <omp.h>

#include "kernels.h"

void add_rms_norm_f32(float *x, const float *delta, const float *w, float eps, float *out, int64_t num_rows,
                      int64_t n, int num_threads);
void rope_angles_f32(const int64_t *positions, int64_t num_rows, const float *inv_freq, int64_t half, float *cos,
                     float *sin);
void rope_f32(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t num_rows, int64_t num_heads,
              int64_t head_dim, int num_threads);
void silu_and_mul_f32(const float *gate_up, float *out, int64_t num_rows, int64_t n, int num_threads);
void argmax_rows_f32(const float *x, int64_t num_rows, int64_t n, int64_t *out);
void write_kv_f32(const float *k, const float *v, int64_t row_stride, void *kv, int bf, int64_t block_stride,
                  int64_t side_stride, const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t num_rows,
                  int64_t width);
int64_t decode_attention_plan(const int64_t *ctx_lens, int64_t num_rows, int64_t block_size, int span_threads,
                              int64_t *first, int64_t *spans);
void decode_attention_planned(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16, int64_t block_stride,
                              int64_t side_stride, const int64_t *block_ids, int64_t max_blocks,
                              const int64_t *ctx_lens, const int64_t *first, const int64_t *spans, float *part,
                              float *out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int num_threads);

typedef int (*linear_status_fn)(const float *, int64_t, const void *, const float *, float *, int64_t, int64_t,
                                int64_t, int64_t, int);
typedef void (*linear_void_fn)(const float *, int64_t, const void *, const float *, float *, int64_t, int64_t,
                               int64_t, int64_t, int);

/* Words per layer descriptor: in_norm, post_norm, then per matmul (qkv, o, gate_up, down) its
 * kernel's address, flags (1: the kernel returns a status, else void; 2: it writes silu(gate) * up,
 * N / 2 columns; 4: called by every thread of a parallel region, it runs as one of that team),
 * the packed weight, the bias (0: none). */
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
 * included); shared: scratch for T * ((H + 2 KV) D + n + 2 I) floats. Returns nonzero where a matmul
 * found no memory for its own scratch, or the layers none for theirs.
 *
 * Where every matmul can run as one of a team (flag 4), the layers run in one parallel region:
 * each thread keeps its own copy of the residual stream, the norms, the attention's output and
 * the MLP's activation, each computed the same way on each thread, so the threads meet only
 * where a matmul's output or the new keys and values are needed whole: six times a layer,
 * against five parallel regions a layer, one a kernel, and the reads of the other thread's norm
 * and activation. Where the two cores share no cache (a line takes ~180 ns from one to the other
 * there, ~40 where they do), entering and leaving a region costs ~1.1 us and a meeting ~0.5.
 * Elsewhere (a matmul that opens its own region) the loop runs on the calling thread and each
 * kernel opens its own region. The same operations in the same order either way: the same bits. */
static int decode_layers(const int64_t *layers, int64_t num_layers, const int64_t *dims, float *x, float *shared,
                         const float *cos, const float *sin, void *kv, const int64_t *slot_blocks,
                         const int64_t *slot_offsets, const int64_t *block_ids, const int64_t *ctx_lens, float eps,
                         float scale, int span_threads, int threads) {
    const int64_t T = dims[0], n = dims[1], H = dims[2], KV = dims[3], D = dims[4], I = dims[5];
    const int64_t block_size = dims[6], layer_stride = dims[7], block_stride = dims[8], side_stride = dims[9];
    const int64_t max_blocks = dims[10], nqkv = (H + 2 * KV) * D;
    const int bf = (int)dims[11];
    float *qkv = shared, *out = qkv + T * nqkv, *gu = out + T * n; /* gu: [T, 2I], or [T, I] where gated */
    int team = threads > 1;
    for (int64_t l = 0; l < num_layers; l++)
        for (int j = 0; j < 4; j++) team &= (layers[l * LAYER_WORDS + 2 + 4 * j + 1] & 4) != 0;
    const int copies = team ? threads : 1, row_threads = team ? 1 : threads;
    const int64_t own = T * (2 * n + H * D + I); /* a thread's copies: residual, norm, attention, activation */
    int64_t *first = malloc(sizeof(int64_t) * (2 * T + 1)), *spans = first + T + 1;
    float *mine = malloc(sizeof(float) * own * copies), *part = 0;
    if (first && mine)
        part = malloc(sizeof(float) * H * (D + 2) *
                      decode_attention_plan(ctx_lens, T, block_size, span_threads, first, spans));
    int failed = !part;
    if (!failed) {
#pragma omp parallel num_threads(threads) if (team) reduction(| : failed)
        {
            float *xt = mine + omp_get_thread_num() * own, *ht = xt + T * n, *attn = ht + T * n, *act = attn + T * H * D;
            memcpy(xt, x, sizeof(float) * T * n);
            for (int64_t l = 0; l < num_layers; l++) {
                const int64_t *w = layers + l * LAYER_WORDS;
                char *kv_layer = (char *)kv + l * layer_stride * (bf ? 2 : 4);
                add_rms_norm_f32(xt, l ? out : 0, (const float *)w[0], eps, ht, T, n, row_threads);
                failed |= matmul(w + 2, ht, qkv, T, nqkv, n, threads);
                {
                    /* In a team the last thread ropes the keys and stores them and the values (the
                     * columns it computed), while the others share the queries' heads: one thread
                     * doing it all read the other's columns from its cache (~1.5% of a one-request
                     * gguf step with the cores apart). Alone, a thread does both parts. */
                    const int t = omp_get_thread_num(), nt = omp_get_num_threads(), qt = nt > 1 ? nt - 1 : 1;
                    if (t == nt - 1) {
                        rope_f32(qkv + H * D, nqkv, cos, sin, T, KV, D, row_threads);
                        write_kv_f32(qkv + H * D, qkv + (H + KV) * D, nqkv, kv_layer, bf, block_stride, side_stride,
                                     slot_blocks, slot_offsets, T, KV * D);
                    }
                    if (t < qt)
                        rope_f32(qkv + H * t / qt * D, nqkv, cos, sin, T, H * (t + 1) / qt - H * t / qt, D, row_threads);
                }
#pragma omp barrier
                decode_attention_planned(qkv, nqkv, kv_layer, bf, block_stride, side_stride, block_ids, max_blocks,
                                         ctx_lens, first, spans, part, attn, T, H, KV, D, block_size, scale, threads);
                failed |= matmul(w + 6, attn, out, T, n, H * D, threads);
                add_rms_norm_f32(xt, out, (const float *)w[1], eps, ht, T, n, row_threads);
                failed |= matmul(w + 10, ht, gu, T, 2 * I, n, threads);
                const float *mlp = gu; /* silu(gate) * up, where the matmul did not write it */
                if (!(w[11] & 2)) {
                    silu_and_mul_f32(gu, act, T, I, row_threads);
                    mlp = act;
                }
                failed |= matmul(w + 14, mlp, out, T, n, I, threads);
            }
            if (omp_get_thread_num() == 0)
                for (int64_t i = 0; i < T * n; i++) x[i] = xt[i] + out[i];
        }
    }
    free(part);
    free(mine);
    free(first);
    return failed;
}

/* ends: the words around the layers, END_WORDS of them: the embedding [E, n] float32, E, the rotary
 * frequencies [D / 2] float32, the final norm's weight, the head's output width V, its matmul (4
 * words as a layer's).
 * token_ids, positions: [T]; sample_rows: [S] rows of T; logits: [S, V]; picked: [S], each logits row's
 * argmax (argmax_rows_f32), or NULL. kv: the pool,
 * [blocks, layers, 2, block_size, KV, D] with the strides and element type in dims; slot_blocks,
 * slot_offsets: [T]; block_ids: [T, max_blocks]; ctx_lens: [T]. Runs on `threads` threads; the
 * attention's spans are cut for `span_threads` (the model's forward's count; 0: batch-invariant
 * spans), and nothing else depends on the count, so the result is the same on any number of
 * threads. Returns 0; -2 (nothing touched) where a token id or a sample row is out of range; -1
 * without memory for the scratch or a matmul's own (the pool may then hold some of this step's
 * K/V: a re-run writes them again). */
int decode_step_f32(const int64_t *layers, int64_t num_layers, const int64_t *dims, const int64_t *ends,
                    const int64_t *token_ids, const int64_t *positions, const int64_t *sample_rows,
                    int64_t num_samples, float *logits, int64_t *picked, void *kv, const int64_t *slot_blocks,
                    const int64_t *slot_offsets, const int64_t *block_ids, const int64_t *ctx_lens, float eps,
                    float scale, int span_threads, int threads) {
    const int64_t T = dims[0], n = dims[1], H = dims[2], KV = dims[3], D = dims[4], I = dims[5], half = D / 2;
    const float *embed = (const float *)ends[0];
    const int64_t embed_rows = ends[1], vocab = ends[4];
    for (int64_t r = 0; r < T; r++)
        if (token_ids[r] < 0 || token_ids[r] >= embed_rows) return -2;
    for (int64_t s = 0; s < num_samples; s++)
        if (sample_rows[s] < 0 || sample_rows[s] >= T) return -2;
    const int64_t S = num_samples, scratch = T * ((H + 2 * KV) * D + n + 2 * I);
    float *x = malloc(sizeof(float) * (T * n + 2 * T * half + scratch + 2 * S * n));
    if (!x) return -1;
    float *cos = x + T * n, *sin = cos + T * half, *shared = sin + T * half, *rows = shared + scratch;
    float *normed = rows + S * n;
    for (int64_t r = 0; r < T; r++) memcpy(x + r * n, embed + token_ids[r] * n, sizeof(float) * n);
    rope_angles_f32(positions, T, (const float *)ends[2], half, cos, sin);
    int failed = decode_layers(layers, num_layers, dims, x, shared, cos, sin, kv, slot_blocks, slot_offsets, block_ids,
                               ctx_lens, eps, scale, span_threads, threads);
    if (!failed) {
        for (int64_t s = 0; s < S; s++) memcpy(rows + s * n, x + sample_rows[s] * n, sizeof(float) * n);
        add_rms_norm_f32(rows, 0, (const float *)ends[3], eps, normed, S, n, threads);
        failed |= matmul(ends + 5, normed, logits, S, vocab, n, threads);
        if (picked && !failed) argmax_rows_f32(logits, S, vocab, picked);
    }
    free(x);
    return failed ? -1 : 0;
}
