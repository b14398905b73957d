// Box-Muller in fp32 with our own log, sin and cos, written once for every device: the CUDA
// kernels, the scalar CPU loop and the AVX2/AVX-512 CPU loops (csrc/cpu/sgld.cpp) instantiate
// the same template, so a seed gives the same noise bits everywhere. Library log/sin/cos differ
// between glibc, CUDA and vector implementations in the last bits, so none of them is used.
//
// Every step is one correctly rounded add, subtract, multiply or square root (CUDA's _rn
// intrinsics are never fused into an FMA; the CPU libraries build with -ffp-contract=off) or
// an exact bit operation; the polynomials were fitted for this file (least squares on
// Chebyshev nodes) and agree with float64 libm to ~1e-7 relative (python_tests/test_sgld_ops.py
// checks the noise against a float64 Box-Muller and bit for bit against a PyTorch rendering).
#pragma once

#include <cstdint>
#include <cstring>

#include "host_device.h"

// Forced inline on the host as well: the CPU's vector instantiation passes values of several
// registers, which a call would spill to memory.
#if defined(__CUDACC__)
#define FEDKERNELS_NOISE_FN FEDKERNELS_HD
#else
#define FEDKERNELS_NOISE_FN inline __attribute__((always_inline))
#endif

namespace fedkernels {

// One fp32 lane: the operations BoxMullerF32 needs, on either device.
struct ScalarF32Ops {
  using F = float;
  using U = uint32_t;
  FEDKERNELS_HD static F splat(float v) { return v; }
#if defined(__CUDA_ARCH__)
  FEDKERNELS_HD static F add(F a, F b) { return __fadd_rn(a, b); }
  FEDKERNELS_HD static F sub(F a, F b) { return __fsub_rn(a, b); }
  FEDKERNELS_HD static F mul(F a, F b) { return __fmul_rn(a, b); }
  FEDKERNELS_HD static F sqrt(F a) { return __fsqrt_rn(a); }
  FEDKERNELS_HD static U bits(F x) { return __float_as_uint(x); }
  FEDKERNELS_HD static F from_bits(U u) { return __uint_as_float(u); }
  FEDKERNELS_HD static F to_float(U u) { return __uint2float_rn(u); }
#else
  FEDKERNELS_HD static F add(F a, F b) { return a + b; }
  FEDKERNELS_HD static F sub(F a, F b) { return a - b; }
  FEDKERNELS_HD static F mul(F a, F b) { return a * b; }
  FEDKERNELS_HD static F sqrt(F a) { return __builtin_sqrtf(a); }
  FEDKERNELS_HD static U bits(F x) {
    U u;
    std::memcpy(&u, &x, sizeof u);
    return u;
  }
  FEDKERNELS_HD static F from_bits(U u) {
    F x;
    std::memcpy(&x, &u, sizeof x);
    return x;
  }
  // The nearest float (ties to even), as the vector loops compute it.
  FEDKERNELS_HD static F to_float(U u) { return static_cast<F>(u); }
#endif
};

// Ops: F (fp32 values) and U (their uint32 bit patterns, same lanes) with splat, add, sub, mul,
// sqrt, bits, from_bits and to_float (uint32 to the nearest float); U supports the integer
// operators with uint32 constants.
template <typename Ops>
struct BoxMullerF32 {
  using F = typename Ops::F;
  using U = typename Ops::U;

  // ln x for a normal x in (0, 1]: x = 2^e m with m in [sqrt(1/2), sqrt(2)],
  // ln x = e ln 2 + ln(1 + f), f = m - 1 (exact), ln(1 + f) = f + f^2 q(f).
  FEDKERNELS_NOISE_FN static F log_unit(F x) {
    const U b = Ops::bits(x);
    U m = (b & 0x007fffffu) | 0x3f800000u;  // the mantissa as a float in [1, 2)
    const U big = (0x3fb504f3u - m) >> 31;  // 1 when m > sqrt(2)
    m = m - (big << 23);                    // then m / 2
    const F e = Ops::sub(Ops::to_float((b >> 23) + big), Ops::splat(127.0f));
    const F f = Ops::sub(Ops::from_bits(m), Ops::splat(1.0f));
    F q = Ops::splat(-7.866667956e-02f);
    q = Ops::add(Ops::mul(q, f), Ops::splat(1.282174885e-01f));
    q = Ops::add(Ops::mul(q, f), Ops::splat(-1.310163438e-01f));
    q = Ops::add(Ops::mul(q, f), Ops::splat(1.418900043e-01f));
    q = Ops::add(Ops::mul(q, f), Ops::splat(-1.662759930e-01f));
    q = Ops::add(Ops::mul(q, f), Ops::splat(2.000196874e-01f));
    q = Ops::add(Ops::mul(q, f), Ops::splat(-2.500077188e-01f));
    q = Ops::add(Ops::mul(q, f), Ops::splat(3.333332241e-01f));
    q = Ops::add(Ops::mul(q, f), Ops::splat(-4.999999702e-01f));
    const F log_m = Ops::add(f, Ops::mul(Ops::mul(f, f), q));
    // ln 2 split so that e * hi is exact for |e| < 2^8.
    const F hi = Ops::splat(0.693145751953125f), lo = Ops::splat(1.428606765330187e-06f);
    return Ops::add(Ops::mul(e, hi), Ops::add(Ops::mul(e, lo), log_m));
  }

  // sin and cos of 2 pi t for t in [0, 1]: 4 t = q + d with q an integer and d in [-1/2, 1/2]
  // (both exact), polynomials in d for the angle pi d / 2, and the quadrant q mod 4 picks which
  // one and its sign.
  FEDKERNELS_NOISE_FN static void sincos_turns(F t, F& sin_out, F& cos_out) {
    const F magic = Ops::splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const F x = Ops::mul(t, Ops::splat(4.0f));
    const F shifted = Ops::add(x, magic);
    const U q = Ops::bits(shifted) & 3u;  // the integer's low bits
    const F d = Ops::sub(x, Ops::sub(shifted, magic));
    const F z = Ops::mul(d, d);
    F s = Ops::splat(-4.602163099e-03f);
    s = Ops::add(Ops::mul(s, z), Ops::splat(7.968021929e-02f));
    s = Ops::add(Ops::mul(s, z), Ops::splat(-6.459634900e-01f));
    s = Ops::add(Ops::mul(s, z), Ops::splat(1.570796371e+00f));
    s = Ops::mul(s, d);
    F c = Ops::splat(9.036298725e-04f);
    c = Ops::add(Ops::mul(c, z), Ops::splat(-2.086007036e-02f));
    c = Ops::add(Ops::mul(c, z), Ops::splat(2.536692023e-01f));
    c = Ops::add(Ops::mul(c, z), Ops::splat(-1.233700514e+00f));
    c = Ops::add(Ops::mul(c, z), Ops::splat(1.0f));
    const U odd = 0u - (q & 1u);  // all ones in quadrants 1 and 3: sin and cos swap
    const U sb = Ops::bits(s), cb = Ops::bits(c);
    const U cos_bits = ((sb & odd) | (cb & ~odd)) ^ (((q + 1u) & 2u) << 30);  // < 0 in 1, 2
    const U sin_bits = ((cb & odd) | (sb & ~odd)) ^ ((q & 2u) << 30);         // < 0 in 2, 3
    cos_out = Ops::from_bits(cos_bits);
    sin_out = Ops::from_bits(sin_bits);
  }

  // Two standard normals from two uint32: u1 = (r1 + 1) 2^-32 in (0, 1], u2 = r2 2^-32 in
  // [0, 1], n0 = sqrt(-2 ln u1) cos(2 pi u2), n1 = sqrt(-2 ln u1) sin(2 pi u2).
  FEDKERNELS_NOISE_FN static void pair(U r1, U r2, F& n0, F& n1) {
    const F scale = Ops::splat(2.3283064365386963e-10f);  // 2^-32
    const F u1 = Ops::mul(Ops::add(Ops::to_float(r1), Ops::splat(1.0f)), scale);
    const F u2 = Ops::mul(Ops::to_float(r2), scale);
    const F r = Ops::sqrt(Ops::mul(Ops::splat(-2.0f), log_unit(u1)));
    F s, c;
    sincos_turns(u2, s, c);
    n0 = Ops::mul(r, c);
    n1 = Ops::mul(r, s);
  }
};

}  // namespace fedkernels

#undef FEDKERNELS_NOISE_FN
