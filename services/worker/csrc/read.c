/* One streaming read of a buffer, the fastest this library reads memory: what `superinfer bench
 * quant` times as the memory-bandwidth limit of a decode step (bench/micro/quant.py). The 64-bit
 * words are summed (so that the loads are not optimised away) in eight lanes, one 64-byte line a
 * vector add: far less work than the loads, which bound it. */
#include "kernels.h"

/* Sum of the n / 8 words at p (p 64-byte aligned, n a multiple of 64), split over num_threads
 * threads in contiguous shares. */
uint64_t read_words(const uint64_t *p, int64_t n, int num_threads) {
    const int64_t lines = n / 64;
    uint64_t lane[8] = {0};
#pragma omp parallel for schedule(static) reduction(+ : lane[:8]) num_threads(num_threads)
    for (int64_t i = 0; i < lines; i++)
        for (int j = 0; j < 8; j++) lane[j] += p[8 * i + j];
    uint64_t total = 0;
    for (int j = 0; j < 8; j++) total += lane[j];
    return total;
}
