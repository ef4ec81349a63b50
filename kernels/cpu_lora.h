/* LoRA updates of the projections that read one input, as a team's work (kernels/cpu_lora.c): the
 * decoder stack hands a LoraBatch to the product's team (TeamWork, cpu_common.h), which computes
 * the low-rank products before its own share of the product and adds the updates after it. */
#ifndef RICLLM_CPU_LORA_H
#define RICLLM_CPU_LORA_H

#include "cpu_common.h"

/* One adapter's update of one projection: A [rank, in] and Bᵀ [rank, out], both fp32 or both
 * bf16; rank 0: the adapter leaves the projection alone. */
typedef struct {
    const void *a;
    const void *b_t;
    float scale;
    int32_t rank;
} LoraUpdate;

#define LORA_MOST_OUTPUTS 3  /* q, k and v: the most projections that read one input */

/* One projection's columns of y's rows, ``out`` of them from ``column`` on, and its update per
 * segment of the batch. */
typedef struct {
    int64_t column;
    int out;
    const LoraUpdate *updates;
} LoraOutput;

/* y[r, output's columns] += scale · (x[r] · Aᵀ) · Bᵀ for every output, on the rows [starts[s],
 * ends[s]) of each segment s with that segment's update; x and y are rows of ``in`` and
 * ``y_stride`` values, ``x_stride`` and ``y_stride`` elements apart, fp32 or bf16 (``is_bf16``).
 * ``ricllm_lora_prepare`` places its working memory; the rest is what the caller says. */
typedef struct {
    const void *x;
    int64_t x_stride;
    int in;
    void *y;
    int64_t y_stride;
    int segments;
    const int32_t *starts;
    const int32_t *ends;
    int outputs;
    LoraOutput output[LORA_MOST_OUTPUTS];
    int is_bf16;
    int weights_bf16;
    /* placed by ricllm_lora_prepare */
    float *low_rank;   /* [outputs][rows][rank_stride]: scale · x · Aᵀ */
    int rows;          /* y's rows that a segment covers, from 0: max(ends) */
    int rank_stride;   /* the largest rank */
    char *scratch;     /* per thread: ROWS_AT_ONCE rows of x as fp32 */
    size_t scratch_per_thread;
} LoraBatch;

/* The bytes ``ricllm_lora_prepare`` takes for ``rows`` rows of ``in`` values, ranks up to
 * ``max_rank``, ``outputs`` outputs and up to ``num_threads`` threads. */
size_t ricllm_lora_scratch_bytes(int rows, int in, int max_rank, int outputs, int num_threads);
/* Checks the batch and places its working memory in ``scratch`` (``ricllm_lora_scratch_bytes``
 * bytes for the batch's rows, in, largest rank, outputs and up to ``num_threads`` threads, 4-byte
 * aligned). Returns 0, or -1 for a batch out of range (a negative width, rank or row, a segment that
 * ends before it starts, more outputs than LORA_MOST_OUTPUTS). */
int ricllm_lora_prepare(LoraBatch *batch, void *scratch, int num_threads);
/* Whether the batch has an update to add (a segment of nonzero rank in some output). */
int ricllm_lora_has_work(const LoraBatch *batch);
/* The two halves of a prepared batch, each thread ``thread`` of ``threads`` doing its share:
 * every thread's share of the first must be done before any thread starts the second. Each
 * value is computed by the same code whatever the thread count, so the sums are the same bits. */
void ricllm_lora_low_rank(const void *batch, int thread, int threads);
void ricllm_lora_add(const void *batch, int thread, int threads);

#endif
