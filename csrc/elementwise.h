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
