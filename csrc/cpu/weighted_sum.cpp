// CPU kernel of fedkernels::weighted_sum. This file is compiled once per instruction set
// (CPU_CAPABILITY = DEFAULT, AVX2, AVX512), each into a library of its own; fedkernels loads
// the best one the CPU supports, so no build ever runs instructions the CPU lacks.
//
// Work: the tensors are cut into chunks (the parallel unit); a chunk is walked in tiles whose
// fp32 accumulators stay in L1 (csrc/cpu/client_tiles.h), so every input element is read from
// memory exactly once and every output element written once: (K + 1) * P element traffic
// (K + 2 with a separate base).
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../elementwise.h"
#include "../weighted_sum_host.h"
#include "chunk_loop.h"
#include "client_tiles.h"
#include "output_pool.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;
using client_tiles::TileArgs;
using client_tiles::accumulate_tile;
using client_tiles::kTile;

constexpr int64_t kChunk = 65536;  // the most elements per parallel work item (balanced_chunk)

template <typename T, typename U>
void weighted_sum_tile(const TileArgs<T, U>& a, const WeightedSumMath& math, acc_type<T> scale) {
  using A = acc_type<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  if (a.num_clients == 1) {
    // One client (e.g. b += w x in place): one pass, the same arithmetic as the tile below.
    const int64_t vec_len = a.len - a.len % step;
    const Vec w(a.weights[0]), scale_v(scale), zero(A(0));
    for (int64_t j = 0; j < vec_len; j += step) {
      Vec b_lo(A(0)), b_hi(A(0)), x_lo, x_hi;
      if (math.has_base) load2<U, A>(a.base + j, b_lo, b_hi);
      load2<T, A>(a.src[0] + j, x_lo, x_hi);
      const Vec lo = math.finish(math.accumulate(zero, w, x_lo, b_lo), scale_v, b_lo);
      const Vec hi = math.finish(math.accumulate(zero, w, x_hi, b_hi), scale_v, b_hi);
      store2<U, A>(a.out + j, lo, hi);
    }
    for (int64_t j = vec_len; j < a.len; ++j) {
      const A b = math.has_base ? static_cast<A>(a.base[j]) : A(0);
      const A acc = math.accumulate(A(0), a.weights[0], static_cast<A>(a.src[0][j]), b);
      a.out[j] = static_cast<U>(math.finish(acc, scale, b));
    }
    return;
  }
  alignas(64) A acc[kTile];
  accumulate_tile(a, math, acc);
  const int64_t vec_len = a.len - a.len % step;
  const Vec scale_v(scale);
  for (int64_t j = 0; j < vec_len; j += step) {
    Vec b_lo(A(0)), b_hi(A(0));
    if (math.has_base) load2<U, A>(a.base + j, b_lo, b_hi);
    const Vec lo = math.finish(Vec::loadu(acc + j), scale_v, b_lo);
    const Vec hi = math.finish(Vec::loadu(acc + j + Vec::size()), scale_v, b_hi);
    store2<U, A>(a.out + j, lo, hi);
  }
  for (int64_t j = vec_len; j < a.len; ++j) {
    const A b = math.has_base ? static_cast<A>(a.base[j]) : A(0);
    a.out[j] = static_cast<U>(math.finish(acc[j], scale, b));
  }
}

struct WeightedSumCpu {
  // Fresh results from the output pool: a server's next round reuses the faulted-in pages of
  // the global model it dropped.
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    return pooled_empty(sizes, options);
  }

  template <typename T, typename U>
  static void run(const WeightedSumPlan& p) {
    using A = acc_type<T>;
    const int64_t K = p.num_clients;
    const int64_t n = p.num_tensors();
    std::vector<A> weights(K);
    const double* w = p.weights.const_data_ptr<double>();
    for (int64_t k = 0; k < K; ++k) weights[k] = static_cast<A>(w[k]);
    const WeightedSumMath math{!p.bases.empty(), p.delta};
    const A scale = static_cast<A>(p.scale);
    const int64_t bytes = total_numel(p.numels) *
        (K * int64_t(sizeof(T)) + int64_t(sizeof(U)) * (p.bases.empty() ? 1 : 2));
    const int64_t chunk = balanced_chunk(total_numel(p.numels), kChunk, kTile);
    for_each_chunk(p.numels, chunk, bytes, PassCost::kStreaming, [&](int64_t, const ChunkRange& r) {
      thread_local std::vector<const T*> src;  // reused: chunks of small tensors are many
      src.resize(K);
      for (int64_t off = r.begin; off < r.end; off += kTile) {
        for (int64_t k = 0; k < K; ++k) {
          src[k] = static_cast<const T*>(p.inputs[k * n + r.tensor]) + off;
        }
        TileArgs<T, U> a{
            src.data(),
            math.has_base ? static_cast<const U*>(p.bases[r.tensor]) + off : nullptr,
            static_cast<U*>(p.outs[r.tensor]) + off,
            weights.data(),
            K,
            std::min(kTile, r.end - off)};
        weighted_sum_tile<T, U>(a, math, scale);
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_weighted_sum<WeightedSumCpu>(m);
}

}  // namespace fedkernels
