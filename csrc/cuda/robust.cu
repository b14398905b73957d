// CUDA kernels of the robust-aggregation ops (schemas: csrc/ops.cpp; host side:
// csrc/robust_host.h; per-coordinate rules: csrc/order_stats.h, shared with the CPU kernels).
//
// Order statistics: one thread per coordinate gathers the K client values, sorts and reduces
// them; blocks own chunks of one tensor. Each client is read once, no [K, P] stack. The values
// stay in registers as integer sort keys, padded to a power of two N <= 128 and sorted by a
// network (csrc/cuda/sorted_keys.cuh). The first H200 run, with a local array sorted by
// insertion, reached 8 % of the memory bandwidth at K = 10; float compare-exchanges in an
// odd-even transposition network, 14 %.
//
// Distances: a block owns a chunk of kDistChunk elements of one tensor and stages it in
// shared memory kDistTile elements of all K clients at a time; each thread accumulates the
// squared differences of its pairs (or of its share of one pair's elements, when pairs are
// fewer than threads) in float64 registers. Each block writes its row of partial sums, and a
// second kernel adds the rows up, in a fixed order, so a given input gives bitwise the same
// matrix run after run.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "../order_stats.h"
#include "../robust_host.h"
#include "client_list.cuh"
#include "multi_tensor.cuh"
#include "sorted_keys.cuh"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRobustChunk = kThreads * 4;
constexpr int64_t kMaxBlocks = 65535LL * 32;
constexpr int64_t kDistChunk = 8192;
static_assert(kMaxRobustClientsCuda <= 128, "the largest order-statistics network holds 128");
constexpr int kDistTile = 32;
// Pair slots per thread: kThreads * kPairSlots >= K (K - 1) / 2 for K <= kMaxRobustClientsCuda.
constexpr int kPairSlots =
    (kMaxRobustClientsCuda * (kMaxRobustClientsCuda - 1) / 2 + kThreads - 1) / kThreads;

// Order statistics for K <= N clients with the values in registers: the K values of a
// coordinate as sort keys, padded with NaN keys to N, sorted by a network, reduced by
// OrderStats::reduce_sorted (the same arithmetic as the CPU kernels). A chunk's
// K source pointers are staged in shared memory once per chunk (in registers they would take
// 2 N of them).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) robust_registers_kernel(
    ClientListTables m, int rule, int64_t param) {
  using A = acc_type<T>;
  using Keys = SortedKeys<A, N>;
  __shared__ const T* s_src[N];
  for (int64_t c = blockIdx.x; c < m.total_chunks; c += gridDim.x) {
    const int64_t t = tensor_of_chunk(m.prefix, m.n, c);
    const int64_t begin = (c - m.prefix[t]) * kRobustChunk;
    const int64_t end = begin + kRobustChunk < m.numels[t] ? begin + kRobustChunk : m.numels[t];
    T* out = reinterpret_cast<T*>(m.outs[t]);
    __syncthreads();  // the previous chunk is done with s_src
    for (int k = threadIdx.x; k < N; k += blockDim.x) {
      s_src[k] = k < m.K ? static_cast<const T*>(m.input(k, t)) : nullptr;
    }
    __syncthreads();
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      Keys r;
      int64_t numbers = 0;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (k < m.K) {
          const A x = static_cast<A>(s_src[k][e]);
          numbers += x == x;
          r.k[k] = SortKey<A>::of(x);
        } else {
          r.k[k] = SortKey<A>::kNaN;
        }
      }
      r.sort();
      out[e] = static_cast<T>(OrderStats::reduce_sorted<A>(
          r, m.K, numbers, static_cast<RobustRule>(rule), param));
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

// One block per chunk; the chunk's K rows go through shared memory kDistTile elements at a time
// (rows padded by one element, so the threads of a warp reading one column of different rows
// hit different banks). Work item v = threadIdx.x + s * kThreads of the block (slot s < kSlots)
// is pair v / lanes, lane v % lanes: with few pairs (K = 10: 45) several lanes share a pair, each
// adding every lanes-th element of the tile, so the block keeps most of its threads busy. The
// lanes' sums are added in lane order at the end: a fixed order, bitwise the same run after run.
template <typename T, int kSlots>
__global__ void __launch_bounds__(kThreads) distances_kernel(
    ClientListTables m, int lanes, double* partial) {
  using A = acc_type<T>;
  constexpr int kStride = kDistTile + 1;
  extern __shared__ unsigned char smem_raw[];
  A* tile = reinterpret_cast<A*>(smem_raw);  // [K][kStride]
  __shared__ double s_lane[kThreads];
  const int64_t K = m.K, pairs = K * (K - 1) / 2;
  const int64_t c = blockIdx.x;
  const int64_t t = tensor_of_chunk(m.prefix, m.n, c);
  const int64_t begin = (c - m.prefix[t]) * kDistChunk;
  const int64_t end = begin + kDistChunk < m.numels[t] ? begin + kDistChunk : m.numels[t];
  int pi[kSlots], pj[kSlots];
  bool busy[kSlots];
  double acc[kSlots];
  const int lane = static_cast<int>(threadIdx.x % lanes);
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    acc[s] = 0.0;
    const int64_t q = (threadIdx.x + static_cast<int64_t>(s) * kThreads) / lanes;
    busy[s] = q < pairs;
    if (busy[s]) {
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
      tile[k * kStride + e] =
          e < len ? static_cast<A>(static_cast<const T*>(m.input(k, t))[e0 + e]) : A(0);
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      if (busy[s]) {
        const A* xi = tile + pi[s] * kStride;
        const A* xj = tile + pj[s] * kStride;
        for (int e = lane; e < len; e += lanes) {
          const double d = static_cast<double>(xi[e]) - static_cast<double>(xj[e]);
          acc[s] += d * d;
        }
      }
    }
    __syncthreads();
  }
  if (lanes == 1) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int64_t q = threadIdx.x + static_cast<int64_t>(s) * kThreads;
      if (q < pairs) partial[c * pairs + q] = acc[s];
    }
    return;
  }
  // lanes > 1 only when pairs * lanes <= kThreads: one slot per thread.
  s_lane[threadIdx.x] = acc[0];
  __syncthreads();
  if (lane == 0 && busy[0]) {
    double sum = s_lane[threadIdx.x];
    for (int l = 1; l < lanes; ++l) sum += s_lane[threadIdx.x + l];
    partial[c * pairs + threadIdx.x / lanes] = sum;
  }
}

// d[i, j] = d[j, i] = the partial rows of pair (i, j) added up (a block per pair).
__global__ void __launch_bounds__(kThreads) distances_reduce_kernel(
    const double* partial, int64_t chunks, int64_t K, double* d) {
  __shared__ double s_red[kThreads / 32];
  const int64_t pairs = K * (K - 1) / 2;
  for (int64_t q = blockIdx.x; q < pairs; q += gridDim.x) {
    const double s = block_strided_sum<kThreads>(partial + q, chunks, pairs, s_red);
    if (threadIdx.x == 0) {
      int i, j;
      pair_of(q, K, i, j);
      d[i * K + j] = s;
      d[j * K + i] = s;
    }
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
    if (p.K <= 8) {
      robust_registers_kernel<T, 8><<<blocks, kThreads, 0, launch.stream>>>(m, rule, p.param);
    } else if (p.K <= 16) {
      robust_registers_kernel<T, 16><<<blocks, kThreads, 0, launch.stream>>>(m, rule, p.param);
    } else if (p.K <= 32) {
      robust_registers_kernel<T, 32><<<blocks, kThreads, 0, launch.stream>>>(m, rule, p.param);
    } else if (p.K <= 64) {
      robust_registers_kernel<T, 64><<<blocks, kThreads, 0, launch.stream>>>(m, rule, p.param);
    } else {  // the host refuses K > kMaxRobustClientsCuda
      robust_registers_kernel<T, 128><<<blocks, kThreads, 0, launch.stream>>>(m, rule, p.param);
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
    const size_t smem = static_cast<size_t>(K) * (kDistTile + 1) * sizeof(A);
    const unsigned blocks = static_cast<unsigned>(m.total_chunks);
    const int lanes = static_cast<int>(std::max<int64_t>(1, kThreads / pairs));
    double* out = partial.mutable_data_ptr<double>();
    if (pairs <= kThreads) {
      distances_kernel<T, 1><<<blocks, kThreads, smem, launch.stream>>>(m, lanes, out);
    } else if (pairs <= 8 * kThreads) {
      distances_kernel<T, 8><<<blocks, kThreads, smem, launch.stream>>>(m, 1, out);
    } else {
      distances_kernel<T, kPairSlots><<<blocks, kThreads, smem, launch.stream>>>(m, 1, out);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    distances_reduce_kernel<<<grid_size(pairs, 1, kMaxBlocks), kThreads, 0,
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
