// CPU kernels of the SGLD / FedEvg ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/sgld_host.h; per-element formulas in csrc/elementwise.h, shared with the CUDA kernels).
// Like every csrc/cpu/*.cpp this file is compiled once per instruction set (see setup.py) into a
// library of its own.
//
// sgld_compose_step: the K x M weights pi first (one sample per item), then ranges of the M*D
// elements (multiples of 4, the noise's Philox blocks) are the parallel unit, each walked in
// tiles of kTile elements whose accumulators stay in L1. A tile's noise is drawn first, and
// while its arithmetic runs the tile's gradients are prefetched into L2 a few lines at a time
// (noise drawn after the sum would leave memory idle); then the accumulator takes the K
// clipped client gradients in client order, over runs of one sample (whose weight is
// constant), four clients' loads in flight per vector pass, and the last pass of clients adds
// the step, the noise and the clamp. The result does not depend on the number of threads,
// nor on the grouping (the same roundings in the same order). The noise seed is drawn from the
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
#include "softmax_stats.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kGroupGrain = 1024;  // Philox groups (4 elements) per parallel work item
constexpr int64_t kTile = 2048;        // elements per tile (a multiple of 4 * kLanes)
// Gradient cache lines prefetched per call of draw_normals' `between` (ten per block of
// normals): spread requests get more served than one burst per block, and more than 3 at a
// time issue more than one core's misses can carry (chosen by bench/bench_sgld.py).
constexpr int kPrefetchLines = 3;

constexpr int kClientGroup = 4;  // clients whose loads are in flight together
constexpr int64_t kEnergyBlockElems = 2048;  // logits per block of energy_from_logits

// x' = clamp(x - step a + std eps, lo, hi) (SgldMath::update), which the last group of clients
// computes from the finished sums instead of storing them: pointers offset to the run.
template <typename T, typename A>
struct StepFinish {
  const T* x;
  const A* eps;
  A* dst;  // out itself for fp32/fp64; a buffer in A for fp16/bf16
  A step, std, lo, hi;
};

// acc[0, len) = [acc +] sum over the c clients of w_i clip(g_i), client i's elements at
// g + i * stride and its weight at w[i * w_stride] (no w: one client, clipped only), added in
// client order; acc is not read when `first`. With kFinish the sums go through `f` instead of
// into acc. The roundings are SgldMath's, a vector of elements at a time (no FMA:
// -ffp-contract=off), so grouping the clients changes no bit.
template <int c, bool kFinish, typename T, typename A>
inline void add_clients(
    const T* g, int64_t stride, const A* w, int64_t w_stride, A* acc, int64_t len, A tau,
    bool first, const StepFinish<T, A>& f) {
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  const Vec vt(tau), vnt(-tau);
  const Vec vstep(f.step), vstd(f.std), vlo(f.lo), vhi(f.hi);
  const auto update = [&](Vec x, Vec a, Vec eps) {
    const Vec v = x - vstep * a + vstd * eps;
    return Vec::blendv(Vec::blendv(v, vlo, v < vlo), vhi, v > vhi);
  };
  Vec wv[c];
  for (int i = 0; i < c; ++i) wv[i] = Vec(w ? w[i * w_stride] : A(1));
  const int64_t vec_len = len - len % step;
  for (int64_t e = 0; e < vec_len; e += step) {
    Vec lo, hi;
    int i = 0;
    if (first) {
      load2<T, A>(g + e, lo, hi);
      lo = at::vec::clamp(lo, vnt, vt);
      hi = at::vec::clamp(hi, vnt, vt);
      if (w) {
        lo = wv[0] * lo;
        hi = wv[0] * hi;
      }
      i = 1;
    } else {
      lo = Vec::loadu(acc + e);
      hi = Vec::loadu(acc + e + Vec::size());
    }
    for (; i < c; ++i) {
      Vec xl, xh;
      load2<T, A>(g + i * stride + e, xl, xh);
      lo = lo + wv[i] * at::vec::clamp(xl, vnt, vt);
      hi = hi + wv[i] * at::vec::clamp(xh, vnt, vt);
    }
    if constexpr (kFinish) {
      Vec xl, xh;
      load2<T, A>(f.x + e, xl, xh);
      update(xl, lo, Vec::loadu(f.eps + e)).store(f.dst + e);
      update(xh, hi, Vec::loadu(f.eps + e + Vec::size())).store(f.dst + e + Vec::size());
    } else {
      lo.store(acc + e);
      hi.store(acc + e + Vec::size());
    }
  }
  for (int64_t e = vec_len; e < len; ++e) {
    int i = 0;
    A a;
    if (first) {
      a = SgldMath::clip<A>(static_cast<A>(g[e]), tau);
      if (w) a = w[0] * a;
      i = 1;
    } else {
      a = acc[e];
    }
    for (; i < c; ++i) {
      a = a + w[i * w_stride] * SgldMath::clip<A>(static_cast<A>(g[i * stride + e]), tau);
    }
    if constexpr (kFinish) {
      f.dst[e] =
          SgldMath::update<A>(static_cast<A>(f.x[e]), a, f.eps[e], f.step, f.std, f.lo, f.hi);
    } else {
      acc[e] = a;
    }
  }
}

// add_clients for c = 1 .. kClientGroup known at run time.
static_assert(kClientGroup == 4, "add_some_clients has a case for each group size");
template <bool kFinish, typename T, typename A>
inline void add_some_clients(
    int64_t c, const T* g, int64_t stride, const A* w, int64_t w_stride, A* acc, int64_t len,
    A tau, bool first, const StepFinish<T, A>& f) {
  switch (c) {
    case 4: add_clients<4, kFinish>(g, stride, w, w_stride, acc, len, tau, first, f); break;
    case 3: add_clients<3, kFinish>(g, stride, w, w_stride, acc, len, tau, first, f); break;
    case 2: add_clients<2, kFinish>(g, stride, w, w_stride, acc, len, tau, first, f); break;
    case 1: add_clients<1, kFinish>(g, stride, w, w_stride, acc, len, tau, first, f); break;
    default: break;
  }
}

// pi[:, j] = softmax_k(log_w_k + phi(-E_kj)), stable (max subtracted).
template <typename A>
void client_weights(const SgldPlan& p) {
  const int64_t K = p.K, M = p.M;
  const A* energies = static_cast<const A*>(p.energies);
  const A* log_w = static_cast<const A*>(p.log_weights);
  A* pi = static_cast<A*>(p.pi);
  const int64_t bytes = 2 * K * M * int64_t(sizeof(A));
  const int64_t grain = std::max<int64_t>(1, 4096 / K);
  parallel_for_bytes(0, M, grain, bytes, PassCost::kArithmetic, [&](int64_t j0, int64_t j1) {
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
  // Energies of blocks of about kEnergyBlockElems logits (fewer where the blocks are few:
  // split_for_threads, parallel.h): the labelled ones read one logit a row; the marginal
  // ones are -log-sum-exp from the rows' softmax statistics (softmax_stats.h; fp16/bf16 blocks
  // converted to float first).
  template <typename T>
  static void energy(const EnergyPlan& p) {
    // Subnormal logits and exps taken as 0, as in the distillation ops (distill.cpp, top): they
    // change no log-sum-exp, and each one costs a microcode assist.
    const DenormalModeScope flush(kFlushDenormals);
    using A = acc_type<T>;
    using Stats = softmax_stats::SoftmaxStats<A>;
    const T* logits = static_cast<const T*>(p.logits);
    T* out = static_cast<T*>(p.out);
    const int64_t N = p.N, C = p.C;
    if (p.labels) {
      const int64_t label_bytes = N * int64_t(2 * sizeof(T) + sizeof(int64_t));
      parallel_for_bytes(0, N, 4096, label_bytes, PassCost::kStreaming, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          out[i] = static_cast<T>(-static_cast<A>(logits[i * C + p.labels[i]]));
        }
      });
      return;
    }
    const int64_t bytes = N * (C + 1) * int64_t(sizeof(T));
    int64_t R = std::max<int64_t>(1, std::min<int64_t>(N, kEnergyBlockElems / C));
    const bool lane_groups = Stats::short_rows(C) && R >= Stats::W;
    if (lane_groups) R = R / Stats::W * Stats::W;  // whole lane groups
    R = split_for_threads(R, N, lane_groups ? Stats::W : 1, bytes, PassCost::kArithmetic);
    const int64_t blocks = (N + R - 1) / R;
    parallel_for_bytes(0, blocks, 1, bytes, PassCost::kArithmetic, [&](int64_t b0, int64_t b1) {
      Stats stats(C, R);
      std::vector<A> xa(std::is_same_v<T, A> ? 0 : R * C), m(R), s(R);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t i0 = b * R, rows = std::min(R, N - i0);
        const T* src = logits + i0 * C;
        const A* x = nullptr;
        typename Stats::Ahead ahead;  // float rows: the next two blocks this thread reads
        if constexpr (std::is_same_v<T, A>) {
          x = src;
          if (b + 1 < b1) {
            ahead.next = src + R * C;
            ahead.next_rows = std::min(R, N - i0 - R);
          }
          if (b + 2 < b1) {
            ahead.after = src + 2 * R * C;
            ahead.after_rows = std::min(R, N - i0 - 2 * R);
          }
        } else {
          convert_to_acc(src, xa.data(), rows * C);
          x = xa.data();
        }
        stats.compute(x, rows, m.data(), s.data(), nullptr, ahead);
        Stats::log_sum_exp(m.data(), s.data(), rows, s.data());
        for (int64_t r = 0; r < rows; ++r) out[i0 + r] = static_cast<T>(-s[r]);
      }
    });
  }

  template <typename T>
  static void sgld(const SgldPlan& p) {
    using A = acc_type<T>;
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

    parallel_for_bytes(0, groups, kGroupGrain, bytes, PassCost::kArithmetic, [&](int64_t g0, int64_t g1) {
      alignas(64) A acc[kTile];
      alignas(64) A eps[kTile];
      alignas(64) A conv[kTile];  // x' of an fp16/bf16 x in A, rounded to T at the tile's end
      const int64_t stop = std::min(n, g1 * 4);
      for (int64_t e0 = g0 * 4; e0 < stop; e0 += kTile) {
        const int64_t len = std::min(kTile, stop - e0);
        // The noise, first: drawing it is arithmetic, during which the tile's gradients are
        // prefetched (kPrefetchLines cache lines at a time), client by client.
        if (noise) {
          convert_to_acc(noise + e0, eps, len);
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
        // The step direction, clipped client gradients added in client order over runs of one
        // sample j (whose weights pi[:, j] are constant), four clients' loads in flight at once;
        // the last group of clients finishes the step from the sums it holds.
        A* dst;
        if constexpr (std::is_same_v<T, A>) {
          dst = out + e0;
        } else {
          dst = conv;
        }
        if (K == 0) {  // sgld_step: one gradient, no weights
          const StepFinish<T, A> f{x + e0, eps, dst, step, std_, lo, hi};
          add_clients<1, true>(grads + e0, n, static_cast<const A*>(nullptr), 0, acc, len, tau,
                               true, f);
        } else {
          for (int64_t s = 0; s < len;) {
            const int64_t j = (e0 + s) / D;
            const int64_t run = std::min(len, (j + 1) * D - e0) - s;
            const T* g = grads + e0 + s;
            const A* w = pi + j;
            const StepFinish<T, A> f{x + e0 + s, eps + s, dst + s, step, std_, lo, hi};
            int64_t k = 0;
            for (; k + kClientGroup < K; k += kClientGroup) {
              add_clients<kClientGroup, false>(
                  g + k * n, n, w + k * M, M, acc + s, run, tau, k == 0, f);
            }
            add_some_clients<true>(
                K - k, g + k * n, n, w + k * M, M, acc + s, run, tau, k == 0, f);
            s += run;
          }
        }
        if constexpr (!std::is_same_v<T, A>) convert_from_acc(conv, out + e0, len);
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_sgld<SgldCpu>(m);
}

}  // namespace fedkernels
