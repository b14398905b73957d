// FEDKERNELS_HD marks the functions the CPU and CUDA kernels share: __host__ __device__ under
// nvcc, plain inline functions in the CPU libraries.
#pragma once

#if defined(__CUDACC__)
#define FEDKERNELS_HD __host__ __device__ __forceinline__
#else
#define FEDKERNELS_HD inline
#endif

// Full unrolling of a loop with a constant trip count in device code (so that indices into a
// register array become constants); nothing in the CPU libraries.
#if defined(__CUDACC__)
#define FEDKERNELS_UNROLL _Pragma("unroll")
#else
#define FEDKERNELS_UNROLL
#endif
