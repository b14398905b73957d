// CUDA kernels of the quantized-update ops (schemas: csrc/ops.cpp; host side:
// csrc/quantize_host.h; per-element math: QuantizeMath in csrc/elementwise.h).
//
// quantize_int8 / quantize_int4: one warp per block of block_size elements: max|v| and the
// non-finite flag by warp reductions (exact, so in any order), then each lane rounds its
// elements (4-bit: a pair of elements, one byte, a lane). quantize_fp8: per-tensor max|v| and
// non-finite flag by atomics on the bits of non-negative values (exact, so in any order), the
// scales, then one thread per element. The stochastic words are the Philox words of the
// element's index in the whole list, as on the CPU, so both devices give the same values for a
// seed.
// dequantize_*weighted_sum: one thread per element adds the K clients' (w_k s_kb) q in client
// order in float32 (the _rn intrinsics: no fused multiply-add, the CPU's bits).
#include <ATen/core/Tensor.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
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
// first (n words each), then the n + 1 prefixes of the blocks (fp8: of kSumChunk chunks).
struct QuantizeTable {
  const int64_t* w;
  int64_t n;
  __device__ const void* x(int64_t t) const { return reinterpret_cast<const void*>(w[t]); }
  __device__ const void* res(int64_t t) const { return reinterpret_cast<const void*>(w[n + t]); }
  __device__ void* q(int64_t t) const { return reinterpret_cast<void*>(w[2 * n + t]); }
  __device__ float* s(int64_t t) const { return reinterpret_cast<float*>(w[3 * n + t]); }
  __device__ void* res_out(int64_t t) const { return reinterpret_cast<void*>(w[4 * n + t]); }
  __device__ int64_t numel(int64_t t) const { return w[5 * n + t]; }
  __device__ int64_t first(int64_t t) const { return w[6 * n + t]; }
  __device__ const int64_t* prefix() const { return w + 7 * n; }
};

// The uniform of element e: word e % 4 of the Philox block (seed, subsequence e / 4, offset).
__device__ __forceinline__ float uniform_of(uint64_t seed, uint64_t offset, uint64_t e) {
  at::philox_engine engine(seed, e / 4, offset);
  uint32_t word = engine();
  for (uint64_t j = 0; j < (e & 3); ++j) word = engine();
  return QuantizeMath::uniform24(word);
}

// int8 (Int4 false) or packed 4-bit levels, one warp per block.
template <typename T, bool Int4>
__global__ void __launch_bounds__(kThreads) quantize_kernel(
    QuantizeTable m, int64_t B, bool stochastic, bool feedback, uint64_t seed, uint64_t offset) {
  using A = acc_type<T>;
  constexpr int kLevels = Int4 ? QuantizeMath::kLevels4 : QuantizeMath::kLevels;
  const int lane = threadIdx.x & 31;
  const int64_t total = m.prefix()[m.n];
  for (int64_t blk = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; blk < total;
       blk += int64_t(gridDim.x) * kWarps) {
    const int64_t t = range_of(m.prefix(), m.n, blk);
    const int64_t b0 = (blk - m.prefix()[t]) * B;
    const int64_t len = b0 + B < m.numel(t) ? B : m.numel(t) - b0;
    const T* x = static_cast<const T*>(m.x(t)) + b0;
    const T* r = feedback ? static_cast<const T*>(m.res(t)) + b0 : nullptr;
    auto v_at = [&](int64_t i) {
      return feedback ? static_cast<A>(x[i]) + static_cast<A>(r[i]) : static_cast<A>(x[i]);
    };
    A amax = A(0);
    bool bad = false;
    for (int64_t i = lane; i < len; i += 32) {
      const A v = v_at(i);
      bad |= !isfinite(v);
      const A a = fabs(v);
      amax = amax < a ? a : amax;
    }
    for (int d = 16; d > 0; d /= 2) {
      const A o = __shfl_xor_sync(0xffffffffu, amax, d);
      amax = amax < o ? o : amax;
    }
    bad = __any_sync(0xffffffffu, bad);
    const float s = QuantizeMath::scale_of<A>(amax, !bad, A(kLevels));
    if (lane == 0) m.s(t)[b0 / B] = s;
    T* ro = feedback ? static_cast<T*>(m.res_out(t)) + b0 : nullptr;
    const uint64_t e0 = static_cast<uint64_t>(m.first(t) + b0);
    auto level = [&](int64_t i, A v) {
      const float u = stochastic ? uniform_of(seed, offset, e0 + i) : 0.0f;
      const int8_t qi = QuantizeMath::quantize<A>(v, s, stochastic, u, kLevels);
      if (feedback) ro[i] = static_cast<T>(v - static_cast<A>(qi) * static_cast<A>(s));
      return qi;
    };
    if constexpr (Int4) {
      // a pair of elements a lane: one whole byte (b0 is even, as B is)
      uint8_t* q = static_cast<uint8_t*>(m.q(t)) + b0 / 2;
      for (int64_t i = 2 * lane; i < len; i += 64) {
        const int8_t lo = level(i, v_at(i));
        const int8_t hi = i + 1 < len ? level(i + 1, v_at(i + 1)) : int8_t{0};
        q[i / 2] = QuantizeMath::pack4(lo, hi);
      }
    } else {
      int8_t* q = static_cast<int8_t*>(m.q(t)) + b0;
      for (int64_t i = lane; i < len; i += 32) q[i] = level(i, v_at(i));
    }
  }
}

// fp8, pass 1: per-tensor max|v| and non-finite flag, as atomics on bits (non-negative values
// order as their bits do). scratch: [0, n) the max bits, [n, 2n) the flags; chunks of
// kSumChunk elements of one tensor (the table's prefixes count them).
template <typename T>
__global__ void __launch_bounds__(kThreads) fp8_max_kernel(
    QuantizeTable m, bool feedback, unsigned long long* scratch) {
  using A = acc_type<T>;
  const int64_t* prefix = m.prefix();
  const int64_t chunks = prefix[m.n];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t t = range_of(prefix, m.n, c);
    const int64_t begin = (c - prefix[t]) * kSumChunk;
    const int64_t end = begin + kSumChunk < m.numel(t) ? begin + kSumChunk : m.numel(t);
    const T* x = static_cast<const T*>(m.x(t));
    const T* r = feedback ? static_cast<const T*>(m.res(t)) : nullptr;
    A amax = A(0);
    bool bad = false;
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      const A v = feedback ? static_cast<A>(x[e]) + static_cast<A>(r[e]) : static_cast<A>(x[e]);
      bad |= !isfinite(v);
      const A a = fabs(v);
      amax = amax < a ? a : amax;
    }
    for (int d = 16; d > 0; d /= 2) {
      const A o = __shfl_xor_sync(0xffffffffu, amax, d);
      amax = amax < o ? o : amax;
    }
    bad = __any_sync(0xffffffffu, bad);
    if ((threadIdx.x & 31) == 0) {
      unsigned long long bits;
      if constexpr (sizeof(A) == 8) {
        bits = static_cast<unsigned long long>(__double_as_longlong(amax));
      } else {
        bits = __float_as_uint(amax);
      }
      atomicMax(scratch + t, bits);
      if (bad) atomicOr(scratch + m.n + t, 1ull);
    }
  }
}

// fp8, pass 2: the n scales from the maxima.
template <typename T>
__global__ void fp8_scale_kernel(QuantizeTable m, const unsigned long long* scratch) {
  using A = acc_type<T>;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= m.n) return;
  A amax;
  if constexpr (sizeof(A) == 8) {
    amax = __longlong_as_double(static_cast<long long>(scratch[t]));
  } else {
    amax = __uint_as_float(static_cast<unsigned>(scratch[t]));
  }
  m.s(t)[0] = QuantizeMath::scale_of<A>(amax, scratch[m.n + t] == 0, A(QuantizeMath::kFp8Max));
}

// fp8, pass 3: one thread per element.
template <typename T>
__global__ void __launch_bounds__(kThreads) fp8_quantize_kernel(
    QuantizeTable m, bool stochastic, bool feedback, uint64_t seed, uint64_t offset) {
  using A = acc_type<T>;
  const int64_t* prefix = m.prefix();
  const int64_t chunks = prefix[m.n];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t t = range_of(prefix, m.n, c);
    const int64_t begin = (c - prefix[t]) * kSumChunk;
    const int64_t end = begin + kSumChunk < m.numel(t) ? begin + kSumChunk : m.numel(t);
    const T* x = static_cast<const T*>(m.x(t));
    const T* r = feedback ? static_cast<const T*>(m.res(t)) : nullptr;
    uint8_t* q = static_cast<uint8_t*>(m.q(t));
    T* ro = feedback ? static_cast<T*>(m.res_out(t)) : nullptr;
    const float s = m.s(t)[0];
    const A sa = static_cast<A>(s);
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      const A v = feedback ? static_cast<A>(x[e]) + static_cast<A>(r[e]) : static_cast<A>(x[e]);
      A qv = A(0);
      if (s > 0.0f) {
        const float u =
            stochastic ? uniform_of(seed, offset, static_cast<uint64_t>(m.first(t) + e)) : 0.0f;
        qv = QuantizeMath::fp8_round<A>(v / sa, stochastic, u);
      }
      q[e] = QuantizeMath::fp8_bits(static_cast<float>(qv));
      if (feedback) ro[e] = static_cast<T>(v - qv * sa);
    }
  }
}

// Table of a dequantize call: values[K T], scales[K T], outs[T], numels[T], the T + 1 chunk
// prefixes, then the K float32 weights (as raw words).
struct DequantizeTable {
  const int64_t* w;
  int64_t K, T;
  __device__ const void* q(int64_t i) const { return reinterpret_cast<const void*>(w[i]); }
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

// Element e of a client's bytes in format F, as float32 (exact).
template <QuantFormat F>
__device__ __forceinline__ float value_at(const void* p, int64_t e) {
  if constexpr (F == QuantFormat::kInt8) {
    return static_cast<float>(static_cast<const int8_t*>(p)[e]);
  } else if constexpr (F == QuantFormat::kInt4) {
    return static_cast<float>(QuantizeMath::nibble(static_cast<const uint8_t*>(p), e));
  } else {
    return QuantizeMath::fp8_value(static_cast<const uint8_t*>(p)[e]);
  }
}

template <typename T, QuantFormat F>
__global__ void __launch_bounds__(kThreads) dequantize_sum_kernel(DequantizeTable m, int64_t B) {
  const int64_t chunks = m.prefix()[m.T];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t t = range_of(m.prefix(), m.T, c);
    const int64_t begin = (c - m.prefix()[t]) * kSumChunk;
    const int64_t end = begin + kSumChunk < m.numel(t) ? begin + kSumChunk : m.numel(t);
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      const int64_t b = F == QuantFormat::kFp8 ? 0 : e / B;
      float acc = 0.0f;
      for (int64_t k = 0; k < m.K; ++k) {
        const int64_t i = k * m.T + t;
        const float coef = __fmul_rn(m.weight(k), m.s(i)[b]);
        acc = __fadd_rn(acc, __fmul_rn(coef, value_at<F>(m.q(i), e)));
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
    const bool fp8 = l.format == QuantFormat::kFp8;
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
    // per-block formats: the tensors' block prefixes; fp8: their kSumChunk chunk prefixes
    int64_t items = 0;
    words.push_back(0);
    for (int64_t t = 0; t < n; ++t) {
      items += fp8 ? (l.numels[t] + kSumChunk - 1) / kSumChunk : blocks_of(l.numels[t], l.block_size);
      words.push_back(items);
    }
    const at::Tensor table = upload(words, l.device);
    const QuantizeTable m{table.const_data_ptr<int64_t>(), n};
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (!fp8) {
      auto kernel = l.format == QuantFormat::kInt4 ? &quantize_kernel<T, true>
                                                   : &quantize_kernel<T, false>;
      kernel<<<grid_for(items, kWarps), kThreads, 0, stream>>>(
          m, l.block_size, l.stochastic, l.feedback, l.seed, l.offset);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    const at::Tensor scratch = at::zeros({2 * n}, table.options());
    auto* bits = reinterpret_cast<unsigned long long*>(scratch.mutable_data_ptr<int64_t>());
    fp8_max_kernel<T><<<grid_for(items, 1), kThreads, 0, stream>>>(m, l.feedback, bits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    fp8_scale_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(m, bits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    fp8_quantize_kernel<T><<<grid_for(items, 1), kThreads, 0, stream>>>(
        m, l.stochastic, l.feedback, l.seed, l.offset);
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
    const DequantizeTable m{table.const_data_ptr<int64_t>(), K, T_};
    auto kernel = l.format == QuantFormat::kInt8   ? &dequantize_sum_kernel<T, QuantFormat::kInt8>
                : l.format == QuantFormat::kInt4 ? &dequantize_sum_kernel<T, QuantFormat::kInt4>
                                                 : &dequantize_sum_kernel<T, QuantFormat::kFp8>;
    kernel<<<grid_for(chunks, 1), kThreads, 0, stream>>>(m, l.block_size);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_quantize<QuantizeCuda>(m);
}

}  // namespace fedkernels
