/* Shared by the native CPU kernels (services/worker/cpu_kernels.py builds every C file here into one
 * library): every exported function's declaration (each .c includes this header, and the build
 * fails on a definition without one), the decode step's argument struct (mirrored once in Python,
 * fused_decode.py), the limits the kernels are built for, which `kernel_limits` (limits.c) hands to
 * Python, and the helpers the kernels share. */
#ifndef SUPERINFER_KERNELS_H
#define SUPERINFER_KERNELS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define MAX_HEADS 64     /* decode and prefill attention: query heads at most */
#define MAX_HEAD_DIM 256 /* ... and head size at most */
#define PANEL 16         /* output columns per panel of the packed matmul weights (float32, quantized, bf16) */
#define PF_X 3           /* prefill attention: 16-row registers per tile */
#define PF_ROWS (16 * PF_X) /* prefill attention: query rows per tile */
#define PF_KEYS 8        /* prefill attention: keys per score pass; elements per value pass (head size in steps of it) */
#define AMX_N 16         /* AMX matmul: float32 columns per C tile */
#define AMX_K 32         /* AMX matmul: bfloat16 inputs per A tile row (64 bytes) */
#define CHUNK 32         /* attention: keys scored at a time (the scores stay in L1) */
#define QBLOCK 32        /* quantized matmul: inputs per quantization block */

/* ------------------------------------------------------------ exported functions, by file */

/* A matmul kernel: y = x . W^T (+ bias). x: [M, K] rows ldx apart; w: W packed for that kernel;
 * bias: [N] or NULL; y: [M, N] rows ldy apart ([M, N / 2] for a gated one: silu(gate) * up).
 * Returns 0, or -1 (y incomplete) without memory for its scratch. */
typedef int linear_fn(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int num_threads);

/* amx_matmul.c (where the compiler targets AMX) */
int amx_enable(void);
void pack_bf16x3(const float *w, int64_t N, int64_t K, uint16_t *out);
linear_fn linear_amx_bf16x3;
/* bf16_matmul.c */
int bf16_matmul_path(int portable);
void pack_bf16_panels(const float *w, int64_t N, int64_t K, uint16_t *out);
linear_fn linear_bf16, linear_bf16_gated;
/* matmul.c (where the compiler targets AVX-512) */
linear_fn linear_panels_f32;
/* quant_matmul.c */
int quant_matmul_path(int limit);
int quant_matmul_dequant_rows(int rows);
linear_fn linear_q4, linear_q4_0, linear_q8;
/* decode_attention.c */
int64_t decode_attention_plan(const int64_t *ctx_lens, int64_t num_rows, int64_t block_size, int span_threads,
                              int64_t *first, int64_t *spans);
void decode_attention_planned(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16, int64_t block_stride,
                              int64_t side_stride, const int64_t *block_ids, int64_t max_blocks,
                              const int64_t *ctx_lens, const int64_t *first, const int64_t *spans, float *part,
                              float *out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int num_threads);
int paged_decode_attention_spans(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16,
                                 int64_t block_stride, int64_t side_stride, const int64_t *block_ids,
                                 int64_t max_blocks, const int64_t *ctx_lens, float *out, int64_t num_rows,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int span_threads, int num_threads);
/* prefill_attention.c (where the compiler targets AVX-512) */
int prefill_bf16_products(void);
int paged_prefill_attention_f32(const float *q, int64_t q_row_stride, const void *kv, int kv_bf16, int64_t block_stride,
                                int64_t side_stride, const int64_t *table, int64_t num_cached, int64_t q_len,
                                float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, int bf16_products, int num_threads);
/* rowops.c */
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
void copy_blocks(const char *src, char *dst, int64_t block_bytes, const int64_t *src_ids, const int64_t *dst_ids,
                 int64_t num);
/* read.c */
uint64_t read_words(const uint64_t *p, int64_t n, int num_threads);
double core_latency_ns(int rounds);
/* limits.c */
int64_t kernel_limits(int64_t *out, int64_t n);
/* sampling.c */
int sample_rows_f32(const float *x, int64_t num_rows, int64_t n, const float *temperature, const int64_t *top_k,
                    const double *top_p, const double *min_p, const double *u, int64_t *out);

/* decode_step.c: a whole decode step in one call (services/worker/fused_decode.py mirrors these
 * structs field for field as ctypes.Structure; a change here is a change there). */
struct linear {
    linear_fn *kernel; /* the matmul the model's forward runs for this many rows */
    int64_t flags;     /* LINEAR_GATED, LINEAR_TEAM */
    const void *weight;
    const float *bias; /* NULL: none */
};
#define LINEAR_GATED 1 /* it writes silu(gate) * up, N / 2 columns */
#define LINEAR_TEAM 2  /* called by every thread of a parallel region, it runs as one of that team */

struct decode_layer {
    const float *in_norm, *post_norm;
    struct linear qkv, o, gate_up, down;
};

struct decode_step {
    /* the model, fixed at load */
    const struct decode_layer *layers;
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    const float *embed; /* [vocab_rows, hidden] float32 */
    int64_t embed_rows;
    const float *inv_freq; /* [head_dim / 2] */
    const float *final_norm;
    struct linear head; /* [vocab, hidden] */
    int64_t vocab;
    float eps, scale;
    /* the KV pool: [blocks, layers, 2, block_size, KV, D], strides in elements */
    void *kv;
    int64_t kv_bf16, num_blocks, block_size, layer_stride, block_stride, side_stride;
    /* this step: T rows, S of them sampled */
    int64_t num_rows, num_samples, max_blocks;
    const int64_t *token_ids, *positions, *sample_rows; /* [T], [T], [S] */
    const int64_t *slot_blocks, *slot_offsets;          /* [T] */
    const int64_t *block_ids, *ctx_lens;                /* [T, max_blocks], [T] */
    float *logits;                                      /* [S, vocab] */
    int64_t *picked;                                    /* [S] each logits row's argmax, or NULL */
    int64_t span_threads, threads;
};
int decode_step_f32(const struct decode_step *s);

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

/* silu(g) * u. sigmoid(g) from e = exp(-|g|) <= 1, so the vectorised exp serves both signs without
 * overflow: 1 / (1 + e) for g >= 0, e / (1 + e) below (libm's expf, scalar, took 10x as long at
 * prefill). silu_mul16: the same arithmetic on 16 lanes. */
static inline float silu_mul(float g, float u) {
    const float e = exp_nonpositive(g < 0.0f ? g : -g);
    return g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * u;
}

/* The chunk of keys at `pos` (at most CHUNK, within its block and before `end`): its first key's
 * offset, in elements, in the layer's view of the pool, and in *n how many keys it holds. */
static inline int64_t chunk_at(int64_t block_stride, const int64_t *table, int64_t pos, int64_t end,
                               int64_t block_size, int64_t slot, int64_t *n) {
    const int64_t in_block = pos % block_size;
    int64_t k = block_size - in_block;
    k = k < CHUNK ? k : CHUNK;
    *n = k < end - pos ? k : end - pos;
    return table[pos / block_size] * block_stride + in_block * slot;
}

/* The KV pool holds float32 or bfloat16 (the top half of a float32: widening is a shift, and
 * narrowing rounds to nearest even as torch does, NaN to torch's quiet NaN). The attention
 * kernels read either, a compile-time `bf` choosing; only the pool's element size differs. */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Runs `share` (a kernel's share of the work, split over the threads of the region it runs in) on
 * every thread of the caller's parallel region where the kernel is called inside one (decode_step.c:
 * each member of the team calls it), else in a region of its own on num_threads threads. */
#define ON_TEAM(num_threads, share)                                       \
    do {                                                                  \
        if (omp_in_parallel()) {                                          \
            share;                                                        \
        } else {                                                          \
            const int team_threads_ = (num_threads);                      \
            _Pragma("omp parallel num_threads(team_threads_)") { share; } \
        }                                                                 \
    } while (0)

/* Element i of a pool of float32 (bf = 0) or bfloat16 (bf = 1). */
static inline float kv_at(const void *kv, int64_t i, const int bf) {
    return bf ? bf16_to_float(((const uint16_t *)kv)[i]) : ((const float *)kv)[i];
}

/* The address of element i. */
static inline const char *kv_addr(const void *kv, int64_t i, const int bf) {
    return (const char *)kv + i * (bf ? 2 : 4);
}

#ifdef __AVX512F__
#include <immintrin.h>

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

static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __mmask16 neg = _mm512_cmplt_ps_mask(g, _mm512_setzero_ps());
    const __m512 e = exp16_nonpositive(_mm512_min_ps(g, _mm512_sub_ps(_mm512_setzero_ps(), g)));
    const __m512 num = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), neg, e);
    return _mm512_mul_ps(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e))), u);
}

/* 16 consecutive elements of a float32 or bfloat16 pool from element i, as float32. */
static inline __m512 kv_load16(const void *kv, int64_t i, const int bf) {
    if (bf)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)kv + i))), 16));
    return _mm512_loadu_ps((const float *)kv + i);
}
#endif

#endif
