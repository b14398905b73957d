// CUDA kernels of the sparse-update op (schemas: csrc/ops.cpp; host side: csrc/sparse_host.h;
// per-element math: SparseMath in csrc/elementwise.h).
//
// check: one thread per entry compares its index with the range and with the entry before it;
// a bad list lowers a device word to its number with an integer atomicMin (the smallest bad
// list, whatever the thread order), which the host reads before anything is written: one
// synchronization per call, the price of refusing bad indices rather than writing out of
// bounds.
// sum: one thread block per chunk of kChunk output elements, accumulated in shared memory in
// the accumulate type: base (or 0), then client 0's entries in the chunk, a barrier, client
// 1's, ... The indices of one client's list are distinct, so within a client no two threads
// touch one element, and the barriers order the clients: each element's sum is
// base + w_0 v_0 + w_1 v_1 + ... in client order, the CPU's bits, with no float atomics.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../elementwise.h"
#include "../sparse_host.h"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 2048;  // output elements per thread block (8 KiB of float sums)
constexpr int64_t kMaxBlocks = 65535LL * 32;

// The index of the range [prefix[i], prefix[i + 1]) holding c, for prefix[0] = 0 <= c <
// prefix[n].
__device__ __forceinline__ int64_t range_of(const int64_t* prefix, int64_t n, int64_t c) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// First position of idx[0, n) holding a value >= x (idx sorted).
template <typename I>
__device__ __forceinline__ int64_t lower_bound_of(const I* idx, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(idx[mid]) < x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

at::Tensor upload(const std::vector<int64_t>& words, at::Device device) {
  at::Tensor host = at::empty({static_cast<int64_t>(words.size())}, at::kLong);
  std::copy(words.begin(), words.end(), host.mutable_data_ptr<int64_t>());
  return host.to(device);
}

inline int64_t ptr_word(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

inline unsigned grid_for(int64_t items, int64_t per_block) {
  const int64_t g = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > kMaxBlocks ? kMaxBlocks : g));
}

// Check table of n = K T lists: indices[n], nnz[n], numel of the list's tensor[n], then the
// n + 1 entry prefixes.
template <typename I>
__global__ void __launch_bounds__(kThreads) check_kernel(const int64_t* w, int64_t n,
                                                         unsigned long long* first_bad) {
  const int64_t* prefix = w + 3 * n;
  const int64_t entries = prefix[n];
  for (int64_t g = int64_t(blockIdx.x) * kThreads + threadIdx.x; g < entries;
       g += int64_t(gridDim.x) * kThreads) {
    const int64_t i = range_of(prefix, n, g);
    const int64_t j = g - prefix[i];
    const I* idx = reinterpret_cast<const I*>(w[i]);
    const int64_t v = static_cast<int64_t>(idx[j]);
    const bool bad = v < 0 || v >= w[2 * n + i] || (j > 0 && v <= static_cast<int64_t>(idx[j - 1]));
    if (bad) atomicMin(first_bad, static_cast<unsigned long long>(i));
  }
}

// Sum table: base[T] (0: zeros), outs[T], numels[T], the T + 1 chunk prefixes, indices[K T],
// values[K T], nnz[K T], then the K weights as float64 words.
struct SparseTable {
  const int64_t* w;
  int64_t K, T;
  __device__ const void* base(int64_t t) const { return reinterpret_cast<const void*>(w[t]); }
  __device__ void* out(int64_t t) const { return reinterpret_cast<void*>(w[T + t]); }
  __device__ int64_t numel(int64_t t) const { return w[2 * T + t]; }
  __device__ const int64_t* prefix() const { return w + 3 * T; }
  __device__ const void* idx(int64_t i) const {
    return reinterpret_cast<const void*>(w[4 * T + 1 + i]);
  }
  __device__ const void* val(int64_t i) const {
    return reinterpret_cast<const void*>(w[4 * T + 1 + K * T + i]);
  }
  __device__ int64_t nnz(int64_t i) const { return w[4 * T + 1 + 2 * K * T + i]; }
  __device__ double weight(int64_t k) const {
    return reinterpret_cast<const double*>(w + 4 * T + 1 + 3 * K * T)[k];
  }
};

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) sum_kernel(SparseTable m) {
  using A = acc_type<T>;
  __shared__ A acc[kChunk];
  const int64_t chunks = m.prefix()[m.T];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t t = range_of(m.prefix(), m.T, c);
    const int64_t begin = (c - m.prefix()[t]) * kChunk;
    const int64_t end = begin + kChunk < m.numel(t) ? begin + kChunk : m.numel(t);
    const T* base = static_cast<const T*>(m.base(t));
    for (int64_t e = begin + threadIdx.x; e < end; e += kThreads) {
      acc[e - begin] = base != nullptr ? static_cast<A>(base[e]) : A(0);
    }
    __syncthreads();
    for (int64_t k = 0; k < m.K; ++k) {
      const int64_t i = k * m.T + t;
      const I* idx = static_cast<const I*>(m.idx(i));
      const T* val = static_cast<const T*>(m.val(i));
      const int64_t lo = lower_bound_of(idx, m.nnz(i), begin);
      const int64_t hi = lower_bound_of(idx, m.nnz(i), end);
      const A wk = static_cast<A>(m.weight(k));
      for (int64_t j = lo + threadIdx.x; j < hi; j += kThreads) {
        const int64_t e = static_cast<int64_t>(idx[j]) - begin;
        acc[e] = SparseMath::add(acc[e], wk, static_cast<A>(val[j]));
      }
      __syncthreads();
    }
    T* out = static_cast<T*>(m.out(t));
    for (int64_t e = begin + threadIdx.x; e < end; e += kThreads) {
      out[e] = static_cast<T>(acc[e - begin]);
    }
    __syncthreads();  // the next chunk reuses acc
  }
}

struct SparseCuda {
  template <typename I>
  static int64_t check(const SparseSumList& l) {
    const c10::cuda::CUDAGuard guard(l.device);
    const int64_t n = l.K * l.T;
    std::vector<int64_t> words;
    words.reserve(4 * n + 1);
    for (int64_t i = 0; i < n; ++i) words.push_back(ptr_word(l.indices[i]));
    for (int64_t i = 0; i < n; ++i) words.push_back(l.nnz[i]);
    for (int64_t i = 0; i < n; ++i) words.push_back(l.numels[i % l.T]);
    int64_t entries = 0;
    words.push_back(0);
    for (int64_t i = 0; i < n; ++i) {
      entries += l.nnz[i];
      words.push_back(entries);
    }
    if (entries == 0) return -1;
    const at::Tensor table = upload(words, l.device);
    const at::Tensor flag = at::full({1}, std::numeric_limits<int64_t>::max(),
                                     at::TensorOptions().dtype(at::kLong).device(l.device));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    check_kernel<I><<<grid_for(entries, kThreads), kThreads, 0, stream>>>(
        table.const_data_ptr<int64_t>(), n,
        reinterpret_cast<unsigned long long*>(flag.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t first = flag.cpu().const_data_ptr<int64_t>()[0];
    return first == std::numeric_limits<int64_t>::max() ? -1 : first;
  }

  template <typename T, typename I>
  static void sum(SparseSumList& l) {
    const c10::cuda::CUDAGuard guard(l.device);
    const int64_t K = l.K, T_ = l.T;
    std::vector<int64_t> words;
    for (int64_t t = 0; t < T_; ++t) words.push_back(l.base.empty() ? 0 : ptr_word(l.base[t]));
    for (int64_t t = 0; t < T_; ++t) words.push_back(ptr_word(l.outs[t]));
    for (int64_t t = 0; t < T_; ++t) words.push_back(l.numels[t]);
    int64_t chunks = 0;
    words.push_back(0);
    for (int64_t t = 0; t < T_; ++t) {
      chunks += (l.numels[t] + kChunk - 1) / kChunk;
      words.push_back(chunks);
    }
    for (int64_t i = 0; i < K * T_; ++i) words.push_back(ptr_word(l.indices[i]));
    for (int64_t i = 0; i < K * T_; ++i) words.push_back(ptr_word(l.values[i]));
    for (int64_t i = 0; i < K * T_; ++i) words.push_back(l.nnz[i]);
    for (int64_t k = 0; k < K; ++k) {
      int64_t word;
      static_assert(sizeof(word) == sizeof(double));
      std::memcpy(&word, &l.weights[k], sizeof word);
      words.push_back(word);
    }
    const at::Tensor table = upload(words, l.device);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    sum_kernel<T, I><<<grid_for(chunks, 1), kThreads, 0, stream>>>(
        SparseTable{table.const_data_ptr<int64_t>(), K, T_});
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_sparse<SparseCuda>(m);
}

}  // namespace fedkernels
