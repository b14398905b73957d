// CUDA kernels of the robust-aggregation ops (schemas: csrc/ops.cpp; host side:
// csrc/robust_host.h; per-coordinate rules: csrc/order_stats.h, shared with the CPU kernels).
//
// Order statistics: one thread per coordinate gathers the K client values, sorts and reduces
// them; blocks own chunks of one tensor. Each client is read once, no [K, P] stack. Up to 32
// clients the values stay in registers (a sorting network of compile-time size); above, in a
// local array (K <= kMaxRobustClientsCuda) sorted by insertion, which the first H200 run
// showed at 8 % of the memory bandwidth for K = 10.
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

// Compare-exchange that leaves a <= b, NaN last.
template <typename A>
__device__ __forceinline__ void compare_exchange(A& a, A& b) {
  const bool swap = a > b || (a != a && b == b);
  const A lo = swap ? b : a, hi = swap ? a : b;
  a = lo;
  b = hi;
}

// N values held in registers: every index below is a compile-time constant once the loops are
// unrolled (a run-time index into a local array sends it to local memory).
template <typename A, int N>
struct RegisterValues {
  A v[N];

  // v[i] for a run-time i, as a chain of selects.
  __device__ __forceinline__ A operator[](int64_t i) const {
    A r = v[0];
#pragma unroll
    for (int j = 1; j < N; ++j) r = i == j ? v[j] : r;
    return r;
  }

  // Odd-even transposition sort (N rounds of compare-exchanges between neighbours), NaN last.
  __device__ __forceinline__ void sort() {
#pragma unroll
    for (int round = 0; round < N; ++round) {
#pragma unroll
      for (int i = round % 2; i + 1 < N; i += 2) compare_exchange(v[i], v[i + 1]);
    }
  }
};

// Order statistics for K <= N clients with the values in registers: the K values of a coordinate
// padded with NaN to N, sorted by a network, reduced by OrderStats::reduce_sorted (the same
// arithmetic as the CPU kernels and robust_kernel). The K source pointers of a chunk are loaded
// once per chunk.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) robust_registers_kernel(
    ClientListTables m, int rule, int64_t param) {
  using A = acc_type<T>;
  const A nan = A(0) / A(0);
  for (int64_t c = blockIdx.x; c < m.total_chunks; c += gridDim.x) {
    const int64_t t = tensor_of_chunk(m.prefix, m.n, c);
    const int64_t begin = (c - m.prefix[t]) * kRobustChunk;
    const int64_t end = begin + kRobustChunk < m.numels[t] ? begin + kRobustChunk : m.numels[t];
    T* out = reinterpret_cast<T*>(m.outs[t]);
    const T* src[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      src[k] = k < m.K ? static_cast<const T*>(m.input(k, t)) : nullptr;
    }
    for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
      RegisterValues<A, N> r;
      int64_t numbers = 0;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        r.v[k] = k < m.K ? static_cast<A>(src[k][e]) : nan;
        numbers += r.v[k] == r.v[k];
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
