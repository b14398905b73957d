// CPU kernels of the ensemble-distillation ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/distill_host.h; per-row math: DistillMath in csrc/elementwise.h). Like every csrc/cpu/*.cpp
// this file is compiled once per instruction set (see setup.py) into a library of its own.
//
// Work: blocks of R consecutive samples (rows), R * C about kBlockElems, are the parallel unit.
// Teacher k's rows of a block are contiguous in L[k], so each pass runs over R * C contiguous
// elements: per-row maxima and sums are full vectors plus scalar tails, exps run over the whole
// block at once, and per-row constants sit in small per-block arrays. The entropy weighting's exps
// take most of its time: float rows use exp2_sums (base 2, ten vector operations per vector of
// logits). Short rows (C < 2 vector widths) go a vector's width of rows at a time, one row per lane
// (RowLanes). Scores and weights are computed for a block of rows at once, vectorised across rows.
// The weighted combination takes four teachers per pass over a row's accumulator (a third of the
// loads and stores of one pass per teacher: FedGO at K = 40, N = 4096, C = 1000 went from ~41 to
// ~27 ms). Every value of a row is computed from that row alone, in client order, with the lane
// layout fixed by C, so the results do not depend on the blocking or the number of threads. The KL
// loss is summed per block of kRowBlock rows in float64 and the blocks are added in order after the
// parallel loop.
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

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kRowBlock = 64;      // rows per KL loss partial
constexpr int64_t kBlockElems = 2048;  // elements of one teacher's rows per block (R * C)
constexpr int64_t kBlockScores = 65536;  // bound on K * R, the per-block scores and weights
constexpr int kCombineGroup = 4;  // teachers per pass of the combination (8 was no faster)

// Rows per block for rows of C elements: about kBlockElems elements, at least one row.
inline int64_t block_rows(int64_t C, int64_t N) {
  return std::max<int64_t>(1, std::min<int64_t>(N, kBlockElems / C));
}

// The helpers below run over one row x[0..n): full vectors and a scalar tail, never a partial
// vector (ATen loads and stores those through a temporary buffer, which dominates short rows).
// They are small and called once per row, so they are always inlined.

// sum_c x_c (y == nullptr) or sum_c x_c y_c.
template <typename A>
C10_ALWAYS_INLINE A row_sum(const A* x, const A* y, int64_t n) {
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

// y_c += a_0 x0_c, then += a_1 x1_c, ... for G rows x_g: G passes of y += a x in one read and
// write of y, every product and sum rounded as in G separate passes, so the result is the same.
template <int G, typename A>
C10_ALWAYS_INLINE void axpy_group(A* y, const A* const* x, const A* a, int64_t n) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  Vec av[G];
  for (int g = 0; g < G; ++g) av[g] = Vec(a[g]);
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    Vec acc = Vec::loadu(y + c);
    for (int g = 0; g < G; ++g) acc = acc + av[g] * Vec::loadu(x[g] + c);
    acc.store(y + c);
  }
  for (; c < n; ++c) {
    A acc = y[c];
    for (int g = 0; g < G; ++g) acc += a[g] * x[g][c];
    y[c] = acc;
  }
}

// y_c += a * x_c.
template <typename A>
C10_ALWAYS_INLINE void axpy(A* y, const A* x, A a, int64_t n) {
  axpy_group<1>(y, &x, &a, n);
}

// Raw lane-wise max(a, b): b where either is NaN (the x86 rule), so a NaN in b survives. One
// instruction, against three for the NaN-propagating at::vec::maximum.
C10_ALWAYS_INLINE Vectorized<float> max_raw(Vectorized<float> a, Vectorized<float> b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_max_ps(a, b);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_max_ps(a, b);
#else
  return Vectorized<float>::blendv(Vectorized<float>::blendv(a, b, b > a), b, b != b);
#endif
}

// The sum and the (NaN-blind, as max_raw) maximum of a float vector's lanes. The sum adds in
// ATen's vec_reduce_all order (lane i with lane i + 8, then i + 4, i + 2, i + 1), so its bits
// are the same; the AVX-512 build goes through the register's halves, since Zen 4 runs 512-bit
// shuffles at a fraction of the speed of 256-bit ones (the two reductions of a row of C = 100
// logits took a fifth of its entropy pass).
#if defined(CPU_CAPABILITY_AVX512)
template <typename Op256, typename Op128>
C10_ALWAYS_INLINE float lane_reduce(Vectorized<float> v, Op256 op256, Op128 op128) {
  const __m512 x = v;
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m256 h = op256(_mm512_castps512_ps256(x), hi);
  __m128 q = op128(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = op128(q, _mm_movehl_ps(q, q));
  q = op128(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}
C10_ALWAYS_INLINE float lane_sum(Vectorized<float> v) {
  return lane_reduce(v, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); },
                     [](__m128 a, __m128 b) { return _mm_add_ps(a, b); });
}
C10_ALWAYS_INLINE float lane_max_raw(Vectorized<float> v) {
  return lane_reduce(v, [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); },
                     [](__m128 a, __m128 b) { return _mm_max_ps(a, b); });
}
#else
C10_ALWAYS_INLINE float lane_sum(Vectorized<float> v) {
  using Vec = Vectorized<float>;
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}
C10_ALWAYS_INLINE float lane_max_raw(Vectorized<float> v) {
  using Vec = Vectorized<float>;
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return max_raw(a, b); }, v);
}
#endif

// max_c x_c, NaN if any x_c is NaN (like at::vec::maximum). Branch-free: the comparisons of
// random data would mispredict. Float rows take the maximum with max_raw in two accumulators and
// OR the unordered lanes apart (a NaN lane's mask is all ones, itself a NaN): a step per vector
// with no dependence through memory. The generic form (kept for float64) passes its accumulator
// to vec_reduce_all by reference, which kept it on the stack: with it a float pseudo-label call
// at K = 1, N = 256, C = 1000 took 147 us instead of 125 (AVX-512, 2-core Zen 4).
template <typename A>
C10_ALWAYS_INLINE A row_max(const A* x, int64_t n) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  if (n < W) {
    A m = x[0];
    bool nan = x[0] != x[0];
    for (int64_t c = 1; c < n; ++c) {
      m = std::max(m, x[c]);
      nan |= x[c] != x[c];
    }
    return nan ? std::numeric_limits<A>::quiet_NaN() : m;
  }
  if constexpr (std::is_same_v<A, float>) {
    Vec a = Vec::loadu(x), b = a, nan = a != a;
    int64_t c = W;
    for (; c + 2 * W <= n; c += 2 * W) {
      const Vec u = Vec::loadu(x + c), v = Vec::loadu(x + c + W);
      a = max_raw(a, u);
      b = max_raw(b, v);
      nan = nan | (u != u) | (v != v);
    }
    // The rest as whole vectors, the last one overlapping: max is idempotent.
    for (; c < n; c += W) {
      const Vec u = Vec::loadu(x + std::min(c, n - W));
      a = max_raw(a, u);
      nan = nan | (u != u);
    }
    const float flag = lane_sum(nan);  // 0, or NaN when a lane was unordered
    return flag != flag ? std::numeric_limits<float>::quiet_NaN() : lane_max_raw(max_raw(a, b));
  } else {
    Vec v = Vec::loadu(x);
    int64_t c = W;
    for (; c + W <= n; c += W) v = at::vec::maximum(v, Vec::loadu(x + c));
    // The last partial vector as an overlapping full one: max is idempotent.
    if (c < n) v = at::vec::maximum(v, Vec::loadu(x + n - W));
    return at::vec::vec_reduce_all<A>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
  }
}

// p * 2^n, from k = n + 1.5 * 2^23 as a float (n an integer in its low mantissa bits): n << 23
// added to p's bits, an integer add that leaves the multipliers free. Exact while the result
// is a normal float.
C10_ALWAYS_INLINE Vectorized<float> scale_by_pow2(Vectorized<float> p, Vectorized<float> k) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_castps_si512(k), 23)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_castps_si256(k), 23)));
#else
  // In uint32, which wraps like the vector integer adds above: exp2_softmax_row also passes
  // y < kMinExp2 (lanes it masks to 0 afterwards), where p's bits plus n << 23 leave the int32
  // range, which would be signed overflow.
  using UVec = Vectorized<uint32_t>;
  return at::vec::cast<float>(
      at::vec::cast<uint32_t>(p) + (at::vec::cast<uint32_t>(k) << UVec(23)));
#endif
}

// 2^y for y in [-125, ~0] (and NaN in, NaN or garbage out: callers check their sums): y = n + f
// with n = round(y) by the 1.5 * 2^23 trick and f = y - n exact in [-1/2, 1/2], 2^f by a
// degree-5 polynomial with 2^0 = 1 exactly (minimax in relative error, 2.2e-7 measured in float
// arithmetic), and 2^n added to the exponent. Ten vector operations, five of them fused
// multiply-adds: the base-2 form drops the two-part ln 2 reduction, and the integer scaling
// drops a multiply.
C10_ALWAYS_INLINE Vectorized<float> exp2_poly(Vectorized<float> y) {
  using Vec = Vectorized<float>;
  const Vec shift(12582912.0f);  // 1.5 * 2^23
  const Vec k = y + shift;
  const Vec f = y - (k - shift);
  Vec p = at::vec::fmadd(Vec(0.0013202982f), f, Vec(0.0096749524f));
  p = at::vec::fmadd(p, f, Vec(0.055510473f));
  p = at::vec::fmadd(p, f, Vec(0.24022166f));
  p = at::vec::fmadd(p, f, Vec(0.69314659f));
  p = at::vec::fmadd(p, f, Vec(1.0f));
  return scale_by_pow2(p, k);
}

// The entropy pass (docs/algorithms/distillation.md, "Ops") needs, per teacher row x with max
// m, s = sum_c e^(x_c - m) and t = sum_c e^(x_c - m) (x_c - m), from which H = log s - t / s.
// It is bound by those exps, so float rows take them in base 2: y_c = x_c log2 e - m log2 e in
// one FMA (the rounding of m log2 e moves every y_c of the row alike, which H does not see),
// clamped to y >= kMinExp2 so that 2^y stays a normal float (a logit more than 86 below the max
// adds ~1e-38 where it should add 0: invisible next to the max's 1, and a -inf logit stays
// finite), then s = sum 2^y and t = ln 2 * sum 2^y y. That needs |m log2 e| < 2^24, so that
// the max's own y (the residual of that rounding) is at most 1/2: exp2_row_ok. Other rows
// (NaN, +-inf or huge maxima, and float64) take the full exp (exp_sums_full).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;
constexpr float kMinExp2 = -125.0f;

template <typename A>
C10_ALWAYS_INLINE bool exp2_row_ok(A m) {
  return std::is_same_v<A, float> && std::abs(m) <= A(1e7);  // false for NaN and +-inf too
}

// y = max(kMinExp2, x log2 e + b) with b = -(m log2 e); a NaN x stays NaN (max_raw).
C10_ALWAYS_INLINE Vectorized<float> exp2_arg(Vectorized<float> x, Vectorized<float> b) {
  return max_raw(Vectorized<float>(kMinExp2), at::vec::fmadd(x, Vectorized<float>(kLog2e), b));
}

// e_c = e^(a_c / T - m) of one float row of C >= W values, m = max(a) / T with exp2_row_ok(m):
// in base 2 as in exp2_sums, y_c = a_c (log2 e / T) - m log2 e, and e_c = 0 exactly where
// y_c < kMinExp2 (a class more than ~86 below the max, or -inf), as the full exp gives 0 there
// to float precision. The last vector overlaps the one before it (same values stored twice).
inline void exp2_softmax_row(const float* a, int64_t C, float inv_t, float m, float* e) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const Vec scale(inv_t * kLog2e), b(-(m * kLog2e)), lo(kMinExp2);
  auto one = [&](int64_t c) {
    const Vec y = at::vec::fmadd(Vec::loadu(a + c), scale, b);
    (exp2_poly(y) & (y >= lo)).store(e + c);
  };
  int64_t c = 0;
  for (; c + W <= C; c += W) one(c);
  if (c < C) one(C - W);
}

// s and t (above) of one long float row (n >= 2 W) with exp2_row_ok(m), in one read, in base 2 (t
// is sum 2^y y, not yet times ln 2), as the vectors s[0..W) and t[0..W) whose lanes add up to
// them: the caller adds the lanes of a block's rows after all their exps (a row's lane sums
// right after its exps were a chain of dependent shuffles that held up the next row). The row
// max m may come from max_raw, which can miss a NaN: a NaN logit makes t NaN (through y), and
// the caller then redoes the row with exp_sums_full. The
// exps are compute bound, so while they run the same span of the next block to be read (pf, if not
// null) is prefetched, a cache line per line of x: its loads then overlap this row's arithmetic.
// Rows of kPrefetchToL2Classes or more prefetch into L2 (kLocality 2), shorter ones into L1 (3).
// Measured on a 2-core Zen 4, both prefetch kinds timed in one process (K = 40, 655 MB): in
// the AVX-512 build rows of 900 to 4000 classes took 12-18 % less time with L2 (long rows'
// prefetches into L1 held the core's few L1 miss buffers, and the exps stalled behind them),
// rows of 100 to 700 classes 10-25 % more; the AVX2 build was even (+-4 %) from 900 classes and
// also lost with L2 below.
constexpr int64_t kPrefetchToL2Classes = 800;

template <int kLocality>
C10_ALWAYS_INLINE void exp2_sums(const float* x, int64_t n, float m, float* s, float* t,
                                const float* pf) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const Vec b(-(m * kLog2e));
  Vec sv(0.0f), tv(0.0f);
  int64_t c = 0;
  constexpr int64_t kLine = 64;
  // Two vectors per step, each sum with one add (the pair summed first): two accumulators
  // instead of four keep every register of the step in the register file.
  for (; c + 2 * W <= n; c += 2 * W) {
    if (pf) {
      const char* p = reinterpret_cast<const char*>(pf + c);
      for (int64_t o = 0; o < 2 * W * int64_t(sizeof(float)); o += kLine) {
        __builtin_prefetch(p + o, 0, kLocality);
      }
    }
    const Vec y0 = exp2_arg(Vec::loadu(x + c), b), y1 = exp2_arg(Vec::loadu(x + c + W), b);
    const Vec e0 = exp2_poly(y0), e1 = exp2_poly(y1);
    sv = sv + (e0 + e1);
    tv = tv + at::vec::fmadd(e1, y1, e0 * y0);
  }
  if (c + W <= n) {
    const Vec y = exp2_arg(Vec::loadu(x + c), b);
    const Vec e = exp2_poly(y);
    sv = sv + e;
    tv = at::vec::fmadd(e, y, tv);
    c += W;
  }
  if (c < n) {
    // The last partial vector as a full one ending at x + n (the row is long), its first
    // lanes, counted already, masked to 0.
    const Vec keep = Vec::arange(0.0f, 1.0f) >= Vec(static_cast<float>(W - (n - c)));
    const Vec y = exp2_arg(Vec::loadu(x + n - W), b) & keep;
    const Vec e = exp2_poly(y) & keep;
    sv = sv + e;
    tv = at::vec::fmadd(e, y, tv);
  }
  sv.store(s);
  tv.store(t);
}

// s and t (above) of one row with the full exp (any m, any A), in one read. NaN and +-inf
// carry through (a NaN or infinite max makes H NaN, as in the reference); a class with e = 0 (a
// -inf logit) adds 0 to t, not 0 * -inf.
template <typename A>
void exp_sums_full(const A* x, int64_t n, A m, A& s, A& t) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  const Vec mv(m), zero(A(0));
  Vec sv(zero), tv(zero);
  for (int64_t c = 0; c < n; c += W) {
    const int64_t cnt = std::min<int64_t>(W, n - c);
    const Vec d = Vec::set(zero, Vec::loadu(x + c, cnt) - mv, cnt);
    const Vec e = Vec::set(zero, d.exp(), cnt);
    sv = sv + e;
    tv = tv + ((e * d) & (e != zero));
  }
  s = at::vec::vec_reduce_all<A>([](Vec& a, Vec& v) { return a + v; }, sv);
  t = at::vec::vec_reduce_all<A>([](Vec& a, Vec& v) { return a + v; }, tv);
}

// at::vec::fmadd's rounding for one float: fused in the AVX2 and AVX-512 builds, a multiply and
// an add in the default one.
C10_ALWAYS_INLINE float fmadd1(float a, float b, float c) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// e = 2^y over a whole block of exp2_arg values (the short rows' entropy pass).
inline void exp2_inplace(const float* y, float* e, int64_t n) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  int64_t c = 0;
  for (; c + W <= n; c += W) exp2_poly(Vec::loadu(y + c)).store(e + c);
  if (c < n) exp2_poly(Vec::loadu(y + c, n - c)).store(e + c, n - c);
}

// s and t (t times ln 2) of one short float row (C < 2 vector widths) with exp2_row_ok(m),
// summed in class order as RowLanes::entropy_stats does, so a row gets the same bits by lanes
// or alone. y and e: C scratch values each.
inline void exp2_sums_in_order(const float* x, int64_t C, float m, float* y, float* e, float& s,
                               float& t) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const Vec b(-(m * kLog2e));
  for (int64_t c = 0; c < C; c += W) {
    const int cnt = static_cast<int>(std::min<int64_t>(W, C - c));
    exp2_arg(Vec::loadu(x + c, cnt), b).store(y + c, cnt);
  }
  exp2_inplace(y, e, C);
  s = t = 0.0f;
  for (int64_t c = 0; c < C; ++c) {
    s += e[c];
    t = fmadd1(e[c], y[c], t);
  }
  t *= kLn2;
}

// max_c x_c with max_raw: NaN-blind (a NaN may be skipped or returned); for exp2_sums only.
C10_ALWAYS_INLINE float row_max_raw(const float* x, int64_t n) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  if (n < 2 * W) return row_max(x, n);
  Vec a = Vec::loadu(x), b = Vec::loadu(x + W);
  int64_t c = 2 * W;
  for (; c + 2 * W <= n; c += 2 * W) {
    a = max_raw(a, Vec::loadu(x + c));
    b = max_raw(b, Vec::loadu(x + c + W));
  }
  for (; c + W <= n; c += W) a = max_raw(a, Vec::loadu(x + c));
  if (c < n) b = max_raw(b, Vec::loadu(x + n - W));  // overlapping: max is idempotent
  return lane_max_raw(max_raw(a, b));
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

// Short rows (C < 2 W, where the row helpers are mostly scalar): W rows at a time, one per vector
// lane. The W x C tile is transposed to columns (col[c * W + l] = x[l * C + c]; W x W tiles, the
// last one overlapping), so the per-row maxima and sums become vertical vector operations. They
// run in class order like the scalar loops of the row helpers, so a row gets the same bits
// either way.
template <typename A>
struct RowLanes {
  using Vec = Vectorized<A>;
  static constexpr int64_t W = Vec::size();

  static bool applies(int64_t C) { return C < 2 * W; }

  explicit RowLanes(int64_t C) : C(C) {}

  // col[c * W + l] = x[l * C + c].
  void transpose(const A* x, A* col) const {
    if (C < W) {
      at::vec::transpose_mxn<A>(x, C, col, W, W, static_cast<int>(C));
      return;
    }
    for (int64_t c = 0; c < C; c += W) {
      const int64_t c0 = std::min(c, C - W);
      at::vec::transpose_mxn<A, W, W>(x + c0, C, col + c0 * W, W);
    }
  }

  // m = max x, s and t (as in exp2_sums, t times ln 2) of the W float rows at x, through col
  // (C * W scratch values), in class order like exp2_sums_in_order, so a row gets the same bits
  // either way. False, with nothing stored, when a row needs the full exp (exp2_row_ok), and
  // for float64: the caller then takes those rows one by one.
  bool entropy_stats(const A* x, A* col, A* m, A* s, A* t) const {
    if constexpr (!std::is_same_v<A, float>) {
      return false;
    } else {
      transpose(x, col);
      Vec mv = Vec::loadu(col);
      for (int64_t c = 1; c < C; ++c) mv = at::vec::maximum(mv, Vec::loadu(col + c * W));
      alignas(64) A lanes[W];
      mv.store(lanes);
      for (int64_t l = 0; l < W; ++l) {
        if (!exp2_row_ok(lanes[l])) return false;
      }
      const Vec b = (mv * Vec(kLog2e)).neg();
      Vec sv(A(0)), tv(A(0));
      for (int64_t c = 0; c < C; ++c) {
        const Vec y = exp2_arg(Vec::loadu(col + c * W), b);
        const Vec e = exp2_poly(y);
        sv = sv + e;
        tv = at::vec::fmadd(e, y, tv);
      }
      mv.store(m);
      sv.store(s);
      (tv * Vec(kLn2)).store(t);
      return true;
    }
  }

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

  int64_t C;
};

struct DistillCpu {
  template <typename T>
  static void pseudo_labels(const PseudoLabelPlan& p) {
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
    int64_t R = std::min(block_rows(C, N), std::max<int64_t>(1, kBlockScores / K));
    if (lanes && R > W) R = R / W * W;  // whole lane groups, except in the last block
    const int64_t blocks = (N + R - 1) / R;

    const int64_t bytes = (K + 1) * N * C * int64_t(sizeof(T)) + K * N * int64_t(sizeof(T));
    parallel_for_bytes(0, blocks, 1, bytes, [&](int64_t b0, int64_t b1) {
      const Lanes lane(C);
      const int64_t E = R * C;
      std::vector<A> col(lanes ? C * W : 0);
      std::vector<A> xk(std::is_same_v<T, A> ? 0 : E);  // teacher k's block in A (fp16/bf16)
      std::vector<A> tmp(E), acc(E);
      std::vector<A> w(K * R);  // [K][R]: scores, then weights
      std::vector<A> max_t(p.probs ? K * R : 0), sum_t(p.probs ? K * R : 0);  // [K][R]
      std::vector<A> row_m(R), row_s(R);
      std::vector<float> lane_s(C >= 2 * W ? R * W : 0), lane_t(lane_s.size());  // exp2_sums
      std::vector<A> row_e(C < 2 * W ? C : 0);  // a short row's exps (exp2_sums_in_order)
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t i0 = b * R, rows = std::min(R, N - i0), n = rows * C;
        auto block = [&](int64_t k) -> const A* {
          const T* src = logits + (k * N + i0) * C;
          if constexpr (std::is_same_v<T, A>) {
            return src;
          } else {
            for (int64_t e = 0; e < n; ++e) xk[e] = static_cast<A>(src[e]);
            return xk.data();
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
            // s and t of each row (t in sk until entropy_scores; see exp2_sums): float rows in
            // base 2 where exp2_row_ok, the others (and any row with a NaN) with the full exp.
            // The next block this thread reads: teacher k + 1's rows, or teacher 0's of the next
            // block.
            const T* next = k + 1 < K ? logits + ((k + 1) * N + i0) * C
                : b + 1 < b1            ? logits + (i0 + R) * C
                                        : nullptr;
            const int64_t next_rows = k + 1 < K ? rows : std::min(R, N - i0 - R);
            const A* pf = nullptr;
            if constexpr (std::is_same_v<T, A>) pf = next;
            auto by_rows = [&](int64_t ra, int64_t rb) {
              if constexpr (std::is_same_v<A, float>) {
                if (C >= 2 * W) {
                  // Long rows in three passes over the rows, each of independent rows: the
                  // maxima, the exps and their lane sums (exp2_sums), then the lanes added.
                  // 4-9 % less time than the three steps row by row at C = 40-200 (AVX-512,
                  // 2-core Zen 4, both timed in one process), the same bits.
                  for (int64_t r = ra; r < rb; ++r) row_m[r] = row_max_raw(x + r * C, C);
                  for (int64_t r = ra; r < rb; ++r) {
                    if (!exp2_row_ok(row_m[r])) continue;
                    const A* xr = x + r * C;
                    const float* pr = pf && r < next_rows ? pf + r * C : nullptr;
                    if (C >= kPrefetchToL2Classes) {
                      exp2_sums<2>(xr, C, row_m[r], &lane_s[r * W], &lane_t[r * W], pr);
                    } else {
                      exp2_sums<3>(xr, C, row_m[r], &lane_s[r * W], &lane_t[r * W], pr);
                    }
                  }
                  for (int64_t r = ra; r < rb; ++r) {
                    if (exp2_row_ok(row_m[r])) {
                      const A t2 = lane_sum(Vectorized<float>::loadu(&lane_t[r * W]));
                      if (std::isfinite(t2)) {  // else a NaN logit: the full exp below
                        row_s[r] = lane_sum(Vectorized<float>::loadu(&lane_s[r * W]));
                        sk[r] = t2 * kLn2;
                        continue;
                      }
                    }
                    row_m[r] = row_max(x + r * C, C);
                    exp_sums_full(x + r * C, C, row_m[r], row_s[r], sk[r]);
                  }
                  return;
                }
              }
              for (int64_t r = ra; r < rb; ++r) {
                const A* xr = x + r * C;
                if constexpr (std::is_same_v<A, float>) {  // short rows outside a lane group
                  row_m[r] = row_max(xr, C);
                  if (exp2_row_ok(row_m[r])) {
                    exp2_sums_in_order(xr, C, row_m[r], tmp.data(), row_e.data(), row_s[r], sk[r]);
                    continue;
                  }
                }
                row_m[r] = row_max(xr, C);
                exp_sums_full(xr, C, row_m[r], row_s[r], sk[r]);
              }
            };
            int64_t r = 0;
            for (; lanes && r + W <= rows; r += W) {
              if (!lane.entropy_stats(x + r * C, col.data(), &row_m[r], &row_s[r], sk + r)) {
                by_rows(r, r + W);
              }
            }
            by_rows(r, rows);
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
            for (int64_t r = 0; r < rows; ++r) {
              mk[r] = row_m[r] * inv_t;
              scale_sub(tmp.data() + r * C, x + r * C, inv_t, mk[r], C);
            }
            exp_inplace(tmp.data(), n);
            for (int64_t r = 0; r < rows; ++r) sum_t[k * R + r] = row_sum<A>(tmp.data() + r * C, nullptr, C);
          }
        }
        block_weights<A>(w.data(), K, R, rows, log_prior, p.weighting, row_m.data());
        for (int64_t k = 0; k < K; ++k) {
          for (int64_t r = 0; r < rows; ++r) out_w[k * N + i0 + r] = static_cast<T>(w[k * R + r]);
        }

        // Combination in client order: y = sum_k w_k L_k, per row. Long rows of fp32/fp64 logits
        // take kCombineGroup teachers per read and write of the accumulator.
        std::fill(acc.begin(), acc.begin() + n, A(0));
        const bool grouped = std::is_same_v<T, A> && !p.probs && !lanes;
        if constexpr (std::is_same_v<T, A>) {
          if (grouped) combine_rows(acc.data(), logits + i0 * C, w.data(), K, R, rows, N * C, C);
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
          for (int64_t e = 0; e < n; ++e) y[e] = static_cast<T>(acc[e]);
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
          const A* e = tmp.data() + r * C;
          const A inv_sum = A(1) / row_sum<A>(e, nullptr, C);
          for (int64_t c = 0; c < C; ++c) y[r * C + c] = static_cast<T>(e[c] * inv_sum);
        }
      }
    });
  }

  template <typename T>
  static void distill_kl(const DistillKLPlan& p) {
    using A = acc_type<T>;
    const int64_t N = p.N, C = p.C;
    const T* student = static_cast<const T*>(p.student);
    const T* target = static_cast<const T*>(p.target);
    T* grad = static_cast<T*>(p.grad);
    const A inv_t = static_cast<A>(1.0 / p.temperature);
    const A scale_over_t = static_cast<A>(p.scale / p.temperature);
    const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
    // Each loss block runs in chunks of R rows, about kBlockElems elements.
    const int64_t R = std::min(kRowBlock, block_rows(C, N));
    std::vector<double> partial(blocks, 0.0);

    const int64_t bytes = (grad ? 3 : 2) * N * C * int64_t(sizeof(T));
    parallel_for_bytes(0, blocks, 1, bytes, [&](int64_t b0, int64_t b1) {
      std::vector<A> z(R * C), e(R * C), yv(R * C), row_m(R), inv_sum(R);
      for (int64_t b = b0; b < b1; ++b) {
        double block_loss = 0;
        const int64_t end = std::min(N, (b + 1) * kRowBlock);
        for (int64_t i0 = b * kRowBlock; i0 < end; i0 += R) {
          const int64_t rows = std::min(R, end - i0), n = rows * C;
          const T* s = student + i0 * C;
          const T* y = target + i0 * C;
          for (int64_t j = 0; j < n; ++j) z[j] = static_cast<A>(s[j]) * inv_t;
          for (int64_t j = 0; j < n; ++j) yv[j] = static_cast<A>(y[j]);
          for (int64_t r = 0; r < rows; ++r) {
            row_m[r] = row_max(z.data() + r * C, C);
            scale_sub(e.data() + r * C, z.data() + r * C, A(1), row_m[r], C);
          }
          exp_inplace(e.data(), n);
          // z becomes log q = z - (m + log sum e), then the loss terms.
          for (int64_t r = 0; r < rows; ++r) {
            const A sum = row_sum<A>(e.data() + r * C, nullptr, C);
            inv_sum[r] = A(1) / sum;
            scale_sub(z.data() + r * C, z.data() + r * C, A(1), row_m[r] + std::log(sum), C);
          }
          kl_terms(z.data(), yv.data(), n);
          for (int64_t r = 0; r < rows; ++r) {
            const A* yr = yv.data() + r * C;
            const A row_loss = row_sum<A>(z.data() + r * C, nullptr, C);
            if (grad) {
              const A y_sum = row_sum<A>(yr, nullptr, C);
              const A* er = e.data() + r * C;
              T* g = grad + (i0 + r) * C;
              for (int64_t c = 0; c < C; ++c) {
                g[c] = static_cast<T>(
                    DistillMath::kl_grad<A>(er[c] * inv_sum[r], yr[c], y_sum, scale_over_t));
              }
            }
            block_loss += static_cast<double>(row_loss);
          }
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
