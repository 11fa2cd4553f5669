/*
 * The small per-layer ops of a decoder step, each one pass over its rows: RMSNorm (with the residual add
 * fused in; per head in place for q/k norms), rotary embedding in place, the gated MLP activations
 * silu(gate) * up (SwiGLU) and gelu_tanh(gate) * up (Gemma). At decode sizes torch spends more time
 * dispatching the 5-10 tensor ops each of these is made of than computing them (docs/performance.md).
 * Arithmetic is float32 in the order of the reference formulas. Layouts are row-major with a row stride,
 * last dimension contiguous.
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

static inline float inverse_rms(const float *x, int64_t dim, float eps) {
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t d = 0; d < dim; ++d) total += x[d] * x[d];
    return 1.f / sqrtf(total / (float)dim + eps);
}

/* out[r] = weight * x[r] / rms(x[r]) */
void rms_norm_f32(const float *x, int64_t rows, int64_t dim, const float *weight, float eps, float *out,
                  int num_threads) {
#pragma omp parallel for if (rows >= 64) num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const float inv = inverse_rms(xr, dim, eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = weight[d] * (xr[d] * inv);
    }
}

/* residual[r] += delta[r]; out[r] = weight * residual[r] / rms(residual[r]) */
void add_rms_norm_f32(float *residual, const float *delta, int64_t rows, int64_t dim, const float *weight,
                      float eps, float *out, int num_threads) {
#pragma omp parallel for if (rows >= 64) num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        float *xr = residual + r * dim;
        const float *dr = delta + r * dim;
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) xr[d] += dr[d];
        const float inv = inverse_rms(xr, dim, eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = weight[d] * (xr[d] * inv);
    }
}

/* In place, each head of each row: x[r, h] = weight * x[r, h] / rms(x[r, h]) (q/k norms: Qwen3, Gemma 3).
 * Rows are row_stride floats apart, heads head_dim apart: q and k may be views into a fused q/k/v product.
 * A head is normed exactly as rms_norm_f32 norms a row of head_dim. */
void head_rms_norm_f32(float *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                       const float *weight, float eps, int num_threads) {
#pragma omp parallel for if (rows >= 64) num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < heads; ++h) {
            float *v = x + r * row_stride + h * head_dim;
            const float inv = inverse_rms(v, head_dim, eps);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) v[d] = weight[d] * (v[d] * inv);
        }
    }
}

/* x[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t], in place ("rotate half": HF's convention).
 * x rows are row_stride floats apart, heads head_dim apart; cos, sin are [rows, head_dim]. */
void rotary_f32(float *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride, const float *cos,
                const float *sin, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (rows >= 64) num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            float *v = x + t * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < half; ++d) {
                const float lo = v[d], hi = v[d + half];
                v[d] = lo * c[d] + (-hi) * s[d];
                v[d + half] = hi * c[d + half] + lo * s[d + half];
            }
        }
    }
}

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o,
                         int64_t inner) {
#pragma omp simd
    for (int64_t i = 0; i < inner; ++i) o[i] = g[i] / (1.f + vec_expf(-g[i])) * u[i];
}

/* gelu_tanh(g) * u with gelu_tanh(g) = g / 2 (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), written as
 * g / (1 + exp(-2u)) (the same value: 1 + tanh(u) = 2 / (1 + exp(-2u))), which has no cancellation for
 * negative g and overflows to the right limits (0 and g) through vec_expf's clamp. */
static void gelu_tanh_mul_row(const float *restrict g, const float *restrict u, float *restrict o,
                              int64_t inner) {
#pragma omp simd
    for (int64_t i = 0; i < inner; ++i) {
        const float x = g[i];
        const float inner_arg = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        o[i] = x / (1.f + vec_expf(-2.f * inner_arg)) * u[i];
    }
}

/* out[r, i] = act(gate[r, i]) * up[r, i]; gate and up rows are row_stride floats apart (views of one
 * [rows, 2 inner] product: row_stride 2 inner; two separate products: inner). activation: 0 silu, 1
 * gelu_tanh. Returns -1 for another activation. */
int gated_act_f32(const float *gate, const float *up, int64_t rows, int64_t inner, int64_t row_stride,
                  int activation, float *out, int num_threads) {
    if (activation != 0 && activation != 1) return -1;
#pragma omp parallel for if (rows >= 64) num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        if (activation == 0)
            silu_mul_row(gate + r * row_stride, up + r * row_stride, out + r * inner, inner);
        else
            gelu_tanh_mul_row(gate + r * row_stride, up + r * row_stride, out + r * inner, inner);
    }
    return 0;
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inner + i] */
void silu_mul_f32(const float *gate_up, int64_t rows, int64_t inner, float *out, int num_threads) {
    gated_act_f32(gate_up, gate_up + inner, rows, inner, 2 * inner, 0, out, num_threads);
}
