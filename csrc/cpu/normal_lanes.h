// Standard normals of the counter-based noise stream (PhiloxNormal in csrc/elementwise.h:
// Philox-4x32-10 with offset 0, Philox group g gives elements 4g..4g+3), drawn many groups at a
// time. The AVX2 and AVX-512 builds run Philox and BoxMullerF32 (csrc/normal_noise.h) on
// kLanes groups at once; the default build and fp64 take the scalar PhiloxNormal. The bits are
// the same on every path, and the same as the CUDA kernels'.
//
// Philox works on values of kWays registers, and Box-Muller takes both pairs of a block as one
// value of 2 kWays registers: the Philox multiplies and the polynomial chains of Box-Muller are
// latency-bound, and one register per value leaves the core idle most of the time; more
// independent chains keep more of it busy.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../elementwise.h"
#include "../normal_noise.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define FEDKERNELS_NORMAL_LANES 1
#endif

namespace fedkernels {

#if defined(FEDKERNELS_NORMAL_LANES)
namespace normal_lanes_detail {

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kNative = 16;  // fp32 lanes of one register
#else
constexpr int kNative = 8;
#endif
constexpr int kWays = 2;  // registers per value
constexpr int kLanes = kNative * kWays;

#define FEDKERNELS_INLINE inline __attribute__((always_inline))

// One register of fp32 values / of their uint32 bit patterns (GCC vector types).
typedef float RegF __attribute__((vector_size(4 * kNative)));
typedef uint32_t RegU __attribute__((vector_size(4 * kNative)));
typedef int32_t RegI __attribute__((vector_size(4 * kNative)));

// N registers, lane i of register w being lane w * kNative + i of the value. Every operator
// runs register by register, which interleaves the N instruction streams.
template <typename R, int N>
struct Wide {
  R r[N];
};
template <int N>
using VecF = Wide<RegF, N>;
template <int N>
using VecU = Wide<RegU, N>;

#define FEDKERNELS_WIDE_OP(op)                                                      \
  template <int N>                                                                  \
  FEDKERNELS_INLINE VecU<N> operator op(const VecU<N>& a, const VecU<N>& b) {      \
    VecU<N> c;                                                                      \
    for (int w = 0; w < N; ++w) c.r[w] = a.r[w] op b.r[w];                          \
    return c;                                                                       \
  }                                                                                 \
  template <int N>                                                                  \
  FEDKERNELS_INLINE VecU<N> operator op(const VecU<N>& a, uint32_t b) {            \
    VecU<N> c;                                                                      \
    for (int w = 0; w < N; ++w) c.r[w] = a.r[w] op b;                               \
    return c;                                                                       \
  }                                                                                 \
  template <int N>                                                                  \
  FEDKERNELS_INLINE VecU<N> operator op(uint32_t a, const VecU<N>& b) {            \
    VecU<N> c;                                                                      \
    for (int w = 0; w < N; ++w) c.r[w] = a op b.r[w];                               \
    return c;                                                                       \
  }
FEDKERNELS_WIDE_OP(+)
FEDKERNELS_WIDE_OP(-)
FEDKERNELS_WIDE_OP(&)
FEDKERNELS_WIDE_OP(|)
FEDKERNELS_WIDE_OP(^)
FEDKERNELS_WIDE_OP(<<)
FEDKERNELS_WIDE_OP(>>)
#undef FEDKERNELS_WIDE_OP

template <int N>
FEDKERNELS_INLINE VecU<N> operator~(const VecU<N>& a) {
  VecU<N> c;
  for (int w = 0; w < N; ++w) c.r[w] = ~a.r[w];
  return c;
}

template <int N>
struct VecF32Ops {
  using F = VecF<N>;
  using U = VecU<N>;
  template <typename Fn>
  static FEDKERNELS_INLINE F map(const F& a, const F& b, Fn fn) {
    F c;
    for (int w = 0; w < N; ++w) c.r[w] = fn(a.r[w], b.r[w]);
    return c;
  }
  static FEDKERNELS_INLINE F splat(float v) {
    F c;
    for (int w = 0; w < N; ++w) c.r[w] = RegF{} + v;
    return c;
  }
  static FEDKERNELS_INLINE F add(F a, F b) { return map(a, b, [](RegF x, RegF y) { return x + y; }); }
  static FEDKERNELS_INLINE F sub(F a, F b) { return map(a, b, [](RegF x, RegF y) { return x - y; }); }
  static FEDKERNELS_INLINE F mul(F a, F b) { return map(a, b, [](RegF x, RegF y) { return x * y; }); }
  static FEDKERNELS_INLINE F sqrt(F a) {
    F c;
#if defined(CPU_CAPABILITY_AVX512)
    for (int w = 0; w < N; ++w) c.r[w] = (RegF)_mm512_sqrt_ps((__m512)a.r[w]);
#else
    for (int w = 0; w < N; ++w) c.r[w] = (RegF)_mm256_sqrt_ps((__m256)a.r[w]);
#endif
    return c;
  }
  static FEDKERNELS_INLINE U bits(F x) {
    U u;
    for (int w = 0; w < N; ++w) u.r[w] = (RegU)x.r[w];
    return u;
  }
  static FEDKERNELS_INLINE F from_bits(U u) {
    F x;
    for (int w = 0; w < N; ++w) x.r[w] = (RegF)u.r[w];
    return x;
  }
  // Both halves convert exactly, so the one rounding is the sum's: the nearest float, as
  // ScalarF32Ops::to_float.
  static FEDKERNELS_INLINE F to_float(U u) {
    F x;
    for (int w = 0; w < N; ++w) {
      const RegF hi = __builtin_convertvector((RegI)(u.r[w] >> 16), RegF);
      const RegF lo = __builtin_convertvector((RegI)(u.r[w] & 0xffffu), RegF);
      x.r[w] = hi * 65536.0f + lo;
    }
    return x;
  }
};

// The two values side by side as one of 2N registers.
template <typename R, int N>
FEDKERNELS_INLINE Wide<R, 2 * N> join(const Wide<R, N>& a, const Wide<R, N>& b) {
  Wide<R, 2 * N> c;
  for (int w = 0; w < N; ++w) {
    c.r[w] = a.r[w];
    c.r[N + w] = b.r[w];
  }
  return c;
}

// The hi and lo words of the 64-bit products m * x, lane by lane.
FEDKERNELS_INLINE void mulhilo(uint32_t m, const VecU<kWays>& x, VecU<kWays>& hi,
                              VecU<kWays>& lo) {
  for (int w = 0; w < kWays; ++w) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i mv = _mm512_set1_epi64(m), xv = (__m512i)x.r[w];
    const __m512i even = _mm512_mul_epu32(xv, mv);
    const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(xv, 32), mv);
    hi.r[w] = (RegU)_mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
#else
    const __m256i mv = _mm256_set1_epi64x(m), xv = (__m256i)x.r[w];
    const __m256i even = _mm256_mul_epu32(xv, mv);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(xv, 32), mv);
    // movehdup moves each even product's high word down (a shuffle, beside the shifts).
    hi.r[w] = (RegU)_mm256_blend_epi32((__m256i)_mm256_movehdup_ps((__m256)even), odd, 0xAA);
#endif
    lo.r[w] = x.r[w] * m;  // one vpmulld instead of a shift and a blend of the products
  }
}

// eps[4 i + j] = v[j] lane i, for i < kLanes: the four values of each group side by side.
FEDKERNELS_INLINE void store_groups(const VecF<kWays> (&v)[4], float* eps) {
  for (int w = 0; w < kWays; ++w) {
    float* o = eps + 4 * w * kNative;
#if defined(CPU_CAPABILITY_AVX512)
    for (int i = 0; i < kNative; ++i) {
      for (int j = 0; j < 4; ++j) o[4 * i + j] = v[j].r[w][i];
    }
#else
    // A 4 x 8 transpose in 12 shuffles (GCC renders the loop above poorly): pairs
    // interleaved, then quadruples, then 128-bit halves.
    const __m256 v0 = (__m256)v[0].r[w], v1 = (__m256)v[1].r[w];
    const __m256 v2 = (__m256)v[2].r[w], v3 = (__m256)v[3].r[w];
    const __m256 t0 = _mm256_unpacklo_ps(v0, v1), t1 = _mm256_unpackhi_ps(v0, v1);
    const __m256 t2 = _mm256_unpacklo_ps(v2, v3), t3 = _mm256_unpackhi_ps(v2, v3);
    const __m256 q0 = _mm256_shuffle_ps(t0, t2, 0x44), q1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 q2 = _mm256_shuffle_ps(t1, t3, 0x44), q3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(q0, q1, 0x20));       // groups 0, 1
    _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(q2, q3, 0x20));   // 2, 3
    _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(q0, q1, 0x31));  // 4, 5
    _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(q2, q3, 0x31));  // 6, 7
#endif
  }
}

// eps[4 i + j] = element j of Philox group g0 + i, for i < kLanes; `between()` runs once in
// each Philox round.
template <typename Between>
FEDKERNELS_INLINE void normal_block(uint64_t seed, uint64_t g0, float* eps, Between& between) {
  alignas(64) uint32_t words[2][kLanes];  // the counters' low and high words
  for (int i = 0; i < kLanes; ++i) {
    words[0][i] = static_cast<uint32_t>(g0 + i);
    words[1][i] = static_cast<uint32_t>((g0 + i) >> 32);
  }
  VecU<kWays> x0, x1, x2, x3;
  for (int w = 0; w < kWays; ++w) {
    x0.r[w] = RegU{};
    x1.r[w] = RegU{};
    std::memcpy(&x2.r[w], words[0] + w * kNative, sizeof(RegU));
    std::memcpy(&x3.r[w], words[1] + w * kNative, sizeof(RegU));
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma GCC unroll 10
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    between();
    VecU<kWays> hi0, lo0, hi1, lo1;
    mulhilo(0xD2511F53u, x0, hi0, lo0);
    mulhilo(0xCD9E8D57u, x2, hi1, lo1);
    x0 = hi1 ^ x1 ^ k0;
    x1 = lo1;
    x2 = hi0 ^ x3 ^ k1;
    x3 = lo0;
  }
  // Both pairs in one value of 2 kWays registers: the polynomial chains of Box-Muller are
  // latency-bound, and twice the independent chains keep more of the core busy.
  VecF<2 * kWays> even, odd;
  BoxMullerF32<VecF32Ops<2 * kWays>>::pair(join(x0, x2), join(x1, x3), even, odd);
  VecF<kWays> v[4];
  for (int w = 0; w < kWays; ++w) {
    v[0].r[w] = even.r[w];
    v[1].r[w] = odd.r[w];
    v[2].r[w] = even.r[kWays + w];
    v[3].r[w] = odd.r[kWays + w];
  }
  store_groups(v, eps);
}

#undef FEDKERNELS_INLINE
}  // namespace normal_lanes_detail
#endif

// eps[0, 4 (g1 - g0)) = the noise of Philox groups [g0, g1) under `seed`. `between()` runs ten
// times per block of kLanes groups (once per Philox round; once per group on the scalar path):
// the caller's chance to start memory traffic that the arithmetic then hides. A few requests
// at a time, spread over the block, get more of them served than one burst per block.
struct NoWork {
  void operator()() const {}
};
template <typename A, typename Between = NoWork>
void draw_normals(uint64_t seed, int64_t g0, int64_t g1, A* eps, Between between = {}) {
  int64_t g = g0;
#if defined(FEDKERNELS_NORMAL_LANES)
  if constexpr (std::is_same_v<A, float>) {
    constexpr int64_t lanes = normal_lanes_detail::kLanes;
    for (; g + lanes <= g1; g += lanes) {
      normal_lanes_detail::normal_block(seed, static_cast<uint64_t>(g), eps + 4 * (g - g0),
                                        between);
    }
  }
#endif
  for (; g < g1; ++g) {
    between();
    PhiloxNormal::normal4<A>(seed, 0, g, eps + 4 * (g - g0));
  }
}

}  // namespace fedkernels
