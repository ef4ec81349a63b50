/* A Llama decoder stack for one decode step, as one C call.
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
 */
#include "cpu_common.h"

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
int ricllm_quant_gemm(const void *x, const uint8_t *w, const uint16_t *scales, const int32_t *offsets,
                      int bits, void *out, int m, int k, int n, int is_bf16, void *scratch, int num_threads);

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

#define TRY(call) do { code = (call); if (code != 0) goto done; } while (0)

/* Returns 0, or the first failing kernel's code (-2: out of memory). ``sinks``/``windows``: per
 * sequence sink + window retention, NULL when no sequence of the step keeps one (cpu_paged_attention.c);
 * dims[CACHE_TYPE]: the K/V caches' type (cpu_common.h). */
int ricllm_decoder_stack(void *x, void *out, const void *const *layer_ptrs, const int32_t *bits,
                         const void *final_norm, const void *cos, const void *sin, const int64_t *slots,
                         const int32_t *block_tables, const int32_t *query_start, const int32_t *context_lens,
                         const int32_t *sinks, const int32_t *windows, const int32_t *dims, float eps, float scale) {
    const int rows = dims[ROWS], hidden = dims[HIDDEN], heads = dims[HEADS], kv_heads = dims[KV_HEADS];
    const int head_dim = dims[HEAD_DIM], inter = dims[INTER], is_bf16 = dims[IS_BF16], threads = dims[NUM_THREADS];
    const int q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    const int widest_input = inter > hidden ? (inter > q_width ? inter : q_width) : (hidden > q_width ? hidden : q_width);
    const size_t elt = is_bf16 ? 2 : 4, row = (size_t)rows * elt;
    const size_t gemm_scratch = (size_t)rows * widest_input * 2 + (size_t)rows * (widest_input / 32 + 1) * 8;
    const size_t activations = row * ((size_t)2 * hidden + qkv_width + 2 * q_width + 3 * (size_t)inter);
    char *buffer = alloc_lines(activations + gemm_scratch + 64);
    if (!buffer) return -2;
    char *h = buffer, *qkv = h + row * hidden, *q = qkv + row * qkv_width, *attn = q + row * q_width;
    char *delta = attn + row * q_width, *gate_up = delta + row * hidden, *act = gate_up + row * 2 * inter;
    char *scratch = act + row * inter;
    int code = 0;
    for (int l = 0; l < dims[LAYERS]; l++) {
        const void *const *p = layer_ptrs + (int64_t)l * LAYER_POINTERS;
        const int32_t *b = bits + (int64_t)l * PROJECTIONS;
        TRY(ricllm_add_rms_norm(x, l == 0 ? NULL : delta, p[ATTN_NORM], h, rows, hidden, eps, is_bf16, threads));
        TRY(ricllm_quant_gemm(h, p[QKV_W], p[QKV_S], p[QKV_O], b[QKV], qkv, rows, hidden, qkv_width, is_bf16,
                              scratch, threads));
        TRY(ricllm_rope_store(qkv, q, cos, sin, slots, (void *)p[K_CACHE], (void *)p[V_CACHE], rows, heads,
                              kv_heads, head_dim, is_bf16, dims[CACHE_TYPE], threads));
        TRY(ricllm_attention(q, p[K_CACHE], p[V_CACHE], attn, block_tables, query_start, context_lens,
                             dims[BATCH], heads, kv_heads, head_dim, dims[BLOCK_SIZE], dims[TABLE_WIDTH],
                             scale, is_bf16, dims[CACHE_TYPE], sinks, windows, threads));
        TRY(ricllm_quant_gemm(attn, p[O_W], p[O_S], p[O_O], b[O], delta, rows, q_width, hidden, is_bf16,
                              scratch, threads));
        TRY(ricllm_add_rms_norm(x, delta, p[FFN_NORM], h, rows, hidden, eps, is_bf16, threads));
        TRY(ricllm_quant_gemm(h, p[GU_W], p[GU_S], p[GU_O], b[GATE_UP], gate_up, rows, hidden, 2 * inter,
                              is_bf16, scratch, threads));
        TRY(ricllm_silu_mul(gate_up, act, rows, inter, is_bf16, threads));
        TRY(ricllm_quant_gemm(act, p[DOWN_W], p[DOWN_S], p[DOWN_O], b[DOWN], delta, rows, inter, hidden, is_bf16,
                              scratch, threads));
    }
    TRY(ricllm_add_rms_norm(x, dims[LAYERS] > 0 ? delta : NULL, final_norm, out, rows, hidden, eps, is_bf16,
                            threads));
done:
    free_lines(buffer);
    return code;
}
