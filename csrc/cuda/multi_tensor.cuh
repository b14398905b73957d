// What the CUDA kernels of every op family share: the device and stream a launch runs on, grid
// sizes, warp and block reductions with a fixed order (so a given input gives bitwise the same
// result run after run), and the upload of a launch's metadata tables (layout in
// csrc/multi_tensor.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common.h"
#include "../multi_tensor.h"

namespace fedkernels {

// The device guard and the current stream of one kernel call: every launch of the call goes on
// that stream.
struct CudaLaunch {
  explicit CudaLaunch(at::Device device)
      : guard(device), stream(c10::cuda::getCurrentCUDAStream().stream()) {}
  c10::cuda::CUDAGuard guard;
  cudaStream_t stream;
};

// Blocks for `work` items of `per_block` each, at least 1 and at most max_blocks.
inline unsigned grid_size(int64_t work, int64_t per_block, int64_t max_blocks) {
  const int64_t b = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, max_blocks)));
}

// A NaN on either side wins, so every lane of a reduction ends with the same value (with
// a > b ? a : b alone, a NaN is kept only when it comes second).
template <typename A>
struct MaxOp {
  __device__ __forceinline__ A operator()(A a, A b) const { return a > b || a != a ? a : b; }
};
template <typename A>
struct SumOp {
  __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};

// A thread's running sum of many finite values (a warp lane adds C / 32 of a row's exps):
// Kahan's compensated sum keeps the error of a few additions at any length, as the CPU kernels'
// chunked float64 sums do (csrc/cpu/softmax_stats.h); one float accumulator a lane grows its
// error with C. An infinite value would make the
// compensation NaN, so callers add exps of arguments <= 0 and their finite products.
template <typename A>
struct CompensatedSum {
  A sum = 0, lost = 0;
  __device__ __forceinline__ void add(A v) {
    const A y = v - lost;
    const A t = sum + y;
    lost = (t - sum) - y;
    sum = t;
  }
};

// Butterfly reduction over a warp: every lane ends with the same value (fp addition is
// commutative, so the pairs are the same on every lane).
template <typename A, typename Op>
__device__ __forceinline__ A warp_reduce(A v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Every thread of a block of kThreads threads gets the reduction of v over the block: warps
// first, then the warps' values in warp order. s_red holds kThreads / 32 values; it is free
// again when the call returns.
template <int kThreads, typename A, typename Op>
__device__ __forceinline__ A block_reduce(A v, Op op, A* s_red) {
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = warp_reduce(v, op);
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  A r = s_red[0];
#pragma unroll
  for (int j = 1; j < kWarps; ++j) r = op(r, s_red[j]);
  __syncthreads();
  return r;
}

// Sum of values[i * stride] for i in [0, count), by one block of kThreads threads: thread j
// adds i = j, j + kThreads, ... in order, then the block reduces in warp order, so an input
// gives bitwise the same sum run after run. Every thread of the block must call it; all get the
// sum. (One thread per sum would be a chain of count dependent loads that leaves the GPU idle.)
template <int kThreads>
__device__ __forceinline__ double block_strided_sum(
    const double* values, int64_t count, int64_t stride, double* s_red) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) s += values[i * stride];
  return block_reduce<kThreads>(s, SumOp<double>(), s_red);
}

// One block of metadata words carried by value in a kernel's parameters.
struct MetadataBlock {
  uint64_t words[kMetadataBlockWords];
};

// (A template only so that every .cu including this header may define it.)
template <typename Block>
__global__ void write_metadata_block_kernel(uint64_t* dst, int64_t count, const Block block) {
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) dst[i] = block.words[i];
}

// The metadata of one launch: filled on the host through host<V>(offset), then upload() puts it
// in a device buffer of the caching allocator (freed in stream order after the call's kernels),
// whose sections kernels read through device<V>(offset).
//
// Outside CUDA graph capture the host side is pinned memory copied asynchronously on the stream
// (the caching host allocator keeps it from reuse until the copy is done). Under capture a copy
// from host memory would be re-read at every replay, long after this call's buffer is gone, so
// the host side is ordinary memory and the upload is a few kernels that carry the words in their
// parameters: the graph keeps its own copy of those, and a replay writes the same tables again.
class LaunchMetadata {
 public:
  LaunchMetadata(const MetadataLayout& layout, at::Device device)
      : device_(device),
        words_(static_cast<int64_t>(layout.words())),
        capturing_(
            c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    if (capturing_) {
      pageable_.assign(static_cast<size_t>(words_), 0);
    } else {
      pinned_ = at::empty(
          {std::max<int64_t>(words_, 1)},
          at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    }
  }

  template <typename V>
  V* host(size_t offset) {
    uint64_t* base = capturing_ ? pageable_.data()
                                : reinterpret_cast<uint64_t*>(pinned_.mutable_data_ptr<int64_t>());
    return reinterpret_cast<V*>(reinterpret_cast<unsigned char*>(base) + offset);
  }

  void upload(cudaStream_t stream) {
    const auto on_device = at::TensorOptions().device(device_).dtype(at::kLong);
    if (!capturing_) {
      device_buffer_ = pinned_.to(on_device, /*non_blocking=*/true);
      return;
    }
    device_buffer_ = at::empty({std::max<int64_t>(words_, 1)}, on_device);
    auto* dst = reinterpret_cast<uint64_t*>(device_buffer_.mutable_data_ptr<int64_t>());
    for_each_metadata_block(words_, [&](int64_t first, int64_t count) {
      MetadataBlock block;
      std::copy_n(pageable_.data() + first, count, block.words);
      write_metadata_block_kernel<MetadataBlock><<<1, 128, 0, stream>>>(dst + first, count, block);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  template <typename V>
  const V* device(size_t offset) const {
    return reinterpret_cast<const V*>(
        reinterpret_cast<const unsigned char*>(device_buffer_.const_data_ptr<int64_t>()) + offset);
  }

 private:
  at::Device device_;
  int64_t words_;
  bool capturing_;
  at::Tensor pinned_;
  std::vector<uint64_t> pageable_;
  at::Tensor device_buffer_;
};

}  // namespace fedkernels
