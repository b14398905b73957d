// Host-side part of fedkernels::weighted_sum shared by the CPU and CUDA backends: input
// validation (nothing is written before it passes), output allocation, and the split of the
// tensor list into groups of one (input dtype, output dtype) pair, each run by one kernel call.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "client_lists.h"
#include "common.h"

namespace fedkernels {

// One kernel call: n tensors that share the input and output dtypes.
struct WeightedSumPlan {
  at::ScalarType in_dtype;
  at::ScalarType out_dtype;
  int64_t num_clients = 0;
  std::vector<const void*> inputs;  // [K][n], client-major
  std::vector<const void*> bases;   // [n], empty when there is no base
  std::vector<void*> outs;          // [n]; may equal bases (in place)
  std::vector<int64_t> numels;      // [n]
  at::Tensor weights;               // [K] float64, contiguous, on the CPU or on `device`
  double scale = 1.0;
  bool delta = false;
  at::Device device = at::kCPU;

  int64_t num_tensors() const { return static_cast<int64_t>(numels.size()); }
};

using WeightedSumRunner = void (*)(const WeightedSumPlan&);

// The dtype the result is stored in when base is given: base's own, which must be the update
// dtype or float32 for half-precision updates (fp32 accumulators of a streaming sum).
inline bool base_dtype_ok(at::ScalarType update, at::ScalarType base) {
  return base == update ||
      (base == at::kFloat && (update == at::kHalf || update == at::kBFloat16));
}

struct WeightedSumShape {
  int64_t num_clients;
  int64_t num_tensors;
  bool narrow;  // some tensor accumulates in float32 (it is not float64)
};

// scale is cast to the accumulate dtype like the weights.
inline void check_scale(double scale, const WeightedSumShape& shape) {
  TORCH_CHECK_VALUE(std::isfinite(scale), "fedkernels.weighted_sum: scale is ", scale);
  TORCH_CHECK_VALUE(
      !shape.narrow || std::abs(scale) <= std::numeric_limits<float>::max(),
      "fedkernels.weighted_sum: scale is ", scale,
      ", beyond the float32 range in which tensors that are not float64 accumulate");
}

// Checks everything about the inputs that does not depend on the output.
inline WeightedSumShape check_inputs(
    at::TensorList updates, const at::Tensor& weights,
    at::TensorList base) {
  const char* op = "weighted_sum";
  TORCH_CHECK_VALUE(
      weights.dim() == 1, "fedkernels.weighted_sum: weights must be 1-D, got ", weights.dim(),
      "-D");
  const int64_t K = weights.numel();
  TORCH_CHECK_VALUE(K > 0, "fedkernels.weighted_sum: need at least one client (weights is empty)");
  TORCH_CHECK_TYPE(
      at::isFloatingType(weights.scalar_type()) || at::isIntegralType(weights.scalar_type(), false),
      "fedkernels.weighted_sum: weights must be real numbers, got ", weights.scalar_type());
  const int64_t n = static_cast<int64_t>(updates.size());
  TORCH_CHECK_VALUE(
      n % K == 0, "fedkernels.weighted_sum: got ", n, " update tensors for ", K,
      " weights; expected K * T tensors, client-major");
  const int64_t T = n / K;
  TORCH_CHECK_VALUE(
      base.empty() || static_cast<int64_t>(base.size()) == T, "fedkernels.weighted_sum: base has ",
      base.size(), " tensors, clients have ", T);
  const at::Device device = T > 0 ? updates[0].device() : weights.device();
  check_device(op, weights, device, /*allow_cpu=*/true, "weights");
  // Weights are cast to the accumulate dtype: one finite in float64 but beyond float32's range
  // would become inf for any tensor that is not float64.
  bool narrow = false;
  for (const auto t : c10::irange(T)) narrow = narrow || updates[t].scalar_type() != at::kDouble;
  if (weights.device().is_cpu()) {
    const auto w = contiguous_aligned(weights.to(at::kDouble));
    const double* wp = w.const_data_ptr<double>();
    for (const auto k : c10::irange(K)) {
      TORCH_CHECK_VALUE(
          std::isfinite(wp[k]), "fedkernels.weighted_sum: weight of client ", k, " is ", wp[k]);
      TORCH_CHECK_VALUE(
          !narrow || std::abs(wp[k]) <= std::numeric_limits<float>::max(),
          "fedkernels.weighted_sum: weight of client ", k, " is ", wp[k],
          ", beyond the float32 range in which tensors that are not float64 accumulate");
    }
  }
  check_client_tensors(op, updates, K, T, device);
  for (const auto t : c10::irange(base.size())) {
    const at::Tensor& b = base[t];
    const at::Tensor& ref = updates[t];
    check_device(op, b, device, /*allow_cpu=*/false, "base tensor ", t);
    TORCH_CHECK_VALUE(
        b.sizes() == ref.sizes(), "fedkernels.weighted_sum: base tensor ", t, " has shape ",
        b.sizes(), ", clients have ", ref.sizes());
    TORCH_CHECK_TYPE(
        base_dtype_ok(ref.scalar_type(), b.scalar_type()), "fedkernels.weighted_sum: base tensor ",
        t, " has dtype ", b.scalar_type(), " for ", ref.scalar_type(),
        " updates; expected the same dtype (or float32 for half-precision updates)");
  }
  return {K, T, narrow};
}

inline at::ScalarType result_dtype(
    at::TensorList updates, at::TensorList base, int64_t t) {
  return base.empty() ? updates[t].scalar_type() : base[t].scalar_type();
}

inline void check_outputs(
    at::TensorList updates, at::TensorList base,
    at::TensorList out, const WeightedSumShape& shape, bool out_is_base) {
  const int64_t K = shape.num_clients, T = shape.num_tensors;
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(out.size()) == T, "fedkernels.weighted_sum: out has ", out.size(),
      " tensors, clients have ", T);
  for (const auto t : c10::irange(T)) {
    const at::Tensor& o = out[t];
    const at::Tensor& ref = updates[t];
    check_device("weighted_sum", o, ref.device(), /*allow_cpu=*/false, "out tensor ", t);
    TORCH_CHECK_VALUE(
        o.sizes() == ref.sizes(), "fedkernels.weighted_sum: out tensor ", t, " has shape ",
        o.sizes(), ", clients have ", ref.sizes());
    TORCH_CHECK_TYPE(
        o.scalar_type() == result_dtype(updates, base, t), "fedkernels.weighted_sum: out tensor ",
        t, " has dtype ", o.scalar_type(), ", expected ", result_dtype(updates, base, t));
  }
  // In place, base is the output itself.
  check_outputs_apart(
      "weighted_sum", out, updates, K, out_is_base ? at::TensorList() : base,
      "; the output must not alias a client update (or base, except in place)");
}

// Runs the kernel into `out` (already validated). Non-contiguous (or misaligned) tensors are
// handled with contiguous copies, so kernels only ever see dense, aligned memory.
inline void run_weighted_sum(
    at::TensorList updates, const at::Tensor& weights,
    at::TensorList base, double scale, bool delta,
    at::TensorList out, const WeightedSumShape& shape, WeightedSumRunner runner) {
  const int64_t K = shape.num_clients, T = shape.num_tensors;
  if (T == 0) return;
  const at::Device device = updates[0].device();
  const at::Tensor w = contiguous_aligned(weights.to(at::kDouble));

  DenseBuffers dense;

  std::map<std::pair<at::ScalarType, at::ScalarType>, WeightedSumPlan> plans;
  for (const auto t : c10::irange(T)) {
    const int64_t numel = updates[t].numel();
    if (numel == 0) continue;
    const auto key = std::make_pair(updates[t].scalar_type(), out[t].scalar_type());
    auto it = plans.find(key);
    if (it == plans.end()) {
      WeightedSumPlan p;
      p.in_dtype = key.first;
      p.out_dtype = key.second;
      p.num_clients = K;
      p.weights = w;
      p.scale = scale;
      p.delta = delta && !base.empty();  // delta needs a base; without one it is plain
      p.device = device;
      it = plans.emplace(key, std::move(p)).first;
    }
    WeightedSumPlan& p = it->second;
    p.numels.push_back(numel);
    if (!base.empty()) p.bases.push_back(dense.in(base[t]));
    p.outs.push_back(dense.out(out[t]));
  }
  for (auto& [key, p] : plans) {
    const int64_t n = p.num_tensors();
    p.inputs.resize(K * n);
  }
  // Fill the client-major pointer tables group by group (second pass keeps them dense).
  std::map<std::pair<at::ScalarType, at::ScalarType>, int64_t> fill;
  for (const auto t : c10::irange(T)) {
    if (updates[t].numel() == 0) continue;
    const auto key = std::make_pair(updates[t].scalar_type(), out[t].scalar_type());
    WeightedSumPlan& p = plans.at(key);
    const int64_t i = fill[key]++;
    const int64_t n = p.num_tensors();
    for (const auto k : c10::irange(K)) {
      p.inputs[k * n + i] = dense.in(updates[k * T + t]);
    }
  }
  for (auto& [key, p] : plans) runner(p);
  dense.finish();
}

inline std::vector<at::Tensor> weighted_sum_functional(
    at::TensorList updates, const at::Tensor& weights,
    at::TensorList base, double scale, bool delta, WeightedSumRunner runner, EmptyFn empty) {
  const auto shape = check_inputs(updates, weights, base);
  check_scale(scale, shape);
  std::vector<at::Tensor> out;
  out.reserve(shape.num_tensors);
  for (const auto t : c10::irange(shape.num_tensors)) {
    out.push_back(empty(
        updates[t].sizes(), updates[t].options().dtype(result_dtype(updates, base, t))));
  }
  run_weighted_sum(updates, weights, base, scale, delta, out, shape, runner);
  return out;
}

inline void weighted_sum_out(
    at::TensorList updates, const at::Tensor& weights,
    at::TensorList base, double scale, bool delta,
    at::TensorList out, WeightedSumRunner runner) {
  const auto shape = check_inputs(updates, weights, base);
  check_scale(scale, shape);
  check_outputs(updates, base, out, shape, /*out_is_base=*/false);
  run_weighted_sum(updates, weights, base, scale, delta, out, shape, runner);
}

inline void weighted_sum_inplace(
    at::TensorList base, at::TensorList updates,
    const at::Tensor& weights, double scale, bool delta, WeightedSumRunner runner) {
  const auto shape = check_inputs(updates, weights, base);
  check_scale(scale, shape);
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(base.size()) == shape.num_tensors,
      "fedkernels.weighted_sum_: base has ", base.size(), " tensors, clients have ",
      shape.num_tensors);
  check_outputs(updates, base, base, shape, /*out_is_base=*/true);
  run_weighted_sum(updates, weights, base, scale, delta, base, shape, runner);
}

// Runs a plan with the backend's kernel template Kernels::run<T, U>(plan): T the update dtype,
// U the result dtype (T, or float32 for half-precision updates into an fp32 base).
template <typename Kernels>
void run_weighted_sum_plan(const WeightedSumPlan& p) {
  dispatch_float(p.in_dtype, "weighted_sum", [&](auto dtype) {
    using T = typename decltype(dtype)::type;
    if (p.out_dtype == p.in_dtype) return Kernels::template run<T, T>(p);
    if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>) {
      if (p.out_dtype == at::kFloat) return Kernels::template run<T, float>(p);
    }
    TORCH_CHECK(
        false, "fedkernels.weighted_sum: unsupported dtypes ", p.in_dtype, " -> ", p.out_dtype);
  });
}

// Registers the three weighted_sum overloads of one backend (CPU, CUDA), whose kernel is the
// template Kernels::run<T, U>(const WeightedSumPlan&).
template <typename Kernels>
void register_weighted_sum(torch::Library& m) {
  m.impl(
      "weighted_sum",
      [](at::TensorList updates, const at::Tensor& weights, at::TensorList base, double scale,
         bool delta) {
        return weighted_sum_functional(
            updates, weights, base, scale, delta, &run_weighted_sum_plan<Kernels>,
            empty_of<Kernels>());
      });
  m.impl(
      "weighted_sum.out",
      [](at::TensorList updates, const at::Tensor& weights, at::TensorList base, double scale,
         bool delta, at::TensorList out) {
        weighted_sum_out(
            updates, weights, base, scale, delta, out, &run_weighted_sum_plan<Kernels>);
      });
  m.impl(
      "weighted_sum_",
      [](at::TensorList base, at::TensorList updates, const at::Tensor& weights, double scale,
         bool delta) {
        weighted_sum_inplace(
            base, updates, weights, scale, delta, &run_weighted_sum_plan<Kernels>);
      });
}

}  // namespace fedkernels
