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
 * At rank 8-64 this is a few percent of the projection's own multiply-adds. Rows of one segment
 * share each read of A and B: a block of up to ROWS_AT_ONCE rows loads each vector of A and B once
 * for all its rows.
 */
#include "cpu_common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define ROWS_AT_ONCE 4
#define PARALLEL_ROWS 32  /* below this many rows, one thread: waking a team costs more than the work */
/* GCC's vector types, so that each family's build holds its sums in its own registers: 16 floats a
 * vector with AVX-512, 8 with AVX2. Each block of rows keeps at least four independent sums going
 * (a multiply-add's latency is about four of its issue slots), and at most 16 vectors of them (AVX2 has 16
 * registers): a block of R rows sums A_ROWS(R) rows of A at once, and OUT_VECTORS(R) vectors of
 * outputs in t · Bᵀ. */
#if defined(__AVX512F__)
#define LANES 16
#define A_ROWS(rows) 4
#else
#define LANES 8
#define A_ROWS(rows) ((rows) <= 2 ? 4 : 2)
#endif
#define MOST_A_ROWS 4
#define OUT_VECTORS(rows) ((rows) == 1 ? 4 : 2)
#define MOST_OUT_VECTORS 4
typedef float vfloat __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
typedef uint32_t vbits __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
typedef uint16_t vhalf __attribute__((vector_size(LANES * 2), aligned(2), may_alias));

/* The row functions take the two type flags, the row count and the block of A's rows as compile-
 * time constants (always inlined into a dispatch on them), so their loops unroll into registers. */
#define INLINE static inline __attribute__((always_inline))
/* loops over a block's rows, rows of A and vectors of outputs, unrolled: their sums stay in registers */
#define UNROLL _Pragma("GCC unroll 16")
#define DISPATCH2(is_bf16, weights_bf16, call) do {                                   \
        if (is_bf16) { const int xb = 1; if (weights_bf16) { const int wb = 1; call; } \
                       else { const int wb = 0; call; } }                              \
        else { const int xb = 0; if (weights_bf16) { const int wb = 1; call; }       \
               else { const int wb = 0; call; } }                                     \
    } while (0)

/* LANES values from index i, widened from bf16 (fp32's upper half) or loaded as fp32 */
INLINE vfloat load_lanes(const void *base, int64_t i, const int bf) {
    if (bf) return (vfloat)(__builtin_convertvector(*(const vhalf *)((const uint16_t *)base + i), vbits) << 16);
    return *(const vfloat *)((const float *)base + i);
}

/* LANES values to index i, rounded to bf16 (to nearest even, as f32_to_bf16) or stored as fp32 */
INLINE void store_lanes(void *base, int64_t i, const int bf, vfloat v) {
    if (bf) {
        const vbits bits = (vbits)v;
        const vbits rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
        *(vhalf *)((uint16_t *)base + i) = __builtin_convertvector(rounded, vhalf);
    } else {
        *(vfloat *)((float *)base + i) = v;
    }
}

INLINE float sum_lanes(vfloat v) {
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += v[l];
    return sum;
}

/* t[i, j + jj] = scale · x_i · A[j + jj] for jj < a_rows: each A vector loaded once for all rows. */
INLINE void low_rank(const float *xs, int in, const int rows, const void *a, int j, const int a_rows, int rank,
                     float scale, const int wb, float *t) {
    vfloat sums[MOST_A_ROWS][ROWS_AT_ONCE];
    UNROLL for (int jj = 0; jj < a_rows; jj++)
        UNROLL for (int i = 0; i < rows; i++) sums[jj][i] = (vfloat){0};
    int k = 0;
    for (; k + LANES <= in; k += LANES) {
        vfloat xv[ROWS_AT_ONCE];
        UNROLL for (int i = 0; i < rows; i++) xv[i] = *(const vfloat *)(xs + (int64_t)i * in + k);
        UNROLL for (int jj = 0; jj < a_rows; jj++) {
            const vfloat weights = load_lanes(a, (int64_t)(j + jj) * in + k, wb);
            UNROLL for (int i = 0; i < rows; i++) sums[jj][i] += xv[i] * weights;
        }
    }
    UNROLL for (int jj = 0; jj < a_rows; jj++) {
        for (int i = 0; i < rows; i++) {
            float sum = sum_lanes(sums[jj][i]);
            const int64_t row_of_a = (int64_t)(j + jj) * in;
            for (int kk = k; kk < in; kk++) sum += xs[(int64_t)i * in + kk] * load_at(a, row_of_a + kk, wb);
            t[i * rank + j + jj] = sum * scale;
        }
    }
}

/* Rows [first, first + rows) of one segment, rows <= ROWS_AT_ONCE: t = scale · x · Aᵀ, then y += t · Bᵀ,
 * OUT_VECTORS(rows) vectors of outputs at a time, each B vector loaded once for all rows. ``scratch``
 * holds ROWS_AT_ONCE · (in + rank) floats. */
INLINE void lora_block(const void *x, int64_t x_stride, void *y, int64_t y_stride, int in, int out, int first,
                       const int rows, int rank, const void *a, const void *b_t, float scale, const int xb,
                       const int wb, float *scratch) {
    float *xs = scratch, *t = xs + ROWS_AT_ONCE * in;
    for (int i = 0; i < rows; i++) load_row(x, (int64_t)(first + i) * x_stride, in, xb, xs + (int64_t)i * in);
    int j = 0;
    const int a_rows = A_ROWS(rows);
    for (; j + a_rows <= rank; j += a_rows) low_rank(xs, in, rows, a, j, a_rows, rank, scale, wb, t);
    for (; j < rank; j++) low_rank(xs, in, rows, a, j, 1, rank, scale, wb, t);
    int o = 0;
    const int vectors = OUT_VECTORS(rows);
    for (; o + vectors * LANES <= out; o += vectors * LANES) {
        vfloat sums[ROWS_AT_ONCE][MOST_OUT_VECTORS];
        UNROLL for (int i = 0; i < rows; i++)
            UNROLL for (int c = 0; c < vectors; c++) sums[i][c] = (vfloat){0};
        for (int jj = 0; jj < rank; jj++) {
            vfloat weights[MOST_OUT_VECTORS];
            UNROLL for (int c = 0; c < vectors; c++)
                weights[c] = load_lanes(b_t, (int64_t)jj * out + o + c * LANES, wb);
            UNROLL for (int i = 0; i < rows; i++)
                UNROLL for (int c = 0; c < vectors; c++) sums[i][c] += t[i * rank + jj] * weights[c];
        }
        UNROLL for (int i = 0; i < rows; i++) {
            const int64_t at = (int64_t)(first + i) * y_stride + o;
            UNROLL for (int c = 0; c < vectors; c++)
                store_lanes(y, at + c * LANES, xb, load_lanes(y, at + c * LANES, xb) + sums[i][c]);
        }
    }
    for (; o < out; o++) {
        for (int i = 0; i < rows; i++) {
            float sum = 0.0f;
            for (int jj = 0; jj < rank; jj++) sum += t[i * rank + jj] * load_at(b_t, (int64_t)jj * out + o, wb);
            const int64_t at = (int64_t)(first + i) * y_stride + o;
            store_at(y, at, xb, load_at(y, at, xb) + sum);
        }
    }
}

/* lora_block with its row count a compile-time constant */
INLINE void lora_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, int in, int out, int first,
                      int rows, int rank, const void *a, const void *b_t, float scale, const int xb, const int wb,
                      float *scratch) {
#define LORA_BLOCK(count) lora_block(x, x_stride, y, y_stride, in, out, first, count, rank, a, b_t, scale, xb, wb, \
                                     scratch)
    switch (rows) {
    case 1: LORA_BLOCK(1); break;
    case 2: LORA_BLOCK(2); break;
    case 3: LORA_BLOCK(3); break;
    default: LORA_BLOCK(4); break;
    }
#undef LORA_BLOCK
}

static int blocks_of(int rows) { return (rows + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE; }

static size_t scratch_per_thread(int in, int max_rank) {
    return ((size_t)ROWS_AT_ONCE * (in + max_rank) * sizeof(float) + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE;
}

/* The scratch ``ricllm_lora_in`` takes for inputs of ``in`` values, ranks up to ``max_rank`` and
 * up to ``num_threads`` threads. */
size_t ricllm_lora_scratch_bytes(int in, int max_rank, int num_threads) {
    return scratch_per_thread(in, max_rank) * (size_t)(num_threads > 0 ? num_threads : 1);
}

/* ``ricllm_lora`` in the caller's scratch (``ricllm_lora_scratch_bytes(in, max rank, num_threads)``
 * bytes, 4-byte aligned): the decoder stack calls it for every projection of every layer, from
 * its own buffer. Returns 0, or -1 for arguments out of range. */
int ricllm_lora_in(const void *x, int64_t x_stride, void *y, int64_t y_stride, int in, int out, int segments,
                   const int32_t *starts, const int32_t *ends, const int32_t *ranks, const void *const *a,
                   const void *const *b_t, const float *scales, int is_bf16, int weights_bf16, int num_threads,
                   void *scratch) {
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
    const size_t per_thread = scratch_per_thread(in, max_rank);
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
        float *mine = (float *)((char *)scratch + per_thread * (size_t)omp_get_thread_num());
#else
        float *mine = (float *)scratch;
#endif
        DISPATCH2(is_bf16, weights_bf16, lora_rows(x, x_stride, y, y_stride, in, out, first, count, ranks[s], a[s],
                                                  b_t[s], scales[s], xb, wb, mine));
    }
    return 0;
}

/* Returns 0, -1 for arguments out of range (a negative width, rank or row, a segment that ends
 * before it starts), -2 when out of memory. */
int ricllm_lora(const void *x, int64_t x_stride, void *y, int64_t y_stride, int in, int out, int segments,
                const int32_t *starts, const int32_t *ends, const int32_t *ranks, const void *const *a,
                const void *const *b_t, const float *scales, int is_bf16, int weights_bf16, int num_threads) {
    if (in <= 0 || segments < 0) return -1;
    int max_rank = 0;
    for (int s = 0; s < segments; s++) max_rank = ranks[s] > max_rank ? ranks[s] : max_rank;
    char *scratch = alloc_lines(ricllm_lora_scratch_bytes(in, max_rank, num_threads));
    if (!scratch) return -2;
    const int code = ricllm_lora_in(x, x_stride, y, y_stride, in, out, segments, starts, ends, ranks, a, b_t,
                                    scales, is_bf16, weights_bf16, num_threads, scratch);
    free_lines(scratch);
    return code;
}
