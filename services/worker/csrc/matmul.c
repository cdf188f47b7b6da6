/* Float32 matmuls (services/worker/cpu_kernels.py). */
#include <omp.h>

#include "kernels.h"

/* ------------------------------------------------------------ small-batch matmul (AVX-512 only)
 * y[M, N] = x[M, K] . W^T (+ bias), for the few rows of a decode step. W is packed once in
 * pairs of panels of 16 output columns, [N / 32][K][32] (an odd last panel [K][16]): a tile is
 * a pair (32 columns) by up to 12 rows, 24 accumulators and the two weight vectors in the 32
 * zmm registers, each weight vector serving every row and each broadcast x value both panels,
 * and it reads its 128 bytes per input in address order, one stream. (Two panels K * 64 bytes
 * apart are two streams a tile, which the hardware prefetchers restart every tile: one row over
 * matrices of SmolLM2-135M's shapes, far larger than the caches in all, streamed at 74-87% of a
 * plain read's rate that way, 1 and 2 threads, and at 95-100% of it this way.) So the weights
 * are read from memory once per row group (once per step up to 12 rows; later groups find them
 * in L2), and decode at a few rows is bound by that read. Built only where the compiler targets
 * AVX-512; elsewhere the symbol is absent and the worker keeps its other layouts. */
#ifdef __AVX512F__
#include <immintrin.h>

#define TILE_ROWS 12

/* No software prefetch: in one stream the hardware keeps ahead (fetching 16 inputs on was 5-10%
 * slower, one row over the model's matrices, 1 and 2 threads). */
static inline __attribute__((always_inline)) void panel_tile(const float *restrict x, int64_t ldx,
    const float *restrict w, int64_t K, float *restrict y, int64_t ldy, const float *restrict bias, const int M,
    const int P) {
    __m512 a0[TILE_ROWS], a1[TILE_ROWS];
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias && P == 2 ? _mm512_loadu_ps(bias + PANEL) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int i = 0; i < M; i++) {
        a0[i] = b0;
        a1[i] = b1;
    }
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = _mm512_loadu_ps(w + k * P * PANEL);
        const __m512 w1 = P == 2 ? _mm512_loadu_ps(w + k * P * PANEL + PANEL) : w0;
#pragma GCC unroll 12
        for (int i = 0; i < M; i++) {
            const __m512 xi = _mm512_set1_ps(x[i * ldx + k]);
            a0[i] = _mm512_fmadd_ps(xi, w0, a0[i]);
            if (P == 2) a1[i] = _mm512_fmadd_ps(xi, w1, a1[i]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < M; i++) {
        _mm512_storeu_ps(y + i * ldy, a0[i]);
        if (P == 2) _mm512_storeu_ps(y + i * ldy + PANEL, a1[i]);
    }
}

/* One tile of M <= TILE_ROWS rows and P panels, with M and P compile-time constants (so the
 * accumulators are registers). */
#define TILE_CASE(m)                                             \
    case m:                                                      \
        if (P == 2) panel_tile(x, ldx, w, K, y, ldy, bias, m, 2); \
        else panel_tile(x, ldx, w, K, y, ldy, bias, m, 1);        \
        break;

static void panel_tile_rows(const float *x, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy,
                            const float *bias, int64_t M, int P) {
    switch (M) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
    }
}

/* Every thread of a team calls it: its share of the panel pairs. */
static void panels_share(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K) {
    const int64_t num_panels = N / PANEL, num_pairs = (num_panels + 1) / 2;
    const int64_t num_groups = (M + TILE_ROWS - 1) / TILE_ROWS, group = (M + num_groups - 1) / num_groups;
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < num_pairs; pair++) {
        const int64_t p = 2 * pair;
        const int P = p + 1 < num_panels ? 2 : 1;
        for (int64_t m0 = 0; m0 < M; m0 += group) {
            const int64_t rows = M - m0 < group ? M - m0 : group;
            panel_tile_rows(x + m0 * ldx, ldx, w + p * K * PANEL, K, y + m0 * ldy + p * PANEL, ldy,
                            bias ? bias + p * PANEL : 0, rows, P);
        }
    }
}

/* x: [M, K] rows ldx apart; w: [N / 32][K][32] then, where N / 16 is odd, [K][16]; bias: [N] or
 * NULL; y: [M, N] rows ldy apart. N a multiple of 16. The threads split the panel pairs; rows go
 * in equal groups of <= 12. Called inside a parallel region (decode_step.c), every thread of the
 * team calls it and it returns, y complete, after they meet; elsewhere it runs on num_threads
 * threads of its own. */
int linear_panels_f32(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M > 0) ON_TEAM(num_threads, panels_share(x, ldx, w, bias, y, ldy, M, N, K));
    return 0;
}
#endif
