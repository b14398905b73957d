// CUDA kernels of the differential-privacy ops (schemas: csrc/ops.cpp; host side:
// csrc/private_host.h).
//
// update_norms: a block owns a chunk of one tensor and, client by client, reduces
// sum (x_k - b)^2 in float64 (fixed-order block reduction) into its row of partial sums; a
// second kernel adds the rows in chunk order.
// private_sum: one thread per element takes the K scaled updates in client order, then adds
// base and the noise: normal e of the Philox stream keyed by the CUDA generator's seed and
// offset (as sgld_step draws them), e counted over the whole model.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <tuple>

#include "../elementwise.h"
#include "../private_host.h"
#include "client_list.cuh"
#include "multi_tensor.cuh"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kNormChunk = kThreads * 16;
constexpr int64_t kSumChunk = kThreads * 4;
constexpr int64_t kMaxBlocks = 65535LL * 32;

template <typename T>
__global__ void norms_kernel(ClientListTables m, double* partial) {
  __shared__ double s_red[kThreads / 32];
  const int64_t c = blockIdx.x;
  const int64_t t = tensor_of_chunk(m.prefix, m.n, c);
  const int64_t begin = (c - m.prefix[t]) * kNormChunk;
  const int64_t end = begin + kNormChunk < m.numels[t] ? begin + kNormChunk : m.numels[t];
  const T* b = reinterpret_cast<const T*>(m.bases[t]);
  for (int64_t k = 0; k < m.K; ++k) {
    const T* x = static_cast<const T*>(m.input(k, t));
    double s = 0.0;
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      const double d = static_cast<double>(x[e]) - static_cast<double>(b[e]);
      s += d * d;
    }
    s = block_reduce<kThreads>(s, SumOp<double>(), s_red);
    if (threadIdx.x == 0) partial[c * m.K + k] = s;
  }
}

// sums[k] = the chunk partials of client k added up (a block per client).
__global__ void __launch_bounds__(kThreads) norms_reduce_kernel(
    const double* partial, int64_t chunks, int64_t K, double* sums) {
  __shared__ double s_red[kThreads / 32];
  for (int64_t k = blockIdx.x; k < K; k += gridDim.x) {
    const double s = block_strided_sum<kThreads>(partial + k, chunks, K, s_red);
    if (threadIdx.x == 0) sums[k] = s;
  }
}

template <typename T>
__global__ void private_sum_kernel(
    ClientListTables m, double noise_std, bool noise, at::PhiloxCudaState philox) {
  using A = acc_type<T>;
  uint64_t seed = 0, offset = 0;
  if (noise) {
    const auto so = at::cuda::philox::unpack(philox);
    seed = std::get<0>(so);
    offset = std::get<1>(so);
  }
  const A std_ = static_cast<A>(noise_std);
  for (int64_t c = blockIdx.x; c < m.total_chunks; c += gridDim.x) {
    const int64_t t = tensor_of_chunk(m.prefix, m.n, c);
    const int64_t begin = (c - m.prefix[t]) * kSumChunk;
    const int64_t end = begin + kSumChunk < m.numels[t] ? begin + kSumChunk : m.numels[t];
    const T* b = reinterpret_cast<const T*>(m.bases[t]);
    T* out = reinterpret_cast<T*>(m.outs[t]);
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      const A base = static_cast<A>(b[e]);
      A acc = A(0);
      for (int64_t k = 0; k < m.K; ++k) {
        const A x = static_cast<A>(static_cast<const T*>(m.input(k, t))[e]);
        acc += static_cast<A>(m.coefficients[k]) * (x - base);
      }
      A v = base + acc;
      if (noise) {
        const int64_t g = m.offsets[t] + e;
        A eps[4];
        PhiloxNormal::normal4<A>(seed, offset, static_cast<uint64_t>(g / 4), eps);
        v += std_ * eps[g & 3];
      }
      out[e] = static_cast<T>(v);
    }
  }
}

struct PrivateCuda {
  using Key = at::PhiloxCudaState;

  // The seed and offset of the plan's generator (the device's default CUDA generator when
  // none), advanced as sgld_step advances it.
  static Key draw_key(const ClientListPlan& p) {
    if (p.noise_std == 0) return {};
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        p.generator, at::cuda::detail::getDefaultCUDAGenerator(p.device.index()));
    std::lock_guard<std::mutex> lock(gen->mutex_);
    return gen->philox_cuda_state(4);
  }

  template <typename T>
  static void norms(ClientListPlan& p) {
    const CudaLaunch launch(p.device);
    std::unique_ptr<LaunchMetadata> meta;
    const ClientListTables m = upload_tables(p, kNormChunk, launch.stream, meta);
    at::Tensor partial = at::empty(
        {m.total_chunks * p.K}, at::TensorOptions().device(p.device).dtype(at::kDouble));
    norms_kernel<T><<<static_cast<unsigned>(m.total_chunks), kThreads, 0, launch.stream>>>(
        m, partial.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    norms_reduce_kernel<<<grid_size(p.K, 1, kMaxBlocks), kThreads, 0, launch.stream>>>(
        partial.const_data_ptr<double>(), m.total_chunks, p.K, p.sums.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T>
  static void private_sum(ClientListPlan& p, const Key& philox) {
    const CudaLaunch launch(p.device);
    std::unique_ptr<LaunchMetadata> meta;
    const ClientListTables m = upload_tables(p, kSumChunk, launch.stream, meta);
    private_sum_kernel<T><<<grid_size(m.total_chunks, 1, kMaxBlocks), kThreads, 0,
                            launch.stream>>>(m, p.noise_std, p.noise_std != 0, philox);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_private<PrivateCuda>(m);
}

}  // namespace fedkernels
