// CPU kernels of the SGLD / FedEvg ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/sgld_host.h; per-element formulas in csrc/elementwise.h, shared with the CUDA kernels).
// Like every csrc/cpu/*.cpp this file is compiled once per instruction set (see setup.py) into a
// library of its own.
//
// sgld_compose_step: the K x M weights pi first (one sample per item), then ranges of the M*D
// elements (multiples of 4, the noise's Philox blocks) are the parallel unit, each walked in
// tiles of kTile elements whose accumulators stay in L1. A tile's noise is drawn first, and
// while its arithmetic runs the tile's gradients are prefetched into L2 a few lines per block of
// normals (drawn after the sum, the noise left memory idle: K = 10 took ~10 % longer); then the
// accumulator takes the K clipped client gradients in client order (vectorized over runs of one
// sample, whose weight is constant), and one vector pass adds the step, the noise and the
// clamp. The result does not depend on the number of threads. The noise seed is drawn from the
// CPU generator (one random64 per call), so a seeded torch.Generator reproduces a run.
//
// Noise: draw_normals (csrc/cpu/normal_lanes.h), vectorized on the AVX2 and AVX-512 builds.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>

#include "../elementwise.h"
#include "../sgld_host.h"
#include "normal_lanes.h"
#include "parallel.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kGroupGrain = 1024;  // Philox groups (4 elements) per parallel work item
constexpr int64_t kTile = 2048;        // elements per tile (a multiple of 4 * kLanes)
constexpr int kPrefetchLines = 24;  // gradient cache lines prefetched per block of normals

// pi[:, j] = softmax_k(log_w_k + phi(-E_kj)), stable (max subtracted).
template <typename A>
void client_weights(const SgldPlan& p) {
  const int64_t K = p.K, M = p.M;
  const A* energies = static_cast<const A*>(p.energies);
  const A* log_w = static_cast<const A*>(p.log_weights);
  A* pi = static_cast<A*>(p.pi);
  const int64_t bytes = 2 * K * M * int64_t(sizeof(A));
  parallel_for_bytes(0, M, std::max<int64_t>(1, 4096 / K), bytes, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      A m = -std::numeric_limits<A>::infinity();
      for (int64_t k = 0; k < K; ++k) {
        const A z = SgldMath::logit<A>(log_w[k], energies[k * M + j], p.signed_mode);
        pi[k * M + j] = z;
        m = std::max(m, z);
      }
      A sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const A w = std::exp(pi[k * M + j] - m);
        pi[k * M + j] = w;
        sum += w;
      }
      for (int64_t k = 0; k < K; ++k) pi[k * M + j] /= sum;
    }
  });
}

// One random64 of the plan's generator (the default CPU generator when none) seeds the noise.
uint64_t draw_seed(const SgldPlan& p) {
  if (!p.draw_noise || p.M * p.D == 0) return 0;
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      p.generator, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->random64();
}

struct SgldCpu {
  template <typename T>
  static void energy(const EnergyPlan& p) {
    using A = acc_type<T>;
    const T* logits = static_cast<const T*>(p.logits);
    T* out = static_cast<T*>(p.out);
    const int64_t C = p.C;
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1));
    const int64_t bytes = p.N * (C + 1) * int64_t(sizeof(T));
    parallel_for_bytes(0, p.N, grain, bytes, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const T* row = logits + i * C;
        if (p.labels) {
          out[i] = static_cast<T>(-static_cast<A>(row[p.labels[i]]));
          continue;
        }
        A m = -std::numeric_limits<A>::infinity();
        bool has_nan = false;
        for (int64_t c = 0; c < C; ++c) {
          m = std::max(m, static_cast<A>(row[c]));
          has_nan |= std::isnan(static_cast<A>(row[c]));
        }
        // An infinite max is the log-sum-exp itself (x - m would give inf - inf = NaN).
        if (std::isinf(m) || has_nan) {
          out[i] = static_cast<T>(has_nan ? std::numeric_limits<A>::quiet_NaN() : -m);
          continue;
        }
        A s = 0;
        for (int64_t c = 0; c < C; ++c) s += std::exp(static_cast<A>(row[c]) - m);
        out[i] = static_cast<T>(-(m + std::log(s)));
      }
    });
  }

  template <typename T>
  static void sgld(const SgldPlan& p) {
    using A = acc_type<T>;
    using Vec = Vectorized<A>;
    const uint64_t seed = draw_seed(p);
    const int64_t K = p.K, M = p.M, D = p.D, n = M * D;
    if (K > 0) client_weights<A>(p);
    if (n == 0) return;
    const T* x = static_cast<const T*>(p.x);
    const T* grads = static_cast<const T*>(p.grads);
    const T* noise = static_cast<const T*>(p.noise);
    const A* pi = static_cast<const A*>(p.pi);
    T* out = static_cast<T*>(p.out);
    const A tau = static_cast<A>(p.tau), step = static_cast<A>(p.step);
    const A std_ = static_cast<A>(p.noise_std);
    const A lo = static_cast<A>(p.lo), hi = static_cast<A>(p.hi);
    const int64_t groups = (n + 3) / 4;
    const int64_t clients = K > 0 ? K : 1;
    const int64_t bytes = n * int64_t(sizeof(T)) * (clients + 2 + (noise ? 1 : 0));

    parallel_for_bytes(0, groups, kGroupGrain, bytes, [&](int64_t g0, int64_t g1) {
      alignas(64) A acc[kTile];
      alignas(64) A eps[kTile];
      alignas(64) A conv[kTile];  // an fp16/bf16 input in A
      const Vec vt(tau), vnt(-tau);
      const int64_t stop = std::min(n, g1 * 4);
      for (int64_t e0 = g0 * 4; e0 < stop; e0 += kTile) {
        const int64_t len = std::min(kTile, stop - e0);
        // The noise, first: drawing it is arithmetic, during which the tile's gradients are
        // prefetched (kPrefetchLines cache lines per block of normals), client by client.
        if (noise) {
          for (int64_t i = 0; i < len; ++i) eps[i] = static_cast<A>(noise[e0 + i]);
        } else if (p.draw_noise) {
          const int64_t tile_bytes = len * int64_t(sizeof(T));
          int64_t pk = 0, poff = 0;
          draw_normals<A>(seed, e0 / 4, (e0 + len + 3) / 4, eps, [&] {
            for (int line = 0; line < kPrefetchLines && pk < clients; ++line) {
              __builtin_prefetch(reinterpret_cast<const char*>(grads + pk * n + e0) + poff, 0, 2);
              poff += 64;
              if (poff >= tile_bytes) {
                poff = 0;
                ++pk;
              }
            }
          });
        } else {
          std::fill(eps, eps + len, A(0));
        }
        // The step direction: clipped client gradients in client order.
        for (int64_t k = 0; k < clients; ++k) {
          const T* gk = grads + k * n + e0;
          const A* src;
          if constexpr (std::is_same_v<T, A>) {
            src = gk;
          } else {
            for (int64_t i = 0; i < len; ++i) conv[i] = static_cast<A>(gk[i]);
            src = conv;
          }
          if (K == 0) {
            at::vec::map<A>(
                [vt, vnt](Vec g) { return at::vec::clamp(g, vnt, vt); }, acc, src, len);
            break;
          }
          // Runs of one sample j share the weight pi[k, j].
          for (int64_t s = 0; s < len;) {
            const int64_t j = (e0 + s) / D;
            const int64_t run = std::min(len, (j + 1) * D - e0) - s;
            const Vec w(pi[k * M + j]);
            const auto add = [w, vt, vnt](Vec a, Vec g) {
              return a + w * at::vec::clamp(g, vnt, vt);
            };
            if (k == 0) {
              at::vec::map<A>(
                  [w, vt, vnt](Vec g) { return w * at::vec::clamp(g, vnt, vt); }, acc + s,
                  src + s, run);
            } else {
              at::vec::map2<A>(add, acc + s, acc + s, src + s, run);
            }
            s += run;
          }
        }
        // x' = clamp(x - step a + std eps, lo, hi), as SgldMath::update.
        const A* xs;
        if constexpr (std::is_same_v<T, A>) {
          xs = x + e0;
        } else {
          for (int64_t i = 0; i < len; ++i) conv[i] = static_cast<A>(x[e0 + i]);
          xs = conv;
        }
        A* dst;
        if constexpr (std::is_same_v<T, A>) {
          dst = out + e0;
        } else {
          dst = conv;
        }
        const Vec vstep(step), vstd(std_), vlo(lo), vhi(hi);
        int64_t i = 0;
        for (; i + Vec::size() <= len; i += Vec::size()) {
          const Vec v = Vec::loadu(xs + i) - vstep * Vec::loadu(acc + i) +
              vstd * Vec::loadu(eps + i);
          const Vec low = Vec::blendv(v, vlo, v < vlo);
          Vec::blendv(low, vhi, v > vhi).store(dst + i);
        }
        for (; i < len; ++i) dst[i] = SgldMath::update<A>(xs[i], acc[i], eps[i], step, std_, lo, hi);
        if constexpr (!std::is_same_v<T, A>) {
          for (int64_t i2 = 0; i2 < len; ++i2) out[e0 + i2] = static_cast<T>(conv[i2]);
        }
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_sgld<SgldCpu>(m);
}

}  // namespace fedkernels
