/* The elementwise steps of a Llama layer, fused for the CPU: one call where eager torch runs
 * four to eight small ops (each a dispatch, an allocation and a pass over memory). At decode
 * batch sizes these steps cost more than the matrix products between them.
 *
 * Each function rounds where eager torch rounds: every intermediate that torch would store in
 * the activation type (bf16) is rounded to it here too, so the fused layer computes what the
 * torch layer computes, up to the order of the fp32 sums in the norm.
 *
 * Rows are independent: small batches (decode) run on the calling thread, since waking a
 * thread team costs more than the work; large ones (prefill) are split across threads.
 */
#include "cpu_common.h"

#define PARALLEL_ROWS 32  /* below this many rows, one thread */

/* The row functions take ``is_bf16`` as a compile-time constant (always inlined into a dispatch
 * on it), so their loops vectorize: a run-time flag inside them would keep them scalar. */
#define INLINE static inline __attribute__((always_inline))
#define DISPATCH(is_bf16, call) do { if (is_bf16) { const int bf = 1; call; } else { const int bf = 0; call; } } while (0)

/* row = x (+ delta, rounded, written back to x) at ``base``; returns 1 / rms(row) */
INLINE float residual_row_inv_rms(void *x, const void *delta, int64_t base, int dim, float eps, const int bf,
                                  float *row) {
    load_row(x, base, dim, bf, row);
    if (delta) {
        for (int i = 0; i < dim; i++) row[i] = round_to(row[i] + load_at(delta, base + i, bf), bf);
        store_row(x, base, dim, bf, row);
    }
    float sum_sq = 0.0f;
    for (int i = 0; i < dim; i++) sum_sq += row[i] * row[i];
    return 1.0f / sqrtf(sum_sq / (float)dim + eps);
}

INLINE void add_rms_norm_row(void *x, const void *delta, const void *weight, void *out, int64_t base,
                             int dim, float eps, const int bf, float *row) {
    const float inv_rms = residual_row_inv_rms(x, delta, base, dim, eps, bf, row);
    for (int i = 0; i < dim; i++) store_at(out, base + i, bf, round_to(row[i] * inv_rms, bf) * load_at(weight, i, bf));
}

/* x += delta (if given), then out = w * round(x / rms(x)): HF's RMSNorm on the residual stream.
 * x is updated in place. */
int ricllm_add_rms_norm(void *x, const void *delta, const void *weight, void *out, int rows, int dim,
                        float eps, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int r = 0; r < rows; r++) {
        float row[dim];
        DISPATCH(is_bf16, add_rms_norm_row(x, delta, weight, out, (int64_t)r * dim, dim, eps, bf, row));
    }
    return 0;
}

/* Rotate-half RoPE of one head in place: x*cos + rotate_half(x)*sin, each product rounded. */
INLINE void rope_head(float *x, const float *cos, const float *sin, int d, const int bf) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = round_to(round_to(a * cos[i], bf) + round_to(-b * sin[i], bf), bf);
        x[i + half] = round_to(round_to(b * cos[i + half], bf) + round_to(a * sin[i + half], bf), bf);
    }
}

INLINE void rope_store_row(const void *qkv, void *q_out, const void *cos, const void *sin, int64_t slot,
                           void *k_cache, void *v_cache, int t, int heads, int kv_heads, int d,
                           const int bf, int cache_type) {
    float c[d], s[d], x[d];
    load_row(cos, (int64_t)t * d, d, bf, c);
    load_row(sin, (int64_t)t * d, d, bf, s);
    const int64_t row = (int64_t)t * (heads + 2 * kv_heads) * d;
    for (int h = 0; h < heads; h++) {
        load_row(qkv, row + (int64_t)h * d, d, bf, x);
        rope_head(x, c, s, d, bf);
        store_row(q_out, ((int64_t)t * heads + h) * d, d, bf, x);
    }
    if (slot < 0) return;
    for (int h = 0; h < kv_heads; h++) {
        const int64_t dst = slot * kv_heads + h;
        load_row(qkv, row + (int64_t)(heads + h) * d, d, bf, x);
        rope_head(x, c, s, d, bf);
        store_cache_row(k_cache, dst, d, cache_type, x);
        load_row(qkv, row + (int64_t)(heads + kv_heads + h) * d, d, bf, x);
        store_cache_row(v_cache, dst, d, cache_type, x);
    }
}

/* From the fused projection ``qkv [T, (H + 2·KVH)·D]``: q rotated into ``q_out [T, H, D]``;
 * k rotated and v as is, written to their cache slots (``slots[t] < 0``: padding, skipped) in
 * the cache's type (``cache_type``: CACHE_FP32, CACHE_BF16, or CACHE_INT8 rows with their scale).
 * ``cos``/``sin`` are ``[T, D]`` in the activation type, already gathered per position. */
int ricllm_rope_store(const void *qkv, void *q_out, const void *cos, const void *sin, const int64_t *slots,
                      void *k_cache, void *v_cache, int rows, int heads, int kv_heads, int head_dim,
                      int is_bf16, int cache_type, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int t = 0; t < rows; t++)
        DISPATCH(is_bf16, rope_store_row(qkv, q_out, cos, sin, slots[t], k_cache, v_cache, t, heads, kv_heads,
                                         head_dim, bf, cache_type));
    return 0;
}

/* round(gate / (1 + exp(e(gate)))) * up for one row of ``gate_up`` (gate first), where ``e`` is
 * ``gelu ? -2y : -gate`` with y = sqrt(2/pi)·(g + 0.044715·g³): silu is g / (1 + exp(-g)), and tanh-GELU
 * 0.5·g·(1 + tanh(y)) is g / (1 + exp(-2y)), a form whose loop vectorizes (tanhf's does not). exp
 * overflows past 88: clamping the exponent at 87 still gives ~ -1e-36, i.e. 0 (a ternary, not fminf,
 * whose NaN rules keep the loop scalar). In chunks through fp32 buffers: the loops over them
 * vectorize, a mixed bf16/fp32 loop does not. */
INLINE void gated_mul_row(const void *gate_up, void *out, int64_t in, int64_t dst, int inter, const int bf,
                          const int gelu) {
    enum { CHUNK = 64 };
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    float g[CHUNK], u[CHUNK];
    for (int first = 0; first < inter; first += CHUNK) {
        const int n = inter - first < CHUNK ? inter - first : CHUNK;
        load_row(gate_up, in + first, n, bf, g);
        load_row(gate_up, in + inter + first, n, bf, u);
        for (int i = 0; i < n; i++) {
            const float x = g[i], e = gelu ? -2.0f * beta * (x + kappa * (x * x * x)) : -x;
            g[i] = round_to(x / (1.0f + exp_approx(e > 87.0f ? 87.0f : e)), bf) * u[i];
        }
        store_row(out, dst + first, n, bf, g);
    }
}

/* out = round(silu(gate)) * up over ``gate_up [T, 2·I]`` (gate first): SwiGLU's activation. */
int ricllm_silu_mul(const void *gate_up, void *out, int rows, int inter, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int t = 0; t < rows; t++)
        DISPATCH(is_bf16, gated_mul_row(gate_up, out, (int64_t)t * 2 * inter, (int64_t)t * inter, inter, bf, 0));
    return 0;
}

/* Gemma 3's RMSNorm (HF's Gemma3RMSNorm): normalised and scaled in fp32, rounded once after, where
 * Llama's rounds the normalised row before the scale. ``weight`` holds HF's ``1 + w`` (the GGUF's). */
INLINE void add_rms_norm_scaled_row(void *x, const void *delta, const void *weight, void *out, int64_t base,
                                    int64_t out_base, int dim, float eps, const int bf, float *row) {
    const float inv_rms = residual_row_inv_rms(x, delta, base, dim, eps, bf, row);
    for (int i = 0; i < dim; i++) store_at(out, out_base + i, bf, row[i] * inv_rms * load_at(weight, i, bf));
}

/* x += delta (if given), then out = round(x / rms(x) · w): Gemma 3's norms on the residual stream and
 * on a sublayer's output (``delta`` NULL; ``out`` may be ``x``: each row is read before it is written). */
int ricllm_add_rms_norm_scaled(void *x, const void *delta, const void *weight, void *out, int rows, int dim,
                               float eps, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int r = 0; r < rows; r++) {
        float row[dim];
        DISPATCH(is_bf16, add_rms_norm_scaled_row(x, delta, weight, out, (int64_t)r * dim, (int64_t)r * dim, dim,
                                                  eps, bf, row));
    }
    return 0;
}

/* QK-norm in place on the fused projection ``qkv [T, (H + 2·KVH)·D]``: each query head's D values
 * normed with ``q_weight``, each key head's with ``k_weight`` (Gemma 3's RMSNorm over the head dim),
 * the values left as they are. */
int ricllm_qk_norm(void *qkv, const void *q_weight, const void *k_weight, int rows, int heads, int kv_heads,
                   int head_dim, float eps, int is_bf16, int num_threads) {
    const int per_row = heads + 2 * kv_heads;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int t = 0; t < rows; t++) {
        float row[head_dim];
        for (int h = 0; h < heads + kv_heads; h++) {
            const int64_t at = ((int64_t)t * per_row + h) * head_dim;
            const void *weight = h < heads ? q_weight : k_weight;
            DISPATCH(is_bf16, add_rms_norm_scaled_row(qkv, NULL, weight, qkv, at, at, head_dim, eps, bf, row));
        }
    }
    return 0;
}

/* out = round(round(gelu_tanh(gate)) * up) over ``gate_up [T, 2·I]`` (gate first): GeGLU, rounded as
 * eager torch's F.gelu(gate, approximate="tanh") * up. */
int ricllm_gelu_tanh_mul(const void *gate_up, void *out, int rows, int inter, int is_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int t = 0; t < rows; t++)
        DISPATCH(is_bf16, gated_mul_row(gate_up, out, (int64_t)t * 2 * inter, (int64_t)t * inter, inter, bf, 1));
    return 0;
}

/* fp32 copies of bf16 values (the upper half of an fp32 is a bf16): the logits the samplers read.
 * numpy widens a [rows, vocab] array in several passes on one thread (~0.14 ms at 8 rows of
 * SmolLM2's 49,152, 0.5-0.66 ms at 32: ~1% of a decode step); this is one pass on the threads. */
int ricllm_bf16_to_f32(const void *src, void *dst, int64_t count, int num_threads) {
    const uint16_t *in = src;
    uint32_t *out = dst;
#pragma omp parallel for num_threads(num_threads) if (count >= (1 << 16)) schedule(static)
    for (int64_t i = 0; i < count; i++) out[i] = (uint32_t)in[i] << 16;
    return 0;
}
