// CPU kernels of the ensemble-distillation ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/distill_host.h; per-row math: DistillMath in csrc/elementwise.h). Like every csrc/cpu/*.cpp
// this file is compiled once per instruction set (see setup.py) into a library of its own.
//
// Work: blocks of R consecutive samples (rows), R * C about kBlockElems, are the parallel unit
// (fewer rows where so few blocks would split unevenly between the threads: split_for_threads).
// Teacher k's rows of a block are contiguous in L[k], so each pass runs over R * C contiguous
// elements: per-row maxima and sums are full vectors plus scalar tails, exps run over the whole
// block at once, and per-row constants sit in small per-block arrays. The entropy weighting's exps
// take most of its time: its per-row statistics come from SoftmaxStats (csrc/cpu/softmax_stats.h:
// base-2 exps, short rows a vector's width of rows at a time). Short rows (C < 2 vector widths)
// are combined and normalised a vector's width of rows at a time too, one row per lane
// (RowLanes). Scores and weights are computed for a block of rows at once, vectorised across rows.
// The weighted combination takes four teachers per pass over a row's accumulator (a third of the
// loads and stores of one pass per teacher). Every value of a row is computed from that row
// alone, in client order, with the lane layout fixed by C, so the results do not depend on the
// blocking or the number of threads. The KL loss is summed per block of rows in float64 (about
// 32 blocks of 8 to kRowBlock rows, sized from N alone) and the blocks are added in order after
// the parallel loop.
//
// Subnormals: both ops run with subnormal inputs and results taken as 0 (parallel.h,
// DenormalModeScope), whatever the caller's mode. Probabilities below 2^-126 are common (the
// softmax of a confident teacher at C = 1000) and each one costs a microcode assist. At that
// size they change no sum (a row's s is at least 1), and the base-2 exps already give 0 there.
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
#include "softmax_stats.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;
using namespace softmax_stats;

constexpr int64_t kRowBlock = 64;      // most rows per KL loss partial
// distill_kl's float rows go in groups of at most this many rows and values (kl_row_exps).
constexpr int64_t kKlGroupRows = 8;
constexpr int64_t kKlGroupElems = 1024;
// distill_kl's float rows of fewer classes go a vector's width of rows at a time (kl_lanes).
// Above it the lanes lose with the gradient (its transpose back), and the path must not depend
// on whether the gradient is wanted (chosen by bench/bench_distill_kl.py).
constexpr int64_t kKlLanesMaxClasses = 32;
constexpr int64_t kBlockElems = 2048;  // elements of one teacher's rows per block (R * C)
constexpr int64_t kBlockScores = 65536;  // bound on K * R, the per-block scores and weights
// The entropy weighting's statistics prefetch into L2 the block they read this many blocks on
// (SoftmaxStats::Ahead::far). A teacher's rows of a block are a few KiB, each in another place
// of L: the hardware prefetchers do not follow them, and the next block's maxima, taken during
// this block's exps, would wait for memory. With the logits in cache the prefetches are only
// work, so they start at kEntropyFarMinBytes of logits, more than the last-level cache of most
// small machines (the size the C library reports is not to be trusted in a virtual machine).
// Both values chosen by bench/bench_distill.py.
constexpr int64_t kEntropyFarBlock = 16;
constexpr int64_t kEntropyFarMinBytes = int64_t(32) << 20;
constexpr int kCombineGroup = 4;  // teachers per pass of the combination
// Most values a thread keeps of a block's K teachers (their exps for combine = "probs", or
// fp16/bf16 rows converted to float): 16 MB of float each.
constexpr int64_t kKeptBlocksElems = int64_t(1) << 22;

// Rows per block for rows of C elements: about kBlockElems elements, at least one row.
inline int64_t block_rows(int64_t C, int64_t N) {
  return std::max<int64_t>(1, std::min<int64_t>(N, kBlockElems / C));
}

// The helpers below run over one row x[0..n): full vectors and a scalar tail (axpy_group: an
// overlapping last vector), never a partial vector (ATen loads and stores those through a
// temporary buffer, which dominates short rows).
// They are small and called once per row, so they are always inlined.

// sum_c x_c (y == nullptr) or sum_c x_c y_c, of at most kSumChunk float values (row_sum).
template <typename A>
C10_ALWAYS_INLINE A row_sum_span(const A* x, const A* y, int64_t n) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  int64_t c = 0;
  A s = 0;
  if (n >= 2 * W) {
    Vec a(A(0)), b(A(0));
    for (; c + 2 * W <= n; c += 2 * W) {
      if (y) {
        a = a + Vec::loadu(x + c) * Vec::loadu(y + c);
        b = b + Vec::loadu(x + c + W) * Vec::loadu(y + c + W);
      } else {
        a = a + Vec::loadu(x + c);
        b = b + Vec::loadu(x + c + W);
      }
    }
    s = at::vec::vec_reduce_all<A>([](Vec& u, Vec& v) { return u + v; }, a + b);
  }
  if (y) {
    for (; c < n; ++c) s += x[c] * y[c];
  } else {
    for (; c < n; ++c) s += x[c];
  }
  return s;
}

// sum_c x_c (y == nullptr) or sum_c x_c y_c; long float rows in chunks whose sums are added in
// float64 (kSumChunk, softmax_stats.h).
template <typename A>
C10_ALWAYS_INLINE A row_sum(const A* x, const A* y, int64_t n) {
  if constexpr (std::is_same_v<A, float>) {
    if (n > kSumChunk) {
      double sum = 0;
      for (int64_t c = 0; c < n; c += kSumChunk) {
        sum += row_sum_span(x + c, y ? y + c : nullptr, std::min(kSumChunk, n - c));
      }
      return static_cast<float>(sum);
    }
  }
  return row_sum_span(x, y, n);
}

// d_c = x_c * a - b.
template <typename A>
C10_ALWAYS_INLINE void scale_sub(A* d, const A* x, A a, A b, int64_t n) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  const Vec av(a), bv(b);
  int64_t c = 0;
  for (; c + W <= n; c += W) (Vec::loadu(x + c) * av - bv).store(d + c);
  for (; c < n; ++c) d[c] = x[c] * a - b;
}

// x_c = (x_c - a) - b.
template <typename A>
C10_ALWAYS_INLINE void sub_twice(A* x, A a, A b, int64_t n) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  const Vec av(a), bv(b);
  int64_t c = 0;
  for (; c + W <= n; c += W) ((Vec::loadu(x + c) - av) - bv).store(x + c);
  for (; c < n; ++c) x[c] = (x[c] - a) - b;
}

// y_c += a_0 x0_c, then += a_1 x1_c, ... for G rows x_g: G passes of y += a x in one read and
// write of y, every product and sum rounded as in G separate passes, so the result is the same.
template <int G, typename A>
C10_ALWAYS_INLINE void axpy_group(A* y, const A* const* x, const A* a, int64_t n) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  Vec av[G];
  for (int g = 0; g < G; ++g) av[g] = Vec(a[g]);
  auto at = [&](int64_t c) {
    Vec acc = Vec::loadu(y + c);
    for (int g = 0; g < G; ++g) acc = acc + av[g] * Vec::loadu(x[g] + c);
    return acc;
  };
  if (n < W) {
    for (int64_t c = 0; c < n; ++c) {
      A acc = y[c];
      for (int g = 0; g < G; ++g) acc += a[g] * x[g][c];
      y[c] = acc;
    }
    return;
  }
  // The last partial vector as a full one ending at y + n, taken from the values before the
  // loop writes them and stored after it: where it overlaps the loop's last vector it holds the
  // same sums, rounded alike: cheaper than a scalar tail, with the same bits.
  const bool partial = n % W != 0;
  const Vec tail = partial ? at(n - W) : Vec(A(0));
  for (int64_t c = 0; c + W <= n; c += W) at(c).store(y + c);
  if (partial) tail.store(y + n - W);
}

// y_c += a * x_c.
template <typename A>
C10_ALWAYS_INLINE void axpy(A* y, const A* x, A a, int64_t n) {
  axpy_group<1>(y, &x, &a, n);
}

// e_c = e^(a_c / T - m) of one float row of C >= W values, m = max(a) / T with exp2_row_ok(m):
// in base 2 as in exp2_sums, y_c = a_c (log2 e / T) - m log2 e, and e_c = 0 exactly where
// y_c < kMinExp2 (a class more than ~86 below the max, or -inf), as the full exp gives 0 there
// to float precision. The last vector overlaps the one before it (same values stored twice).
inline void exp2_softmax_row(const float* a, int64_t C, float inv_t, float m, float* e) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const Vec scale(inv_t * kLog2e), b(-(m * kLog2e));
  auto one = [&](int64_t c) {
    const Vec y = at::vec::fmadd(Vec::loadu(a + c), scale, b);
    exp2_or_zero(y).store(e + c);
  };
  int64_t c = 0;
  for (; c + W <= C; c += W) one(c);
  if (c < C) one(C - W);
}


// acc[r] += sum_k w[k * R + r] x_k[r] for rows r < rows of C elements, teacher k's rows at
// x + k * stride, in client order: kCombineGroup teachers per pass over acc (axpy_group), which
// rounds as one axpy per teacher would.
template <typename A>
void combine_rows(A* acc, const A* x, const A* w, int64_t K, int64_t R, int64_t rows,
                  int64_t stride, int64_t C) {
  for (int64_t k0 = 0; k0 < K; k0 += kCombineGroup) {
    const int g = static_cast<int>(std::min<int64_t>(kCombineGroup, K - k0));
    for (int64_t r = 0; r < rows; ++r) {
      const A* xs[kCombineGroup];
      A ws[kCombineGroup];
      for (int j = 0; j < g; ++j) {
        xs[j] = x + (k0 + j) * stride + r * C;
        ws[j] = w[(k0 + j) * R + r];
      }
      A* y = acc + r * C;
      switch (g) {
        case 4: axpy_group<4>(y, xs, ws, C); break;
        case 3: axpy_group<3>(y, xs, ws, C); break;
        case 2: axpy_group<2>(y, xs, ws, C); break;
        default: axpy_group<1>(y, xs, ws, C); break;
      }
    }
  }
}

// lq = y (log y - lq), 0 where y = 0, over a whole block: the vector form of
// DistillMath::kl_term (NaN for a NaN or negative y there too).
template <typename A>
void kl_terms(A* lq, const A* y, int64_t n) {
  using Vec = Vectorized<A>;
  at::vec::map2<A>(
      [](Vec l, Vec yv) {
        const Vec zero(A(0));
        return Vec::blendv(yv * (yv.log() - l), zero, yv == zero);
      },
      lq, lq, y, n);
}

// x = e^x over a whole block.
template <typename A>
void exp_inplace(A* x, int64_t n) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  int64_t c = 0;
  for (; c + W <= n; c += W) Vec::loadu(x + c).exp().store(x + c);
  if (c < n) Vec::loadu(x + c, n - c).exp().store(x + c, n - c);
}

// Scores from the discriminator logits z[0..rows) into s (fedgo, domain, uniform), vectorised
// across rows: the vector form of DistillMath::score for these weightings.
template <typename A>
void z_scores(A* s, const A* z, int64_t rows, Weighting weighting, bool double_sigmoid) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  const bool sigmoid = weighting == Weighting::kDomain ||
      (weighting == Weighting::kFedgo && double_sigmoid);
  if (!z || weighting == Weighting::kUniform) {
    std::fill(s, s + rows, A(0));
  } else if (!sigmoid) {
    std::copy(z, z + rows, s);
  } else {
    // The last vector is partial, so that every row gets the same exp.
    const Vec one(A(1));
    for (int64_t r = 0; r < rows; r += W) {
      const int cnt = static_cast<int>(std::min<int64_t>(W, rows - r));
      (one / (one + (-Vec::loadu(z + r, cnt)).exp())).store(s + r, cnt);
    }
  }
}

// Entropy scores -H / tau of rows [0, rows) from s = sum e^(x - m) and t = sum e^(x - m) (x - m)
// (st holds t on entry): H = log s - t / s, vectorised across rows (the vector form of
// DistillMath::entropy and score).
template <typename A>
void entropy_scores(A* st, const A* s, int64_t rows, A tau) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  // The last vector is partial (its unused lanes load as 0 and are not stored), so that every
  // row gets the same log.
  const Vec tv(tau);
  for (int64_t r = 0; r < rows; r += W) {
    const int cnt = static_cast<int>(std::min<int64_t>(W, rows - r));
    const Vec sv = Vec::loadu(s + r, cnt);
    const Vec ent = sv.log() - Vec::loadu(st + r, cnt) / sv;
    (ent.neg() / tv).store(st + r, cnt);
  }
}

// Scores w[k * R + r] (k < K, r < rows) into the weights of those rows
// (docs/algorithms/distillation.md, "Client weightings"): softmax over clients of
// score + log_prior (vectorised across rows), or the linear normalisation of n_k * score
// (uniform when every mass is 0). `sum` holds R scratch values.
template <typename A>
void block_weights(
    A* w, int64_t K, int64_t R, int64_t rows, const A* log_prior, Weighting weighting, A* sum) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  if (DistillMath::softmax_kind(weighting)) {
    for (int64_t r0 = 0; r0 < rows; r0 += W) {
      const int cnt = static_cast<int>(std::min<int64_t>(W, rows - r0));
      auto load = [&](int64_t k) {
        const Vec v = Vec::loadu(w + k * R + r0, cnt);
        return log_prior ? v + Vec(log_prior[k]) : v;
      };
      Vec m = load(0);
      for (int64_t k = 1; k < K; ++k) m = at::vec::maximum(m, load(k));
      Vec s(A(0));
      for (int64_t k = 0; k < K; ++k) {
        const Vec e = (load(k) - m).exp();
        e.store(w + k * R + r0, cnt);
        s = s + e;
      }
      for (int64_t k = 0; k < K; ++k) (Vec::loadu(w + k * R + r0, cnt) / s).store(w + k * R + r0, cnt);
    }
  } else {
    std::fill(sum, sum + rows, A(0));
    for (int64_t k = 0; k < K; ++k) {
      const A n_k = log_prior ? std::exp(log_prior[k]) : A(1);
      for (int64_t r = 0; r < rows; ++r) {
        w[k * R + r] *= n_k;
        sum[r] += w[k * R + r];
      }
    }
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t r = 0; r < rows; ++r) {
        w[k * R + r] = sum[r] > A(0) ? w[k * R + r] / sum[r] : A(1) / static_cast<A>(K);
      }
    }
  }
}

// Short rows (C < 2 W): W rows at a time, one per vector lane (RowColumns, whose stats give the
// entropy's s and t), also for the combination and the output softmax.
template <typename A>
struct RowLanes : RowColumns<A> {
  using Vec = Vectorized<A>;
  static constexpr int64_t W = Vec::size();
  using RowColumns<A>::C;
  using RowColumns<A>::transpose;

  explicit RowLanes(int64_t C) : RowColumns<A>(C) {}

  // acc[c * W + l] += w[l] x[l * C + c]: the combination of the W rows at x, kept by column.
  void axpy(A* acc, const A* x, const A* w, A* col) const {
    transpose(x, col);
    const Vec wv = Vec::loadu(w);
    for (int64_t c = 0; c < C; ++c) {
      (Vec::loadu(acc + c * W) + wv * Vec::loadu(col + c * W)).store(acc + c * W);
    }
  }

  // y[l * C + c] = softmax(acc / T) of the W rows whose columns acc holds, through col.
  template <typename T>
  void softmax(const A* acc, A inv_t, A* col, T* y) const {
    const Vec it(inv_t);
    Vec m = Vec::loadu(acc);
    for (int64_t c = 1; c < C; ++c) m = at::vec::maximum(m, Vec::loadu(acc + c * W));
    m = m * it;
    Vec s(A(0));
    for (int64_t c = 0; c < C; ++c) {
      const Vec e = (Vec::loadu(acc + c * W) * it - m).exp();
      e.store(col + c * W);
      s = s + e;
    }
    const Vec inv = Vec(A(1)) / s;
    for (int64_t c = 0; c < C; ++c) (Vec::loadu(col + c * W) * inv).store(col + c * W);
    for (int64_t l = 0; l < W; ++l) {
      for (int64_t c = 0; c < C; ++c) y[l * C + c] = static_cast<T>(col[c * W + l]);
    }
  }
};

// Per-thread buffers of distill_kl: the student's and the target's rows in A (for fp16/bf16
// inputs), and the rows' exps (and scaled logits, full-exp rows) in A.
template <typename A>
struct KlScratch {
  // n: the values of a group of rows; converted: of a group of rows converted to A (n if 0).
  KlScratch(int64_t n, bool convert, int64_t converted = 0)
      : s(convert ? std::max(n, converted) : 0), y(convert ? std::max(n, converted) : 0), z(n), e(n) {}

  // src as A: src itself when it already is, else converted into buf.
  template <typename T>
  const A* acc(const T* src, std::vector<A>& buf, int64_t n) {
    if constexpr (std::is_same_v<T, A>) {
      return src;
    } else {
      convert_to_acc(src, buf.data(), n);
      return buf.data();
    }
  }

  std::vector<A> s, y, z, e;
};

// The KL loss of `rows` rows of C values (student logits s, target y, rows contiguous) with
// the full exp, any dtype and any row: z = s / T, log q = (z - m) - log sum e^(z - m), terms
// y (log y - log q) (0 where y = 0; DistillMath::kl_term), and the gradient into g (null: not
// wanted). The rows' exps run over the whole block at once, which short rows need.
template <typename T, typename A>
double kl_rows_full(const A* s, const A* y, int64_t rows, int64_t C, A inv_t, A scale_over_t,
                    T* g, KlScratch<A>& w) {
  const int64_t n = rows * C;
  A* z = w.z.data();
  A* e = w.e.data();
  for (int64_t j = 0; j < n; ++j) z[j] = s[j] * inv_t;
  A row_m[kRowBlock], inv_sum[kRowBlock];
  for (int64_t r = 0; r < rows; ++r) {
    row_m[r] = row_max(z + r * C, C);
    scale_sub(e + r * C, z + r * C, A(1), row_m[r], C);
  }
  exp_inplace(e, n);
  // z becomes log q = (z - m) - log sum e, then the loss terms. (z - m) first: m + log sum
  // rounds log sum away where |m| is large (float32 logits near 3e7 are 2 apart).
  for (int64_t r = 0; r < rows; ++r) {
    const A sum = row_sum<A>(e + r * C, nullptr, C);
    inv_sum[r] = A(1) / sum;
    sub_twice(z + r * C, row_m[r], std::log(sum), C);
  }
  kl_terms(z, y, n);
  double loss = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const A* yr = y + r * C;
    loss += static_cast<double>(row_sum<A>(z + r * C, nullptr, C));
    if (g) {
      const A y_sum = row_sum<A>(yr, nullptr, C);
      const A* er = e + r * C;
      T* gr = g + r * C;
      for (int64_t c = 0; c < C; ++c) {
        gr[c] = static_cast<T>(DistillMath::kl_grad<A>(er[c] * inv_sum[r], yr[c], y_sum, scale_over_t));
      }
    }
  }
  return loss;
}

// log2 y of float vectors (the KL terms are in base 2): +-0 gives -inf, a negative y or NaN gives
// NaN. ATen's log is a call into Sleef, around which the KL pass would keep its sums on the stack,
// so the vector builds take it inline. The AVX-512 build: y = 2^k m with m in [3/4, 3/2)
// (vgetmantps, which also makes a negative y NaN; vgetexpps and one masked add for k), m's top four
// mantissa bits pick one of 16 intervals (a vpermps from a register), r = m / c - 1 with c the
// interval's middle (one fused multiply-subtract by 1 / c, |r| <= 0.031), ln m = ln c + ln(1 + r)
// by four terms of the series (error below 6e-9), and log2 y = k + ln m / ln 2. Fourteen vector
// operations, against nineteen for the atanh series below over [sqrt(1/2), sqrt(2)), which the AVX2
// build keeps (a vpermps there holds only 8 entries): exponent and mantissa from the bits (an
// integer shift and mask), ln m = 2 atanh(u) = 2u + u^3 (2/3 + 2/5 u^2 + 2/7 u^4 + 2/9 u^6),
// u = (m - 1) / (m + 1), |u| <= 0.172, with vrcpps (12 bits) and a Newton step for 1 / (m + 1),
// and the special values put back by compares: +-0 and, as the ops take subnormals as 0, a
// subnormal y give -inf, +inf gives +inf, a negative y or NaN gives NaN. The default build takes
// ATen's log.
#if defined(CPU_CAPABILITY_AVX2)
// log2(2^k m) for m in [sqrt(1/2), sqrt(2)), from r, 1 / (m + 1) to 12 bits or better (one
// Newton step here): the series above.
C10_ALWAYS_INLINE Vectorized<float> log2_of_parts(Vectorized<float> m, Vectorized<float> k,
                                                 Vectorized<float> r) {
  using Vec = Vectorized<float>;
  const Vec one(1.0f), den = m + one;
  r = r * at::vec::fmadd(den.neg(), r, Vec(2.0f));
  const Vec u = (m - one) * r, u2 = u * u;
  Vec q = at::vec::fmadd(Vec(2.0f / 9), u2, Vec(2.0f / 7));
  q = at::vec::fmadd(q, u2, Vec(2.0f / 5));
  q = at::vec::fmadd(q, u2, Vec(2.0f / 3));
  const Vec log_m = at::vec::fmadd(u * u2, q, u + u);
  return at::vec::fmadd(log_m, Vec(kLog2e), k);  // log2 y = k + ln m / ln 2
}
#endif

C10_ALWAYS_INLINE Vectorized<float> log2_of(Vectorized<float> y) {
#if defined(CPU_CAPABILITY_AVX512)
  // 1 / c and -ln(1 / c) (from the rounded 1 / c, so that r's rounding is the only one) for
  // the 16 intervals: [1 + j/16, 1 + (j+1)/16) for j < 8, [1/2 + j/32, 1/2 + (j+1)/32) above.
  const __m512 inv_c = _mm512_setr_ps(
      0.969696999f, 0.914285719f, 0.864864886f, 0.820512831f, 0.780487776f, 0.744186044f,
      0.711111128f, 0.680851042f, 1.30612242f, 1.25490201f, 1.20754719f, 1.16363633f,
      1.12280703f, 1.08474576f, 1.04918027f, 1.01587307f);
  const __m512 ln_c = _mm512_setr_ps(
      0.030771628f, 0.0896121562f, 0.145181984f, 0.19782573f, 0.247836202f, 0.295464218f,
      0.340926558f, 0.384411722f, -0.267062753f, -0.227057487f, -0.188591182f, -0.151549861f,
      -0.115831822f, -0.0813456401f, -0.0480091646f, -0.0157484151f);
  using Vec = Vectorized<float>;
  const __m512 m = _mm512_getmant_ps(y, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_nan);
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 k = _mm512_getexp_ps(y);
  k = _mm512_mask_add_ps(k, _mm512_cmp_ps_mask(m, one, _CMP_LT_OQ), k, one);  // m < 1: y's f >= 3/2
  // vpermps reads the low four bits of each index: m's top four mantissa bits.
  const __m512i j = _mm512_srli_epi32(_mm512_castps_si512(m), 19);
  const Vec r(_mm512_fmsub_ps(m, _mm512_permutexvar_ps(j, inv_c), one));
  Vec q = at::vec::fmadd(r, Vec(-0.25f), Vec(1.0f / 3));
  q = at::vec::fmadd(q, r, Vec(-0.5f));
  const Vec ln_m = at::vec::fmadd(r * r, q, r) + Vec(_mm512_permutexvar_ps(j, ln_c));
  return at::vec::fmadd(ln_m, Vec(kLog2e), Vec(k));  // log2 y = k + ln m / ln 2
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256i bits = _mm256_castps_si256(y);
  // y = 2^k m with m in [1, 2), read off the bits of a positive normal y
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_castps_si256(one)));
  __m256 k = _mm256_cvtepi32_ps(
      _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  const __m256 high = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), high);
  k = _mm256_add_ps(k, _mm256_and_ps(high, one));
  __m256 out = log2_of_parts(m, k, _mm256_rcp_ps(_mm256_add_ps(m, one)));
  const float inf = std::numeric_limits<float>::infinity();
  out = _mm256_blendv_ps(out, _mm256_set1_ps(-inf), _mm256_cmp_ps(y, zero, _CMP_EQ_OQ));
  out = _mm256_blendv_ps(out, y, _mm256_cmp_ps(y, _mm256_set1_ps(inf), _CMP_EQ_OQ));
  return _mm256_blendv_ps(out, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                          _mm256_cmp_ps(y, zero, _CMP_NGE_UQ));  // y < 0 or NaN
#else
  return y.log() * Vectorized<float>(kLog2e);
#endif
}

// y d, 0 where y == 0 (a NaN y stays NaN): the loss terms, with 0 log 0 = 0. In the AVX-512
// build a compare and a zero-masked multiply, where ATen's blendv of a compare takes four
// operations after the multiply.
C10_ALWAYS_INLINE Vectorized<float> times_nonzero(Vectorized<float> y, Vectorized<float> d) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_NEQ_UQ), y, d);
#else
  const Vectorized<float> zero(0.0f);
  return Vectorized<float>::blendv(y * d, zero, y == zero);
#endif
}

// S = sum_c e_c with e_c = 2^(s_c a + b), 0 where that argument is below kMinExp2 (as
// exp2_softmax_row), of one float row of C >= W values; e is stored into e_out unless null, and
// S is the same either way. Rows longer than kSumChunk are summed in chunks added in float64.
inline float exp2_row_sum(const float* s, int64_t C, float a, float b, float* e_out) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const Vec av(a), bv(b);
  auto one = [&](int64_t c) {
    const Vec y = at::vec::fmadd(Vec::loadu(s + c), av, bv);
    const Vec e = exp2_or_zero(y);
    if (e_out) e.store(e_out + c);
    return e;
  };
  double total = 0;
  for (int64_t c0 = 0; c0 < C; c0 += kSumChunk) {
    const int64_t c1 = std::min(C, c0 + kSumChunk);
    Vec acc0(0.0f), acc1(0.0f);
    int64_t c = c0;
    for (; c + 2 * W <= c1; c += 2 * W) {
      acc0 = acc0 + one(c);
      acc1 = acc1 + one(c + W);
    }
    if (c + W <= c1) {
      acc0 = acc0 + one(c);
      c += W;
    }
    if (c < c1) {  // a full vector ending at c1 (stored again: the same values), lanes masked
      const Vec keep = Vec::arange(0.0f, 1.0f) >= Vec(static_cast<float>(W - (c1 - c)));
      acc1 = acc1 + (one(c1 - W) & keep);
    }
    total += static_cast<double>(lane_sum(acc0 + acc1));
  }
  return static_cast<float>(total);
}

// One float row of C >= W values by base-2 exps: y2_c = s_c (log2 e / T) - m log2 e with m the
// max of s / T, e_c = 2^y2_c (exp2_row_sum), S = sum e, and log q_c = ln 2 (y2_c - log2 S), in
// which the rounding of m log2 e that every y2_c carries cancels. Adds the row's loss
// sum_c y (log y - log q) (0 where y = 0; a NaN or negative y gives NaN) to `loss` and writes
// the gradient (scale / T)(q sum y - y) into g (if not null); false, with nothing done, for a
// row whose max needs the full exp (exp2_row_ok: NaN, +-inf, |m| > 1e7). Passes over the row:
// the max, the exps (stored only for the gradient), the terms with sum y, the gradient; all but
// the first read from cache. The loss does not depend on whether the gradient is wanted.
// In two steps, kl_row_exps (the max and the exps) and kl_row_terms (the rest), which the
// caller takes for a group of rows each: every step ends in a sum over the row that the next
// one waits for, and one row at a time those waits would not overlap.
struct KlRowExps {
  bool ok;  // false: the row needs the full exp (nothing else is set)
  float a, b, sum_e;
};

inline KlRowExps kl_row_exps(const float* s, int64_t C, float inv_t, float* e) {
  const float m = row_max(s, C) * inv_t;
  if (!exp2_row_ok(m)) return {false, 0.0f, 0.0f, 0.0f};
  const float a = inv_t * kLog2e, b = -(m * kLog2e);
  return {true, a, b, exp2_row_sum(s, C, a, b, e)};
}

template <typename T>
void kl_row_terms(const float* s, const float* y, int64_t C, const KlRowExps& x,
                  float scale_over_t, T* g, float* e, double& loss) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const float sum_e = x.sum_e;
  const Vec av(x.a), bv(x.b), log2_sum(std::log2(sum_e));
  // y (log2 y - log2 q) with log2 q = y2 - log2 S; ln 2 times the row's sum is its loss.
  auto term = [&](const Vec& yv, int64_t c) {
    return times_nonzero(yv, (log2_of(yv) + log2_sum) - at::vec::fmadd(Vec::loadu(s + c), av, bv));
  };
  double row_loss = 0, sum_y = 0;  // chunks of kSumChunk added in float64, as row_sum
  for (int64_t c0 = 0; c0 < C; c0 += kSumChunk) {
    const int64_t c1 = std::min(C, c0 + kSumChunk);
    Vec acc(0.0f), acc_y(0.0f);
    int64_t c = c0;
    for (; c + W <= c1; c += W) {
      const Vec yv = Vec::loadu(y + c);
      acc = acc + term(yv, c);
      acc_y = acc_y + yv;
    }
    if (c < c1) {  // a full vector ending at c1, its first lanes masked
      const Vec keep = Vec::arange(0.0f, 1.0f) >= Vec(static_cast<float>(W - (c1 - c)));
      const Vec yv = Vec::loadu(y + c1 - W);
      acc = acc + (term(yv, c1 - W) & keep);
      acc_y = acc_y + (yv & keep);
    }
    row_loss += static_cast<double>(lane_sum(acc));
    sum_y += static_cast<double>(lane_sum(acc_y));
  }
  loss += 0.693147180559945309 * row_loss;  // ln 2 in float64, as the sums
  if (g) {
    // (scale / T)(q sum y - y) with q = e / S: e (scale / T)(sum y / S) - y (scale / T), into
    // g, or for fp16/bf16 into e and then converted.
    const Vec alpha(scale_over_t * (static_cast<float>(sum_y) / sum_e)), beta(scale_over_t);
    float* out = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      out = g;
    } else {
      out = e;
    }
    auto grad_at = [&](int64_t k) {
      return at::vec::fmadd(Vec::loadu(e + k), alpha, -(Vec::loadu(y + k) * beta));
    };
    // The last partial vector as a full one ending at C, from e before the loop overwrites
    // it (when out is e), stored after the loop: where it overlaps, the same values.
    const Vec last = grad_at(C - W);
    for (int64_t c = 0; c + W <= C; c += W) grad_at(c).store(out + c);
    last.store(out + C - W);
    if constexpr (!std::is_same_v<T, float>) convert_from_acc(e, g, C);
  }
}

// Float rows of fewer than kKlLanesMaxClasses classes: W rows at a time, one per vector lane.
// The steps of kl_row_exps and kl_row_terms run down the columns (RowColumns::transpose), with
// each row's max, sum and log sum as vectors and its loss terms summed in its lane in class
// order, so a row's loss and gradient depend on that row alone. A group of fewer than W rows is
// padded with zero rows, which are neither added nor written. Rows whose max needs the full exp
// (exp2_row_ok) are redone after by kl_rows_full, in row order. Rows this short would spend most
// of their time in kl_rows_full's per-row scalar maxima, sums and logs. Scratch: 5 * W * C
// floats.
template <typename T>
void kl_lanes(const float* s, const float* y, int64_t rows, int64_t C, float inv_t,
              float scale_over_t, T* g, float* scratch, KlScratch<float>& w, double& loss) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const RowColumns<float> cols(C);
  float* cs = scratch;          // the columns of s, then of the gradient
  float* cy = cs + W * C;       // of y
  float* ce = cy + W * C;       // the exps
  float* pad = ce + W * C;      // 2 * W * C: the rows of a short group, then the gradient rows
  const Vec a(inv_t * kLog2e);
  for (int64_t r0 = 0; r0 < rows; r0 += W) {
    const int64_t cnt = std::min(W, rows - r0);
    const float* sr = s + r0 * C;
    const float* yr = y + r0 * C;
    if (cnt < W) {
      std::fill(pad, pad + 2 * W * C, 0.0f);
      std::copy(sr, sr + cnt * C, pad);
      std::copy(yr, yr + cnt * C, pad + W * C);
      sr = pad;
      yr = pad + W * C;
    }
    cols.transpose(sr, cs);
    cols.transpose(yr, cy);
    Vec m = Vec::loadu(cs);
    for (int64_t c = 1; c < C; ++c) m = at::vec::maximum(m, Vec::loadu(cs + c * W));
    m = m * Vec(inv_t);  // as kl_row_exps: the max of s, then over T
    alignas(64) float ok[W];
    (m.abs() <= Vec(kExp2RowMaxAbs)).store(ok);  // all ones (NaN bits) where exp2_row_ok
    const Vec b = (m * Vec(kLog2e)).neg();
    Vec sum(0.0f);
    for (int64_t c = 0; c < C; ++c) {
      const Vec y2 = at::vec::fmadd(Vec::loadu(cs + c * W), a, b);
      const Vec e = exp2_or_zero(y2);
      e.store(ce + c * W);
      sum = sum + e;
    }
    const Vec log2_sum = log2_of(sum);
    Vec acc(0.0f), acc_y(0.0f);  // as kl_row_terms: y (log2 y - log2 q), then times ln 2
    for (int64_t c = 0; c < C; ++c) {
      const Vec yv = Vec::loadu(cy + c * W);
      acc = acc + times_nonzero(yv, (log2_of(yv) + log2_sum) -
                                        at::vec::fmadd(Vec::loadu(cs + c * W), a, b));
      acc_y = acc_y + yv;
    }
    alignas(64) float row_loss[W];
    (acc * Vec(kLn2)).store(row_loss);
    T* gr = g ? g + r0 * C : nullptr;
    if (g) {
      // (scale / T)(q sum y - y) with q = e / S, by columns into cs, then back to rows.
      const Vec alpha = Vec(scale_over_t) * acc_y / sum, beta(scale_over_t);
      for (int64_t c = 0; c < C; ++c) {
        at::vec::fmadd(Vec::loadu(ce + c * W), alpha, -(Vec::loadu(cy + c * W) * beta))
            .store(cs + c * W);
      }
      if constexpr (std::is_same_v<T, float>) {
        if (cnt == W) {
          at::vec::transpose_mxn<float>(cs, W, gr, C, static_cast<int>(C), static_cast<int>(W));
        } else {
          at::vec::transpose_mxn<float>(cs, W, pad, C, static_cast<int>(C), static_cast<int>(W));
          std::copy(pad, pad + cnt * C, gr);
        }
      } else {
        at::vec::transpose_mxn<float>(cs, W, pad, C, static_cast<int>(C), static_cast<int>(W));
        convert_from_acc(pad, gr, cnt * C);
      }
    }
    for (int64_t l = 0; l < cnt; ++l) {
      if (ok[l] != 0.0f) {  // 0 bits: the row needs the full exp
        loss += static_cast<double>(row_loss[l]);
      } else {
        loss += kl_rows_full(s + (r0 + l) * C, y + (r0 + l) * C, 1, C, inv_t, scale_over_t,
                             gr ? gr + l * C : nullptr, w);
      }
    }
  }
}

struct DistillCpu {
  template <typename T>
  static void pseudo_labels(const PseudoLabelPlan& p) {
    const DenormalModeScope flush(kFlushDenormals);  // see "Subnormals" at the top
    using A = acc_type<T>;
    const int64_t K = p.K, N = p.N, C = p.C;
    const T* logits = static_cast<const T*>(p.logits);
    const A* scores = static_cast<const A*>(p.scores);
    const A* log_prior = static_cast<const A*>(p.log_prior);
    T* out_y = static_cast<T*>(p.out_labels);
    T* out_w = static_cast<T*>(p.out_weights);
    const A inv_t = static_cast<A>(1.0 / p.temperature);
    const A tau = static_cast<A>(p.tau);
    const bool entropy = p.weighting == Weighting::kEntropy;
    const bool variance = p.weighting == Weighting::kVariance;
    using Lanes = RowLanes<A>;
    constexpr int64_t W = Lanes::W;
    const bool lanes = Lanes::applies(C) && !p.probs;
    const int64_t bytes = (K + 1) * N * C * int64_t(sizeof(T)) + K * N * int64_t(sizeof(T));
    int64_t R = std::min(block_rows(C, N), std::max<int64_t>(1, kBlockScores / K));
    if (lanes && R > W) R = R / W * W;  // whole lane groups, except in the last block
    R = split_for_threads(R, N, lanes && R >= W ? W : 1, bytes, PassCost::kArithmetic);
    const int64_t blocks = (N + R - 1) / R;

    // combine = "probs" with float rows of a vector's width or more keeps every teacher's exps
    // of a block (base 2, exp2_row_sum) for the combination, which then takes
    // kCombineGroup teachers per pass (combine_rows); otherwise the exps are taken again there.
    const bool keep_exps = p.probs && std::is_same_v<A, float> && C >= W &&
        K * R * C <= kKeptBlocksElems;
    const bool keep_converted = !std::is_same_v<T, A> && K * R * C <= kKeptBlocksElems;
    parallel_for_bytes(0, blocks, 1, bytes, PassCost::kArithmetic, [&](int64_t b0, int64_t b1) {
      const Lanes lane(C);
      const int64_t E = R * C;
      std::vector<A> kept(keep_exps ? K * E : 0), coef(keep_exps ? K * R : 0);  // [K][E], [K][R]
      std::vector<A> col(lanes ? C * W : 0);
      // fp16/bf16 teachers' blocks in A: every teacher's, converted once per block (for the
      // scores and the combination), or, past kKeptBlocksElems, teacher k's at a time.
      std::vector<A> xk(keep_converted ? K * E : std::is_same_v<T, A> ? 0 : E);
      std::vector<char> converted(K);
      std::vector<A> tmp(E), acc(E);
      std::vector<A> w(K * R);  // [K][R]: scores, then weights
      std::vector<A> max_t(p.probs ? K * R : 0), sum_t(p.probs ? K * R : 0);  // [K][R]
      std::vector<A> row_m(R), row_s(R);
      SoftmaxStats<A> stats(entropy ? C : 0, entropy ? R : 0);  // the entropy's s and t
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t i0 = b * R, rows = std::min(R, N - i0), n = rows * C;
        std::fill(converted.begin(), converted.end(), 0);
        auto block = [&](int64_t k) -> const A* {
          const T* src = logits + (k * N + i0) * C;
          if constexpr (std::is_same_v<T, A>) {
            return src;
          } else {
            A* dst = xk.data() + (keep_converted ? k * E : 0);
            if (!keep_converted || !converted[k]) convert_to_acc(src, dst, n);
            converted[k] = 1;
            return dst;
          }
        };

        // Per-client scores, and the softmax statistics for combine = "probs".
        for (int64_t k = 0; k < K; ++k) {
          A* sk = w.data() + k * R;
          if (!entropy && !variance) {
            z_scores<A>(sk, scores ? scores + k * N + i0 : nullptr, rows, p.weighting, p.double_sigmoid);
          }
          if (!entropy && !variance && !p.probs) continue;  // the rows are not needed yet
          const A* x = block(k);
          if (entropy) {
            // s and t of each row (t in sk until entropy_scores; SoftmaxStats). Float rows read
            // straight from L: the blocks this thread reads next (SoftmaxStats::Ahead),
            // teacher by teacher and block by block.
            typename SoftmaxStats<A>::Ahead ahead;
            if constexpr (std::is_same_v<T, A>) {
              auto later = [&](int64_t by, const A*& at, int64_t& at_rows) {
                const int64_t bb = b + (k + by) / K, kk = (k + by) % K;
                if (bb >= b1) return;
                at = logits + (kk * N + bb * R) * C;
                at_rows = std::min(R, N - bb * R);
              };
              later(1, ahead.next, ahead.next_rows);
              later(2, ahead.after, ahead.after_rows);
              if (K * N * C * int64_t(sizeof(T)) > kEntropyFarMinBytes) {
                later(kEntropyFarBlock, ahead.far, ahead.far_rows);
              }
            }
            stats.compute(x, rows, row_m.data(), row_s.data(), sk, ahead);
            entropy_scores<A>(sk, row_s.data(), rows, tau);
          } else if (variance) {
            for (int64_t r = 0; r < rows; ++r) {
              const A* xr = x + r * C;
              const A mean = row_sum<A>(xr, nullptr, C) / static_cast<A>(C);
              A* d = tmp.data() + r * C;
              scale_sub(d, xr, A(1), mean, C);
              const A var = row_sum<A>(d, d, C) / static_cast<A>(C);
              sk[r] = DistillMath::score<A>(p.weighting, 0, 0, var, tau, p.double_sigmoid);
            }
          }
          if (p.probs) {
            if (!entropy) {
              for (int64_t r = 0; r < rows; ++r) row_m[r] = row_max(x + r * C, C);
            }
            A* mk = max_t.data() + k * R;
            if (keep_exps) {
              if constexpr (std::is_same_v<A, float>) {
                for (int64_t r = 0; r < rows; ++r) {
                  mk[r] = row_m[r] * inv_t;
                  A* e = kept.data() + k * E + r * C;
                  if (exp2_row_ok(mk[r])) {  // the exps and their sum in one pass
                    sum_t[k * R + r] =
                        exp2_row_sum(x + r * C, C, inv_t * kLog2e, -(mk[r] * kLog2e), e);
                  } else {
                    scale_sub(e, x + r * C, inv_t, mk[r], C);
                    exp_inplace(e, C);
                    sum_t[k * R + r] = row_sum<A>(e, nullptr, C);
                  }
                }
              }
            } else {
              for (int64_t r = 0; r < rows; ++r) {
                mk[r] = row_m[r] * inv_t;
                scale_sub(tmp.data() + r * C, x + r * C, inv_t, mk[r], C);
              }
              exp_inplace(tmp.data(), n);
              for (int64_t r = 0; r < rows; ++r) {
                sum_t[k * R + r] = row_sum<A>(tmp.data() + r * C, nullptr, C);
              }
            }
          }
        }
        block_weights<A>(w.data(), K, R, rows, log_prior, p.weighting, row_m.data());
        for (int64_t k = 0; k < K; ++k) {
          for (int64_t r = 0; r < rows; ++r) out_w[k * N + i0 + r] = static_cast<T>(w[k * R + r]);
        }

        // Combination in client order: y = sum_k w_k L_k, per row. Long rows of fp32/fp64 logits
        // take kCombineGroup teachers per read and write of the accumulator.
        std::fill(acc.begin(), acc.begin() + n, A(0));
        const bool grouped =
            ((std::is_same_v<T, A> || keep_converted) && !p.probs && !lanes) || keep_exps;
        if (keep_exps) {  // y = sum_k (w_k / s_k) e_k from the kept exps
          for (int64_t k = 0; k < K; ++k) {
            for (int64_t r = 0; r < rows; ++r) coef[k * R + r] = w[k * R + r] / sum_t[k * R + r];
          }
          combine_rows(acc.data(), kept.data(), coef.data(), K, R, rows, E, C);
        } else if (grouped) {
          if constexpr (std::is_same_v<T, A>) {
            combine_rows(acc.data(), logits + i0 * C, w.data(), K, R, rows, N * C, C);
          } else {
            for (int64_t k = 0; k < K; ++k) block(k);  // those the scores did not need
            combine_rows(acc.data(), xk.data(), w.data(), K, R, rows, E, C);
          }
        }
        for (int64_t k = 0; k < K && !grouped; ++k) {
          const A* x = block(k);
          if (!p.probs) {
            int64_t r = 0;
            for (; lanes && r + W <= rows; r += W) lane.axpy(&acc[r * C], x + r * C, &w[k * R + r], col.data());
            for (; r < rows; ++r) axpy(acc.data() + r * C, x + r * C, w[k * R + r], C);
          } else {
            for (int64_t r = 0; r < rows; ++r) {
              scale_sub(tmp.data() + r * C, x + r * C, inv_t, max_t[k * R + r], C);
            }
            exp_inplace(tmp.data(), n);
            for (int64_t r = 0; r < rows; ++r) {
              axpy(acc.data() + r * C, tmp.data() + r * C, w[k * R + r] / sum_t[k * R + r], C);
            }
          }
        }
        T* y = out_y + i0 * C;
        if (p.probs) {
          convert_from_acc(acc.data(), y, n);
          continue;
        }
        // y = softmax(acc / T).
        int64_t r0 = 0;
        for (; lanes && r0 + W <= rows; r0 += W) lane.softmax(&acc[r0 * C], inv_t, col.data(), y + r0 * C);
        for (int64_t r = r0; r < rows; ++r) {
          const A* a = acc.data() + r * C;
          A* e = tmp.data() + r * C;
          const A m = row_max(a, C) * inv_t;
          if constexpr (std::is_same_v<A, float>) {
            // Long rows in base 2 (short ones are the lanes' tails: same exp as the lanes).
            if (C >= 2 * W && exp2_row_ok(m)) {
              exp2_softmax_row(a, C, inv_t, m, e);
              continue;
            }
          }
          scale_sub(e, a, inv_t, m, C);
          exp_inplace(e, C);
        }
        for (int64_t r = r0; r < rows; ++r) {
          A* e = tmp.data() + r * C;
          const A inv_sum = A(1) / row_sum<A>(e, nullptr, C);
          if constexpr (std::is_same_v<T, A>) {
            for (int64_t c = 0; c < C; ++c) y[r * C + c] = e[c] * inv_sum;
          } else {  // scaled in place, then converted by vector instructions
            for (int64_t c = 0; c < C; ++c) e[c] *= inv_sum;
            convert_from_acc(e, y + r * C, C);
          }
        }
      }
    });
  }

  template <typename T>
  static void distill_kl(const DistillKLPlan& p) {
    const DenormalModeScope flush(kFlushDenormals);  // see "Subnormals" at the top
    using A = acc_type<T>;
    const int64_t N = p.N, C = p.C;
    const T* student = static_cast<const T*>(p.student);
    const T* target = static_cast<const T*>(p.target);
    T* grad = static_cast<T*>(p.grad);
    const A inv_t = static_cast<A>(1.0 / p.temperature);
    const A scale_over_t = static_cast<A>(p.scale / p.temperature);
    // Rows per loss partial: about 32 blocks, so that two threads share them evenly, at least 8
    // rows (smaller blocks only add their overhead), and from N alone, so that the loss has the
    // same bits for any number of threads.
    // Float rows of a vector's width or more take the base-2 row kernel (kl_row_exps, then
    // kl_row_terms) in groups of up to kKlGroupRows rows of kKlGroupElems values in all;
    // shorter float rows a vector's width of rows at a time (kl_lanes), whose blocks are whole
    // groups of lanes (so from N and the lane width); float64 goes kBlockElems elements at a time.
    constexpr bool kFloat = std::is_same_v<A, float>;
    constexpr int64_t W = Vectorized<A>::size();
    const bool by_lanes = kFloat && C < kKlLanesMaxClasses;
    const bool by_row = kFloat && !by_lanes;
    int64_t loss_rows = std::clamp<int64_t>(N / 32, 8, kRowBlock);
    if (by_lanes) loss_rows = (loss_rows + W - 1) / W * W;
    const int64_t blocks = (N + loss_rows - 1) / loss_rows;
    const int64_t R = by_row     ? std::clamp<int64_t>(kKlGroupElems / C, 1, kKlGroupRows)
                      : by_lanes ? loss_rows
                                 : std::min(loss_rows, block_rows(C, N));
    std::vector<double> partial(blocks, 0.0);

    const int64_t bytes = (grad ? 3 : 2) * N * C * int64_t(sizeof(T));
    parallel_for_bytes(0, blocks, 1, bytes, PassCost::kArithmetic, [&](int64_t b0, int64_t b1) {
      KlScratch<A> w(by_lanes ? C : R * C, !std::is_same_v<T, A>, by_lanes ? R * C : 0);
      std::vector<A> lanes(by_lanes ? 5 * W * C : 0);
      for (int64_t b = b0; b < b1; ++b) {
        double block_loss = 0;
        const int64_t end = std::min(N, (b + 1) * loss_rows);
        for (int64_t i0 = b * loss_rows; i0 < end; i0 += R) {
          const int64_t rows = std::min(R, end - i0), n = rows * C;
          const A* s = w.acc(student + i0 * C, w.s, n);
          const A* y = w.acc(target + i0 * C, w.y, n);
          T* g = grad ? grad + i0 * C : nullptr;
          if constexpr (kFloat) {
            if (by_lanes) {
              kl_lanes(s, y, rows, C, inv_t, scale_over_t, g, lanes.data(), w, block_loss);
              continue;
            }
            if (by_row) {
              // The group's exps, then its terms, each row's loss added in row order (the
              // same bits as one row at a time). A row that needs the full exp takes it in
              // its turn: kl_rows_full of one row writes w.e[0, C), which holds row 0's exps,
              // used by then.
              KlRowExps x[kKlGroupRows];
              for (int64_t r = 0; r < rows; ++r) {
                x[r] = kl_row_exps(s + r * C, C, inv_t, g ? w.e.data() + r * C : nullptr);
              }
              for (int64_t r = 0; r < rows; ++r) {
                T* gr = g ? g + r * C : nullptr;
                if (x[r].ok) {
                  kl_row_terms(s + r * C, y + r * C, C, x[r], scale_over_t, gr,
                               w.e.data() + r * C, block_loss);
                } else {
                  block_loss += kl_rows_full(s + r * C, y + r * C, 1, C, inv_t, scale_over_t,
                                             gr, w);
                }
              }
              continue;
            }
          }
          block_loss += kl_rows_full(s, y, rows, C, inv_t, scale_over_t, g, w);
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
