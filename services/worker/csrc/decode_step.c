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
 * many rows). Every argument crosses in one `struct decode_step` (kernels.h).
 */
#include "kernels.h"

static int matmul(const struct linear *lin, const float *x, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    return lin->kernel(x, K, lin->weight, lin->bias, y, lin->flags & LINEAR_GATED ? N / 2 : N, M, N, K, threads);
}

/* Every layer over x: [T, n], the residual stream (updated in place, x += down of the last layer
 * included); shared: scratch for T * ((H + 2 KV) D + n + 2 I) floats. Returns nonzero where a matmul
 * found no memory for its own scratch, or the layers none for theirs.
 *
 * Where every matmul can run as one of a team (LINEAR_TEAM), the layers run in one parallel region:
 * each thread keeps its own copy of the residual stream, the norms, the attention's output and
 * the MLP's activation, each computed the same way on each thread, so the threads meet only
 * where a matmul's output or the new keys and values are needed whole: six times a layer,
 * against five parallel regions a layer, one a kernel, and the reads of the other thread's norm
 * and activation. Where the two cores share no cache (a line takes ~180 ns from one to the other
 * there, ~40 where they do), entering and leaving a region costs ~1.1 us and a meeting ~0.5.
 * Elsewhere (a matmul that opens its own region) the loop runs on the calling thread and each
 * kernel opens its own region. The same operations in the same order either way: the same bits. */
static int decode_layers(const struct decode_step *s, float *x, float *shared, const float *cos, const float *sin) {
    const int64_t T = s->num_rows, n = s->hidden, H = s->num_heads, KV = s->num_kv_heads, D = s->head_dim;
    const int64_t I = s->intermediate, nqkv = (H + 2 * KV) * D;
    const int bf = (int)s->kv_bf16, threads = (int)s->threads;
    float *qkv = shared, *out = qkv + T * nqkv, *gu = out + T * n; /* gu: [T, 2I], or [T, I] where gated */
    int team = threads > 1;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const struct decode_layer *w = s->layers + l;
        team &= (w->qkv.flags & w->o.flags & w->gate_up.flags & w->down.flags & LINEAR_TEAM) != 0;
    }
    const int copies = team ? threads : 1, row_threads = team ? 1 : threads;
    const int64_t own = T * (2 * n + H * D + I); /* a thread's copies: residual, norm, attention, activation */
    int64_t *first = malloc(sizeof(int64_t) * (2 * T + 1)), *spans = first + T + 1;
    float *mine = malloc(sizeof(float) * own * copies), *part = 0;
    if (first && mine)
        part = malloc(sizeof(float) * H * (D + 2) *
                      decode_attention_plan(s->ctx_lens, T, s->block_size, (int)s->span_threads, first, spans));
    int failed = !part;
    if (!failed) {
#pragma omp parallel num_threads(threads) if (team) reduction(| : failed)
        {
            float *xt = mine + omp_get_thread_num() * own, *ht = xt + T * n, *attn = ht + T * n, *act = attn + T * H * D;
            memcpy(xt, x, sizeof(float) * T * n);
            for (int64_t l = 0; l < s->num_layers; l++) {
                const struct decode_layer *w = s->layers + l;
                char *kv_layer = (char *)s->kv + l * s->layer_stride * (bf ? 2 : 4);
                add_rms_norm_f32(xt, l ? out : 0, w->in_norm, s->eps, ht, T, n, row_threads);
                failed |= matmul(&w->qkv, ht, qkv, T, nqkv, n, threads);
                {
                    /* In a team the last thread ropes the keys and stores them and the values (the
                     * columns it computed), while the others share the queries' heads: one thread
                     * doing it all read the other's columns from its cache (~1.5% of a one-request
                     * gguf step with the cores apart). Alone, a thread does both parts. */
                    const int t = omp_get_thread_num(), nt = omp_get_num_threads(), qt = nt > 1 ? nt - 1 : 1;
                    if (t == nt - 1) {
                        rope_f32(qkv + H * D, nqkv, cos, sin, T, KV, D, row_threads);
                        write_kv_f32(qkv + H * D, qkv + (H + KV) * D, nqkv, kv_layer, bf, s->block_stride,
                                     s->side_stride, s->slot_blocks, s->slot_offsets, T, KV * D);
                    }
                    if (t < qt)
                        rope_f32(qkv + H * t / qt * D, nqkv, cos, sin, T, H * (t + 1) / qt - H * t / qt, D, row_threads);
                }
#pragma omp barrier
                decode_attention_planned(qkv, nqkv, kv_layer, bf, s->block_stride, s->side_stride, s->block_ids,
                                         s->max_blocks, s->ctx_lens, first, spans, part, attn, T, H, KV, D,
                                         s->block_size, s->scale, threads);
                failed |= matmul(&w->o, attn, out, T, n, H * D, threads);
                add_rms_norm_f32(xt, out, w->post_norm, s->eps, ht, T, n, row_threads);
                failed |= matmul(&w->gate_up, ht, gu, T, 2 * I, n, threads);
                const float *mlp = gu; /* silu(gate) * up, where the matmul did not write it */
                if (!(w->gate_up.flags & LINEAR_GATED)) {
                    silu_and_mul_f32(gu, act, T, I, row_threads);
                    mlp = act;
                }
                failed |= matmul(&w->down, mlp, out, T, n, I, threads);
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

/* Every index the step reads from its arguments, checked before anything is touched: token ids
 * within the embedding, sample rows within the step, positions >= 0, each row's context (its
 * position + 1) within its table of max_blocks blocks, every block id the context and the slots
 * use within the pool, slot offsets within a block. */
static int step_checked(const struct decode_step *s) {
    const int64_t T = s->num_rows, size = s->block_size;
    if (T < 0 || s->num_samples < 0 || s->max_blocks < 1 || size < 1) return 0;
    for (int64_t r = 0; r < T; r++) {
        const int64_t ctx = s->ctx_lens[r], used = (ctx + size - 1) / size;
        if (s->token_ids[r] < 0 || s->token_ids[r] >= s->embed_rows || s->positions[r] < 0 || ctx < 1 ||
            used > s->max_blocks || s->slot_blocks[r] < 0 || s->slot_blocks[r] >= s->num_blocks ||
            s->slot_offsets[r] < 0 || s->slot_offsets[r] >= size)
            return 0;
        for (int64_t b = 0; b < used; b++) {
            const int64_t id = s->block_ids[r * s->max_blocks + b];
            if (id < 0 || id >= s->num_blocks) return 0;
        }
    }
    for (int64_t i = 0; i < s->num_samples; i++)
        if (s->sample_rows[i] < 0 || s->sample_rows[i] >= T) return 0;
    return 1;
}

/* The step described by *s (kernels.h): token_ids, positions: [T]; sample_rows: [S] rows of T;
 * logits: [S, V]; picked: [S], each logits row's argmax (argmax_rows_f32), or NULL. kv: the pool
 * with the strides and element type in *s; slot_blocks, slot_offsets: [T]; block_ids: [T,
 * max_blocks]; ctx_lens: [T]. Runs on `threads` threads; the attention's spans are cut for
 * `span_threads` (the model's forward's count; 0: batch-invariant spans), and nothing else depends
 * on the count, so the result is the same on any number of threads. Returns 0; -2 (nothing touched)
 * where an index is out of range (step_checked); -1 without memory for the scratch or a matmul's own
 * (the pool may then hold some of this step's K/V: a re-run writes them again). */
int decode_step_f32(const struct decode_step *s) {
    if (!step_checked(s)) return -2;
    const int64_t T = s->num_rows, n = s->hidden, H = s->num_heads, KV = s->num_kv_heads, D = s->head_dim;
    const int64_t half = D / 2, S = s->num_samples, scratch = T * ((H + 2 * KV) * D + n + 2 * s->intermediate);
    float *x = malloc(sizeof(float) * (T * n + 2 * T * half + scratch + 2 * S * n));
    if (!x) return -1;
    float *cos = x + T * n, *sin = cos + T * half, *shared = sin + T * half, *rows = shared + scratch;
    float *normed = rows + S * n;
    for (int64_t r = 0; r < T; r++) memcpy(x + r * n, s->embed + s->token_ids[r] * n, sizeof(float) * n);
    rope_angles_f32(s->positions, T, s->inv_freq, half, cos, sin);
    int failed = decode_layers(s, x, shared, cos, sin);
    if (!failed) {
        for (int64_t i = 0; i < S; i++) memcpy(rows + i * n, x + s->sample_rows[i] * n, sizeof(float) * n);
        add_rms_norm_f32(rows, 0, s->final_norm, s->eps, normed, S, n, (int)s->threads);
        failed |= matmul(&s->head, normed, s->logits, S, s->vocab, n, (int)s->threads);
        if (s->picked && !failed) argmax_rows_f32(s->logits, S, s->vocab, s->picked);
    }
    free(x);
    return failed ? -1 : 0;
}
