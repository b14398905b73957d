// CPU kernels of the robust-aggregation ops (schemas: csrc/ops.cpp; host side:
// csrc/robust_host.h; per-coordinate rules: csrc/order_stats.h, shared with the CUDA kernels).
//
// Order statistics: chunks of every tensor are the parallel unit. A chunk takes its
// coordinates a vector width at a time: the K client values of those coordinates are gathered,
// sorted by a branch-free network of vector min/max and reduced; a group with a NaN takes the
// scalar rule of csrc/order_stats.h (NaN last), which gives the same values for numbers. No
// [K, P] stack is built: each client is read once, in place.
//
// Distances: fixed chunks of kDistChunk elements are the work items; a chunk converts its K
// slices to float64 a block at a time and adds sum_e (x_i[e] - x_j[e])^2 for every pair i < j
// to its own row of partial sums, which are added chunk by chunk in chunk order at the end, so
// the result is the same for any number of threads.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../order_stats.h"
#include "../robust_host.h"
#include "chunk_loop.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kRobustChunk = 4096;     // coordinates per work item
constexpr int64_t kDistChunk = 1 << 16;    // elements per distance work item (a partial row)
constexpr int64_t kDistBlock = 256;        // elements converted to float64 at a time

// Sorts W coordinates at once: v[k] holds client k's values of the W coordinates (no NaN).
// Odd-even transposition sort with vector min/max: branch-free, and for numbers it leaves
// exactly the sorted values the scalar insertion sort gives.
template <typename A>
void sort_columns(Vectorized<A>* v, int64_t K) {
  for (int64_t pass = 0; pass < K; ++pass) {
    for (int64_t i = pass & 1; i + 1 < K; i += 2) {
      const Vectorized<A> lo = at::vec::minimum(v[i], v[i + 1]);
      v[i + 1] = at::vec::maximum(v[i], v[i + 1]);
      v[i] = lo;
    }
  }
}

struct RobustCpu {
  template <typename T>
  static void robust(ClientListPlan& p) {
    using A = acc_type<T>;
    using Vec = Vectorized<A>;
    constexpr int64_t W = Vec::size();
    const int64_t K = p.K, n = p.num_tensors();
    const int64_t bytes = (K + 1) * total_numel(p.numels) * int64_t(sizeof(T));
    for_each_chunk(p.numels, kRobustChunk, bytes, [&](int64_t, const ChunkRange& r) {
      std::vector<A> v(K), lanes(K * W);
      std::vector<Vec> cols(K);
      std::vector<const T*> x(K);
      for (int64_t k = 0; k < K; ++k) x[k] = static_cast<const T*>(p.inputs[k * n + r.tensor]);
      T* out = static_cast<T*>(p.outs[r.tensor]);
      auto scalar = [&](int64_t e) {
        for (int64_t k = 0; k < K; ++k) v[k] = static_cast<A>(x[k][e]);
        out[e] = static_cast<T>(OrderStats::reduce<A>(v.data(), K, p.rule, p.param));
      };
      int64_t e = r.begin;
      for (; e + W <= r.end; e += W) {
        bool has_nan = false;
        for (int64_t k = 0; k < K; ++k) {
          A* row = lanes.data() + k * W;
          for (int64_t l = 0; l < W; ++l) {
            row[l] = static_cast<A>(x[k][e + l]);
            has_nan |= OrderStats::is_nan(row[l]);
          }
          cols[k] = Vec::loadu(row);
        }
        if (has_nan) {  // NaN sorts last: the scalar rule handles it
          for (int64_t l = 0; l < W; ++l) scalar(e + l);
          continue;
        }
        sort_columns(cols.data(), K);
        A res[W];
        if (p.rule == RobustRule::kMedianWindow) {
          for (int64_t k = 0; k < K; ++k) cols[k].store(lanes.data() + k * W);
          for (int64_t l = 0; l < W; ++l) {
            for (int64_t k = 0; k < K; ++k) v[k] = lanes[k * W + l];
            res[l] = OrderStats::reduce_sorted<A>(v.data(), K, K, p.rule, p.param);
          }
        } else {
          // the same operations, in the same order, as OrderStats::reduce_sorted
          const int64_t lo = p.rule == RobustRule::kMedian ? (K - 1) / 2 : p.param;
          const int64_t hi = p.rule == RobustRule::kMedian ? K / 2 + 1 : K - p.param;
          Vec sum = cols[lo];
          for (int64_t k = lo + 1; k < hi; ++k) sum = sum + cols[k];
          (sum / Vec(static_cast<A>(hi - lo))).store(res);
        }
        for (int64_t l = 0; l < W; ++l) out[e + l] = static_cast<T>(res[l]);
      }
      for (; e < r.end; ++e) scalar(e);
    });
  }

  template <typename T>
  static void distances(ClientListPlan& p) {
    using Vec = Vectorized<double>;
    const int64_t K = p.K, n = p.num_tensors();
    const int64_t pairs = K * (K - 1) / 2;
    std::vector<int64_t> prefix(n + 1);
    const int64_t chunks = fill_chunk_prefix(p.numels.data(), n, kDistChunk, prefix.data());
    std::vector<double> partial(static_cast<size_t>(chunks * pairs), 0.0);
    const int64_t bytes = K * total_numel(p.numels) * int64_t(sizeof(T));
    for_each_chunk(p.numels, kDistChunk, bytes, [&](int64_t c, const ChunkRange& r) {
      double* row = partial.data() + c * pairs;
      std::vector<double> buf(static_cast<size_t>(K * kDistBlock));
      for (int64_t b0 = r.begin; b0 < r.end; b0 += kDistBlock) {
        const int64_t len = std::min(kDistBlock, r.end - b0);
        for (int64_t k = 0; k < K; ++k) {
          const T* x = static_cast<const T*>(p.inputs[k * n + r.tensor]) + b0;
          double* d = buf.data() + k * kDistBlock;
          for (int64_t e = 0; e < len; ++e) d[e] = static_cast<double>(x[e]);
        }
        int64_t q = 0;
        for (int64_t i = 0; i < K; ++i) {
          const double* xi = buf.data() + i * kDistBlock;
          for (int64_t j = i + 1; j < K; ++j, ++q) {
            const double* xj = buf.data() + j * kDistBlock;
            Vec acc(0.0);
            int64_t e = 0;
            for (; e + Vec::size() <= len; e += Vec::size()) {
              const Vec diff = Vec::loadu(xi + e) - Vec::loadu(xj + e);
              acc = acc + diff * diff;
            }
            double lanes[Vec::size()];
            acc.store(lanes);
            double s = 0.0;
            for (int64_t l = 0; l < Vec::size(); ++l) s += lanes[l];
            for (; e < len; ++e) s += (xi[e] - xj[e]) * (xi[e] - xj[e]);
            row[q] += s;
          }
        }
      }
    });
    double* d = p.sums.mutable_data_ptr<double>();
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t q = 0;
      for (int64_t i = 0; i < K; ++i) {
        for (int64_t j = i + 1; j < K; ++j, ++q) d[i * K + j] += partial[c * pairs + q];
      }
    }
    for (int64_t i = 0; i < K; ++i) {
      for (int64_t j = i + 1; j < K; ++j) d[j * K + i] = d[i * K + j];
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_robust<RobustCpu>(m);
}

}  // namespace fedkernels
