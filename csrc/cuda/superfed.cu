// CUDA kernels of the SuPerFed ops (schemas: csrc/ops.cpp; host side: csrc/superfed_host.h;
// math: specs/superfed.md §1.5 and §3 K1-K3; per-element functors shared with the CPU kernels
// in csrc/elementwise.h).
//
// One launch per dtype group whatever the number of tensors: the launch metadata (input and
// output pointers, numels, a prefix sum of chunks per tensor, each tensor's index in the op's
// lists) lives in one device buffer copied from pinned memory on the current stream (the
// weighted_sum design, specs/prior_art.md §2.4). Each block owns one chunk of one tensor at a
// time (grid-stride over chunks). The reductions (the lam gradient, the four statistics) are
// reduced per chunk in the accumulate type with a fixed tree (warp shuffles, then shared
// memory), stored in float64 per chunk, and a second small kernel adds each tensor's chunks in
// order: no atomics, so the result is bitwise the same run after run.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../elementwise.h"
#include "../superfed_host.h"

namespace fedkernels {
namespace {

template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

constexpr int kThreads = 256;
constexpr int kPerThread = 8;                     // elements per thread per chunk
constexpr int kChunk = kThreads * kPerThread;     // 2048 elements per block-chunk
constexpr int64_t kMaxBlocks = 65535;

struct Meta {
  const uint64_t* in;           // [4][n] input pointers (0: absent)
  const uint64_t* out;          // [3][n] output pointers (0: not wanted)
  const int64_t* numels;        // [n], all > 0
  const int64_t* chunk_prefix;  // [n + 1]
  const int64_t* index;         // [n]: position in the op's lists (row of coef / result)
  const double* coef;           // lam [T] or H [T, 4]; null for kStats
  const double* coef2;          // H [T, 4] for kMixStatsBackward
  double* partials;             // [total_chunks][width]; null without a reduction
  int64_t num_tensors;
  int64_t total_chunks;
  bool has_local, has_anchor;
};

__device__ __forceinline__ int64_t tensor_of_chunk(const int64_t* prefix, int64_t n, int64_t c) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Sum over the block with a fixed order; the result is valid in thread 0.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // `shared` is free (a previous call may still be reading it)
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  A s = A(0);
  if (threadIdx.x == 0) {
    for (int w = 0; w < kThreads / 32; ++w) s += shared[w];
  }
  return s;
}

template <typename T>
__device__ __forceinline__ const T* input(const Meta& m, int j, int64_t t) {
  return reinterpret_cast<const T*>(m.in[j * m.num_tensors + t]);
}

template <typename T>
__device__ __forceinline__ T* output(const Meta& m, int j, int64_t t) {
  return reinterpret_cast<T*>(m.out[j * m.num_tensors + t]);
}

template <typename T, SuperfedKind kKind>
__global__ void __launch_bounds__(kThreads) superfed_kernel(const Meta m) {
  using A = acc_type<T>;
  __shared__ A shared[kThreads / 32];
  for (int64_t c = blockIdx.x; c < m.total_chunks; c += gridDim.x) {
    const int64_t t = tensor_of_chunk(m.chunk_prefix, m.num_tensors, c);
    const int64_t begin = (c - m.chunk_prefix[t]) * kChunk;
    const int64_t rest = m.numels[t] - begin;
    const int len = static_cast<int>(rest < kChunk ? rest : kChunk);
    const int64_t row = m.index[t];

    if constexpr (kKind == SuperfedKind::kMix) {
      const T* g = input<T>(m, 0, t) + begin;
      const T* l = input<T>(m, 1, t) + begin;
      T* out = output<T>(m, 0, t) + begin;
      const A w = static_cast<A>(m.coef[row]);
      const A omw = A(1) - w;
      const bool low = w < A(0.5);
      for (int j = threadIdx.x; j < len; j += kThreads) {
        out[j] = static_cast<T>(
            MixMath::mix(static_cast<A>(g[j]), static_cast<A>(l[j]), w, omw, low));
      }
    } else if constexpr (kKind == SuperfedKind::kMixBackward) {
      const T* grad = input<T>(m, 0, t) + begin;
      const T* g = input<T>(m, 1, t) + begin;
      const T* l = input<T>(m, 2, t) + begin;
      T* grad_g = output<T>(m, 0, t);
      T* grad_l = output<T>(m, 1, t);
      if (grad_g) grad_g += begin;
      if (grad_l) grad_l += begin;
      const A w = static_cast<A>(m.coef[row]);
      const A omw = A(1) - w;
      A sum = A(0);
      for (int j = threadIdx.x; j < len; j += kThreads) {
        const A G = static_cast<A>(grad[j]);
        if (grad_g) grad_g[j] = static_cast<T>(omw * G);
        if (grad_l) grad_l[j] = static_cast<T>(w * G);
        if (m.partials) {
          sum += MixMath::lam_term(G, static_cast<A>(g[j]), static_cast<A>(l[j]));
        }
      }
      if (m.partials) {
        const A s = block_sum(sum, shared);
        if (threadIdx.x == 0) m.partials[c] = static_cast<double>(s);
      }
    } else if constexpr (kKind == SuperfedKind::kStats) {
      const T* g = input<T>(m, 0, t) + begin;
      const T* l = m.has_local ? input<T>(m, 1, t) + begin : nullptr;
      const T* a = m.has_anchor ? input<T>(m, 2, t) + begin : nullptr;
      A acc[4] = {A(0), A(0), A(0), A(0)};
      for (int j = threadIdx.x; j < len; j += kThreads) {
        const A gj = static_cast<A>(g[j]);
        acc[1] += gj * gj;
        if (l) {
          const A lj = static_cast<A>(l[j]);
          acc[0] += gj * lj;
          acc[2] += lj * lj;
        }
        if (a) {
          const A d = StatsMath::diff(gj, static_cast<A>(a[j]));
          acc[3] += d * d;
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const A s = block_sum(acc[k], shared);
        if (threadIdx.x == 0) m.partials[4 * c + k] = static_cast<double>(s);
      }
    } else if constexpr (kKind == SuperfedKind::kMixStats) {
      const T* g = input<T>(m, 0, t) + begin;
      const T* l = input<T>(m, 1, t) + begin;
      const T* a = m.has_anchor ? input<T>(m, 2, t) + begin : nullptr;
      T* out = output<T>(m, 0, t) + begin;
      const A w = static_cast<A>(m.coef[row]);
      const A omw = A(1) - w;
      const bool low = w < A(0.5);
      A acc[4] = {A(0), A(0), A(0), A(0)};
      for (int j = threadIdx.x; j < len; j += kThreads) {
        const A gj = static_cast<A>(g[j]), lj = static_cast<A>(l[j]);
        out[j] = static_cast<T>(MixMath::mix(gj, lj, w, omw, low));
        acc[0] += gj * lj;
        acc[1] += gj * gj;
        acc[2] += lj * lj;
        if (a) {
          const A d = StatsMath::diff(gj, static_cast<A>(a[j]));
          acc[3] += d * d;
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const A s = block_sum(acc[k], shared);
        if (threadIdx.x == 0) m.partials[4 * c + k] = static_cast<double>(s);
      }
    } else if constexpr (kKind == SuperfedKind::kMixStatsBackward) {
      const T* g = input<T>(m, 0, t) + begin;
      const T* l = input<T>(m, 1, t) + begin;
      const T* a = m.has_anchor ? input<T>(m, 2, t) + begin : nullptr;
      const T* grad = input<T>(m, 3, t) + begin;
      T* grad_g = output<T>(m, 0, t);
      T* grad_l = output<T>(m, 1, t);
      T* grad_a = output<T>(m, 2, t);
      if (grad_g) grad_g += begin;
      if (grad_l) grad_l += begin;
      if (grad_a) grad_a += begin;
      const A w = static_cast<A>(m.coef[row]);
      const A omw = A(1) - w;
      const double* h = m.coef2 + 4 * row;
      const A h0 = static_cast<A>(h[0]);
      const A h1x2 = static_cast<A>(2 * h[1]);
      const A h2x2 = static_cast<A>(2 * h[2]);
      const A h3x2 = a ? static_cast<A>(2 * h[3]) : A(0);
      A sum = A(0);
      for (int j = threadIdx.x; j < len; j += kThreads) {
        const A gj = static_cast<A>(g[j]), lj = static_cast<A>(l[j]);
        const A G = static_cast<A>(grad[j]);
        const A d = a ? StatsMath::diff(gj, static_cast<A>(a[j])) : A(0);
        if (grad_g) {
          grad_g[j] = static_cast<T>(omw * G + StatsMath::grad_global(gj, lj, d, h0, h1x2, h3x2));
        }
        if (grad_l) grad_l[j] = static_cast<T>(w * G + StatsMath::grad_local(gj, lj, h0, h2x2));
        if (grad_a) grad_a[j] = static_cast<T>(-(h3x2 * d));
        if (m.partials) sum += MixMath::lam_term(G, gj, lj);
      }
      if (m.partials) {
        const A s = block_sum(sum, shared);
        if (threadIdx.x == 0) m.partials[c] = static_cast<double>(s);
      }
    } else {  // kStatsBackward
      const T* g = input<T>(m, 0, t) + begin;
      const T* l = m.has_local ? input<T>(m, 1, t) + begin : nullptr;
      const T* a = m.has_anchor ? input<T>(m, 2, t) + begin : nullptr;
      T* grad_g = output<T>(m, 0, t);
      T* grad_l = output<T>(m, 1, t);
      T* grad_a = output<T>(m, 2, t);
      if (grad_g) grad_g += begin;
      if (grad_l) grad_l += begin;
      if (grad_a) grad_a += begin;
      const double* h = m.coef + 4 * row;
      const A h0 = l ? static_cast<A>(h[0]) : A(0);
      const A h1x2 = static_cast<A>(2 * h[1]);
      const A h2x2 = l ? static_cast<A>(2 * h[2]) : A(0);
      const A h3x2 = a ? static_cast<A>(2 * h[3]) : A(0);
      for (int j = threadIdx.x; j < len; j += kThreads) {
        const A gj = static_cast<A>(g[j]);
        const A lj = l ? static_cast<A>(l[j]) : A(0);
        const A d = a ? StatsMath::diff(gj, static_cast<A>(a[j])) : A(0);
        if (grad_g) grad_g[j] = static_cast<T>(StatsMath::grad_global(gj, lj, d, h0, h1x2, h3x2));
        if (grad_l) grad_l[j] = static_cast<T>(StatsMath::grad_local(gj, lj, h0, h2x2));
        if (grad_a) grad_a[j] = static_cast<T>(-(h3x2 * d));
      }
    }
  }
}

// result[index[t] * width + k] += sum of tensor t's chunk partials, in chunk order.
__global__ void combine_partials_kernel(
    const double* partials, const int64_t* chunk_prefix, const int64_t* index, int64_t n,
    int width, double* result) {
  for (int64_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
    for (int k = 0; k < width; ++k) {
      double s = 0;
      for (int64_t c = chunk_prefix[t]; c < chunk_prefix[t + 1]; ++c) s += partials[c * width + k];
      result[index[t] * width + k] += s;
    }
  }
}

template <typename T>
void superfed_cuda_typed(const SuperfedPlan& p) {
  const int64_t n = p.num_tensors();
  const c10::cuda::CUDAGuard guard(p.device);
  TORCH_CHECK(
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
      "fedkernels: the SuPerFed ops cannot run under CUDA graph capture (their launch metadata "
      "is copied from a host buffer)");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Layout (int64 words): in [4n], out [3n], numels [n], prefix [n + 1], index [n].
  const int64_t words = 4 * n + 3 * n + n + (n + 1) + n;
  at::Tensor host =
      at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.mutable_data_ptr<int64_t>();
  int64_t* h_in = h;
  int64_t* h_out = h_in + 4 * n;
  int64_t* h_numels = h_out + 3 * n;
  int64_t* h_prefix = h_numels + n;
  int64_t* h_index = h_prefix + n + 1;
  for (int j = 0; j < 4; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      h_in[j * n + i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.in[j][i]));
      if (j < 3) h_out[j * n + i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.out[j][i]));
    }
  }
  h_prefix[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    h_numels[i] = p.numels[i];
    h_prefix[i + 1] = h_prefix[i] + (p.numels[i] + kChunk - 1) / kChunk;
    h_index[i] = p.index[i];
  }
  const int64_t total_chunks = h_prefix[n];
  const at::Tensor meta_dev =
      host.to(at::TensorOptions().device(p.device).dtype(at::kLong), /*non_blocking=*/true);
  const int64_t* d = meta_dev.const_data_ptr<int64_t>();

  int width = 0;
  if (p.kind == SuperfedKind::kStats || p.kind == SuperfedKind::kMixStats) width = 4;
  if (p.kind == SuperfedKind::kMixBackward && p.need[2]) width = 1;
  if (p.kind == SuperfedKind::kMixStatsBackward && p.need[3]) width = 1;
  at::Tensor partials;
  if (width > 0) {
    partials = at::empty(
        {total_chunks * width}, at::TensorOptions().device(p.device).dtype(at::kDouble));
  }

  Meta m;
  m.in = reinterpret_cast<const uint64_t*>(d);
  m.out = reinterpret_cast<const uint64_t*>(d + 4 * n);
  m.numels = d + 7 * n;
  m.chunk_prefix = d + 8 * n;
  m.index = d + 9 * n + 1;
  m.coef = p.coef.defined() ? p.coef.const_data_ptr<double>() : nullptr;
  m.coef2 = p.coef2.defined() ? p.coef2.const_data_ptr<double>() : nullptr;
  m.partials = width > 0 ? partials.mutable_data_ptr<double>() : nullptr;
  m.num_tensors = n;
  m.total_chunks = total_chunks;
  m.has_local = p.has_local;
  m.has_anchor = p.has_anchor;

  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(total_chunks, kMaxBlocks)));
  switch (p.kind) {
    case SuperfedKind::kMix:
      superfed_kernel<T, SuperfedKind::kMix><<<grid, kThreads, 0, stream>>>(m);
      break;
    case SuperfedKind::kMixBackward:
      superfed_kernel<T, SuperfedKind::kMixBackward><<<grid, kThreads, 0, stream>>>(m);
      break;
    case SuperfedKind::kStats:
      superfed_kernel<T, SuperfedKind::kStats><<<grid, kThreads, 0, stream>>>(m);
      break;
    case SuperfedKind::kStatsBackward:
      superfed_kernel<T, SuperfedKind::kStatsBackward><<<grid, kThreads, 0, stream>>>(m);
      break;
    case SuperfedKind::kMixStats:
      superfed_kernel<T, SuperfedKind::kMixStats><<<grid, kThreads, 0, stream>>>(m);
      break;
    case SuperfedKind::kMixStatsBackward:
      superfed_kernel<T, SuperfedKind::kMixStatsBackward><<<grid, kThreads, 0, stream>>>(m);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (width > 0) {
    const int threads = 128;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 1024));
    combine_partials_kernel<<<blocks, threads, 0, stream>>>(
        m.partials, m.chunk_prefix, m.index, n, width, p.result.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void superfed_cuda_group(const SuperfedPlan& p) {
  switch (p.dtype) {
    case at::kFloat: return superfed_cuda_typed<float>(p);
    case at::kDouble: return superfed_cuda_typed<double>(p);
    case at::kHalf: return superfed_cuda_typed<at::Half>(p);
    case at::kBFloat16: return superfed_cuda_typed<at::BFloat16>(p);
    default: TORCH_CHECK(false, "fedkernels: unsupported dtype ", p.dtype);
  }
}

std::vector<at::Tensor> mix_endpoints_cuda(
    at::TensorList g, at::TensorList l, const at::Tensor& lam) {
  return mix_endpoints_host(g, l, lam, &superfed_cuda_group);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
mix_endpoints_backward_cuda(
    at::TensorList grads, at::TensorList g, at::TensorList l, const at::Tensor& lam,
    std::array<bool, 3> mask) {
  return mix_endpoints_backward_host(grads, g, l, lam, mask, &superfed_cuda_group);
}

at::Tensor superfed_stats_cuda(at::TensorList g, at::TensorList l, at::TensorList a) {
  return superfed_stats_host(g, l, a, &superfed_cuda_group);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
superfed_stats_backward_cuda(
    const at::Tensor& grad_stats, at::TensorList g, at::TensorList l, at::TensorList a,
    std::array<bool, 3> mask) {
  return superfed_stats_backward_host(grad_stats, g, l, a, mask, &superfed_cuda_group);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> mix_endpoints_with_stats_cuda(
    at::TensorList g, at::TensorList l, const at::Tensor& lam, at::TensorList a) {
  return mix_endpoints_with_stats_host(g, l, lam, a, &superfed_cuda_group);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, std::vector<at::Tensor>>
mix_endpoints_with_stats_backward_cuda(
    at::TensorList grads, const at::Tensor& grad_stats, at::TensorList g, at::TensorList l,
    const at::Tensor& lam, at::TensorList a, std::array<bool, 4> mask) {
  return mix_endpoints_with_stats_backward_host(
      grads, grad_stats, g, l, lam, a, mask, &superfed_cuda_group);
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("mix_endpoints", &mix_endpoints_cuda);
  m.impl("mix_endpoints_backward", &mix_endpoints_backward_cuda);
  m.impl("superfed_stats", &superfed_stats_cuda);
  m.impl("superfed_stats_backward", &superfed_stats_backward_cuda);
  m.impl("mix_endpoints_with_stats", &mix_endpoints_with_stats_cuda);
  m.impl("mix_endpoints_with_stats_backward", &mix_endpoints_with_stats_backward_cuda);
}

}  // namespace fedkernels
