/* Low-rank (LoRA) updates of one projection's output, for a batch whose rows are grouped by adapter.
 *
 *   for each segment s, for each row r in [start_s, end_s):   y[r] += scale_s · (x[r] · A_sᵀ) · B_sᵀ
 *
 * A_s is [rank_s, in] and B_s is given transposed, [rank_s, out], so that both products stream
 * whole rows: t = x[r] · A_sᵀ is rank_s dot products along ``in``, and t · B_sᵀ adds rank_s
 * scaled rows of B_sᵀ along ``out``. Rows that no segment covers are not touched (requests
 * without an adapter); segments must not overlap. The sums are fp32 and y is rounded once, when
 * the update is added: y[r] = round(y[r] + scale · Σ_j t_j · B_sᵀ[j]).
 *
 * x and y are rows of ``in`` and ``out`` values, ``x_stride`` and ``y_stride`` elements apart, so
 * y may be a column slice of a fused output (q, k and v inside one qkv row; gate and up inside
 * one gate_up row). Activations are fp32 or bf16 (``is_bf16``), the A and B values fp32 or bf16
 * (``weights_bf16``).
 *
 * At rank 8-64 this is a few percent of the projection's own multiply-adds; what it costs is
 * reading A and B. Rows of one segment share each read: blocks of ROWS_AT_ONCE rows take each
 * row of A and B once from memory and reuse it from L1 for the other rows.
 */
#include "cpu_common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define ROWS_AT_ONCE 4
#define PARALLEL_ROWS 32  /* below this many rows, one thread: waking a team costs more than the work */

/* The row functions take the two type flags as compile-time constants (always inlined into a
 * dispatch on them), so their loops vectorize. */
#define INLINE static inline __attribute__((always_inline))
#define DISPATCH2(is_bf16, weights_bf16, call) do {                                   \
        if (is_bf16) { const int xb = 1; if (weights_bf16) { const int wb = 1; call; } \
                       else { const int wb = 0; call; } }                              \
        else { const int xb = 0; if (weights_bf16) { const int wb = 1; call; }       \
               else { const int wb = 0; call; } }                                     \
    } while (0)

/* Rows [first, first + rows) of one segment, rows <= ROWS_AT_ONCE; ``scratch`` holds
 * ROWS_AT_ONCE · (in + out + rank) floats. */
INLINE void lora_block(const void *x, int64_t x_stride, void *y, int64_t y_stride, int in, int out, int first,
                       int rows, int rank, const void *a, const void *b_t, float scale, const int xb, const int wb,
                       float *scratch) {
    float *xs = scratch, *delta = xs + ROWS_AT_ONCE * in, *t = delta + ROWS_AT_ONCE * out;
    for (int i = 0; i < rows; i++) load_row(x, (int64_t)(first + i) * x_stride, in, xb, xs + (int64_t)i * in);
    for (int j = 0; j < rank; j++) {
        const int64_t row_of_a = (int64_t)j * in;
        for (int i = 0; i < rows; i++) {
            const float *xi = xs + (int64_t)i * in;
            float sum = 0.0f;
            for (int k = 0; k < in; k++) sum += xi[k] * load_at(a, row_of_a + k, wb);
            t[i * rank + j] = sum * scale;
        }
    }
    for (int i = 0; i < rows; i++) {
        float *di = delta + (int64_t)i * out;
        for (int o = 0; o < out; o++) di[o] = 0.0f;
        for (int j = 0; j < rank; j++) {
            const float tj = t[i * rank + j];
            const int64_t row_of_b = (int64_t)j * out;
            for (int o = 0; o < out; o++) di[o] += tj * load_at(b_t, row_of_b + o, wb);
        }
        const int64_t at = (int64_t)(first + i) * y_stride;
        for (int o = 0; o < out; o++) store_at(y, at + o, xb, load_at(y, at + o, xb) + di[o]);
    }
}

static int blocks_of(int rows) { return (rows + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE; }

/* Returns 0, -1 for arguments out of range (a negative width, rank or row, a segment that ends
 * before it starts), -2 when out of memory. */
int ricllm_lora(const void *x, int64_t x_stride, void *y, int64_t y_stride, int in, int out, int segments,
                const int32_t *starts, const int32_t *ends, const int32_t *ranks, const void *const *a,
                const void *const *b_t, const float *scales, int is_bf16, int weights_bf16, int num_threads) {
    if (in <= 0 || out <= 0 || segments < 0 || x_stride < in || y_stride < out) return -1;
    int blocks = 0, rows = 0, max_rank = 0;
    for (int s = 0; s < segments; s++) {
        if (starts[s] < 0 || ends[s] < starts[s] || ranks[s] <= 0) return -1;
        blocks += blocks_of(ends[s] - starts[s]);
        rows += ends[s] - starts[s];
        max_rank = ranks[s] > max_rank ? ranks[s] : max_rank;
    }
    if (blocks == 0) return 0;
    const int threads = rows >= PARALLEL_ROWS ? num_threads : 1;
    const size_t per_thread = ((size_t)ROWS_AT_ONCE * (in + out + max_rank) * sizeof(float) + CACHE_LINE - 1)
                              / CACHE_LINE * CACHE_LINE;
    char *scratch = alloc_lines(per_thread * (threads > 0 ? threads : 1));
    if (!scratch) return -2;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int block = 0; block < blocks; block++) {
        int s = 0, first_block = 0;  /* the segment this block is in, and that segment's first block */
        while (first_block + blocks_of(ends[s] - starts[s]) <= block) {
            first_block += blocks_of(ends[s] - starts[s]);
            s++;
        }
        const int first = starts[s] + (block - first_block) * ROWS_AT_ONCE;
        const int count = ends[s] - first < ROWS_AT_ONCE ? ends[s] - first : ROWS_AT_ONCE;
#ifdef _OPENMP
        float *mine = (float *)(scratch + per_thread * (size_t)omp_get_thread_num());
#else
        float *mine = (float *)scratch;
#endif
        DISPATCH2(is_bf16, weights_bf16, lora_block(x, x_stride, y, y_stride, in, out, first, count, ranks[s], a[s],
                                                   b_t[s], scales[s], xb, wb, mine));
    }
    free_lines(scratch);
    return 0;
}
