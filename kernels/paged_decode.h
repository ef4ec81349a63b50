// Plain C interface of the CUDA paged decode kernel (no torch headers on either side).
//
// Cache layout per layer: k_cache, v_cache: [num_blocks, block_size, n_kv, head_dim], the last
// dimension contiguous, K and V with the same strides. GQA: query head h reads KV head
// h / (n_heads / n_kv). Query, caches and the final output share one dtype.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum RicllmDtype { RICLLM_FLOAT32 = 0, RICLLM_FLOAT16 = 1, RICLLM_BFLOAT16 = 2 };

// Return codes of ricllm_paged_decode besides cudaSuccess (0) and cudaError_t values.
enum RicllmStatus {
  RICLLM_BAD_HEAD_DIM = -1,   // head_dim not in {32, 64, 128, 256}
  RICLLM_BAD_DTYPE = -2,      // dtype not a RicllmDtype
  RICLLM_BAD_SHAPE = -3,      // n_heads % n_kv != 0, a size out of range, or a missing buffer
};

typedef struct RicllmDecodeParams {
  const void* query;            // [batch, n_heads, head_dim], rows strided, last dim contiguous
  const void* k_cache;          // [num_blocks, block_size, n_kv, head_dim]
  const void* v_cache;          // same shape and strides as k_cache
  const int32_t* block_tables;  // [batch, table_width]; entries past the context never read
  const int32_t* context_lens;  // [batch], each >= 1
  void* out;                    // [batch, n_heads, head_dim] contiguous, written iff num_splits == 1
  float* partial_out;           // [batch, n_heads, num_splits, head_dim] fp32, iff num_splits > 1
  float* partial_lse;           // [batch, n_heads, num_splits] fp32 (base-2 log-sum-exp)
  int64_t q_stride_b, q_stride_h;
  int64_t cache_stride_block, cache_stride_slot, cache_stride_head;
  int64_t table_stride;
  int batch, n_heads, n_kv, head_dim, block_size, num_splits;
  float scale;
} RicllmDecodeParams;

// Launches the decode kernel (and the split merge when num_splits > 1) on `stream`.
// Returns 0 on success, a RicllmStatus for bad arguments, or the cudaError_t of the launch.
int ricllm_paged_decode(const RicllmDecodeParams* params, int dtype, cudaStream_t stream);

// Human-readable text for a return code of ricllm_paged_decode.
const char* ricllm_status_string(int status);

#ifdef __cplusplus
}
#endif
