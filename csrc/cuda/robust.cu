// CUDA kernels of the robust-aggregation ops (schemas: csrc/ops.cpp; host side:
// csrc/robust_host.h; per-coordinate rules: csrc/order_stats.h, shared with the CPU kernels).
//
// Order statistics: one thread per coordinate gathers the K client values into a local array
// (K <= kMaxRobustClientsCuda), sorts and reduces it; blocks own chunks of one tensor. Each
// client is read once, no [K, P] stack.
//
// Distances: a block owns a chunk of kDistChunk elements of one tensor and stages it in
// shared memory kDistTile elements of all K clients at a time; thread s accumulates the
// squared differences of pairs s, s + kThreads, ... in float64 registers. Each block writes
// its row of partial sums, and a second kernel adds the rows in chunk order, so a given input
// gives bitwise the same matrix run after run.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>

#include "../order_stats.h"
#include "../robust_host.h"
#include "client_list.cuh"
#include "multi_tensor.cuh"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRobustChunk = kThreads * 4;
constexpr int64_t kMaxBlocks = 65535LL * 32;
constexpr int64_t kDistChunk = 8192;
constexpr int kDistTile = 32;
// Pair slots per thread: kThreads * kPairSlots >= K (K - 1) / 2 for K <= kMaxRobustClientsCuda.
constexpr int kPairSlots =
    (kMaxRobustClientsCuda * (kMaxRobustClientsCuda - 1) / 2 + kThreads - 1) / kThreads;

template <typename T, int kMaxK>
__global__ void robust_kernel(ClientListTables m, int rule, int64_t param) {
  using A = acc_type<T>;
  A v[kMaxK];
  for (int64_t c = blockIdx.x; c < m.total_chunks; c += gridDim.x) {
    const int64_t t = tensor_of_chunk(m.prefix, m.n, c);
    const int64_t begin = (c - m.prefix[t]) * kRobustChunk;
    const int64_t end = begin + kRobustChunk < m.numels[t] ? begin + kRobustChunk : m.numels[t];
    T* out = reinterpret_cast<T*>(m.outs[t]);
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      for (int64_t k = 0; k < m.K; ++k) {
        v[k] = static_cast<A>(static_cast<const T*>(m.input(k, t))[e]);
      }
      out[e] = static_cast<T>(
          OrderStats::reduce<A>(v, m.K, static_cast<RobustRule>(rule), param));
    }
  }
}

// Pair q of the upper triangle (row-major over i < j) as (i, j).
__device__ __forceinline__ void pair_of(int64_t q, int64_t K, int& i, int& j) {
  int64_t row = 0;
  while (q >= K - 1 - row) {
    q -= K - 1 - row;
    ++row;
  }
  i = static_cast<int>(row);
  j = static_cast<int>(row + 1 + q);
}

template <typename T>
__global__ void distances_kernel(ClientListTables m, double* partial) {
  using A = acc_type<T>;
  extern __shared__ unsigned char smem_raw[];
  A* tile = reinterpret_cast<A*>(smem_raw);  // [K][kDistTile]
  const int64_t K = m.K, pairs = K * (K - 1) / 2;
  const int64_t c = blockIdx.x;
  const int64_t t = tensor_of_chunk(m.prefix, m.n, c);
  const int64_t begin = (c - m.prefix[t]) * kDistChunk;
  const int64_t end = begin + kDistChunk < m.numels[t] ? begin + kDistChunk : m.numels[t];
  int pi[kPairSlots], pj[kPairSlots];
  double acc[kPairSlots];
#pragma unroll
  for (int s = 0; s < kPairSlots; ++s) {
    acc[s] = 0.0;
    const int64_t q = threadIdx.x + static_cast<int64_t>(s) * kThreads;
    if (q < pairs) {
      pair_of(q, K, pi[s], pj[s]);
    } else {
      pi[s] = pj[s] = 0;
    }
  }
  for (int64_t e0 = begin; e0 < end; e0 += kDistTile) {
    const int len = static_cast<int>(end - e0 < kDistTile ? end - e0 : kDistTile);
    for (int64_t idx = threadIdx.x; idx < K * kDistTile; idx += blockDim.x) {
      const int64_t k = idx / kDistTile;
      const int e = static_cast<int>(idx % kDistTile);
      tile[idx] = e < len ? static_cast<A>(static_cast<const T*>(m.input(k, t))[e0 + e]) : A(0);
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kPairSlots; ++s) {
      if (threadIdx.x + static_cast<int64_t>(s) * kThreads < pairs) {
        const A* xi = tile + pi[s] * kDistTile;
        const A* xj = tile + pj[s] * kDistTile;
        for (int e = 0; e < len; ++e) {
          const double d = static_cast<double>(xi[e]) - static_cast<double>(xj[e]);
          acc[s] += d * d;
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int s = 0; s < kPairSlots; ++s) {
    const int64_t q = threadIdx.x + static_cast<int64_t>(s) * kThreads;
    if (q < pairs) partial[c * pairs + q] = acc[s];
  }
}

// d[i, j] = d[j, i] = sum over chunks (in order) of the partial rows.
__global__ void distances_reduce_kernel(
    const double* partial, int64_t chunks, int64_t K, double* d) {
  const int64_t pairs = K * (K - 1) / 2;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < pairs;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[c * pairs + q];
    int i, j;
    pair_of(q, K, i, j);
    d[i * K + j] = s;
    d[j * K + i] = s;
  }
}

struct RobustCuda {
  template <typename T>
  static void robust(ClientListPlan& p) {
    const CudaLaunch launch(p.device);
    std::unique_ptr<LaunchMetadata> meta;
    const ClientListTables m = upload_tables(p, kRobustChunk, launch.stream, meta);
    const unsigned blocks = grid_size(m.total_chunks, 1, kMaxBlocks);
    const int rule = static_cast<int>(p.rule);
    if (p.K <= 32) {
      robust_kernel<T, 32><<<blocks, kThreads, 0, launch.stream>>>(m, rule, p.param);
    } else {
      robust_kernel<T, kMaxRobustClientsCuda><<<blocks, kThreads, 0, launch.stream>>>(
          m, rule, p.param);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T>
  static void distances(ClientListPlan& p) {
    using A = acc_type<T>;
    const int64_t K = p.K, pairs = K * (K - 1) / 2;
    if (pairs == 0) return;
    TORCH_CHECK_VALUE(
        K <= kMaxRobustClientsCuda, "fedkernels.pairwise_sq_distances: the CUDA kernel takes at "
        "most ", kMaxRobustClientsCuda, " clients, got ", K);
    const CudaLaunch launch(p.device);
    std::unique_ptr<LaunchMetadata> meta;
    const ClientListTables m = upload_tables(p, kDistChunk, launch.stream, meta);
    at::Tensor partial = at::empty(
        {m.total_chunks * pairs}, at::TensorOptions().device(p.device).dtype(at::kDouble));
    const size_t smem = static_cast<size_t>(K) * kDistTile * sizeof(A);
    distances_kernel<T><<<static_cast<unsigned>(m.total_chunks), kThreads, smem, launch.stream>>>(
        m, partial.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    distances_reduce_kernel<<<grid_size(pairs, kThreads, kMaxBlocks), kThreads, 0,
                              launch.stream>>>(
        partial.const_data_ptr<double>(), m.total_chunks, K, p.sums.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_robust<RobustCuda>(m);
}

}  // namespace fedkernels
