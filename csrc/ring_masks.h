// The arithmetic of the secure-aggregation ops (schemas: csrc/ops.cpp, "Secure aggregation"),
// shared by the CPU and CUDA kernels: Philox-4x32-10 written once over a lane type (a uint32,
// or a vector of them in the CPU loops), so that a mask seed gives the same words on every
// device and in fedkernels.ops.reference.philox_words_reference, and the fixed-point encoding.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace fedkernels {

// One uint32 lane: the product halves of Philox's rounds, and a ^ b ^ k.
struct ScalarU32Ops {
  using U = uint32_t;
  FEDKERNELS_HD static U mix(U a, U b, uint32_t k) { return a ^ b ^ k; }
  FEDKERNELS_HD static void mulhilo(uint32_t m, U x, U& hi, U& lo) {
#if defined(__CUDA_ARCH__)
    hi = __umulhi(m, x);
    lo = m * x;
#else
    const uint64_t p = static_cast<uint64_t>(m) * x;
    hi = static_cast<U>(p >> 32);
    lo = static_cast<U>(p);
#endif
  }
};

// Philox-4x32-10 as at::philox_engine computes it: counter (x0, x1, x2, x3) = (offset low,
// offset high, subsequence low, subsequence high), key (k0, k1) = the seed's halves; the
// block's four words come back in x. Ops: U (uint32 lanes), mulhilo and mix.
template <typename Ops>
struct Philox10 {
  using U = typename Ops::U;
  FEDKERNELS_HD static void block(U& x0, U& x1, U& x2, U& x3, uint32_t k0, uint32_t k1) {
    FEDKERNELS_UNROLL
    for (int r = 0; r < 10; ++r) {
      if (r) {
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
      }
      U hi0, lo0, hi1, lo1;
      Ops::mulhilo(0xD2511F53u, x0, hi0, lo0);
      Ops::mulhilo(0xCD9E8D57u, x2, hi1, lo1);
      const U n0 = Ops::mix(hi1, x1, k0), n2 = Ops::mix(hi0, x3, k1);
      x0 = n0;
      x1 = lo1;
      x2 = n2;
      x3 = lo0;
    }
  }
};

// Word e % 4 of the block (key, subsequence e / 4, offset): the value a mask with this seed
// adds at element e of the list, and the uniform word of stochastic rounding.
FEDKERNELS_HD uint32_t philox_word(uint64_t key, uint64_t offset, uint64_t e) {
  uint32_t x0 = static_cast<uint32_t>(offset), x1 = static_cast<uint32_t>(offset >> 32);
  const uint64_t g = e >> 2;
  uint32_t x2 = static_cast<uint32_t>(g), x3 = static_cast<uint32_t>(g >> 32);
  Philox10<ScalarU32Ops>::block(x0, x1, x2, x3, static_cast<uint32_t>(key),
                                static_cast<uint32_t>(key >> 32));
  switch (e & 3) {
    case 0: return x0;
    case 1: return x1;
    case 2: return x2;
    default: return x3;
  }
}

// The fixed-point code of one value, in float64 on every device (exact products of a value
// and a power-of-two scale; one rounding otherwise, the same everywhere): clamp to
// [-clip, clip] (NaN encodes as 0), times scale, rounded to nearest (ties to even) or
// stochastically, floor(w + word 2^-32), then taken mod 2^32.
struct RingMath {
  FEDKERNELS_HD static uint32_t encode(double v, double clip, double scale, bool stochastic,
                                       uint32_t word) {
    v = v != v ? 0.0 : v;
    v = v < -clip ? -clip : (v > clip ? clip : v);
#if defined(__CUDA_ARCH__)
    const double w = __dmul_rn(v, scale);
    const double r = stochastic ? floor(__dadd_rn(w, static_cast<double>(word) * 0x1p-32)) : rint(w);
#else
    // Rounding by the magic constant 1.5 * 2^52 (exact for |t| < 2^51; |t| <= 2^31 + 1 here):
    // to nearest with ties to even, as rint, inline and in vectors where libm would be a call.
    constexpr double kMagic = 6755399441055744.0;
    const double w = v * scale;
    const double t = stochastic ? w + static_cast<double>(word) * 0x1p-32 : w;
    double r = (t + kMagic) - kMagic;
    if (stochastic) r = r > t ? r - 1.0 : r;  // floor
#endif
    return static_cast<uint32_t>(static_cast<int64_t>(r));
  }
};

}  // namespace fedkernels
