// CUDA kernels of the SuPerFed ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/superfed_host.h; per-element math: SuperfedOp in csrc/elementwise.h, the functions the
// CPU kernels run).
//
// One launch per dtype group whatever the number of tensors: the launch metadata (input and
// output pointers, numels, a prefix sum of chunks per tensor, each tensor's index in the op's
// lists) lives in one device buffer (LaunchMetadata, csrc/cuda/multi_tensor.cuh). Each block
// owns one chunk of one tensor at a time (grid-stride over chunks) and runs every element of it
// through SuperfedOp<kind>::apply. The reductions (the lam gradient, the four statistics) are
// reduced per chunk in the accumulate type with a fixed tree (block_reduce), stored in float64
// per chunk, and a second small kernel adds each tensor's chunks in order: no atomics, so the
// result is bitwise the same run after run.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../elementwise.h"
#include "../superfed_host.h"
#include "multi_tensor.cuh"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;                  // elements per thread per chunk
constexpr int kChunk = kThreads * kPerThread;  // 2048 elements per block-chunk
constexpr int64_t kMaxBlocks = 65535;

struct SuperfedMeta {
  const uint64_t* in;           // [kSuperfedInputs][n] input pointers (0: absent)
  const uint64_t* out;          // [kSuperfedOutputs][n] output pointers (0: not wanted)
  const int64_t* numels;        // [n], all > 0
  const int64_t* chunk_prefix;  // [n + 1]
  const int64_t* index;         // [n]: position in the op's lists (row of lam, h, result)
  const double* lam;            // [T] or null
  const double* h;              // [T, 4] or null
  SgdSettings sgd;              // kMixStatsStep only
  double* partials;             // [total_chunks][kSums]; null without a reduction
  int64_t num_tensors;
  int64_t total_chunks;
  bool has[kSuperfedInputs];    // which inputs the call reads
};

template <typename T, SuperfedKind kKind>
__global__ void __launch_bounds__(kThreads) superfed_kernel(const SuperfedMeta m) {
  using A = acc_type<T>;
  using Op = SuperfedOp<kKind>;
  constexpr int kWidth = Op::kSums > 0 ? Op::kSums : 1;
  constexpr int kIn = Op::kInputs, kOut = Op::kOutputs;
  __shared__ A s_red[kThreads / 32];
  const bool reduce = m.partials != nullptr;
  for (int64_t c = blockIdx.x; c < m.total_chunks; c += gridDim.x) {
    const int64_t t = tensor_of_chunk(m.chunk_prefix, m.num_tensors, c);
    const int64_t begin = (c - m.chunk_prefix[t]) * kChunk;
    const int64_t rest = m.numels[t] - begin;
    const int len = static_cast<int>(rest < kChunk ? rest : kChunk);
    const T* in[kIn];
    T* out[kOut];
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      const auto ptr = reinterpret_cast<const T*>(m.in[i * m.num_tensors + t]);
      in[i] = ptr ? ptr + begin : nullptr;
    }
#pragma unroll
    for (int i = 0; i < kOut; ++i) {
      const auto ptr = reinterpret_cast<T*>(m.out[i * m.num_tensors + t]);
      out[i] = ptr ? ptr + begin : nullptr;
    }
    const auto coef =
        SuperfedCoef<A>::load(m.lam, m.h, m.index[t], m.has[1], m.has[2]).with_sgd(m.sgd);
    A sums[kWidth];
#pragma unroll
    for (int k = 0; k < kWidth; ++k) sums[k] = A(0);
    for (int j = threadIdx.x; j < len; j += kThreads) {
      A x[kIn], y[kOut];
#pragma unroll
      for (int i = 0; i < kIn; ++i) x[i] = in[i] ? static_cast<A>(in[i][j]) : A(0);
      Op::apply(coef, m.has[1], m.has[2], reduce, x, y, sums);
#pragma unroll
      for (int i = 0; i < kOut; ++i) {
        if (out[i]) out[i][j] = static_cast<T>(y[i]);
      }
    }
    if constexpr (Op::kSums > 0) {
      if (reduce) {
#pragma unroll
        for (int k = 0; k < Op::kSums; ++k) {
          const A s = block_reduce<kThreads>(sums[k], SumOp<A>(), s_red);
          if (threadIdx.x == 0) m.partials[Op::kSums * c + k] = static_cast<double>(s);
        }
      }
    }
  }
}

// result[index[t] * width + k] += sum of tensor t's chunk partials (a block per tensor).
constexpr int kCombineThreads = 128;
__global__ void __launch_bounds__(kCombineThreads) combine_partials_kernel(
    const double* partials, const int64_t* chunk_prefix, const int64_t* index, int64_t n,
    int width, double* result) {
  __shared__ double s_red[kCombineThreads / 32];
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t first = chunk_prefix[t], count = chunk_prefix[t + 1] - first;
    for (int k = 0; k < width; ++k) {
      const double s = block_strided_sum<kCombineThreads>(
          partials + first * width + k, count, width, s_red);
      if (threadIdx.x == 0) result[index[t] * width + k] += s;
    }
  }
}

struct SuperfedCuda {
  template <typename T, SuperfedKind kKind>
  static void run(const SuperfedPlan& p) {
    const int64_t n = p.num_tensors();
    const CudaLaunch launch(p.device);
    TORCH_CHECK(
        c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
        "fedkernels: the SuPerFed ops are not supported under CUDA graph capture (not yet "
        "validated there)");

    MetadataLayout layout;
    const size_t in_at = layout.add<uint64_t>(kSuperfedInputs * n);
    const size_t out_at = layout.add<uint64_t>(kSuperfedOutputs * n);
    const size_t numels_at = layout.add<int64_t>(n);
    const size_t prefix_at = layout.add<int64_t>(n + 1);
    const size_t index_at = layout.add<int64_t>(n);
    LaunchMetadata meta(layout, p.device);
    auto* h_in = meta.host<uint64_t>(in_at);
    auto* h_out = meta.host<uint64_t>(out_at);
    auto* h_numels = meta.host<int64_t>(numels_at);
    auto* h_index = meta.host<int64_t>(index_at);
    for (int j = 0; j < kSuperfedInputs; ++j) {
      for (int64_t i = 0; i < n; ++i) {
        h_in[j * n + i] = p.has_input(j) ? reinterpret_cast<uint64_t>(p.in[j][i]) : 0;
      }
    }
    for (int j = 0; j < kSuperfedOutputs; ++j) {
      for (int64_t i = 0; i < n; ++i) {
        h_out[j * n + i] = p.has_output(j) ? reinterpret_cast<uint64_t>(p.out[j][i]) : 0;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      h_numels[i] = p.numels[i];
      h_index[i] = p.index[i];
    }
    const int64_t total_chunks =
        fill_chunk_prefix(h_numels, n, kChunk, meta.host<int64_t>(prefix_at));
    meta.upload(launch.stream);

    constexpr int kSums = SuperfedOp<kKind>::kSums;
    const bool reduce = kSums > 0 && p.reduce;
    at::Tensor partials;
    if (reduce) {
      partials = at::empty(
          {total_chunks * kSums}, at::TensorOptions().device(p.device).dtype(at::kDouble));
    }
    SuperfedMeta m;
    m.in = meta.device<uint64_t>(in_at);
    m.out = meta.device<uint64_t>(out_at);
    m.numels = meta.device<int64_t>(numels_at);
    m.chunk_prefix = meta.device<int64_t>(prefix_at);
    m.index = meta.device<int64_t>(index_at);
    m.lam = p.lam.defined() ? p.lam.const_data_ptr<double>() : nullptr;
    m.h = p.h.defined() ? p.h.const_data_ptr<double>() : nullptr;
    m.partials = reduce ? partials.mutable_data_ptr<double>() : nullptr;
    m.num_tensors = n;
    m.total_chunks = total_chunks;
    for (int j = 0; j < kSuperfedInputs; ++j) m.has[j] = p.has_input(j);
    m.sgd = p.sgd;

    superfed_kernel<T, kKind>
        <<<grid_size(total_chunks, 1, kMaxBlocks), kThreads, 0, launch.stream>>>(m);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (reduce) {
      combine_partials_kernel<<<grid_size(n, 1, kMaxBlocks), kCombineThreads, 0, launch.stream>>>(
          m.partials, m.chunk_prefix, m.index, n, kSums, p.result.mutable_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_superfed<SuperfedCuda>(m);
}

}  // namespace fedkernels
