// CPU kernels of the sparse-update op (schemas: csrc/ops.cpp; host side: csrc/sparse_host.h;
// per-element math: SparseMath in csrc/elementwise.h).
//
// check: one work item per list, each read once in order; the first bad list is the smallest
// index flagged, whatever thread flagged it.
// sum: chunks of consecutive output elements are the work items. A chunk starts from base (or
// zeros) in the accumulate type, then adds client 0's entries that fall in it, then client 1's,
// ... (each list is sorted, so its entries of a chunk are one run found by binary search), and
// is written once. Each element's sum is therefore base + w_0 v_0 + w_1 v_1 + ... in client
// order whatever the chunks and threads: no element is written by two threads, no atomics.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../elementwise.h"
#include "../sparse_host.h"
#include "chunk_loop.h"
#include "output_pool.h"
#include "parallel.h"

namespace fedkernels {
namespace {

// Output elements per work item: its accumulators (at most 64 KiB in float) stay in L2 while
// the K clients' entries land in it at random.
constexpr int64_t kSparseChunk = 1 << 14;

struct SparseCpu {
  // Fresh sums from the output pool, as weighted_sum's: a server's next round reuses the
  // faulted-in pages of the model it dropped.
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    return pooled_empty(sizes, options);
  }

  template <typename I>
  static int64_t check(const SparseSumList& l) {
    const int64_t n = l.K * l.T;
    int64_t entries = 0;
    for (const auto c : l.nnz) entries += c;
    std::vector<char> bad(n, 0);
    parallel_for_bytes(0, n, 1, entries * int64_t(sizeof(I)), PassCost::kStreaming,
                       [&](int64_t i0, int64_t i1) {
                         for (int64_t i = i0; i < i1; ++i) {
                           bad[i] = first_bad_index(static_cast<const I*>(l.indices[i]), l.nnz[i],
                                                    l.numels[i % l.T]) >= 0;
                         }
                       });
    for (int64_t i = 0; i < n; ++i) {
      if (bad[i]) return i;
    }
    return -1;
  }

  template <typename T, typename I>
  static void sum(SparseSumList& l) {
    using A = acc_type<T>;
    const int64_t K = l.K, T_ = l.T;
    int64_t total = 0, entries = 0;
    for (const auto n : l.numels) total += n;
    for (const auto c : l.nnz) entries += c;
    const int64_t bytes = total * int64_t(sizeof(T)) * (l.base.empty() ? 1 : 2) +
        entries * int64_t(sizeof(I) + sizeof(T));
    std::vector<A> w(K);
    for (int64_t k = 0; k < K; ++k) w[k] = static_cast<A>(l.weights[k]);
    for_each_chunk(l.numels, kSparseChunk, bytes, PassCost::kStreaming,
                   [&](int64_t, const ChunkRange& r) {
      constexpr bool kDirect = std::is_same_v<T, A>;  // accumulate in the output itself
      thread_local std::vector<A> buf;
      const int64_t len = r.end - r.begin;
      T* out = static_cast<T*>(l.outs[r.tensor]) + r.begin;
      const T* base = l.base.empty() ? nullptr : static_cast<const T*>(l.base[r.tensor]) + r.begin;
      A* acc;
      if constexpr (kDirect) {
        acc = out;
        if (base == nullptr) {
          std::fill(acc, acc + len, A(0));
        } else if (base != out) {
          std::memcpy(acc, base, len * sizeof(T));
        }
      } else {
        buf.resize(len);
        acc = buf.data();
        for (int64_t e = 0; e < len; ++e) acc[e] = base ? static_cast<A>(base[e]) : A(0);
      }
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = k * T_ + r.tensor;
        const I* idx = static_cast<const I*>(l.indices[i]);
        const T* val = static_cast<const T*>(l.values[i]);
        const auto below = [](I a, int64_t b) { return static_cast<int64_t>(a) < b; };
        const I* lo = std::lower_bound(idx, idx + l.nnz[i], r.begin, below);
        const I* hi = std::lower_bound(lo, idx + l.nnz[i], r.end, below);
        const A wk = w[k];
        const int64_t first = lo - idx;
        for (int64_t j = first; j < hi - idx; ++j) {
          const int64_t e = static_cast<int64_t>(idx[j]) - r.begin;
          acc[e] = SparseMath::add(acc[e], wk, static_cast<A>(val[j]));
        }
      }
      if constexpr (!kDirect) {
        for (int64_t e = 0; e < len; ++e) out[e] = static_cast<T>(acc[e]);
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_sparse<SparseCpu>(m);
}

}  // namespace fedkernels
