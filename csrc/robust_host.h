// Host side of the robust-aggregation ops (coordinate_median, trimmed_mean, median_window_mean,
// pairwise_sq_distances; schemas in csrc/ops.cpp), shared by the CPU and CUDA backends: input
// validation (nothing is written before it passes), output allocation, and the split of the
// client lists into one plan per dtype, each run by one kernel call. csrc/private_host.h builds
// on the client-list checks here.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "client_lists.h"
#include "common.h"
#include "order_stats.h"

namespace fedkernels {

// The most clients the CUDA order-statistic kernels hold per coordinate (a thread keeps them in
// registers, sorted by a network of up to 128 values) and the distance kernels stage per tile.
constexpr int64_t kMaxRobustClientsCuda = 128;

// One kernel call over n tensors of one dtype, K clients each.
struct ClientListPlan {
  at::ScalarType dtype;
  int64_t K = 0;
  std::vector<const void*> inputs;  // [K][n], client-major, dense
  std::vector<const void*> bases;   // [n] (private_sum, update_norms), dense
  std::vector<void*> outs;          // [n], dense; may equal bases (in place)
  std::vector<int64_t> numels;      // [n], all > 0
  std::vector<int64_t> offsets;     // [n]: the tensor's first element in the whole model
  at::Device device = at::kCPU;
  // robust order statistics
  RobustRule rule = RobustRule::kMedian;
  int64_t param = 0;
  // pairwise_sq_distances ([K, K]) / update_norms ([K]): float64 sums of this plan's tensors
  at::Tensor sums;
  // private_sum
  at::Tensor coefficients;  // [K] float64 (on the CPU; the CUDA kernel uploads it)
  double noise_std = 0;
  std::optional<at::Generator> generator;

  int64_t num_tensors() const { return static_cast<int64_t>(numels.size()); }
};

using ClientListRunner = void (*)(ClientListPlan&);

// The end of the error of an out tensor that overlaps an input.
constexpr const char* kOutputAliasWhy =
    "; the output must not alias a client (or base, except in place)";

// Checks a client-major list of K clients of T tensors each (same shapes, dtypes and device as
// client 0's); returns T.
inline int64_t check_clients(const char* op, at::TensorList clients, int64_t K) {
  TORCH_CHECK_VALUE(K > 0, "fedkernels.", op, ": need at least one client, got num_clients = ", K);
  const int64_t n = static_cast<int64_t>(clients.size());
  TORCH_CHECK_VALUE(
      n % K == 0, "fedkernels.", op, ": got ", n, " client tensors for ", K,
      " clients; expected K * T tensors, client-major");
  const int64_t T = n / K;
  if (T > 0) check_client_tensors(op, clients, K, T, clients[0].device());
  return T;
}

// Checks `list` (base or out) against client 0's T tensors: same shape, dtype and device.
inline void check_like_clients(
    const char* op, at::TensorList list, at::TensorList clients, int64_t T, const char* name) {
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(list.size()) == T, "fedkernels.", op, ": ", name, " has ", list.size(),
      " tensors, clients have ", T);
  for (const auto t : c10::irange(T)) {
    const at::Tensor& x = list[t];
    const at::Tensor& ref = clients[t];
    check_device(op, x, ref.device(), /*allow_cpu=*/false, name, " tensor ", t);
    TORCH_CHECK_VALUE(
        x.sizes() == ref.sizes(), "fedkernels.", op, ": ", name, " tensor ", t, " has shape ",
        x.sizes(), ", clients have ", ref.sizes());
    TORCH_CHECK_TYPE(
        x.scalar_type() == ref.scalar_type(), "fedkernels.", op, ": ", name, " tensor ", t,
        " has dtype ", x.scalar_type(), ", clients have ", ref.scalar_type());
  }
}

// Plans per dtype (in dtype order) over the non-empty tensors of a client-major list; base and
// out are optional ([] skips them). `offsets` count every element of the model, in order.
inline std::map<at::ScalarType, ClientListPlan> make_plans(
    at::TensorList clients, int64_t K, int64_t T, at::TensorList base, at::TensorList out,
    DenseBuffers& dense) {
  std::map<at::ScalarType, ClientListPlan> plans;
  std::vector<std::vector<int64_t>> members;  // per plan, in tensor order (filled below)
  int64_t offset = 0;
  for (const auto t : c10::irange(T)) {
    const int64_t numel = clients[t].numel();
    const int64_t first = offset;
    offset += numel;
    if (numel == 0) continue;
    auto& p = plans[clients[t].scalar_type()];
    p.dtype = clients[t].scalar_type();
    p.K = K;
    p.device = clients[t].device();
    p.numels.push_back(numel);
    p.offsets.push_back(first);
    if (!base.empty()) p.bases.push_back(dense.in(base[t]));
    if (!out.empty()) p.outs.push_back(dense.out(out[t]));
  }
  for (auto& [dtype, p] : plans) p.inputs.reserve(K * p.num_tensors());
  for (const auto k : c10::irange(K)) {
    for (const auto t : c10::irange(T)) {
      const at::Tensor& x = clients[k * T + t];
      if (x.numel() > 0) plans.at(x.scalar_type()).inputs.push_back(dense.in(x));
    }
  }
  return plans;
}

// ---------------------------------------------------------------- order statistics

inline const char* rule_op(RobustRule rule) {
  switch (rule) {
    case RobustRule::kMedian: return "coordinate_median";
    case RobustRule::kTrimmedMean: return "trimmed_mean";
    default: return "median_window_mean";
  }
}

inline void check_rule_param(RobustRule rule, int64_t K, int64_t param) {
  const char* op = rule_op(rule);
  if (rule == RobustRule::kTrimmedMean) {
    // K - param, not 2 * param, which wraps for a cut near 2^62 and would pass.
    TORCH_CHECK_VALUE(
        param >= 0 && param < K - param, "fedkernels.", op, ": cut must be in [0, K/2) for K = ",
        K, " clients (it drops `cut` values at each end), got ", param);
  } else if (rule == RobustRule::kMedianWindow) {
    TORCH_CHECK_VALUE(
        param >= 1 && param <= K, "fedkernels.", op, ": window must be in [1, K] for K = ", K,
        " clients, got ", param);
  }
}

inline void run_robust(
    at::TensorList clients, int64_t K, RobustRule rule, int64_t param, at::TensorList out,
    bool check_out, ClientListRunner runner) {
  const char* op = rule_op(rule);
  const int64_t T = check_clients(op, clients, K);
  check_rule_param(rule, K, param);
  if (check_out) {
    check_like_clients(op, out, clients, T, "out");
    check_outputs_apart(op, out, clients, K, {}, kOutputAliasWhy);
  }
  if (T > 0 && clients[0].is_cuda()) {
    TORCH_CHECK_VALUE(
        K <= kMaxRobustClientsCuda, "fedkernels.", op, ": the CUDA kernel takes at most ",
        kMaxRobustClientsCuda, " clients, got ", K);
  }
  DenseBuffers dense;
  auto plans = make_plans(clients, K, T, {}, out, dense);
  for (auto& [dtype, p] : plans) {
    p.rule = rule;
    p.param = param;
    runner(p);
  }
  dense.finish();
}

template <RobustRule kRule>
std::vector<at::Tensor> robust_functional(
    at::TensorList clients, int64_t K, int64_t param, ClientListRunner runner) {
  const int64_t T = check_clients(rule_op(kRule), clients, K);
  std::vector<at::Tensor> out;
  out.reserve(T);
  for (const auto t : c10::irange(T)) out.push_back(at::empty_like(clients[t]));
  run_robust(clients, K, kRule, param, out, /*check_out=*/false, runner);
  return out;
}

// ---------------------------------------------------------------- pairwise distances

inline at::Tensor pairwise_sq_distances_host(
    at::TensorList clients, int64_t K, ClientListRunner runner) {
  const char* op = "pairwise_sq_distances";
  const int64_t T = check_clients(op, clients, K);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor d = at::zeros({K, K}, T > 0 ? opts.device(clients[0].device()) : opts);
  DenseBuffers dense;
  auto plans = make_plans(clients, K, T, {}, {}, dense);
  for (auto& [dtype, p] : plans) {  // groups added in dtype order: a fixed order
    p.sums = at::zeros({K, K}, d.options());
    runner(p);
    d.add_(p.sums);
  }
  return d;
}

// ---------------------------------------------------------------- registration

template <typename Kernels>
void run_robust_plan(ClientListPlan& p) {
  dispatch_float(p.dtype, rule_op(p.rule), [&](auto dtype) {
    Kernels::template robust<typename decltype(dtype)::type>(p);
  });
}

template <typename Kernels>
void run_distances_plan(ClientListPlan& p) {
  dispatch_float(p.dtype, "pairwise_sq_distances", [&](auto dtype) {
    Kernels::template distances<typename decltype(dtype)::type>(p);
  });
}

// Registers the robust ops of one backend (CPU, CUDA), whose kernels are the templates
// Kernels::robust<T>(ClientListPlan&) and Kernels::distances<T>(ClientListPlan&).
template <typename Kernels>
void register_robust(torch::Library& m) {
  m.impl("coordinate_median", [](at::TensorList clients, int64_t K) {
    return robust_functional<RobustRule::kMedian>(clients, K, 0, &run_robust_plan<Kernels>);
  });
  m.impl("coordinate_median.out", [](at::TensorList clients, int64_t K, at::TensorList out) {
    run_robust(clients, K, RobustRule::kMedian, 0, out, true, &run_robust_plan<Kernels>);
  });
  m.impl("trimmed_mean", [](at::TensorList clients, int64_t K, int64_t cut) {
    return robust_functional<RobustRule::kTrimmedMean>(clients, K, cut, &run_robust_plan<Kernels>);
  });
  m.impl("trimmed_mean.out", [](at::TensorList clients, int64_t K, int64_t cut, at::TensorList out) {
    run_robust(clients, K, RobustRule::kTrimmedMean, cut, out, true, &run_robust_plan<Kernels>);
  });
  m.impl("median_window_mean", [](at::TensorList clients, int64_t K, int64_t window) {
    return robust_functional<RobustRule::kMedianWindow>(
        clients, K, window, &run_robust_plan<Kernels>);
  });
  m.impl(
      "median_window_mean.out",
      [](at::TensorList clients, int64_t K, int64_t window, at::TensorList out) {
        run_robust(
            clients, K, RobustRule::kMedianWindow, window, out, true, &run_robust_plan<Kernels>);
      });
  m.impl("pairwise_sq_distances", [](at::TensorList clients, int64_t K) {
    return pairwise_sq_distances_host(clients, K, &run_distances_plan<Kernels>);
  });
}

}  // namespace fedkernels
