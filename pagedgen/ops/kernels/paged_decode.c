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

/* Pass 2 of decode_row for the G query heads h0 .. h0 + G - 1 that share kv head kvh, PV_CHUNK values of
 * the head at a time: each value row is read once for the G heads and their G x PV_CHUNK sums stay in
 * registers over all the keys, where the per-head loop read every value row G times and loaded and stored
 * its sums at every key (G = 4, head 256, 164 keys, 32 rows: 2x the loads and stores of the FMAs). Each sum
 * is the same chain, acc = acc + w * v over the keys in order from 0, so the bits are the per-head loop's. */
#define PV_CHUNK 32
static inline __attribute__((always_inline)) void pv_grouped(const int G, const float *v_cache,
                                                             const int32_t *table, int64_t start, int64_t len,
                                                             int64_t kvh, const int64_t head_dim,
                                                             int64_t pos_stride, int64_t block_size,
                                                             const float *scores, int64_t score_stride,
                                                             int64_t h0, float *acc) {
    const int64_t block_stride = block_size * pos_stride;
    for (int64_t c0 = 0; c0 < head_dim; c0 += PV_CHUNK) {
        float a[8][PV_CHUNK];
        for (int g = 0; g < G; ++g)
#pragma omp simd
            for (int c = 0; c < PV_CHUNK; ++c) a[g][c] = 0.f;
        for (int64_t b = 0, p0 = 0; p0 < len; ++b, p0 += block_size) {
            const int64_t n = len - p0 < block_size ? len - p0 : block_size;
            if (p0 + n <= start) continue;
            const int64_t j0 = start > p0 ? start - p0 : 0;
            const float *vb = v_cache + (int64_t)table[b] * block_stride + kvh * head_dim + c0;
            for (int64_t j = j0; j < n; ++j) {
                const float *vp = vb + j * pos_stride;
                for (int g = 0; g < G; ++g) {
                    const float w = scores[(h0 + g) * score_stride + p0 + j - start];
#pragma omp simd
                    for (int c = 0; c < PV_CHUNK; ++c) a[g][c] += w * vp[c];
                }
            }
        }
        for (int g = 0; g < G; ++g) memcpy(acc + (h0 + g) * head_dim + c0, a[g], sizeof(float) * PV_CHUNK);
    }
}

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
    /* Pass 2: acc[h] = sum_p probs[h, p] * v[p, h / groups]; grouped heads (2-8 per kv head) by chunks. */
    if (groups >= 2 && groups <= 8 && head_dim % PV_CHUNK == 0) {
        for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
            const int64_t h0 = kvh * groups;
#define PV_GROUPED(G) \
    pv_grouped(G, v_cache, table, start, len, kvh, head_dim, pos_stride, block_size, scores, score_stride, h0, acc)
            switch (groups) { /* a constant G for each: the sums in registers */
            case 2: PV_GROUPED(2); break;
            case 3: PV_GROUPED(3); break;
            case 4: PV_GROUPED(4); break;
            case 5: PV_GROUPED(5); break;
            case 6: PV_GROUPED(6); break;
            case 7: PV_GROUPED(7); break;
            default: PV_GROUPED(8); break;
            }
#undef PV_GROUPED
        }
        return;
    }
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
