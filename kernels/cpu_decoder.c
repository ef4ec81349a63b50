/* A Llama decoder stack for one decode step, as one C call (and Gemma 3's, at the end of this file).
 *
 * Why: at decode batch sizes each layer's kernels take tens of microseconds, and calling them
 * one by one from Python (about ten calls a layer, each with its tensor allocations and
 * argument conversions) costs as much again: half of a one-stream step on a 2-core CPU. This
 * file runs the same kernels, in the same order and with the same roundings, for every layer,
 * so the step's Python work is one call. The torch model (``ricllm/engine/runtime/llama.py``) stays the
 * reference; the Python wrapper checks that the model fits (every projection packed in ricllm's
 * own layout, decode-only step) and otherwise the per-op path runs.
 *
 *   for each layer:  x += delta; h = n1(x);  q, k, v = W_qkv h;  RoPE(q, k); cache[slots] = k, v
 *                    delta = W_o attend(q)
 *                    x += delta; h = n2(x);  delta = W_down (silu(W_gate h) ⊙ W_up h)
 *   out = n(x + delta)
 *
 * ``x`` (the embedded tokens, [T, hidden]) is the residual stream and is updated in place.
 *
 * With LoRA adapters (``lora`` not NULL), each projection's output gets, on the rows of each of
 * the step's segments, its slot's low-rank update (cpu_lora.c) before anything reads it: q, k and
 * v on their columns of the qkv rows (from h), o on delta (from attn), gate and up on their halves
 * of the gate_up rows (from h), down on delta (from act). The product's own team does it, the
 * low-rank products before its tiles and the additions after them: a decode step's update is a
 * few microseconds, too little for a team of its own (a fork and join each) yet worth both cores.
 */
#include "cpu_common.h"
#include "cpu_lora.h"

int ricllm_add_rms_norm(void *x, const void *delta, const void *weight, void *out, int rows, int dim,
                        float eps, int is_bf16, int num_threads);
int ricllm_rope_store(const void *qkv, void *q_out, const void *cos, const void *sin, const int64_t *slots,
                      void *k_cache, void *v_cache, int rows, int heads, int kv_heads, int head_dim,
                      int is_bf16, int cache_type, int num_threads);
int ricllm_silu_mul(const void *gate_up, void *out, int rows, int inter, int is_bf16, int num_threads);
/* the paged kernel, or the blocked prefill kernel for steps with long prompts (cpu_prefill_attention.c) */
int ricllm_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int32_t *block_tables, const int32_t *query_start,
                     const int32_t *context_lens, int batch, int heads, int kv_heads,
                     int head_dim, int block_size, int table_width, float scale,
                     int is_bf16, int cache_type, const int32_t *sinks, const int32_t *windows,
                     int num_threads);
int ricllm_quant_gemm_with(const void *x, const uint8_t *w, const uint16_t *scales, const int32_t *offsets,
                           int bits, void *out, int m, int k, int n, int is_bf16, void *scratch, int num_threads,
                           const TeamWork *team);

/* A layer's pointers, in this order (``layer_ptrs`` holds LAYER_POINTERS per layer). Each
 * projection is (packed weight, fp16 scales, int32 offsets) as ``ricllm_quant_gemm`` takes it. */
enum { ATTN_NORM, QKV_W, QKV_S, QKV_O, O_W, O_S, O_O, FFN_NORM, GU_W, GU_S, GU_O, DOWN_W, DOWN_S, DOWN_O,
       K_CACHE, V_CACHE, LAYER_POINTERS };
enum { QKV, O, GATE_UP, DOWN, PROJECTIONS };  /* ``bits`` holds PROJECTIONS per layer */
/* ``dims``, in this order */
enum { ROWS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, BATCH, TABLE_WIDTH, BLOCK_SIZE, IS_BF16,
       NUM_THREADS, CACHE_TYPE, DIMS };

int ricllm_decoder_stack_dims(void) { return DIMS; }
int ricllm_decoder_stack_layer_pointers(void) { return LAYER_POINTERS; }

/* The LoRA projections of a layer, in the order it runs them (ricllm.model.lora.PROJECTIONS) */
enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_PROJECTIONS };

/* A step's adapters: rows [starts[s], ends[s]) take slot slots[s]'s updates (LoraUpdate, cpu_lora.h:
 * rank 0 where the slot's adapter leaves a projection alone), which ``table`` holds at
 * [slot][layer][projection] (``slot_count`` slots of ``layers`` layers); A and B are all bf16 or all
 * fp32 (``weights_bf16``). */
typedef struct {
    const int32_t *starts;
    const int32_t *ends;
    const int32_t *slots;
    const LoraUpdate *table;
    int32_t segments;
    int32_t slot_count;
    int32_t layers;
    int32_t weights_bf16;
} LoraStep;

/* What Python checks its copy of the structures against: 0 sizeof(LoraUpdate), 1 sizeof(LoraStep),
 * 2 the projections per layer. */
int ricllm_decoder_stack_lora_layout(int which) {
    switch (which) {
    case 0: return (int)sizeof(LoraUpdate);
    case 1: return (int)sizeof(LoraStep);
    case 2: return LORA_PROJECTIONS;
    default: return -1;
    }
}

/* A projection a product's team updates: its LORA_* number and its columns of the product's rows. */
typedef struct {
    int projection;
    int64_t column;
    int out;
} LoraTarget;

/* What a product's team needs for its LoRA updates: the batch and its work, room for its
 * LORA_MOST_OUTPUTS × segments updates, and the scratch (for ``threads`` threads). */
typedef struct {
    LoraBatch batch;
    TeamWork work;
    LoraUpdate *updates;
    void *scratch;
    int threads;
} LoraProduct;

/* The step's updates of ``count`` projections of layer ``layer`` that read x, each on its columns of
 * y's rows (y_stride apart), as ``*work`` for the product's team: NULL when no segment's slot
 * updates them. Returns 0, or -1 for updates that do not fit their columns. */
static int lora_product(const LoraStep *lora, int layer, const void *x, int in, void *y, int64_t y_stride,
                        int is_bf16, int count, const LoraTarget *targets, LoraProduct *product,
                        const TeamWork **work) {
    *work = NULL;
    if (lora == NULL || lora->segments == 0) return 0;
    LoraBatch *batch = &product->batch;
    *batch = (LoraBatch){.x = x, .x_stride = in, .in = in, .y = y, .y_stride = y_stride, .segments = lora->segments,
                         .starts = lora->starts, .ends = lora->ends, .outputs = count, .is_bf16 = is_bf16,
                         .weights_bf16 = lora->weights_bf16};
    for (int p = 0; p < count; p++) {
        LoraUpdate *updates = product->updates + (int64_t)p * lora->segments;
        for (int s = 0; s < lora->segments; s++)
            updates[s] = lora->table[((int64_t)lora->slots[s] * lora->layers + layer) * LORA_PROJECTIONS
                                     + targets[p].projection];
        batch->output[p] = (LoraOutput){targets[p].column, targets[p].out, updates};
    }
    if (!ricllm_lora_has_work(batch)) return 0;
    if (ricllm_lora_prepare(batch, product->scratch, product->threads) != 0) return -1;
    product->work = (TeamWork){ricllm_lora_low_rank, ricllm_lora_add, batch};
    *work = &product->work;
    return 0;
}

/* The largest rank the step's segments use (0 without LoRA), or -1 when the step does not fit
 * the stack: a slot, a row or the table's layers out of range. */
static int lora_max_rank(const LoraStep *lora, int layers, int rows) {
    if (lora == NULL) return 0;
    if (lora->layers != layers || lora->segments < 0) return -1;
    int max_rank = 0;
    for (int s = 0; s < lora->segments; s++) {
        if (lora->slots[s] < 0 || lora->slots[s] >= lora->slot_count || lora->starts[s] < 0
            || lora->ends[s] < lora->starts[s] || lora->ends[s] > rows) return -1;
        const LoraUpdate *u = &lora->table[(int64_t)lora->slots[s] * layers * LORA_PROJECTIONS];
        for (int i = 0; i < layers * LORA_PROJECTIONS; i++) {
            if (u[i].rank < 0) return -1;
            max_rank = u[i].rank > max_rank ? u[i].rank : max_rank;
        }
    }
    return max_rank;
}

/* One step's working memory for a decoder stack, in one allocation: the activations (h, qkv, q,
 * attn, delta, gate_up, act), the products' scratch, and the LoRA updates with their scratch; and
 * the projections LoRA may update, each on its columns of its product's rows. */
typedef struct {
    char *buffer, *h, *qkv, *q, *attn, *delta, *gate_up, *act, *scratch;
    LoraTarget qkv_lora[3], o_lora[1], gate_up_lora[2], down_lora[1];
    LoraProduct lora;
} StackMemory;

static size_t round_to_lines(size_t bytes) { return (bytes + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE; }

/* Returns 0 (free m->buffer with free_lines), -1 for a LoRA step that does not fit the stack, or
 * -2 when the memory cannot be had. */
static int stack_memory_open(StackMemory *m, const int32_t *dims, const LoraStep *lora) {
    const int rows = dims[ROWS], hidden = dims[HIDDEN], heads = dims[HEADS], kv_heads = dims[KV_HEADS];
    const int head_dim = dims[HEAD_DIM], inter = dims[INTER], threads = dims[NUM_THREADS] > 0 ? dims[NUM_THREADS] : 1;
    const int q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
    const int widest_input = inter > hidden ? (inter > q_width ? inter : q_width) : (hidden > q_width ? hidden : q_width);
    const size_t row = (size_t)rows * (dims[IS_BF16] ? 2 : 4);
    const size_t gemm_scratch = (size_t)rows * widest_input * 2 + (size_t)rows * (widest_input / 32 + 1) * 8;
    const size_t activations = row * ((size_t)2 * hidden + qkv_width + 2 * q_width + 3 * (size_t)inter);
    const int lora_rank = lora_max_rank(lora, dims[LAYERS], rows);
    if (lora_rank < 0) return -1;
    const int segments = lora && lora->segments > 0 ? lora->segments : 1;
    const size_t updates_at = round_to_lines(activations + gemm_scratch);
    const size_t lora_at = round_to_lines(updates_at + sizeof(LoraUpdate) * LORA_MOST_OUTPUTS * segments);
    const size_t lora_scratch = lora ? ricllm_lora_scratch_bytes(rows, widest_input, lora_rank, LORA_MOST_OUTPUTS,
                                                                 threads) : 0;
    m->buffer = alloc_lines(lora_at + lora_scratch + 64);
    if (!m->buffer) return -2;
    m->h = m->buffer, m->qkv = m->h + row * hidden, m->q = m->qkv + row * qkv_width, m->attn = m->q + row * q_width;
    m->delta = m->attn + row * q_width, m->gate_up = m->delta + row * hidden, m->act = m->gate_up + row * 2 * inter;
    m->scratch = m->act + row * inter;
    m->lora = (LoraProduct){.updates = (LoraUpdate *)(m->buffer + updates_at), .scratch = m->buffer + lora_at,
                            .threads = threads};
    m->qkv_lora[0] = (LoraTarget){LORA_Q, 0, q_width};
    m->qkv_lora[1] = (LoraTarget){LORA_K, q_width, kv_width};
    m->qkv_lora[2] = (LoraTarget){LORA_V, q_width + kv_width, kv_width};
    m->o_lora[0] = (LoraTarget){LORA_O, 0, hidden};
    m->down_lora[0] = (LoraTarget){LORA_DOWN, 0, hidden};
    m->gate_up_lora[0] = (LoraTarget){LORA_GATE, 0, inter};
    m->gate_up_lora[1] = (LoraTarget){LORA_UP, inter, inter};
    return 0;
}

#define TRY(call) do { code = (call); if (code != 0) goto done; } while (0)

/* Returns 0, -1 for a LoRA step that does not fit the stack (a slot, a row or its layers out of
 * range), or the first failing kernel's code (-2: out of memory). ``sinks``/``windows``: per
 * sequence sink + window retention, NULL when no sequence of the step keeps one (cpu_paged_attention.c);
 * ``lora``: the step's adapters, NULL when no row has one; dims[CACHE_TYPE]: the K/V caches' type
 * (cpu_common.h). */
int ricllm_decoder_stack(void *x, void *out, const void *const *layer_ptrs, const int32_t *bits,
                         const void *final_norm, const void *cos, const void *sin, const int64_t *slots,
                         const int32_t *block_tables, const int32_t *query_start, const int32_t *context_lens,
                         const int32_t *sinks, const int32_t *windows, const LoraStep *lora, const int32_t *dims,
                         float eps, float scale) {
    const int rows = dims[ROWS], hidden = dims[HIDDEN], heads = dims[HEADS], kv_heads = dims[KV_HEADS];
    const int head_dim = dims[HEAD_DIM], inter = dims[INTER], is_bf16 = dims[IS_BF16], threads = dims[NUM_THREADS];
    const int q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    StackMemory m;
    int code = stack_memory_open(&m, dims, lora);
    if (code != 0) return code;
    char *h = m.h, *qkv = m.qkv, *q = m.q, *attn = m.attn, *delta = m.delta, *gate_up = m.gate_up, *act = m.act;
    char *scratch = m.scratch;
    const TeamWork *with_lora;  /* the product's LoRA updates, for its team */
    for (int l = 0; l < dims[LAYERS]; l++) {
        const void *const *p = layer_ptrs + (int64_t)l * LAYER_POINTERS;
        const int32_t *b = bits + (int64_t)l * PROJECTIONS;
        TRY(ricllm_add_rms_norm(x, l == 0 ? NULL : delta, p[ATTN_NORM], h, rows, hidden, eps, is_bf16, threads));
        TRY(lora_product(lora, l, h, hidden, qkv, qkv_width, is_bf16, 3, m.qkv_lora, &m.lora, &with_lora));
        TRY(ricllm_quant_gemm_with(h, p[QKV_W], p[QKV_S], p[QKV_O], b[QKV], qkv, rows, hidden, qkv_width, is_bf16,
                                   scratch, threads, with_lora));
        TRY(ricllm_rope_store(qkv, q, cos, sin, slots, (void *)p[K_CACHE], (void *)p[V_CACHE], rows, heads,
                              kv_heads, head_dim, is_bf16, dims[CACHE_TYPE], threads));
        TRY(ricllm_attention(q, p[K_CACHE], p[V_CACHE], attn, block_tables, query_start, context_lens,
                             dims[BATCH], heads, kv_heads, head_dim, dims[BLOCK_SIZE], dims[TABLE_WIDTH],
                             scale, is_bf16, dims[CACHE_TYPE], sinks, windows, threads));
        TRY(lora_product(lora, l, attn, q_width, delta, hidden, is_bf16, 1, m.o_lora, &m.lora, &with_lora));
        TRY(ricllm_quant_gemm_with(attn, p[O_W], p[O_S], p[O_O], b[O], delta, rows, q_width, hidden, is_bf16,
                                   scratch, threads, with_lora));
        TRY(ricllm_add_rms_norm(x, delta, p[FFN_NORM], h, rows, hidden, eps, is_bf16, threads));
        TRY(lora_product(lora, l, h, hidden, gate_up, 2 * inter, is_bf16, 2, m.gate_up_lora, &m.lora,
                         &with_lora));
        TRY(ricllm_quant_gemm_with(h, p[GU_W], p[GU_S], p[GU_O], b[GATE_UP], gate_up, rows, hidden, 2 * inter,
                                   is_bf16, scratch, threads, with_lora));
        TRY(ricllm_silu_mul(gate_up, act, rows, inter, is_bf16, threads));
        TRY(lora_product(lora, l, act, inter, delta, hidden, is_bf16, 1, m.down_lora, &m.lora, &with_lora));
        TRY(ricllm_quant_gemm_with(act, p[DOWN_W], p[DOWN_S], p[DOWN_O], b[DOWN], delta, rows, inter, hidden,
                                   is_bf16, scratch, threads, with_lora));
    }
    TRY(ricllm_add_rms_norm(x, dims[LAYERS] > 0 ? delta : NULL, final_norm, out, rows, hidden, eps, is_bf16,
                            threads));
done:
    free_lines(m.buffer);
    return code;
}

/* ---------------------------------------------------------------------------------------------
 * Gemma 3's decoder stack (ricllm/engine/runtime/gemma3.py is the reference): the same kernels, with
 * Gemma's norms (scaled in fp32: ricllm_add_rms_norm_scaled), QK-norm, a norm after each sublayer,
 * GeGLU, each layer's RoPE table and each layer's view of the cache:
 *
 *   for each layer:  x += delta; h = n1(x);  q, k, v = W_qkv h;  q, k = n_q(q), n_k(k) per head
 *                    RoPE_θ(q, k); cache[slots_view] = k, v;  delta = n_post1(W_o attend_view(q))
 *                    x += delta; h = n2(x);  delta = n_post2(W_down (gelu_tanh(W_gate h) ⊙ W_up h))
 *   out = n(x + delta)
 *
 * A layer's view is its cache group's block tables and slots with its sliding window (ricllm/cache/
 * kv_groups.py): layers of one view attend alike.
 *
 * With LoRA adapters (``step->lora`` not NULL) each projection's output gets its rows' updates as
 * in the Llama stack, inside the product's team: q and k before QK-norm (PEFT adapts q_proj and
 * k_proj, whose outputs Gemma then norms), o and down before their post-sublayer norms, gate and
 * up before GeGLU.
 */
int ricllm_add_rms_norm_scaled(void *x, const void *delta, const void *weight, void *out, int rows, int dim,
                               float eps, int is_bf16, int num_threads);
int ricllm_qk_norm(void *qkv, const void *q_weight, const void *k_weight, int rows, int heads, int kv_heads,
                   int head_dim, float eps, int is_bf16, int num_threads);
int ricllm_gelu_tanh_mul(const void *gate_up, void *out, int rows, int inter, int is_bf16, int num_threads);

/* A Gemma 3 layer's pointers beside LAYER_POINTERS: its QK-norm and post-sublayer norm weights */
enum { Q_NORM, K_NORM, POST_ATTN_NORM, POST_FFN_NORM, GEMMA3_NORMS };

/* What a Gemma 3 step needs beyond the Llama stack's arguments. ``cos``/``sin`` hold ``rope_tables``
 * tables of [rows, head_dim] one after another; a view's sinks and windows are NULL together when
 * no sequence keeps a window there. */
typedef struct {
    const void *const *norms;             /* GEMMA3_NORMS per layer */
    const int32_t *layer_rope;            /* per layer: its table in cos/sin */
    const int32_t *layer_view;            /* per layer: its view */
    const int64_t *const *view_slots;     /* per view: the step's cache slots [rows] */
    const int32_t *const *view_tables;    /* per view: block tables [batch, table_width] */
    const int32_t *const *view_sinks;     /* per view: [batch] or NULL */
    const int32_t *const *view_windows;   /* per view: [batch] or NULL */
    const LoraStep *lora;                 /* the step's adapters, NULL when no row has one */
    int32_t views;
    int32_t rope_tables;
} Gemma3Step;

/* What Python checks its copy of the structure against: its size and GEMMA3_NORMS. */
int ricllm_gemma3_stack_layout(int which) {
    switch (which) {
    case 0: return (int)sizeof(Gemma3Step);
    case 1: return GEMMA3_NORMS;
    default: return -1;
    }
}

/* Returns 0, -1 for a step whose layers name a view or RoPE table it does not have or whose LoRA
 * step does not fit the stack, or the first failing kernel's code (-2: out of memory). dims and
 * layer_ptrs as ricllm_decoder_stack's. */
int ricllm_gemma3_decoder_stack(void *x, void *out, const void *const *layer_ptrs, const int32_t *bits,
                                const void *final_norm, const void *cos, const void *sin,
                                const int32_t *query_start, const int32_t *context_lens, const Gemma3Step *step,
                                const int32_t *dims, float eps, float scale) {
    const int rows = dims[ROWS], hidden = dims[HIDDEN], heads = dims[HEADS], kv_heads = dims[KV_HEADS];
    const int head_dim = dims[HEAD_DIM], inter = dims[INTER], is_bf16 = dims[IS_BF16], threads = dims[NUM_THREADS];
    const int q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    for (int l = 0; l < dims[LAYERS]; l++)
        if (step->layer_view[l] < 0 || step->layer_view[l] >= step->views || step->layer_rope[l] < 0
            || step->layer_rope[l] >= step->rope_tables) return -1;
    const LoraStep *lora = step->lora;
    const size_t table_bytes = (size_t)rows * head_dim * (is_bf16 ? 2 : 4);
    StackMemory m;
    int code = stack_memory_open(&m, dims, lora);
    if (code != 0) return code;
    char *h = m.h, *qkv = m.qkv, *q = m.q, *attn = m.attn, *delta = m.delta, *gate_up = m.gate_up, *act = m.act;
    char *scratch = m.scratch;
    const TeamWork *with_lora;  /* the product's LoRA updates, for its team */
    for (int l = 0; l < dims[LAYERS]; l++) {
        const void *const *p = layer_ptrs + (int64_t)l * LAYER_POINTERS;
        const void *const *n = step->norms + (int64_t)l * GEMMA3_NORMS;
        const int32_t *b = bits + (int64_t)l * PROJECTIONS;
        const int view = step->layer_view[l];
        const size_t table = (size_t)step->layer_rope[l] * table_bytes;
        TRY(ricllm_add_rms_norm_scaled(x, l == 0 ? NULL : delta, p[ATTN_NORM], h, rows, hidden, eps, is_bf16,
                                       threads));
        TRY(lora_product(lora, l, h, hidden, qkv, qkv_width, is_bf16, 3, m.qkv_lora, &m.lora, &with_lora));
        TRY(ricllm_quant_gemm_with(h, p[QKV_W], p[QKV_S], p[QKV_O], b[QKV], qkv, rows, hidden, qkv_width, is_bf16,
                                   scratch, threads, with_lora));
        TRY(ricllm_qk_norm(qkv, n[Q_NORM], n[K_NORM], rows, heads, kv_heads, head_dim, eps, is_bf16, threads));
        TRY(ricllm_rope_store(qkv, q, (const char *)cos + table, (const char *)sin + table, step->view_slots[view],
                              (void *)p[K_CACHE], (void *)p[V_CACHE], rows, heads, kv_heads, head_dim, is_bf16,
                              dims[CACHE_TYPE], threads));
        TRY(ricllm_attention(q, p[K_CACHE], p[V_CACHE], attn, step->view_tables[view], query_start, context_lens,
                             dims[BATCH], heads, kv_heads, head_dim, dims[BLOCK_SIZE], dims[TABLE_WIDTH], scale,
                             is_bf16, dims[CACHE_TYPE], step->view_sinks[view], step->view_windows[view], threads));
        TRY(lora_product(lora, l, attn, q_width, delta, hidden, is_bf16, 1, m.o_lora, &m.lora, &with_lora));
        TRY(ricllm_quant_gemm_with(attn, p[O_W], p[O_S], p[O_O], b[O], delta, rows, q_width, hidden, is_bf16,
                                   scratch, threads, with_lora));
        TRY(ricllm_add_rms_norm_scaled(delta, NULL, n[POST_ATTN_NORM], delta, rows, hidden, eps, is_bf16, threads));
        TRY(ricllm_add_rms_norm_scaled(x, delta, p[FFN_NORM], h, rows, hidden, eps, is_bf16, threads));
        TRY(lora_product(lora, l, h, hidden, gate_up, 2 * inter, is_bf16, 2, m.gate_up_lora, &m.lora,
                         &with_lora));
        TRY(ricllm_quant_gemm_with(h, p[GU_W], p[GU_S], p[GU_O], b[GATE_UP], gate_up, rows, hidden, 2 * inter,
                                   is_bf16, scratch, threads, with_lora));
        TRY(ricllm_gelu_tanh_mul(gate_up, act, rows, inter, is_bf16, threads));
        TRY(lora_product(lora, l, act, inter, delta, hidden, is_bf16, 1, m.down_lora, &m.lora, &with_lora));
        TRY(ricllm_quant_gemm_with(act, p[DOWN_W], p[DOWN_S], p[DOWN_O], b[DOWN], delta, rows, inter, hidden,
                                   is_bf16, scratch, threads, with_lora));
        TRY(ricllm_add_rms_norm_scaled(delta, NULL, n[POST_FFN_NORM], delta, rows, hidden, eps, is_bf16, threads));
    }
    TRY(ricllm_add_rms_norm_scaled(x, dims[LAYERS] > 0 ? delta : NULL, final_norm, out, rows, hidden, eps, is_bf16,
                                   threads));
done:
    free_lines(m.buffer);
    return code;
}
