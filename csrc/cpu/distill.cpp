// CPU kernels of the ensemble-distillation ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/distill_host.h; per-row math: DistillMath in csrc/elementwise.h). Like every csrc/cpu/*.cpp
// this file is compiled once per instruction set (see setup.py) into a library of its own.
//
// Work: samples (rows i) are the parallel unit. A row's K teacher rows L[k, i, :] are read once
// (converted to the accumulate type when the input is fp16/bf16), their statistics, the
// weights, the combination and the final softmax are computed from that copy, in client order.
// The KL loss is summed per block of kRowBlock rows in float64 and the blocks are added in
// order after the parallel loop, so the result does not depend on the number of threads.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../distill_host.h"
#include "../elementwise.h"
#include "parallel.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kRowBlock = 64;  // rows per parallel work item (and per loss partial)

template <typename A>
A row_max(const A* x, int64_t n) {
  using Vec = Vectorized<A>;
  return at::vec::reduce_all<A>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
}

template <typename A>
A row_sum(const A* x, int64_t n) {
  using Vec = Vectorized<A>;
  return at::vec::reduce_all<A>([](Vec& a, Vec& b) { return a + b; }, x, n);
}

// Per-client statistics of one row x[0..C), as the weighting and the combine need them.
template <typename A>
struct RowStats {
  A score = 0;     // DistillMath::score (before log_prior / n_k)
  A max_t = 0;     // max_c x_c / T          (probs)
  A sum_t = 1;     // sum_c e^(x_c/T - max_t) (probs)
};

template <typename A>
RowStats<A> row_stats(const A* x, int64_t C, const PseudoLabelPlan& p, A z) {
  using Vec = Vectorized<A>;
  RowStats<A> st;
  const A inv_t = static_cast<A>(1.0 / p.temperature);
  A ent = 0, var = 0;
  if (p.weighting == Weighting::kEntropy || p.probs) {
    const A m = row_max(x, C);
    if (p.weighting == Weighting::kEntropy) {
      // s = sum e^(x - m) and t = sum e^(x - m) x in one pass: one exp per element. With a
      // finite max every exponent is <= 0 or -inf, where the faster exp_u20 (a few more ulps;
      // it does not carry NaN through) is exact enough for a weight; otherwise the NaN/inf
      // cases take the full exp.
      const Vec mv(m);
      const bool fast = std::isfinite(m);
      Vec s_lo(A(0)), s_hi(A(0)), t_lo(A(0)), t_hi(A(0));
      constexpr int64_t step = 2 * Vec::size();
      int64_t c = 0;
      for (; c + step <= C; c += step) {
        const Vec v_lo = Vec::loadu(x + c), v_hi = Vec::loadu(x + c + Vec::size());
        const Vec e_lo = fast ? (v_lo - mv).exp_u20() : (v_lo - mv).exp();
        const Vec e_hi = fast ? (v_hi - mv).exp_u20() : (v_hi - mv).exp();
        s_lo = s_lo + e_lo;
        s_hi = s_hi + e_hi;
        t_lo = t_lo + e_lo * v_lo;
        t_hi = t_hi + e_hi * v_hi;
      }
      // The rest (fewer than `step`) one vector at a time, the last one partial: its missing
      // lanes load as 0 and their e is set to 0, so they add nothing to s or t.
      for (; c < C; c += Vec::size()) {
        const int64_t count = std::min<int64_t>(Vec::size(), C - c);
        const Vec v = Vec::loadu(x + c, count);
        const Vec e = Vec::set(Vec(A(0)), fast ? (v - mv).exp_u20() : (v - mv).exp(), count);
        s_lo = s_lo + e;
        t_lo = t_lo + e * v;
      }
      const A s = static_cast<A>(horizontal_sum(s_lo, s_hi));
      const A t = static_cast<A>(horizontal_sum(t_lo, t_hi));
      ent = DistillMath::entropy(m, s, t);
    }
    if (p.probs) {
      st.max_t = m * inv_t;
      const Vec mt(st.max_t), it(inv_t);
      st.sum_t = at::vec::map_reduce_all<A>(
          [mt, it](Vec v) { return (v * it - mt).exp(); }, [](Vec a, Vec b) { return a + b; }, x,
          C);
    }
  }
  if (p.weighting == Weighting::kVariance) {
    const A mean = row_sum(x, C) / static_cast<A>(C);
    const Vec mv(mean);
    const A m2 = at::vec::map_reduce_all<A>(
        [mv](Vec v) { return (v - mv) * (v - mv); }, [](Vec a, Vec b) { return a + b; }, x, C);
    var = m2 / static_cast<A>(C);
  }
  st.score = DistillMath::score<A>(
      p.weighting, z, ent, var, static_cast<A>(p.tau), p.double_sigmoid);
  return st;
}

// w[k] from the per-client scores (docs/algorithms/distillation.md, "Client weightings"):
// softmax of score + log_prior, or the linear
// normalisation of n_k * score (uniform when every mass is 0).
template <typename A>
void client_weights(
    const std::vector<RowStats<A>>& st, const A* log_prior, Weighting weighting, A* w) {
  const int64_t K = static_cast<int64_t>(st.size());
  if (DistillMath::softmax_kind(weighting)) {
    A m = -std::numeric_limits<A>::infinity();
    for (int64_t k = 0; k < K; ++k) {
      w[k] = st[k].score + (log_prior ? log_prior[k] : A(0));
      m = std::max(m, w[k]);
    }
    A sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      w[k] = std::exp(w[k] - m);
      sum += w[k];
    }
    for (int64_t k = 0; k < K; ++k) w[k] /= sum;
  } else {
    A sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      w[k] = st[k].score * (log_prior ? std::exp(log_prior[k]) : A(1));
      sum += w[k];
    }
    for (int64_t k = 0; k < K; ++k) w[k] = sum > A(0) ? w[k] / sum : A(1) / static_cast<A>(K);
  }
}

struct DistillCpu {
  template <typename T>
  static void pseudo_labels(const PseudoLabelPlan& p) {
    using A = acc_type<T>;
    using Vec = Vectorized<A>;
    const int64_t K = p.K, N = p.N, C = p.C;
    const T* logits = static_cast<const T*>(p.logits);
    const A* scores = static_cast<const A*>(p.scores);
    const A* log_prior = static_cast<const A*>(p.log_prior);
    T* out_y = static_cast<T*>(p.out_labels);
    T* out_w = static_cast<T*>(p.out_weights);
    const A inv_t = static_cast<A>(1.0 / p.temperature);
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * C));

    const int64_t bytes = (K + 1) * N * C * int64_t(sizeof(T)) + K * N * int64_t(sizeof(T));
    parallel_for_bytes(0, N, grain, bytes, [&](int64_t i0, int64_t i1) {
      std::vector<A> rows;  // the row's K teacher rows in A (only for fp16/bf16 inputs)
      if constexpr (!std::is_same_v<T, A>) rows.resize(K * C);
      std::vector<A> acc(C);
      std::vector<A> w(K);
      std::vector<RowStats<A>> st(K);
      for (int64_t i = i0; i < i1; ++i) {
        auto row = [&](int64_t k) -> const A* {
          if constexpr (std::is_same_v<T, A>) {
            return logits + (k * N + i) * C;
          } else {
            return rows.data() + k * C;
          }
        };
        for (int64_t k = 0; k < K; ++k) {
          if constexpr (!std::is_same_v<T, A>) {
            const T* src = logits + (k * N + i) * C;
            A* dst = rows.data() + k * C;
            for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<A>(src[c]);
          }
          const A z = scores ? scores[k * N + i] : A(0);
          st[k] = row_stats<A>(row(k), C, p, z);
        }
        client_weights<A>(st, log_prior, p.weighting, w.data());
        for (int64_t k = 0; k < K; ++k) out_w[k * N + i] = static_cast<T>(w[k]);

        // Combination in client order.
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t k = 0; k < K; ++k) {
          const A* x = row(k);
          if (!p.probs) {
            const Vec wv(w[k]);
            at::vec::map2<A>(
                [wv](Vec a, Vec v) { return a + wv * v; }, acc.data(), acc.data(), x, C);
          } else {
            const Vec coef(w[k] / st[k].sum_t), mt(st[k].max_t), it(inv_t);
            at::vec::map2<A>(
                [coef, mt, it](Vec a, Vec v) { return a + coef * (v * it - mt).exp(); },
                acc.data(), acc.data(), x, C);
          }
        }
        T* y = out_y + i * C;
        if (p.probs) {
          for (int64_t c = 0; c < C; ++c) y[c] = static_cast<T>(acc[c]);
          continue;
        }
        // y = softmax(acc / T).
        const A m = row_max(acc.data(), C) * inv_t;
        const Vec mv(m), it(inv_t);
        at::vec::map<A>([mv, it](Vec a) { return (a * it - mv).exp(); }, acc.data(), acc.data(), C);
        const A inv_sum = A(1) / row_sum(acc.data(), C);
        for (int64_t c = 0; c < C; ++c) y[c] = static_cast<T>(acc[c] * inv_sum);
      }
    });
  }

  template <typename T>
  static void distill_kl(const DistillKLPlan& p) {
    using A = acc_type<T>;
    using Vec = Vectorized<A>;
    const int64_t N = p.N, C = p.C;
    const T* student = static_cast<const T*>(p.student);
    const T* target = static_cast<const T*>(p.target);
    T* grad = static_cast<T*>(p.grad);
    const A inv_t = static_cast<A>(1.0 / p.temperature);
    const A scale_over_t = static_cast<A>(p.scale / p.temperature);
    const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
    std::vector<double> partial(blocks, 0.0);

    const int64_t bytes = (grad ? 3 : 2) * N * C * int64_t(sizeof(T));
    parallel_for_bytes(0, blocks, 1, bytes, [&](int64_t b0, int64_t b1) {
      std::vector<A> z(C);
      std::vector<A> e(C);
      for (int64_t b = b0; b < b1; ++b) {
        double block_loss = 0;
        const int64_t end = std::min(N, (b + 1) * kRowBlock);
        for (int64_t i = b * kRowBlock; i < end; ++i) {
          const T* s = student + i * C;
          const T* y = target + i * C;
          for (int64_t c = 0; c < C; ++c) z[c] = static_cast<A>(s[c]) * inv_t;
          const A m = row_max(z.data(), C);
          const Vec mv(m);
          at::vec::map<A>([mv](Vec v) { return (v - mv).exp(); }, e.data(), z.data(), C);
          const A sum = row_sum(e.data(), C);
          const A log_sum = std::log(sum);
          const A inv_sum = A(1) / sum;
          A row_loss = 0, y_sum = 0;
          for (int64_t c = 0; c < C; ++c) {
            const A yc = static_cast<A>(y[c]);
            row_loss += DistillMath::kl_term<A>(yc, z[c] - m - log_sum);
            y_sum += yc;
          }
          if (grad) {
            for (int64_t c = 0; c < C; ++c) {
              grad[i * C + c] = static_cast<T>(DistillMath::kl_grad<A>(
                  e[c] * inv_sum, static_cast<A>(y[c]), y_sum, scale_over_t));
            }
          }
          block_loss += static_cast<double>(row_loss);
        }
        partial[b] = block_loss;
      }
    });
    double total = 0;
    for (const double v : partial) total += v;
    *static_cast<A*>(p.loss) = static_cast<A>(p.scale * total);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_distill<DistillCpu>(m);
}

}  // namespace fedkernels
