// CUDA kernel of fedkernels::weighted_sum (schemas and the three modes: csrc/ops.cpp; the design
// is multi_tensor_apply with an indirect pointer table).
//
// One launch per (input dtype, output dtype) group, whatever the number of clients K and of
// tensors n: the launch metadata (client-major input pointers [K][n], base and out pointers,
// numels, a prefix sum of chunks per tensor, per-tensor vectorizable flags, the weights) lives in
// one device buffer (LaunchMetadata, csrc/cuda/multi_tensor.cuh) rather than in kernel arguments
// (4 KB, which caps apex/ATen multi_tensor_apply at a handful of lists). The upload is legal
// under CUDA graph capture, so the op works in captured graphs (torch.compile's
// mode="reduce-overhead"); weights given on the CPU are then fixed at their captured values.
//
// Work: each block owns one chunk of one tensor (found by binary search on the chunk prefix).
// Its threads keep the chunk's accumulators in registers (fp32, fp64 for fp64 inputs) and read
// the clients in order k = 0..K-1, several clients' loads in flight at once, so every input
// element is read once and every output element written once: (K + 1) * P element traffic
// (K + 2 with a separate base). The per-element order of the sum is fixed, so a given input gives
// bitwise the same output run after run on one device.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../elementwise.h"
#include "../weighted_sum_host.h"
#include "multi_tensor.cuh"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;

// Elements of T in one 16-byte vector load.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// Vectors per thread per chunk (kSlots) and clients whose loads are issued together (kUnroll):
// 8 loads of 16 bytes in flight per thread. Clients in flight matter more than slots: when the
// model is small, blocks are few and each is bound by the latency of its walk over the clients.
constexpr int kSlots = 2;
constexpr int kUnrollVector = 4;
// The element-by-element path (an unaligned pointer, or numel % kVec != 0).
template <typename T>
constexpr int kScalarSlots = sizeof(T) == 2 ? 8 : 4;
constexpr int kUnrollScalar = 4;

// Elements per chunk: 2048 for fp32, 4096 for fp16/bf16, 1024 for fp64 (8 KiB of each client).
template <typename T>
constexpr int kChunk = kThreads * kVec<T> * kSlots;

template <typename A>
struct Meta {
  const uint64_t* inputs;        // [K][n] pointers to T, client-major
  const uint64_t* bases;         // [n] pointers to U; null without a base
  const uint64_t* outs;          // [n] pointers to U; may equal bases (in place)
  const int64_t* numels;         // [n], all > 0
  const int64_t* chunk_prefix;   // [n + 1]: tensor t owns chunks [prefix[t], prefix[t + 1])
  const uint8_t* vectorizable;   // [n]: every pointer 16-byte aligned and numel % kVec == 0
  const A* weights;              // [K]
  int64_t num_clients;
  int64_t num_tensors;
  int64_t total_chunks;
  A scale;
};

// Raw bits of one element, for __ldg of types it has no overload for (c10::Half, BFloat16).
template <size_t bytes>
struct Bits;
template <>
struct Bits<2> { using type = unsigned short; };
template <>
struct Bits<4> { using type = unsigned int; };
template <>
struct Bits<8> { using type = unsigned long long; };

// Load of N elements of a client update: read-only for the whole kernel (the host checked that
// no output overlaps an update), so it may go through the non-coherent cache.
template <typename T, int N>
__device__ __forceinline__ void load_update(const T* p, T (&v)[N]) {
  if constexpr (N == 1) {
    using B = typename Bits<sizeof(T)>::type;
    const B raw = __ldg(reinterpret_cast<const B*>(p));
    memcpy(&v[0], &raw, sizeof(T));
  } else {
    static_assert(sizeof(T) * N == 16, "one vector load");
    const int4 raw = __ldg(reinterpret_cast<const int4*>(p));
    memcpy(&v[0], &raw, 16);
  }
}

// Load of N base elements. The base may be the output (in place), so plain coherent loads; the
// thread that loads an element is the one that later stores it.
template <typename U, int N>
__device__ __forceinline__ void load_base(const U* p, U (&v)[N]) {
  if constexpr (N == 1) {
    v[0] = *p;
  } else {
    static_assert(sizeof(U) * N % 16 == 0, "whole vector loads");
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(U)) * N / 16; ++i) {
      const int4 raw = reinterpret_cast<const int4*>(p)[i];
      memcpy(reinterpret_cast<char*>(&v[0]) + 16 * i, &raw, 16);
    }
  }
}

template <typename U, int N>
__device__ __forceinline__ void store_out(U* p, const U (&v)[N]) {
  if constexpr (N == 1) {
    *p = v[0];
  } else {
    static_assert(sizeof(U) * N % 16 == 0, "whole vector stores");
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(U)) * N / 16; ++i) {
      int4 raw;
      memcpy(&raw, reinterpret_cast<const char*>(&v[0]) + 16 * i, 16);
      reinterpret_cast<int4*>(p)[i] = raw;
    }
  }
}

// Per-thread state of one pass over a chunk: S slots of N consecutive elements; slot s of thread
// i starts at element (s * kThreads + i) * N, so a warp's loads of one slot are contiguous and
// the slots of one thread are constant offsets from its first. kFull: every slot is in range
// (all chunks of a tensor but its last), so neither loads nor adds need a bounds check.
template <typename T, int N, int S, bool kFull>
struct ChunkState {
  using A = acc_type<T>;
  static constexpr int kStride = kThreads * N;  // elements from one slot to the next
  int lane;                                     // threadIdx.x * N
  bool valid[S];
  A acc[S][N];
  A base[S][N];  // the base in A (zero when unused)

  __device__ __forceinline__ bool in_range(int s) const { return kFull || valid[s]; }
};

// acc += w_k * (x_k - [delta] b) for G clients of the staged batch, starting at index j. All G
// clients' loads are issued before the first is added, and the additions keep client order.
template <int G, typename T, int N, int S, bool kFull>
__device__ __forceinline__ void accumulate_clients(
    ChunkState<T, N, S, kFull>& st, const T* const* src, const acc_type<T>* w, int j,
    const WeightedSumMath& math) {
  using A = acc_type<T>;
  T x[G][S][N];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* p = src[j + g] + st.lane;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if (st.in_range(s)) {
        load_update<T, N>(p + s * st.kStride, x[g][s]);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) x[g][s][e] = T(0);  // out of range: add 0, never stored
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const A wg = w[j + g];
#pragma unroll
    for (int s = 0; s < S; ++s) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        st.acc[s][e] =
            math.accumulate(st.acc[s][e], wg, static_cast<A>(x[g][s][e]), st.base[s][e]);
      }
    }
  }
}

// One pass over elements [begin, begin + len) of tensor t (len <= kThreads * N * S): every
// client, then the finish and one store per element.
template <typename T, typename U, bool kHasBase, bool kDelta, int N, int S, int kUnroll, bool kFull>
__device__ __forceinline__ void weighted_sum_pass(
    const Meta<acc_type<T>>& m, int64_t t, int64_t begin, int len, const T** s_src,
    acc_type<T>* s_w) {
  using A = acc_type<T>;
  const WeightedSumMath math{kHasBase, kDelta};
  const int tid = threadIdx.x;
  const int64_t K = m.num_clients;
  const int64_t n = m.num_tensors;

  ChunkState<T, N, S, kFull> st;
  st.lane = tid * N;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    st.valid[s] = st.lane + s * st.kStride < len;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      st.acc[s][e] = A(0);
      st.base[s][e] = A(0);
    }
  }
  const U* base = kHasBase ? reinterpret_cast<const U*>(m.bases[t]) + begin + st.lane : nullptr;
  U* out = reinterpret_cast<U*>(m.outs[t]) + begin + st.lane;

  auto read_base = [&]() {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if (st.in_range(s)) {
        U b[N];
        load_base<U, N>(base + s * st.kStride, b);
#pragma unroll
        for (int e = 0; e < N; ++e) st.base[s][e] = static_cast<A>(b[e]);
      }
    }
  };
  if constexpr (kDelta) read_base();

  // Clients are staged kThreads at a time: one thread fetches each client's pointer and weight
  // into shared memory, so the loop below never waits on a pointer load.
  for (int64_t k0 = 0; k0 < K; k0 += kThreads) {
    const int batch = static_cast<int>(K - k0 < kThreads ? K - k0 : kThreads);
    __syncthreads();  // the previous batch (or pass) is done with the staging area
    if (tid < batch) {
      s_src[tid] = reinterpret_cast<const T*>(m.inputs[(k0 + tid) * n + t]) + begin;
      s_w[tid] = m.weights[k0 + tid];
    }
    __syncthreads();
    // No further unrolling: the group size already sets the loads in flight, and more would
    // only cost registers.
    int j = 0;
#pragma unroll 1
    for (; j + kUnroll <= batch; j += kUnroll) {
      accumulate_clients<kUnroll>(st, s_src, s_w, j, math);
    }
#pragma unroll 1
    for (; j < batch; ++j) accumulate_clients<1>(st, s_src, s_w, j, math);
  }

  if constexpr (kHasBase && !kDelta) read_base();
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (st.in_range(s)) {
      U y[N];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        y[e] = static_cast<U>(math.finish(st.acc[s][e], m.scale, st.base[s][e]));
      }
      store_out<U, N>(out + s * st.kStride, y);
    }
  }
}

// Elements [begin, begin + len) of tensor t in passes of kThreads * N * S elements.
template <typename T, typename U, bool kHasBase, bool kDelta, int N, int S, int kUnroll>
__device__ __forceinline__ void weighted_sum_chunk(
    const Meta<acc_type<T>>& m, int64_t t, int64_t begin, int len, const T** s_src,
    acc_type<T>* s_w) {
  constexpr int kPass = kThreads * N * S;
  static_assert(kChunk<T> % kPass == 0, "a whole number of passes per chunk");
  for (int done = 0; done < len; done += kPass) {
    if (len - done >= kPass) {
      weighted_sum_pass<T, U, kHasBase, kDelta, N, S, kUnroll, true>(
          m, t, begin + done, kPass, s_src, s_w);
    } else {
      weighted_sum_pass<T, U, kHasBase, kDelta, N, S, kUnroll, false>(
          m, t, begin + done, len - done, s_src, s_w);
    }
  }
}

template <typename T, typename U, bool kHasBase, bool kDelta>
__global__ void __launch_bounds__(kThreads, 2) weighted_sum_kernel(const Meta<acc_type<T>> m) {
  using A = acc_type<T>;
  __shared__ const T* s_src[kThreads];
  __shared__ A s_w[kThreads];
  for (int64_t c = blockIdx.x; c < m.total_chunks; c += gridDim.x) {
    const int64_t t = tensor_of_chunk(m.chunk_prefix, m.num_tensors, c);
    const int64_t begin = (c - m.chunk_prefix[t]) * kChunk<T>;
    const int64_t rest = m.numels[t] - begin;
    const int len = static_cast<int>(rest < kChunk<T> ? rest : kChunk<T>);
    if (m.vectorizable[t]) {
      weighted_sum_chunk<T, U, kHasBase, kDelta, kVec<T>, kSlots, kUnrollVector>(
          m, t, begin, len, s_src, s_w);
    } else {
      // Element by element (an unaligned pointer, or numel % kVec != 0), in passes of
      // kThreads * kScalarSlots elements, each a full pass over the clients.
      weighted_sum_chunk<T, U, kHasBase, kDelta, 1, kScalarSlots<T>, kUnrollScalar>(
          m, t, begin, len, s_src, s_w);
    }
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

struct WeightedSumCuda {
  template <typename T, typename U>
  static void run(const WeightedSumPlan& p) {
    using A = acc_type<T>;
    const int64_t K = p.num_clients;
    const int64_t n = p.num_tensors();
    const bool has_base = !p.bases.empty();
    const bool weights_on_host = p.weights.device().is_cpu();
    const CudaLaunch launch(p.device);

    MetadataLayout layout;
    const size_t inputs_at = layout.add<uint64_t>(K * n);
    const size_t bases_at = layout.add<uint64_t>(has_base ? n : 0);
    const size_t outs_at = layout.add<uint64_t>(n);
    const size_t numels_at = layout.add<int64_t>(n);
    const size_t prefix_at = layout.add<int64_t>(n + 1);
    const size_t flags_at = layout.add<uint8_t>(n);
    const size_t weights_at = layout.add<A>(weights_on_host ? K : 0);
    LaunchMetadata meta(layout, p.device);
    auto* h_inputs = meta.host<uint64_t>(inputs_at);
    auto* h_bases = meta.host<uint64_t>(bases_at);
    auto* h_outs = meta.host<uint64_t>(outs_at);
    auto* h_numels = meta.host<int64_t>(numels_at);
    auto* h_prefix = meta.host<int64_t>(prefix_at);
    auto* h_flags = meta.host<uint8_t>(flags_at);

    std::vector<bool> vectorizable(n);
    for (int64_t i = 0; i < n; ++i) {
      const void* out = p.outs[i];
      bool ok = p.numels[i] % kVec<T> == 0 && aligned16(out);
      h_outs[i] = reinterpret_cast<uint64_t>(out);
      if (has_base) {
        ok = ok && aligned16(p.bases[i]);
        h_bases[i] = reinterpret_cast<uint64_t>(p.bases[i]);
      }
      vectorizable[i] = ok;
    }
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t i = 0; i < n; ++i) {
        const void* x = p.inputs[k * n + i];
        h_inputs[k * n + i] = reinterpret_cast<uint64_t>(x);
        if (!aligned16(x)) vectorizable[i] = false;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      h_numels[i] = p.numels[i];
      h_flags[i] = vectorizable[i] ? 1 : 0;
    }
    const int64_t total_chunks = fill_chunk_prefix(h_numels, n, kChunk<T>, h_prefix);
    at::Tensor device_weights;  // keeps converted on-device weights alive until after the launch
    if (weights_on_host) {
      const double* w = p.weights.const_data_ptr<double>();
      A* h_weights = meta.host<A>(weights_at);
      for (int64_t k = 0; k < K; ++k) h_weights[k] = static_cast<A>(w[k]);
    } else {
      device_weights = p.weights.to(c10::CppTypeToScalarType<A>::value).contiguous();
    }
    meta.upload(launch.stream);

    Meta<A> m;
    m.inputs = meta.device<uint64_t>(inputs_at);
    m.bases = has_base ? meta.device<uint64_t>(bases_at) : nullptr;
    m.outs = meta.device<uint64_t>(outs_at);
    m.numels = meta.device<int64_t>(numels_at);
    m.chunk_prefix = meta.device<int64_t>(prefix_at);
    m.vectorizable = meta.device<uint8_t>(flags_at);
    m.weights = weights_on_host ? meta.device<A>(weights_at) : device_weights.const_data_ptr<A>();
    m.num_clients = K;
    m.num_tensors = n;
    m.total_chunks = total_chunks;
    m.scale = static_cast<A>(p.scale);

    const dim3 grid(grid_size(total_chunks, 1, std::numeric_limits<int32_t>::max()));
    if (!has_base) {  // delta without a base is the plain sum (as on the CPU)
      weighted_sum_kernel<T, U, false, false><<<grid, kThreads, 0, launch.stream>>>(m);
    } else if (p.delta) {
      weighted_sum_kernel<T, U, true, true><<<grid, kThreads, 0, launch.stream>>>(m);
    } else {
      weighted_sum_kernel<T, U, true, false><<<grid, kThreads, 0, launch.stream>>>(m);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_weighted_sum<WeightedSumCuda>(m);
}

}  // namespace fedkernels
