/*
 * Every decoder layer of a pure-decode step in one call: the per-layer loop of a Llama-style model, in C.
 *
 * Why: at batch 1 a layer is ten microsecond-sized kernels (two RMSNorms, four GEMMs over packed weights,
 * rotary, the KV write, paged attention, SwiGLU). Called one by one from Python, with the tensor
 * bookkeeping around each call, the dispatch cost about a quarter of the forward (docs/performance.md,
 * "The fused decode path"). Here the same kernels run in the same order on the same buffers, so the result
 * is bit-identical to the per-layer path: only the Python between them is gone.
 *
 * Per layer, for x the residual stream still missing delta (the previous layer's MLP output; none before
 * layer 0):
 *   x += delta; h = rms_norm(x)                  (layer 0: h = rms_norm(x))
 *   qkv = h @ Wqkv^T + b;  rotate q and k at the step's positions (in place)
 *   write k, v into the layer's paged cache at slots; q copied contiguous; attn = paged_decode(q)
 *     (a sliding-window layer writes through its ring's slots and attends within the window: its own view)
 *   o = attn @ Wo^T;  x += o; h = rms_norm(x)
 *   delta = silu_mul(h @ Wgate_up^T + b) @ Wdown^T + b
 * On return x still misses the last layer's delta (the caller adds it for the rows it needs logits of).
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
void rotary_f32(float *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride, const float *cos,
                const float *sin, int num_threads);
void silu_mul_f32(const float *gate_up, int64_t rows, int64_t inner, float *out, int num_threads);
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

/* One packed weight matrix [n_out, k] (bias NULL when absent). */
typedef struct {
    const uint8_t *data;
    int64_t row_bytes;
    int64_t qtype;
    const float *bias;
} packed_weight;

/* One layer's parameters and its KV cache tensors ([num_blocks, block_size, Hkv, D] each); a windowed layer
 * reads and writes through the step's window view. */
typedef struct {
    const float *input_norm;
    const float *post_norm;
    packed_weight qkv, o, gate_up, down;
    float *k_cache, *v_cache;
    int64_t windowed;
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

/* The model's sizes. */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, inner;
    float eps, scale;
} decoder_dims;

/* The step: its positions' rotary tables, KV slots and block tables, and the working buffers. */
typedef struct {
    int64_t tokens;
    const float *cos, *sin;   /* [T, D] */
    kv_view full, window;     /* window: unused without windowed layers */
    const int64_t *token_rows; /* [T] = 0 .. T - 1 */
    int64_t block_size;
    float *x;       /* [T, hidden] residual stream, updated in place */
    float *delta;   /* [T, hidden] out: the last layer's MLP output */
    float *h;       /* [T, hidden] */
    float *qkv;     /* [T, (Hq + 2 Hkv) D] */
    float *q;       /* [T, Hq D] */
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

/* Returns 0; -1 for an unknown qtype, -2 if a kernel could not allocate, -3 for a slot outside its cache
 * (checked for both views before anything is written to any cache). The buffers are then incomplete. */
int decoder_layers_f32(const decoder_layer *layers, int64_t num_layers, const decoder_dims *dims,
                       const decoder_step *step, int num_threads) {
    const int64_t t = step->tokens, hidden = dims->hidden, d = dims->head_dim;
    const int64_t q_width = dims->q_heads * d, kv_width = dims->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    for (int64_t l = 0; l < num_layers; ++l)
        if (!slots_inside(layers[l].windowed ? &step->window : &step->full, t)) return -3;
    for (int64_t l = 0; l < num_layers; ++l) {
        const decoder_layer *layer = &layers[l];
        const kv_view *view = layer->windowed ? &step->window : &step->full;
        if (l == 0)
            rms_norm_f32(step->x, t, hidden, layer->input_norm, dims->eps, step->h, num_threads);
        else
            add_rms_norm_f32(step->x, step->delta, t, hidden, layer->input_norm, dims->eps, step->h, num_threads);
        int failed = quant_gemm_f32(step->h, t, layer->qkv.data, layer->qkv.row_bytes, (int)layer->qkv.qtype,
                                    hidden, qkv_width, layer->qkv.bias, step->qkv, num_threads);
        if (failed) return failed;
        rotary_f32(step->qkv, t, dims->q_heads, d, qkv_width, step->cos, step->sin, num_threads);
        rotary_f32(step->qkv + q_width, t, dims->kv_heads, d, qkv_width, step->cos, step->sin, num_threads);
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
        failed = quant_gemm_f32(step->attn, t, layer->o.data, layer->o.row_bytes, (int)layer->o.qtype, q_width,
                                hidden, layer->o.bias, step->o, num_threads);
        if (failed) return failed;
        add_rms_norm_f32(step->x, step->o, t, hidden, layer->post_norm, dims->eps, step->h, num_threads);
        failed = quant_gemm_f32(step->h, t, layer->gate_up.data, layer->gate_up.row_bytes,
                                (int)layer->gate_up.qtype, hidden, 2 * dims->inner, layer->gate_up.bias,
                                step->gate_up, num_threads);
        if (failed) return failed;
        silu_mul_f32(step->gate_up, t, dims->inner, step->act, num_threads);
        failed = quant_gemm_f32(step->act, t, layer->down.data, layer->down.row_bytes, (int)layer->down.qtype,
                                dims->inner, hidden, layer->down.bias, step->delta, num_threads);
        if (failed) return failed;
    }
    return 0;
}
