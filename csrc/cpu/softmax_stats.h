// Softmax statistics of rows of logits, for the CPU kernels that need them per row (the entropy
// weighting of the pseudo-labels, the energies of FedEvg): the row maxima m, and
// s = sum_c e^(x_c - m) and t = sum_c e^(x_c - m) (x_c - m), from which log-sum-exp = m + log s
// and the entropy H = log s - t / s. They are bound by the exps, so float rows take them in base
// 2 with a polynomial (exp2_poly); rows that need more range, and float64, take ATen's exp.
// SoftmaxStats runs the whole computation over a block of rows; the helpers below it are also
// used on their own by csrc/cpu/distill.cpp.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace fedkernels {
namespace softmax_stats {

using at::vec::Vectorized;

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
// shuffles at a fraction of the speed of 256-bit ones.
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

// The sum and the maximum (NaN if a lane is NaN) of a float64 vector's lanes, in registers:
// ATen's vec_reduce_all goes through the stack, which would cost a short row more than its
// exps.
C10_ALWAYS_INLINE double lane_sum(Vectorized<double> v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_pd(v);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
#else
  using Vec = Vectorized<double>;
  return at::vec::vec_reduce_all<double>([](Vec& a, Vec& b) { return a + b; }, v);
#endif
}
C10_ALWAYS_INLINE double lane_max(Vectorized<double> v) {
#if defined(CPU_CAPABILITY_AVX512)
  if (_mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q) != 0) return std::numeric_limits<double>::quiet_NaN();
  return _mm512_reduce_max_pd(v);
#elif defined(CPU_CAPABILITY_AVX2)
  if (_mm256_movemask_pd(_mm256_cmp_pd(v, v, _CMP_UNORD_Q)) != 0) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const __m128d h = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_max_sd(h, _mm_unpackhi_pd(h, h)));
#else
  using Vec = Vectorized<double>;
  return at::vec::vec_reduce_all<double>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
#endif
}

// max_c x_c, NaN if any x_c is NaN (like at::vec::maximum). Branch-free: the comparisons of
// random data would mispredict. Float rows take the maximum with max_raw in two accumulators and
// OR the unordered lanes apart (a NaN lane's mask is all ones, itself a NaN): a step per vector
// with no dependence through memory. The generic form (kept for float64) passes its accumulator
// to vec_reduce_all by reference, which keeps it on the stack.
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
    return lane_max(v);
  }
}

// p * 2^n, from k = n + 1.5 * 2^23 as a float (n an integer in its low mantissa bits): n << 23
// added to p's bits, an integer add that leaves the multipliers free. Exact while the result
// is a normal float. (The AVX-512 build scales with vscalefps instead: exp2_poly.)
#if !defined(CPU_CAPABILITY_AVX512)
C10_ALWAYS_INLINE Vectorized<float> scale_by_pow2(Vectorized<float> p, Vectorized<float> k) {
#if defined(CPU_CAPABILITY_AVX2)
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
#endif

// 2^y for y in [-125, ~0] (and NaN in, NaN or garbage out: callers check their sums): y = n + f
// with n = round(y) by the 1.5 * 2^23 trick and f = y - n exact in [-1/2, 1/2], 2^f by a
// degree-5 polynomial with 2^0 = 1 exactly (minimax in relative error, 2.2e-7 in float
// arithmetic), and 2^n added to the exponent. Ten vector operations, five of them fused
// multiply-adds: the base-2 form drops the two-part ln 2 reduction, and the integer scaling
// drops a multiply. The AVX-512 build takes f with vreduceps and scales with vscalefps (exact
// for these normal results): eight operations, the same bits.
C10_ALWAYS_INLINE Vectorized<float> exp2_poly_of(Vectorized<float> f) {
  using Vec = Vectorized<float>;
  Vec p = at::vec::fmadd(Vec(0.0013202982f), f, Vec(0.0096749524f));
  p = at::vec::fmadd(p, f, Vec(0.055510473f));
  p = at::vec::fmadd(p, f, Vec(0.24022166f));
  p = at::vec::fmadd(p, f, Vec(0.69314659f));
  return at::vec::fmadd(p, f, Vec(1.0f));
}

C10_ALWAYS_INLINE Vectorized<float> exp2_poly(Vectorized<float> y) {
  using Vec = Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  // f = y - round(y) in one vreduceps, then n = y - f (exact): on Intel, vrndscaleps is two
  // micro-ops, and the exps are bound by micro-ops. The same f and n, the same bits. Only a
  // +-inf y gives a different value (f = 0, not NaN), and no caller keeps
  // one: exp2_arg clamps y, exp2_softmax_row and exp2_row_sum mask y < kMinExp2 to 0.
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_poly_of(Vec(f)), _mm512_sub_ps(y, f));
#else
  const Vec shift(12582912.0f);  // 1.5 * 2^23
  const Vec k = y + shift;
  const Vec f = y - (k - shift);
  return scale_by_pow2(exp2_poly_of(f), k);
#endif
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
constexpr float kExp2RowMaxAbs = 1e7f;  // the largest |m| of a base-2 row (exp2_row_ok)

// 2^y, and 0 where y < kMinExp2 (or y is NaN): for the KL rows, whose far-below-the-max exps
// are dropped rather than clamped. The AVX-512 build masks vscalefps by the compare: one
// operation where ATen's vector compare and the AND take three, the same bits.
C10_ALWAYS_INLINE Vectorized<float> exp2_or_zero(Vectorized<float> y) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 keep = _mm512_cmp_ps_mask(y, _mm512_set1_ps(kMinExp2), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(keep, exp2_poly_of(Vectorized<float>(f)), _mm512_sub_ps(y, f));
#else
  return exp2_poly(y) & (y >= Vectorized<float>(kMinExp2));
#endif
}

template <typename A>
C10_ALWAYS_INLINE bool exp2_row_ok(A m) {
  // false for NaN and +-inf too
  return std::is_same_v<A, float> && std::abs(m) <= A(kExp2RowMaxAbs);
}

// y = max(kMinExp2, x log2 e + b) with b = -(m log2 e); a NaN x stays NaN (max_raw).
C10_ALWAYS_INLINE Vectorized<float> exp2_arg(Vectorized<float> x, Vectorized<float> b) {
  return max_raw(Vectorized<float>(kMinExp2), at::vec::fmadd(x, Vectorized<float>(kLog2e), b));
}

// s and t (above) of one long float row (n >= 2 W) with exp2_row_ok(m), in one read, in base 2 (t
// is sum 2^y y, not yet times ln 2), as the vectors s[0..W) and t[0..W) whose lanes add up to
// them: the caller adds the lanes of a block's rows after all their exps (a row's lane sums
// right after its exps would be a chain of dependent shuffles that holds up the next row). The
// row max m may come from max_raw, which can miss a NaN: a NaN logit makes t NaN (through y),
// and the caller then redoes the row with exp_sums_full. The exps are compute bound, so while
// they run the same span of a block read later (pf, if not null: SoftmaxStats::Ahead) is
// prefetched, a cache line per line of x: its loads then overlap this row's arithmetic.
// Rows of kPrefetchToL2Classes or more prefetch into L2 (kLocality 2), shorter ones into L1 (3):
// long rows' prefetches into L1 would hold the core's few L1 miss buffers and stall the exps
// behind them (chosen by bench/bench_distill.py).
constexpr int64_t kPrefetchToL2Classes = 800;

// Values per chunk of a long float sum. A lane of a float accumulator adds up n / W values, and
// its rounding errors grow with n, so rows longer than this are summed in chunks whose lane sums
// are added in float64, which keeps the error that of one chunk.
constexpr int64_t kSumChunk = 4096;

// exp2_sums of kRows rows of n >= W values each, row j at x + j * stride (s + j * W, t + j * W,
// prefetching pf[j] unless null, and taking the NaN-blind maximum of the n values at nx[j] into
// nmax[j] unless nx or nx[j] is null: SoftmaxStats::Ahead), x + n - W inside each row (the last
// partial vector is loaded as a full one ending at x + n). Two rows at once interleave two
// independent chains of the same operations, row by row in the same order (the same bits as
// one row at a time): a row's last, unpaired vector is one long chain of dependent operations,
// which next to the other row's chain overlaps.
// Without kWithT only s is summed (t may be null): energies need no t.
template <int kRows, int kLocality, bool kWithT>
C10_ALWAYS_INLINE void exp2_sums_span(const float* x, int64_t stride, int64_t n, const float* m,
                                     float* s, float* t, const float* const* pf,
                                     const float* const* nx = nullptr, float* nmax = nullptr) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  Vec b[kRows], sv[kRows], tv[kRows], mx[kRows];
  const float* nj[kRows];
  bool any_max = false;
  for (int j = 0; j < kRows; ++j) {
    b[j] = Vec(-(m[j] * kLog2e));
    sv[j] = tv[j] = Vec(0.0f);
    nj[j] = nx ? nx[j] : nullptr;
    if (nj[j]) mx[j] = Vec::loadu(nj[j] + n - W);  // the last vector, which the loop skips
    any_max |= nj[j] != nullptr;
  }
  int64_t c = 0;
  constexpr int64_t kLine = 64;
  // Two vectors per step into one accumulator per sum (two more would not stay in registers):
  // s takes the pair's sum, t two chained multiply-adds. The chains are no bound: two rows'
  // steps hold far more independent work than their length.
  // The side maxima have a loop of their own (kMax: every row takes one, a row without nj[j]
  // its own, unused): a branch on nj[j] inside the loop makes GCC keep the four s and t
  // accumulators on the stack, a load and a store per step each.
  auto steps = [&](auto with_max) {
    constexpr bool kMax = decltype(with_max)::value;
    const float* mj[kRows];
    for (int j = 0; j < kRows; ++j) mj[j] = nj[j] ? nj[j] : x + j * stride;  // own row: unused
    for (; c + 2 * W <= n; c += 2 * W) {
      for (int j = 0; j < kRows; ++j) {
        if (pf[j]) {
          const char* p = reinterpret_cast<const char*>(pf[j] + c);
          for (int64_t o = 0; o < 2 * W * int64_t(sizeof(float)); o += kLine) {
            __builtin_prefetch(p + o, 0, kLocality);
          }
        }
      }
      for (int j = 0; j < kRows; ++j) {
        const float* xj = x + j * stride;
        const Vec y0 = exp2_arg(Vec::loadu(xj + c), b[j]);
        const Vec y1 = exp2_arg(Vec::loadu(xj + c + W), b[j]);
        const Vec e0 = exp2_poly(y0), e1 = exp2_poly(y1);
        sv[j] = sv[j] + (e0 + e1);
        if constexpr (kWithT) tv[j] = at::vec::fmadd(e1, y1, at::vec::fmadd(e0, y0, tv[j]));
        if constexpr (kMax) {
          mx[j] = max_raw(mx[j], max_raw(Vec::loadu(mj[j] + c), Vec::loadu(mj[j] + c + W)));
        }
      }
    }
  };
  if (any_max) {
    for (int j = 0; j < kRows; ++j) {
      if (!nj[j]) mx[j] = Vec(0.0f);
    }
    steps(std::true_type{});
  } else {
    steps(std::false_type{});
  }
  if (c + W <= n) {
    for (int j = 0; j < kRows; ++j) {
      if (nj[j]) mx[j] = max_raw(mx[j], Vec::loadu(nj[j] + c));
      const Vec y = exp2_arg(Vec::loadu(x + j * stride + c), b[j]);
      const Vec e = exp2_poly(y);
      sv[j] = sv[j] + e;
      if constexpr (kWithT) tv[j] = at::vec::fmadd(e, y, tv[j]);
    }
    c += W;
  }
  if (c < n) {
    // The last partial vector as a full one ending at x + n (the row is long), its first
    // lanes, counted already, masked to 0.
    const Vec keep = Vec::arange(0.0f, 1.0f) >= Vec(static_cast<float>(W - (n - c)));
    for (int j = 0; j < kRows; ++j) {
      const Vec y = exp2_arg(Vec::loadu(x + j * stride + n - W), b[j]) & keep;
      const Vec e = exp2_poly(y) & keep;
      sv[j] = sv[j] + e;
      if constexpr (kWithT) tv[j] = at::vec::fmadd(e, y, tv[j]);
    }
  }
  for (int j = 0; j < kRows; ++j) {
    sv[j].store(s + j * W);
    if constexpr (kWithT) tv[j].store(t + j * W);
    if (nj[j]) nmax[j] = lane_max_raw(mx[j]);
  }
}

// exp2_sums_span of one row; rows longer than kSumChunk in chunks (their side maximum, if nx,
// the maximum of the chunks').
template <int kLocality, bool kWithT>
C10_ALWAYS_INLINE void exp2_sums(const float* x, int64_t n, float m, float* s, float* t,
                                const float* pf, const float* nx, float* nmax) {
  if (n <= kSumChunk) {
    exp2_sums_span<1, kLocality, kWithT>(x, n, n, &m, s, t, &pf, &nx, nmax);
    return;
  }
  constexpr int64_t W = Vectorized<float>::size();
  double sum_s[W] = {}, sum_t[W] = {};
  alignas(64) float chunk_s[W], chunk_t[W];
  float chunk_max = 0.0f;
  for (int64_t c = 0; c < n; c += kSumChunk) {  // chunks of whole vector pairs but the last
    const float* pfc = pf ? pf + c : nullptr;
    const float* nxc = nx ? nx + c : nullptr;
    exp2_sums_span<1, kLocality, kWithT>(x + c, 0, std::min(kSumChunk, n - c), &m, chunk_s,
                                         chunk_t, &pfc, &nxc, &chunk_max);
    if (nx) *nmax = c == 0 ? chunk_max : std::max(*nmax, chunk_max);
    for (int64_t l = 0; l < W; ++l) {
      sum_s[l] += chunk_s[l];
      if constexpr (kWithT) sum_t[l] += chunk_t[l];
    }
  }
  for (int64_t l = 0; l < W; ++l) {
    s[l] = static_cast<float>(sum_s[l]);
    if constexpr (kWithT) t[l] = static_cast<float>(sum_t[l]);
  }
}

// s and t (above; t only with with_t) of one row with the full exp (any m, any A), in one read:
// whole vectors, the last partial one as a full vector ending at x + n with its lanes counted
// already masked to 0, and a row shorter than a vector one value at a time with std::exp (a
// partial vector goes through a buffer, slower than a scalar loop for short rows). NaN and +-inf
// carry through (a NaN or infinite max makes H NaN, as in the reference); a class with e = 0 (a
// -inf logit) adds 0 to t, not 0 * -inf.
template <typename A>
void exp_sums_full(const A* x, int64_t n, A m, A& s, A& t, bool with_t) {
  using Vec = Vectorized<A>;
  constexpr int64_t W = Vec::size();
  const Vec mv(m), zero(A(0));
  Vec sv(zero), tv(zero);
  s = t = A(0);
  if (n < W) {
    for (int64_t c = 0; c < n; ++c) {
      const A d = x[c] - m;
      const A e = std::exp(d);
      s += e;
      if (with_t && e != A(0)) t += e * d;
    }
    return;
  }
  auto add = [&](Vec d, Vec keep) {
    const Vec e = d.exp() & keep;
    sv = sv + e;
    if (with_t) tv = tv + ((e * d) & (e != zero));
  };
  const Vec all = zero == zero;
  int64_t c = 0;
  for (; c + W <= n; c += W) add(Vec::loadu(x + c) - mv, all);
  if (c < n) {
    add(Vec::loadu(x + n - W) - mv,
        Vec::arange(A(0), A(1)) >= Vec(static_cast<A>(W - (n - c))));
  }
  s = lane_sum(sv);
  if (with_t) t = lane_sum(tv);
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

// Short rows (C < 2 W, where the row helpers are mostly scalar): W rows at a time, one per vector
// lane. The W x C tile is transposed to columns (col[c * W + l] = x[l * C + c]; W x W tiles, the
// last one overlapping), so the per-row maxima and sums become vertical vector operations. They
// run in class order like the scalar loops of the row helpers, so a row gets the same bits
// either way.
template <typename A>
struct RowColumns {
  using Vec = Vectorized<A>;
  static constexpr int64_t W = Vec::size();

  static bool applies(int64_t C) { return C < 2 * W; }

  explicit RowColumns(int64_t C) : C(C) {}

  // col[c * W + l] = x[l * C + c].
  void transpose(const A* x, A* col) const {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<A, float>) {
      // Below 16 classes a gather per class beats ATen's 16 x 16 shuffle network (which costs
      // the same for any C); the same values.
      if (C < W) {
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i row = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(C)));
        for (int64_t c = 0; c < C; ++c) {
          _mm512_storeu_ps(col + c * W, _mm512_i32gather_ps(row, x + c, 4));
        }
        return;
      }
    }
#endif
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
  bool stats(const A* x, A* col, A* m, A* s, A* t) const {
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

  int64_t C;
};

// m, s and t of each of `rows` rows of C values at x (rows contiguous), for a block of rows that
// fits in cache. Float rows take base 2 where exp2_row_ok (long rows with exp2_sums, short rows a
// vector's width at a time with RowColumns, the rest with exp2_sums_in_order); rows with a NaN,
// +-inf or huge maximum, and float64 rows, take the full exp. Each row's values depend on that
// row alone (and C), never on its place in the block. A base-2 row's s is sum 2^(y_c), with every
// y_c carrying the rounding of m log2 e: H does not see it, log_sum_exp takes it out. R: the
// most rows a block has.
template <typename A>
class SoftmaxStats {
 public:
  using Vec = Vectorized<A>;
  static constexpr int64_t W = Vec::size();

  SoftmaxStats(int64_t C, int64_t R)
      : C_(C),
        columns_(C),
        col_(RowColumns<A>::applies(C) ? C * W : 0),
        lane_s_(C >= 2 * W ? R * W : 0),
        lane_t_(lane_s_.size()),
        row_y_(C < 2 * W ? C : 0),
        row_e_(C < 2 * W ? C : 0),
        t_unused_(R),
        ahead_max_(C >= 2 * W ? R : 0) {}

  // Rows worth a vector's width of rows at a time: R should then be a multiple of W.
  static bool short_rows(int64_t C) { return RowColumns<A>::applies(C); }

  // What a compute() call does on the side for the blocks of rows (of the same C, at most R
  // rows) its caller reads next: the row maxima of `next`, taken in the exps loop and kept, so
  // that the call for `next` needs no max pass of its own, and a prefetch of `after`, the block
  // read after that. Only float rows of 2 W classes or more do this work. A block's exps are
  // bound by arithmetic and its max pass by the reads; with a max pass of its own per block,
  // the memory would sit idle while the exps run.
  struct Ahead {
    const A* next = nullptr;  // the next block's rows (nullptr: none)
    int64_t next_rows = 0;
    const A* after = nullptr;  // the block after it, prefetched (nullptr: none)
    int64_t after_rows = 0;
    // A block read further on, prefetched into L2 all at once when the call starts (nullptr:
    // none). For blocks spread over memory, which the hardware prefetchers do not follow: see
    // the entropy weighting in csrc/cpu/distill.cpp. All at once, because the same prefetches
    // spread over the rows, between the exps, cost more than they save.
    const A* far = nullptr;
    int64_t far_rows = 0;
  };

  // m, s, t of rows [0, rows) of x; t may be null (not wanted: rows on the full exp then skip
  // it). ahead: see Ahead; the previous call's ahead.next, if it is x, spares this call its
  // max pass.
  void compute(const A* x, int64_t rows, A* m, A* s, A* t, const Ahead& ahead = {}) {
    if (ahead.far) {
      const char* p = reinterpret_cast<const char*>(ahead.far);
      const int64_t bytes = ahead.far_rows * C_ * int64_t(sizeof(A));
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
    }
    with_t_ = t != nullptr;
    if (!with_t_) t = t_unused_.data();
    if constexpr (std::is_same_v<A, float>) {
      if (C_ >= 2 * W) {
        if (with_t_) {
          long_rows<true>(x, rows, m, s, t, ahead);
        } else {
          long_rows<false>(x, rows, m, s, t, ahead);
        }
        return;
      }
    }
    int64_t r = 0;
    if (short_rows(C_)) {
      for (; r + W <= rows; r += W) {
        if (!columns_.stats(x + r * C_, col_.data(), m + r, s + r, t + r)) {
          by_rows(x, r, r + W, m, s, t);
        }
      }
    }
    by_rows(x, r, rows, m, s, t);
  }

  // log sum_c e^(x_c) of rows [0, rows) from compute's m and s, into out (may alias s): m + log s
  // for finite m, less the rounding of m log2 e that every y_c of a base-2 row carries; m itself
  // for an infinite m (x_c - m would be NaN there); NaN for a NaN m.
  static void log_sum_exp(const A* m, const A* s, int64_t rows, A* out) {
    for (int64_t r0 = 0; r0 < rows; r0 += W) {
      const int cnt = static_cast<int>(std::min<int64_t>(W, rows - r0));
      const Vec mv = cnt == W ? Vec::loadu(m + r0) : Vec::loadu(m + r0, cnt);
      Vec v = (cnt == W ? Vec::loadu(s + r0) : Vec::loadu(s + r0, cnt)).log();
      if constexpr (std::is_same_v<A, float>) {
        // The rounding of m log2 e as the exps saw it: with b = -(m log2 e) rounded and
        // y_c = x_c log2 e + b in one fused multiply-add, every y_c carries m log2 e + b, which
        // the fused multiply-add below gives exactly. The default build does not fuse: its y_c
        // round x_c log2 e first, which takes the same rounding out at x_c = m, and the
        // unfused form below gives 0 too. Only base-2 rows (exp2_row_ok) carry it.
        const Vec l2e(kLog2e);
        const Vec shift = at::vec::fmadd(mv, l2e, (mv * l2e).neg()) * Vec(kLn2);
        v = v - (shift & (mv.abs() <= Vec(kExp2RowMaxAbs)));  // exp2_row_ok
      }
      // m + log s where m is finite; an infinite or NaN m is the result itself.
      v = Vec::blendv(mv, mv + v, (mv - mv) == Vec(A(0)));
      if (cnt == W) {
        v.store(out + r0);
      } else {
        v.store(out + r0, cnt);
      }
    }
  }

 private:
  // Float rows of 2 W classes or more (compute) in three passes over the rows, each of
  // independent rows: the maxima (unless the previous call took them: ahead_of_), the exps and
  // their lane sums (exp2_sums, two rows at a time), then the lanes added: independent rows
  // overlap where the three steps row by row would wait on each other; the same bits. Without
  // kWithT, t is left alone (compute's t was null).
  template <bool kWithT>
  void long_rows(const float* x, int64_t rows, float* m, float* s, float* t,
                 const Ahead& ahead) {
    float* ls = lane_s_.data();
    float* lt = lane_t_.data();
    if (x == ahead_of_ && rows <= ahead_rows_) {
      std::copy(ahead_max_.begin(), ahead_max_.begin() + rows, m);
    } else {
      for (int64_t r = 0; r < rows; ++r) m[r] = row_max_raw(x + r * C_, C_);
    }
    // ahead_max_ holds the next block's maxima from here on (a block of more than R rows: none)
    const float* next =
        ahead.next_rows <= static_cast<int64_t>(ahead_max_.size()) ? ahead.next : nullptr;
    ahead_of_ = next;
    ahead_rows_ = ahead.next_rows;
    auto next_row = [&](int64_t r) -> const float* {
      return next && r < ahead.next_rows ? next + r * C_ : nullptr;
    };
    auto after_row = [&](int64_t r) -> const float* {
      return ahead.after && r < ahead.after_rows ? ahead.after + r * C_ : nullptr;
    };
    auto next_max = [&](int64_t r) { return next ? ahead_max_.data() + r : nullptr; };
    int64_t q = 0;
    if (C_ <= kSumChunk) {  // two rows at a time (exp2_sums_span)
      for (; q + 2 <= rows; q += 2) {
        if (!exp2_row_ok(m[q]) || !exp2_row_ok(m[q + 1])) {
          exp2_row<kWithT>(x, q, m, ls, lt, after_row(q), next_row(q), next_max(q));
          exp2_row<kWithT>(x, q + 1, m, ls, lt, after_row(q + 1), next_row(q + 1),
                           next_max(q + 1));
          continue;
        }
        const float* prs[2] = {after_row(q), after_row(q + 1)};
        const float* nxs[2] = {next_row(q), next_row(q + 1)};
        if (C_ >= kPrefetchToL2Classes) {
          exp2_sums_span<2, 2, kWithT>(x + q * C_, C_, C_, m + q, ls + q * W, lt + q * W, prs,
                                       nxs, next_max(q));
        } else {
          exp2_sums_span<2, 3, kWithT>(x + q * C_, C_, C_, m + q, ls + q * W, lt + q * W, prs,
                                       nxs, next_max(q));
        }
      }
    }
    for (; q < rows; ++q) {
      exp2_row<kWithT>(x, q, m, ls, lt, after_row(q), next_row(q), next_max(q));
    }
    // Rows of the next block past this one's (its callers' blocks shrink, never grow: none).
    for (int64_t r = rows; r < ahead.next_rows && next; ++r) {
      ahead_max_[r] = row_max_raw(next + r * C_, C_);
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (exp2_row_ok(m[r])) {
        if constexpr (kWithT) {
          const float t2 = lane_sum(Vectorized<float>::loadu(lt + r * W));
          if (std::isfinite(t2)) {  // else a NaN logit: the full exp below
            s[r] = lane_sum(Vectorized<float>::loadu(ls + r * W));
            t[r] = t2 * kLn2;
            continue;
          }
        } else {
          const float s2 = lane_sum(Vectorized<float>::loadu(ls + r * W));
          if (std::isfinite(s2)) {  // else a NaN logit, as t would tell
            s[r] = s2;
            continue;
          }
        }
      }
      m[r] = row_max(x + r * C_, C_);
      exp_sums_full(x + r * C_, C_, m[r], s[r], t[r], with_t_);
    }
  }

  // Rows [ra, rb) one at a time: short rows outside a lane group, and float64 rows.
  void by_rows(const A* x, int64_t ra, int64_t rb, A* m, A* s, A* t) {
    for (int64_t r = ra; r < rb; ++r) {
      const A* xr = x + r * C_;
      m[r] = row_max(xr, C_);
      if constexpr (std::is_same_v<A, float>) {
        if (exp2_row_ok(m[r])) {
          exp2_sums_in_order(xr, C_, m[r], row_y_.data(), row_e_.data(), s[r], t[r]);
          continue;
        }
      }
      exp_sums_full(xr, C_, m[r], s[r], t[r], with_t_);
    }
  }

  // exp2_sums of row r, prefetching pf and taking the maximum of nx into *nmax (unless null).
  // Where !exp2_row_ok(m[r]) no exps (the full exp redoes the row), nx's maximum alone.
  template <bool kWithT>
  void exp2_row(const float* x, int64_t r, const float* m, float* ls, float* lt, const float* pf,
                const float* nx, float* nmax) const {
    if (!exp2_row_ok(m[r])) {
      if (nx) *nmax = row_max_raw(nx, C_);
      return;
    }
    if (C_ >= kPrefetchToL2Classes) {
      exp2_sums<2, kWithT>(x + r * C_, C_, m[r], ls + r * W, lt + r * W, pf, nx, nmax);
    } else {
      exp2_sums<3, kWithT>(x + r * C_, C_, m[r], ls + r * W, lt + r * W, pf, nx, nmax);
    }
  }

  int64_t C_;
  RowColumns<A> columns_;
  std::vector<A> col_;                  // a short-row tile by columns (RowColumns)
  std::vector<float> lane_s_, lane_t_;  // long rows: per-row lane vectors (exp2_sums)
  std::vector<A> row_y_, row_e_;        // a short row's exponents and exps (exp2_sums_in_order)
  std::vector<A> t_unused_;             // t when the caller does not want it
  bool with_t_ = true;
  std::vector<A> ahead_max_;            // the NaN-blind row maxima of ahead_of_'s rows
  const A* ahead_of_ = nullptr;         // the last call's Ahead::next, and its rows
  int64_t ahead_rows_ = 0;
};

}  // namespace softmax_stats
}  // namespace fedkernels
