// Host-side part of the SGLD / FedEvg ops (schemas: csrc/ops.cpp; math: specs/fedevg.md §1.2,
// §1.4-1.5, §3 K1-K3), shared by the CPU and CUDA backends: validation (nothing is allocated
// or written before it passes), conversion of the small per-client inputs to the accumulate
// type, output allocation, and one plan per call that the backend's runner executes. The
// runner draws the noise seed from the generator (CPUGeneratorImpl / CUDA Philox state).
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

#include "elementwise.h"

namespace fedkernels {

inline bool sgld_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline at::ScalarType sgld_acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

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
  TORCH_CHECK_TYPE(
      sgld_float(logits.scalar_type()), op, "logits have dtype ", logits.scalar_type(),
      "; supported: float32, float64, float16, bfloat16");
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
    TORCH_CHECK_VALUE(
        labels->device() == logits.device(), op, "labels are on ", labels->device(),
        ", logits on ", logits.device());
    y = labels->contiguous();
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
  const at::Tensor l = logits.contiguous();
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

using SgldRunner = void (*)(SgldPlan&);

inline void check_step_args(
    const char* op, double step_size, double noise_std, const std::optional<double>& grad_clip,
    const std::optional<double>& clamp_min, const std::optional<double>& clamp_max,
    SgldPlan& p) {
  TORCH_CHECK_VALUE(std::isfinite(step_size), op, "step_size must be finite, got ", step_size);
  TORCH_CHECK_VALUE(
      std::isfinite(noise_std) && noise_std >= 0, op, "noise_std must be finite and >= 0, got ",
      noise_std);
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
    const char* op, const at::Tensor& x, const std::optional<at::Tensor>& noise,
    const std::optional<at::Generator>& generator, SgldPlan& p, at::Tensor& noise_c) {
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
    TORCH_CHECK_VALUE(
        noise->device() == x.device(), op, "noise is on ", noise->device(), ", x on ",
        x.device());
    noise_c = noise->contiguous();
  }
  p.draw_noise = !has_noise && p.noise_std != 0;
  if (generator.has_value() && generator->defined()) p.generator = generator;
}

// Writes into x in place when inplace (through a contiguous temporary when x is not
// contiguous), else into a new tensor; returns the tensor holding x'.
inline at::Tensor finish_into(
    const at::Tensor& x, bool inplace, SgldPlan& p, SgldRunner runner) {
  at::Tensor out;
  const bool direct = inplace && x.is_contiguous();
  out = direct ? x : at::empty_like(x, at::MemoryFormat::Contiguous);
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
  const char* op = inplace ? "fedkernels.sgld_step_: " : "fedkernels.sgld_step: ";
  TORCH_CHECK_TYPE(
      sgld_float(x.scalar_type()), op, "x has dtype ", x.scalar_type(),
      "; supported: float32, float64, float16, bfloat16");
  TORCH_CHECK_VALUE(
      grad.sizes() == x.sizes(), op, "grad has shape ", grad.sizes(), ", x ", x.sizes());
  TORCH_CHECK_TYPE(
      grad.scalar_type() == x.scalar_type(), op, "grad has dtype ", grad.scalar_type(), ", x ",
      x.scalar_type());
  TORCH_CHECK_VALUE(
      grad.device() == x.device(), op, "grad is on ", grad.device(), ", x on ", x.device());
  SgldPlan p;
  check_step_args(op, step_size, noise_std, grad_clip, clamp_min, clamp_max, p);
  at::Tensor noise_c;
  check_noise(op, x, noise, generator, p, noise_c);
  const at::Tensor xc = x.contiguous();
  const at::Tensor gc = grad.contiguous();
  p.dtype = x.scalar_type();
  p.K = 0;
  p.M = 1;
  p.D = x.numel();
  p.x = xc.const_data_ptr();
  p.grads = gc.const_data_ptr();
  p.noise = noise_c.defined() ? noise_c.const_data_ptr() : nullptr;
  p.device = x.device();
  if (x.numel() == 0) return inplace ? x : at::empty_like(x);
  return finish_into(x, inplace, p, runner);
}

inline std::tuple<at::Tensor, at::Tensor> sgld_compose_step_host(
    const at::Tensor& x, const at::Tensor& grads, const at::Tensor& energies,
    const at::Tensor& log_weights, const std::string& mode, double step_size, double noise_std,
    const std::optional<double>& grad_clip, const std::optional<double>& clamp_min,
    const std::optional<double>& clamp_max, const std::optional<at::Tensor>& noise,
    const std::optional<at::Generator>& generator, bool inplace, SgldRunner runner) {
  const char* op = inplace ? "fedkernels.sgld_compose_step_: " : "fedkernels.sgld_compose_step: ";
  TORCH_CHECK_VALUE(
      mode == "exact" || mode == "signed", op, "unknown mode '", mode,
      "'; expected exact or signed");
  TORCH_CHECK_TYPE(
      sgld_float(x.scalar_type()), op, "x has dtype ", x.scalar_type(),
      "; supported: float32, float64, float16, bfloat16");
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
  TORCH_CHECK_VALUE(
      grads.device() == x.device(), op, "grads are on ", grads.device(), ", x on ", x.device());
  const int64_t K = grads.size(0), M = x.size(0);
  TORCH_CHECK_VALUE(K >= 1, op, "need at least one client (grads.shape[0] is 0)");
  TORCH_CHECK_VALUE(
      energies.dim() == 2 && energies.size(0) == K && energies.size(1) == M, op,
      "energies must be [K, M] = [", K, ", ", M, "], got ", energies.sizes());
  TORCH_CHECK_TYPE(
      sgld_float(energies.scalar_type()), op, "energies have dtype ", energies.scalar_type(),
      "; expected a floating dtype");
  TORCH_CHECK_VALUE(
      energies.device() == x.device(), op, "energies are on ", energies.device(), ", x on ",
      x.device());
  TORCH_CHECK_VALUE(
      log_weights.dim() == 1 && log_weights.size(0) == K, op, "log_weights must be [K] = [", K,
      "], got ", log_weights.sizes());
  TORCH_CHECK_TYPE(
      sgld_float(log_weights.scalar_type()), op, "log_weights have dtype ",
      log_weights.scalar_type(), "; expected a floating dtype");
  TORCH_CHECK_VALUE(
      log_weights.device() == x.device() || log_weights.device().is_cpu(), op,
      "log_weights are on ", log_weights.device(), ", x on ", x.device());
  if (log_weights.device().is_cpu()) {
    const auto lw = log_weights.to(at::kDouble).contiguous();
    const double* pw = lw.const_data_ptr<double>();
    for (const auto k : c10::irange(K)) {
      TORCH_CHECK_VALUE(
          !std::isnan(pw[k]) && pw[k] != std::numeric_limits<double>::infinity(), op,
          "log weight of client ", k, " is ", pw[k], " (weights must be >= 0 and finite)");
    }
  }
  SgldPlan p;
  check_step_args(op, step_size, noise_std, grad_clip, clamp_min, clamp_max, p);
  at::Tensor noise_c;
  check_noise(op, x, noise, generator, p, noise_c);
  const at::ScalarType acc = sgld_acc_dtype(x.scalar_type());
  const auto acc_opts = x.options().dtype(acc);
  const at::Tensor e = energies.to(acc_opts).contiguous();
  const at::Tensor lw = log_weights.to(acc_opts).contiguous();
  at::Tensor pi = at::empty({K, M}, acc_opts);
  const at::Tensor xc = x.contiguous();
  const at::Tensor gc = grads.contiguous();
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
  if (M == 0) return {inplace ? x : at::empty_like(x), pi};
  at::Tensor out = finish_into(x, inplace, p, runner);
  return {out, pi};
}

// Registers the FedEvg ops of one backend (CPU, CUDA), run by `energy` and `sgld`.
template <EnergyRunner energy, SgldRunner sgld>
void register_sgld(torch::Library& m) {
  m.impl(
      "energy_from_logits",
      [](const at::Tensor& logits, const std::optional<at::Tensor>& labels) {
        return energy_from_logits_host(logits, labels, energy);
      });
  m.impl(
      "sgld_step",
      [](const at::Tensor& x, const at::Tensor& grad, double step_size, double noise_std,
         std::optional<double> grad_clip, std::optional<double> clamp_min,
         std::optional<double> clamp_max, const std::optional<at::Tensor>& noise,
         std::optional<at::Generator> generator) {
        return sgld_step_host(
            x, grad, step_size, noise_std, grad_clip, clamp_min, clamp_max, noise, generator,
            false, sgld);
      });
  m.impl(
      "sgld_step_",
      [](const at::Tensor& x, const at::Tensor& grad, double step_size, double noise_std,
         std::optional<double> grad_clip, std::optional<double> clamp_min,
         std::optional<double> clamp_max, const std::optional<at::Tensor>& noise,
         std::optional<at::Generator> generator) {
        sgld_step_host(
            x, grad, step_size, noise_std, grad_clip, clamp_min, clamp_max, noise, generator,
            true, sgld);
      });
  m.impl(
      "sgld_compose_step",
      [](const at::Tensor& x, const at::Tensor& grads, const at::Tensor& energies,
         const at::Tensor& log_weights, c10::string_view mode, double step_size, double noise_std,
         std::optional<double> grad_clip, std::optional<double> clamp_min,
         std::optional<double> clamp_max, const std::optional<at::Tensor>& noise,
         std::optional<at::Generator> generator) {
        return sgld_compose_step_host(
            x, grads, energies, log_weights, std::string(mode), step_size, noise_std, grad_clip,
            clamp_min, clamp_max, noise, generator, false, sgld);
      });
  m.impl(
      "sgld_compose_step_",
      [](const at::Tensor& x, const at::Tensor& grads, const at::Tensor& energies,
         const at::Tensor& log_weights, c10::string_view mode, double step_size, double noise_std,
         std::optional<double> grad_clip, std::optional<double> clamp_min,
         std::optional<double> clamp_max, const std::optional<at::Tensor>& noise,
         std::optional<at::Generator> generator) {
        return std::get<1>(sgld_compose_step_host(
            x, grads, energies, log_weights, std::string(mode), step_size, noise_std, grad_clip,
            clamp_min, clamp_max, noise, generator, true, sgld));
      });
}

}  // namespace fedkernels
