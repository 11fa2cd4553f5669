/*
 * The barrier the fused decode step's threads meet at (decoder_layers.c: five per layer, 150 per step of a
 * 30-layer model): spin for a short while, then sleep until the last thread arrives.
 *
 * Why not `#pragma omp barrier`: libgomp's barrier spins for GOMP_SPINCOUNT (300,000 pauses, several
 * milliseconds on the cores measured) before it sleeps. When another process takes one of the cores, the
 * thread that waits keeps its core spinning while the thread it waits for sits in the run queue, and every
 * barrier then costs about a scheduler time slice: on a 2-core machine with one busy process beside it, a
 * decode step of the default model took 620 ms instead of 12. Here a waiting thread spins for at most
 * SPIN_NS and then sleeps in the kernel (a futex), which frees its core for the thread it waits for. On a
 * quiet machine the waits are a few microseconds, well inside the spin, so nothing changes there.
 *
 * Linux only (futex); elsewhere the OpenMP barrier is used. Ordering: the last thread's release of the
 * generation publishes every thread's writes before the barrier to every thread after it (each arrival is
 * an acq_rel read-modify-write of the count).
 */
#ifndef PAGEDGEN_STEP_BARRIER_H
#define PAGEDGEN_STEP_BARRIER_H

/* How long a waiting thread spins before it sleeps, unless the caller says otherwise. */
#define SPIN_NS 100000

#if defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define STEP_BARRIER_PAUSE() _mm_pause()
#else
#define STEP_BARRIER_PAUSE() ((void)0)
#endif

typedef struct {
    atomic_int arrived;  /* threads at the barrier of the current generation */
    atomic_uint gen;     /* bumped by the last thread of each generation (the futex word) */
    atomic_int sleepers; /* threads in futex_wait on gen */
    atomic_long naps;    /* waits that stopped spinning (counted for the tests) */
    int threads;
    int64_t spin_ns;
} step_barrier;

static inline void step_barrier_init(step_barrier *b, int threads, int64_t spin_ns) {
    atomic_init(&b->arrived, 0);
    atomic_init(&b->gen, 0);
    atomic_init(&b->sleepers, 0);
    atomic_init(&b->naps, 0);
    b->threads = threads;
    b->spin_ns = spin_ns;
}

static inline int64_t barrier_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void step_barrier_wait(step_barrier *b) {
    const unsigned gen = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add(&b->gen, 1); /* seq_cst: ordered before the read of sleepers */
        if (atomic_load(&b->sleepers) > 0) syscall(SYS_futex, &b->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        return;
    }
    const int64_t until = barrier_now_ns() + b->spin_ns;
    for (int i = 0;; ++i) {
        if (atomic_load_explicit(&b->gen, memory_order_acquire) != gen) return;
        if (i % 64 == 0 && barrier_now_ns() >= until) break;
        STEP_BARRIER_PAUSE();
    }
    atomic_fetch_add_explicit(&b->naps, 1, memory_order_relaxed);
    atomic_fetch_add(&b->sleepers, 1); /* seq_cst: a last thread that missed this has already bumped gen */
    while (atomic_load(&b->gen) == gen)
        syscall(SYS_futex, &b->gen, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
    atomic_fetch_sub(&b->sleepers, 1);
}

#else
#include <omp.h>
#include <stdint.h>

typedef struct {
    int threads;
    long naps;
} step_barrier;

static inline void step_barrier_init(step_barrier *b, int threads, int64_t spin_ns) {
    (void)spin_ns;
    b->threads = threads, b->naps = 0;
}

static inline void step_barrier_wait(step_barrier *b) {
    (void)b;
#pragma omp barrier
}
#endif

#endif
