/* The limits the kernels are built for, read once by services/worker/cpu_kernels.py (so Python
 * never keeps its own copy of a #define). */
#include "kernels.h"

/* Writes up to n of: max heads, max head size, panel columns, prefill keys per pass, prefill rows
 * per tile, AMX tile columns, AMX tile inputs, quantization block; returns how many there are. */
int64_t kernel_limits(int64_t *out, int64_t n) {
    const int64_t limits[] = {MAX_HEADS, MAX_HEAD_DIM, PANEL, PF_KEYS, PF_ROWS, AMX_N, AMX_K, QBLOCK};
    const int64_t count = sizeof limits / sizeof limits[0];
    for (int64_t i = 0; i < n && i < count; i++) out[i] = limits[i];
    return count;
}
