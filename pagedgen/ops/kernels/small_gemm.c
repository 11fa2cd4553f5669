/*
 * fp32 GEMM for decode-sized batches: y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for a few rows m.
 *
 * Why: at 1-16 rows a linear layer is a stream of its weight matrix; MKL does not thread it and OpenBLAS
 * threads only the larger shapes in its own pool (docs/performance.md). Here each thread of torch's OpenMP
 * pool streams a contiguous slice of weight rows once and computes every x row against them while the
 * rows sit in L1. Each output is one thread's fixed-order sum, so results do not depend on the thread
 * count or on which other rows share the batch.
 *
 * Layouts: x [m_rows, k], w [n_out, k], y [m_rows, n_out], bias [n_out] or NULL; all contiguous.
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

void small_gemm_f32(const float *x, int64_t m_rows, const float *w, int64_t k, int64_t n_out,
                    const float *bias, float *y, int num_threads) {
    const int64_t quads = n_out / 4;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < quads; ++q) four_outputs(x, m_rows, w, k, bias, y, n_out, 4 * q);
#pragma omp for schedule(static)
        for (int64_t n = 4 * quads; n < n_out; ++n) one_output(x, m_rows, w, k, bias, y, n_out, n);
    }
}
