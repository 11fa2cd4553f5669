/*
 * Paged decode attention for fp32 CPU caches: one query token per row, keys and values read in place from
 * their cache blocks (no gathered copy of the history, which the pure-torch path must make every layer).
 *
 * Layouts (all contiguous):
 *   q, out      [num_tokens, num_q_heads, head_dim]     rows token_rows[r] are read / written
 *   k/v cache   [num_blocks, block_size, num_kv_heads, head_dim]
 *   tables      [num_rows, table_stride] int32           physical block of each logical block
 *   kv_lens     [num_rows] int32                          keys 0 .. kv_lens[r] - 1 are attended
 *   kv_starts   [num_rows] int32 or NULL                  (windowed variant) keys before kv_starts[r] are not
 * A sliding-window layer's table starts at the row's first live block, so its start is below block_size.
 * One task per row computes the scores of every query head (grouped-query attention: query head h reads
 * kv head h / (Hq / Hkv)), a float32 softmax, and the weighted sum of values. A row's blocks are read as
 * contiguous runs (a task per (row, kv head) read 256-byte pieces at a stride and was 1.5-2x slower). OpenMP threads come from the runtime torch loaded
 * (same soname), so torch.set_num_threads' count is passed in as num_threads.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

static inline __attribute__((always_inline)) void decode_row(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t start,
    int64_t len, int64_t q_heads, int64_t kv_heads, const int64_t head_dim, int64_t pos_stride, int64_t block_size,
    float scale, float *scores, int64_t score_stride, float *acc) {
    /* q_heads / kv_heads of the cache's kv heads (all of them, or one: paged_decode_qheads_f32 below); a
     * position's keys of every kv head are contiguous, pos_stride floats apart */
    const int64_t groups = q_heads / kv_heads;
    const int64_t block_stride = block_size * pos_stride;
    const int64_t count = len - start; /* attended keys; scores[h, p - start] */
    /* Pass 1: scores[h, p] = scale * q[h] . k[p, h / groups], block by block (no division per position).
     * With start = 0 (full attention) every index and operation is what it was before windows existed. */
    for (int64_t b = 0, p0 = 0; p0 < len; ++b, p0 += block_size) {
        const int64_t n = len - p0 < block_size ? len - p0 : block_size;
        if (p0 + n <= start) continue;
        const int64_t j0 = start > p0 ? start - p0 : 0;
        const float *kb = k_cache + (int64_t)table[b] * block_stride;
        for (int64_t j = j0; j < n; ++j) {
            const float *kp = kb + j * pos_stride;
            for (int64_t h = 0; h < q_heads; ++h) {
                const float *qh = q + h * head_dim;
                const float *kh = kp + (h / groups) * head_dim;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
                scores[h * score_stride + p0 + j - start] = s * scale;
            }
        }
    }
    /* Softmax of each query head's scores, in place. */
    for (int64_t h = 0; h < q_heads; ++h) {
        float *sh = scores + h * score_stride;
        float top = -FLT_MAX;
        for (int64_t p = 0; p < count; ++p) top = sh[p] > top ? sh[p] : top;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t p = 0; p < count; ++p) {
            sh[p] = vec_expf(sh[p] - top);
            total += sh[p];
        }
        const float inv = 1.f / total;
        for (int64_t p = 0; p < count; ++p) sh[p] *= inv;
    }
    /* Pass 2: acc[h] = sum_p probs[h, p] * v[p, h / groups]. */
    memset(acc, 0, sizeof(float) * (size_t)(q_heads * head_dim));
    for (int64_t b = 0, p0 = 0; p0 < len; ++b, p0 += block_size) {
        const int64_t n = len - p0 < block_size ? len - p0 : block_size;
        if (p0 + n <= start) continue;
        const int64_t j0 = start > p0 ? start - p0 : 0;
        const float *vb = v_cache + (int64_t)table[b] * block_stride;
        for (int64_t j = j0; j < n; ++j) {
            const float *vp = vb + j * pos_stride;
            for (int64_t h = 0; h < q_heads; ++h) {
                const float w = scores[h * score_stride + p0 + j - start];
                const float *vh = vp + (h / groups) * head_dim;
                float *ah = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) ah[d] += w * vh[d];
            }
        }
    }
}

/* Returns 0 on success, 1 if a thread could not allocate its score buffer (out is then incomplete).
 * kv_starts NULL: every row attends from key 0. */
static int paged_decode(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                        int64_t table_stride, const int32_t *kv_lens, const int32_t *kv_starts,
                        const int64_t *token_rows, int64_t num_rows, int64_t num_q_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, float *out, int num_threads) {
    int64_t max_len = 0;
    for (int64_t r = 0; r < num_rows; ++r) max_len = kv_lens[r] > max_len ? kv_lens[r] : max_len;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * (max_len + head_dim)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* One task per row: its blocks are read as contiguous 16-position runs of every head. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; ++r) {
            if (scores == NULL) continue;
            const int64_t offset = token_rows[r] * num_q_heads * head_dim;
            const int32_t *table = tables + r * table_stride;
            float *acc = scores + num_q_heads * max_len;
            const int64_t start = kv_starts == NULL ? 0 : kv_starts[r];
            /* Constant head sizes let the compiler unroll the inner loops completely. */
            if (head_dim == 64)
                decode_row(q + offset, k_cache, v_cache, table, start, kv_lens[r], num_q_heads, num_kv_heads,
                           64, num_kv_heads * head_dim, block_size, scale, scores, max_len, acc);
            else if (head_dim == 128)
                decode_row(q + offset, k_cache, v_cache, table, start, kv_lens[r], num_q_heads, num_kv_heads,
                           128, num_kv_heads * head_dim, block_size, scale, scores, max_len, acc);
            else
                decode_row(q + offset, k_cache, v_cache, table, start, kv_lens[r], num_q_heads, num_kv_heads,
                           head_dim, num_kv_heads * head_dim, block_size, scale, scores, max_len, acc);
            memcpy(out + offset, acc, sizeof(float) * (size_t)(num_q_heads * head_dim));
        }
        free(scores);
    }
    return failed;
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *tables, int64_t table_stride, const int32_t *kv_lens,
                               const int64_t *token_rows, int64_t num_rows, int64_t num_q_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                               float *out, int num_threads) {
    return paged_decode(q, k_cache, v_cache, tables, table_stride, kv_lens, NULL, token_rows, num_rows,
                        num_q_heads, num_kv_heads, head_dim, block_size, scale, out, num_threads);
}

/* Sliding-window decode: row r attends to keys kv_starts[r] .. kv_lens[r] - 1 of its table. */
int paged_decode_window_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                      const int32_t *tables, int64_t table_stride, const int32_t *kv_lens,
                                      const int32_t *kv_starts, const int64_t *token_rows, int64_t num_rows,
                                      int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, float scale, float *out, int num_threads) {
    return paged_decode(q, k_cache, v_cache, tables, table_stride, kv_lens, kv_starts, token_rows, num_rows,
                        num_q_heads, num_kv_heads, head_dim, block_size, scale, out, num_threads);
}

/* One row's attention for query heads h_begin .. h_end - 1 on the calling thread, so that a caller can
 * split a row's heads over its own threads (decoder_layers.c); the run may begin or end inside a kv head's
 * group. A head's scores, softmax and weighted sum do not involve the other heads: each kv head's part of
 * the run is one decode_row call over that kv head alone, whose per-head operations are those of a call
 * over every head, so the bits are paged_decode's. q and out point at the row's first query head (the
 * row's [Hq, D]); table is the row's block table; keys start .. len - 1 are attended; scores holds
 * (h_end - h_begin) * len floats. */
void paged_decode_qheads_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                             int64_t start, int64_t len, int64_t num_q_heads, int64_t num_kv_heads,
                             int64_t h_begin, int64_t h_end, int64_t head_dim, int64_t block_size, float scale,
                             float *scores, float *out) {
    const int64_t groups = num_q_heads / num_kv_heads, pos_stride = num_kv_heads * head_dim;
    for (int64_t h = h_begin; h < h_end;) {
        const int64_t g = h / groups, stop = (g + 1) * groups < h_end ? (g + 1) * groups : h_end;
        const float *qh = q + h * head_dim, *kh = k_cache + g * head_dim, *vh = v_cache + g * head_dim;
        float *oh = out + h * head_dim;
        if (head_dim == 64)
            decode_row(qh, kh, vh, table, start, len, stop - h, 1, 64, pos_stride, block_size, scale, scores, len,
                       oh);
        else if (head_dim == 128)
            decode_row(qh, kh, vh, table, start, len, stop - h, 1, 128, pos_stride, block_size, scale, scores, len,
                       oh);
        else
            decode_row(qh, kh, vh, table, start, len, stop - h, 1, head_dim, pos_stride, block_size, scale, scores,
                       len, oh);
        h = stop;
    }
}

/* k_cache/v_cache slot s (a [row_len] run, row_len = Hkv * D) = key/value row t for every t with s =
 * slots[t]; key/value rows are key_stride/value_stride floats apart. Returns 1, writing nothing, if a slot
 * is outside [0, num_slots). */
int write_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride, int64_t rows,
                 int64_t row_len, const int64_t *slots, int64_t num_slots, float *k_cache, float *v_cache) {
    for (int64_t t = 0; t < rows; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    for (int64_t t = 0; t < rows; ++t) {
        memcpy(k_cache + slots[t] * row_len, key + t * key_stride, sizeof(float) * (size_t)row_len);
        memcpy(v_cache + slots[t] * row_len, value + t * value_stride, sizeof(float) * (size_t)row_len);
    }
    return 0;
}
