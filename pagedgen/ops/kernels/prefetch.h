/*
 * Asking for a group's weight rows while the group before it computes. A batch-1 GEMM streams its weights
 * once, and the one-row kernels (quant_gemm.c's register paths, quant_q8.c's integer dot products) do enough
 * arithmetic between their loads that the core keeps too few misses in flight to stream DRAM on its own.
 * Asked for as one burst before each group, 40-50 lines fill the core's miss buffers and the loads behind
 * them wait for DRAM with nothing else in flight; asked for a slice per step of the group's loop, the misses
 * overlap the arithmetic. Measured (AVX2 EPYC, from DRAM, the same bits): a Q4_1 group took 0.80-0.85x the
 * time of the burst, Q5_0/Q5_1 0.6x, Q4_K 0.73x, Q6_K's chunk buffer 0.75x, the Q8_0 head 0.75-0.85x; the
 * default model's fused decode layers 0.74-0.81x (docs/performance.md, "Prefetch spread over the loop").
 * Asking changes no value.
 */
#ifndef PAGEDGEN_PREFETCH_H
#define PAGEDGEN_PREFETCH_H

#include <stddef.h>
#include <stdint.h>

/* Bytes [p, p + len) asked for `per` bytes at a time (a multiple of 64; len 0: nothing). */
typedef struct {
    const uint8_t *p;
    int64_t len, per;
} ahead_window;

/* The rows of the group `ahead` rows on from row n (rows of them, stopping at n_out), spread over `steps`
 * steps. */
static inline ahead_window window_ahead(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t n_out, int rows,
                                        int64_t ahead, int64_t steps) {
    const int64_t first = n + ahead, last = first + rows < n_out ? first + rows : n_out;
    ahead_window a = {NULL, 0, 0};
    if (first >= last || steps <= 0) return a;
    a.p = w + first * row_bytes, a.len = (last - first) * row_bytes;
    a.per = ((a.len + steps - 1) / steps + 63) / 64 * 64;
    return a;
}

/* Step i's slice of the window (the prefetcht2 hint). */
static inline __attribute__((always_inline)) void ask_step(const ahead_window *a, int64_t i) {
    const int64_t end = (i + 1) * a->per < a->len ? (i + 1) * a->per : a->len;
    for (int64_t o = i * a->per; o < end; o += 64) __builtin_prefetch(a->p + o, 0, 1);
}

#endif
