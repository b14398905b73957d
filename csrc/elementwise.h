// Per-element math shared by the CPU and CUDA kernels, so the CPU tests check the arithmetic
// the GPU runs. Each function is a template over the value type: a scalar (float, double) on
// either device, or an at::vec::Vectorized on the CPU.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace fedkernels {

// fedkernels::weighted_sum (see csrc/ops.cpp for the three modes).
struct WeightedSumMath {
  bool has_base;
  bool delta;

  // One client's contribution, accumulated in client order: acc + w * (x - [delta] b).
  template <typename V>
  FEDKERNELS_HD V accumulate(V acc, V w, V x, V b) const {
    return delta ? acc + w * (x - b) : acc + w * x;
  }

  // After the last client: [b +] scale * acc.
  template <typename V>
  FEDKERNELS_HD V finish(V acc, V scale, V b) const {
    return has_base ? b + scale * acc : scale * acc;
  }
};

}  // namespace fedkernels

// ---------------------------------------------------------------- SuPerFed
// Schemas and formulas in csrc/ops.cpp; the method in docs/superfed.md.
namespace fedkernels {

// theta = (1 - w) g + w l, evaluated as torch.lerp does so that w = 0 gives g and w = 1 gives
// l exactly: `low` (w < 0.5) is decided once per tensor, outside the element loop.
struct MixMath {
  template <typename V>
  FEDKERNELS_HD static V mix(V g, V l, V w, V one_minus_w, bool low) {
    return low ? g + w * (l - g) : l - (l - g) * one_minus_w;
  }
  // d theta/d g: (1 - w) G; d theta/d l: w G; d theta/d w contribution: G (l - g).
  template <typename V>
  FEDKERNELS_HD static V lam_term(V grad, V g, V l) {
    return grad * (l - g);
  }
};

// Per-tensor statistics of the regularizers: s = [<g, l>, ||g||^2, ||l||^2, ||g - a||^2].
struct StatsMath {
  template <typename V>
  FEDKERNELS_HD static V diff(V g, V a) {
    return g - a;
  }
  // Adds one element's terms to s (the columns of an absent list stay 0).
  template <typename V>
  FEDKERNELS_HD static void accumulate(V* s, V g, V l, V a, bool has_local, bool has_anchor) {
    s[1] = s[1] + g * g;
    if (has_local) {
      s[0] = s[0] + g * l;
      s[2] = s[2] + l * l;
    }
    if (has_anchor) {
      const V d = diff(g, a);
      s[3] = s[3] + d * d;
    }
  }
  // Backward with h = (H0, 2 H1, 2 H2, 2 H3) and d = g - a:
  //   grad_g = H0 l + 2 H1 g + 2 H3 d;  grad_l = H0 g + 2 H2 l;  grad_a = -2 H3 d.
  template <typename V>
  FEDKERNELS_HD static V grad_global(V g, V l, V d, V h0, V h1x2, V h3x2) {
    return h0 * l + h1x2 * g + h3x2 * d;
  }
  template <typename V>
  FEDKERNELS_HD static V grad_local(V g, V l, V h0, V h2x2) {
    return h0 * g + h2x2 * l;
  }
  template <typename V>
  FEDKERNELS_HD static V grad_anchor(V d, V h3x2) {
    return -(h3x2 * d);
  }
};

// torch.optim.SGD's update of one parameter p with gradient d, in its foreach order (weight decay
// into the gradient, then momentum, then the step); b is the momentum buffer, written to b_out.
// A buffer's first step (`first`) takes it as d itself, as torch does (no dampening).
struct SgdMath {
  template <typename V, typename C>
  FEDKERNELS_HD static V step(const C& c, bool first, V p, V d, V b, V& b_out) {
    if (c.decay) d = d + c.weight_decay * p;
    if (c.momentum_on) {
      b_out = first ? d : b * c.momentum + c.one_minus_dampening * d;
      d = c.nesterov ? d + c.momentum * b_out : b_out;
    }
    return p - c.lr * d;
  }
};

// The kernels of the SuPerFed ops. Each reads some of the inputs, by slot g, l, a (anchor), G
// (the upstream gradient of theta), and for kMixStatsStep the momentum buffers of g and l; writes
// some of the outputs, by slot theta or grad_g, grad_l, grad_a (kMixStatsStep: g, l and their
// buffers, in place); and sums some per-tensor reductions (the four statistics, or the lam
// gradient). kMixStatsStep is kMixStatsBackward's gradients fed straight into SgdMath::step.
enum class SuperfedKind {
  kMix, kMixBackward, kStats, kStatsBackward, kMixStats, kMixStatsBackward, kMixStatsStep
};
constexpr int kSuperfedInputs = 6;   // slots g, l, a, G, g's buffer, l's buffer
constexpr int kSuperfedOutputs = 4;  // slots theta or grad_g (or g), grad_l (or l), grad_a or
                                     // g's buffer, l's buffer

// torch.optim.SGD's settings for kMixStatsStep (host side; float64 as torch keeps them).
struct SgdSettings {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  // Per endpoint (g, l): its buffers are not read, only written (torch: buffer = d).
  bool first_step_global = false, first_step_local = false;
};

// Per-tensor constants of the element functions, in the value type V (a scalar, or a CPU vector
// of that scalar in every lane): the mixing weight w = lam_t and the gradient coefficients of the
// statistics (from H = d loss / d stats, row t; 0 for a list the call does not have).
template <typename V>
struct SuperfedCoef {
  V w, omw;  // w and 1 - w
  bool low;  // w < 0.5: the lerp form of MixMath::mix
  V h0, h1x2, h2x2, h3x2;
  V zero;
  // kMixStatsStep's SGD settings (SgdMath::step; zero and off for the other kinds).
  V lr, momentum, one_minus_dampening, weight_decay;
  bool decay, momentum_on, nesterov, first_global, first_local;

  // From lam [T] and H [T, 4] (float64; either may be null) at row t.
  FEDKERNELS_HD static SuperfedCoef load(
      const double* lam, const double* h, int64_t t, bool has_local, bool has_anchor) {
    SuperfedCoef c;
    c.w = lam ? static_cast<V>(lam[t]) : V(0);
    c.omw = V(1) - c.w;
    c.low = c.w < V(0.5);
    const double* row = h ? h + 4 * t : nullptr;
    c.h0 = row && has_local ? static_cast<V>(row[0]) : V(0);
    c.h1x2 = row ? static_cast<V>(2 * row[1]) : V(0);
    c.h2x2 = row && has_local ? static_cast<V>(2 * row[2]) : V(0);
    c.h3x2 = row && has_anchor ? static_cast<V>(2 * row[3]) : V(0);
    c.zero = V(0);
    c.lr = c.momentum = c.one_minus_dampening = c.weight_decay = V(0);
    c.decay = c.momentum_on = c.nesterov = c.first_global = c.first_local = false;
    return c;
  }

  FEDKERNELS_HD SuperfedCoef with_sgd(const SgdSettings& s) const {
    SuperfedCoef c = *this;
    c.lr = static_cast<V>(s.lr);
    c.momentum = static_cast<V>(s.momentum);
    c.one_minus_dampening = static_cast<V>(1 - s.dampening);
    c.weight_decay = static_cast<V>(s.weight_decay);
    c.decay = s.weight_decay != 0;
    c.momentum_on = s.momentum != 0;
    c.nesterov = s.nesterov;
    c.first_global = s.first_step_global;
    c.first_local = s.first_step_local;
    return c;
  }

  // The same constants in another value type (e.g. every lane of a CPU vector).
  template <typename W>
  SuperfedCoef<W> as() const {
    return {W(w), W(omw), low, W(h0), W(h1x2), W(h2x2), W(h3x2), W(zero),
            W(lr), W(momentum), W(one_minus_dampening), W(weight_decay),
            decay, momentum_on, nesterov, first_global, first_local};
  }
};

// The per-element arithmetic of one kernel kind: x = {g, l, a, G[, buffer_g, buffer_l]} (inputs
// the kind or the call does not have are 0 and unused), y = {theta or grad_g, grad_l, grad_a}
// (kMixStatsStep: {g, l, buffer_g, buffer_l} after the step), s += the kSums per-tensor sums
// (when `reduce`). Both backends run their element loops through apply, so the
// CPU tests check the arithmetic the GPU runs.
template <SuperfedKind kKind>
struct SuperfedOp {
  static constexpr bool kMixes =
      kKind == SuperfedKind::kMix || kKind == SuperfedKind::kMixStats;
  static constexpr bool kStats =
      kKind == SuperfedKind::kStats || kKind == SuperfedKind::kMixStats;
  static constexpr bool kMixGrad =
      kKind == SuperfedKind::kMixBackward || kKind == SuperfedKind::kMixStatsBackward;
  static constexpr bool kStatsGrad =
      kKind == SuperfedKind::kStatsBackward || kKind == SuperfedKind::kMixStatsBackward;
  static constexpr bool kStep = kKind == SuperfedKind::kMixStatsStep;
  // Sums per tensor: the statistics row, or the lam gradient.
  static constexpr int kSums = kStats ? 4 : (kMixGrad ? 1 : 0);
  // Slots the kind uses (the buffers only by the step).
  static constexpr int kInputs = kStep ? 6 : 4;
  static constexpr int kOutputs = kStep ? 4 : 3;

  template <typename V>
  FEDKERNELS_HD static void apply(
      const SuperfedCoef<V>& c, bool has_local, bool has_anchor, bool reduce, const V* x, V* y,
      V* s) {
    const V g = x[0], l = x[1], a = x[2], G = x[3];
    if constexpr (kStep) {
      const V d = has_anchor ? StatsMath::diff(g, a) : c.zero;
      const V grad_g = c.omw * G + StatsMath::grad_global(g, l, d, c.h0, c.h1x2, c.h3x2);
      const V grad_l = c.w * G + StatsMath::grad_local(g, l, c.h0, c.h2x2);
      y[0] = SgdMath::step(c, c.first_global, g, grad_g, x[4], y[2]);
      y[1] = SgdMath::step(c, c.first_local, l, grad_l, x[5], y[3]);
      return;
    }
    if constexpr (kMixes) y[0] = MixMath::mix(g, l, c.w, c.omw, c.low);
    if constexpr (kStats) StatsMath::accumulate(s, g, l, a, has_local, has_anchor);
    if constexpr (kStatsGrad) {
      const V d = has_anchor ? StatsMath::diff(g, a) : c.zero;
      const V grad_g = StatsMath::grad_global(g, l, d, c.h0, c.h1x2, c.h3x2);
      const V grad_l = StatsMath::grad_local(g, l, c.h0, c.h2x2);
      if constexpr (kMixGrad) {
        y[0] = c.omw * G + grad_g;
        y[1] = c.w * G + grad_l;
      } else {
        y[0] = grad_g;
        y[1] = grad_l;
      }
      y[2] = StatsMath::grad_anchor(d, c.h3x2);
    } else if constexpr (kMixGrad) {
      y[0] = c.omw * G;
      y[1] = c.w * G;
    }
    if constexpr (kMixGrad) {
      if (reduce) s[0] = s[0] + MixMath::lam_term(G, g, l);
    }
  }
};

}  // namespace fedkernels

// ---------------------------------------------------------------- Ensemble distillation
// Schemas and formulas in csrc/ops.cpp; the method in docs/fedgo.md. Scalar math only (A = float
// or double): the CPU and CUDA kernels compute the same per-row statistics and call these to
// turn them into scores, weights and loss terms.
#include <cmath>

namespace fedkernels {

// exp and log of float/double on either device (std:: on the host, CUDA's overloads on it).
template <typename A>
FEDKERNELS_HD A math_exp(A x) {
#if defined(__CUDA_ARCH__)
  return exp(x);
#else
  return std::exp(x);
#endif
}
template <typename A>
FEDKERNELS_HD A math_log(A x) {
#if defined(__CUDA_ARCH__)
  return log(x);
#else
  return std::log(x);
#endif
}

enum class Weighting : int { kUniform = 0, kEntropy = 1, kFedgo = 2, kVariance = 3, kDomain = 4 };

struct DistillMath {
  // Softmax-normalised weightings (w = softmax_k(score + log_prior)); the others are linear.
  FEDKERNELS_HD static bool softmax_kind(Weighting w) {
    return w == Weighting::kUniform || w == Weighting::kEntropy || w == Weighting::kFedgo;
  }
  template <typename A>
  FEDKERNELS_HD static A sigmoid(A z) {
    return A(1) / (A(1) + math_exp(-z));
  }
  // H(softmax(x)) = log s - t / s from s = sum e^(x - m) and t = sum e^(x - m) (x - m), m = max x
  // (the stable form; docs/algorithms/distillation.md, "Ops"). A class with e^(x - m) = 0 adds 0
  // to t (0 log 0 = 0), not 0 * -inf.
  template <typename A>
  FEDKERNELS_HD static A entropy(A s, A t) {
    return math_log(s) - t / s;
  }
  // The per-client score of one sample before normalisation over clients:
  //   softmax kinds: the exponent (without log_prior); linear kinds: the non-negative mass
  //   (without the n_k factor). var = (1/C) sum_c (x_c - mean)^2.
  template <typename A>
  FEDKERNELS_HD static A score(Weighting w, A z, A ent, A var, A tau, bool double_sigmoid) {
    switch (w) {
      case Weighting::kEntropy: return -ent / tau;
      case Weighting::kFedgo: return double_sigmoid ? sigmoid(z) : z;
      case Weighting::kVariance: return var;
      case Weighting::kDomain: return sigmoid(z);
      default: return A(0);
    }
  }
  // One element of the KL loss: y (log y - log q), with 0 at y = 0 (xlogy, even where q = 0);
  // NaN for a NaN or negative y (log y), as the gradient is NaN or meaningless there.
  template <typename A>
  FEDKERNELS_HD static A kl_term(A y, A log_q) {
    return y == A(0) ? A(0) : y * (math_log(y) - log_q);
  }
  // d loss / d S for one element: (scale / T) (q sum_c y - y), i.e. (scale / T) (q - y) for a
  // normalised target (exact for any non-negative target).
  template <typename A>
  FEDKERNELS_HD static A kl_grad(A q, A y, A y_sum, A scale_over_t) {
    return scale_over_t * (q * y_sum - y);
  }
};

}  // namespace fedkernels

// ---------------------------------------------------------------- FedEvg / SGLD
// Schemas and formulas in csrc/ops.cpp; the method in docs/fedevg.md.
#include <ATen/core/PhiloxRNGEngine.h>

#include <cstdint>
#include <type_traits>

#include "normal_noise.h"

namespace fedkernels {

struct SgldMath {
  // clip(g, -tau, tau) (tau = +inf: no clip; NaN passes through).
  template <typename A>
  FEDKERNELS_HD static A clip(A g, A tau) {
    return g < -tau ? -tau : (g > tau ? tau : g);
  }
  // x' = clamp(x - step a + std eps, lo, hi) (lo/hi = -inf/+inf: no clamp).
  template <typename A>
  FEDKERNELS_HD static A update(A x, A a, A eps, A step, A std, A lo, A hi) {
    const A v = x - step * a + std * eps;
    return v < lo ? lo : (v > hi ? hi : v);
  }
  // z = log w + phi(-E): phi = identity (exact) or sign (signed)
  // (docs/algorithms/fedevg.md, "Composition on the server").
  template <typename A>
  FEDKERNELS_HD static A logit(A log_w, A energy, bool signed_mode) {
    if (!signed_mode) return log_w - energy;
    const A s = energy < A(0) ? A(1) : (energy > A(0) ? A(-1) : A(0));
    return log_w + s;
  }
};

// Standard normals for the SGLD noise, the same on both devices: element e of a call takes
// lane e % 4 of the Philox-4x32-10 block (seed, subsequence = e / 4, offset); lanes (0, 1) and
// (2, 3) are Box-Muller pairs, u1 = (r + 1) 2^-32 in (0, 1], u2 = r 2^-32 in [0, 1). In fp32
// the pair is BoxMullerF32 (csrc/normal_noise.h: our own log, sin and cos, so every device and
// CPU build gives the same bits); in fp64 it uses the device's log, sin and cos.
struct PhiloxNormal {
  template <typename A>
  FEDKERNELS_HD static void box_muller(uint32_t r1, uint32_t r2, A& n0, A& n1) {
    if constexpr (std::is_same_v<A, float>) {
      BoxMullerF32<ScalarF32Ops>::pair(r1, r2, n0, n1);
    } else {
      const A scale = A(2.3283064365386963e-10);  // 2^-32
      const A u1 = (static_cast<A>(r1) + A(1)) * scale;
      const A u2 = static_cast<A>(r2) * scale;
      const A two_pi = A(6.283185307179586);
#if defined(__CUDA_ARCH__)
      const A r = sqrt(A(-2) * log(u1));
      n0 = r * cos(two_pi * u2);
      n1 = r * sin(two_pi * u2);
#else
      const A r = std::sqrt(A(-2) * std::log(u1));
      n0 = r * std::cos(two_pi * u2);
      n1 = r * std::sin(two_pi * u2);
#endif
    }
  }
  template <typename A>
  FEDKERNELS_HD static void normal4(uint64_t seed, uint64_t offset, uint64_t group, A* out) {
    at::philox_engine engine(seed, group, offset);
    const uint32_t r0 = engine(), r1 = engine(), r2 = engine(), r3 = engine();
    box_muller<A>(r0, r1, out[0], out[1]);
    box_muller<A>(r2, r3, out[2], out[3]);
  }
};

}  // namespace fedkernels

// ---------------------------------------------------------------- Quantized updates
// Schemas and formulas in csrc/ops.cpp; the method in docs/algorithms/quantized.md.
#include <cmath>
#include <cstring>
#include <limits>

namespace fedkernels {

struct QuantizeMath {
  static constexpr int kLevels = 127;  // symmetric int8: -127..127, so that -q is a level too

  // The block's float32 scale from max|v| (accumulate type A): NaN when the block holds a NaN
  // or an infinity, so that its dequantized values are NaN, as an fp32 sum would be.
  template <typename A>
  FEDKERNELS_HD static float scale_of(A amax, bool finite, A top = A(kLevels)) {
    if (!finite) {
#if defined(__CUDA_ARCH__)
      return __int_as_float(0x7fc00000);
#else
      return std::numeric_limits<float>::quiet_NaN();
#endif
    }
    return static_cast<float>(amax / top);
  }

  // Uniform in [0, 1) from one Philox word: its top 24 bits, exact in float32.
  FEDKERNELS_HD static float uniform24(uint32_t word) {
    return static_cast<float>(word >> 8) * 5.9604644775390625e-08f;  // 2^-24
  }

  // q for v in a block of scale s: round to nearest (ties to even), or floor(v / s + u) for
  // u uniform in [0, 1) (stochastic: E[q s] = v), clamped to [-levels, levels]. q = 0 where s
  // is 0 or NaN.
  template <typename A>
  FEDKERNELS_HD static int8_t quantize(A v, float s, bool stochastic, float u,
                                       int levels = kLevels) {
    if (!(s > 0.0f)) return 0;
    const A w = v / static_cast<A>(s);
#if defined(__CUDA_ARCH__)
    A r = stochastic ? floor(w + static_cast<A>(u)) : rint(w);
#else
    A r = stochastic ? std::floor(w + static_cast<A>(u)) : std::nearbyint(w);
#endif
    r = r < A(-levels) ? A(-levels) : (r > A(levels) ? A(levels) : r);
    return static_cast<int8_t>(r);
  }

  // What the server adds for one client: (w_k s_b) q, the product of the weight and the
  // scale taken once per block.
  FEDKERNELS_HD static float coefficient(float weight, float scale) { return weight * scale; }

  // ---- packed 4-bit: levels -7..7 in two's complement nibbles, element 2j in the low
  // nibble of byte j, element 2j + 1 in the high one.
  static constexpr int kLevels4 = 7;

  FEDKERNELS_HD static uint8_t pack4(int8_t lo, int8_t hi) {
    return static_cast<uint8_t>((static_cast<uint8_t>(lo) & 0x0F) | (static_cast<uint8_t>(hi) << 4));
  }

  // The signed level of element e of a packed tensor.
  FEDKERNELS_HD static int nibble(const uint8_t* p, int64_t e) {
    const int n = (p[e >> 1] >> ((e & 1) * 4)) & 0x0F;
    return (n ^ 8) - 8;
  }

  // ---- fp8 e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities,
  // 0x7F/0xFF are NaN): the largest finite value, which the per-tensor scale maps max|v| to.
  static constexpr float kFp8Max = 448.0f;

  // The spacing of the e4m3 values around a >= 0 (a <= 448): 2^(e-3) for a in [2^e, 2^(e+1)),
  // 2^-9 below 2^-6 (subnormals): a power of two, from the exponent bits of a.
  FEDKERNELS_HD static float fp8_step(float a) {
    if (a < 0.015625f) return 0.001953125f;
    uint32_t bits = float_bits(a) & 0x7F800000u;
    return bits_float(bits - (3u << 23));
  }
  FEDKERNELS_HD static double fp8_step(double a) {
    if (a < 0.015625) return 0.001953125;
    uint64_t bits;
#if defined(__CUDA_ARCH__)
    bits = static_cast<uint64_t>(__double_as_longlong(a));
#else
    std::memcpy(&bits, &a, sizeof bits);
#endif
    bits = (bits & 0x7FF0000000000000ull) - (uint64_t(3) << 52);
    double step;
#if defined(__CUDA_ARCH__)
    step = __longlong_as_double(static_cast<long long>(bits));
#else
    std::memcpy(&step, &bits, sizeof step);
#endif
    return step;
  }

  // The e4m3fn value that w (= v / s, finite) rounds to, as A: |w| saturated to 448 first (so
  // no NaN from finite input), then to nearest on the e4m3 grid (ties to even), or
  // stochastically to one of the two neighbouring values, up iff u < the fractional distance
  // (exact: the grid step is a power of two, so a / step and its fraction are exact).
  // The sign is w's sign bit (-0 stays -0, as a cast to e4m3fn keeps it).
  template <typename A>
  FEDKERNELS_HD static A fp8_round(A w, bool stochastic, float u) {
#if defined(__CUDA_ARCH__)
    A a = fabs(w);
#else
    A a = std::fabs(w);
#endif
    a = a < A(kFp8Max) ? a : A(kFp8Max);
    const A step = fp8_step(a);
    const A m = a / step;
#if defined(__CUDA_ARCH__)
    const A fl = floor(m);
    const A r = stochastic ? fl + (static_cast<A>(u) < m - fl ? A(1) : A(0)) : rint(m);
    const bool negative = signbit(w);
#else
    const A fl = std::floor(m);
    const A r = stochastic ? fl + (static_cast<A>(u) < m - fl ? A(1) : A(0)) : std::nearbyint(m);
    const bool negative = std::signbit(w);
#endif
    const A q = r * step;
    return negative ? -q : q;
  }

  // The e4m3fn bits of a value of the grid (what fp8_round returns, -0 included): exact.
  FEDKERNELS_HD static uint8_t fp8_bits(float q) {
    const uint32_t bits = float_bits(q);
    const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
    const float a = bits_float(bits & 0x7FFFFFFFu);
    if (a < 0.015625f) return sign | static_cast<uint8_t>(a * 512.0f);  // subnormal: m 2^-9
    // exponent e + 127 -> e + 7, the top 3 mantissa bits kept
    return sign | static_cast<uint8_t>(((bits & 0x7FFFFFFFu) >> 20) - (120u << 3));
  }

  // The float32 value of e4m3fn bits b (NaN for 0x7F/0xFF): exact.
  FEDKERNELS_HD static float fp8_value(uint8_t b) {
    const uint32_t m7 = b & 0x7Fu;
    float a;
    if (m7 == 0x7Fu) {
      a = bits_float(0x7fc00000u);
    } else if (m7 < 8) {
      a = static_cast<float>(m7) * 0.001953125f;  // subnormal: m 2^-9
    } else {
      a = bits_float((m7 << 20) + (120u << 23));
    }
    return (b & 0x80) ? -a : a;
  }

 private:
  FEDKERNELS_HD static uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
#endif
  }
  FEDKERNELS_HD static float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(b);
#else
    float x;
    std::memcpy(&x, &b, sizeof x);
    return x;
#endif
  }
};

// ---------------------------------------------------------------- sparse updates

// The server's sum of (index, value) lists: acc + w v in the accumulate type, rounded after the
// product and after the sum (no fused multiply-add on either device), so the CPU builds and
// the GPU give the reference's bits.
struct SparseMath {
  FEDKERNELS_HD static float add(float acc, float w, float v) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(acc, __fmul_rn(w, v));
#else
    return acc + w * v;
#endif
  }
  FEDKERNELS_HD static double add(double acc, double w, double v) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(acc, __dmul_rn(w, v));
#else
    return acc + w * v;
#endif
  }
};

}  // namespace fedkernels
