// CUDA kernels of the robust-aggregation ops (schemas: csrc/ops.cpp; host side:
// csrc/robust_host.h; per-coordinate rules: csrc/order_stats.h, shared with the CPU kernels).
//
// Order statistics: one thread per coordinate gathers the K client values, sorts and reduces
// them; blocks own chunks of one tensor. Each client is read once, no [K, P] stack. The values
// stay in registers as integer sort keys, padded to a power of two N <= 128 and sorted by a
// network (csrc/cuda/sorted_keys.cuh): a local array sorted by insertion, or float
// compare-exchanges, would leave the kernel far from the memory bandwidth.
//
// Distances: a block owns a chunk of kDistChunk elements of one tensor and stages it in
// shared memory kDistTile elements of all K clients at a time; each thread accumulates the
// squared differences of its pair (few pairs: of its share of the pair's elements) or of a
// 4 x 4 block of pairs (many pairs) in float64 registers. Each block writes its row of partial
// sums, and a second kernel adds the rows up, in a fixed order, so a given input gives bitwise
// the same matrix run after run.
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

// The sum of a work item's lanes (this thread and the lanes - 1 after it), added in lane order,
// for the threads that ask (an item's first lane, of an item that exists); every thread of the
// block must call it, as it syncs.
__device__ __forceinline__ double lane_sum(double acc, int lanes, bool ask, double* s_lane) {
  __syncthreads();  // s_lane is free again
  s_lane[threadIdx.x] = acc;
  __syncthreads();
  double sum = 0.0;
  if (ask) {
    sum = s_lane[threadIdx.x];
    for (int l = 1; l < lanes; ++l) sum += s_lane[threadIdx.x + l];
  }
  return sum;
}

// Few pairs (K (K - 1) / 2 <= kThreads). One block per chunk; the chunk's K rows go through
// shared memory kDistTile elements at a time (rows padded by one element, so the threads of a
// warp reading one column of different rows hit different banks). Thread v is pair v / lanes,
// lane v % lanes: several lanes share a pair (K = 10: 45 pairs, 5 lanes), each adding every
// lanes-th element of the tile, so the block keeps most of its threads busy. The lanes' sums
// are added in lane order at the end: a fixed order, bitwise the same run after run.
template <typename T>
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
  const int lane = static_cast<int>(threadIdx.x % lanes);
  const int64_t q = threadIdx.x / lanes;
  const bool busy = q < pairs;
  int pi = 0, pj = 0;
  if (busy) pair_of(q, K, pi, pj);
  double acc = 0.0;
  for (int64_t e0 = begin; e0 < end; e0 += kDistTile) {
    const int len = static_cast<int>(end - e0 < kDistTile ? end - e0 : kDistTile);
    for (int64_t idx = threadIdx.x; idx < K * kDistTile; idx += blockDim.x) {
      const int64_t k = idx / kDistTile;
      const int e = static_cast<int>(idx % kDistTile);
      tile[k * kStride + e] =
          e < len ? static_cast<A>(static_cast<const T*>(m.input(k, t))[e0 + e]) : A(0);
    }
    __syncthreads();
    if (busy) {
      const A* xi = tile + pi * kStride;
      const A* xj = tile + pj * kStride;
      for (int e = lane; e < len; e += lanes) {
        const double d = static_cast<double>(xi[e]) - static_cast<double>(xj[e]);
        acc += d * d;
      }
    }
    __syncthreads();
  }
  if (lanes == 1) {
    if (busy) partial[c * pairs + q] = acc;
    return;
  }
  const double sum = lane_sum(acc, lanes, lane == 0 && busy, s_lane);
  if (lane == 0 && busy) partial[c * pairs + q] = sum;
}

// Many pairs (K (K - 1) / 2 > kThreads): the pairs are cut into kBlock x kBlock blocks of
// rows I x J (I <= J; a diagonal block holds its i < j pairs), and a thread owns a whole block:
// per element it reads 2 kBlock values from shared memory for kBlock^2 pairs, where one pair
// per thread read 2 values for 1. The tile is staged as float64 once (rows past K zero). Work
// item v = threadIdx.x + r * kThreads is block v / lanes, lane v % lanes (lanes > 1 only when
// the blocks fit in one round); rounds r > 0 stage the chunk again. Each pair's sum runs over
// the chunk's elements in the same order as in distances_kernel.
constexpr int kBlock = 4;

// Block q of the upper triangle with its diagonal (row-major over bi <= bj < nb): pair q of
// nb + 1 rows, its second index moved down by one.
__device__ __forceinline__ void block_of(int64_t q, int64_t nb, int& bi, int& bj) {
  pair_of(q, nb + 1, bi, bj);
  --bj;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) distances_blocked_kernel(
    ClientListTables m, int lanes, double* partial) {
  constexpr int kStride = kDistTile + 1;
  extern __shared__ double tile64[];  // [nb * kBlock][kStride]
  __shared__ double s_lane[kThreads];
  const int64_t K = m.K, pairs = K * (K - 1) / 2;
  const int64_t nb = (K + kBlock - 1) / kBlock, blocks = nb * (nb + 1) / 2;
  const int64_t rows = nb * kBlock;
  const int64_t c = blockIdx.x;
  const int64_t t = tensor_of_chunk(m.prefix, m.n, c);
  const int64_t begin = (c - m.prefix[t]) * kDistChunk;
  const int64_t end = begin + kDistChunk < m.numels[t] ? begin + kDistChunk : m.numels[t];
  const int lane = static_cast<int>(threadIdx.x % lanes);
  for (int64_t first = 0; first < blocks * lanes; first += kThreads) {
    const int64_t q = (first + threadIdx.x) / lanes;
    const bool busy = q < blocks;
    int bi = 0, bj = 0;
    if (busy) block_of(q, nb, bi, bj);
    double acc[kBlock][kBlock];
#pragma unroll
    for (int a = 0; a < kBlock; ++a) {
#pragma unroll
      for (int b = 0; b < kBlock; ++b) acc[a][b] = 0.0;
    }
    for (int64_t e0 = begin; e0 < end; e0 += kDistTile) {
      const int len = static_cast<int>(end - e0 < kDistTile ? end - e0 : kDistTile);
      __syncthreads();  // the previous tile (or round) is done with tile64
      for (int64_t idx = threadIdx.x; idx < rows * kDistTile; idx += blockDim.x) {
        const int64_t k = idx / kDistTile;
        const int e = static_cast<int>(idx % kDistTile);
        tile64[k * kStride + e] =
            k < K && e < len ? static_cast<double>(static_cast<const T*>(m.input(k, t))[e0 + e])
                             : 0.0;
      }
      __syncthreads();
      if (busy) {
        const double* xi = tile64 + bi * kBlock * kStride;
        const double* xj = tile64 + bj * kBlock * kStride;
        for (int e = lane; e < len; e += lanes) {
          double vi[kBlock], vj[kBlock];
#pragma unroll
          for (int a = 0; a < kBlock; ++a) {
            vi[a] = xi[a * kStride + e];
            vj[a] = xj[a * kStride + e];
          }
#pragma unroll
          for (int a = 0; a < kBlock; ++a) {
#pragma unroll
            for (int b = 0; b < kBlock; ++b) {
              const double d = vi[a] - vj[b];
              acc[a][b] += d * d;
            }
          }
        }
      }
    }
    // Each pair of the block: its lanes' sums added in lane order into partial.
#pragma unroll
    for (int a = 0; a < kBlock; ++a) {
#pragma unroll
      for (int b = 0; b < kBlock; ++b) {
        const int64_t i = static_cast<int64_t>(bi) * kBlock + a;
        const int64_t j = static_cast<int64_t>(bj) * kBlock + b;
        const bool real = busy && i < j && j < K;
        const int64_t pair = i * (2 * K - i - 1) / 2 + (j - i - 1);
        if (lanes == 1) {
          if (real) partial[c * pairs + pair] = acc[a][b];
          continue;
        }
        const double sum = lane_sum(acc[a][b], lanes, lane == 0 && real, s_lane);
        if (lane == 0 && real) partial[c * pairs + pair] = sum;
      }
    }
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
    const unsigned blocks = static_cast<unsigned>(m.total_chunks);
    double* out = partial.mutable_data_ptr<double>();
    if (pairs <= kThreads) {
      const size_t smem = static_cast<size_t>(K) * (kDistTile + 1) * sizeof(A);
      const int lanes = static_cast<int>(std::max<int64_t>(1, kThreads / pairs));
      distances_kernel<T><<<blocks, kThreads, smem, launch.stream>>>(m, lanes, out);
    } else {
      const int64_t nb = (K + kBlock - 1) / kBlock, pair_blocks = nb * (nb + 1) / 2;
      const size_t smem = static_cast<size_t>(nb * kBlock) * (kDistTile + 1) * sizeof(double);
      const int lanes = static_cast<int>(
          std::min<int64_t>(kDistTile, std::max<int64_t>(1, kThreads / pair_blocks)));
      distances_blocked_kernel<T><<<blocks, kThreads, smem, launch.stream>>>(m, lanes, out);
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
