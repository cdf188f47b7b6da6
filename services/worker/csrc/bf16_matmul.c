/* Matmul with bfloat16 weights, float32 activations and output: y[M, N] = x[M, K] . W^T (+ bias).
 *
 * W is packed once in panels of 16 output columns, per pair of inputs the 16 columns' two
 * weights side by side (64 bytes), which is vdpbf16ps's operand (AVX512-BF16: 32 products an
 * instruction, summed in pairs into 16 float32 lanes); two panels interleaved per pair of inputs,
 * [N / 32][K / 2][2 panels][16][2], and an odd last panel [K / 2][16][2], so that a work item
 * reads its weights in one stream (matmul.c says why). Each row of x is rounded to bfloat16 once
 * per call (round to nearest even, as vLLM's bfloat16 activations are) and a pair of its values,
 * read as one 32-bit word, is the broadcast partner. A work item is two panels (32 columns) by
 * up to BF_ROWS rows, accumulators in registers; half the bytes of the float32 panels, so a
 * decode step's weight read takes half as long.
 *
 * linear_bf16_gated is an MLP's gate and up projections in one: W's rows packed so that each pair
 * of panels is 16 gate columns and the same 16 up columns (the caller orders the rows), and the
 * tile writes silu(gate) * up for its 16 columns (kernels.h) instead of both: the [M, 2I] product
 * is never stored and read back (a 512-token prefill of SmolLM2-135M: ~13 ms of silu_and_mul).
 *
 * The AVX512-BF16 path is chosen at run time (cpuid); elsewhere a portable C loop does the same
 * products in float32 (slowly: the worker then keeps its float32 layouts).
 */
#include <omp.h>

#include "kernels.h"

#define BF_ROWS 12

static int bf16_force_portable = 0;

/* Rows [0, M) of one panel whose pairs of inputs lie `stride` elements apart. */
static void panel_bf16_portable(const uint16_t *xb, int64_t K, const uint16_t *w, int64_t stride, const float *bias,
                                float *y, int64_t ldy, int64_t M) {
    for (int64_t r = 0; r < M; r++)
        for (int c = 0; c < PANEL; c++) {
            float s = bias ? bias[c] : 0.0f;
            for (int64_t k = 0; k < K; k++) s += bf16_to_float(xb[r * K + k]) * bf16_to_float(w[(k / 2) * stride + c * 2 + k % 2]);
            y[r * ldy + c] = s;
        }
}

/* y[r][c] = silu(g[r][c]) * u[r][c] for a tile's rows: its gate and up columns `ldg` apart in g. */
static void gate_rows(const float *g, int64_t ldg, float *y, int64_t ldy, int64_t M) {
    for (int64_t r = 0; r < M; r++)
        for (int c = 0; c < PANEL; c++) y[r * ldy + c] = silu_mul(g[r * ldg + c], g[r * ldg + PANEL + c]);
}

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")
#include <immintrin.h>

/* M rows (compile-time, <= BF_ROWS) by P panels (1 or 2); pairs of inputs in two chains where
 * M is small, so one row still has independent accumulations in flight. G (P == 2): the panels are
 * gate and up columns, and the tile writes silu(gate) * up, 16 columns. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *xb, int64_t K, const uint16_t *w0,
                                                           const float *bias, float *y, int64_t ldy, const int M,
                                                           const int P, const int G) {
    const uint16_t *w1 = w0 + 2 * PANEL; /* P == 2: the second panel's 16 columns of each pair */
    const int64_t pairs = K / 2, step = P * 2 * PANEL;
    const uint32_t *x2 = (const uint32_t *)xb;
    __m512 a0[BF_ROWS], a1[BF_ROWS], c0[BF_ROWS], c1[BF_ROWS];
    for (int r = 0; r < M; r++) a0[r] = a1[r] = c0[r] = c1[r] = _mm512_setzero_ps();
    const int two_chains = M <= 4;
    for (int64_t j = 0; j < pairs; j += 1 + two_chains) { /* no software prefetch: one stream (matmul.c) */
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + j * step);
        const __m512bh v1 = (__m512bh)(P == 2 ? _mm512_loadu_si512(w1 + j * step) : _mm512_setzero_si512());
        for (int r = 0; r < M; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x2[r * pairs + j]);
            a0[r] = _mm512_dpbf16_ps(a0[r], v0, xv);
            if (P == 2) a1[r] = _mm512_dpbf16_ps(a1[r], v1, xv);
        }
        if (two_chains) {
            const __m512bh u0 = (__m512bh)_mm512_loadu_si512(w0 + (j + 1) * step);
            const __m512bh u1 = (__m512bh)(P == 2 ? _mm512_loadu_si512(w1 + (j + 1) * step) : _mm512_setzero_si512());
            for (int r = 0; r < M; r++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x2[r * pairs + j + 1]);
                c0[r] = _mm512_dpbf16_ps(c0[r], u0, xv);
                if (P == 2) c1[r] = _mm512_dpbf16_ps(c1[r], u1, xv);
            }
        }
    }
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias && P == 2 ? _mm512_loadu_ps(bias + PANEL) : _mm512_setzero_ps();
    for (int r = 0; r < M; r++) {
        const __m512 g = _mm512_add_ps(_mm512_add_ps(a0[r], c0[r]), b0);
        if (G) {
            _mm512_storeu_ps(y + r * ldy, silu_mul16(g, _mm512_add_ps(_mm512_add_ps(a1[r], c1[r]), b1)));
            continue;
        }
        _mm512_storeu_ps(y + r * ldy, g);
        if (P == 2) _mm512_storeu_ps(y + r * ldy + PANEL, _mm512_add_ps(_mm512_add_ps(a1[r], c1[r]), b1));
    }
}

#define BF_CASE(m)                                                   \
    case m:                                                          \
        if (G) tile_bf16(xb, K, w, bias, y, ldy, m, 2, 1);           \
        else if (P == 2) tile_bf16(xb, K, w, bias, y, ldy, m, 2, 0); \
        else tile_bf16(xb, K, w, bias, y, ldy, m, 1, 0);             \
        break;

static void tile_bf16_rows(const uint16_t *xb, int64_t K, const uint16_t *w, const float *bias, float *y,
                           int64_t ldy, int64_t M, int P, int G) {
    switch (M) {
        BF_CASE(1) BF_CASE(2) BF_CASE(3) BF_CASE(4) BF_CASE(5) BF_CASE(6)
        BF_CASE(7) BF_CASE(8) BF_CASE(9) BF_CASE(10) BF_CASE(11) BF_CASE(12)
    }
}

static void round_row_bf16(const float *x, int64_t K, uint16_t *out) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) _mm256_storeu_si256((__m256i *)(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
    for (; k < K; k++) out[k] = float_to_bf16(x[k]);
}
#pragma GCC pop_options

static int have_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}
#else
static int have_bf16(void) { return 0; }
/* Never called (have_bf16() is 0): the AVX512-BF16 kernels' stand-ins. */
#define tile_bf16_rows(xb, K, w, bias, y, ldy, M, P, G) ((void)0)
#define round_row_bf16(x, K, out) ((void)0)
#endif

/* 1 where the AVX512-BF16 path runs; `portable` nonzero forces the portable one (tests). */
int bf16_matmul_path(int portable) {
    bf16_force_portable = portable;
    return !bf16_force_portable && have_bf16();
}

/* w: [N, K] float32 -> out: [N / 32][K / 2][32][2] bfloat16, then an odd last panel [K / 2][16][2]
 * (N % 16 == K % 2 == 0). */
void pack_bf16_panels(const float *w, int64_t N, int64_t K, uint16_t *out) {
    const int64_t num_panels = N / PANEL;
#pragma omp parallel for
    for (int64_t p = 0; p < num_panels; p++) {
        const int64_t width = p / 2 * 2 + 1 < num_panels ? 2 * PANEL : PANEL; /* columns per pair of inputs */
        uint16_t *o = out + (p - p % 2) * K * PANEL + (p % 2) * PANEL * 2;
        for (int64_t k = 0; k < K; k++)
            for (int c = 0; c < PANEL; c++) o[(k / 2) * width * 2 + c * 2 + k % 2] = float_to_bf16(w[(p * PANEL + c) * K + k]);
    }
}

/* Row x [K] -> out, rounded to bfloat16 (by vcvtneps2bf16 where `fast`). */
static void round_row(const float *x, int64_t K, uint16_t *out, int fast) {
    if (fast) round_row_bf16(x, K, out);
    else
        for (int64_t k = 0; k < K; k++) out[k] = float_to_bf16(x[k]);
}

/* One thread's share of a matmul, on a team of threads all calling it: xb is this thread's
 * bfloat16 copy of x where `own` (it rounds every row itself), else the team's one copy, which the
 * team rounds row by row first. */
static void bf16_share(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                       int64_t M, int64_t N, int64_t K, int gated, int own, uint16_t *xb) {
    const int fast = !bf16_force_portable && have_bf16();
    const int64_t groups = (M + BF_ROWS - 1) / BF_ROWS, group = (M + groups - 1) / groups; /* <= BF_ROWS */
    const int64_t num_panels = N / PANEL, num_pairs = (num_panels + 1) / 2;
    if (own) {
        for (int64_t r = 0; r < M; r++) round_row(x + r * ldx, K, xb + r * K, fast);
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) round_row(x + r * ldx, K, xb + r * K, fast);
    }
    /* this thread's run of the (row group, panel pair) items, in equal runs */
    const int64_t items = groups * num_pairs, t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t item = items * t / nt; item < items * (t + 1) / nt; item++) {
        const int64_t g = item / num_pairs, pair = item % num_pairs;
        const int64_t m0 = g * group, rows = M - m0 < group ? M - m0 : group, p = 2 * pair;
        if (rows <= 0) continue;
        const int P = p + 1 < num_panels ? 2 : 1;
        const uint16_t *wp = w + p * K * PANEL;
        const float *bp = bias ? bias + p * PANEL : 0;
        float *yp = y + m0 * ldy + (gated ? pair : p) * PANEL;
        if (fast) tile_bf16_rows(xb + m0 * K, K, wp, bp, yp, ldy, rows, P, gated);
        else {
            float gu[BF_ROWS * 2 * PANEL]; /* gated: the tile's gate and up products */
            float *out = gated ? gu : yp;
            const int64_t ld = gated ? 2 * PANEL : ldy;
            for (int q = 0; q < P; q++)
                panel_bf16_portable(xb + m0 * K, K, wp + q * 2 * PANEL, P * 2 * PANEL, bp ? bp + q * PANEL : 0,
                                    out + q * PANEL, ld, rows);
            if (gated) gate_rows(out, ld, yp, ldy, rows);
        }
    }
}

/* x: [M, K] rows ldx apart; w: packed by pack_bf16_panels; bias: [N] or NULL; y: [M, N] rows ldy
 * apart, or [M, N / 2] where gated (each pair of panels gate then up columns: silu(gate) * up).
 * Called inside a parallel region (decode_step.c), every thread of the team calls it and it
 * returns, y complete, on every thread after they meet; elsewhere it runs on num_threads threads
 * of its own. Returns -1 (y incomplete) without memory for the rounded copy of x. */
static int linear_bf16_any(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                           int64_t M, int64_t N, int64_t K, int num_threads, int gated) {
    if (M <= 0) return 0;
    const int team = omp_in_parallel(); /* a member of the caller's team: its own copy */
    uint16_t *xb = malloc(sizeof(uint16_t) * M * K);
    if (xb) ON_TEAM(num_threads, bf16_share(x, ldx, w, bias, y, ldy, M, N, K, gated, team, xb));
    free(xb);
    if (team) {
#pragma omp barrier
    }
    return xb ? 0 : -1;
}

int linear_bf16(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K, int num_threads) {
    return linear_bf16_any(x, ldx, w, bias, y, ldy, M, N, K, num_threads, 0);
}

/* As linear_bf16 over N = 2I rows packed gate and up panels in pairs; y: [M, I] = silu(gate) * up. */
int linear_bf16_gated(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    return linear_bf16_any(x, ldx, w, bias, y, ldy, M, N, K, num_threads, 1);
}
