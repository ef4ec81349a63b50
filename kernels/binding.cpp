// Torch binding of the CUDA paged decode kernel (paged_decode.cu exposes a plain C launcher).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "paged_decode.h"

namespace {

int dtype_code(const at::ScalarType type) {
  switch (type) {
    case at::kFloat: return RICLLM_FLOAT32;
    case at::kHalf: return RICLLM_FLOAT16;
    case at::kBFloat16: return RICLLM_BFLOAT16;
    default: TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", type);
  }
  return -1;
}

void check_inputs(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens) {
  TORCH_CHECK(query.is_cuda() && k_cache.is_cuda() && v_cache.is_cuda() && block_tables.is_cuda() &&
                  context_lens.is_cuda(),
              "paged_decode: every tensor must be on the GPU");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "paged_decode: query [B, H, d], caches [N, bs, n_kv, d]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "paged_decode: k_cache and v_cache must share shape and strides");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "paged_decode: k_cache and v_cache dtypes differ");
  TORCH_CHECK(k_cache.stride(3) == 1, "paged_decode: the cache's head_dim must be contiguous");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "paged_decode: query and cache head_dim differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) == query.size(0),
              "paged_decode: block_tables must be [B, max_blocks] with contiguous rows");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == query.size(0), "paged_decode: context_lens [B]");
}

}  // namespace

// query [B, H, d] -> out [B, H, d] in the query's dtype; computed in the cache's dtype.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t num_splits) {
  check_inputs(query, k_cache, v_cache, block_tables, context_lens);
  TORCH_CHECK(num_splits >= 1, "paged_decode: num_splits must be >= 1");
  const c10::cuda::CUDAGuard guard(query.device());
  const auto q = query.to(k_cache.scalar_type()).contiguous();
  const auto contexts = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t batch = q.size(0), n_heads = q.size(1), head_dim = q.size(2);
  torch::Tensor partial, lse;
  if (num_splits > 1) {
    const auto opts = q.options().dtype(at::kFloat);
    partial = torch::empty({batch, n_heads, num_splits, head_dim}, opts);
    lse = torch::empty({batch, n_heads, num_splits}, opts);
  }

  RicllmDecodeParams p{};
  p.query = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.context_lens = contexts.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.partial_out = num_splits > 1 ? partial.data_ptr<float>() : nullptr;
  p.partial_lse = num_splits > 1 ? lse.data_ptr<float>() : nullptr;
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.cache_stride_block = k_cache.stride(0);
  p.cache_stride_slot = k_cache.stride(1);
  p.cache_stride_head = k_cache.stride(2);
  p.table_stride = block_tables.stride(0);
  p.batch = static_cast<int>(batch);
  p.n_heads = static_cast<int>(n_heads);
  p.n_kv = static_cast<int>(k_cache.size(2));
  p.head_dim = static_cast<int>(head_dim);
  p.block_size = static_cast<int>(k_cache.size(1));
  p.num_splits = static_cast<int>(num_splits);
  p.scale = static_cast<float>(scale);

  const int status = ricllm_paged_decode(&p, dtype_code(k_cache.scalar_type()),
                                         c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(status == 0, "paged_decode: ", ricllm_status_string(status));
  return out.to(query.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention (CUDA): query [B, H, d] -> [B, H, d]",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("num_splits"));
}
