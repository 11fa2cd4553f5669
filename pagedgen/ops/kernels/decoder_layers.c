/*
 * Every decoder layer of a pure-decode step in one call: the per-layer loop of a Llama- or Gemma-style
 * model, in C.
 *
 * Why: at batch 1 a layer is ten microsecond-sized kernels (two RMSNorms, four GEMMs over packed weights,
 * rotary, the KV write, paged attention, the gated activation). Called one by one from Python, with the
 * tensor bookkeeping around each call, the dispatch cost about a quarter of the forward (docs/performance.md,
 * "The fused decode path"). Here the same kernels run in the same order on the same buffers, so the result
 * is bit-identical to the per-layer path: only the Python between them is gone.
 *
 * Per layer, for x the residual stream still missing delta (the previous layer's output; none before
 * layer 0):
 *   x += delta; h = rms_norm(x)                  (layer 0: h = rms_norm(x))
 *   qkv = h @ Wqkv^T + b                         (per segment of Wqkv, see below)
 *   [q, k = head_rms_norm(q), head_rms_norm(k)]  (q/k norms: Qwen3, Gemma 3)
 *   rotate q and k at the step's positions (in place; a local layer with its own table: Gemma 3)
 *   write k, v into the layer's paged cache at slots; q copied contiguous; attn = paged_decode(q)
 *     (a sliding-window layer writes through its ring's slots and attends within the window: its own view)
 *   o = attn @ Wo^T + b;  [o = rms_norm(o)]      (sandwich norm: Gemma)
 *   x += o; h = rms_norm(x)
 *   delta = act_mul(h @ Wgate_up^T + b) @ Wdown^T + b;  [delta = rms_norm(delta)]   (sandwich norm: Gemma)
 * act is silu (SwiGLU) or gelu_tanh (Gemma). On return x still misses the last layer's delta (the caller
 * adds it for the rows it needs logits of).
 *
 * Segments: a fused matrix (q/k/v, gate/up) is up to three row ranges, each stored in its own format and
 * memory (a Q4_K_M file keeps q/k in one format, v in another). Each segment's part of a thread's columns is
 * that segment's quant_gemm_f32 call restricted to those rows: the call the per-layer path makes for that
 * part (same weight, same x rows), so the bits are the same. Segments are never merged, even when two are
 * adjacent and alike, so the result does not depend on how the kernel splits a matrix's rows.
 *
 * 8-bit activations (activations="q8", quant_q8.c): a segment flagged QT_Q8_ACTIVATIONS runs the integer
 * kernel's column slice (quant_gemm_q8_rows) on the GEMM's x rounded to 8-bit blocks; each thread rounds
 * the whole x itself (the 32-blocks, the K-quants' 256-blocks or both, as its segments read), with the
 * kernel's own code, so every thread reads the bytes quant_gemm_q8 would. Segments without such a kernel
 * (Q2_K, Q3_K, f16, bf16 in a q8 model) stay exact, in the same step.
 *
 * Threads: one OpenMP region for the whole step, not one per kernel. Each thread owns a fixed slice of
 * every GEMM's output columns and a fixed part of attention (whole sequences when there are rows enough,
 * whose keys and values it also writes; else a run of query heads of every row: attention_share), keeps its
 * own copy of the residual stream and of each norm's output, and the threads meet at five barriers per
 * layer, where a product feeds the next (decoder_layers_f32, at the end; step_barrier.h: a wait spins
 * briefly, then sleeps, so that a core taken by another process does not cost a scheduler slice per
 * barrier). At batch 1 that also puts both threads on attention, and on norms and activations no thread
 * waits for. Every value is still computed by the per-layer path's code, so the
 * bits do not depend on the split or the thread count.
 *
 * Layouts: all row-major and contiguous; weights are packed rows as in quant_gemm.c (the qtype is a ggml
 * type id). The step is decode only: row r of the step is token r (token_rows = 0 .. tokens - 1).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "step_barrier.h"

/* The kernels of the sibling sources (one shared library). */
void rms_norm_f32(const float *x, int64_t rows, int64_t dim, const float *weight, float eps, float *out,
                  int num_threads);
void add_rms_norm_f32(float *residual, const float *delta, int64_t rows, int64_t dim, const float *weight,
                      float eps, float *out, int num_threads);
void head_rms_norm_f32(float *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                       const float *weight, float eps, int num_threads);
void rotary_f32(float *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride, const float *cos,
                const float *sin, int num_threads);
int gated_act_f32(const float *gate, const float *up, int64_t rows, int64_t inner, int64_t row_stride,
                  int activation, float *out, int num_threads);

int quant_gemm_rows_f32(const float *x, int64_t m_rows, const uint8_t *w, int64_t row_bytes, int qtype, int64_t k,
                        int64_t n_begin, int64_t n_end, const float *bias, float *y, int64_t y_stride, float *buf);
int64_t quant_gemm_buffer_floats(int64_t m_rows, int64_t k);
int64_t quant_q8_buffer_bytes(int64_t m_rows, int64_t k);
int quant_q8_quantize_parts(const float *x, int64_t m_rows, int64_t k, void *buf, int parts);
int quant_q8_part(int qtype);
int quant_gemm_q8_rows(const void *buf, int64_t m_rows, const uint8_t *w, int64_t row_bytes, int qtype, int64_t k,
                       int64_t n_begin, int64_t n_end, const float *bias, float *y, int64_t y_stride);
void paged_decode_qheads_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                             int64_t start, int64_t len, int64_t num_q_heads, int64_t num_kv_heads,
                             int64_t h_begin, int64_t h_end, int64_t head_dim, int64_t block_size, float scale,
                             float *scores, float *out);

enum { MAX_SEGMENTS = 3 };
#define QT_Q8_ACTIVATIONS 0x100 /* quant_gemm.c: the opt-in 8-bit-activation kernels */

/* Output rows of a packed weight stored in one format: [rows, k] as rows of row_bytes. */
typedef struct {
    const uint8_t *data;
    int64_t row_bytes;
    int64_t qtype;
    int64_t rows;
} weight_segment;

/* One packed weight matrix [n_out, k]: its segments stacked by output row (their rows sum to n_out), and
 * the bias over all n_out (NULL when absent). */
typedef struct {
    weight_segment segments[MAX_SEGMENTS];
    int64_t num_segments;
    const float *bias;
} packed_weight;

/* One layer's parameters and its KV cache tensors ([num_blocks, block_size, Hkv, D] each); a windowed layer
 * reads and writes through the step's window view. NULL norms are absent (Llama: no q/k or sandwich norms). */
typedef struct {
    const float *input_norm;
    const float *post_norm;     /* before the MLP: Llama's post_attention_layernorm, Gemma's pre_feedforward */
    const float *q_norm, *k_norm;     /* [D] each, or NULL */
    const float *attn_out_norm;       /* Gemma's post_attention_layernorm (on o), or NULL */
    const float *mlp_out_norm;        /* Gemma's post_feedforward_layernorm (on the MLP output), or NULL */
    packed_weight qkv, o, gate_up, down;
    float *k_cache, *v_cache;
    int64_t windowed;
    int64_t local_rope;               /* rotate with the step's local table (Gemma 3's local layers) */
} decoder_layer;

/* Where one kind of layer writes and reads the step's keys: the full-context blocks, or the window rings. */
typedef struct {
    const int64_t *slots;     /* [T] flat cache slot of each token */
    int64_t num_slots;        /* slots in one such layer's cache */
    const int32_t *tables;    /* [T, table_stride] */
    int64_t table_stride;
    const int32_t *kv_lens;   /* [T] keys 0 .. kv_lens - 1 of the table */
    const int32_t *kv_starts; /* [T] first attended key (window), or NULL: from key 0 */
} kv_view;

/* The model's sizes; activation 0 silu, 1 gelu_tanh. */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, inner;
    float eps, scale;
    int64_t activation;
} decoder_dims;

/* The step: its positions' rotary tables, KV slots and block tables, and the working buffers. */
typedef struct {
    int64_t tokens;
    const float *cos, *sin;             /* [T, D] */
    const float *local_cos, *local_sin; /* [T, D] the local layers' table, or NULL: none has its own */
    kv_view full, window;               /* window: unused without windowed layers */
    const int64_t *token_rows;          /* [T] = 0 .. T - 1 */
    int64_t block_size;
    float *x;       /* [T, hidden] residual stream, updated in place */
    float *delta;   /* [T, hidden] out: the last layer's output still to add */
    float *qkv;     /* [T, (Hq + 2 Hkv) D] */
    float *attn;    /* [T, Hq D] */
    float *o;       /* [T, hidden] */
    float *gate_up; /* [T, 2 inner] */
    float *act;     /* [T, inner] */
} decoder_step;

static int slots_inside(const kv_view *view, int64_t tokens) {
    for (int64_t r = 0; r < tokens; ++r)
        if (view->slots[r] < 0 || view->slots[r] >= view->num_slots) return 0;
    return 1;
}

/* [begin, end) of n items for thread tid of nth, cut at multiples of align. */
static void share(int64_t n, int64_t align, int tid, int nth, int64_t *begin, int64_t *end) {
    const int64_t units = (n + align - 1) / align;
    const int64_t b = units * tid / nth * align, e = units * (tid + 1) / nth * align;
    *begin = b < n ? b : n;
    *end = e < n ? e : n;
}

/* The parts of the quantised x (quant_q8.c's Q8_PART_*) that w's 8-bit-activation segments read; 0 for none. */
static int q8_parts_of(const packed_weight *w) {
    int parts = 0;
    for (int64_t s = 0; s < w->num_segments; ++s)
        if (w->segments[s].qtype & QT_Q8_ACTIVATIONS)
            parts |= quant_q8_part((int)(w->segments[s].qtype & ~QT_Q8_ACTIVATIONS));
    return parts;
}

/* x [t, k] rounded to 8-bit blocks into buf when some segment of w runs the 8-bit-activation kernels
 * (quant_q8.c), for packed_columns; NULL when none does. Every thread rounds the whole x into its own
 * buffer: the same code on the same floats, so the same bytes as quant_gemm_q8's own, and no thread waits
 * for another's (at batch 1 that is a few thousand values per GEMM, cheaper than a barrier). */
static const void *quantised_for(const packed_weight *w, const float *x, int64_t t, int64_t k, void *buf) {
    const int parts = q8_parts_of(w);
    if (!parts) return NULL;
    quant_q8_quantize_parts(x, t, k, buf, parts);
    return buf;
}

/* Output columns c0 .. c1 - 1 of y [t, y_stride] = x [t, k] @ W^T + b on the calling thread: each segment's
 * part of that range is the segment's quant_gemm_f32 restricted to those rows of W (same bits); a segment
 * with 8-bit activations reads x as quantised_for rounded it (xq). */
static void packed_columns(const float *x, const void *xq, int64_t t, const packed_weight *w, int64_t k,
                           int64_t c0, int64_t c1, float *y, int64_t y_stride, float *buf) {
    int64_t column = 0;
    for (int64_t s = 0; s < w->num_segments; ++s) {
        const weight_segment *seg = &w->segments[s];
        const int64_t lo = c0 > column ? c0 : column, hi = c1 < column + seg->rows ? c1 : column + seg->rows;
        const float *bias = w->bias ? w->bias + column : NULL;
        if (lo < hi && (seg->qtype & QT_Q8_ACTIVATIONS))
            quant_gemm_q8_rows(xq, t, seg->data, seg->row_bytes, (int)(seg->qtype & ~QT_Q8_ACTIVATIONS), k,
                               lo - column, hi - column, bias, y + column, y_stride);
        else if (lo < hi)
            quant_gemm_rows_f32(x, t, seg->data, seg->row_bytes, (int)seg->qtype, k, lo - column, hi - column,
                                bias, y + column, y_stride, buf);
        column += seg->rows;
    }
}

/* Ask for the first bytes of this thread's rows c0 .. c1 - 1 of w before its GEMM starts. quant_gemm_rows_f32
 * prefetches ahead within one call only, so without this every call of a step (four to six per layer)
 * would begin on cache misses. Issued before a barrier, the lines arrive while the thread waits or runs the
 * norms and attention that come first. */
#define HEAD_PREFETCH_BYTES 4096
static void prefetch_columns(const packed_weight *w, int64_t c0, int64_t c1) {
    int64_t column = 0;
    for (int64_t s = 0; s < w->num_segments && c0 < c1; ++s) {
        const weight_segment *seg = &w->segments[s];
        if (c0 < column + seg->rows) {
            const int64_t rows = (c1 < column + seg->rows ? c1 : column + seg->rows) - c0;
            const int64_t bytes = rows * seg->row_bytes < HEAD_PREFETCH_BYTES ? rows * seg->row_bytes
                                                                            : HEAD_PREFETCH_BYTES;
            const uint8_t *p = seg->data + (c0 - column) * seg->row_bytes;
            for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
            return;
        }
        column += seg->rows;
    }
}

/* What one thread needs of its own: a private copy of the residual stream x and of each norm's output (every
 * thread computes them alike, so no thread waits for another's), the GEMM buffer and attention scores. */
typedef struct {
    float *x, *h, *tmp, *delta; /* [T, hidden] each */
    float *gemm;                /* quant_gemm_buffer_floats(T, widest k) */
    float *scores;              /* [Hq, longest attended length] */
    void *q8;                   /* quant_q8_buffer_bytes(T, widest k): one GEMM's x rounded to 8 bits */
} thread_buffers;

/* Whole heads of width d in columns [0, c) of a run of `heads` heads (c clamped to the run). */
static int64_t clamp_heads(int64_t c, int64_t d, int64_t heads) {
    return c <= 0 ? 0 : c >= heads * d ? heads : c / d;
}

/* Keys and values of rows r0 .. r1 - 1 for kv heads [k0, k1) (keys) and [v0, v1) (values): k norm and
 * rotary in place in the q/k/v output, then each row's key and value written to its slot. */
static void kv_write(const decoder_layer *layer, const decoder_dims *dims, const decoder_step *step,
                     const kv_view *view, const float *cos, const float *sin, int64_t r0, int64_t r1, int64_t k0,
                     int64_t k1, int64_t v0, int64_t v1) {
    const int64_t d = dims->head_dim;
    const int64_t q_width = dims->q_heads * d, kv_width = dims->kv_heads * d, qkv_width = q_width + 2 * kv_width;
    for (int64_t r = r0; r < r1; ++r) {
        float *row = step->qkv + r * qkv_width, *k = row + q_width + k0 * d;
        const int64_t slot = view->slots[r];
        if (k0 < k1) {
            if (layer->k_norm != NULL) head_rms_norm_f32(k, 1, k1 - k0, d, qkv_width, layer->k_norm, dims->eps, 1);
            rotary_f32(k, 1, k1 - k0, d, qkv_width, cos + r * d, sin + r * d, 1);
            memcpy(layer->k_cache + slot * kv_width + k0 * d, k, sizeof(float) * (size_t)((k1 - k0) * d));
        }
        if (v0 < v1)
            memcpy(layer->v_cache + slot * kv_width + v0 * d, row + q_width + kv_width + v0 * d,
                   sizeof(float) * (size_t)((v1 - v0) * d));
    }
}

/* The K/V part of a layer when attention is cut by query heads (kv_write for every row): the k and v heads
 * inside output columns c0 .. c1 - 1 of its q/k/v GEMM (this thread's slice, cut at head boundaries), all
 * before the barrier that follows the GEMM, so every key a row attends this step is in the cache before
 * attention reads it, whichever thread attends. (When attention takes whole rows, each thread writes its
 * own rows' keys and values after that barrier instead: see layers_on_thread.) */
static void kv_part(const decoder_layer *layer, const decoder_dims *dims, const decoder_step *step,
                    const kv_view *view, const float *cos, const float *sin, int64_t c0, int64_t c1) {
    const int64_t d = dims->head_dim, q_width = dims->q_heads * d, kv_width = dims->kv_heads * d;
    /* kv heads [k0, k1) have their k columns in the slice, [v0, v1) their v columns */
    const int64_t k0 = clamp_heads(c0 - q_width, d, dims->kv_heads), k1 = clamp_heads(c1 - q_width, d, dims->kv_heads);
    const int64_t v0 = clamp_heads(c0 - q_width - kv_width, d, dims->kv_heads);
    const int64_t v1 = clamp_heads(c1 - q_width - kv_width, d, dims->kv_heads);
    kv_write(layer, dims, step, view, cos, sin, 0, step->tokens, k0, k1, v0, v1);
}

/* The attention part of a layer for rows r0 .. r1 - 1 and query heads h0 .. h1 - 1 of each: q norm and
 * rotary, then attention over the cache kv_part or kv_write filled. */
static void attention_part(const decoder_layer *layer, const decoder_dims *dims, const decoder_step *step,
                           const kv_view *view, const float *cos, const float *sin, int64_t r0, int64_t r1,
                           int64_t h0, int64_t h1, float *scores) {
    const int64_t d = dims->head_dim;
    const int64_t q_width = dims->q_heads * d, kv_width = dims->kv_heads * d, qkv_width = q_width + 2 * kv_width;
    if (h0 >= h1) return;
    for (int64_t r = r0; r < r1; ++r) {
        float *q = step->qkv + r * qkv_width + h0 * d;
        if (layer->q_norm != NULL) head_rms_norm_f32(q, 1, h1 - h0, d, qkv_width, layer->q_norm, dims->eps, 1);
        rotary_f32(q, 1, h1 - h0, d, qkv_width, cos + r * d, sin + r * d, 1);
    }
    for (int64_t r = r0; r < r1; ++r)
        paged_decode_qheads_f32(step->qkv + step->token_rows[r] * qkv_width, layer->k_cache, layer->v_cache,
                                view->tables + r * view->table_stride, view->kv_starts ? view->kv_starts[r] : 0,
                                view->kv_lens[r], dims->q_heads, dims->kv_heads, h0, h1, d, step->block_size,
                                dims->scale, scores, step->attn + step->token_rows[r] * q_width);
}

/* Whether rows r - 1 and r may be one sequence's (draft verification): a sequence's rows are consecutive
 * and carry copies of one block table, while two sequences' tables differ at least at the block each
 * writes this step. Equal tables of two sequences would only keep them on one thread. */
static int same_sequence(const kv_view *view, int64_t r) {
    const int32_t *a = view->tables + (r - 1) * view->table_stride, *b = a + view->table_stride;
    return memcmp(a, b, sizeof(int32_t) * (size_t)view->table_stride) == 0;
}

/* Where part i of nth of the rows begins: at the row boundary nearest i / nth of the step's work (each row
 * its keys plus ROW_COST, for the writes and the q/k work; a row goes to the part holding most of it), moved
 * on past the rows of the sequence it would split. */
#define ROW_COST 32
static int64_t rows_boundary(const kv_view *view, int64_t tokens, int64_t total, int i, int nth) {
    if (i == 0) return 0;
    if (i == nth) return tokens;
    const int64_t target = total * i / nth;
    int64_t b = 0, before = 0;
    while (b < tokens && 2 * before + view->kv_lens[b] + ROW_COST <= 2 * target)
        before += view->kv_lens[b++] + ROW_COST;
    while (b > 0 && b < tokens && same_sequence(view, b)) ++b;
    return b;
}

/* Which rows and query heads of attention thread tid takes. With at least as many rows as threads, whole
 * rows, balanced by the keys they attend: each thread then reads its own rows' cache blocks. With fewer
 * rows (batch 1), or when keeping sequences whole would leave a thread without rows, every row and a run of
 * query heads: cut by query heads, not kv heads, a model with 3 kv heads splits 4 / 5 query heads instead
 * of 1 / 2 kv heads on two threads (one thread took twice the other's time), and one with 1 kv head uses
 * both threads instead of one. Every head of a row is computed by the same code either way, so the bits do
 * not depend on the split. */
static int attention_share(const kv_view *view, int64_t tokens, int64_t q_heads, int tid, int nth, int64_t *r0,
                           int64_t *r1, int64_t *h0, int64_t *h1) {
    if (nth > 1 && tokens >= nth) {
        int64_t total = 0;
        for (int64_t r = 0; r < tokens; ++r) total += view->kv_lens[r] + ROW_COST;
        int every_part_has_rows = 1;
        for (int i = 0; i < nth && every_part_has_rows; ++i)
            every_part_has_rows = rows_boundary(view, tokens, total, i, nth) <
                                  rows_boundary(view, tokens, total, i + 1, nth);
        if (every_part_has_rows) {
            *r0 = rows_boundary(view, tokens, total, tid, nth), *r1 = rows_boundary(view, tokens, total, tid + 1, nth);
            *h0 = 0, *h1 = q_heads;
            return 1;
        }
    }
    *r0 = 0, *r1 = tokens;
    share(q_heads, 1, tid, nth, h0, h1);
    return 0;
}

/* One thread's part of every layer; the threads meet only where a product feeds the next (five barriers
 * per layer: after q/k/v, attention, o, gate/up with the activation, down). */
static void layers_on_thread(const decoder_layer *layers, int64_t num_layers, const decoder_dims *dims,
                             const decoder_step *step, const thread_buffers *own, step_barrier *meet, int tid,
                             int nth) {
    const int64_t t = step->tokens, hidden = dims->hidden, d = dims->head_dim, inner = dims->inner;
    const int64_t q_width = dims->q_heads * d, kv_width = dims->kv_heads * d, qkv_width = q_width + 2 * kv_width;
    const float eps = dims->eps;
    int64_t c0, c1, a0, a1, h0, h1, o0, o1, i0, i1;
    share(qkv_width, d, tid, nth, &c0, &c1); /* whole heads: kv_part writes the k and v heads of its slice */
    /* whole rows: every thread writes its own rows' keys and values (kv_write, after the q/k/v barrier), so
     * the writes and their first-touch page faults are shared out like attention; else kv_part */
    const int whole_rows = attention_share(&step->full, t, dims->q_heads, tid, nth, &a0, &a1, &h0, &h1);
    share(hidden, 8, tid, nth, &o0, &o1);
    share(inner, 16, tid, nth, &i0, &i1);
    const float *delta = NULL; /* the previous layer's output (shared, or this thread's normed copy) */
    memcpy(own->x, step->x, sizeof(float) * (size_t)(t * hidden));
    for (int64_t l = 0; l < num_layers; ++l) {
        const decoder_layer *layer = &layers[l];
        const kv_view *view = layer->windowed ? &step->window : &step->full;
        const int local = layer->local_rope && step->local_cos != NULL;
        const float *cos = local ? step->local_cos : step->cos, *sin = local ? step->local_sin : step->sin;
        if (delta == NULL)
            rms_norm_f32(own->x, t, hidden, layer->input_norm, eps, own->h, 1);
        else
            add_rms_norm_f32(own->x, delta, t, hidden, layer->input_norm, eps, own->h, 1);
        const void *xq = quantised_for(&layer->qkv, own->h, t, hidden, own->q8);
        packed_columns(own->h, xq, t, &layer->qkv, hidden, c0, c1, step->qkv, qkv_width, own->gemm);
        if (!whole_rows) kv_part(layer, dims, step, view, cos, sin, c0, c1);
        prefetch_columns(&layer->o, o0, o1);
        step_barrier_wait(meet);
        if (whole_rows) kv_write(layer, dims, step, view, cos, sin, a0, a1, 0, dims->kv_heads, 0, dims->kv_heads);
        attention_part(layer, dims, step, view, cos, sin, a0, a1, h0, h1, own->scores);
        step_barrier_wait(meet);
        xq = quantised_for(&layer->o, step->attn, t, q_width, own->q8);
        packed_columns(step->attn, xq, t, &layer->o, q_width, o0, o1, step->o, hidden, own->gemm);
        prefetch_columns(&layer->gate_up, i0, i1);
        prefetch_columns(&layer->gate_up, inner + i0, inner + i1);
        step_barrier_wait(meet);
        const float *attn_out = step->o;
        if (layer->attn_out_norm != NULL) {
            rms_norm_f32(step->o, t, hidden, layer->attn_out_norm, eps, own->tmp, 1);
            attn_out = own->tmp;
        }
        add_rms_norm_f32(own->x, attn_out, t, hidden, layer->post_norm, eps, own->h, 1);
        xq = quantised_for(&layer->gate_up, own->h, t, hidden, own->q8);
        packed_columns(own->h, xq, t, &layer->gate_up, hidden, i0, i1, step->gate_up, 2 * inner, own->gemm);
        packed_columns(own->h, xq, t, &layer->gate_up, hidden, inner + i0, inner + i1, step->gate_up, 2 * inner,
                       own->gemm);
        if (i0 < i1)
            for (int64_t r = 0; r < t; ++r)
                gated_act_f32(step->gate_up + r * 2 * inner + i0, step->gate_up + r * 2 * inner + inner + i0, 1,
                              i1 - i0, 2 * inner, (int)dims->activation, step->act + r * inner + i0, 1);
        prefetch_columns(&layer->down, o0, o1);
        step_barrier_wait(meet);
        float *mlp_out = layer->mlp_out_norm != NULL ? step->o : step->delta;
        xq = quantised_for(&layer->down, step->act, t, inner, own->q8);
        packed_columns(step->act, xq, t, &layer->down, inner, o0, o1, mlp_out, hidden, own->gemm);
        if (l + 1 < num_layers) prefetch_columns(&layers[l + 1].qkv, c0, c1);
        step_barrier_wait(meet);
        delta = step->delta;
        if (layer->mlp_out_norm != NULL) {
            rms_norm_f32(step->o, t, hidden, layer->mlp_out_norm, eps, own->delta, 1);
            delta = own->delta;
        }
    }
    if (tid == 0) {
        memcpy(step->x, own->x, sizeof(float) * (size_t)(t * hidden));
        if (delta != step->delta) memcpy(step->delta, delta, sizeof(float) * (size_t)(t * hidden));
    }
}

static int64_t longest_attended(const kv_view *view, int64_t tokens) {
    int64_t longest = 1;
    for (int64_t r = 0; r < tokens; ++r) longest = view->kv_lens[r] > longest ? view->kv_lens[r] : longest;
    return longest;
}

/* Whether every segment of every layer's GEMMs has a kernel: an exact quant kernel with a known qtype, or an
 * 8-bit-activation kernel for its format and in size k (a multiple of 32). */
static int kernels_known(const decoder_layer *layers, int64_t num_layers, const decoder_dims *dims) {
    const int64_t q_width = dims->q_heads * dims->head_dim;
    for (int64_t l = 0; l < num_layers; ++l) {
        const packed_weight *ws[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        const int64_t ks[4] = {dims->hidden, q_width, dims->hidden, dims->inner};
        for (int i = 0; i < 4; ++i)
            for (int64_t s = 0; s < ws[i]->num_segments; ++s) {
                const weight_segment *seg = &ws[i]->segments[s];
                const int failed =
                    seg->qtype & QT_Q8_ACTIVATIONS
                        ? quant_gemm_q8_rows(NULL, 1, seg->data, seg->row_bytes,
                                             (int)(seg->qtype & ~QT_Q8_ACTIVATIONS), ks[i], 0, 0, NULL, NULL, 0)
                        : quant_gemm_rows_f32(NULL, 1, seg->data, seg->row_bytes, (int)seg->qtype, 0, 0, 0, NULL,
                                              NULL, 0, NULL);
                if (failed) return 0;
            }
    }
    return 1;
}

/* Returns 0; -1 for an unknown qtype or activation, -2 if a kernel could not allocate, -3 for a slot outside
 * its cache (checked for both views before anything is written to any cache). The buffers are then
 * incomplete.
 *
 * Threads: one parallel region for the whole step. Each thread owns a fixed slice of every GEMM's output
 * columns (gate and up: the same inner columns of both, so it applies the activation to its own slice) and a
 * fixed part of attention (attention_share: whole sequences, whose keys and values it writes to the cache
 * itself after the q/k/v barrier; or with rows < threads a run of query heads of every row, so every thread
 * still works, the k and v heads of its q/k/v columns then written before that barrier), and keeps its own
 * copy of the residual stream and norm outputs; the threads meet at five barriers per layer instead of the
 * fork and join of every kernel. Every value is computed by the same code as the per-layer path's kernels
 * (the GEMM slices by quant_gemm_rows_f32 or quant_gemm_q8_rows, a head's attention by decode_row), so the
 * output is the same bit for bit, whatever the thread count. */
static int64_t barrier_spin_ns = SPIN_NS, barrier_naps = 0;

int decoder_layers_f32(const decoder_layer *layers, int64_t num_layers, const decoder_dims *dims,
                       const decoder_step *step, int num_threads) {
    const int64_t t = step->tokens, hidden = dims->hidden;
    if (dims->activation != 0 && dims->activation != 1) return -1;
    for (int64_t l = 0; l < num_layers; ++l)
        if (!slots_inside(layers[l].windowed ? &step->window : &step->full, t)) return -3;
    if (!kernels_known(layers, num_layers, dims)) return -1;
    int64_t longest = longest_attended(&step->full, t);
    if (step->window.kv_lens != NULL) {
        const int64_t window = longest_attended(&step->window, t);
        longest = window > longest ? window : longest;
    }
    const int64_t widest_k = dims->inner > hidden ? dims->inner : hidden;
    const int64_t k_max = dims->q_heads * dims->head_dim > widest_k ? dims->q_heads * dims->head_dim : widest_k;
    const size_t state = (size_t)(4 * t * hidden), gemm = (size_t)quant_gemm_buffer_floats(t, k_max);
    const size_t scores = (size_t)(dims->q_heads * longest);
    const size_t q8 = (size_t)(quant_q8_buffer_bytes(t, k_max) + 3) / sizeof(float);
    const size_t floats = state + gemm + scores + q8;
    int failed = 0;
    step_barrier meet;
#pragma omp parallel num_threads(num_threads)
    {
        if (omp_get_thread_num() == 0) step_barrier_init(&meet, omp_get_num_threads(), barrier_spin_ns);
        float *mine = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (mine == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            memset(mine + state, 0, gemm * sizeof(float)); /* rows past a short group are read, never stored */
        }
#pragma omp barrier
        if (!failed) {
            const size_t n = (size_t)(t * hidden);
            const thread_buffers own = {mine,         mine + n,     mine + 2 * n, mine + 3 * n, mine + state,
                                        mine + state + gemm, mine + state + gemm + scores};
            layers_on_thread(layers, num_layers, dims, step, &own, &meet, omp_get_thread_num(),
                             omp_get_num_threads());
        }
        free(mine);
    }
    __atomic_fetch_add(&barrier_naps, (int64_t)meet.naps, __ATOMIC_RELAXED);
    return failed ? -2 : 0;
}

/* How long the step's threads spin at a barrier before they sleep (step_barrier.h; negative: the default),
 * and how many of their waits have stopped spinning so far: for the tests, which set 0 to take the sleeping
 * path at every barrier. Not for use while a step runs. */
void decoder_barrier_spin(int64_t spin_ns) { barrier_spin_ns = spin_ns < 0 ? SPIN_NS : spin_ns; }
int64_t decoder_barrier_naps(void) { return __atomic_load_n(&barrier_naps, __ATOMIC_RELAXED); }

/* attention_share for every thread of nth, for the tests: out[4 i .. 4 i + 3] = thread i's first row, end
 * row, first query head and end query head, for a step of `tokens` rows with these tables and key counts. */
void decoder_attention_share(const int32_t *tables, int64_t table_stride, const int32_t *kv_lens, int64_t tokens,
                             int64_t q_heads, int nth, int64_t *out) {
    const kv_view view = {NULL, 0, tables, table_stride, kv_lens, NULL};
    for (int i = 0; i < nth; ++i)
        attention_share(&view, tokens, q_heads, i, nth, out + 4 * i, out + 4 * i + 1, out + 4 * i + 2,
                        out + 4 * i + 3);
}
