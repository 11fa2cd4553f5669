/*
 * fp32 GEMM for decode-sized batches: y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for a few rows m.
 *
 * Why: at 1-64 rows a linear layer is a stream of its weight matrix; MKL does not always thread it and
 * OpenBLAS threads it in its own pool (docs/performance.md). Here each thread of torch's OpenMP pool streams
 * a contiguous slice of weight rows once and computes every x row against them while the rows sit in
 * cache. Each output is one thread's fixed-order sum, so results do not depend on the thread count or on
 * which other rows share the batch. Whether this kernel or a library runs is decided per machine by
 * measurement (pagedgen/ops/matmul/gemm_calibrate.py), not here.
 *
 * Layouts: x [m_rows, k], w [n_out, k], y [m_rows, n_out], bias [n_out] or NULL; all contiguous.
 *
 * Variants, chosen at compile time for the host (-march=native) and then by k alone, never by m_rows:
 * - AVX-512F and k a multiple of 16: a 6 x 4 register tile of 16-wide accumulators (24 of the 32 zmm
 *   registers, ten loads per 24 FMAs);
 * - AVX2/FMA and k a multiple of 8: a 3 x 4 tile of 8-wide accumulators (twelve of the 16 ymm registers);
 * - otherwise a portable loop the compiler vectorises.
 * small_gemm_variant(k) names the one a call with that k takes.
 */
#include <stdint.h>

/* Four weight rows n .. n + 3 against every x row: four independent accumulator chains per x row. (Two x
 * rows at a time, eight chains, measured no faster at 16 rows and slower at 32.) */
static inline __attribute__((always_inline)) void four_outputs(const float *x, int64_t m_rows, const float *w,
                                                               int64_t k, const float *bias, float *y,
                                                               int64_t n_out, int64_t n) {
    const float *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    for (int64_t m = 0; m < m_rows; ++m) {
        const float *xm = x + m * k;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < k; ++d) {
            s0 += xm[d] * w0[d];
            s1 += xm[d] * w1[d];
            s2 += xm[d] * w2[d];
            s3 += xm[d] * w3[d];
        }
        float *ym = y + m * n_out + n;
        ym[0] = bias ? s0 + bias[n] : s0;
        ym[1] = bias ? s1 + bias[n + 1] : s1;
        ym[2] = bias ? s2 + bias[n + 2] : s2;
        ym[3] = bias ? s3 + bias[n + 3] : s3;
    }
}

static void one_output(const float *x, int64_t m_rows, const float *w, int64_t k, const float *bias, float *y,
                       int64_t n_out, int64_t n) {
    const float *wn = w + n * k;
    for (int64_t m = 0; m < m_rows; ++m) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < k; ++d) s += x[m * k + d] * wn[d];
        y[m * n_out + n] = bias ? s + bias[n] : s;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "hsum.h"


static inline float with_bias(float s, const float *bias, int64_t n) { return bias ? s + bias[n] : s; }

/* A 3 x 4 register tile: x rows m .. m + 2 (mr of them valid) against weight rows n .. n + 3, eight k at
 * a time in twelve accumulators. Each output's sum runs in the same order whatever mr is, so a row's result
 * does not depend on its neighbours. k is a multiple of 8. */
static inline __attribute__((always_inline)) void tile_3x4(const float *x, int64_t k, const float *w,
                                                           const float *bias, float *y, int64_t n_out,
                                                           int64_t m, int64_t n, const int mr) {
    const float *x0 = x + m * k, *x1 = mr > 1 ? x0 + k : x0, *x2 = mr > 2 ? x0 + 2 * k : x0;
    const float *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t d = 0; d < k; d += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + d), v1 = _mm256_loadu_ps(x1 + d), v2 = _mm256_loadu_ps(x2 + d);
        __m256 b = _mm256_loadu_ps(w0 + d);
        a00 = _mm256_fmadd_ps(v0, b, a00), a10 = _mm256_fmadd_ps(v1, b, a10), a20 = _mm256_fmadd_ps(v2, b, a20);
        b = _mm256_loadu_ps(w1 + d);
        a01 = _mm256_fmadd_ps(v0, b, a01), a11 = _mm256_fmadd_ps(v1, b, a11), a21 = _mm256_fmadd_ps(v2, b, a21);
        b = _mm256_loadu_ps(w2 + d);
        a02 = _mm256_fmadd_ps(v0, b, a02), a12 = _mm256_fmadd_ps(v1, b, a12), a22 = _mm256_fmadd_ps(v2, b, a22);
        b = _mm256_loadu_ps(w3 + d);
        a03 = _mm256_fmadd_ps(v0, b, a03), a13 = _mm256_fmadd_ps(v1, b, a13), a23 = _mm256_fmadd_ps(v2, b, a23);
    }
    const __m256 acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 4; ++c) y[(m + r) * n_out + n + c] = with_bias(hsum8_ps(acc[r][c]), bias, n + c);
}

/* One weight row against one x row with the tile's arithmetic (one accumulator, eight k at a time). */
static inline void tile_1x1(const float *x, int64_t k, const float *w, const float *bias, float *y,
                            int64_t n_out, int64_t m, int64_t n) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < k; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + d), _mm256_loadu_ps(w + n * k + d), a);
    y[m * n_out + n] = with_bias(hsum8_ps(a), bias, n);
}

/* Weight rows per task: streamed from memory once, then reused from cache by every x row. 32 splits the
 * model's shapes evenly between two threads (6% faster than 64 at 32 rows). */
#define N_BLOCK 32

static void tiled_gemm(const float *x, int64_t m_rows, const float *w, int64_t k, int64_t n_out,
                       const float *bias, float *y, int num_threads) {
    const int64_t blocks = (n_out + N_BLOCK - 1) / N_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t n0 = blk * N_BLOCK, n1 = n0 + N_BLOCK < n_out ? n0 + N_BLOCK : n_out;
        const int64_t quads_end = n0 + (n1 - n0) / 4 * 4;
        for (int64_t m = 0; m < m_rows; m += 3) {
            const int mr = m_rows - m >= 3 ? 3 : (int)(m_rows - m);
            /* A constant mr lets the compiler drop the unused accumulators of a short last tile. */
            for (int64_t n = n0; n < quads_end; n += 4) {
                if (mr == 3)
                    tile_3x4(x, k, w, bias, y, n_out, m, n, 3);
                else if (mr == 2)
                    tile_3x4(x, k, w, bias, y, n_out, m, n, 2);
                else
                    tile_3x4(x, k, w, bias, y, n_out, m, n, 1);
            }
            for (int64_t n = quads_end; n < n1; ++n)
                for (int r = 0; r < mr; ++r) tile_1x1(x, k, w, bias, y, n_out, m + r, n);
        }
    }
}

#if defined(__AVX512F__)
/* Rows of x per AVX-512 tile: 6 x 4 accumulators + 6 x loads + 1 weight load fit the 32 zmm registers. */
#define MR16 6

/* x rows m .. m + mr - 1 against weight rows n .. n + 3, sixteen k at a time. Each output's sum is one
 * accumulator chain over k in steps of 16, then _mm512_reduce_add_ps: the same order whatever mr is, so a
 * row's result does not depend on its neighbours. The loops over r and c are unrolled with mr a constant
 * (see tiled_gemm16), so the accumulators live in registers. k is a multiple of 16. */
static inline __attribute__((always_inline)) void tile_mr_x4_16(const float *x, int64_t k, const float *w,
                                                                const float *bias, float *y, int64_t n_out,
                                                                int64_t m, int64_t n, const int mr) {
    const float *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    const float *xr[MR16];
    __m512 acc[MR16][4];
#pragma GCC unroll 6
    for (int r = 0; r < MR16; ++r) {
        xr[r] = x + (m + (r < mr ? r : 0)) * k;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < k; d += 16) {
        __m512 v[MR16];
#pragma GCC unroll 6
        for (int r = 0; r < MR16; ++r)
            if (r < mr) v[r] = _mm512_loadu_ps(xr[r] + d);
        const float *wc[4] = {w0, w1, w2, w3};
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m512 b = _mm512_loadu_ps(wc[c] + d);
#pragma GCC unroll 6
            for (int r = 0; r < MR16; ++r)
                if (r < mr) acc[r][c] = _mm512_fmadd_ps(v[r], b, acc[r][c]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR16; ++r)
        if (r < mr)
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c)
                y[(m + r) * n_out + n + c] = with_bias(_mm512_reduce_add_ps(acc[r][c]), bias, n + c);
}

/* One weight row against one x row with the tile's arithmetic (one accumulator, sixteen k at a time). */
static inline void tile_1x1_16(const float *x, int64_t k, const float *w, const float *bias, float *y,
                               int64_t n_out, int64_t m, int64_t n) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < k; d += 16)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + d), _mm512_loadu_ps(w + n * k + d), a);
    y[m * n_out + n] = with_bias(_mm512_reduce_add_ps(a), bias, n);
}

static void tiled_gemm16(const float *x, int64_t m_rows, const float *w, int64_t k, int64_t n_out,
                         const float *bias, float *y, int num_threads) {
    const int64_t blocks = (n_out + N_BLOCK - 1) / N_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t n0 = blk * N_BLOCK, n1 = n0 + N_BLOCK < n_out ? n0 + N_BLOCK : n_out;
        const int64_t quads_end = n0 + (n1 - n0) / 4 * 4;
        for (int64_t m = 0; m < m_rows; m += MR16) {
            const int mr = m_rows - m >= MR16 ? MR16 : (int)(m_rows - m);
            for (int64_t n = n0; n < quads_end; n += 4) {
                switch (mr) { /* a constant mr per call site: unused accumulators are dropped */
                case 6: tile_mr_x4_16(x, k, w, bias, y, n_out, m, n, 6); break;
                case 5: tile_mr_x4_16(x, k, w, bias, y, n_out, m, n, 5); break;
                case 4: tile_mr_x4_16(x, k, w, bias, y, n_out, m, n, 4); break;
                case 3: tile_mr_x4_16(x, k, w, bias, y, n_out, m, n, 3); break;
                case 2: tile_mr_x4_16(x, k, w, bias, y, n_out, m, n, 2); break;
                default: tile_mr_x4_16(x, k, w, bias, y, n_out, m, n, 1); break;
                }
            }
            for (int64_t n = quads_end; n < n1; ++n)
                for (int r = 0; r < mr; ++r) tile_1x1_16(x, k, w, bias, y, n_out, m + r, n);
        }
    }
}
#endif
#endif

void small_gemm_f32(const float *x, int64_t m_rows, const float *w, int64_t k, int64_t n_out,
                    const float *bias, float *y, int num_threads) {
    /* The choice depends on k only, never on m_rows: a row gets the same bits in any batch. */
#if defined(__AVX512F__)
    if (k % 16 == 0) {
        tiled_gemm16(x, m_rows, w, k, n_out, bias, y, num_threads);
        return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (k % 8 == 0) {
        tiled_gemm(x, m_rows, w, k, n_out, bias, y, num_threads);
        return;
    }
#endif
    const int64_t quads = n_out / 4;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < quads; ++q) four_outputs(x, m_rows, w, k, bias, y, n_out, 4 * q);
#pragma omp for schedule(static)
        for (int64_t n = 4 * quads; n < n_out; ++n) one_output(x, m_rows, w, k, bias, y, n_out, n);
    }
}

/* Which variant small_gemm_f32 runs for this k: 2 AVX-512 6 x 4 tile, 1 AVX2 3 x 4 tile, 0 portable. */
int small_gemm_variant(int64_t k) {
#if defined(__AVX512F__)
    if (k % 16 == 0) return 2;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (k % 8 == 0) return 1;
#endif
    return 0;
}
