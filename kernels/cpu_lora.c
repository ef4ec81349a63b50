/* Low-rank (LoRA) updates of projections' outputs, for a batch whose rows are grouped by adapter.
 *
 *   for each segment s, for each row r in [start_s, end_s):   y[r] += scale_s · (x[r] · A_sᵀ) · B_sᵀ
 *
 * A_s is [rank_s, in] and B_s is given transposed, [rank_s, out], so that both products stream
 * whole rows: t = scale · x[r] · A_sᵀ is rank_s dot products along ``in``, and t · B_sᵀ adds rank_s
 * rows of B_sᵀ along ``out``. Rows that no segment covers are not touched (requests without an
 * adapter); segments must not overlap. The sums are fp32 and y is rounded once, when the update is
 * added: y[r] = round(y[r] + Σ_j t_j · B_sᵀ[j]).
 *
 * x and y are rows of ``in`` and ``out`` values, ``x_stride`` and ``y_stride`` elements apart, so
 * y may be a column slice of a fused output (q, k and v inside one qkv row; gate and up inside
 * one gate_up row). Activations are fp32 or bf16 (``is_bf16``), the A and B values fp32 or bf16
 * (``weights_bf16``).
 *
 * A batch (cpu_lora.h) holds the updates of up to three projections that read one x, in two
 * halves that a team of threads shares: the low-rank products t (pieces of a block of rows times a
 * few rows of A), then the additions to y (ranges of output columns). At decode sizes the work is
 * a few microseconds a projection, mostly reading A and B; the decoder stack runs the halves in
 * the team of the projection's own product (before its tiles and after them), so they take both
 * cores without a team of their own. Each value comes from the same code however the pieces fall
 * to threads: the sums are the same bits with any thread count.
 *
 * What a decode step's update costs is reading A and B: a few KB a projection that the step's
 * other weights evicted since the last step. Each half asks for its thread's lines of A or Bᵀ at
 * once before reading them (``fetch``), and the first half also asks for the second's Bᵀ, which
 * then arrives while the product's tiles run.
 *
 * At rank 8-64 this is a few percent of the projection's own multiply-adds. Rows of one segment
 * share each read of A and B: a block of up to ROWS_AT_ONCE rows loads each vector of A and B once
 * for all its rows.
 */
#include "cpu_lora.h"

#define ROWS_AT_ONCE 4
#define PARALLEL_ROWS 32  /* a call on its own: below this many rows, one thread (a team costs more) */
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
/* the additions split y's columns at multiples of this: every block's run of OUT_VECTORS vectors
 * then starts where it would without the split */
#define COLUMN_CHUNK (MOST_OUT_VECTORS * LANES)
typedef float vfloat __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
typedef uint32_t vbits __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
typedef uint16_t vhalf __attribute__((vector_size(LANES * 2), aligned(2), may_alias));

/* The inner functions take the type flags, the row count and the block of A's rows as compile-
 * time constants (always inlined into a dispatch on them), so their loops unroll into registers. */
#define INLINE static inline __attribute__((always_inline))
/* loops over a block's rows, rows of A and vectors of outputs, unrolled: their sums stay in registers */
#define UNROLL _Pragma("GCC unroll 16")

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

/* t[i·t_stride + j + jj] = scale · x_i · A[j + jj] for jj < a_rows: each A vector loaded once for all rows. */
INLINE void low_rank(const float *xs, int in, const int rows, const void *a, int j, const int a_rows, int t_stride,
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
            t[i * t_stride + j + jj] = sum * scale;
        }
    }
}

/* low_rank for ``rows`` (1 to ROWS_AT_ONCE) rows of x, at A rows [j, j + A_ROWS(rows)), or the one
 * A row j (``single``: the rank's remainder) */
static void low_rank_piece(const float *xs, int in, int rows, const void *a, int j, int single, int t_stride,
                           float scale, int weights_bf16, float *t) {
#define LOW_RANK(count, wb) (single ? low_rank(xs, in, count, a, j, 1, t_stride, scale, wb, t) \
                                    : low_rank(xs, in, count, a, j, A_ROWS(count), t_stride, scale, wb, t))
#define LOW_RANK_ROWS(count) (weights_bf16 ? LOW_RANK(count, 1) : LOW_RANK(count, 0))
    switch (rows) {
    case 1: LOW_RANK_ROWS(1); break;
    case 2: LOW_RANK_ROWS(2); break;
    case 3: LOW_RANK_ROWS(3); break;
    default: LOW_RANK_ROWS(4); break;
    }
#undef LOW_RANK_ROWS
#undef LOW_RANK
}

/* y[first + i, o] += Σ_j t[i·t_stride + j] · Bᵀ[j, o] for the block's rows and columns [from, to),
 * OUT_VECTORS(rows) vectors of outputs at a time, each B vector loaded once for all rows; from is a
 * multiple of COLUMN_CHUNK and so is to unless it is ``out`` (where the last columns run one by one). */
INLINE void add_to_rows(const float *t, int t_stride, const void *b_t, int rank, int out, int from, int to, void *y,
                        int64_t y_stride, int first, const int rows, const int xb, const int wb) {
    int o = from;
    const int vectors = OUT_VECTORS(rows);
    for (; o + vectors * LANES <= to; o += vectors * LANES) {
        vfloat sums[ROWS_AT_ONCE][MOST_OUT_VECTORS];
        UNROLL for (int i = 0; i < rows; i++)
            UNROLL for (int c = 0; c < vectors; c++) sums[i][c] = (vfloat){0};
        for (int jj = 0; jj < rank; jj++) {
            vfloat weights[MOST_OUT_VECTORS];
            UNROLL for (int c = 0; c < vectors; c++)
                weights[c] = load_lanes(b_t, (int64_t)jj * out + o + c * LANES, wb);
            UNROLL for (int i = 0; i < rows; i++)
                UNROLL for (int c = 0; c < vectors; c++) sums[i][c] += t[i * t_stride + jj] * weights[c];
        }
        UNROLL for (int i = 0; i < rows; i++) {
            const int64_t at = (int64_t)(first + i) * y_stride + o;
            UNROLL for (int c = 0; c < vectors; c++)
                store_lanes(y, at + c * LANES, xb, load_lanes(y, at + c * LANES, xb) + sums[i][c]);
        }
    }
    for (; o < to; o++) {
        for (int i = 0; i < rows; i++) {
            float sum = 0.0f;
            for (int jj = 0; jj < rank; jj++) sum += t[i * t_stride + jj] * load_at(b_t, (int64_t)jj * out + o, wb);
            const int64_t at = (int64_t)(first + i) * y_stride + o;
            store_at(y, at, xb, load_at(y, at, xb) + sum);
        }
    }
}

/* add_to_rows for ``rows`` (1 to ROWS_AT_ONCE) rows, its types compile-time constants */
static void add_piece(const float *t, int t_stride, const void *b_t, int rank, int out, int from, int to, void *y,
                      int64_t y_stride, int first, int rows, int is_bf16, int weights_bf16) {
#define ADD(count, xb, wb) add_to_rows(t, t_stride, b_t, rank, out, from, to, y, y_stride, first, count, xb, wb)
#define ADD_TYPES(count) (is_bf16 ? (weights_bf16 ? ADD(count, 1, 1) : ADD(count, 1, 0)) \
                                  : (weights_bf16 ? ADD(count, 0, 1) : ADD(count, 0, 0)))
    switch (rows) {
    case 1: ADD_TYPES(1); break;
    case 2: ADD_TYPES(2); break;
    case 3: ADD_TYPES(3); break;
    default: ADD_TYPES(4); break;
    }
#undef ADD_TYPES
#undef ADD
}

static int blocks_of(int rows) { return (rows + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE; }

static size_t lines(size_t bytes) { return (bytes + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE; }

static size_t scratch_per_thread(int in) { return lines((size_t)ROWS_AT_ONCE * in * sizeof(float)); }

static size_t low_rank_bytes(int rows, int max_rank, int outputs) {
    return lines((size_t)outputs * rows * max_rank * sizeof(float));
}

size_t ricllm_lora_scratch_bytes(int rows, int in, int max_rank, int outputs, int num_threads) {
    return low_rank_bytes(rows, max_rank, outputs) + scratch_per_thread(in) * (size_t)(num_threads > 0 ? num_threads : 1);
}

int ricllm_lora_prepare(LoraBatch *batch, void *scratch, int num_threads) {
    if (batch->in <= 0 || batch->segments < 0 || batch->x_stride < batch->in || batch->outputs < 0
        || batch->outputs > LORA_MOST_OUTPUTS) return -1;
    int rows = 0, max_rank = 0;
    for (int s = 0; s < batch->segments; s++) {
        if (batch->starts[s] < 0 || batch->ends[s] < batch->starts[s]) return -1;
        rows = batch->ends[s] > rows ? batch->ends[s] : rows;
    }
    for (int p = 0; p < batch->outputs; p++) {
        const LoraOutput *output = &batch->output[p];
        if (output->out <= 0 || output->column < 0 || output->column + output->out > batch->y_stride) return -1;
        for (int s = 0; s < batch->segments; s++) {
            if (output->updates[s].rank < 0) return -1;
            max_rank = output->updates[s].rank > max_rank ? output->updates[s].rank : max_rank;
        }
    }
    batch->rows = rows, batch->rank_stride = max_rank;
    batch->low_rank = (float *)scratch;
    batch->scratch = (char *)scratch + low_rank_bytes(rows, max_rank, batch->outputs);
    batch->scratch_per_thread = scratch_per_thread(batch->in);
    (void)num_threads;  /* the caller sized the scratch for its threads */
    return 0;
}

int ricllm_lora_has_work(const LoraBatch *batch) {
    for (int p = 0; p < batch->outputs; p++)
        for (int s = 0; s < batch->segments; s++)
            if (batch->output[p].updates[s].rank > 0 && batch->ends[s] > batch->starts[s]) return 1;
    return 0;
}

/* The pieces of a batch are numbered in one order, each with a cost, and thread ``thread`` of
 * ``threads`` takes those whose first unit of cost falls in its share [total·thread/threads,
 * total·(thread+1)/threads): consecutive pieces, about as much work on each thread. */
typedef struct {
    int64_t from, to, at;  /* the thread's share, and the cost counted so far */
} Share;

static Share share_of(int64_t total, int thread, int threads) {
    return (Share){total * thread / threads, total * (thread + 1) / threads, 0};
}

/* Whether the next piece, of ``cost``, is the thread's (and counts it). */
static int take(Share *share, int64_t cost) {
    const int mine = share->at >= share->from && share->at < share->to;
    share->at += cost;
    return mine;
}

static float *low_rank_rows(const LoraBatch *b, int p, int first) {
    return b->low_rank + ((int64_t)p * b->rows + first) * b->rank_stride;
}

/* The second half's columns of each output for thread ``thread`` of ``threads``: [from[p], to[p]),
 * from[p] -1 where it has none. Pieces of (output, COLUMN_CHUNK columns), each for every segment's
 * rows, costed by the rows of Bᵀ they read. */
static void columns_of(const LoraBatch *b, int thread, int threads, int *from, int *to) {
    int64_t total = 0, per_chunk[LORA_MOST_OUTPUTS];
    for (int p = 0; p < b->outputs; p++) {
        per_chunk[p] = 0;
        for (int s = 0; s < b->segments; s++)
            per_chunk[p] += (int64_t)b->output[p].updates[s].rank * blocks_of(b->ends[s] - b->starts[s]);
        total += per_chunk[p] * ((b->output[p].out + COLUMN_CHUNK - 1) / COLUMN_CHUNK);
    }
    Share share = share_of(total, thread, threads);
    for (int p = 0; p < b->outputs; p++) {
        const int out = b->output[p].out;
        from[p] = to[p] = -1;
        for (int o = 0; o < out; o += COLUMN_CHUNK)
            if (take(&share, per_chunk[p])) {
                from[p] = from[p] < 0 ? o : from[p];
                to[p] = o + COLUMN_CHUNK < out ? o + COLUMN_CHUNK : out;
            }
        if (per_chunk[p] == 0) from[p] = to[p] = -1;
    }
}

/* Asks the memory for ``bytes`` from ``at``, a line at a time, into the cache level ``locality``
 * names (__builtin_prefetch's). The adapter's weights are a few KB a projection, read once a step
 * and evicted by the step's other weights in between: each half would otherwise wait on its lines
 * a few at a time, as its loads reach them. */
static void fetch(const void *at, size_t bytes, const int locality) {
    const char *line = (const char *)((uintptr_t)at / CACHE_LINE * CACHE_LINE), *end = (const char *)at + bytes;
    for (; line < end; line += CACHE_LINE) {
        if (locality == 3) __builtin_prefetch(line, 0, 3);
        else __builtin_prefetch(line, 0, 2);
    }
}

/* The rows of A the thread's pieces of the first half read (``share`` as ricllm_lora_low_rank's),
 * into L1: per update, the rows from the first to the last its pieces start on. */
static void fetch_a_rows(const LoraBatch *b, Share share) {
    const size_t elt = b->weights_bf16 ? 2 : 4;
    for (int p = 0; p < b->outputs; p++)
        for (int s = 0; s < b->segments; s++) {
            const LoraUpdate *u = &b->output[p].updates[s];
            int lowest = u->rank, highest = 0;  /* A's rows [lowest, highest) hold the thread's pieces */
            for (int first = b->starts[s]; first < b->ends[s]; first += ROWS_AT_ONCE) {
                const int rows = b->ends[s] - first < ROWS_AT_ONCE ? b->ends[s] - first : ROWS_AT_ONCE;
                const int a_rows = A_ROWS(rows);
                (void)rows;  /* AVX-512's A_ROWS is one count for any rows */
                for (int j = 0; j < u->rank;) {
                    const int count = j + a_rows > u->rank ? 1 : a_rows;
                    if (take(&share, count)) {
                        lowest = j < lowest ? j : lowest;
                        highest = j + count > highest ? j + count : highest;
                    }
                    j += count;
                }
            }
            if (lowest < highest)
                fetch((const char *)u->a + (size_t)lowest * b->in * elt, (size_t)(highest - lowest) * b->in * elt, 3);
        }
}

/* The columns of Bᵀ a thread's share of the second half reads (columns_of's ``from`` and ``to``),
 * into L1 (``locality`` 3) or L2 (2). */
static void fetch_b_columns(const LoraBatch *b, const int *from, const int *to, const int locality) {
    const size_t elt = b->weights_bf16 ? 2 : 4;
    for (int p = 0; p < b->outputs; p++) {
        if (from[p] < 0) continue;
        for (int s = 0; s < b->segments; s++) {
            const LoraUpdate *u = &b->output[p].updates[s];
            for (int j = 0; j < u->rank; j++)
                fetch((const char *)u->b_t + ((size_t)j * b->output[p].out + from[p]) * elt,
                      (size_t)(to[p] - from[p]) * elt, locality);
        }
    }
}

/* The first half: t = scale · x · Aᵀ in pieces of (output, segment, block of rows, A_ROWS rows of A or
 * one), costed by the rows of A they read. */
void ricllm_lora_low_rank(const void *work, int thread, int threads) {
    const LoraBatch *b = work;
    int64_t total = 0;
    for (int p = 0; p < b->outputs; p++)
        for (int s = 0; s < b->segments; s++)
            total += (int64_t)b->output[p].updates[s].rank * blocks_of(b->ends[s] - b->starts[s]);
    fetch_a_rows(b, share_of(total, thread, threads));
    Share share = share_of(total, thread, threads);
    float *xs = (float *)(b->scratch + b->scratch_per_thread * (size_t)thread);
    int loaded = -1;  /* the first row of the block of x in xs */
    for (int p = 0; p < b->outputs; p++)
        for (int s = 0; s < b->segments; s++) {
            const LoraUpdate *u = &b->output[p].updates[s];
            for (int first = b->starts[s]; first < b->ends[s]; first += ROWS_AT_ONCE) {
                const int rows = b->ends[s] - first < ROWS_AT_ONCE ? b->ends[s] - first : ROWS_AT_ONCE;
                const int a_rows = A_ROWS(rows);
                for (int j = 0; j < u->rank;) {
                    const int single = j + a_rows > u->rank, count = single ? 1 : a_rows;
                    if (take(&share, count)) {
                        if (loaded != first) {
                            for (int i = 0; i < rows; i++)
                                load_row(b->x, (int64_t)(first + i) * b->x_stride, b->in, b->is_bf16,
                                         xs + (int64_t)i * b->in);
                            loaded = first;
                        }
                        low_rank_piece(xs, b->in, rows, u->a, j, single, b->rank_stride, u->scale, b->weights_bf16,
                                       low_rank_rows(b, p, first));
                    }
                    j += count;
                }
            }
        }
    /* the second half's Bᵀ, to arrive while the product's own tiles run between the halves */
    int from[LORA_MOST_OUTPUTS], to[LORA_MOST_OUTPUTS];
    columns_of(b, thread, threads, from, to);
    fetch_b_columns(b, from, to, 2);
}

/* The second half: y += t · Bᵀ on the thread's columns (columns_of). */
void ricllm_lora_add(const void *work, int thread, int threads) {
    const LoraBatch *b = work;
    int from_of[LORA_MOST_OUTPUTS], to_of[LORA_MOST_OUTPUTS];
    columns_of(b, thread, threads, from_of, to_of);
    fetch_b_columns(b, from_of, to_of, 3);  /* what the tiles evicted, asked for at once */
    for (int p = 0; p < b->outputs; p++) {
        const LoraOutput *output = &b->output[p];
        const int from = from_of[p], to = to_of[p];
        if (from < 0) continue;
        void *y = (char *)b->y + output->column * (b->is_bf16 ? 2 : 4);
        for (int s = 0; s < b->segments; s++) {
            const LoraUpdate *u = &output->updates[s];
            if (u->rank == 0) continue;
            for (int first = b->starts[s]; first < b->ends[s]; first += ROWS_AT_ONCE) {
                const int rows = b->ends[s] - first < ROWS_AT_ONCE ? b->ends[s] - first : ROWS_AT_ONCE;
                add_piece(low_rank_rows(b, p, first), b->rank_stride, u->b_t, u->rank, output->out, from, to, y,
                          b->y_stride, first, rows, b->is_bf16, b->weights_bf16);
            }
        }
    }
}

/* One projection's update, on its own: the two halves in a team of its own from PARALLEL_ROWS rows,
 * else on the calling thread. Returns 0, -1 for arguments out of range (a negative width, rank or
 * row, a segment that ends before it starts), -2 when out of memory. */
int ricllm_lora(const void *x, int64_t x_stride, void *y, int64_t y_stride, int in, int out, int segments,
                const int32_t *starts, const int32_t *ends, const int32_t *ranks, const void *const *a,
                const void *const *b_t, const float *scales, int is_bf16, int weights_bf16, int num_threads) {
    if (in <= 0 || out <= 0 || segments < 0 || x_stride < in || y_stride < out) return -1;
    LoraUpdate updates[segments > 0 ? segments : 1];
    int rows = 0, max_rank = 0;
    for (int s = 0; s < segments; s++) {
        if (starts[s] < 0 || ends[s] < starts[s] || ranks[s] <= 0) return -1;
        updates[s] = (LoraUpdate){a[s], b_t[s], scales[s], ranks[s]};
        rows += ends[s] - starts[s];
        max_rank = ranks[s] > max_rank ? ranks[s] : max_rank;
    }
    LoraBatch batch = {.x = x, .x_stride = x_stride, .in = in, .y = y, .y_stride = y_stride, .segments = segments,
                       .starts = starts, .ends = ends, .outputs = 1, .output = {{0, out, updates}},
                       .is_bf16 = is_bf16, .weights_bf16 = weights_bf16};
    if (rows == 0) return 0;
    const int threads = rows >= PARALLEL_ROWS && num_threads > 1 ? num_threads : 1;
    int last_row = 0;
    for (int s = 0; s < segments; s++) last_row = ends[s] > last_row ? ends[s] : last_row;
    char *scratch = alloc_lines(ricllm_lora_scratch_bytes(last_row, in, max_rank, 1, threads));
    if (!scratch) return -2;
    int code = ricllm_lora_prepare(&batch, scratch, threads);
    if (code == 0) {
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            ricllm_lora_low_rank(&batch, team_thread(), team_size());
#pragma omp barrier
            ricllm_lora_add(&batch, team_thread(), team_size());
        }
    }
    free_lines(scratch);
    return code;
}
