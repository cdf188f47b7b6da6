#include "kernels.h"

/* ------------------------------------------------------------ prefill matmul on AMX (bf16x3)
 * y[M, N] = x[M, K] . W^T (+ bias) for the many rows of a prefill chunk, on the AMX tile unit,
 * at float32's accuracy less a few bits. Each float32 value is split into two bfloat16 parts,
 * v = hi + lo (hi = v rounded to bfloat16, lo = the remainder rounded again: 16 bits of
 * mantissa together), and x . w = xh.wh + xh.wl + xl.wh, the three products accumulated in
 * float32 by the tile unit (xl.wl, below 2^-16 of the product, is left out). Three bfloat16
 * products cost less than one float32 product on AVX-512: measured 1.6-2.2x faster than
 * oneDNN's float32 GEMM at 512 rows, ~4e-6 off relative to the output's scale (plain float32:
 * ~5e-7; a single bfloat16 product: ~3e-3).
 *
 * W is packed once, [N / 16][K / 32][hi, lo][16][32] bfloat16: per 16 output columns and 32
 * inputs, one B tile per part in the tile unit's pair-interleaved layout (tile row r holds
 * inputs 2r and 2r + 1 of the 16 columns), 4 bytes a weight as float32. x is split per call.
 * A C tile is 16 rows by 16 columns; a work item is 32 rows by 32 columns (four C tiles, so four
 * accumulations are in flight), 16 rows or 16 columns at the edges; items are taken column pair
 * by column pair so each thread's weights stay in L2. The kernel reads its tiles from L2 at
 * about a third of the tile unit's peak (README, "Benchmarks").
 * Built where the compiler targets AMX; the kernel runs only after `amx_enable` got the
 * kernel's permission for the tile state. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* rows of every tile */
#define AMX_TILE_ELEMS (AMX_ROWS * AMX_K)
/* C tile c += A.B in bf16x3: the two small terms first (tile numbers are immediates, hence a macro) */
#define DP_BF16X3(c, ah, al, bh, bl) \
    do {                             \
        _tile_dpbf16ps(c, al, bh);   \
        _tile_dpbf16ps(c, ah, bl);   \
        _tile_dpbf16ps(c, ah, bh);   \
    } while (0)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

static inline void bf16_split(float v, uint16_t *hi, uint16_t *lo) {
    *hi = float_to_bf16(v);
    *lo = float_to_bf16(v - bf16_to_float(*hi)); /* exact difference: the two share an exponent range */
}

/* w: [N, K] float32 -> out: [N / 16][K / 32][2][16][32] bfloat16 (N % 16 == K % 32 == 0). */
void pack_bf16x3(const float *w, int64_t N, int64_t K, uint16_t *out) {
    const int64_t num_kb = K / AMX_K;
#pragma omp parallel for collapse(2)
    for (int64_t nb = 0; nb < N / AMX_N; nb++)
        for (int64_t kb = 0; kb < num_kb; kb++) {
            uint16_t *hi = out + (nb * num_kb + kb) * 2 * AMX_TILE_ELEMS, *lo = hi + AMX_TILE_ELEMS;
            for (int r = 0; r < AMX_ROWS; r++)
                for (int c = 0; c < AMX_N; c++)
                    for (int j = 0; j < 2; j++) {
                        const int64_t at = r * AMX_K + 2 * c + j;
                        bf16_split(w[(nb * AMX_N + c) * K + kb * AMX_K + 2 * r + j], hi + at, lo + at);
                    }
        }
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void tiles_configure(void) { /* every tile 16 rows of 64 bytes; per thread */
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = AMX_ROWS;
    _tile_loadconfig(&c);
}

/* 16 rows by 16 or 32 columns (the edges of the 32 x 32 items). Tiles: 0, 1 C (columns n, n + 16);
 * 2, 3 A (xh, xl); 4, 5 B of n (hi, lo); 6, 7 B of n + 16. */
static inline void amx_item(const uint16_t *xh, const uint16_t *xl, int64_t K, const uint16_t *w0, int two,
                            float *c0, float *c1) {
    const int64_t num_kb = K / AMX_K;
    const uint16_t *w1 = w0 + num_kb * 2 * AMX_TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < num_kb; kb++) {
        _tile_loadd(2, xh + kb * AMX_K, K * 2);
        _tile_loadd(3, xl + kb * AMX_K, K * 2);
        const uint16_t *b0 = w0 + kb * 2 * AMX_TILE_ELEMS, *b1 = w1 + kb * 2 * AMX_TILE_ELEMS;
        _tile_loadd(4, b0, 64);
        _tile_loadd(5, b0 + AMX_TILE_ELEMS, 64);
        if (two) {
            _tile_loadd(6, b1, 64);
            _tile_loadd(7, b1 + AMX_TILE_ELEMS, 64);
        }
        DP_BF16X3(0, 2, 3, 4, 5);
        if (two) DP_BF16X3(1, 2, 3, 6, 7);
    }
    _tile_stored(0, c0, AMX_N * 4);
    if (two) _tile_stored(1, c1, AMX_N * 4);
}

/* 32 rows by 32 columns: four C tiles (0 rows r, n; 1 r, n + 16; 2 r + 16, n; 3 r + 16, n + 16),
 * so four accumulation chains are in flight; 4, 5 A (xh, xl), 6, 7 B (hi, lo), reloaded. */
static inline void amx_item_2x2(const uint16_t *xh, const uint16_t *xl, int64_t K, const uint16_t *w0, float *c) {
    const int64_t num_kb = K / AMX_K, next_rows = AMX_ROWS * K;
    const uint16_t *w1 = w0 + num_kb * 2 * AMX_TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < num_kb; kb++) {
        const uint16_t *b0 = w0 + kb * 2 * AMX_TILE_ELEMS, *b1 = w1 + kb * 2 * AMX_TILE_ELEMS;
        _tile_loadd(4, xh + kb * AMX_K, K * 2);
        _tile_loadd(5, xl + kb * AMX_K, K * 2);
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b0 + AMX_TILE_ELEMS, 64);
        DP_BF16X3(0, 4, 5, 6, 7);
        _tile_loadd(6, b1, 64);
        _tile_loadd(7, b1 + AMX_TILE_ELEMS, 64);
        DP_BF16X3(1, 4, 5, 6, 7);
        _tile_loadd(4, xh + next_rows + kb * AMX_K, K * 2);
        _tile_loadd(5, xl + next_rows + kb * AMX_K, K * 2);
        DP_BF16X3(3, 4, 5, 6, 7);
        _tile_loadd(6, b0, 64);
        _tile_loadd(7, b0 + AMX_TILE_ELEMS, 64);
        DP_BF16X3(2, 4, 5, 6, 7);
    }
    _tile_stored(0, c, AMX_N * 4);
    _tile_stored(1, c + AMX_ROWS * AMX_N, AMX_N * 4);
    _tile_stored(2, c + 2 * AMX_ROWS * AMX_N, AMX_N * 4);
    _tile_stored(3, c + 3 * AMX_ROWS * AMX_N, AMX_N * 4);
}

/* x: [M, K] rows ldx apart; w: packed by pack_bf16x3; bias: [N] or NULL; y: [M, N] rows ldy apart.
 * N % 16 == K % 32 == 0. Returns -1 (y untouched) where the split copy of x cannot be allocated. */
int linear_amx_bf16x3(const float *x, int64_t ldx, const void *weights, const float *bias, float *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M <= 0) return 0;
    const uint16_t *w = weights;
    const int64_t num_mb = (M + AMX_ROWS - 1) / AMX_ROWS, rows_padded = num_mb * AMX_ROWS;
    const int64_t num_nb = N / AMX_N, num_pairs = (num_nb + 1) / 2, num_mb2 = (num_mb + 1) / 2;
    uint16_t *xs = aligned_alloc(64, (size_t)(rows_padded * K * 2 * sizeof(uint16_t)));
    if (!xs) return -1;
    uint16_t *xh = xs, *xl = xs + rows_padded * K;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows_padded; m++)
            for (int64_t k = 0; k < K; k++) {
                if (m < M) bf16_split(x[m * ldx + k], xh + m * K + k, xl + m * K + k);
                else xh[m * K + k] = xl[m * K + k] = 0;
            }
        tiles_configure();
        float c[4][AMX_ROWS * AMX_N] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_pairs * num_mb2; item++) {
            const int64_t nb = 2 * (item / num_mb2), m0 = (item % num_mb2) * 2 * AMX_ROWS;
            const int two = nb + 1 < num_nb, tall = m0 + AMX_ROWS < M;
            const uint16_t *wn = w + nb * (K / AMX_K) * 2 * AMX_TILE_ELEMS;
            if (two && tall) {
                amx_item_2x2(xh + m0 * K, xl + m0 * K, K, wn, c[0]);
            } else {
                amx_item(xh + m0 * K, xl + m0 * K, K, wn, two, c[0], c[1]);
                if (tall) amx_item(xh + (m0 + AMX_ROWS) * K, xl + (m0 + AMX_ROWS) * K, K, wn, two, c[2], c[3]);
            }
            for (int t = 0; t < 4; t++) {
                const int64_t n = (nb + (t & 1)) * AMX_N, r0 = m0 + (t >> 1) * AMX_ROWS;
                if (n >= N || r0 >= M) continue;
                const int64_t rows = M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS;
                const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
                for (int64_t r = 0; r < rows; r++)
                    _mm512_storeu_ps(y + (r0 + r) * ldy + n, _mm512_add_ps(_mm512_load_ps(c[t] + r * AMX_N), b));
            }
        }
        _tile_release();
    }
    free(xs);
    return 0;
}
#endif
