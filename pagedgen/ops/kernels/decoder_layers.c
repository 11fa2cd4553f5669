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
 * memory (a Q4_K_M file keeps q/k in one format, v in another). Each segment is one quant_gemm_f32 call
 * into its column range of the output: the very call the per-layer path makes for that part (same weight,
 * same x rows), so the bits are the same. Segments are never merged, even when two are adjacent and alike,
 * so the result does not depend on how the kernel splits a matrix's rows.
 *
 * Layouts: all row-major and contiguous; weights are packed rows as in quant_gemm.c (the qtype is a ggml
 * type id). The step is decode only: row r of the step is token r (token_rows = 0 .. tokens - 1).
 */
#include <stdint.h>
#include <string.h>

/* The kernels of the sibling sources (one shared library). */
int quant_gemm_f32(const float *x, int64_t m_rows, const uint8_t *w, int64_t row_bytes, int qtype, int64_t k,
                   int64_t n_out, const float *bias, float *y, int num_threads);
void rms_norm_f32(const float *x, int64_t rows, int64_t dim, const float *weight, float eps, float *out,
                  int num_threads);
void add_rms_norm_f32(float *residual, const float *delta, int64_t rows, int64_t dim, const float *weight,
                      float eps, float *out, int num_threads);
void head_rms_norm_f32(float *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                       const float *weight, float eps, int num_threads);
void rotary_f32(float *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride, const float *cos,
                const float *sin, int num_threads);
void silu_mul_f32(const float *gate_up, int64_t rows, int64_t inner, float *out, int num_threads);
int gated_act_f32(const float *gate, const float *up, int64_t rows, int64_t inner, int64_t row_stride,
                  int activation, float *out, int num_threads);
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *tables, int64_t table_stride, const int32_t *kv_lens,
                               const int64_t *token_rows, int64_t num_rows, int64_t num_q_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                               float *out, int num_threads);
int paged_decode_window_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                      const int32_t *tables, int64_t table_stride, const int32_t *kv_lens,
                                      const int32_t *kv_starts, const int64_t *token_rows, int64_t num_rows,
                                      int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, float scale, float *out, int num_threads);
int write_kv_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride, int64_t rows,
                 int64_t row_len, const int64_t *slots, int64_t num_slots, float *k_cache, float *v_cache);

enum { MAX_SEGMENTS = 3 };

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
    float *h;       /* [T, hidden] */
    float *qkv;     /* [T, (Hq + 2 Hkv) D] */
    float *q;       /* [T, Hq D] */
    float *attn;    /* [T, Hq D] */
    float *o;       /* [T, hidden] */
    float *gate_up; /* [T, 2 inner] */
    float *act;     /* [T, inner] */
    float *scratch; /* [T, widest segment] one segment's product before it is placed (T > 1 only) */
} decoder_step;

static int slots_inside(const kv_view *view, int64_t tokens) {
    for (int64_t r = 0; r < tokens; ++r)
        if (view->slots[r] < 0 || view->slots[r] >= view->num_slots) return 0;
    return 1;
}

/* y [t, n_out] = x [t, k] @ W^T + b, one quant_gemm_f32 call per segment into its columns. One row's
 * columns are contiguous, so for t = 1 a segment writes in place; otherwise through scratch. */
static int packed_gemm(const float *x, int64_t t, const packed_weight *w, int64_t k, int64_t n_out, float *y,
                       float *scratch, int num_threads) {
    if (w->num_segments == 1)
        return quant_gemm_f32(x, t, w->segments[0].data, w->segments[0].row_bytes, (int)w->segments[0].qtype,
                              k, n_out, w->bias, y, num_threads);
    int64_t column = 0;
    for (int64_t s = 0; s < w->num_segments; ++s) {
        const weight_segment *seg = &w->segments[s];
        const float *bias = w->bias ? w->bias + column : NULL;
        float *out = t == 1 ? y + column : scratch;
        const int failed =
            quant_gemm_f32(x, t, seg->data, seg->row_bytes, (int)seg->qtype, k, seg->rows, bias, out, num_threads);
        if (failed) return failed;
        if (t > 1)
            for (int64_t r = 0; r < t; ++r)
                memcpy(y + r * n_out + column, scratch + r * seg->rows, sizeof(float) * (size_t)seg->rows);
        column += seg->rows;
    }
    return 0;
}

/* Returns 0; -1 for an unknown qtype or activation, -2 if a kernel could not allocate, -3 for a slot outside
 * its cache (checked for both views before anything is written to any cache). The buffers are then
 * incomplete. */
int decoder_layers_f32(const decoder_layer *layers, int64_t num_layers, const decoder_dims *dims,
                       const decoder_step *step, int num_threads) {
    const int64_t t = step->tokens, hidden = dims->hidden, d = dims->head_dim, inner = dims->inner;
    const int64_t q_width = dims->q_heads * d, kv_width = dims->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const float eps = dims->eps;
    if (dims->activation != 0 && dims->activation != 1) return -1;
    for (int64_t l = 0; l < num_layers; ++l)
        if (!slots_inside(layers[l].windowed ? &step->window : &step->full, t)) return -3;
    for (int64_t l = 0; l < num_layers; ++l) {
        const decoder_layer *layer = &layers[l];
        const kv_view *view = layer->windowed ? &step->window : &step->full;
        const int local = layer->local_rope && step->local_cos != NULL;
        const float *cos = local ? step->local_cos : step->cos, *sin = local ? step->local_sin : step->sin;
        if (l == 0)
            rms_norm_f32(step->x, t, hidden, layer->input_norm, eps, step->h, num_threads);
        else
            add_rms_norm_f32(step->x, step->delta, t, hidden, layer->input_norm, eps, step->h, num_threads);
        int failed = packed_gemm(step->h, t, &layer->qkv, hidden, qkv_width, step->qkv, step->scratch, num_threads);
        if (failed) return failed;
        if (layer->q_norm != NULL) {
            head_rms_norm_f32(step->qkv, t, dims->q_heads, d, qkv_width, layer->q_norm, eps, num_threads);
            head_rms_norm_f32(step->qkv + q_width, t, dims->kv_heads, d, qkv_width, layer->k_norm, eps,
                              num_threads);
        }
        rotary_f32(step->qkv, t, dims->q_heads, d, qkv_width, cos, sin, num_threads);
        rotary_f32(step->qkv + q_width, t, dims->kv_heads, d, qkv_width, cos, sin, num_threads);
        if (write_kv_f32(step->qkv + q_width, qkv_width, step->qkv + q_width + kv_width, qkv_width, t, kv_width,
                         view->slots, view->num_slots, layer->k_cache, layer->v_cache))
            return -3;
        for (int64_t r = 0; r < t; ++r)
            memcpy(step->q + r * q_width, step->qkv + r * qkv_width, sizeof(float) * (size_t)q_width);
        failed = view->kv_starts == NULL
                     ? paged_decode_attention_f32(step->q, layer->k_cache, layer->v_cache, view->tables,
                                                  view->table_stride, view->kv_lens, step->token_rows, t,
                                                  dims->q_heads, dims->kv_heads, d, step->block_size, dims->scale,
                                                  step->attn, num_threads)
                     : paged_decode_window_attention_f32(step->q, layer->k_cache, layer->v_cache, view->tables,
                                                         view->table_stride, view->kv_lens, view->kv_starts,
                                                         step->token_rows, t, dims->q_heads, dims->kv_heads, d,
                                                         step->block_size, dims->scale, step->attn, num_threads);
        if (failed) return -2;
        failed = packed_gemm(step->attn, t, &layer->o, q_width, hidden, step->o, step->scratch, num_threads);
        if (failed) return failed;
        const float *attn_out = step->o;
        if (layer->attn_out_norm != NULL) { /* h is free: the q/k/v product is taken */
            rms_norm_f32(step->o, t, hidden, layer->attn_out_norm, eps, step->h, num_threads);
            attn_out = step->h;
        }
        float *mlp_in = attn_out == step->h ? step->o : step->h; /* the buffer attn_out is not */
        add_rms_norm_f32(step->x, attn_out, t, hidden, layer->post_norm, eps, mlp_in, num_threads);
        failed = packed_gemm(mlp_in, t, &layer->gate_up, hidden, 2 * inner, step->gate_up, step->scratch,
                             num_threads);
        if (failed) return failed;
        if (dims->activation == 0)
            silu_mul_f32(step->gate_up, t, inner, step->act, num_threads);
        else
            gated_act_f32(step->gate_up, step->gate_up + inner, t, inner, 2 * inner, (int)dims->activation,
                          step->act, num_threads);
        float *mlp_out = layer->mlp_out_norm != NULL ? step->o : step->delta;
        failed = packed_gemm(step->act, t, &layer->down, inner, hidden, mlp_out, step->scratch, num_threads);
        if (failed) return failed;
        if (layer->mlp_out_norm != NULL)
            rms_norm_f32(step->o, t, hidden, layer->mlp_out_norm, eps, step->delta, num_threads);
    }
    return 0;
}
