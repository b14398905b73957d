// CPU kernels of the differential-privacy ops (schemas: csrc/ops.cpp; host side:
// csrc/private_host.h).
//
// update_norms: fixed chunks are the work items; each adds sum_e (x_k[e] - b[e])^2 in float64
// for every client to its own row of partial sums, added in chunk order at the end (the result
// does not depend on the number of threads).
// private_sum: chunks of every tensor are the work items; a chunk's accumulators take the K
// scaled updates in client order, then one pass adds base and the noise. The noise key is one
// random64 of the CPU generator per call (as sgld_step draws it), so a seeded torch.Generator
// reproduces a call and element e gets the same normal as element e of sgld_step's noise.
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
#include "normal_lanes.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kNormChunk = 1 << 16;
constexpr int64_t kSumChunk = 1 << 14;

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
    const int64_t chunks = fill_chunk_prefix(p.numels.data(), n, kNormChunk, prefix.data());
    std::vector<double> partial(static_cast<size_t>(chunks * K), 0.0);
    const int64_t bytes = (K + 1) * total_numel(p.numels) * int64_t(sizeof(T));
    for_each_chunk(p.numels, kNormChunk, bytes, [&](int64_t c, const ChunkRange& r) {
      const T* b = static_cast<const T*>(p.bases[r.tensor]);
      for (int64_t k = 0; k < K; ++k) {
        const T* x = static_cast<const T*>(p.inputs[k * n + r.tensor]);
        double s[4] = {0, 0, 0, 0};  // four interleaved sums: a fixed order
        int64_t e = r.begin;
        for (; e + 4 <= r.end; e += 4) {
          for (int l = 0; l < 4; ++l) {
            const double d = static_cast<double>(x[e + l]) - static_cast<double>(b[e + l]);
            s[l] += d * d;
          }
        }
        for (; e < r.end; ++e) {
          const double d = static_cast<double>(x[e]) - static_cast<double>(b[e]);
          s[0] += d * d;
        }
        partial[c * K + k] = (s[0] + s[1]) + (s[2] + s[3]);
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
    const int64_t K = p.K, n = p.num_tensors();
    const double* coef = p.coefficients.const_data_ptr<double>();
    const A std_ = static_cast<A>(p.noise_std);
    const bool noise = p.noise_std != 0;
    const int64_t bytes = (K + 2) * total_numel(p.numels) * int64_t(sizeof(T));
    for_each_chunk(p.numels, kSumChunk, bytes, [&](int64_t, const ChunkRange& r) {
      const int64_t len = r.end - r.begin;
      const T* b = static_cast<const T*>(p.bases[r.tensor]) + r.begin;
      T* out = static_cast<T*>(p.outs[r.tensor]) + r.begin;
      std::vector<A> base(len), acc(len, A(0)), conv;
      for (int64_t i = 0; i < len; ++i) base[i] = static_cast<A>(b[i]);
      if constexpr (!std::is_same_v<T, A>) conv.resize(len);
      for (int64_t k = 0; k < K; ++k) {
        const T* xk = static_cast<const T*>(p.inputs[k * n + r.tensor]) + r.begin;
        const A* src;
        if constexpr (std::is_same_v<T, A>) {
          src = xk;
        } else {
          for (int64_t i = 0; i < len; ++i) conv[i] = static_cast<A>(xk[i]);
          src = conv.data();
        }
        const Vec c(static_cast<A>(coef[k]));
        at::vec::map3<A>(
            [c](Vec a, Vec x, Vec bb) { return a + c * (x - bb); }, acc.data(), acc.data(), src,
            base.data(), len);
      }
      const int64_t first = p.offsets[r.tensor] + r.begin;  // element index in the model
      if (noise) {
        // The normals of the Philox groups the chunk overlaps; element e takes eps[e - 4 g0].
        const int64_t g0 = first / 4, g1 = (first + len + 3) / 4;
        std::vector<A> eps(static_cast<size_t>(4 * (g1 - g0)));
        draw_normals<A>(seed, g0, g1, eps.data());
        const A* e = eps.data() + (first - 4 * g0);
        for (int64_t i = 0; i < len; ++i) out[i] = static_cast<T>(base[i] + acc[i] + std_ * e[i]);
      } else {
        for (int64_t i = 0; i < len; ++i) out[i] = static_cast<T>(base[i] + acc[i]);
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_private<PrivateCpu>(m);
}

}  // namespace fedkernels
