// Host-side part of the SGLD / FedEvg ops (schemas and formulas: csrc/ops.cpp; per-element math:
// SgldMath and PhiloxNormal in csrc/elementwise.h), shared by the CPU and CUDA backends:
// validation (nothing is allocated or written before it passes), conversion of the small
// per-client inputs to the accumulate type, output allocation, one plan per call that the
// backend's kernel template runs, and the registration of a backend's kernels. The backend draws
// the noise seed from the generator (CPUGeneratorImpl / CUDA Philox state).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "elementwise.h"

namespace fedkernels {

// ---------------------------------------------------------------- energy_from_logits

struct EnergyPlan {
  at::ScalarType dtype;
  int64_t N = 0, C = 0;
  const void* logits = nullptr;   // [N, C] contiguous
  const int64_t* labels = nullptr;  // [N] contiguous, or null (marginal energy)
  void* out = nullptr;            // [N], dtype
  at::Device device = at::kCPU;
};

using EnergyRunner = void (*)(const EnergyPlan&);

inline at::Tensor energy_from_logits_host(
    const at::Tensor& logits, const std::optional<at::Tensor>& labels, EnergyRunner runner) {
  constexpr const char* op = "fedkernels.energy_from_logits: ";
  TORCH_CHECK_VALUE(logits.dim() == 2, op, "logits must be [N, C], got ", logits.dim(), "-D");
  check_supported_float("energy_from_logits", logits.scalar_type(), "logits");
  const int64_t N = logits.size(0), C = logits.size(1);
  TORCH_CHECK_VALUE(N == 0 || C >= 1, op, "need at least one class (logits.shape[1] is 0)");
  const bool has_labels = labels.has_value() && labels->defined();
  at::Tensor y;
  if (has_labels) {
    TORCH_CHECK_VALUE(
        labels->dim() == 1 && labels->size(0) == N, op, "labels must be [N] = [", N, "], got ",
        labels->sizes());
    TORCH_CHECK_TYPE(
        labels->scalar_type() == at::kLong, op, "labels have dtype ", labels->scalar_type(),
        "; expected int64");
    check_device("energy_from_logits", *labels, logits.device(), /*allow_cpu=*/false, "labels");
    y = contiguous_aligned(*labels);
    if (y.device().is_cpu()) {
      const int64_t* py = y.const_data_ptr<int64_t>();
      for (const auto i : c10::irange(N)) {
        TORCH_CHECK_VALUE(
            py[i] >= 0 && py[i] < C, op, "label ", py[i], " of sample ", i,
            " is out of range for ", C, " classes");
      }
    }
  }
  at::Tensor out = at::empty({N}, logits.options());
  if (N == 0) return out;
  const at::Tensor l = contiguous_aligned(logits);
  EnergyPlan p;
  p.dtype = logits.scalar_type();
  p.N = N;
  p.C = C;
  p.logits = l.const_data_ptr();
  p.labels = has_labels ? y.const_data_ptr<int64_t>() : nullptr;
  p.out = out.mutable_data_ptr();
  p.device = logits.device();
  runner(p);
  return out;
}

// ---------------------------------------------------------------- sgld_step / compose

// One elementwise SGLD update of n = M * D values. K = 0: plain step (grads = grad [M, D]);
// K >= 1: composition over K clients with weights pi [K, M] computed by the runner first.
struct SgldPlan {
  at::ScalarType dtype;            // of x, grads, noise, out
  int64_t K = 0, M = 0, D = 0;     // n = M * D
  const void* x = nullptr;         // [M, D] contiguous
  const void* grads = nullptr;     // [K, M, D] (or [M, D] when K = 0) contiguous
  const void* energies = nullptr;  // [K, M], accumulate dtype
  const void* log_weights = nullptr;  // [K], accumulate dtype
  void* pi = nullptr;              // [K, M] output, accumulate dtype
  const void* noise = nullptr;     // [M, D] contiguous, or null
  void* out = nullptr;             // [M, D] contiguous (may equal x)
  bool signed_mode = true;
  double step = 0, noise_std = 0;
  double tau = std::numeric_limits<double>::infinity();
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool draw_noise = false;  // no noise tensor and noise_std != 0: draw from the generator
  std::optional<at::Generator> generator;
  at::Device device = at::kCPU;
};

using SgldRunner = void (*)(const SgldPlan&);

inline void check_step_args(
    const char* name, double step_size, double noise_std, const std::optional<double>& grad_clip,
    const std::optional<double>& clamp_min, const std::optional<double>& clamp_max,
    SgldPlan& p) {
  const std::string prefix = std::string("fedkernels.") + name + ": ";
  const char* op = prefix.c_str();
  TORCH_CHECK_VALUE(std::isfinite(step_size), op, "step_size must be finite, got ", step_size);
  check_finite_nonnegative(name, "noise_std", noise_std);
  if (grad_clip.has_value()) {
    TORCH_CHECK_VALUE(*grad_clip > 0, op, "grad_clip must be > 0, got ", *grad_clip);
    p.tau = *grad_clip;
  }
  if (clamp_min.has_value()) {
    TORCH_CHECK_VALUE(!std::isnan(*clamp_min), op, "clamp_min is NaN");
    p.lo = *clamp_min;
  }
  if (clamp_max.has_value()) {
    TORCH_CHECK_VALUE(!std::isnan(*clamp_max), op, "clamp_max is NaN");
    p.hi = *clamp_max;
  }
  TORCH_CHECK_VALUE(
      p.lo <= p.hi, op, "clamp_min (", p.lo, ") must not exceed clamp_max (", p.hi, ")");
  p.step = step_size;
  p.noise_std = noise_std;
}

inline void check_noise(
    const char* name, const at::Tensor& x, const std::optional<at::Tensor>& noise,
    const std::optional<at::Generator>& generator, SgldPlan& p, at::Tensor& noise_c) {
  const std::string prefix = std::string("fedkernels.") + name + ": ";
  const char* op = prefix.c_str();
  const bool has_noise = noise.has_value() && noise->defined();
  if (has_noise) {
    TORCH_CHECK_VALUE(
        !(generator.has_value() && generator->defined()), op,
        "pass either noise or generator, not both");
    TORCH_CHECK_VALUE(
        noise->sizes() == x.sizes(), op, "noise has shape ", noise->sizes(), ", x ", x.sizes());
    TORCH_CHECK_TYPE(
        noise->scalar_type() == x.scalar_type(), op, "noise has dtype ", noise->scalar_type(),
        ", x ", x.scalar_type());
    check_device(name, *noise, x.device(), /*allow_cpu=*/false, "noise");
    noise_c = contiguous_aligned(*noise);
  }
  p.draw_noise = !has_noise && p.noise_std != 0;
  if (generator.has_value() && generator->defined()) {
    TORCH_CHECK_VALUE(
        generator->device().type() == x.device().type(), op, "generator is a ",
        generator->device(), " generator, x is on ", x.device());
    p.generator = generator;
  }
}

// An in-place x must hold one element of memory each (not an expanded view): checked before
// any noise is drawn, so a refused call leaves the generator as it was.
inline void check_writable_x(const char* op, const at::Tensor& x, bool inplace) {
  TORCH_CHECK_VALUE(
      !inplace || !may_overlap_itself(x), op,
      "x has elements that share memory (an expanded or overlapping view), and the op writes it "
      "in place; pass a tensor with one element of memory each (x.clone())");
}

// Writes into x in place when inplace (through a contiguous temporary when x is not
// contiguous, or misaligned), else into a new tensor; returns the tensor holding x'. `read`
// names the tensors the kernel reads: writing x directly, none may share only part of x's
// memory (the kernel would read values it has already overwritten); the same memory, element
// for element, is fine.
inline at::Tensor finish_into(
    const char* op, const at::Tensor& x, bool inplace,
    std::initializer_list<std::pair<const char*, const at::Tensor*>> read, SgldPlan& p,
    SgldRunner runner) {
  const bool direct = inplace && is_contiguous_aligned(x);
  if (direct) {
    std::vector<const at::Tensor*> tensors{&x};  // written, then read
    std::vector<const char*> names{"x"};
    for (const auto& [name, t] : read) {
      tensors.push_back(t);
      names.push_back(name);
    }
    if (const auto shared = find_shared_memory(tensors, 1, /*same_elements_ok=*/true)) {
      const char* name = names[shared->second];
      TORCH_CHECK_VALUE(
          false, op, name, " shares part of x's memory, which the op writes in place; pass a "
          "copy (", name, ".clone())");
    }
  }
  at::Tensor out = direct ? x : at::empty_like(x, at::MemoryFormat::Contiguous);
  p.out = out.mutable_data_ptr();
  if (p.M * p.D > 0 || p.K > 0) runner(p);
  if (inplace && !direct) {
    const_cast<at::Tensor&>(x).copy_(out);
    return x;
  }
  return out;
}

inline at::Tensor sgld_step_host(
    const at::Tensor& x, const at::Tensor& grad, double step_size, double noise_std,
    const std::optional<double>& grad_clip, const std::optional<double>& clamp_min,
    const std::optional<double>& clamp_max, const std::optional<at::Tensor>& noise,
    const std::optional<at::Generator>& generator, bool inplace, SgldRunner runner) {
  const char* name = inplace ? "sgld_step_" : "sgld_step";
  const char* op = inplace ? "fedkernels.sgld_step_: " : "fedkernels.sgld_step: ";
  check_supported_float(name, x.scalar_type(), "x");
  TORCH_CHECK_VALUE(
      grad.sizes() == x.sizes(), op, "grad has shape ", grad.sizes(), ", x ", x.sizes());
  TORCH_CHECK_TYPE(
      grad.scalar_type() == x.scalar_type(), op, "grad has dtype ", grad.scalar_type(), ", x ",
      x.scalar_type());
  check_device(name, grad, x.device(), /*allow_cpu=*/false, "grad");
  SgldPlan p;
  check_step_args(name, step_size, noise_std, grad_clip, clamp_min, clamp_max, p);
  check_writable_x(op, x, inplace);
  at::Tensor noise_c;
  check_noise(name, x, noise, generator, p, noise_c);
  const at::Tensor xc = contiguous_aligned(x);
  const at::Tensor gc = contiguous_aligned(grad);
  p.dtype = x.scalar_type();
  p.K = 0;
  p.M = 1;
  p.D = x.numel();
  p.x = xc.const_data_ptr();
  p.grads = gc.const_data_ptr();
  p.noise = noise_c.defined() ? noise_c.const_data_ptr() : nullptr;
  p.device = x.device();
  if (x.numel() == 0) return inplace ? x : at::empty_like(x, at::MemoryFormat::Contiguous);
  return finish_into(op, x, inplace, {{"grad", &gc}, {"noise", &noise_c}}, p, runner);
}

inline std::tuple<at::Tensor, at::Tensor> sgld_compose_step_host(
    const at::Tensor& x, const at::Tensor& grads, const at::Tensor& energies,
    const at::Tensor& log_weights, const std::string& mode, double step_size, double noise_std,
    const std::optional<double>& grad_clip, const std::optional<double>& clamp_min,
    const std::optional<double>& clamp_max, const std::optional<at::Tensor>& noise,
    const std::optional<at::Generator>& generator, bool inplace, SgldRunner runner) {
  const char* name = inplace ? "sgld_compose_step_" : "sgld_compose_step";
  const char* op = inplace ? "fedkernels.sgld_compose_step_: " : "fedkernels.sgld_compose_step: ";
  TORCH_CHECK_VALUE(
      mode == "exact" || mode == "signed", op, "unknown mode '", mode,
      "'; expected exact or signed");
  check_supported_float(name, x.scalar_type(), "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, op, "x must be [M, ...] (samples first), got a 0-d tensor");
  TORCH_CHECK_VALUE(
      grads.dim() == x.dim() + 1, op, "grads must be [K, M, ...] = [K, ", x.sizes(),
      "], got ", grads.sizes());
  TORCH_CHECK_VALUE(
      grads.sizes().slice(1) == x.sizes(), op, "grads must be [K, M, ...] with [M, ...] = ",
      x.sizes(), ", got ", grads.sizes());
  TORCH_CHECK_TYPE(
      grads.scalar_type() == x.scalar_type(), op, "grads have dtype ", grads.scalar_type(),
      ", x ", x.scalar_type());
  check_device(name, grads, x.device(), /*allow_cpu=*/false, "grads");
  const int64_t K = grads.size(0), M = x.size(0);
  TORCH_CHECK_VALUE(K >= 1, op, "need at least one client (grads.shape[0] is 0)");
  TORCH_CHECK_VALUE(
      energies.dim() == 2 && energies.size(0) == K && energies.size(1) == M, op,
      "energies must be [K, M] = [", K, ", ", M, "], got ", energies.sizes());
  check_supported_float(name, energies.scalar_type(), "energies");
  check_device(name, energies, x.device(), /*allow_cpu=*/false, "energies");
  TORCH_CHECK_VALUE(
      log_weights.dim() == 1 && log_weights.size(0) == K, op, "log_weights must be [K] = [", K,
      "], got ", log_weights.sizes());
  check_supported_float(name, log_weights.scalar_type(), "log_weights");
  check_device(name, log_weights, x.device(), /*allow_cpu=*/true, "log_weights");
  if (log_weights.device().is_cpu()) {
    const auto lw = contiguous_aligned(log_weights.to(at::kDouble));
    const double* pw = lw.const_data_ptr<double>();
    for (const auto k : c10::irange(K)) {
      TORCH_CHECK_VALUE(
          !std::isnan(pw[k]) && pw[k] != std::numeric_limits<double>::infinity(), op,
          "log weight of client ", k, " is ", pw[k], " (weights must be >= 0 and finite)");
    }
  }
  SgldPlan p;
  check_step_args(name, step_size, noise_std, grad_clip, clamp_min, clamp_max, p);
  check_writable_x(op, x, inplace);
  at::Tensor noise_c;
  check_noise(name, x, noise, generator, p, noise_c);
  const at::ScalarType acc = accumulate_dtype(x.scalar_type());
  const auto acc_opts = x.options().dtype(acc);
  const at::Tensor e = contiguous_aligned(energies.to(acc_opts));
  const at::Tensor lw = contiguous_aligned(log_weights.to(acc_opts));
  at::Tensor pi = at::empty({K, M}, acc_opts);
  const at::Tensor xc = contiguous_aligned(x);
  const at::Tensor gc = contiguous_aligned(grads);
  p.dtype = x.scalar_type();
  p.K = K;
  p.M = M;
  p.D = M == 0 ? 0 : x.numel() / M;
  p.x = xc.const_data_ptr();
  p.grads = gc.const_data_ptr();
  p.energies = e.const_data_ptr();
  p.log_weights = lw.const_data_ptr();
  p.pi = pi.mutable_data_ptr();
  p.noise = noise_c.defined() ? noise_c.const_data_ptr() : nullptr;
  p.signed_mode = mode == "signed";
  p.device = x.device();
  if (M == 0) return {inplace ? x : at::empty_like(x, at::MemoryFormat::Contiguous), pi};
  at::Tensor out = finish_into(
      op, x, inplace, {{"grads", &gc}, {"energies", &e}, {"log_weights", &lw}, {"noise", &noise_c}},
      p, runner);
  return {out, pi};
}

// Runs a plan with the backend's kernel templates Kernels::energy<T>(plan) and
// Kernels::sgld<T>(plan), T the dtype of logits / x.
template <typename Kernels>
void run_energy_plan(const EnergyPlan& p) {
  dispatch_float(p.dtype, "energy_from_logits", [&](auto dtype) {
    Kernels::template energy<typename decltype(dtype)::type>(p);
  });
}

template <typename Kernels>
void run_sgld_plan(const SgldPlan& p) {
  dispatch_float(p.dtype, "sgld_step", [&](auto dtype) {
    Kernels::template sgld<typename decltype(dtype)::type>(p);
  });
}

// The kernels of sgld_step (returns x') and sgld_step_ (in place, returns nothing).
template <typename Kernels, bool kInplace>
auto sgld_step_kernel(
    const at::Tensor& x, const at::Tensor& grad, double step_size, double noise_std,
    std::optional<double> grad_clip, std::optional<double> clamp_min,
    std::optional<double> clamp_max, const std::optional<at::Tensor>& noise,
    std::optional<at::Generator> generator) {
  at::Tensor out = sgld_step_host(
      x, grad, step_size, noise_std, grad_clip, clamp_min, clamp_max, noise, generator, kInplace,
      &run_sgld_plan<Kernels>);
  if constexpr (kInplace) {
    return;
  } else {
    return out;
  }
}

// The kernels of sgld_compose_step (returns (x', pi)) and sgld_compose_step_ (in place, returns
// pi).
template <typename Kernels, bool kInplace>
auto sgld_compose_step_kernel(
    const at::Tensor& x, const at::Tensor& grads, const at::Tensor& energies,
    const at::Tensor& log_weights, c10::string_view mode, double step_size, double noise_std,
    std::optional<double> grad_clip, std::optional<double> clamp_min,
    std::optional<double> clamp_max, const std::optional<at::Tensor>& noise,
    std::optional<at::Generator> generator) {
  auto result = sgld_compose_step_host(
      x, grads, energies, log_weights, std::string(mode), step_size, noise_std, grad_clip,
      clamp_min, clamp_max, noise, generator, kInplace, &run_sgld_plan<Kernels>);
  if constexpr (kInplace) {
    return std::get<1>(result);
  } else {
    return result;
  }
}

// Registers the FedEvg ops of one backend (CPU, CUDA), whose kernels are the templates
// Kernels::energy<T>(const EnergyPlan&) and Kernels::sgld<T>(const SgldPlan&).
template <typename Kernels>
void register_sgld(torch::Library& m) {
  m.impl(
      "energy_from_logits",
      [](const at::Tensor& logits, const std::optional<at::Tensor>& labels) {
        return energy_from_logits_host(logits, labels, &run_energy_plan<Kernels>);
      });
  m.impl("sgld_step", &sgld_step_kernel<Kernels, false>);
  m.impl("sgld_step_", &sgld_step_kernel<Kernels, true>);
  m.impl("sgld_compose_step", &sgld_compose_step_kernel<Kernels, false>);
  m.impl("sgld_compose_step_", &sgld_compose_step_kernel<Kernels, true>);
}

}  // namespace fedkernels
