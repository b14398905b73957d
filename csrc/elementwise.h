// Per-element math shared by the CPU and CUDA kernels, so the CPU tests check the arithmetic
// the GPU runs. Each function is a template over the value type: a scalar (float, double) on
// either device, or an at::vec::Vectorized on the CPU.
#pragma once

#if defined(__CUDACC__)
#define FEDKERNELS_HD __host__ __device__ __forceinline__
#else
#define FEDKERNELS_HD inline
#endif

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

// ---------------------------------------------------------------- SuPerFed (issue 5)
// specs/superfed.md §1.5 and §3 K1-K3; schemas in csrc/ops.cpp.
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

// Per-tensor statistics of the regularizers: <g, l>, ||g||^2, ||l||^2, ||g - a||^2.
struct StatsMath {
  template <typename V>
  FEDKERNELS_HD static V diff(V g, V a) {
    return g - a;
  }
  // Backward with h = (H0, 2 H1, 2 H2, 2 H3):
  //   grad_g = H0 l + 2 H1 g + 2 H3 (g - a);  grad_l = H0 g + 2 H2 l;  grad_a = -2 H3 (g - a).
  template <typename V>
  FEDKERNELS_HD static V grad_global(V g, V l, V d, V h0, V h1x2, V h3x2) {
    return h0 * l + h1x2 * g + h3x2 * d;
  }
  template <typename V>
  FEDKERNELS_HD static V grad_local(V g, V l, V h0, V h2x2) {
    return h0 * g + h2x2 * l;
  }
};

}  // namespace fedkernels
