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

template <typename A>
struct MaxOp {
  __device__ __forceinline__ A operator()(A a, A b) const { return a > b ? a : b; }
};
template <typename A>
struct SumOp {
  __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
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

// The metadata of one launch: filled on the host through host<V>(offset) (pinned memory), then
// upload() copies it asynchronously on the stream into a device buffer of the caching allocator
// (the caching host allocator keeps the pinned buffer from reuse until the copy is done; the
// device buffer is freed in stream order after the call's kernels), whose sections kernels read
// through device<V>(offset). The pinned buffer is reused after the call, so a launch that uses
// it cannot be captured in a CUDA graph.
class LaunchMetadata {
 public:
  LaunchMetadata(const MetadataLayout& layout, at::Device device)
      : device_(device),
        pinned_(at::empty(
            {std::max<int64_t>(static_cast<int64_t>(layout.words()), 1)},
            at::TensorOptions().dtype(at::kLong).pinned_memory(true))) {}

  template <typename V>
  V* host(size_t offset) {
    return reinterpret_cast<V*>(
        reinterpret_cast<unsigned char*>(pinned_.mutable_data_ptr<int64_t>()) + offset);
  }

  void upload(cudaStream_t /*stream: the current one, which the copy uses*/) {
    device_buffer_ =
        pinned_.to(at::TensorOptions().device(device_).dtype(at::kLong), /*non_blocking=*/true);
  }

  template <typename V>
  const V* device(size_t offset) const {
    return reinterpret_cast<const V*>(
        reinterpret_cast<const unsigned char*>(device_buffer_.const_data_ptr<int64_t>()) + offset);
  }

 private:
  at::Device device_;
  at::Tensor pinned_;
  at::Tensor device_buffer_;
};

}  // namespace fedkernels
