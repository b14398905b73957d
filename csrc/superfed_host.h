// Host-side part of the SuPerFed ops (mix_endpoints, superfed_stats and their backwards; schemas
// in csrc/ops.cpp, math in specs/superfed.md §1.5 and §3 K1-K3) shared by the CPU and CUDA
// backends: input validation (nothing is allocated or written before it passes), output
// allocation, and the split of the tensor list into groups of one dtype, each run by one kernel
// call of the backend.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/irange.h>

#include <array>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "weighted_sum_host.h"  // is_supported_float

namespace fedkernels {

enum class SuperfedKind { kMix, kMixBackward, kStats, kStatsBackward, kMixStats, kMixStatsBackward };

// One kernel call: the non-empty tensors of one dtype. Inputs and outputs are dense (contiguous)
// and have numels[i] elements; `index[i]` is the tensor's position in the op's lists, which
// selects its row of `coef` and of `result`.
//   kMix:           in {g, l},     out {theta},               coef = lam [T]
//   kMixBackward:   in {G, g, l},  out {grad_g?, grad_l?},    coef = lam [T], result = dlam [T]
//   kStats:         in {g, l?, a?},                           result = stats [T, 4]
//   kStatsBackward: in {g, l?, a?}, out {grad_g?, grad_l?, grad_a?}, coef = H [T, 4]
//   kMixStats:      in {g, l, a?}, out {theta},  coef = lam [T], result = stats [T, 4]
//   kMixStatsBackward: in {g, l, a?, G}, out {grad_g?, grad_l?, grad_a?}, coef = lam [T],
//                   coef2 = H [T, 4], result = dlam [T] (when need[3])
// An input marked absent (no local list, no anchor) and an output not asked for are null.
struct SuperfedPlan {
  SuperfedKind kind;
  at::ScalarType dtype;
  at::Device device = at::kCPU;
  std::vector<int64_t> index;
  std::vector<int64_t> numels;
  std::array<std::vector<const void*>, 4> in;
  std::array<std::vector<void*>, 3> out;
  bool has_local = true;
  bool has_anchor = false;
  std::array<bool, 4> need = {true, true, true, true};
  at::Tensor coef;    // float64, contiguous, on `device`
  at::Tensor coef2;   // float64, contiguous, on `device` (kMixStatsBackward: H)
  at::Tensor result;  // float64, contiguous, zero-filled, on `device`

  int64_t num_tensors() const { return static_cast<int64_t>(numels.size()); }
};

using SuperfedRunner = void (*)(const SuperfedPlan&);

// Checks that `other` matches `ref` tensor by tensor (count, device, shape, dtype).
inline void check_matching_list(
    const char* op, at::TensorList ref, at::TensorList other, const char* ref_name,
    const char* other_name) {
  TORCH_CHECK_VALUE(
      other.size() == ref.size(), "fedkernels.", op, ": ", other_name, " has ", other.size(),
      " tensors, ", ref_name, " has ", ref.size());
  for (const auto t : c10::irange(ref.size())) {
    TORCH_CHECK_VALUE(
        other[t].device() == ref[t].device(), "fedkernels.", op, ": ", other_name, " tensor ", t,
        " is on ", other[t].device(), ", ", ref_name, " tensor ", t, " on ", ref[t].device());
    TORCH_CHECK_VALUE(
        other[t].sizes() == ref[t].sizes(), "fedkernels.", op, ": ", other_name, " tensor ", t,
        " has shape ", other[t].sizes(), ", ", ref_name, " tensor ", t, " has ", ref[t].sizes());
    TORCH_CHECK_TYPE(
        other[t].scalar_type() == ref[t].scalar_type(), "fedkernels.", op, ": ", other_name,
        " tensor ", t, " has dtype ", other[t].scalar_type(), ", ", ref_name, " tensor ", t,
        " has ", ref[t].scalar_type());
  }
}

// The reference list: supported float dtypes, all on one device.
inline void check_global_list(const char* op, at::TensorList g) {
  for (const auto t : c10::irange(g.size())) {
    TORCH_CHECK_TYPE(
        is_supported_float(g[t].scalar_type()), "fedkernels.", op, ": global_params tensor ", t,
        " has dtype ", g[t].scalar_type(), "; supported: float32, float64, float16, bfloat16");
    TORCH_CHECK_VALUE(
        g[t].device() == g[0].device(), "fedkernels.", op, ": global_params tensor ", t,
        " is on ", g[t].device(), ", tensor 0 on ", g[0].device());
  }
}

// lam: one value (MM) or one per tensor (LM), real, finite when on the CPU.
inline void check_lam(const char* op, const at::Tensor& lam, int64_t T, at::Device device) {
  TORCH_CHECK_TYPE(
      at::isFloatingType(lam.scalar_type()), "fedkernels.", op,
      ": lam must be a floating-point tensor, got ", lam.scalar_type());
  TORCH_CHECK_VALUE(
      lam.numel() == 1 || lam.numel() == T, "fedkernels.", op, ": lam has ", lam.numel(),
      " values; expected 1 (model mixing) or one per tensor (", T, ", layer mixing)");
  TORCH_CHECK_VALUE(
      lam.device() == device || lam.device().is_cpu(), "fedkernels.", op, ": lam is on ",
      lam.device(), ", the parameters on ", device);
  if (lam.device().is_cpu()) {
    const auto w = lam.to(at::kDouble).contiguous();
    const double* p = w.const_data_ptr<double>();
    for (const auto i : c10::irange(w.numel())) {
      TORCH_CHECK_VALUE(
          std::isfinite(p[i]), "fedkernels.", op, ": lam of tensor ", i, " is ", p[i]);
    }
  }
}

inline at::Device list_device(at::TensorList g) {
  return g.empty() ? at::Device(at::kCPU) : g[0].device();
}

// Builds one plan per dtype over the non-empty tensors of `g`, with contiguous views of the
// inputs (strided ones copied into `keep_alive`).
class PlanBuilder {
 public:
  PlanBuilder(SuperfedKind kind, at::TensorList g) : kind_(kind), g_(g) {
    keep_alive_.reserve(6 * g.size());
  }

  const void* dense(const at::Tensor& x) {
    if (x.is_contiguous()) return x.const_data_ptr();
    keep_alive_.push_back(x.contiguous());
    return keep_alive_.back().const_data_ptr();
  }

  // ins: up to four lists (an empty list is absent); outs: up to three (empty: not wanted).
  std::map<at::ScalarType, SuperfedPlan> build(
      const std::array<at::TensorList, 4>& ins, const std::array<std::vector<at::Tensor>*, 3>& outs,
      const at::Tensor& coef, const at::Tensor& result) {
    std::map<at::ScalarType, SuperfedPlan> plans;
    for (const auto t : c10::irange(g_.size())) {
      if (g_[t].numel() == 0) continue;
      auto it = plans.find(g_[t].scalar_type());
      if (it == plans.end()) {
        SuperfedPlan p;
        p.kind = kind_;
        p.dtype = g_[t].scalar_type();
        p.device = g_[t].device();
        p.coef = coef;
        p.result = result;
        it = plans.emplace(p.dtype, std::move(p)).first;
      }
      SuperfedPlan& p = it->second;
      p.index.push_back(static_cast<int64_t>(t));
      p.numels.push_back(g_[t].numel());
      for (const auto j : c10::irange(4)) {
        p.in[j].push_back(ins[j].empty() ? nullptr : dense(ins[j][t]));
      }
      for (const auto j : c10::irange(3)) {
        p.out[j].push_back(
            (outs[j] == nullptr || outs[j]->empty()) ? nullptr : (*outs[j])[t].data_ptr());
      }
    }
    return plans;
  }

 private:
  SuperfedKind kind_;
  at::TensorList g_;
  std::vector<at::Tensor> keep_alive_;
};

inline std::vector<at::Tensor> empty_like_list(at::TensorList g) {
  std::vector<at::Tensor> out;
  out.reserve(g.size());
  for (const auto& x : g) out.push_back(at::empty(x.sizes(), x.options()));
  return out;
}

// lam as float64 [T] on `device`, one value per tensor.
inline at::Tensor lam_per_tensor(const at::Tensor& lam, int64_t T, at::Device device) {
  return lam.to(at::TensorOptions().device(device).dtype(at::kDouble))
      .reshape({-1})
      .expand({T})
      .contiguous();
}

inline std::vector<at::Tensor> mix_endpoints_host(
    at::TensorList g, at::TensorList l, const at::Tensor& lam, SuperfedRunner runner) {
  const char* op = "mix_endpoints";
  check_global_list(op, g);
  check_matching_list(op, g, l, "global_params", "local_params");
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g);
  check_lam(op, lam, T, device);
  auto theta = empty_like_list(g);
  if (T == 0) return theta;
  PlanBuilder builder(SuperfedKind::kMix, g);
  auto plans = builder.build(
      {g, l, {}, {}}, {&theta, nullptr, nullptr}, lam_per_tensor(lam, T, device), at::Tensor());
  for (auto& [dtype, p] : plans) runner(p);
  return theta;
}

inline std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
mix_endpoints_backward_host(
    at::TensorList grads, at::TensorList g, at::TensorList l, const at::Tensor& lam,
    std::array<bool, 3> mask, SuperfedRunner runner) {
  const char* op = "mix_endpoints_backward";
  check_global_list(op, g);
  check_matching_list(op, g, l, "global_params", "local_params");
  check_matching_list(op, g, grads, "global_params", "grads");
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g);
  check_lam(op, lam, T, device);
  std::vector<at::Tensor> grad_g = mask[0] ? empty_like_list(g) : std::vector<at::Tensor>{};
  std::vector<at::Tensor> grad_l = mask[1] ? empty_like_list(g) : std::vector<at::Tensor>{};
  const auto dtype = at::TensorOptions().device(device).dtype(at::kDouble);
  at::Tensor dlam = at::zeros({T}, dtype);
  // Empty tensors get no kernel: their gradients are empty anyway.
  if (T > 0 && (mask[0] || mask[1] || mask[2])) {
    PlanBuilder builder(SuperfedKind::kMixBackward, g);
    auto plans = builder.build(
        {grads, g, l, {}}, {&grad_g, &grad_l, nullptr}, lam_per_tensor(lam, T, device), dlam);
    for (auto& [type, p] : plans) {
      p.need = {mask[0], mask[1], mask[2], false};
      runner(p);
    }
  }
  at::Tensor grad_lam;
  if (!mask[2] || T == 0) {
    grad_lam = at::zeros(lam.sizes(), lam.options());
  } else {
    // MM: the one lam feeds every tensor, so its gradient is the sum over tensors (in order).
    at::Tensor g_lam = lam.numel() == 1 ? dlam.sum() : dlam;
    grad_lam = g_lam.reshape(lam.sizes()).to(lam.options());
  }
  return {std::move(grad_g), std::move(grad_l), std::move(grad_lam)};
}

// local_params and anchor may each be empty (not used); otherwise they match global_params.
inline void check_stats_inputs(
    const char* op, at::TensorList g, at::TensorList l, at::TensorList a) {
  check_global_list(op, g);
  if (!l.empty() || g.empty()) check_matching_list(op, g, l, "global_params", "local_params");
  if (!a.empty() || g.empty()) check_matching_list(op, g, a, "global_params", "anchor");
}

inline at::Tensor superfed_stats_host(
    at::TensorList g, at::TensorList l, at::TensorList a, SuperfedRunner runner) {
  check_stats_inputs("superfed_stats", g, l, a);
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g);
  at::Tensor stats = at::zeros({T, 4}, at::TensorOptions().device(device).dtype(at::kDouble));
  if (T == 0) return stats;
  PlanBuilder builder(SuperfedKind::kStats, g);
  auto plans = builder.build({g, l, a, {}}, {nullptr, nullptr, nullptr}, at::Tensor(), stats);
  for (auto& [dtype, p] : plans) {
    p.has_local = !l.empty();
    p.has_anchor = !a.empty();
    runner(p);
  }
  return stats;
}

inline std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
superfed_stats_backward_host(
    const at::Tensor& grad_stats, at::TensorList g, at::TensorList l, at::TensorList a,
    std::array<bool, 3> mask, SuperfedRunner runner) {
  const char* op = "superfed_stats_backward";
  check_stats_inputs(op, g, l, a);
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g);
  TORCH_CHECK_VALUE(
      grad_stats.dim() == 2 && grad_stats.size(0) == T && grad_stats.size(1) == 4, "fedkernels.",
      op, ": grad_stats has shape ", grad_stats.sizes(), ", expected [", T, ", 4]");
  TORCH_CHECK_TYPE(
      at::isFloatingType(grad_stats.scalar_type()), "fedkernels.", op,
      ": grad_stats must be floating point, got ", grad_stats.scalar_type());
  TORCH_CHECK_VALUE(
      grad_stats.device() == device || grad_stats.device().is_cpu(), "fedkernels.", op,
      ": grad_stats is on ", grad_stats.device(), ", the parameters on ", device);
  const bool has_l = !l.empty(), has_a = !a.empty();
  mask[1] = mask[1] && has_l;
  mask[2] = mask[2] && has_a;
  std::vector<at::Tensor> grad_g = mask[0] ? empty_like_list(g) : std::vector<at::Tensor>{};
  std::vector<at::Tensor> grad_l = mask[1] ? empty_like_list(g) : std::vector<at::Tensor>{};
  std::vector<at::Tensor> grad_a = mask[2] ? empty_like_list(g) : std::vector<at::Tensor>{};
  if (T > 0 && (mask[0] || mask[1] || mask[2])) {
    const at::Tensor h =
        grad_stats.to(at::TensorOptions().device(device).dtype(at::kDouble)).contiguous();
    PlanBuilder builder(SuperfedKind::kStatsBackward, g);
    auto plans = builder.build({g, l, a, {}}, {&grad_g, &grad_l, &grad_a}, h, at::Tensor());
    for (auto& [dtype, p] : plans) {
      p.has_local = has_l;
      p.has_anchor = has_a;
      p.need = {mask[0], mask[1], mask[2], false};
      runner(p);
    }
  }
  return {std::move(grad_g), std::move(grad_l), std::move(grad_a)};
}

// mix_endpoints and superfed_stats in one pass (forward) and one pass (backward).
inline std::tuple<std::vector<at::Tensor>, at::Tensor> mix_endpoints_with_stats_host(
    at::TensorList g, at::TensorList l, const at::Tensor& lam, at::TensorList a,
    SuperfedRunner runner) {
  const char* op = "mix_endpoints_with_stats";
  check_global_list(op, g);
  check_matching_list(op, g, l, "global_params", "local_params");
  check_stats_inputs(op, g, l, a);
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g);
  check_lam(op, lam, T, device);
  auto theta = empty_like_list(g);
  at::Tensor stats = at::zeros({T, 4}, at::TensorOptions().device(device).dtype(at::kDouble));
  if (T == 0) return {std::move(theta), stats};
  PlanBuilder builder(SuperfedKind::kMixStats, g);
  auto plans = builder.build(
      {g, l, a, {}}, {&theta, nullptr, nullptr}, lam_per_tensor(lam, T, device), stats);
  for (auto& [dtype, p] : plans) {
    p.has_anchor = !a.empty();
    runner(p);
  }
  return {std::move(theta), stats};
}

inline std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor,
                  std::vector<at::Tensor>>
mix_endpoints_with_stats_backward_host(
    at::TensorList grads, const at::Tensor& grad_stats, at::TensorList g, at::TensorList l,
    const at::Tensor& lam, at::TensorList a, std::array<bool, 4> mask, SuperfedRunner runner) {
  const char* op = "mix_endpoints_with_stats_backward";
  check_global_list(op, g);
  check_matching_list(op, g, l, "global_params", "local_params");
  check_matching_list(op, g, grads, "global_params", "grads");
  check_stats_inputs(op, g, l, a);
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g);
  check_lam(op, lam, T, device);
  TORCH_CHECK_VALUE(
      grad_stats.dim() == 2 && grad_stats.size(0) == T && grad_stats.size(1) == 4, "fedkernels.",
      op, ": grad_stats has shape ", grad_stats.sizes(), ", expected [", T, ", 4]");
  TORCH_CHECK_VALUE(
      grad_stats.device() == device || grad_stats.device().is_cpu(), "fedkernels.", op,
      ": grad_stats is on ", grad_stats.device(), ", the parameters on ", device);
  const bool has_a = !a.empty();
  mask[3] = mask[3] && has_a;
  std::vector<at::Tensor> grad_g = mask[0] ? empty_like_list(g) : std::vector<at::Tensor>{};
  std::vector<at::Tensor> grad_l = mask[1] ? empty_like_list(g) : std::vector<at::Tensor>{};
  std::vector<at::Tensor> grad_a = mask[3] ? empty_like_list(g) : std::vector<at::Tensor>{};
  const auto dtype = at::TensorOptions().device(device).dtype(at::kDouble);
  at::Tensor dlam = at::zeros({T}, dtype);
  if (T > 0 && (mask[0] || mask[1] || mask[2] || mask[3])) {
    PlanBuilder builder(SuperfedKind::kMixStatsBackward, g);
    auto plans = builder.build(
        {g, l, a, grads}, {&grad_g, &grad_l, &grad_a}, lam_per_tensor(lam, T, device), dlam);
    const at::Tensor h = grad_stats.to(dtype).contiguous();
    for (auto& [type, p] : plans) {
      p.coef2 = h;
      p.has_anchor = has_a;
      // need: grad_g, grad_l, grad_a, dlam
      p.need = {mask[0], mask[1], mask[3], mask[2]};
      runner(p);
    }
  }
  at::Tensor grad_lam;
  if (!mask[2] || T == 0) {
    grad_lam = at::zeros(lam.sizes(), lam.options());
  } else {
    at::Tensor g_lam = lam.numel() == 1 ? dlam.sum() : dlam;
    grad_lam = g_lam.reshape(lam.sizes()).to(lam.options());
  }
  return {std::move(grad_g), std::move(grad_l), std::move(grad_lam), std::move(grad_a)};
}

}  // namespace fedkernels
