// CUDA kernels of the secure-aggregation ops (schemas: csrc/ops.cpp; host side:
// csrc/secagg_host.h; Philox and the fixed-point code: csrc/ring_masks.h).
//
// One thread per group of four consecutive elements of the whole list (one Philox block per
// mask gives their four words): the group's codes or the K clients' sum in registers, then
// each mask's block added or subtracted, written once. The masks' seeds sit in a small device
// table; no mask is ever in memory, and the words are the CPU's, so both devices give the
// same bits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../ring_masks.h"
#include "../secagg_host.h"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535LL * 32;

// Table of a call with n input tensors (n = K T), T outputs and M masks: inputs[n],
// outs[T], first[T + 1] (element prefixes), (key, offset, negate) per mask, then the T
// inputs' dtype codes (client).
struct RingTable {
  const int64_t* w;
  int64_t n, T, M;
  __device__ const void* in(int64_t i) const { return reinterpret_cast<const void*>(w[i]); }
  __device__ uint32_t* out(int64_t t) const { return reinterpret_cast<uint32_t*>(w[n + t]); }
  __device__ const int64_t* first() const { return w + n + T; }
  __device__ const int64_t* mask(int64_t m) const { return w + n + 2 * T + 1 + 3 * m; }
  __device__ int64_t dtype(int64_t t) const { return w[n + 2 * T + 1 + 3 * M + t]; }
};

enum DtypeCode : int64_t { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };

__device__ __forceinline__ double load_value(const void* p, int64_t code, int64_t i) {
  switch (code) {
    case kF64: return static_cast<const double*>(p)[i];
    case kF16: return static_cast<float>(static_cast<const at::Half*>(p)[i]);
    case kBF16: return static_cast<float>(static_cast<const at::BFloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ int64_t tensor_of(const int64_t* prefix, int64_t n, int64_t e) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= e) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ void add_masks(const RingTable& m, uint64_t g, uint32_t acc[4]) {
  for (int64_t j = 0; j < m.M; ++j) {
    const int64_t* s = m.mask(j);
    const uint64_t key = static_cast<uint64_t>(s[0]), offset = static_cast<uint64_t>(s[1]);
    uint32_t x0 = static_cast<uint32_t>(offset), x1 = static_cast<uint32_t>(offset >> 32);
    uint32_t x2 = static_cast<uint32_t>(g), x3 = static_cast<uint32_t>(g >> 32);
    Philox10<ScalarU32Ops>::block(x0, x1, x2, x3, static_cast<uint32_t>(key),
                                  static_cast<uint32_t>(key >> 32));
    const uint32_t sign = s[2] ? 0xffffffffu : 1u;  // times -1 mod 2^32 subtracts
    acc[0] += sign * x0;
    acc[1] += sign * x1;
    acc[2] += sign * x2;
    acc[3] += sign * x3;
  }
}

__global__ void __launch_bounds__(kThreads) mask_kernel(
    RingTable m, double clip, double scale, bool stochastic, uint64_t seed, uint64_t offset) {
  const int64_t total = m.first()[m.T];
  const int64_t groups = (total + 3) / 4;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    uint32_t acc[4] = {0u, 0u, 0u, 0u}, words[4] = {0u, 0u, 0u, 0u};
    if (stochastic) {
      uint32_t x0 = static_cast<uint32_t>(offset), x1 = static_cast<uint32_t>(offset >> 32);
      uint32_t x2 = static_cast<uint32_t>(g), x3 = static_cast<uint32_t>(uint64_t(g) >> 32);
      Philox10<ScalarU32Ops>::block(x0, x1, x2, x3, static_cast<uint32_t>(seed),
                                    static_cast<uint32_t>(seed >> 32));
      words[0] = x0; words[1] = x1; words[2] = x2; words[3] = x3;
    }
    int64_t t = tensor_of(m.first(), m.T, 4 * g);
    for (int j = 0; j < 4 && 4 * g + j < total; ++j) {
      const int64_t e = 4 * g + j;
      while (e >= m.first()[t + 1]) ++t;
      const double v = load_value(m.in(t), m.dtype(t), e - m.first()[t]);
      acc[j] = RingMath::encode(v, clip, scale, stochastic, words[j]);
    }
    add_masks(m, static_cast<uint64_t>(g), acc);
    t = tensor_of(m.first(), m.T, 4 * g);
    for (int j = 0; j < 4 && 4 * g + j < total; ++j) {
      const int64_t e = 4 * g + j;
      while (e >= m.first()[t + 1]) ++t;
      m.out(t)[e - m.first()[t]] = acc[j];
    }
  }
}

__global__ void __launch_bounds__(kThreads) unmask_kernel(RingTable m, int64_t K) {
  const int64_t total = m.first()[m.T];
  const int64_t groups = (total + 3) / 4;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    uint32_t acc[4] = {0u, 0u, 0u, 0u};
    int64_t t = tensor_of(m.first(), m.T, 4 * g);
    for (int j = 0; j < 4 && 4 * g + j < total; ++j) {
      const int64_t e = 4 * g + j;
      while (e >= m.first()[t + 1]) ++t;
      const int64_t i = e - m.first()[t];
      for (int64_t k = 0; k < K; ++k) {
        acc[j] += static_cast<const uint32_t*>(m.in(k * m.T + t))[i];
      }
    }
    add_masks(m, static_cast<uint64_t>(g), acc);
    t = tensor_of(m.first(), m.T, 4 * g);
    for (int j = 0; j < 4 && 4 * g + j < total; ++j) {
      const int64_t e = 4 * g + j;
      while (e >= m.first()[t + 1]) ++t;
      m.out(t)[e - m.first()[t]] = acc[j];
    }
  }
}

at::Tensor upload(const RingList& l, int64_t& total) {
  std::vector<int64_t> words;
  auto ptr = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); };
  for (const void* p : l.x) words.push_back(ptr(p));
  for (uint32_t* p : l.outs) words.push_back(ptr(p));
  total = 0;
  for (size_t t = 0; t < l.numels.size(); ++t) {
    words.push_back(total);
    total += l.numels[t];
  }
  words.push_back(total);
  for (const auto& mk : l.masks) {
    words.push_back(static_cast<int64_t>(mk.key));
    words.push_back(static_cast<int64_t>(mk.offset));
    words.push_back(mk.negate ? 1 : 0);
  }
  for (const auto d : l.dtypes) {
    words.push_back(d == at::kDouble ? kF64 : d == at::kHalf ? kF16 : d == at::kBFloat16 ? kBF16
                                                                                       : kF32);
  }
  at::Tensor host = at::empty({static_cast<int64_t>(words.size())}, at::kLong);
  std::copy(words.begin(), words.end(), host.mutable_data_ptr<int64_t>());
  return host.to(l.device);
}

inline unsigned grid_for(int64_t groups) {
  const int64_t g = (groups + kThreads - 1) / kThreads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > kMaxBlocks ? kMaxBlocks : g));
}

struct SecaggCuda {
  static void mask(RingList& l) {
    const c10::cuda::CUDAGuard guard(l.device);
    int64_t total;
    const at::Tensor table = upload(l, total);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    mask_kernel<<<grid_for((total + 3) / 4), kThreads, 0, stream>>>(
        RingTable{table.const_data_ptr<int64_t>(), l.T, l.T,
                  static_cast<int64_t>(l.masks.size())},
        l.clip, l.scale, l.stochastic, l.seed, l.offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  static void unmask_sum(RingList& l) {
    const c10::cuda::CUDAGuard guard(l.device);
    int64_t total;
    const at::Tensor table = upload(l, total);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    unmask_kernel<<<grid_for((total + 3) / 4), kThreads, 0, stream>>>(
        RingTable{table.const_data_ptr<int64_t>(), l.K * l.T, l.T,
                  static_cast<int64_t>(l.masks.size())},
        l.K);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_secagg<SecaggCuda>(m);
}

}  // namespace fedkernels
