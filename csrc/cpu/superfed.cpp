// CPU kernels of the SuPerFed ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/superfed_host.h; per-element math: SuperfedOp in csrc/elementwise.h). Like every
// csrc/cpu/*.cpp this file is compiled once per instruction set (see setup.py) into a library of
// its own.
//
// One loop serves every kind (the step's outputs are its inputs g, l and the buffers: each element
// is read before it is written): the plan's tensors are cut into chunks of at most kChunk elements
// and at least kMinChunk, whole tiles, sized from the model alone (balanced_chunk, so that the
// threads get even shares), the parallel unit, each walked in tiles of kTile elements, two vectors
// of the accumulate type at a time, through SuperfedOp<kind>::apply. The reductions (the lam
// gradient, the four statistics) are summed per tile in the accumulate type (fp32, fp64 for fp64
// inputs) in vector lanes, each tile's sum is added in float64 to its chunk's partial, and the
// partials are added per tensor in chunk order after the parallel loop: the result does not depend
// on the number of threads, and is bitwise the same run after run.
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../elementwise.h"
#include "../superfed_host.h"
#include "chunk_loop.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kTile = 2048;    // elements per fp32 partial sum
constexpr int64_t kChunk = 65536;  // the most elements per parallel work item (balanced_chunk)
// The fewest: smaller chunks only add their overhead. Not split_for_threads: the statistics'
// partials follow the chunks, and the same tensors must give the same statistics through every
// op, whatever its byte count.
constexpr int64_t kMinChunk = 8 * kTile;

// Adds each chunk's partials (width per chunk) into result[index[i] * width + j], in chunk order.
void combine_partials(const SuperfedPlan& p, const std::vector<double>& partials, int width,
                      int64_t chunk) {
  double* result = p.result.mutable_data_ptr<double>();
  int64_t c = 0;
  for (int64_t i = 0; i < p.num_tensors(); ++i) {
    double* row = result + p.index[i] * width;
    for (int64_t k = 0; k < chunks_of(p.numels[i], chunk); ++k, ++c) {
      for (int j = 0; j < width; ++j) row[j] += partials[c * width + j];
    }
  }
}

struct SuperfedCpu {
  template <typename T, SuperfedKind kKind>
  static void run(const SuperfedPlan& p) {
    using Op = SuperfedOp<kKind>;
    using A = acc_type<T>;
    using Vec = Vectorized<A>;
    constexpr int kSums = Op::kSums;
    constexpr int kIn = Op::kInputs, kOut = Op::kOutputs;
    constexpr int kWidth = kSums > 0 ? kSums : 1;  // arrays of at least one element
    constexpr int64_t step = 2 * Vec::size();
    const bool reduce = kSums > 0 && p.reduce;
    bool has[kIn], wants[kOut];
    for (int j = 0; j < kIn; ++j) has[j] = p.has_input(j);
    for (int j = 0; j < kOut; ++j) wants[j] = p.has_output(j);
    const double* lam = p.lam.defined() ? p.lam.const_data_ptr<double>() : nullptr;
    const double* h = p.h.defined() ? p.h.const_data_ptr<double>() : nullptr;
    int64_t chunks = 0;
    const int64_t chunk =
        std::max(kMinChunk, balanced_chunk(total_numel(p.numels), kChunk, kTile));
    for (const auto n : p.numels) chunks += chunks_of(n, chunk);
    std::vector<double> partials(reduce ? kSums * chunks : 0, 0.0);

    int64_t streams = 0;  // tensors read or written per element
    for (int j = 0; j < kIn; ++j) streams += has[j];
    for (int j = 0; j < kOut; ++j) streams += wants[j];
    const int64_t bytes = total_numel(p.numels) * streams * int64_t(sizeof(T));
    for_each_chunk(p.numels, chunk, bytes, PassCost::kStreaming, [&](int64_t c, const ChunkRange& r) {
      const T* in[kIn];
      T* out[kOut];
      for (int j = 0; j < kIn; ++j) {
        in[j] = has[j] ? static_cast<const T*>(p.in[j][r.tensor]) + r.begin : nullptr;
      }
      for (int j = 0; j < kOut; ++j) {
        out[j] = wants[j] ? static_cast<T*>(p.out[j][r.tensor]) + r.begin : nullptr;
      }
      const auto coef =
          SuperfedCoef<A>::load(lam, h, p.index[r.tensor], has[1], has[2]).with_sgd(p.sgd);
      const auto coef_v = coef.template as<Vec>();
      double sums[kWidth] = {};
      for (int64_t t0 = 0; t0 < r.end - r.begin; t0 += kTile) {
        const int64_t len = std::min(kTile, r.end - r.begin - t0);
        const int64_t vec_len = len - len % step;
        Vec acc[2][kWidth];
        for (auto& half : acc) std::fill(half, half + kWidth, Vec(A(0)));
        for (int64_t j = t0; j < t0 + vec_len; j += step) {
          Vec x[2][kIn], y[2][kOut];
          for (int i = 0; i < kIn; ++i) {
            if (in[i]) {
              load2<T, A>(in[i] + j, x[0][i], x[1][i]);
            } else {
              x[0][i] = x[1][i] = coef_v.zero;
            }
          }
          for (int half = 0; half < 2; ++half) {
            Op::apply(coef_v, has[1], has[2], reduce, x[half], y[half], acc[half]);
          }
          for (int o = 0; o < kOut; ++o) {
            if (out[o]) store2<T, A>(out[o] + j, y[0][o], y[1][o]);
          }
        }
        A tail[kWidth] = {};
        for (int64_t j = t0 + vec_len; j < t0 + len; ++j) {
          A x[kIn], y[kOut];
          for (int i = 0; i < kIn; ++i) x[i] = in[i] ? static_cast<A>(in[i][j]) : A(0);
          Op::apply(coef, has[1], has[2], reduce, x, y, tail);
          for (int o = 0; o < kOut; ++o) {
            if (out[o]) out[o][j] = static_cast<T>(y[o]);
          }
        }
        if (reduce) {
          for (int k = 0; k < kSums; ++k) {
            sums[k] += horizontal_sum(acc[0][k], acc[1][k]) + static_cast<double>(tail[k]);
          }
        }
      }
      if (reduce) {
        for (int k = 0; k < kSums; ++k) partials[kSums * c + k] = sums[k];
      }
    });
    if (reduce) combine_partials(p, partials, kSums, chunk);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_superfed<SuperfedCpu>(m);
}

}  // namespace fedkernels
