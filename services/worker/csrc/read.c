/* One streaming read of a buffer: what `superinfer bench quant` times, beside torch's sum of the
 * same buffer, for the memory-bandwidth limit of a decode step (bench/micro/quant.py). The 64-bit
 * words are summed (so that the loads are not optimised away) in eight lanes, one 64-byte line a
 * vector add: far less work than the loads, which bound it. */
#include <omp.h>

#include "kernels.h"

/* Sum of the n / 8 words at p (p 64-byte aligned, n a multiple of 64), split over num_threads
 * threads in contiguous shares. */
uint64_t read_words(const uint64_t *p, int64_t n, int num_threads) {
    const int64_t lines = n / 64;
    uint64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const uint64_t *line = p + 8 * (lines * t / nt), *end = p + 8 * (lines * (t + 1) / nt);
        uint64_t lane[8] = {0}; /* one vector register: an array shared by the team would go through memory */
        for (; line < end; line += 8)
            for (int j = 0; j < 8; j++) lane[j] += line[j];
        for (int j = 0; j < 8; j++) total += lane[j];
    }
    return total;
}

/* The time a cache line takes from one thread to another, in ns: two threads pass a counter back
 * and forth `rounds` times, each waiting for the other's write. On a 2-core virtual machine
 * whose host moves its cores it reads ~40 ns where the two share a cache and ~170 ns where they
 * do not; `superinfer bench quant` records it beside each round's read, since every place a
 * step's threads meet costs accordingly. 0 on one core. */
double core_latency_ns(int rounds) {
    static volatile int64_t turn __attribute__((aligned(64)));
    double ns = 0.0;
    if (omp_get_num_procs() < 2) return ns; /* two spinning threads on one core would take turns by the scheduler */
    turn = 0;
#pragma omp parallel num_threads(2)
    if (omp_get_num_threads() == 2) {
        const int me = omp_get_thread_num();
#pragma omp barrier
        const double start = omp_get_wtime();
        for (int64_t i = 0; i < rounds; i++) {
            while (turn != 2 * i + me) {
            }
            turn = 2 * i + me + 1;
        }
        if (me == 0) ns = (omp_get_wtime() - start) / (2.0 * rounds) * 1e9;
    }
    return ns;
}
