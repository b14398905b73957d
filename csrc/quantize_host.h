// Host side of the quantized-update ops (quantize_int8, quantize_int4, quantize_fp8 and their
// dequantize_*weighted_sum; schemas in csrc/ops.cpp), shared by the CPU and CUDA backends:
// validation (nothing is written before it passes), output allocation, and the per-dtype lists
// of pointers the kernels walk.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"

namespace fedkernels {

// Blocks longer than this gain nothing (the scale is 4 bytes) and would need 64-bit block
// arithmetic nowhere else required.
constexpr int64_t kMaxQuantBlock = int64_t(1) << 24;

inline int64_t blocks_of(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

inline int64_t total_of(const std::vector<int64_t>& numels) {
  int64_t total = 0;
  for (const auto n : numels) total += n;
  return total;
}

// The compressed formats: int8 and packed int4 with one scale per block, fp8 e4m3fn with one
// scale per tensor.
enum class QuantFormat { kInt8, kInt4, kFp8 };

inline const char* quantize_op_name(QuantFormat f) {
  return f == QuantFormat::kInt8 ? "quantize_int8"
       : f == QuantFormat::kInt4 ? "quantize_int4" : "quantize_fp8";
}

// Bytes of a tensor of n elements in format f: int4 packs two elements a byte.
inline int64_t packed_bytes(QuantFormat f, int64_t n) {
  return f == QuantFormat::kInt4 ? (n + 1) / 2 : n;
}

inline void check_block_size(const char* op, int64_t block_size, bool even = false) {
  TORCH_CHECK_VALUE(
      block_size >= 1 && block_size <= kMaxQuantBlock, "fedkernels.", op,
      ": block_size must be in [1, ", kMaxQuantBlock, "], got ", block_size);
  // an even block never shares a byte with the next one, so no two threads write one byte
  TORCH_CHECK_VALUE(!even || block_size % 2 == 0, "fedkernels.", op,
                    ": block_size must be even (two 4-bit values a byte), got ", block_size);
}

// The tensors of one dtype of a quantize_* call: the kernels' view. fp8 has one block per
// tensor (block_size 0 here).
struct QuantizeList {
  QuantFormat format = QuantFormat::kInt8;
  at::ScalarType dtype;
  at::Device device{at::kCPU};
  int64_t block_size = 0;
  bool stochastic = false, feedback = false;
  uint64_t seed = 0, offset = 0;
  std::vector<const void*> x, residual;  // residual: empty without error feedback
  std::vector<void*> values;             // int8, packed uint8 or e4m3fn bytes
  std::vector<float*> scales;
  std::vector<void*> residual_out;
  std::vector<int64_t> numels;
  std::vector<int64_t> first;  // index of the tensor's first element in the whole list
  int64_t num_tensors() const { return static_cast<int64_t>(x.size()); }
};

// The K clients' compressed tensors of a dequantize_*weighted_sum call and its outputs. fp8:
// one scale per tensor (block_size 0).
struct DequantizeList {
  QuantFormat format = QuantFormat::kInt8;
  at::ScalarType dtype;  // of the outputs
  at::Device device{at::kCPU};
  int64_t K = 0, T = 0, block_size = 0;
  std::vector<const void*> values;  // client-major, [k * T + t]
  std::vector<const float*> scales;
  std::vector<float> weights;
  std::vector<void*> outs;
  std::vector<int64_t> numels;
};

using QuantizeRunner = void (*)(QuantizeList&);
using DequantizeRunner = void (*)(DequantizeList&);

// quantize_int8 (values shaped as x), quantize_int4 (values packed: [ceil(n / 2)] uint8) and
// quantize_fp8 (values shaped as x, e4m3fn; one scale per tensor; block_size unused).
inline std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
quantize_host(QuantFormat format, at::TensorList x, at::TensorList residual, int64_t block_size,
              bool stochastic, int64_t seed, int64_t offset, QuantizeRunner runner) {
  const char* op = quantize_op_name(format);
  const int64_t T = static_cast<int64_t>(x.size());
  if (format != QuantFormat::kFp8) check_block_size(op, block_size, format == QuantFormat::kInt4);
  const bool feedback = !residual.empty();
  TORCH_CHECK_VALUE(
      !feedback || static_cast<int64_t>(residual.size()) == T, "fedkernels.", op,
      ": residual must be empty or have one tensor per x tensor (", T, "), got ", residual.size());
  for (const auto t : c10::irange(T)) {
    check_supported_float(op, x[t].scalar_type(), "x tensor ", t);
    check_device(op, x[t], x[0].device(), false, "x tensor ", t);
    if (feedback) {
      check_device(op, residual[t], x[0].device(), false, "residual tensor ", t);
      TORCH_CHECK_VALUE(
          residual[t].sizes() == x[t].sizes(), "fedkernels.", op, ": residual tensor ", t,
          " has shape ", residual[t].sizes(), ", x tensor ", t, " has ", x[t].sizes());
      TORCH_CHECK_TYPE(
          residual[t].scalar_type() == x[t].scalar_type(), "fedkernels.", op,
          ": residual tensor ", t, " has dtype ", residual[t].scalar_type(), ", x tensor ", t,
          " has ", x[t].scalar_type());
    }
  }
  std::vector<at::Tensor> values, scales, residual_out;
  DenseBuffers dense;
  std::map<at::ScalarType, QuantizeList> lists;
  int64_t first = 0;
  for (const auto t : c10::irange(T)) {
    const int64_t n = x[t].numel();
    if (format == QuantFormat::kInt4) {
      values.push_back(at::empty({packed_bytes(format, n)}, x[t].options().dtype(at::kByte)));
    } else {
      values.push_back(at::empty(x[t].sizes(), x[t].options().dtype(
          format == QuantFormat::kInt8 ? at::kChar : at::ScalarType::Float8_e4m3fn)));
    }
    const int64_t nb = format == QuantFormat::kFp8 ? 1 : blocks_of(n, block_size);
    scales.push_back(at::empty({nb}, x[t].options().dtype(at::kFloat)));
    if (feedback) residual_out.push_back(at::empty(x[t].sizes(), x[t].options()));
    auto [it, fresh] = lists.try_emplace(x[t].scalar_type());
    QuantizeList& l = it->second;
    if (fresh) {
      l.format = format;
      l.dtype = x[t].scalar_type();
      l.device = x[t].device();
      l.block_size = format == QuantFormat::kFp8 ? 0 : block_size;
      l.stochastic = stochastic;
      l.feedback = feedback;
      l.seed = static_cast<uint64_t>(seed);
      l.offset = static_cast<uint64_t>(offset);
    }
    l.x.push_back(dense.in(x[t]));
    if (feedback) {
      l.residual.push_back(dense.in(residual[t]));
      l.residual_out.push_back(residual_out.back().data_ptr());
    }
    l.values.push_back(values.back().data_ptr());
    l.scales.push_back(scales.back().mutable_data_ptr<float>());
    l.numels.push_back(n);
    l.first.push_back(first);
    first += n;
  }
  for (auto& [dtype, l] : lists) {
    // an empty fp8 tensor still has its one scale (0, as an all-zero tensor's): the kernels
    // write it
    if (total_of(l.numels) > 0 || format == QuantFormat::kFp8) runner(l);
  }
  return {values, scales, residual_out};
}

// Checks the K weights (1-D, real, finite; on the CPU or the values' device) and returns them
// as float32, the type the kernels multiply in.
inline std::vector<float> checked_quantized_weights(
    const char* op, const at::Tensor& weights, at::TensorList values) {
  TORCH_CHECK_VALUE(
      weights.dim() == 1 && weights.numel() >= 1, "fedkernels.", op,
      ": weights must be 1-D [K] with K >= 1, got shape ", weights.sizes());
  TORCH_CHECK_TYPE(
      at::isFloatingType(weights.scalar_type()), "fedkernels.", op,
      ": weights must be floating point, got ", weights.scalar_type());
  if (!values.empty()) check_device(op, weights, values[0].device(), true, "weights");
  const at::Tensor w = weights.to(at::kCPU, at::kDouble).contiguous();
  const double* wp = w.const_data_ptr<double>();
  std::vector<float> out(weights.numel());
  for (const auto k : c10::irange(weights.numel())) {
    TORCH_CHECK_VALUE(std::isfinite(wp[k]), "fedkernels.", op, ": weight of client ", k, " is ",
                      wp[k]);
    out[k] = static_cast<float>(wp[k]);
  }
  return out;
}

inline const char* dequantize_op_name(QuantFormat f, bool check_out) {
  if (f == QuantFormat::kInt8) {
    return check_out ? "dequantize_weighted_sum.out" : "dequantize_weighted_sum";
  }
  if (f == QuantFormat::kInt4) {
    return check_out ? "dequantize_int4_weighted_sum.out" : "dequantize_int4_weighted_sum";
  }
  return check_out ? "dequantize_fp8_weighted_sum.out" : "dequantize_fp8_weighted_sum";
}

// The sum into fresh tensors, or (check_out) into out after checking it: T tensors of dtype,
// on the values' device, each sharing no memory with another tensor. int8 and fp8: shaped as
// client 0's values; int4 (values packed, so the element counts come as numels): fresh
// results are 1-D [numels[t]], and out tensors may have any shape of numels[t] elements
// (written in C order).
inline std::vector<at::Tensor> dequantize_weighted_sum_host(
    QuantFormat format, at::TensorList values, at::TensorList scales, const at::Tensor& weights,
    int64_t block_size, at::IntArrayRef numels_given, at::ScalarType dtype,
    at::TensorList out_given, bool check_out, DequantizeRunner runner,
    EmptyFn empty = &plain_empty) {
  const char* op = dequantize_op_name(format, check_out);
  const bool int4 = format == QuantFormat::kInt4, fp8 = format == QuantFormat::kFp8;
  if (!fp8) check_block_size(op, block_size, int4);
  check_supported_float(op, dtype, "dtype");
  TORCH_CHECK_VALUE(
      weights.dim() == 1 && weights.numel() >= 1, "fedkernels.", op,
      ": weights must be 1-D [K] with K >= 1, got shape ", weights.sizes());
  const int64_t K = weights.numel();
  const int64_t n_values = static_cast<int64_t>(values.size());
  TORCH_CHECK_VALUE(
      n_values % K == 0, "fedkernels.", op, ": ", n_values, " values tensors for K = ", K,
      " clients (expected K * T, client-major)");
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(scales.size()) == n_values, "fedkernels.", op, ": ", scales.size(),
      " scales tensors for ", n_values, " values tensors (expected one per values tensor)");
  const int64_t T = n_values / K;
  if (int4) {
    TORCH_CHECK_VALUE(
        static_cast<int64_t>(numels_given.size()) == T, "fedkernels.", op, ": numels has ",
        numels_given.size(), " entries for ", T, " tensors per client");
    for (const auto t : c10::irange(T)) {
      TORCH_CHECK_VALUE(numels_given[t] >= 0, "fedkernels.", op, ": numels[", t, "] is ",
                        numels_given[t]);
    }
  }
  const at::ScalarType stored = int4 ? at::kByte : fp8 ? at::ScalarType::Float8_e4m3fn : at::kChar;
  const char* stored_name = int4 ? "uint8" : fp8 ? "float8_e4m3fn" : "int8";
  for (const auto i : c10::irange(n_values)) {
    const int64_t k = i / T, t = i % T;
    check_device(op, values[i], values[0].device(), false, "values tensor ", i);
    check_device(op, scales[i], values[0].device(), false, "scales tensor ", i);
    TORCH_CHECK_TYPE(
        values[i].scalar_type() == stored, "fedkernels.", op, ": values tensor ", i,
        " (client ", k, ", tensor ", t, ") has dtype ", values[i].scalar_type(), ", expected ",
        stored_name);
    TORCH_CHECK_TYPE(
        scales[i].scalar_type() == at::kFloat, "fedkernels.", op, ": scales tensor ", i,
        " (client ", k, ", tensor ", t, ") has dtype ", scales[i].scalar_type(),
        ", expected float32");
    if (int4) {
      const int64_t want = packed_bytes(format, numels_given[t]);
      TORCH_CHECK_VALUE(
          values[i].dim() == 1 && values[i].numel() == want, "fedkernels.", op,
          ": values tensor ", i, " (client ", k, ", tensor ", t, ") has shape ",
          values[i].sizes(), ", expected [", want, "] (", numels_given[t],
          " values, two a byte)");
    } else {
      TORCH_CHECK_VALUE(
          values[i].sizes() == values[t].sizes(), "fedkernels.", op, ": values tensor ", i,
          " (client ", k, ", tensor ", t, ") has shape ", values[i].sizes(), ", client 0's has ",
          values[t].sizes());
    }
    const int64_t n = int4 ? numels_given[t] : values[i].numel();
    const int64_t want = fp8 ? 1 : blocks_of(n, block_size);
    TORCH_CHECK_VALUE(
        scales[i].dim() == 1 && scales[i].numel() == want, "fedkernels.", op, ": scales tensor ",
        i, " (client ", k, ", tensor ", t, ") has shape ", scales[i].sizes(), ", expected [",
        want, "] (", fp8 ? "one per tensor" : "one per block", ")");
  }
  std::vector<int64_t> numels(T);
  for (const auto t : c10::irange(T)) numels[t] = int4 ? numels_given[t] : values[t].numel();
  if (check_out) {
    TORCH_CHECK_VALUE(
        static_cast<int64_t>(out_given.size()) == T, "fedkernels.", op, ": out has ",
        out_given.size(), " tensors, expected ", T);
    for (const auto t : c10::irange(T)) {
      check_device(op, out_given[t], values[0].device(), false, "out tensor ", t);
      TORCH_CHECK_TYPE(
          out_given[t].scalar_type() == dtype, "fedkernels.", op, ": out tensor ", t,
          " has dtype ", out_given[t].scalar_type(), ", expected ", dtype);
      if (int4) {
        TORCH_CHECK_VALUE(
            out_given[t].numel() == numels[t], "fedkernels.", op, ": out tensor ", t,
            " has shape ", out_given[t].sizes(), ", expected ", numels[t], " elements");
      } else {
        TORCH_CHECK_VALUE(
            out_given[t].sizes() == values[t].sizes(), "fedkernels.", op, ": out tensor ", t,
            " has shape ", out_given[t].sizes(), ", expected ", values[t].sizes());
      }
    }
    std::vector<const at::Tensor*> tensors;
    for (const auto& o : out_given) tensors.push_back(&o);
    for (const auto& v : values) tensors.push_back(&v);
    for (const auto& sc : scales) tensors.push_back(&sc);
    check_written_apart(
        op, tensors, T,
        [&](int64_t i) {
          if (i < T) return "out tensor " + std::to_string(i);
          if (i < T + n_values) return "values tensor " + std::to_string(i - T);
          return "scales tensor " + std::to_string(i - T - n_values);
        },
        "", "");
  }
  DequantizeList l;
  l.format = format;
  l.dtype = dtype;
  l.K = K;
  l.T = T;
  l.block_size = fp8 ? 0 : block_size;
  l.weights = checked_quantized_weights(op, weights, values);
  std::vector<at::Tensor> out;
  if (T == 0) return out;
  l.device = values[0].device();
  DenseBuffers dense;
  for (const auto i : c10::irange(n_values)) {
    l.values.push_back(dense.in(values[i]));
    l.scales.push_back(static_cast<const float*>(dense.in(scales[i])));
  }
  int64_t total = 0;
  for (const auto t : c10::irange(T)) {
    if (check_out) {
      l.outs.push_back(dense.out(out_given[t]));
    } else {
      const auto opts = values[t].options().dtype(dtype);
      out.push_back(int4 ? empty({numels[t]}, opts) : empty(values[t].sizes(), opts));
      l.outs.push_back(out.back().data_ptr());
    }
    l.numels.push_back(numels[t]);
    total += numels[t];
  }
  if (total > 0) runner(l);
  dense.finish();
  return out;
}

template <typename Kernels>
void run_quantize_list(QuantizeList& l) {
  dispatch_float(l.dtype, quantize_op_name(l.format), [&](auto tag) {
    Kernels::template quantize<typename decltype(tag)::type>(l);
  });
}

template <typename Kernels>
void run_dequantize_list(DequantizeList& l) {
  dispatch_float(l.dtype, dequantize_op_name(l.format, false), [&](auto tag) {
    Kernels::template dequantize_sum<typename decltype(tag)::type>(l);
  });
}

// Registers the quantized-update ops of one backend (CPU, CUDA), whose kernels are the
// templates Kernels::quantize<T>(QuantizeList&) (T: x's type) and
// Kernels::dequantize_sum<T>(DequantizeList&) (T: the output type), each for every format.
template <typename Kernels>
void register_quantize(torch::Library& m) {
  m.impl(
      "quantize_int8",
      [](at::TensorList x, at::TensorList residual, int64_t block_size, bool stochastic,
         int64_t seed, int64_t offset) {
        return quantize_host(QuantFormat::kInt8, x, residual, block_size, stochastic, seed,
                             offset, &run_quantize_list<Kernels>);
      });
  m.impl(
      "dequantize_weighted_sum",
      [](at::TensorList values, at::TensorList scales, const at::Tensor& weights,
         int64_t block_size, at::ScalarType dtype) {
        return dequantize_weighted_sum_host(
            QuantFormat::kInt8, values, scales, weights, block_size, {}, dtype, {}, false,
            &run_dequantize_list<Kernels>, empty_of<Kernels>());
      });
  m.impl(
      "dequantize_weighted_sum.out",
      [](at::TensorList values, at::TensorList scales, const at::Tensor& weights,
         int64_t block_size, at::ScalarType dtype, at::TensorList out) {
        dequantize_weighted_sum_host(QuantFormat::kInt8, values, scales, weights, block_size, {},
                                     dtype, out, true, &run_dequantize_list<Kernels>);
      });
  // packed 4-bit
  m.impl(
      "quantize_int4",
      [](at::TensorList x, at::TensorList residual, int64_t block_size, bool stochastic,
         int64_t seed, int64_t offset) {
        return quantize_host(QuantFormat::kInt4, x, residual, block_size, stochastic, seed,
                             offset, &run_quantize_list<Kernels>);
      });
  m.impl(
      "dequantize_int4_weighted_sum",
      [](at::TensorList values, at::TensorList scales, const at::Tensor& weights,
         int64_t block_size, at::IntArrayRef numels, at::ScalarType dtype) {
        return dequantize_weighted_sum_host(
            QuantFormat::kInt4, values, scales, weights, block_size, numels, dtype, {}, false,
            &run_dequantize_list<Kernels>, empty_of<Kernels>());
      });
  m.impl(
      "dequantize_int4_weighted_sum.out",
      [](at::TensorList values, at::TensorList scales, const at::Tensor& weights,
         int64_t block_size, at::IntArrayRef numels, at::ScalarType dtype, at::TensorList out) {
        dequantize_weighted_sum_host(QuantFormat::kInt4, values, scales, weights, block_size,
                                     numels, dtype, out, true, &run_dequantize_list<Kernels>);
      });
  // fp8 e4m3fn, one scale per tensor
  m.impl(
      "quantize_fp8",
      [](at::TensorList x, at::TensorList residual, bool stochastic, int64_t seed,
         int64_t offset) {
        return quantize_host(QuantFormat::kFp8, x, residual, 0, stochastic, seed, offset,
                             &run_quantize_list<Kernels>);
      });
  m.impl(
      "dequantize_fp8_weighted_sum",
      [](at::TensorList values, at::TensorList scales, const at::Tensor& weights,
         at::ScalarType dtype) {
        return dequantize_weighted_sum_host(
            QuantFormat::kFp8, values, scales, weights, 0, {}, dtype, {}, false,
            &run_dequantize_list<Kernels>, empty_of<Kernels>());
      });
  m.impl(
      "dequantize_fp8_weighted_sum.out",
      [](at::TensorList values, at::TensorList scales, const at::Tensor& weights,
         at::ScalarType dtype, at::TensorList out) {
        dequantize_weighted_sum_host(QuantFormat::kFp8, values, scales, weights, 0, {}, dtype,
                                     out, true, &run_dequantize_list<Kernels>);
      });
}

}  // namespace fedkernels
