// What every fedkernels op shares, on the host and in the kernels of both backends: the
// accumulate type of each supported dtype, the checks of dtypes, devices, scalar arguments and
// (overlap.h) written memory that every op's validation runs (each raising an error that names
// the op and the argument), and the one dispatch from a runtime dtype to the kernel templates.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "host_device.h"
#include "overlap.h"

namespace fedkernels {

// "<what> <verb>", the verb in the plural form for a plural argument name ("scores are", "x is"):
// the subject of the messages below.
template <typename... What>
inline std::string subject(const char* singular, const char* plural, const What&... what) {
  const std::string name = c10::str(what...);
  return name + " " + (!name.empty() && name.back() == 's' ? plural : singular);
}

// ---------------------------------------------------------------- dtypes

// Arithmetic type of a storage type: fp32 for fp16/bf16/fp32, fp64 for fp64.
template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

inline at::ScalarType accumulate_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The parameter dtypes every op takes.
inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// TypeError "fedkernels.<op>: <what> has dtype <t>; supported: ..." unless t is supported.
template <typename... What>
inline void check_supported_float(const char* op, at::ScalarType t, const What&... what) {
  TORCH_CHECK_TYPE(
      is_supported_float(t), "fedkernels.", op, ": ", subject("has", "have", what...), " dtype ",
      t, "; supported: float32, float64, float16, bfloat16");
}

template <typename T>
struct DtypeTag {
  using type = T;
};

// Calls f(DtypeTag<T>{}) with the C++ type T of a supported dtype; raises for any other.
template <typename F>
decltype(auto) dispatch_float(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: return f(DtypeTag<float>{});
    case at::kDouble: return f(DtypeTag<double>{});
    case at::kHalf: return f(DtypeTag<at::Half>{});
    case at::kBFloat16: return f(DtypeTag<at::BFloat16>{});
    default:
      TORCH_CHECK_TYPE(
          false, "fedkernels.", op, ": unsupported dtype ", t,
          "; supported: float32, float64, float16, bfloat16");
  }
}

// ---------------------------------------------------------------- memory

// Whether a kernel may read or write t's elements where they are: contiguous, with a data
// pointer aligned to the element size. A tensor over foreign memory (torch.frombuffer at an odd
// byte offset, say) can be contiguous yet misaligned, and a typed access to it is undefined
// behaviour (a fault where the compiler uses aligned vector loads).
inline bool is_contiguous_aligned(const at::Tensor& t) {
  return t.is_contiguous() &&
      reinterpret_cast<uintptr_t>(t.const_data_ptr()) % static_cast<uintptr_t>(t.element_size()) ==
      0;
}

// t itself when is_contiguous_aligned, else a contiguous copy in fresh (aligned) memory; what
// Tensor::contiguous() gives, except for a contiguous but misaligned t.
inline at::Tensor contiguous_aligned(const at::Tensor& t) {
  return is_contiguous_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The memory a kernel reads and writes, for one call: a tensor's own where is_contiguous_aligned,
// else a dense copy of an input (kept alive until the kernel has run) or a dense temporary for
// an output, copied into it by finish(). Pointers stay valid while the call's buffers live.
struct DenseBuffers {
  std::vector<at::Tensor> copies;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (dense result, output)

  const void* in(const at::Tensor& x) {
    if (is_contiguous_aligned(x)) return x.const_data_ptr();
    copies.push_back(x.clone(at::MemoryFormat::Contiguous));
    return copies.back().const_data_ptr();
  }
  void* out(const at::Tensor& o) {
    if (is_contiguous_aligned(o)) return o.data_ptr();
    auto tmp = at::empty(o.sizes(), o.options());
    write_back.emplace_back(tmp, o);
    return tmp.data_ptr();
  }
  // After the kernels: the dense results into their outputs (an in-place base is read before,
  // so writing it here stays correct).
  void finish() {
    for (auto& [dense, strided] : write_back) strided.copy_(dense);
  }
};

// ---------------------------------------------------------------- devices

// ValueError "fedkernels.<op>: <what> is on <device>, expected <expected>" unless the tensor
// is on `expected` (or, with allow_cpu, on the CPU: the small host-side arguments, such as
// weights and mixing coefficients, that an op reads or uploads itself). Every tensor argument
// of every op passes through this check, so a tensor on another device (`meta` among CPU
// tensors, say) is an error that names it, never a result computed from the wrong memory.
template <typename... What>
inline void check_device(
    const char* op, const at::Tensor& t, at::Device expected, bool allow_cpu,
    const What&... what) {
  TORCH_CHECK_VALUE(
      t.device() == expected || (allow_cpu && t.device().is_cpu()), "fedkernels.", op, ": ",
      subject("is", "are", what...), " on ", t.device(), ", expected ", expected,
      allow_cpu && !expected.is_cpu() ? " (or cpu)" : "");
}

// The same for every tensor of a list ("<name> tensor <i> is on ...").
inline void check_list_device(
    const char* op, at::TensorList list, at::Device expected, const char* name) {
  for (size_t i = 0; i < list.size(); ++i) {
    check_device(op, list[i], expected, /*allow_cpu=*/false, name, " tensor ", i);
  }
}

// ---------------------------------------------------------------- scalar arguments

// ValueError "fedkernels.<op>: <name> must be finite and >= 0, got <value>" (NaN fails too).
inline void check_finite_nonnegative(const char* op, const char* name, double value) {
  TORCH_CHECK_VALUE(
      std::isfinite(value) && value >= 0, "fedkernels.", op, ": ", name,
      " must be finite and >= 0, got ", value);
}

// ValueError "fedkernels.<op>: <name> must be finite and > 0, got <value>".
inline void check_finite_positive(const char* op, const char* name, double value) {
  TORCH_CHECK_VALUE(
      std::isfinite(value) && value > 0, "fedkernels.", op, ": ", name,
      " must be finite and > 0, got ", value);
}

// How a backend allocates an allocating op's results (the CPU's come from its output pool):
// Kernels::empty where the backend has one, else at::empty.
using EmptyFn = at::Tensor (*)(at::IntArrayRef, const at::TensorOptions&);

inline at::Tensor plain_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty(sizes, options);
}

template <typename Kernels>
constexpr EmptyFn empty_of() {
  if constexpr (requires { Kernels::empty; }) {
    return &Kernels::empty;
  } else {
    return &plain_empty;
  }
}

}  // namespace fedkernels
