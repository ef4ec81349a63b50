// CUDA paged decode attention: one query token per sequence over the paged KV cache.
//
// Grid (batch, n_kv * subgroups, num_splits), kThreads threads per CTA. A CTA owns one
// sequence, up to kMaxGroup query heads of one KV head (the whole GQA group when it fits),
// and one contiguous run of the context (the split). Inside the CTA every thread group of
// kTpt threads reads whole 16-byte-vectorised K/V rows and keeps its own online-softmax state
// (running max m, sum l, accumulator acc) in fp32 for every query head of the group, so each
// K/V row is read once for the whole group and no barrier sits in the main loop. The states
// are merged at the end: across thread groups of a warp with shuffles, across warps through
// shared memory. With num_splits > 1 each CTA writes a normalised partial output and its
// base-2 log-sum-exp; merge_splits_kernel combines them. Scores are kept in base 2
// (q pre-scaled by scale * log2(e)), cache offsets in int64.
#include "paged_decode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

namespace {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = 4;
constexpr int kThreads = kWarpSize * kNumWarps;
constexpr int kMaxGroup = 8;      // query heads per CTA; larger GQA groups use several CTAs
constexpr int kKeysInFlight = 4;  // 16-byte K (and V) vectors each thread loads before use
constexpr float kLog2e = 1.4426950408889634f;

// 16-byte vectors of T and scalar conversions to and from fp32.
template <typename T> struct Vec;

template <> struct Vec<float> {
  static constexpr int kLen = 4;
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
  __device__ static void unpack(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  }
};

template <> struct Vec<__half> {
  static constexpr int kLen = 8;
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static void unpack(const uint4& raw, float* out) {
    const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

template <> struct Vec<__nv_bfloat16> {
  static constexpr int kLen = 8;
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static void unpack(const uint4& raw, float* out) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

// How a head_dim row of T is spread over threads: a thread group of kTpt lanes reads one row,
// each lane kVpt 16-byte vectors (kElems values); lane i's vector j starts at (j*kTpt + i)*kLen.
template <typename T, int HEAD_DIM> struct RowLayout {
  static constexpr int kLen = Vec<T>::kLen;
  static constexpr int kRowVecs = HEAD_DIM / kLen;
  static constexpr int kTpt = kRowVecs < kWarpSize ? kRowVecs : kWarpSize;
  static constexpr int kVpt = kRowVecs / kTpt;
  static constexpr int kElems = kVpt * kLen;
  static constexpr int kGroupsPerCta = kThreads / kTpt;
  static constexpr int kUnroll = kKeysInFlight / kVpt > 0 ? kKeysInFlight / kVpt : 1;
  static_assert(HEAD_DIM % kLen == 0 && kRowVecs % kTpt == 0 && kWarpSize % kTpt == 0,
                "unsupported head_dim");
  __device__ static int dim(int lane_in_group, int j, int e) {
    return (j * kTpt + lane_in_group) * kLen + e;
  }
};

// Online-softmax state of one thread for GROUP query heads.
template <int GROUP, int ELEMS> struct SoftmaxState {
  float m[GROUP];
  float l[GROUP];
  float acc[GROUP][ELEMS];

  __device__ void init() {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      m[g] = -CUDART_INF_F;
      l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) acc[g][e] = 0.f;
    }
  }

  // Merge the state held by lane (this lane ^ offset) into this one (all lanes must call).
  __device__ void merge_from_lane(int offset) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float m_o = __shfl_xor_sync(0xffffffffu, m[g], offset);
      const float l_o = __shfl_xor_sync(0xffffffffu, l[g], offset);
      const float m_new = fmaxf(m[g], m_o);
      const float a = m[g] == -CUDART_INF_F ? 0.f : exp2f(m[g] - m_new);
      const float b = m_o == -CUDART_INF_F ? 0.f : exp2f(m_o - m_new);
      l[g] = l[g] * a + l_o * b;
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) {
        const float acc_o = __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
        acc[g][e] = acc[g][e] * a + acc_o * b;
      }
      m[g] = m_new;
    }
  }
};

struct CtaWork {
  int seq, kv_head, head0, n_heads_here, split, lo, hi;
};

template <int GROUP>
__device__ CtaWork cta_work(const RicllmDecodeParams& p) {
  CtaWork w;
  const int group = p.n_heads / p.n_kv;
  const int subgroups = (group + GROUP - 1) / GROUP;
  w.seq = blockIdx.x;
  w.kv_head = blockIdx.y / subgroups;
  w.head0 = w.kv_head * group + (blockIdx.y % subgroups) * GROUP;
  w.n_heads_here = min(GROUP, (w.kv_head + 1) * group - w.head0);
  w.split = blockIdx.z;
  const int ctx = p.context_lens[w.seq];
  const int per_split = (ctx + p.num_splits - 1) / p.num_splits;
  w.lo = min(ctx, w.split * per_split);
  w.hi = min(ctx, w.lo + per_split);
  return w;
}

// Writes output row (head, dim) = o / l, or the split's partial row and log-sum-exp.
template <typename T>
__device__ void write_result(const RicllmDecodeParams& p, const CtaWork& w, int head, int d,
                             float o, float l, float m) {
  const int64_t row = static_cast<int64_t>(w.seq) * p.n_heads + head;
  if (p.num_splits == 1) {
    static_cast<T*>(p.out)[row * p.head_dim + d] = Vec<T>::from_float(o / l);
    return;
  }
  const int64_t part = row * p.num_splits + w.split;
  p.partial_out[part * p.head_dim + d] = l > 0.f ? o / l : 0.f;
  if (d == 0) p.partial_lse[part] = l > 0.f ? m + log2f(l) : -CUDART_INF_F;
}

template <typename T, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads) decode_kernel(const RicllmDecodeParams p) {
  using L = RowLayout<T, HEAD_DIM>;
  constexpr int kStep = L::kGroupsPerCta * L::kUnroll;
  __shared__ float sm_acc[kNumWarps][GROUP][HEAD_DIM];
  __shared__ float sm_m[kNumWarps][GROUP];
  __shared__ float sm_l[kNumWarps][GROUP];

  const CtaWork w = cta_work<GROUP>(p);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int lane_in_group = threadIdx.x % L::kTpt;
  const int thread_group = threadIdx.x / L::kTpt;

  // This lane's slice of the group's queries, pre-scaled into the base-2 domain.
  float q[GROUP][L::kElems];
  const float qk_scale = p.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const T* q_row = static_cast<const T*>(p.query) + w.seq * p.q_stride_b +
                     (w.head0 + min(g, w.n_heads_here - 1)) * p.q_stride_h;
#pragma unroll
    for (int j = 0; j < L::kVpt; ++j)
#pragma unroll
      for (int e = 0; e < L::kLen; ++e)
        q[g][j * L::kLen + e] = Vec<T>::to_float(q_row[L::dim(lane_in_group, j, e)]) * qk_scale;
  }

  SoftmaxState<GROUP, L::kElems> st;
  st.init();
  const int32_t* table = p.block_tables + w.seq * p.table_stride;
  const int64_t lane_off = w.kv_head * p.cache_stride_head + L::dim(lane_in_group, 0, 0);
  const T* k_base = static_cast<const T*>(p.k_cache) + lane_off;
  const T* v_base = static_cast<const T*>(p.v_cache) + lane_off;

  for (int base = w.lo; base < w.hi; base += kStep) {  // uniform across the CTA
    uint4 k_raw[L::kUnroll][L::kVpt], v_raw[L::kUnroll][L::kVpt];
    bool valid[L::kUnroll];
#pragma unroll
    for (int u = 0; u < L::kUnroll; ++u) {
      const int t = base + u * L::kGroupsPerCta + thread_group;
      valid[u] = t < w.hi;
      const int64_t block = valid[u] ? table[t / p.block_size] : 0;
      const int64_t off = block * p.cache_stride_block + (t % p.block_size) * p.cache_stride_slot;
#pragma unroll
      for (int j = 0; j < L::kVpt; ++j) {
        const int64_t o = off + j * L::kTpt * L::kLen;
        k_raw[u][j] = valid[u] ? __ldg(reinterpret_cast<const uint4*>(k_base + o)) : make_uint4(0, 0, 0, 0);
        v_raw[u][j] = valid[u] ? __ldg(reinterpret_cast<const uint4*>(v_base + o)) : make_uint4(0, 0, 0, 0);
      }
    }

    float s[L::kUnroll][GROUP];
#pragma unroll
    for (int u = 0; u < L::kUnroll; ++u) {
      float k[L::kElems];
#pragma unroll
      for (int j = 0; j < L::kVpt; ++j) Vec<T>::unpack(k_raw[u][j], k + j * L::kLen);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < L::kElems; ++e) dot = fmaf(q[g][e], k[e], dot);
#pragma unroll
        for (int off = L::kTpt / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        s[u][g] = valid[u] ? dot : -CUDART_INF_F;
      }
    }

#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float m_new = st.m[g];
#pragma unroll
      for (int u = 0; u < L::kUnroll; ++u) m_new = fmaxf(m_new, s[u][g]);
      if (m_new == -CUDART_INF_F) continue;  // no valid key seen yet by this thread group
      const float alpha = exp2f(st.m[g] - m_new);
      st.l[g] *= alpha;
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) st.acc[g][e] *= alpha;
#pragma unroll
      for (int u = 0; u < L::kUnroll; ++u) {
        const float pr = exp2f(s[u][g] - m_new);
        st.l[g] += pr;
        float v[L::kElems];
#pragma unroll
        for (int j = 0; j < L::kVpt; ++j) Vec<T>::unpack(v_raw[u][j], v + j * L::kLen);
#pragma unroll
        for (int e = 0; e < L::kElems; ++e) st.acc[g][e] = fmaf(pr, v[e], st.acc[g][e]);
      }
      st.m[g] = m_new;
    }
  }

  // Thread groups of a warp -> lanes 0..kTpt-1, then warps -> shared memory.
#pragma unroll
  for (int off = L::kTpt; off < kWarpSize; off *= 2) st.merge_from_lane(off);
  if (lane < L::kTpt) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int j = 0; j < L::kVpt; ++j)
#pragma unroll
        for (int e = 0; e < L::kLen; ++e)
          sm_acc[warp][g][L::dim(lane_in_group, j, e)] = st.acc[g][j * L::kLen + e];
      if (lane == 0) {
        sm_m[warp][g] = st.m[g];
        sm_l[warp][g] = st.l[g];
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < w.n_heads_here * HEAD_DIM; idx += kThreads) {
    const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float m = -CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < kNumWarps; ++i) m = fmaxf(m, sm_m[i][g]);
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int i = 0; i < kNumWarps; ++i) {
      const float wt = sm_m[i][g] == -CUDART_INF_F ? 0.f : exp2f(sm_m[i][g] - m);
      l += sm_l[i][g] * wt;
      o += sm_acc[i][g][d] * wt;
    }
    write_result<T>(p, w, w.head0 + g, d, o, l, m);
  }
}

// Block per (seq, head) row, thread per dim: out = sum_s 2^(lse_s - max) * part_s / sum of weights.
template <typename T>
__global__ void merge_splits_kernel(const RicllmDecodeParams p) {
  const int64_t row = blockIdx.x;
  const float* lse = p.partial_lse + row * p.num_splits;
  float m = -CUDART_INF_F;
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, lse[s]);
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float l = 0.f, o = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float wt = lse[s] == -CUDART_INF_F ? 0.f : exp2f(lse[s] - m);
      l += wt;
      o += wt * p.partial_out[(row * p.num_splits + s) * p.head_dim + d];
    }
    static_cast<T*>(p.out)[row * p.head_dim + d] = Vec<T>::from_float(o / l);
  }
}

template <typename T, int HEAD_DIM, int GROUP>
int launch(const RicllmDecodeParams& p, cudaStream_t stream) {
  const int group = p.n_heads / p.n_kv;
  const dim3 grid(p.batch, p.n_kv * ((group + GROUP - 1) / GROUP), p.num_splits);
  decode_kernel<T, HEAD_DIM, GROUP><<<grid, kThreads, 0, stream>>>(p);
  if (p.num_splits > 1) {
    merge_splits_kernel<T><<<p.batch * p.n_heads, HEAD_DIM < kThreads ? HEAD_DIM : kThreads, 0, stream>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int HEAD_DIM>
int dispatch_group(const RicllmDecodeParams& p, cudaStream_t stream) {
  const int group = p.n_heads / p.n_kv;
  if (group <= 1) return launch<T, HEAD_DIM, 1>(p, stream);
  if (group <= 2) return launch<T, HEAD_DIM, 2>(p, stream);
  if (group <= 4) return launch<T, HEAD_DIM, 4>(p, stream);
  return launch<T, HEAD_DIM, kMaxGroup>(p, stream);
}

template <typename T>
int dispatch_head_dim(const RicllmDecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32: return dispatch_group<T, 32>(p, stream);
    case 64: return dispatch_group<T, 64>(p, stream);
    case 128: return dispatch_group<T, 128>(p, stream);
    case 256: return dispatch_group<T, 256>(p, stream);
    default: return RICLLM_BAD_HEAD_DIM;
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int element_size(int dtype) { return dtype == RICLLM_FLOAT32 ? 4 : 2; }

// Shapes, strides and buffers the kernels rely on; RICLLM_BAD_SHAPE when one is off.
int validate(const RicllmDecodeParams& p, int dtype) {
  if (dtype != RICLLM_FLOAT32 && dtype != RICLLM_FLOAT16 && dtype != RICLLM_BFLOAT16) return RICLLM_BAD_DTYPE;
  if (p.n_kv <= 0 || p.n_heads % p.n_kv != 0 || p.block_size <= 0 || p.batch < 0) return RICLLM_BAD_SHAPE;
  if (p.num_splits < 1 || p.num_splits > 65535 || p.n_kv * ((p.n_heads / p.n_kv + kMaxGroup - 1) / kMaxGroup) > 65535) {
    return RICLLM_BAD_SHAPE;
  }
  const int64_t vec = 16 / element_size(dtype);
  if (!aligned16(p.k_cache) || !aligned16(p.v_cache) || p.cache_stride_block % vec != 0 ||
      p.cache_stride_slot % vec != 0 || p.cache_stride_head % vec != 0) {
    return RICLLM_BAD_SHAPE;
  }
  if (!p.query || !p.block_tables || !p.context_lens || !p.out) return RICLLM_BAD_SHAPE;
  if (p.num_splits > 1 && (!p.partial_out || !p.partial_lse)) return RICLLM_BAD_SHAPE;
  return 0;
}

}  // namespace

extern "C" int ricllm_paged_decode(const RicllmDecodeParams* params, int dtype, cudaStream_t stream) {
  if (params == nullptr) return RICLLM_BAD_SHAPE;
  const int status = validate(*params, dtype);
  if (status != 0 || params->batch == 0) return status;
  switch (dtype) {
    case RICLLM_FLOAT32: return dispatch_head_dim<float>(*params, stream);
    case RICLLM_FLOAT16: return dispatch_head_dim<__half>(*params, stream);
    default: return dispatch_head_dim<__nv_bfloat16>(*params, stream);
  }
}

extern "C" const char* ricllm_status_string(int status) {
  switch (status) {
    case 0: return "success";
    case RICLLM_BAD_HEAD_DIM: return "head_dim must be 32, 64, 128 or 256";
    case RICLLM_BAD_DTYPE: return "dtype must be float32, float16 or bfloat16";
    case RICLLM_BAD_SHAPE:
      return "bad shape: n_heads must be a multiple of n_kv, caches 16-byte aligned with strides in "
             "whole 16-byte vectors, grid sizes within CUDA limits, every buffer set";
    default: return cudaGetErrorString(static_cast<cudaError_t>(status));
  }
}
