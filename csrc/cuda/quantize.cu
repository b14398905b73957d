// CUDA kernels of the quantized-update ops (schemas: csrc/ops.cpp; host side:
// csrc/quantize_host.h; per-element math: QuantizeMath in csrc/elementwise.h).
//
// quantize_int8: one warp per block of block_size elements: max|v| and the non-finite flag by
// warp reductions (exact, so in any order), then each lane rounds its elements. The stochastic
// words are the Philox words of the element's index in the whole list, as on the CPU, so both
// devices give the same values for a seed.
// dequantize_weighted_sum: one thread per element adds the K clients' (w_k s_kb) q in client
// order in float32 (the _rn intrinsics: no fused multiply-add, the CPU's bits).
#include <ATen/core/Tensor.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../elementwise.h"
#include "../quantize_host.h"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kSumChunk = kThreads * 4;
constexpr int64_t kMaxBlocks = 65535LL * 32;

// The index of the range [prefix[i], prefix[i + 1]) holding c, for prefix[0] = 0 <= c <
// prefix[n].
__device__ __forceinline__ int64_t range_of(const int64_t* prefix, int64_t n, int64_t c) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// A host table of int64 words copied to the device: pointers, sizes and prefixes.
at::Tensor upload(const std::vector<int64_t>& words, at::Device device) {
  at::Tensor host = at::empty({static_cast<int64_t>(words.size())}, at::kLong);
  std::copy(words.begin(), words.end(), host.mutable_data_ptr<int64_t>());
  return host.to(device);
}

// Table of a quantize call with n tensors: x, residual, values, scales, residual_out, numel,
// first (n words each), then the n + 1 block prefixes.
struct QuantizeTable {
  const int64_t* w;
  int64_t n;
  __device__ const void* x(int64_t t) const { return reinterpret_cast<const void*>(w[t]); }
  __device__ const void* res(int64_t t) const { return reinterpret_cast<const void*>(w[n + t]); }
  __device__ int8_t* q(int64_t t) const { return reinterpret_cast<int8_t*>(w[2 * n + t]); }
  __device__ float* s(int64_t t) const { return reinterpret_cast<float*>(w[3 * n + t]); }
  __device__ void* res_out(int64_t t) const { return reinterpret_cast<void*>(w[4 * n + t]); }
  __device__ int64_t numel(int64_t t) const { return w[5 * n + t]; }
  __device__ int64_t first(int64_t t) const { return w[6 * n + t]; }
  __device__ const int64_t* prefix() const { return w + 7 * n; }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_kernel(
    QuantizeTable m, int64_t B, bool stochastic, bool feedback, uint64_t seed, uint64_t offset) {
  using A = acc_type<T>;
  const int lane = threadIdx.x & 31;
  const int64_t total = m.prefix()[m.n];
  for (int64_t blk = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; blk < total;
       blk += int64_t(gridDim.x) * kWarps) {
    const int64_t t = range_of(m.prefix(), m.n, blk);
    const int64_t b0 = (blk - m.prefix()[t]) * B;
    const int64_t len = b0 + B < m.numel(t) ? B : m.numel(t) - b0;
    const T* x = static_cast<const T*>(m.x(t)) + b0;
    const T* r = feedback ? static_cast<const T*>(m.res(t)) + b0 : nullptr;
    A amax = A(0);
    bool bad = false;
    for (int64_t i = lane; i < len; i += 32) {
      const A v = feedback ? static_cast<A>(x[i]) + static_cast<A>(r[i]) : static_cast<A>(x[i]);
      bad |= !isfinite(v);
      const A a = fabs(v);
      amax = amax < a ? a : amax;
    }
    for (int d = 16; d > 0; d /= 2) {
      const A o = __shfl_xor_sync(0xffffffffu, amax, d);
      amax = amax < o ? o : amax;
    }
    bad = __any_sync(0xffffffffu, bad);
    const float s = QuantizeMath::scale_of<A>(amax, !bad);
    if (lane == 0) m.s(t)[b0 / B] = s;
    int8_t* q = m.q(t) + b0;
    T* ro = feedback ? static_cast<T*>(m.res_out(t)) + b0 : nullptr;
    for (int64_t i = lane; i < len; i += 32) {
      const A v = feedback ? static_cast<A>(x[i]) + static_cast<A>(r[i]) : static_cast<A>(x[i]);
      float u = 0.0f;
      if (stochastic) {
        const uint64_t e = static_cast<uint64_t>(m.first(t) + b0 + i);
        at::philox_engine engine(seed, e / 4, offset);
        uint32_t word = engine();
        for (uint64_t j = 0; j < (e & 3); ++j) word = engine();
        u = QuantizeMath::uniform24(word);
      }
      const int8_t qi = QuantizeMath::quantize<A>(v, s, stochastic, u);
      q[i] = qi;
      if (feedback) ro[i] = static_cast<T>(v - static_cast<A>(qi) * static_cast<A>(s));
    }
  }
}

// Table of a dequantize call: values[K T], scales[K T], outs[T], numels[T], the T + 1 chunk
// prefixes, then the K float32 weights (as raw words).
struct DequantizeTable {
  const int64_t* w;
  int64_t K, T;
  __device__ const int8_t* q(int64_t i) const { return reinterpret_cast<const int8_t*>(w[i]); }
  __device__ const float* s(int64_t i) const {
    return reinterpret_cast<const float*>(w[K * T + i]);
  }
  __device__ void* out(int64_t t) const { return reinterpret_cast<void*>(w[2 * K * T + t]); }
  __device__ int64_t numel(int64_t t) const { return w[2 * K * T + T + t]; }
  __device__ const int64_t* prefix() const { return w + 2 * K * T + 2 * T; }
  __device__ float weight(int64_t k) const {
    return reinterpret_cast<const float*>(w + 2 * K * T + 3 * T + 1)[k];
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_sum_kernel(DequantizeTable m, int64_t B) {
  const int64_t chunks = m.prefix()[m.T];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t t = range_of(m.prefix(), m.T, c);
    const int64_t begin = (c - m.prefix()[t]) * kSumChunk;
    const int64_t end = begin + kSumChunk < m.numel(t) ? begin + kSumChunk : m.numel(t);
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      float acc = 0.0f;
      for (int64_t k = 0; k < m.K; ++k) {
        const int64_t i = k * m.T + t;
        const float coef = __fmul_rn(m.weight(k), m.s(i)[e / B]);
        acc = __fadd_rn(acc, __fmul_rn(coef, static_cast<float>(m.q(i)[e])));
      }
      static_cast<T*>(m.out(t))[e] = static_cast<T>(acc);
    }
  }
}

inline unsigned grid_for(int64_t items, int64_t per_block) {
  const int64_t g = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > kMaxBlocks ? kMaxBlocks : g));
}

struct QuantizeCuda {
  template <typename T>
  static void quantize(QuantizeList& l) {
    const c10::cuda::CUDAGuard guard(l.device);
    const int64_t n = l.num_tensors();
    std::vector<int64_t> words;
    words.reserve(8 * n + 1);
    auto ptr = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); };
    for (int64_t t = 0; t < n; ++t) words.push_back(ptr(l.x[t]));
    for (int64_t t = 0; t < n; ++t) words.push_back(l.feedback ? ptr(l.residual[t]) : 0);
    for (int64_t t = 0; t < n; ++t) words.push_back(ptr(l.values[t]));
    for (int64_t t = 0; t < n; ++t) words.push_back(ptr(l.scales[t]));
    for (int64_t t = 0; t < n; ++t) words.push_back(l.feedback ? ptr(l.residual_out[t]) : 0);
    for (int64_t t = 0; t < n; ++t) words.push_back(l.numels[t]);
    for (int64_t t = 0; t < n; ++t) words.push_back(l.first[t]);
    int64_t blocks = 0;
    words.push_back(0);
    for (int64_t t = 0; t < n; ++t) {
      blocks += blocks_of(l.numels[t], l.block_size);
      words.push_back(blocks);
    }
    const at::Tensor table = upload(words, l.device);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    quantize_kernel<T><<<grid_for(blocks, kWarps), kThreads, 0, stream>>>(
        QuantizeTable{table.const_data_ptr<int64_t>(), n}, l.block_size, l.stochastic,
        l.feedback, l.seed, l.offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T>
  static void dequantize_sum(DequantizeList& l) {
    const c10::cuda::CUDAGuard guard(l.device);
    const int64_t K = l.K, T_ = l.T;
    std::vector<int64_t> words;
    auto ptr = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); };
    for (int64_t i = 0; i < K * T_; ++i) words.push_back(ptr(l.values[i]));
    for (int64_t i = 0; i < K * T_; ++i) words.push_back(ptr(l.scales[i]));
    for (int64_t t = 0; t < T_; ++t) words.push_back(ptr(l.outs[t]));
    for (int64_t t = 0; t < T_; ++t) words.push_back(l.numels[t]);
    int64_t chunks = 0;
    words.push_back(0);
    for (int64_t t = 0; t < T_; ++t) {
      chunks += (l.numels[t] + kSumChunk - 1) / kSumChunk;
      words.push_back(chunks);
    }
    const size_t at_weights = words.size();
    words.resize(at_weights + (K + 1) / 2, 0);
    std::memcpy(words.data() + at_weights, l.weights.data(), K * sizeof(float));
    const at::Tensor table = upload(words, l.device);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    dequantize_sum_kernel<T><<<grid_for(chunks, 1), kThreads, 0, stream>>>(
        DequantizeTable{table.const_data_ptr<int64_t>(), K, T_}, l.block_size);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_quantize<QuantizeCuda>(m);
}

}  // namespace fedkernels
