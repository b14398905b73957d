// Host-side part of the ensemble-distillation ops (schemas and formulas: csrc/ops.cpp; per-row
// math: DistillMath in csrc/elementwise.h), shared by the CPU and CUDA backends: validation
// (nothing is allocated or written before it passes), the conversion of the small per-client
// inputs (scores, log_prior) to the accumulate type, output allocation, one plan per call that
// the backend's kernel template runs, and the registration of a backend's kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>

#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "common.h"
#include "elementwise.h"

namespace fedkernels {

// ---------------------------------------------------------------- ensemble_pseudo_labels

struct PseudoLabelPlan {
  at::ScalarType dtype;  // of logits and of both outputs
  int64_t K = 0, N = 0, C = 0;
  const void* logits = nullptr;     // [K, N, C] contiguous, dtype
  const void* scores = nullptr;     // [K, N] contiguous, accumulate dtype; null when unused
  const void* log_prior = nullptr;  // [K] contiguous, accumulate dtype; null = all zeros
  void* out_labels = nullptr;       // [N, C]
  void* out_weights = nullptr;      // [K, N]
  Weighting weighting = Weighting::kUniform;
  bool probs = false;  // combine = "probs"
  double temperature = 1.0;
  double tau = 1.0;
  bool double_sigmoid = true;
  at::Device device = at::kCPU;
};


inline Weighting parse_weighting(const std::string& name) {
  if (name == "uniform") return Weighting::kUniform;
  if (name == "entropy") return Weighting::kEntropy;
  if (name == "fedgo") return Weighting::kFedgo;
  if (name == "variance") return Weighting::kVariance;
  if (name == "domain") return Weighting::kDomain;
  TORCH_CHECK_VALUE(
      false, "fedkernels.ensemble_pseudo_labels: unknown weighting '", name,
      "'; expected uniform, fedgo, entropy, variance or domain");
}

inline bool needs_scores(Weighting w) {
  return w == Weighting::kFedgo || w == Weighting::kDomain;
}

inline std::tuple<at::Tensor, at::Tensor> ensemble_pseudo_labels_host(
    const at::Tensor& logits, const std::optional<at::Tensor>& scores,
    const std::optional<at::Tensor>& log_prior, const std::string& weighting_name,
    const std::string& combine, double temperature, double tau, bool double_sigmoid,
    void (*runner)(const PseudoLabelPlan&)) {
  constexpr const char* op = "fedkernels.ensemble_pseudo_labels: ";
  const Weighting weighting = parse_weighting(weighting_name);
  TORCH_CHECK_VALUE(
      combine == "logits" || combine == "probs", op, "unknown combine '", combine,
      "'; expected logits or probs");
  TORCH_CHECK_VALUE(
      logits.dim() == 3, op, "logits must be [K, N, C] (clients, samples, classes), got ",
      logits.dim(), "-D");
  check_supported_float("ensemble_pseudo_labels", logits.scalar_type(), "logits");
  const int64_t K = logits.size(0), N = logits.size(1), C = logits.size(2);
  TORCH_CHECK_VALUE(K >= 1, op, "need at least one client (logits.shape[0] is 0)");
  TORCH_CHECK_VALUE(C >= 1, op, "need at least one class (logits.shape[2] is 0)");
  check_finite_positive("ensemble_pseudo_labels", "temperature", temperature);
  check_finite_positive("ensemble_pseudo_labels", "tau", tau);
  const at::Device device = logits.device();
  const at::ScalarType acc = accumulate_dtype(logits.scalar_type());

  const bool has_scores = scores.has_value() && scores->defined();
  if (needs_scores(weighting)) {
    TORCH_CHECK_VALUE(
        has_scores, op, "weighting='", weighting_name,
        "' needs scores (the discriminators' logits, [K, N])");
  } else {
    TORCH_CHECK_VALUE(
        !has_scores, op, "weighting='", weighting_name,
        "' does not use scores; pass scores=None (scores are for fedgo and domain)");
  }
  at::Tensor s;
  if (has_scores) {
    TORCH_CHECK_VALUE(
        scores->dim() == 2 && scores->size(0) == K && scores->size(1) == N, op,
        "scores must be [K, N] = [", K, ", ", N, "], got ", scores->sizes());
    check_supported_float("ensemble_pseudo_labels", scores->scalar_type(), "scores");
    check_device("ensemble_pseudo_labels", *scores, device, /*allow_cpu=*/false, "scores");
    s = contiguous_aligned(scores->to(acc));
  }
  at::Tensor prior;
  if (log_prior.has_value() && log_prior->defined()) {
    TORCH_CHECK_VALUE(
        log_prior->dim() == 1 && log_prior->size(0) == K, op, "log_prior must be [K] = [", K,
        "], got ", log_prior->sizes());
    check_supported_float("ensemble_pseudo_labels", log_prior->scalar_type(), "log_prior");
    check_device("ensemble_pseudo_labels", *log_prior, device, /*allow_cpu=*/true, "log_prior");
    if (log_prior->device().is_cpu()) {
      const auto p = contiguous_aligned(log_prior->to(at::kDouble));
      const double* pp = p.const_data_ptr<double>();
      for (const auto k : c10::irange(K)) {
        TORCH_CHECK_VALUE(
            std::isfinite(pp[k]), op, "log_prior of client ", k, " is ", pp[k],
            " (sample sizes must be positive and finite)");
      }
    }
    prior = contiguous_aligned(log_prior->to(at::TensorOptions().device(device).dtype(acc)));
  }

  at::Tensor labels = at::empty({N, C}, logits.options());
  at::Tensor weights = at::empty({K, N}, logits.options());
  if (N == 0) return {labels, weights};
  const at::Tensor l = contiguous_aligned(logits);

  PseudoLabelPlan p;
  p.dtype = logits.scalar_type();
  p.K = K;
  p.N = N;
  p.C = C;
  p.logits = l.const_data_ptr();
  p.scores = s.defined() ? s.const_data_ptr() : nullptr;
  p.log_prior = prior.defined() ? prior.const_data_ptr() : nullptr;
  p.out_labels = labels.mutable_data_ptr();
  p.out_weights = weights.mutable_data_ptr();
  p.weighting = weighting;
  p.probs = combine == "probs";
  p.temperature = temperature;
  p.tau = tau;
  p.double_sigmoid = double_sigmoid;
  p.device = device;
  runner(p);
  return {labels, weights};
}

// ---------------------------------------------------------------- distill_kl

struct DistillKLPlan {
  at::ScalarType dtype;  // of student, target and grad
  int64_t N = 0, C = 0;
  const void* student = nullptr;  // [N, C] contiguous
  const void* target = nullptr;   // [N, C] contiguous
  void* grad = nullptr;           // [N, C], or null (no gradient wanted)
  void* loss = nullptr;           // 0-d, accumulate dtype
  double temperature = 1.0;
  double scale = 1.0;
  at::Device device = at::kCPU;
};


inline std::tuple<at::Tensor, at::Tensor> distill_kl_host(
    const at::Tensor& student, const at::Tensor& target, double temperature, double scale,
    bool with_grad, void (*runner)(const DistillKLPlan&)) {
  constexpr const char* op = "fedkernels.distill_kl: ";
  TORCH_CHECK_VALUE(
      student.dim() == 2, op, "student_logits must be [N, C], got ", student.dim(), "-D");
  TORCH_CHECK_VALUE(
      target.sizes() == student.sizes(), op, "pseudo_labels have shape ", target.sizes(),
      ", student_logits ", student.sizes());
  check_supported_float("distill_kl", student.scalar_type(), "student_logits");
  TORCH_CHECK_TYPE(
      target.scalar_type() == student.scalar_type(), op, "pseudo_labels have dtype ",
      target.scalar_type(), ", student_logits ", student.scalar_type());
  check_device("distill_kl", target, student.device(), /*allow_cpu=*/false, "pseudo_labels");
  check_finite_positive("distill_kl", "temperature", temperature);
  TORCH_CHECK_VALUE(std::isfinite(scale), op, "scale must be finite, got ", scale);
  const int64_t N = student.size(0), C = student.size(1);
  TORCH_CHECK_VALUE(N == 0 || C >= 1, op, "need at least one class (C is 0)");
  const at::ScalarType acc = accumulate_dtype(student.scalar_type());
  at::Tensor loss = at::zeros({}, student.options().dtype(acc));
  at::Tensor grad = with_grad ? at::empty({N, C}, student.options()) : at::empty({0}, student.options());
  if (N == 0) {
    if (with_grad) grad = at::zeros({N, C}, student.options());
    return {loss, grad};
  }
  const at::Tensor s = contiguous_aligned(student);
  const at::Tensor t = contiguous_aligned(target);
  DistillKLPlan p;
  p.dtype = student.scalar_type();
  p.N = N;
  p.C = C;
  p.student = s.const_data_ptr();
  p.target = t.const_data_ptr();
  p.grad = with_grad ? grad.mutable_data_ptr() : nullptr;
  p.loss = loss.mutable_data_ptr();
  p.temperature = temperature;
  p.scale = scale;
  p.device = student.device();
  runner(p);
  return {loss, grad};
}

// Registers the distillation ops of one backend (CPU, CUDA), whose kernels are the templates
// Kernels::pseudo_labels<T>(const PseudoLabelPlan&) and Kernels::distill_kl<T>(const
// DistillKLPlan&), T the logits' dtype.
template <typename Kernels>
void register_distill(torch::Library& m) {
  m.impl(
      "ensemble_pseudo_labels",
      [](const at::Tensor& logits, const std::optional<at::Tensor>& scores,
         const std::optional<at::Tensor>& log_prior, c10::string_view weighting,
         c10::string_view combine, double temperature, double tau, bool double_sigmoid) {
        return ensemble_pseudo_labels_host(
            logits, scores, log_prior, std::string(weighting), std::string(combine), temperature,
            tau, double_sigmoid, [](const PseudoLabelPlan& p) {
              dispatch_float(p.dtype, "ensemble_pseudo_labels", [&](auto dtype) {
                Kernels::template pseudo_labels<typename decltype(dtype)::type>(p);
              });
            });
      });
  m.impl(
      "distill_kl",
      [](const at::Tensor& student, const at::Tensor& target, double temperature, double scale,
         bool with_grad) {
        return distill_kl_host(
            student, target, temperature, scale, with_grad, [](const DistillKLPlan& p) {
              dispatch_float(p.dtype, "distill_kl", [&](auto dtype) {
                Kernels::template distill_kl<typename decltype(dtype)::type>(p);
              });
            });
      });
}

}  // namespace fedkernels
