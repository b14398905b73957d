// Host-side part of the SuPerFed ops (mix_endpoints, superfed_stats, mix_endpoints_with_stats and
// their backwards; schemas and formulas in csrc/ops.cpp, per-element math in csrc/elementwise.h)
// shared by the CPU and CUDA backends: input validation (nothing is allocated or written before
// it passes), output allocation, the split of the tensor lists into groups of one dtype, each run
// by one kernel call of the backend, and the registration of a backend's kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "elementwise.h"  // SuperfedKind

namespace fedkernels {

// One kernel call: the non-empty tensors of one dtype. Inputs and outputs are dense (contiguous)
// and have numels[i] elements; `index[i]` is the tensor's position in the op's lists, which
// selects its row of `lam`, `h` and `result`. Input slots {g, l, a, G} and output slots
// {theta or grad_g, grad_l, grad_a} as in SuperfedOp (csrc/elementwise.h); a slot the call does
// not read or write is an empty vector.
//   kMix:              in g, l;          out theta;                          lam
//   kMixBackward:      in G (g, l for the lam gradient); out grad_g?, grad_l?; lam; result dlam [T]
//   kStats:            in g, l?, a?;                                         result stats [T, 4]
//   kStatsBackward:    in g, l?, a?;     out grad_g?, grad_l?, grad_a?;      h
//   kMixStats:         in g, l, a?;      out theta;                          lam; result stats [T, 4]
//   kMixStatsBackward: in g, l, a?, G;   out grad_g?, grad_l?, grad_a?;      lam, h; result dlam [T]
//   kMixStatsStep:     in g, l, a?, G, buffers?; out g, l, buffers? (in place); lam, h, sgd
struct SuperfedPlan {
  SuperfedKind kind;
  at::ScalarType dtype;
  at::Device device = at::kCPU;
  std::vector<int64_t> index;
  std::vector<int64_t> numels;
  std::array<std::vector<const void*>, kSuperfedInputs> in;
  std::array<std::vector<void*>, kSuperfedOutputs> out;
  bool reduce = false;  // the kind's per-tensor sums are wanted (into result)
  at::Tensor lam;       // float64 [T], contiguous, on `device`; undefined when unused
  at::Tensor h;         // float64 [T, 4], contiguous, on `device`; undefined when unused
  at::Tensor result;    // float64, contiguous, zero-filled, on `device`, when reduce
  SgdSettings sgd;      // kMixStatsStep only

  int64_t num_tensors() const { return static_cast<int64_t>(numels.size()); }
  bool has_input(int slot) const { return !in[slot].empty(); }
  bool has_output(int slot) const { return !out[slot].empty(); }
};

using SuperfedRunner = void (*)(const SuperfedPlan&);

// Calls f(std::integral_constant<SuperfedKind, kind>{}).
template <typename F>
void dispatch_superfed_kind(SuperfedKind kind, F&& f) {
  using K = SuperfedKind;
  switch (kind) {
    case K::kMix: return f(std::integral_constant<K, K::kMix>{});
    case K::kMixBackward: return f(std::integral_constant<K, K::kMixBackward>{});
    case K::kStats: return f(std::integral_constant<K, K::kStats>{});
    case K::kStatsBackward: return f(std::integral_constant<K, K::kStatsBackward>{});
    case K::kMixStats: return f(std::integral_constant<K, K::kMixStats>{});
    case K::kMixStatsBackward: return f(std::integral_constant<K, K::kMixStatsBackward>{});
    case K::kMixStatsStep: return f(std::integral_constant<K, K::kMixStatsStep>{});
  }
}

// Runs a plan with the backend's kernel template Kernels::run<T, kind>(plan).
template <typename Kernels>
void run_superfed_plan(const SuperfedPlan& p) {
  dispatch_float(p.dtype, "superfed", [&](auto dtype) {
    dispatch_superfed_kind(p.kind, [&](auto kind) {
      Kernels::template run<typename decltype(dtype)::type, decltype(kind)::value>(p);
    });
  });
}

// Checks that `other` matches `ref` tensor by tensor (count, device, shape, dtype).
inline void check_matching_list(
    const char* op, at::TensorList ref, at::TensorList other, const char* ref_name,
    const char* other_name) {
  TORCH_CHECK_VALUE(
      other.size() == ref.size(), "fedkernels.", op, ": ", other_name, " has ", other.size(),
      " tensors, ", ref_name, " has ", ref.size());
  for (const auto t : c10::irange(ref.size())) {
    check_device(op, other[t], ref[t].device(), /*allow_cpu=*/false, other_name, " tensor ", t);
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
    check_supported_float(op, g[t].scalar_type(), "global_params tensor ", t);
  }
  if (!g.empty()) check_list_device(op, g, g[0].device(), "global_params");
}

// lam: one value (MM) or one per tensor (LM), real, finite when on the CPU.
inline void check_lam(const char* op, const at::Tensor& lam, int64_t T, at::Device device) {
  TORCH_CHECK_TYPE(
      at::isFloatingType(lam.scalar_type()), "fedkernels.", op,
      ": lam must be a floating-point tensor, got ", lam.scalar_type());
  TORCH_CHECK_VALUE(
      lam.numel() == 1 || lam.numel() == T, "fedkernels.", op, ": lam has ", lam.numel(),
      " values; expected 1 (model mixing) or one per tensor (", T, ", layer mixing)");
  check_device(op, lam, device, /*allow_cpu=*/true, "lam");
  if (lam.device().is_cpu()) {
    const auto w = contiguous_aligned(lam.to(at::kDouble));
    const double* p = w.const_data_ptr<double>();
    for (const auto i : c10::irange(w.numel())) {
      TORCH_CHECK_VALUE(
          std::isfinite(p[i]), "fedkernels.", op, ": lam of tensor ", i, " is ", p[i]);
    }
  }
}

// The device of the parameters: global_params' own, or for an empty model the device of the
// call's one other tensor (lam, grad_stats), else the CPU.
inline at::Device list_device(at::TensorList g, const at::Tensor& other = at::Tensor()) {
  if (!g.empty()) return g[0].device();
  return other.defined() ? other.device() : at::Device(at::kCPU);
}

// H = d loss / d stats: [T, 4], floating point, on the parameters' device or the CPU.
inline void check_grad_stats(const char* op, const at::Tensor& grad_stats, int64_t T, at::Device device) {
  TORCH_CHECK_VALUE(
      grad_stats.dim() == 2 && grad_stats.size(0) == T && grad_stats.size(1) == 4, "fedkernels.",
      op, ": grad_stats has shape ", grad_stats.sizes(), ", expected [", T, ", 4]");
  TORCH_CHECK_TYPE(
      at::isFloatingType(grad_stats.scalar_type()), "fedkernels.", op,
      ": grad_stats must be floating point, got ", grad_stats.scalar_type());
  check_device(op, grad_stats, device, /*allow_cpu=*/true, "grad_stats");
}

// One kernel pass of a SuPerFed op over the non-empty tensors of g (inputs and outputs by slot,
// as in SuperfedPlan; an empty input list or a null/empty output list is not in the pass).
struct SuperfedPass {
  SuperfedKind kind;
  std::array<at::TensorList, kSuperfedInputs> in;
  std::array<std::vector<at::Tensor>*, kSuperfedOutputs> out = {};
  at::Tensor lam;
  at::Tensor h;
  at::Tensor result;
  bool reduce = false;
  SgdSettings sgd;
};

// Splits the pass into one plan per dtype, over contiguous inputs (strided ones are copied),
// and runs each with the backend's runner.
inline void run_superfed(at::TensorList g, const SuperfedPass& pass, SuperfedRunner runner) {
  DenseBuffers dense;  // only inputs: the outputs are this call's own dense tensors
  std::map<at::ScalarType, SuperfedPlan> plans;
  for (const auto t : c10::irange(g.size())) {
    if (g[t].numel() == 0) continue;  // nothing to compute; its outputs are empty too
    auto it = plans.find(g[t].scalar_type());
    if (it == plans.end()) {
      SuperfedPlan p;
      p.kind = pass.kind;
      p.dtype = g[t].scalar_type();
      p.device = g[t].device();
      p.lam = pass.lam;
      p.h = pass.h;
      p.result = pass.result;
      p.reduce = pass.reduce;
      p.sgd = pass.sgd;
      it = plans.emplace(p.dtype, std::move(p)).first;
    }
    SuperfedPlan& p = it->second;
    p.index.push_back(static_cast<int64_t>(t));
    p.numels.push_back(g[t].numel());
    for (const auto j : c10::irange(kSuperfedInputs)) {
      if (!pass.in[j].empty()) p.in[j].push_back(dense.in(pass.in[j][t]));
    }
    for (const auto j : c10::irange(kSuperfedOutputs)) {
      if (pass.out[j] != nullptr && !pass.out[j]->empty()) {
        p.out[j].push_back((*pass.out[j])[t].data_ptr());
      }
    }
  }
  for (auto& [dtype, p] : plans) runner(p);
}

inline std::vector<at::Tensor> empty_like_list(at::TensorList g) {
  std::vector<at::Tensor> out;
  out.reserve(g.size());
  for (const auto& x : g) out.push_back(at::empty(x.sizes(), x.options()));
  return out;
}

inline std::vector<at::Tensor> empty_like_list_if(bool wanted, at::TensorList g) {
  return wanted ? empty_like_list(g) : std::vector<at::Tensor>{};
}

// lam as float64 [T] on `device`, one value per tensor.
inline at::Tensor lam_per_tensor(const at::Tensor& lam, int64_t T, at::Device device) {
  return contiguous_aligned(
      lam.to(at::TensorOptions().device(device).dtype(at::kDouble)).reshape({-1}).expand({T}));
}

inline at::Tensor zeros_f64(std::initializer_list<int64_t> sizes, at::Device device) {
  return at::zeros(sizes, at::TensorOptions().device(device).dtype(at::kDouble));
}

// The lam gradient from the per-tensor sums dlam [T]: MM's one lam feeds every tensor, so its
// gradient is the sum over tensors (in order); zero when not wanted.
inline at::Tensor lam_gradient(const at::Tensor& lam, const at::Tensor& dlam, bool wanted) {
  if (!wanted || dlam.numel() == 0) return at::zeros(lam.sizes(), lam.options());
  const at::Tensor g_lam = lam.numel() == 1 ? dlam.sum() : dlam;
  return g_lam.reshape(lam.sizes()).to(lam.options());
}

inline std::vector<at::Tensor> mix_endpoints_host(
    at::TensorList g, at::TensorList l, const at::Tensor& lam, SuperfedRunner runner) {
  const char* op = "mix_endpoints";
  check_global_list(op, g);
  check_matching_list(op, g, l, "global_params", "local_params");
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g, lam);
  check_lam(op, lam, T, device);
  auto theta = empty_like_list(g);
  if (T == 0) return theta;
  SuperfedPass pass{SuperfedKind::kMix, {g, l, {}, {}}, {&theta, nullptr, nullptr}};
  pass.lam = lam_per_tensor(lam, T, device);
  run_superfed(g, pass, runner);
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
  const at::Device device = list_device(g, lam);
  check_lam(op, lam, T, device);
  auto grad_g = empty_like_list_if(mask[0], g);
  auto grad_l = empty_like_list_if(mask[1], g);
  at::Tensor dlam = zeros_f64({T}, device);
  // Empty tensors get no kernel: their gradients are empty anyway. g and l are read only for
  // the lam gradient.
  if (T > 0 && (mask[0] || mask[1] || mask[2])) {
    const at::TensorList none;
    SuperfedPass pass{
        SuperfedKind::kMixBackward, {mask[2] ? g : none, mask[2] ? l : none, {}, grads},
        {&grad_g, &grad_l, nullptr}};
    pass.lam = lam_per_tensor(lam, T, device);
    pass.result = dlam;
    pass.reduce = mask[2];
    run_superfed(g, pass, runner);
  }
  return {std::move(grad_g), std::move(grad_l), lam_gradient(lam, dlam, mask[2])};
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
  at::Tensor stats = zeros_f64({T, 4}, list_device(g));
  if (T == 0) return stats;
  SuperfedPass pass{SuperfedKind::kStats, {g, l, a, {}}};
  pass.result = stats;
  pass.reduce = true;
  run_superfed(g, pass, runner);
  return stats;
}

inline std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
superfed_stats_backward_host(
    const at::Tensor& grad_stats, at::TensorList g, at::TensorList l, at::TensorList a,
    std::array<bool, 3> mask, SuperfedRunner runner) {
  const char* op = "superfed_stats_backward";
  check_stats_inputs(op, g, l, a);
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g, grad_stats);
  check_grad_stats(op, grad_stats, T, device);
  mask[1] = mask[1] && !l.empty();
  mask[2] = mask[2] && !a.empty();
  auto grad_g = empty_like_list_if(mask[0], g);
  auto grad_l = empty_like_list_if(mask[1], g);
  auto grad_a = empty_like_list_if(mask[2], g);
  if (T > 0 && (mask[0] || mask[1] || mask[2])) {
    SuperfedPass pass{SuperfedKind::kStatsBackward, {g, l, a, {}}, {&grad_g, &grad_l, &grad_a}};
    pass.h = contiguous_aligned(
        grad_stats.to(at::TensorOptions().device(device).dtype(at::kDouble)));
    run_superfed(g, pass, runner);
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
  const at::Device device = list_device(g, lam);
  check_lam(op, lam, T, device);
  auto theta = empty_like_list(g);
  at::Tensor stats = zeros_f64({T, 4}, device);
  if (T == 0) return {std::move(theta), stats};
  SuperfedPass pass{SuperfedKind::kMixStats, {g, l, a, {}}, {&theta, nullptr, nullptr}};
  pass.lam = lam_per_tensor(lam, T, device);
  pass.result = stats;
  pass.reduce = true;
  run_superfed(g, pass, runner);
  return {std::move(theta), stats};
}

// The inputs of a backward of mix_endpoints_with_stats (the backward op, or the fused SGD
// step): G and H for theta and the stats rows of (g, l, lam, anchor). Returns the device.
inline at::Device check_mix_stats_backward_inputs(
    const char* op, at::TensorList grads, const at::Tensor& grad_stats, at::TensorList g,
    at::TensorList l, const at::Tensor& lam, at::TensorList a) {
  check_global_list(op, g);
  check_matching_list(op, g, l, "global_params", "local_params");
  check_matching_list(op, g, grads, "global_params", "grads");
  check_stats_inputs(op, g, l, a);
  const int64_t T = static_cast<int64_t>(g.size());
  const at::Device device = list_device(g, lam);
  check_lam(op, lam, T, device);
  check_grad_stats(op, grad_stats, T, device);
  return device;
}

inline std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor,
                  std::vector<at::Tensor>>
mix_endpoints_with_stats_backward_host(
    at::TensorList grads, const at::Tensor& grad_stats, at::TensorList g, at::TensorList l,
    const at::Tensor& lam, at::TensorList a, std::array<bool, 4> mask, SuperfedRunner runner) {
  const char* op = "mix_endpoints_with_stats_backward";
  const at::Device device = check_mix_stats_backward_inputs(op, grads, grad_stats, g, l, lam, a);
  const int64_t T = static_cast<int64_t>(g.size());
  // mask: grad_g, grad_l, grad_lam, grad_a
  mask[3] = mask[3] && !a.empty();
  auto grad_g = empty_like_list_if(mask[0], g);
  auto grad_l = empty_like_list_if(mask[1], g);
  auto grad_a = empty_like_list_if(mask[3], g);
  at::Tensor dlam = zeros_f64({T}, device);
  if (T > 0 && (mask[0] || mask[1] || mask[2] || mask[3])) {
    SuperfedPass pass{
        SuperfedKind::kMixStatsBackward, {g, l, a, grads}, {&grad_g, &grad_l, &grad_a}};
    pass.lam = lam_per_tensor(lam, T, device);
    pass.h = contiguous_aligned(
        grad_stats.to(at::TensorOptions().device(device).dtype(at::kDouble)));
    pass.result = dlam;
    pass.reduce = mask[2];
    run_superfed(g, pass, runner);
  }
  return {std::move(grad_g), std::move(grad_l), lam_gradient(lam, dlam, mask[2]),
          std::move(grad_a)};
}

// A dense tensor to compute an in-place result in: the tensor itself when it is dense, else a
// dense copy that `finish` writes back.
struct InPlaceDense {
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (dense copy, the tensor)

  std::vector<at::Tensor> list(at::TensorList xs) {
    std::vector<at::Tensor> out;
    out.reserve(xs.size());
    for (const auto& x : xs) {
      if (is_contiguous_aligned(x) || x.numel() == 0) {
        out.push_back(x);
      } else {
        out.push_back(x.clone(at::MemoryFormat::Contiguous));
        write_back.emplace_back(out.back(), x);
      }
    }
    return out;
  }
  void finish() {
    for (auto& [dense, x] : write_back) x.copy_(dense);
  }
};

// The lists a call updates in place (`written`, in order) hold one element of memory each and
// overlap neither each other nor the lists it only reads; errors name "<list> tensor <t>".
inline void check_updated_lists_apart(
    const char* op, std::initializer_list<std::pair<at::TensorList, const char*>> written,
    std::initializer_list<std::pair<at::TensorList, const char*>> read) {
  std::vector<std::pair<at::TensorList, const char*>> lists(written);
  lists.insert(lists.end(), read.begin(), read.end());
  int64_t num_written = 0;
  for (const auto& w : written) num_written += static_cast<int64_t>(w.first.size());
  std::vector<const at::Tensor*> tensors;
  for (const auto& [list, name] : lists) {
    for (const auto& x : list) tensors.push_back(&x);
  }
  auto name_of = [&](int64_t i) {  // tensor i of the lists laid end to end
    size_t j = 0;
    for (; i >= static_cast<int64_t>(lists[j].first.size()); ++j) i -= lists[j].first.size();
    return std::string(lists[j].second) + " tensor " + std::to_string(i);
  };
  check_written_apart(
      op, tensors, num_written, name_of, "; it is updated in place",
      " in memory; it is updated in place");
}

inline void check_sgd_settings(const char* op, const SgdSettings& s) {
  const std::pair<const char*, double> values[] = {
      {"lr", s.lr}, {"momentum", s.momentum}, {"dampening", s.dampening},
      {"weight_decay", s.weight_decay}};
  for (const auto& [name, v] : values) check_finite_nonnegative(op, name, v);
  TORCH_CHECK_VALUE(
      !s.nesterov || (s.momentum > 0 && s.dampening == 0), "fedkernels.", op,
      ": nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)");
}

// One SGD step of both endpoints from the mixed model's gradient G and H = d loss / d stats:
// mix_endpoints_with_stats_backward's grad_g and grad_l, given to torch.optim.SGD's update,
// without writing the gradients anywhere. Updates g, l and (momentum > 0) their buffers in place.
inline void superfed_sgd_step_host(
    at::TensorList g, at::TensorList l, at::TensorList buffer_g, at::TensorList buffer_l,
    at::TensorList grads, const at::Tensor& grad_stats, const at::Tensor& lam, at::TensorList a,
    const SgdSettings& sgd, SuperfedRunner runner) {
  const char* op = "superfed_sgd_step_";
  const at::Device device = check_mix_stats_backward_inputs(op, grads, grad_stats, g, l, lam, a);
  const int64_t T = static_cast<int64_t>(g.size());
  check_sgd_settings(op, sgd);
  const bool momentum_on = sgd.momentum != 0;
  if (momentum_on || !buffer_g.empty() || !buffer_l.empty()) {
    TORCH_CHECK_VALUE(
        momentum_on, "fedkernels.", op, ": momentum buffers given with momentum 0");
    check_matching_list(op, g, buffer_g, "global_params", "global_momentum");
    check_matching_list(op, g, buffer_l, "global_params", "local_momentum");
  }
  check_updated_lists_apart(
      op,
      {{g, "global_params"}, {l, "local_params"}, {buffer_g, "global_momentum"},
       {buffer_l, "local_momentum"}},
      {{grads, "grads"}, {a, "anchor"}});
  if (T == 0) return;
  InPlaceDense dense;
  auto gd = dense.list(g);
  auto ld = dense.list(l);
  auto bg = dense.list(buffer_g);
  auto bl = dense.list(buffer_l);
  const at::TensorList none;
  // A first step only writes the buffers.
  const bool read_g = momentum_on && !sgd.first_step_global;
  const bool read_l = momentum_on && !sgd.first_step_local;
  SuperfedPass pass{
      SuperfedKind::kMixStatsStep,
      {gd, ld, a, grads, read_g ? at::TensorList(bg) : none, read_l ? at::TensorList(bl) : none},
      {&gd, &ld, momentum_on ? &bg : nullptr, momentum_on ? &bl : nullptr}};
  pass.lam = lam_per_tensor(lam, T, device);
  pass.h = contiguous_aligned(
      grad_stats.to(at::TensorOptions().device(device).dtype(at::kDouble)));
  pass.sgd = sgd;
  run_superfed(g, pass, runner);
  dense.finish();
}

// Registers the SuPerFed ops of one backend (CPU, CUDA), whose kernels are the templates
// Kernels::run<T, kind>(const SuperfedPlan&).
template <typename Kernels>
void register_superfed(torch::Library& m) {
  m.impl("mix_endpoints", [](at::TensorList g, at::TensorList l, const at::Tensor& lam) {
    return mix_endpoints_host(g, l, lam, &run_superfed_plan<Kernels>);
  });
  m.impl(
      "mix_endpoints_backward",
      [](at::TensorList grads, at::TensorList g, at::TensorList l, const at::Tensor& lam,
         std::array<bool, 3> mask) {
        return mix_endpoints_backward_host(grads, g, l, lam, mask, &run_superfed_plan<Kernels>);
      });
  m.impl("superfed_stats", [](at::TensorList g, at::TensorList l, at::TensorList a) {
    return superfed_stats_host(g, l, a, &run_superfed_plan<Kernels>);
  });
  m.impl(
      "superfed_stats_backward",
      [](const at::Tensor& grad_stats, at::TensorList g, at::TensorList l, at::TensorList a,
         std::array<bool, 3> mask) {
        return superfed_stats_backward_host(grad_stats, g, l, a, mask, &run_superfed_plan<Kernels>);
      });
  m.impl(
      "mix_endpoints_with_stats",
      [](at::TensorList g, at::TensorList l, const at::Tensor& lam, at::TensorList a) {
        return mix_endpoints_with_stats_host(g, l, lam, a, &run_superfed_plan<Kernels>);
      });
  m.impl(
      "mix_endpoints_with_stats_backward",
      [](at::TensorList grads, const at::Tensor& grad_stats, at::TensorList g, at::TensorList l,
         const at::Tensor& lam, at::TensorList a, std::array<bool, 4> mask) {
        return mix_endpoints_with_stats_backward_host(
            grads, grad_stats, g, l, lam, a, mask, &run_superfed_plan<Kernels>);
      });
  m.impl(
      "superfed_sgd_step_",
      [](at::TensorList g, at::TensorList l, at::TensorList buffer_g, at::TensorList buffer_l,
         at::TensorList grads, const at::Tensor& grad_stats, const at::Tensor& lam,
         at::TensorList a, double lr, double momentum, double dampening, double weight_decay,
         bool nesterov, std::array<bool, 2> first_step) {
        const SgdSettings sgd{
            lr, momentum, dampening, weight_decay, nesterov, first_step[0], first_step[1]};
        superfed_sgd_step_host(
            g, l, buffer_g, buffer_l, grads, grad_stats, lam, a, sgd, &run_superfed_plan<Kernels>);
      });
}

}  // namespace fedkernels
