// CUDA kernels of the ensemble-distillation ops (schemas and formulas: csrc/ops.cpp; host side:
// csrc/distill_host.h; per-row formulas: DistillMath in csrc/elementwise.h, shared with the CPU
// kernels).
//
// ensemble_pseudo_labels: one block per sample row i (grid-stride). The block's warps take the
// K clients in turn (warp w: clients w, w + 8, ...) and reduce each teacher row L[k, i, :] with
// shuffles only (the statistics the weighting and the combine need); warp 0 turns the K scores
// into weights; then the threads stride over the classes, each combining its classes over the
// clients in order k = 0..K-1 into a row buffer (shared memory when it fits, else a global fp32
// workspace), and the block's max and sum reductions finish the softmax. Every reduction has a
// fixed order, so a given input gives bitwise the same output run after run.
//
// distill_kl: one warp per row computes the row's loss and (optionally) writes the gradient;
// the per-row losses are then summed by one block in a fixed order.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../distill_host.h"
#include "../elementwise.h"
#include "multi_tensor.cuh"

namespace fedkernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Dynamic shared memory per block; the static reduction buffers fit in the rest of 48 KiB.
constexpr size_t kSharedLimit = 46 * 1024;

struct PseudoLabelArgs {
  int64_t K, N, C;
  Weighting weighting;
  bool probs;
  bool double_sigmoid;
  bool acc_in_shared;
  double temperature;
  double tau;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) pseudo_labels_kernel(
    const T* __restrict__ logits, const acc_type<T>* __restrict__ scores,
    const acc_type<T>* __restrict__ log_prior, T* __restrict__ out_y, T* __restrict__ out_w,
    acc_type<T>* __restrict__ workspace, const PseudoLabelArgs a) {
  using A = acc_type<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A s_red[kWarps];
  const int64_t K = a.K, N = a.N, C = a.C;
  A* s_score = reinterpret_cast<A*>(smem_raw);
  A* s_maxt = s_score + K;
  A* s_sumt = s_maxt + K;
  A* s_w = s_sumt + K;
  A* s_acc = s_w + K;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const A inv_t = static_cast<A>(1.0 / a.temperature);
  const A tau = static_cast<A>(a.tau);
  const A inf = std::numeric_limits<A>::infinity();
  const bool entropy = a.weighting == Weighting::kEntropy;
  const bool variance = a.weighting == Weighting::kVariance;
  const bool row_stats = entropy || variance || a.probs;

  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    __syncthreads();  // the previous row is done with the shared buffers
    A* acc = a.acc_in_shared ? s_acc : workspace + i * C;
    // 1. Per-client statistics and scores (docs/algorithms/distillation.md, "Ops"), one warp per client.
    if (row_stats) {
      for (int64_t k = warp; k < K; k += kWarps) {
        const T* x = logits + (k * N + i) * C;
        A ent = 0, var = 0, max_t = 0, sum_t = 1;
        if (entropy || a.probs) {
          A m = -inf;
          for (int64_t c = lane; c < C; c += 32) m = MaxOp<A>()(m, static_cast<A>(x[c]));
          m = warp_reduce(m, MaxOp<A>());
          CompensatedSum<A> s, t, st;
          max_t = m * inv_t;
          for (int64_t c = lane; c < C; c += 32) {
            const A v = static_cast<A>(x[c]);
            if (entropy) {
              const A d = v - m;
              const A e = math_exp(d);
              s.add(e);
              if (e != A(0)) t.add(e * d);  // a -inf logit adds 0, not 0 * -inf
            }
            if (a.probs) st.add(math_exp(v * inv_t - max_t));
          }
          if (entropy) {
            ent = DistillMath::entropy(warp_reduce(s.sum, SumOp<A>()),
                                       warp_reduce(t.sum, SumOp<A>()));
          }
          if (a.probs) sum_t = warp_reduce(st.sum, SumOp<A>());
        }
        if (variance) {
          A s = 0;
          for (int64_t c = lane; c < C; c += 32) s += static_cast<A>(x[c]);
          const A mean = warp_reduce(s, SumOp<A>()) / static_cast<A>(C);
          A m2 = 0;
          for (int64_t c = lane; c < C; c += 32) {
            const A d = static_cast<A>(x[c]) - mean;
            m2 += d * d;
          }
          var = warp_reduce(m2, SumOp<A>()) / static_cast<A>(C);
        }
        if (lane == 0) {
          const A z = scores ? scores[k * N + i] : A(0);
          s_score[k] = DistillMath::score<A>(a.weighting, z, ent, var, tau, a.double_sigmoid);
          s_maxt[k] = max_t;
          s_sumt[k] = sum_t;
        }
      }
    } else {
      for (int64_t k = tid; k < K; k += kThreads) {
        const A z = scores ? scores[k * N + i] : A(0);
        s_score[k] = DistillMath::score<A>(a.weighting, z, A(0), A(0), tau, a.double_sigmoid);
      }
    }
    __syncthreads();
    // 2. Weights over the clients, by warp 0.
    if (warp == 0) {
      if (DistillMath::softmax_kind(a.weighting)) {
        A m = -inf;
        for (int64_t k = lane; k < K; k += 32) {
          const A v = s_score[k] + (log_prior ? log_prior[k] : A(0));
          s_w[k] = v;
          m = MaxOp<A>()(m, v);
        }
        m = warp_reduce(m, MaxOp<A>());
        A sum = 0;
        for (int64_t k = lane; k < K; k += 32) {
          const A e = math_exp(s_w[k] - m);
          s_w[k] = e;
          sum += e;
        }
        sum = warp_reduce(sum, SumOp<A>());
        for (int64_t k = lane; k < K; k += 32) s_w[k] /= sum;
      } else {
        A sum = 0;
        for (int64_t k = lane; k < K; k += 32) {
          const A v = s_score[k] * (log_prior ? math_exp(log_prior[k]) : A(1));
          s_w[k] = v;
          sum += v;
        }
        sum = warp_reduce(sum, SumOp<A>());
        for (int64_t k = lane; k < K; k += 32) {
          s_w[k] = sum > A(0) ? s_w[k] / sum : A(1) / static_cast<A>(K);
        }
      }
      __syncwarp();
      for (int64_t k = lane; k < K; k += 32) out_w[k * N + i] = static_cast<T>(s_w[k]);
    }
    __syncthreads();
    // 3. Combination in client order and the final softmax (logit mode).
    T* y = out_y + i * C;
    A local_max = -inf;
    for (int64_t c = tid; c < C; c += kThreads) {
      A v = 0;
      for (int64_t k = 0; k < K; ++k) {
        const A x = static_cast<A>(logits[(k * N + i) * C + c]);
        if (a.probs) {
          v += s_w[k] / s_sumt[k] * math_exp(x * inv_t - s_maxt[k]);
        } else {
          v += s_w[k] * x;
        }
      }
      if (a.probs) {
        y[c] = static_cast<T>(v);
      } else {
        acc[c] = v;
        local_max = MaxOp<A>()(local_max, v * inv_t);
      }
    }
    if (a.probs) continue;
    const A m = block_reduce<kThreads>(local_max, MaxOp<A>(), s_red);
    CompensatedSum<A> local_sum;
    for (int64_t c = tid; c < C; c += kThreads) {
      const A e = math_exp(acc[c] * inv_t - m);
      acc[c] = e;
      local_sum.add(e);
    }
    const A inv_sum = A(1) / block_reduce<kThreads>(local_sum.sum, SumOp<A>(), s_red);
    for (int64_t c = tid; c < C; c += kThreads) y[c] = static_cast<T>(acc[c] * inv_sum);
  }
}

// One warp per row: the row's loss into row_loss[i] (float64), the gradient into grad.
template <typename T>
__global__ void __launch_bounds__(kThreads) distill_kl_rows_kernel(
    const T* __restrict__ student, const T* __restrict__ target, T* __restrict__ grad,
    double* __restrict__ row_loss, int64_t N, int64_t C, acc_type<T> inv_t,
    acc_type<T> scale_over_t) {
  using A = acc_type<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; i < N;
       i += warps) {
    const T* s = student + i * C;
    const T* y = target + i * C;
    A m = -std::numeric_limits<A>::infinity();
    for (int64_t c = lane; c < C; c += 32) m = MaxOp<A>()(m, static_cast<A>(s[c]) * inv_t);
    m = warp_reduce(m, MaxOp<A>());
    CompensatedSum<A> lane_sum;
    for (int64_t c = lane; c < C; c += 32) lane_sum.add(math_exp(static_cast<A>(s[c]) * inv_t - m));
    const A sum = warp_reduce(lane_sum.sum, SumOp<A>());
    const A log_sum = math_log(sum);
    const A inv_sum = A(1) / sum;
    // A lane adds C / 32 terms: in float64, so that rows of 1e6 classes keep float32
    // accuracy (a compensated float sum would turn an infinite term into NaN).
    double loss = 0, y_total = 0;
    for (int64_t c = lane; c < C; c += 32) {
      const A yc = static_cast<A>(y[c]);
      loss += static_cast<double>(
          DistillMath::kl_term<A>(yc, static_cast<A>(s[c]) * inv_t - m - log_sum));
      y_total += static_cast<double>(yc);
    }
    loss = warp_reduce(loss, SumOp<double>());
    if (grad) {
      const A y_sum = static_cast<A>(warp_reduce(y_total, SumOp<double>()));
      for (int64_t c = lane; c < C; c += 32) {
        const A q = math_exp(static_cast<A>(s[c]) * inv_t - m) * inv_sum;
        grad[i * C + c] =
            static_cast<T>(DistillMath::kl_grad<A>(q, static_cast<A>(y[c]), y_sum, scale_over_t));
      }
    }
    if (lane == 0) row_loss[i] = loss;
  }
}

// loss = scale * sum_i row_loss[i], by one block in a fixed order.
template <typename A>
__global__ void __launch_bounds__(kThreads) sum_rows_kernel(
    const double* __restrict__ row_loss, int64_t N, double scale, A* __restrict__ loss) {
  __shared__ double s_red[kWarps];
  double v = 0;
  for (int64_t i = threadIdx.x; i < N; i += kThreads) v += row_loss[i];
  v = block_reduce<kThreads>(v, SumOp<double>(), s_red);
  if (threadIdx.x == 0) *loss = static_cast<A>(scale * v);
}

struct DistillCuda {
  template <typename T>
  static void pseudo_labels(const PseudoLabelPlan& p) {
    using A = acc_type<T>;
    const CudaLaunch launch(p.device);
    const size_t per_client = 4 * sizeof(A) * static_cast<size_t>(p.K);
    TORCH_CHECK_VALUE(
        per_client <= kSharedLimit, "fedkernels.ensemble_pseudo_labels: K = ", p.K,
        " clients is more than the CUDA kernel supports (", kSharedLimit / (4 * sizeof(A)), ")");
    PseudoLabelArgs a;
    a.K = p.K;
    a.N = p.N;
    a.C = p.C;
    a.weighting = p.weighting;
    a.probs = p.probs;
    a.double_sigmoid = p.double_sigmoid;
    a.temperature = p.temperature;
    a.tau = p.tau;
    const size_t with_row = per_client + sizeof(A) * static_cast<size_t>(p.C);
    a.acc_in_shared = p.probs || with_row <= kSharedLimit;
    at::Tensor workspace;
    if (!a.acc_in_shared) {
      workspace = at::empty(
          {p.N, p.C},
          at::TensorOptions().device(p.device).dtype(c10::CppTypeToScalarType<A>::value));
    }
    const size_t shared = a.acc_in_shared && !p.probs ? with_row : per_client;
    pseudo_labels_kernel<T><<<grid_size(p.N, 1, 65535 * 8), kThreads, shared, launch.stream>>>(
        static_cast<const T*>(p.logits), static_cast<const A*>(p.scores),
        static_cast<const A*>(p.log_prior), static_cast<T*>(p.out_labels),
        static_cast<T*>(p.out_weights),
        workspace.defined() ? workspace.mutable_data_ptr<A>() : nullptr, a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T>
  static void distill_kl(const DistillKLPlan& p) {
    using A = acc_type<T>;
    const CudaLaunch launch(p.device);
    at::Tensor row_loss =
        at::empty({p.N}, at::TensorOptions().device(p.device).dtype(at::kDouble));
    distill_kl_rows_kernel<T><<<grid_size(p.N, kWarps, 65535 * 8), kThreads, 0, launch.stream>>>(
        static_cast<const T*>(p.student), static_cast<const T*>(p.target), static_cast<T*>(p.grad),
        row_loss.mutable_data_ptr<double>(), p.N, p.C, static_cast<A>(1.0 / p.temperature),
        static_cast<A>(p.scale / p.temperature));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    sum_rows_kernel<A><<<1, kThreads, 0, launch.stream>>>(
        row_loss.const_data_ptr<double>(), p.N, p.scale, static_cast<A*>(p.loss));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  register_distill<DistillCuda>(m);
}

}  // namespace fedkernels
