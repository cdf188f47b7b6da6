/* Matmul with block-quantized weights kept packed (Q8_0, Q4_0, Q4_1 of GGUF), dequantized inside
 * the kernel: y[M, N] = x[M, K] . W^T (+ bias).
 *
 * Every format is held as w = d * q + m per block of 32 inputs of one output column, q unsigned
 * (4 or 8 bits), d and m float16: Q4_1 as it is; Q4_0 and Q8_0 (q + 128) with m = -2^(bits-1) d,
 * which the kernel computes (exactly: a power of two) instead of reading. The activations are
 * quantized per row and block too, as llama.cpp's q8 dot products do: x = dx * xq, xq int8,
 * dx = max|x| / 127. A block then sums as
 *     sum_k w_k x_k = d dx sum_k q_k xq_k + m dx sum_k xq_k
 * with the first sum exact in int32 (vpdpbusd: unsigned q times signed xq, 64 products an
 * instruction) and the second known per row and block before the matmul starts.
 *
 * Packed layout (services/worker/cpu_quant.py writes it): a line of 64 bytes that says where the
 * panels lie (`panel_at`: in one part after it, or cut in parts per thread), then per panel of 16
 * output columns its blocks of 32 inputs in order, each block's q in QB(bits) bytes:
 *   4 bits: 4 x 64 bytes; byte c * 4 + r of vector i holds column c's inputs 4i + r (low nibble)
 *           and 16 + 4i + r (high nibble) -- GGUF's own nibble order, so packing only transposes;
 *   8 bits: 8 x 64 bytes; byte c * 4 + r of vector g holds column c's input 4g + r;
 * and the scales, one float16 per column: with m (Q4_1), after each block's q its 16 d and 16 m;
 * without (Q4_0, Q8_0), blocks in pairs: both blocks' 16 d (64 bytes), then the two blocks' q (a
 * last odd block: its d, 32 bytes of padding, its q). So each block's q stays 64-byte aligned
 * (Q8_0 takes 544 bytes a block, not 576; Q4_0 288, not 320) and a panel is still read front to
 * back in one stream. Against the m read from memory, one-row steps of the bundled model in
 * alternating processes: Q8_0 6.8-8.1 -> 4.9-5.5 ms, Q4_0 3.0-4.4 -> 2.8-3.5 ms. (All the panel's
 * d at its end, or all at its start, made Q4_0 the slowest format at one row: 4.6-5.2 ms against
 * Q4_1's 3.5-3.8.)
 * So one 64-byte load is a vpdpbusd operand for 16 columns x 4 inputs, and 4 consecutive int8
 * activations, read as one int32, its broadcast partner. A work item is one panel by up to
 * QTILE rows, whose 16-column float accumulators stay in registers across the blocks.
 *
 * The AVX2 path (x86 without AVX-512: Zen 1-3, most laptops) reads the same layout: a 64-byte
 * vector is two 32-byte halves, columns 0-7 and 8-15, and vpmaddubsw (unsigned q times signed xq,
 * adjacent pairs summed to int16) then vpmaddwd by ones (int16 pairs to int32) stands for
 * vpdpbusd. vpmaddubsw saturates its int16 sums, so the q it sees stay small: 4 bits, q <= 15 and
 * |xq| <= 127, a pair is at most 3810 and all 8 vectors of a block (low and high nibbles, the
 * high ones shifted down) sum to at most 30480 in int16 before one vpmaddwd; 8 bits, q + 128 up
 * to 255 could not, so it multiplies the signed q (the stored byte xor 0x80) as |q| times xq
 * given q's sign (vpsignb; a pair at most 2 * 128 * 127 = 32512), each vector widened to int32
 * at once, and adds 128 sum_k xq_k (kept per row and block by the quantizer) back. Its integer
 * sums are the other paths' exactly, and it scales them in the VNNI path's order, so the two
 * give the same bits.
 *
 * The path is chosen at run time (cpuid): AVX512-VNNI, else AVX2 with FMA and F16C, else a
 * portable C loop that computes the same integer sums.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define QTILE 8 /* rows per work item: 8 float accumulators + the block's 8 weight vectors in registers */
#define ATILE 4 /* AVX2: rows per pass over a panel: 2 halves x 4 rows of accumulators, a half's 8 weight vectors (16 ymm: the compiler keeps some in L1) */
#define AVX2_AHEAD 6 /* AVX2: blocks its prefetches run ahead of the reads */
#define DEQ_ROWS 4 /* most rows of the float32 path */

/* The paths, slowest first; `most` is the fastest one allowed (tests force the slower ones). */
enum { PATH_PORTABLE, PATH_AVX2, PATH_VNNI };
static int most = PATH_VNNI;
static int dequant_rows = 0; /* steps of at most this many rows take the float32 path (0: never) */

/* Bytes of q per panel and block. */
static inline int64_t qb(int bits) { return bits == 4 ? 256 : 512; }

/* Bytes per panel of nb blocks. */
static inline int64_t panel_bytes(int bits, int has_m, int64_t nb) {
    return has_m ? nb * (qb(bits) + 64) : (nb + 1) / 2 * 64 + nb * qb(bits);
}

/* Block b's q, and its 16 d (then its 16 m where has_m). */
static inline const uint8_t *block_q(const uint8_t *w, int bits, int has_m, int64_t b) {
    return has_m ? w + b * (qb(bits) + 64) : w + b / 2 * (64 + 2 * qb(bits)) + 64 + b % 2 * qb(bits);
}
static inline const uint16_t *block_d(const uint8_t *w, int bits, int has_m, int64_t b) {
    const uint8_t *d = has_m ? w + b * (qb(bits) + 64) + qb(bits) : w + b / 2 * (64 + 2 * qb(bits)) + b % 2 * 32;
    return (const uint16_t *)d;
}

/* m per unit of d where the format computes it: q is unsigned, stored 2^(bits-1) up. */
static inline float m_per_d(int bits) { return -(float)(1 << (bits - 1)); }

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row r of x -> xq (K int8), dx and sx (K / 32 floats each: the scale, and dx * sum xq), and
 * the sums themselves (K / 32 int32: the AVX2 path's 8-bit correction). */
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *dx, float *sx, int32_t *sq) {
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.0f;
#pragma omp simd reduction(max : amax)
        for (int i = 0; i < QBLOCK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < QBLOCK; i++) {
            const int q = (int)__builtin_rintf(xb[i] * inv);
            xq[b * QBLOCK + i] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
        sq[b] = sum;
    }
}

/* Portable: rows [0, M) of one panel. */
static void panel_portable(const int8_t *xq, const float *dx, const float *sx, int64_t K, const uint8_t *w,
                           int bits, int has_m, const float *bias, float *y, int64_t ldy, int64_t M) {
    const int64_t nb = K / QBLOCK;
    for (int64_t r = 0; r < M; r++) {
        float acc[16];
        for (int c = 0; c < 16; c++) acc[c] = bias ? bias[c] : 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = block_q(w, bits, has_m, b);
            const int8_t *xb = xq + r * K + b * QBLOCK;
            const uint16_t *dm = block_d(w, bits, has_m, b);
            for (int c = 0; c < 16; c++) {
                int32_t s = 0;
                for (int k = 0; k < QBLOCK; k++) {
                    int q;
                    if (bits == 4) {
                        const uint8_t byte = wb[(k % 16 / 4) * 64 + c * 4 + k % 4];
                        q = k < 16 ? byte & 0x0f : byte >> 4;
                    } else {
                        q = wb[(k / 4) * 64 + c * 4 + k % 4];
                    }
                    s += q * xb[k];
                }
                const float d = half_to_float(dm[c]), m = has_m ? half_to_float(dm[16 + c]) : m_per_d(bits) * d;
                acc[c] += d * dx[r * nb + b] * (float)s + m * sx[r * nb + b];
            }
        }
        for (int c = 0; c < 16; c++) y[r * ldy + c] = acc[c];
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* M rows (a compile-time constant <= ATILE) of one panel; sq: the rows' sums of xq per block. */
static inline __attribute__((always_inline)) void panel_avx2(const int8_t *xq, const float *dx, const float *sx,
                                                            const int32_t *sq, int64_t K, const uint8_t *w,
                                                            const int bits, const int has_m, const float *bias,
                                                            float *y, int64_t ldy, const int M) {
    const int64_t nb = K / QBLOCK;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[ATILE][2];
    for (int h = 0; h < 2; h++) {
        const __m256 b0 = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
        for (int r = 0; r < M; r++) acc[r][h] = b0;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = block_q(w, bits, has_m, b);
        const uint16_t *ds = block_d(w, bits, has_m, b);
        /* Unlike the VNNI path's, a prefetch: on a Zen 3 (2 threads, 4 layers of the 1B shape, one
         * row, the distances alternating in one process, medians of 7) 25.6 -> 31.1 GB/s for Q4_1,
         * 25.0 -> 30.4 for Q4_0, 20.0 -> 25.0 for Q8_0; 4 to 12 blocks ahead all within 2 GB/s,
         * 8 rows unchanged. Past the panel's end it reads the next panel (this thread's next) or
         * nothing: a prefetch does not fault. */
        const char *ahead = (const char *)block_q(w, bits, has_m, b + AVX2_AHEAD);
        for (int i = 0; i < (bits == 4 ? 5 : 9); i++) _mm_prefetch(ahead + 64 * i, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) { /* columns 8h .. 8h + 7: bytes 32h .. 32h + 31 of every vector */
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ds + 8 * h)));
            const __m256 m = has_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ds + 16 + 8 * h)))
                                   : _mm256_mul_ps(d, _mm256_set1_ps(m_per_d(bits)));
            __m256i wv[8]; /* 4 bits: q of inputs 4i.. (low nibbles), then 16 + 4i.. (high); 8 bits: |q| */
            __m256i sg[8]; /* 8 bits: the signed q, whose signs the activations take */
            if (bits == 4) {
                for (int i = 0; i < 4; i++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * i + 32 * h));
                    wv[i] = _mm256_and_si256(v, low);
                    wv[4 + i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            } else {
                for (int g = 0; g < 8; g++) {
                    sg[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + 64 * g + 32 * h)), flip);
                    wv[g] = _mm256_abs_epi8(sg[g]);
                }
            }
            for (int r = 0; r < M; r++) {
                const int32_t *x4 = (const int32_t *)(xq + r * K + b * QBLOCK);
                __m256i si;
                if (bits == 4) { /* 8 vectors of pairs <= 3810 each: their int16 sum fits */
                    __m256i s16 = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(x4[0]));
                    for (int i = 1; i < 8; i++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[i], _mm256_set1_epi32(x4[i])));
                    si = _mm256_madd_epi16(s16, ones);
                } else { /* sum (q + 128) xq = sum |q| (sign(q) xq) + 128 sum xq */
                    __m256i s0 = _mm256_set1_epi32(128 * sq[r * nb + b]), s1 = _mm256_setzero_si256();
                    for (int g = 0; g < 8; g += 2) {
                        const __m256i p0 = _mm256_maddubs_epi16(wv[g], _mm256_sign_epi8(_mm256_set1_epi32(x4[g]), sg[g]));
                        const __m256i p1 = _mm256_maddubs_epi16(wv[g + 1], _mm256_sign_epi8(_mm256_set1_epi32(x4[g + 1]), sg[g + 1]));
                        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, ones));
                        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, ones));
                    }
                    si = _mm256_add_epi32(s0, s1);
                }
                const __m256 s = _mm256_cvtepi32_ps(si);
                acc[r][h] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < M; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + r * ldy + 8 * h, acc[r][h]);
}

#define ACASE(rows)                                                                              \
    case rows:                                                                                   \
        if (has_m) panel_avx2(xr, dr, sr, qr, K, w, 4, 1, bias, yr, ldy, rows);                 \
        else if (bits == 4) panel_avx2(xr, dr, sr, qr, K, w, 4, 0, bias, yr, ldy, rows);        \
        else panel_avx2(xr, dr, sr, qr, K, w, 8, 0, bias, yr, ldy, rows);                       \
        break;

/* Rows [0, M) of one panel, M <= QTILE, ATILE rows at a time (each a pass over the panel: the
 * second pass finds it in L2). */
static void panel_avx2_rows(const int8_t *xq, const float *dx, const float *sx, const int32_t *sq, int64_t K,
                            const uint8_t *w, int bits, int has_m, const float *bias, float *y, int64_t ldy,
                            int64_t M) {
    const int64_t nb = K / QBLOCK;
    for (int64_t r0 = 0; r0 < M; r0 += ATILE) {
        const int8_t *xr = xq + r0 * K;
        const float *dr = dx + r0 * nb, *sr = sx + r0 * nb;
        const int32_t *qr = sq + r0 * nb;
        float *yr = y + r0 * ldy;
        switch (M - r0 < ATILE ? M - r0 : ATILE) { ACASE(1) ACASE(2) ACASE(3) ACASE(4) }
    }
}
#undef ACASE
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c,fma")

/* M rows (a compile-time constant <= QTILE) of one panel. */
static inline __attribute__((always_inline)) void panel_vnni(const int8_t *xq, const float *dx, const float *sx,
                                                            int64_t K, const uint8_t *w, const int bits,
                                                            const int has_m, const float *bias, float *y,
                                                            int64_t ldy, const int M) {
    const int64_t nb = K / QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[QTILE];
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int r = 0; r < M; r++) acc[r] = b0;
    for (int64_t b = 0; b < nb; b++) {
        /* No software prefetch: with the weights in huge pages (host_memory.py) the hardware
         * prefetchers keep ahead; prefetching every line 4 blocks on made the 121 one-row matmuls
         * of a step 8-15% slower on one thread (Q4 and Q8 layouts, alternating in one process, two
         * runs) and no faster on two, and into L2 8 or 16 blocks on was no better. */
        const uint8_t *wb = block_q(w, bits, has_m, b);
        const uint16_t *ds = block_d(w, bits, has_m, b);
        __m512i wv[8];
        if (bits == 4) { /* high nibbles kept in place (16 q): their sums are shifted back once, exactly */
            for (int i = 0; i < 4; i++) {
                const __m512i v = _mm512_loadu_si512(wb + 64 * i);
                wv[i] = _mm512_and_si512(v, low);
                wv[4 + i] = _mm512_andnot_si512(low, v);
            }
        } else {
            for (int g = 0; g < 8; g++) wv[g] = _mm512_loadu_si512(wb + 64 * g);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ds));
        const __m512 m = has_m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ds + 16)))
                               : _mm512_mul_ps(d, _mm512_set1_ps(m_per_d(bits)));
        for (int r = 0; r < M; r++) {
            const int32_t *x4 = (const int32_t *)(xq + r * K + b * QBLOCK);
            /* s0: inputs 0-15 (4 bits: the low nibbles), s1: 16-31 (4 bits: 16x, from the high ones in place) */
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], _mm512_set1_epi32(x4[0]));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[4], _mm512_set1_epi32(x4[4]));
            s0 = _mm512_dpbusd_epi32(s0, wv[1], _mm512_set1_epi32(x4[1]));
            s1 = _mm512_dpbusd_epi32(s1, wv[5], _mm512_set1_epi32(x4[5]));
            s0 = _mm512_dpbusd_epi32(s0, wv[2], _mm512_set1_epi32(x4[2]));
            s1 = _mm512_dpbusd_epi32(s1, wv[6], _mm512_set1_epi32(x4[6]));
            s0 = _mm512_dpbusd_epi32(s0, wv[3], _mm512_set1_epi32(x4[3]));
            s1 = _mm512_dpbusd_epi32(s1, wv[7], _mm512_set1_epi32(x4[7]));
            if (bits == 4) s1 = _mm512_srai_epi32(s1, 4);
            const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* The other way for a few rows: the weights dequantized to float32 in registers (w = d q + m,
 * one vector of 16 columns per input) and multiplied by the float32 activations, which are not
 * rounded. vpermb (AVX512-VBMI) regroups a 64-byte vector's bytes input by input. */
static const uint8_t DEQ_PERM[64] __attribute__((aligned(64))) = {
    0, 4, 8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 1, 5, 9,  13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61,
    2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63};

#define DEQ_INPUT(r)                                                                                      \
    do {                                                                                                  \
        const __m512 wv = _mm512_fmadd_ps(                                                                \
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(g, r))), d, m);             \
        for (int i = 0; i < M; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k0 + r]), wv, acc[i]); \
    } while (0)

static inline __attribute__((always_inline)) void panel_deq(const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                                                           const int bits, const int has_m, const float *bias,
                                                           float *y, int64_t ldy, const int M) {
    const int64_t nb = K / QBLOCK, bb = qb(bits) + (has_m ? 64 : 0);
    const __m512i low = _mm512_set1_epi8(0x0f), perm = _mm512_load_si512(DEQ_PERM);
    __m512 acc[DEQ_ROWS];
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int i = 0; i < M; i++) acc[i] = b0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = block_q(w, bits, has_m, b);
        const uint16_t *ds = block_d(w, bits, has_m, b);
        _mm_prefetch((const char *)(wb + 4 * bb), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + 4 * bb + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + 4 * bb + 256), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ds));
        const __m512 m = has_m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ds + 16)))
                               : _mm512_mul_ps(d, _mm512_set1_ps(m_per_d(bits)));
        for (int v = 0; v < 8; v++) {
            /* vector v: 4 bits, v < 4 the low nibbles of vector v, else the high ones of v - 4 */
            const __m512i raw = _mm512_loadu_si512(wb + 64 * (bits == 4 ? v % 4 : v));
            const __m512i q = bits == 8 ? raw : v < 4 ? _mm512_and_si512(raw, low) : _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            const __m512i g = _mm512_permutexvar_epi8(perm, q);
            const int64_t k0 = b * QBLOCK + 4 * v;
            DEQ_INPUT(0);
            DEQ_INPUT(1);
            DEQ_INPUT(2);
            DEQ_INPUT(3);
        }
    }
    for (int i = 0; i < M; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

static void panel_deq_rows(const float *x, int64_t ldx, int64_t K, const uint8_t *w, int bits, int has_m,
                           const float *bias, float *y, int64_t ldy, int64_t M) {
#define DCASE(rows)                                                                          \
    case rows:                                                                               \
        if (has_m) panel_deq(x, ldx, K, w, 4, 1, bias, y, ldy, rows);                       \
        else if (bits == 4) panel_deq(x, ldx, K, w, 4, 0, bias, y, ldy, rows);              \
        else panel_deq(x, ldx, K, w, 8, 0, bias, y, ldy, rows);                             \
        break;
    switch (M) { DCASE(1) DCASE(2) DCASE(3) DCASE(4) }
#undef DCASE
}

#define QCASE(rows)                                                                 \
    case rows:                                                                      \
        if (has_m) panel_vnni(xq, dx, sx, K, w, 4, 1, bias, y, ldy, rows);          \
        else if (bits == 4) panel_vnni(xq, dx, sx, K, w, 4, 0, bias, y, ldy, rows); \
        else panel_vnni(xq, dx, sx, K, w, 8, 0, bias, y, ldy, rows);                \
        break;

static void panel_vnni_rows(const int8_t *xq, const float *dx, const float *sx, int64_t K, const uint8_t *w,
                            int bits, int has_m, const float *bias, float *y, int64_t ldy, int64_t M) {
    switch (M) { QCASE(1) QCASE(2) QCASE(3) QCASE(4) QCASE(5) QCASE(6) QCASE(7) QCASE(8) }
}
#pragma GCC pop_options

static int have_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}
static int have_vbmi(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vbmi");
}
static int have_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
static int have_vnni(void) { return 0; }
static int have_vbmi(void) { return 0; }
static int have_avx2(void) { return 0; }
static void panel_avx2_rows(const int8_t *xq, const float *dx, const float *sx, const int32_t *sq, int64_t K,
                            const uint8_t *w, int bits, int has_m, const float *bias, float *y, int64_t ldy,
                            int64_t M) {
    (void)sq;
    panel_portable(xq, dx, sx, K, w, bits, has_m, bias, y, ldy, M);
}
static void panel_deq_rows(const float *x, int64_t ldx, int64_t K, const uint8_t *w, int bits, int has_m,
                           const float *bias, float *y, int64_t ldy, int64_t M) {}
static void panel_vnni_rows(const int8_t *xq, const float *dx, const float *sx, int64_t K, const uint8_t *w,
                            int bits, int has_m, const float *bias, float *y, int64_t ldy, int64_t M) {
    panel_portable(xq, dx, sx, K, w, bits, has_m, bias, y, ldy, M);
}
#endif

/* The path that runs: the fastest this CPU has, up to `most`. */
static int path_in_force(void) {
    if (most >= PATH_VNNI && have_vnni()) return PATH_VNNI;
    if (most >= PATH_AVX2 && have_avx2()) return PATH_AVX2;
    return PATH_PORTABLE;
}

/* The path the quantized matmul runs: 0 the portable loop, 1 AVX2 (with FMA and F16C), 2
 * AVX512-VNNI. `limit` >= 0 allows none faster than it from now on (tests force the slower ones;
 * 2: the fastest the CPU has); below 0 it only asks. */
int quant_matmul_path(int limit) {
    if (limit >= 0) most = limit;
    return path_in_force();
}

/* Steps of at most `rows` rows (<= DEQ_ROWS) take the float32 path where the CPU has AVX512-VBMI;
 * returns the limit in force (0: none). */
int quant_matmul_dequant_rows(int rows) {
    dequant_rows = rows < 0 ? 0 : rows > DEQ_ROWS ? DEQ_ROWS : rows;
    /* (An AVX-512 path: taken only where the VNNI one is allowed, quant_share.) */
    if (!have_vbmi()) dequant_rows = 0;
    return dequant_rows;
}

/* Panel p of a packed weight: the weight's first line holds its layout (int64 words): panels per
 * part, then the bytes from one part's first panel to the next one's; part 0's panels follow the
 * line. One part (pack): [line][panels]. Cut for n threads (cpu_quant.thread_major): part t,
 * panels [t c, (t + 1) c) with c = ceil(panels / n), lies among thread t's parts of every matrix
 * of the step, end to end. */
static inline const uint8_t *panel_at(const uint8_t *w, int64_t p, int64_t pb) {
    const int64_t *layout = (const int64_t *)w;
    return w + 64 + p / layout[0] * layout[1] + p % layout[0] * pb;
}

/* Thread t of nt's panels, [*p0, *p1): part t where the weight is cut for nt threads. */
static inline void thread_panels(int64_t num_panels, int t, int nt, int64_t *p0, int64_t *p1) {
    const int64_t per = (num_panels + nt - 1) / nt, first = t * per < num_panels ? t * per : num_panels;
    *p0 = first;
    *p1 = first + per < num_panels ? first + per : num_panels;
}

/* Rows [m0, m0 + rows) of panel p, on `path`. */
static inline void rows_by_panel(const int8_t *xq, const float *dx, const float *sx, const int32_t *sq, int64_t K,
                                 const uint8_t *w, int64_t p, int64_t pb, int bits, int has_m, const float *bias,
                                 float *y, int64_t ldy, int64_t m0, int64_t rows, int path) {
    const int64_t nb = K / QBLOCK;
    const float *bp = bias ? bias + p * 16 : 0;
    float *yr = y + m0 * ldy + p * 16;
    const uint8_t *wp = panel_at(w, p, pb);
    if (path == PATH_VNNI) panel_vnni_rows(xq + m0 * K, dx + m0 * nb, sx + m0 * nb, K, wp, bits, has_m, bp, yr, ldy, rows);
    else if (path == PATH_AVX2)
        panel_avx2_rows(xq + m0 * K, dx + m0 * nb, sx + m0 * nb, sq + m0 * nb, K, wp, bits, has_m, bp, yr, ldy, rows);
    else panel_portable(xq + m0 * K, dx + m0 * nb, sx + m0 * nb, K, wp, bits, has_m, bp, yr, ldy, rows);
}

/* One thread's share of a matmul, on a team of threads all calling it: xq, dx: this thread's int8
 * copy of x and its scales (then the scaled sums, then the sums: 3 M K / 32 words), where `own` (each thread quantizes every row itself, so the threads
 * meet only at the end), else the team's one copy, which the team quantizes row by row first. */
static void quant_share(const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, int bits, int has_m, int own, int8_t *xq, float *dx) {
    const int64_t nb = K / QBLOCK, num_panels = N / 16, pb = panel_bytes(bits, has_m, nb);
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int path = path_in_force();
    if (M <= dequant_rows && path == PATH_VNNI) {
        int64_t p0, p1;
        thread_panels(num_panels, t, nt, &p0, &p1);
        for (int64_t p = p0; p < p1; p++)
            panel_deq_rows(x, ldx, K, panel_at(w, p, pb), bits, has_m, bias ? bias + p * 16 : 0, y + p * 16, ldy, M);
        return;
    }
    float *sx = dx + M * nb;
    int32_t *sq = (int32_t *)(dx + 2 * M * nb);
    if (own) {
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, xq + r * K, dx + r * nb, sx + r * nb, sq + r * nb);
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, xq + r * K, dx + r * nb, sx + r * nb, sq + r * nb);
    }
    const int64_t groups = (M + QTILE - 1) / QTILE, group = (M + groups - 1) / groups;
    if (groups == 1) { /* each thread its part of the panels (one stream across the step's matrices) */
        int64_t p0, p1;
        thread_panels(num_panels, t, nt, &p0, &p1);
        for (int64_t p = p0; p < p1; p++) rows_by_panel(xq, dx, sx, sq, K, w, p, pb, bits, has_m, bias, y, ldy, 0, M, path);
    } else { /* this thread's run of the (row group, panel) items, in equal runs */
        const int64_t items = groups * num_panels;
        for (int64_t item = items * t / nt; item < items * (t + 1) / nt; item++) {
            const int64_t m0 = item / num_panels * group, p = item % num_panels, rows = M - m0 < group ? M - m0 : group;
            if (rows > 0) rows_by_panel(xq, dx, sx, sq, K, w, p, pb, bits, has_m, bias, y, ldy, m0, rows, path);
        }
    }
}

/* x: [M, K] rows ldx apart; w: packed (its layout line, then N / 16 panels of panel_bytes each,
 * in one part or several); bias: [N] or NULL; y: [M, N] rows ldy apart. N % 16 == K % 32 == 0.
 * Called inside a parallel region (decode_step.c), every thread of the team calls it and it
 * returns, y complete, on every thread after they meet; elsewhere it runs on num_threads threads
 * of its own. Returns -1 (y incomplete) without memory for xq. */
static int linear_quant(const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, int num_threads, int bits, int has_m) {
    if (M <= 0) return 0;
    const int64_t nb = K / QBLOCK, xq_size = (M * K + 63) / 64 * 64, dx_size = 3 * M * nb;
    /* A few rows: every thread quantizes them all into its own copy, so the threads meet only
     * once, at the end (decode steps run ~10 such matmuls a layer). More rows are split. A member
     * of the caller's team has its own copy (each member calls this). */
    const int team = omp_in_parallel(), own = team || (M <= QTILE && num_threads > 1);
    const int copies = own && !team ? num_threads : 1;
    int8_t *xq_all = aligned_alloc(64, (size_t)(xq_size * copies));
    float *dx_all = malloc(sizeof(float) * dx_size * copies);
    const int ok = xq_all && dx_all;
#define COPY (copies > 1 ? omp_get_thread_num() : 0)
    if (ok)
        ON_TEAM(num_threads, quant_share(x, ldx, w, bias, y, ldy, M, N, K, bits, has_m, own, xq_all + COPY * xq_size,
                                         dx_all + COPY * dx_size));
#undef COPY
    free(xq_all);
    free(dx_all);
    if (team) {
#pragma omp barrier
    }
    return ok ? 0 : -1;
}

/* Q4_1: 4 bits, d and m. */
int linear_q4(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy, int64_t M,
              int64_t N, int64_t K, int num_threads) {
    return linear_quant(x, ldx, w, bias, y, ldy, M, N, K, num_threads, 4, 1);
}

/* Q4_0: 4 bits, d alone. */
int linear_q4_0(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K, int num_threads) {
    return linear_quant(x, ldx, w, bias, y, ldy, M, N, K, num_threads, 4, 0);
}

/* Q8_0: 8 bits, d alone. */
int linear_q8(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t ldy, int64_t M,
              int64_t N, int64_t K, int num_threads) {
    return linear_quant(x, ldx, w, bias, y, ldy, M, N, K, num_threads, 8, 0);
}
