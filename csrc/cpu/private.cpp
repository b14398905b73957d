// CPU kernels of the differential-privacy ops (schemas: csrc/ops.cpp; host side:
// csrc/private_host.h).
//
// update_norms: fixed chunks are the work items; each adds sum_e (x_k[e] - b[e])^2 in float64
// for every client to its own row of partial sums, added in chunk order at the end (the result
// does not depend on the number of threads).
// private_sum: chunks of every tensor are the work items, walked in tiles as weighted_sum's
// (csrc/cpu/client_tiles.h): a tile's accumulators take the K scaled updates in client order,
// then one pass adds base and the noise. The noise key is one random64 of the CPU generator per
// call (as sgld_step draws it), so a seeded torch.Generator reproduces a call and element e gets
// the same normal as element e of sgld_step's noise.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

#include "../elementwise.h"
#include "../private_host.h"
#include "chunk_loop.h"
#include "client_tiles.h"
#include "normal_lanes.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;
using client_tiles::TileArgs;
using client_tiles::accumulate_tile;
using client_tiles::kTile;

constexpr int64_t kNormChunk = 1 << 16;  // the most elements per norm work item
constexpr int kNormLanes = 16;
constexpr int64_t kSumChunk = 1 << 14;  // the most elements per sum work item (balanced_chunk)

struct PrivateCpu {
  using Key = uint64_t;

  static Key draw_key(const ClientListPlan& p) {
    if (p.noise_std == 0) return 0;
    auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
        p.generator, at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    return gen->random64();
  }

  template <typename T>
  static void norms(ClientListPlan& p) {
    const int64_t K = p.K, n = p.num_tensors();
    std::vector<int64_t> prefix(n + 1);
    // Chunks sized from the model (balanced_chunk), so two threads share a small one; about
    // 16, not 32, because a chunk restarts every client's stream.
    const int64_t chunk = balanced_chunk(total_numel(p.numels), kNormChunk, kTile, 16);
    const int64_t chunks = fill_chunk_prefix(p.numels.data(), n, chunk, prefix.data());
    std::vector<double> partial(static_cast<size_t>(chunks * K), 0.0);
    const int64_t bytes = (K + 1) * total_numel(p.numels) * int64_t(sizeof(T));
    for_each_chunk(p.numels, chunk, bytes, PassCost::kArithmetic, [&](int64_t c, const ChunkRange& r) {
      const T* b = static_cast<const T*>(p.bases[r.tensor]);
      for (int64_t k = 0; k < K; ++k) {
        const T* x = static_cast<const T*>(p.inputs[k * n + r.tensor]);
        // kNormLanes interleaved sums (element e adds to sum e % kNormLanes of its chunk),
        // added pairwise at the end: a fixed order in every build, and a loop the compiler
        // turns into vector code (with fewer sums it stays scalar).
        double s[kNormLanes] = {};
        int64_t e = r.begin;
        for (; e + kNormLanes <= r.end; e += kNormLanes) {
          for (int l = 0; l < kNormLanes; ++l) {
            const double d = static_cast<double>(x[e + l]) - static_cast<double>(b[e + l]);
            s[l] += d * d;
          }
        }
        for (; e < r.end; ++e) {
          const double d = static_cast<double>(x[e]) - static_cast<double>(b[e]);
          s[e % kNormLanes] += d * d;
        }
        for (int h = kNormLanes / 2; h > 0; h /= 2) {
          for (int l = 0; l < h; ++l) s[l] += s[l + h];
        }
        partial[c * K + k] = s[0];
      }
    });
    double* out = p.sums.mutable_data_ptr<double>();
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t k = 0; k < K; ++k) out[k] += partial[c * K + k];
    }
  }

  template <typename T>
  static void private_sum(ClientListPlan& p, Key seed) {
    using A = acc_type<T>;
    using Vec = Vectorized<A>;
    constexpr int64_t W = Vec::size();
    const int64_t K = p.K, n = p.num_tensors();
    const double* c = p.coefficients.const_data_ptr<double>();
    std::vector<A> coef(K);
    for (int64_t k = 0; k < K; ++k) coef[k] = static_cast<A>(c[k]);
    const A std_ = static_cast<A>(p.noise_std);
    const bool noise = p.noise_std != 0;
    const WeightedSumMath math{true, true};  // acc + c_k * (x_k - base), in client order
    const int64_t bytes = (K + 2) * total_numel(p.numels) * int64_t(sizeof(T));
    // Chunks that split evenly between the threads (split_for_threads). Element e takes normal
    // e of the stream whatever the chunks.
    const int64_t chunk = split_for_threads(kSumChunk, total_numel(p.numels), kTile, bytes,
                                            PassCost::kArithmetic);
    for_each_chunk(p.numels, chunk, bytes, PassCost::kArithmetic, [&](int64_t, const ChunkRange& r) {
      thread_local std::vector<const T*> src;  // reused: chunks of small tensors are many
      src.resize(K);
      alignas(64) A acc[kTile];
      alignas(64) A eps[kTile + 8];  // the tile's Philox groups, 3 elements of slack each side
      const T* b = static_cast<const T*>(p.bases[r.tensor]);
      T* out = static_cast<T*>(p.outs[r.tensor]);
      for (int64_t off = r.begin; off < r.end; off += kTile) {
        const int64_t len = std::min(kTile, r.end - off);
        for (int64_t k = 0; k < K; ++k) src[k] = static_cast<const T*>(p.inputs[k * n + r.tensor]) + off;
        accumulate_tile(TileArgs<T, T>{src.data(), b + off, nullptr, coef.data(), K, len}, math, acc);
        // out = base + acc (+ std * eps): element e of the model takes normal e of the stream.
        const A* e = nullptr;
        if (noise) {
          const int64_t first = p.offsets[r.tensor] + off;
          const int64_t g0 = first / 4, g1 = (first + len + 3) / 4;
          draw_normals<A>(seed, g0, g1, eps);
          e = eps + (first - 4 * g0);
        }
        const Vec sv(std_);
        int64_t j = 0;
        for (; j + 2 * W <= len; j += 2 * W) {
          Vec b_lo, b_hi;
          load2<T, A>(b + off + j, b_lo, b_hi);
          Vec lo = b_lo + Vec::loadu(acc + j), hi = b_hi + Vec::loadu(acc + j + W);
          if (e) {
            lo = lo + sv * Vec::loadu(e + j);
            hi = hi + sv * Vec::loadu(e + j + W);
          }
          store2<T, A>(out + off + j, lo, hi);
        }
        for (; j < len; ++j) {
          const A v = static_cast<A>(b[off + j]) + acc[j];
          out[off + j] = static_cast<T>(e ? v + std_ * e[j] : v);
        }
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_private<PrivateCpu>(m);
}

}  // namespace fedkernels
