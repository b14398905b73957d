// Host side of the differential-privacy ops (update_norms, private_sum; schemas in
// csrc/ops.cpp), shared by the CPU and CUDA backends: validation (nothing is written before it
// passes), output allocation and the plans per dtype (csrc/robust_host.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <map>
#include <optional>
#include <vector>

#include "common.h"
#include "robust_host.h"

namespace fedkernels {

inline at::Tensor update_norms_host(
    at::TensorList clients, int64_t K, at::TensorList base, ClientListRunner runner) {
  const char* op = "update_norms";
  const int64_t T = check_clients(op, clients, K);
  check_like_clients(op, base, clients, T, "base");
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor sq = at::zeros({K}, T > 0 ? opts.device(clients[0].device()) : opts);
  DenseBuffers dense;
  auto plans = make_plans(clients, K, T, base, {}, dense);
  for (auto& [dtype, p] : plans) {  // dtype order: a fixed order of the partial sums
    p.sums = at::zeros({K}, sq.options());
    runner(p);
    sq.add_(p.sums);
  }
  return sq.sqrt_();
}

// Checks the K coefficients (1-D, real, finite; on the CPU) and returns them as float64.
inline at::Tensor checked_coefficients(const char* op, const at::Tensor& c, int64_t K) {
  TORCH_CHECK_VALUE(
      c.dim() == 1 && c.numel() == K, "fedkernels.", op, ": coefficients must be [K] = [", K,
      "], got shape ", c.sizes());
  TORCH_CHECK_VALUE(
      c.device().is_cpu(), "fedkernels.", op, ": coefficients are on ", c.device(),
      ", expected cpu (the host computes them from the update norms)");
  TORCH_CHECK_TYPE(
      at::isFloatingType(c.scalar_type()), "fedkernels.", op,
      ": coefficients must be floating point, got ", c.scalar_type());
  at::Tensor w = contiguous_aligned(c.to(at::kDouble));
  const double* wp = w.const_data_ptr<double>();
  for (const auto k : c10::irange(K)) {
    TORCH_CHECK_VALUE(
        std::isfinite(wp[k]), "fedkernels.", op, ": coefficient of client ", k, " is ", wp[k]);
  }
  return w;
}

inline int64_t clients_of(const char* op, at::TensorList clients, const at::Tensor& c) {
  TORCH_CHECK_VALUE(c.dim() == 1, "fedkernels.", op, ": coefficients must be 1-D [K], got ",
                    c.dim(), "-D");
  return c.numel();
}

using PrivatePlansRunner = void (*)(std::map<at::ScalarType, ClientListPlan>&);

// out_t = base_t + sum_k c_k (x_kt - base_t) + noise_std * eps (out may be base: in place).
inline void run_private_sum(
    at::TensorList clients, const at::Tensor& coefficients, at::TensorList base, double noise_std,
    std::optional<at::Generator> generator, at::TensorList out, bool check_out, bool in_place,
    PrivatePlansRunner runner) {
  const char* op = in_place ? "private_sum_" : "private_sum";
  const int64_t K = clients_of(op, clients, coefficients);
  const int64_t T = check_clients(op, clients, K);
  check_like_clients(op, base, clients, T, "base");
  check_finite_nonnegative(op, "noise_std", noise_std);
  const at::Tensor w = checked_coefficients(op, coefficients, K);
  if (check_out) {
    check_like_clients(op, out, clients, T, "out");
    check_outputs_apart(
        op, out, clients, K, in_place ? at::TensorList() : base, kOutputAliasWhy);
  }
  DenseBuffers dense;
  auto plans = make_plans(clients, K, T, base, out, dense);
  for (auto& [dtype, p] : plans) {
    p.coefficients = w;
    p.noise_std = noise_std;
    p.generator = generator;
  }
  runner(plans);
  dense.finish();
}

template <typename Kernels>
void run_norms_plan(ClientListPlan& p) {
  dispatch_float(p.dtype, "update_norms", [&](auto dtype) {
    Kernels::template norms<typename decltype(dtype)::type>(p);
  });
}

// One noise key per call (Kernels::draw_key, only when there is noise to draw), shared by the
// plans of every dtype: element e of the model gets normal e of one stream.
template <typename Kernels>
void run_private_plans(std::map<at::ScalarType, ClientListPlan>& plans) {
  if (plans.empty()) return;
  ClientListPlan& first = plans.begin()->second;
  const auto key = Kernels::draw_key(first);
  for (auto& [dtype, p] : plans) {
    dispatch_float(p.dtype, "private_sum", [&](auto tag) {
      Kernels::template private_sum<typename decltype(tag)::type>(p, key);
    });
  }
}

template <typename Kernels>
void private_sum_entry(
    at::TensorList clients, const at::Tensor& coefficients, at::TensorList base, double noise_std,
    std::optional<at::Generator> generator, at::TensorList out, bool check_out, bool in_place) {
  run_private_sum(
      clients, coefficients, base, noise_std, generator, out, check_out, in_place,
      &run_private_plans<Kernels>);
}

// Registers the DP ops of one backend (CPU, CUDA), whose kernels are the templates
// Kernels::norms<T>(ClientListPlan&) and Kernels::private_sum<T>(ClientListPlan&, Key), with
// Kernels::draw_key(ClientListPlan&) -> Key the call's noise key.
template <typename Kernels>
void register_private(torch::Library& m) {
  m.impl("update_norms", [](at::TensorList clients, int64_t K, at::TensorList base) {
    return update_norms_host(clients, K, base, &run_norms_plan<Kernels>);
  });
  m.impl(
      "private_sum",
      [](at::TensorList clients, const at::Tensor& coefficients, at::TensorList base,
         double noise_std, std::optional<at::Generator> generator) {
        const int64_t K = clients_of("private_sum", clients, coefficients);
        const int64_t T = check_clients("private_sum", clients, K);
        std::vector<at::Tensor> out;
        out.reserve(T);
        for (const auto t : c10::irange(T)) out.push_back(at::empty_like(clients[t]));
        private_sum_entry<Kernels>(
            clients, coefficients, base, noise_std, generator, out, false, false);
        return out;
      });
  m.impl(
      "private_sum.out",
      [](at::TensorList clients, const at::Tensor& coefficients, at::TensorList base,
         double noise_std, std::optional<at::Generator> generator, at::TensorList out) {
        private_sum_entry<Kernels>(
            clients, coefficients, base, noise_std, generator, out, true, false);
      });
  m.impl(
      "private_sum_",
      [](at::TensorList base, at::TensorList clients, const at::Tensor& coefficients,
         double noise_std, std::optional<at::Generator> generator) {
        private_sum_entry<Kernels>(
            clients, coefficients, base, noise_std, generator, base, true, true);
      });
}

}  // namespace fedkernels
