// CUDA kernels of the SGLD / FedEvg ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/sgld_host.h; per-element formulas in csrc/elementwise.h, shared with the CPU kernels).
//
// energy_from_logits: one warp per row, shuffle reductions (max, then sum of exp).
// sgld_compose_step: (1) one thread per sample j turns the K energies into pi[:, j] (softmax
// over clients, stable); (2) one thread per group of 4 consecutive elements (the 4 lanes of one
// Philox block) streams the K clients' gradients once, in client order, accumulating
// pi[k, j] clip(G[k, e]) in fp32 (fp64 for fp64), then adds step, noise and clamp and writes
// x'. sgld_step is (2) with K = 0. The Philox seed and offset come from the CUDA generator
// (philox_cuda_state, graph-safe), so a seeded torch.Generator reproduces a run.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <tuple>

#include "../elementwise.h"
#include "../sgld_host.h"
#include "multi_tensor.cuh"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535LL * 32;

template <typename T>
__global__ void energy_kernel(const T* logits, const int64_t* labels, T* out, int64_t N, int64_t C) {
  using A = acc_type<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < N; i += warps) {
    const T* row = logits + i * C;
    if (labels) {
      if (lane == 0) {
        const int64_t y = labels[i];
        CUDA_KERNEL_ASSERT(y >= 0 && y < C && "fedkernels.energy_from_logits: label out of range");
        out[i] = static_cast<T>(-static_cast<A>(row[y]));
      }
      continue;
    }
    A m = -std::numeric_limits<A>::infinity();
    bool has_nan = false;
    for (int64_t c = lane; c < C; c += 32) {
      const A v = static_cast<A>(row[c]);
      m = max(m, v);
      has_nan |= v != v;
    }
    m = warp_reduce(m, MaxOp<A>());
    has_nan = __any_sync(0xffffffffu, has_nan);
    // An infinite max is the log-sum-exp itself (x - m would give inf - inf = NaN).
    const A inf = std::numeric_limits<A>::infinity();
    if (m == inf || m == -inf || has_nan) {
      if (lane == 0) out[i] = static_cast<T>(has_nan ? std::numeric_limits<A>::quiet_NaN() : -m);
      continue;
    }
    CompensatedSum<A> lane_s;
    for (int64_t c = lane; c < C; c += 32) lane_s.add(math_exp(static_cast<A>(row[c]) - m));
    const A s = warp_reduce(lane_s.sum, SumOp<A>());
    if (lane == 0) out[i] = static_cast<T>(-(m + math_log(s)));
  }
}

constexpr int kWeightThreads = 32;

template <typename A>
__global__ void weights_kernel(
    const A* energies, const A* log_w, A* pi, int64_t K, int64_t M, bool signed_mode) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < M;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A m = -std::numeric_limits<A>::infinity();
#pragma unroll 4
    for (int64_t k = 0; k < K; ++k) {
      const A z = SgldMath::logit<A>(log_w[k], energies[k * M + j], signed_mode);
      pi[k * M + j] = z;
      m = max(m, z);
    }
    A sum = 0;
#pragma unroll 4
    for (int64_t k = 0; k < K; ++k) {
      const A w = math_exp(pi[k * M + j] - m);
      pi[k * M + j] = w;
      sum += w;
    }
#pragma unroll 4
    for (int64_t k = 0; k < K; ++k) pi[k * M + j] /= sum;
  }
}

struct UpdateArgs {
  int64_t K, M, D, n;
  double step, noise_std, tau, lo, hi;
  bool draw_noise;
  at::PhiloxCudaState philox;
};

template <typename T>
__global__ void update_kernel(
    const T* __restrict__ x, const T* __restrict__ grads, const acc_type<T>* __restrict__ pi,
    const T* __restrict__ noise, T* out, UpdateArgs args) {
  using A = acc_type<T>;
  const A tau = static_cast<A>(args.tau), step = static_cast<A>(args.step);
  const A std_ = static_cast<A>(args.noise_std);
  const A lo = static_cast<A>(args.lo), hi = static_cast<A>(args.hi);
  uint64_t seed = 0, offset = 0;
  if (args.draw_noise) {
    const auto so = at::cuda::philox::unpack(args.philox);
    seed = std::get<0>(so);
    offset = std::get<1>(so);
  }
  const int64_t n = args.n, groups = (n + 3) / 4;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e0 = g * 4;
    const int cnt = static_cast<int>(n - e0 < 4 ? n - e0 : 4);
    A acc[4] = {0, 0, 0, 0};
    if (args.K == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (i < cnt) acc[i] = SgldMath::clip<A>(static_cast<A>(grads[e0 + i]), tau);
    } else {
      int64_t j[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) j[i] = (e0 + i) / args.D;
      for (int64_t k = 0; k < args.K; ++k) {
        const T* gk = grads + k * n;
        const A* pk = pi + k * args.M;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (i < cnt) acc[i] += pk[j[i]] * SgldMath::clip<A>(static_cast<A>(gk[e0 + i]), tau);
        }
      }
    }
    A eps[4] = {0, 0, 0, 0};
    if (args.draw_noise) PhiloxNormal::normal4<A>(seed, offset, static_cast<uint64_t>(g), eps);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i < cnt) {
        const A ei = noise ? static_cast<A>(noise[e0 + i]) : eps[i];
        out[e0 + i] = static_cast<T>(
            SgldMath::update<A>(static_cast<A>(x[e0 + i]), acc[i], ei, step, std_, lo, hi));
      }
    }
  }
}

// The Philox seed and offset of the plan's generator (the device's default CUDA generator when
// none), advanced by one 128-bit block per thread.
at::PhiloxCudaState philox_state(const SgldPlan& p) {
  if (!p.draw_noise || p.M * p.D == 0) return {};
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      p.generator, at::cuda::detail::getDefaultCUDAGenerator(p.device.index()));
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->philox_cuda_state(4);
}

struct SgldCuda {
  template <typename T>
  static void energy(const EnergyPlan& p) {
    const CudaLaunch launch(p.device);
    energy_kernel<T><<<grid_size(p.N, kThreads / 32, kMaxBlocks), kThreads, 0, launch.stream>>>(
        static_cast<const T*>(p.logits), p.labels, static_cast<T*>(p.out), p.N, p.C);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T>
  static void sgld(const SgldPlan& p) {
    using A = acc_type<T>;
    const CudaLaunch launch(p.device);
    const at::PhiloxCudaState philox = philox_state(p);
    if (p.K > 0) {
      // One thread per sample: M is small (hundreds to thousands), so small blocks spread it
      // over more multiprocessors (a few large blocks would be latency-bound).
      weights_kernel<A><<<grid_size(p.M, kWeightThreads, kMaxBlocks), kWeightThreads, 0,
                          launch.stream>>>(
          static_cast<const A*>(p.energies), static_cast<const A*>(p.log_weights),
          static_cast<A*>(p.pi), p.K, p.M, p.signed_mode);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const int64_t n = p.M * p.D;
    if (n == 0) return;
    UpdateArgs a;
    a.K = p.K;
    a.M = p.M;
    a.D = p.D;
    a.n = n;
    a.step = p.step;
    a.noise_std = p.noise_std;
    a.tau = p.tau;
    a.lo = p.lo;
    a.hi = p.hi;
    a.draw_noise = p.draw_noise;
    a.philox = philox;
    update_kernel<T><<<grid_size((n + 3) / 4, kThreads, kMaxBlocks), kThreads, 0, launch.stream>>>(
        static_cast<const T*>(p.x), static_cast<const T*>(p.grads),
        static_cast<const A*>(p.pi), static_cast<const T*>(p.noise), static_cast<T*>(p.out), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_sgld<SgldCuda>(m);
}

}  // namespace fedkernels
