// The checks of a client-major list of K clients of T tensors each (clients[k * T + t] is
// tensor t of client k), the input of weighted_sum, the robust rules and the DP ops: every
// client's tensor t has client 0's shape and dtype and lies on the call's device, client 0's
// dtypes are supported, and the outputs alias none of them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace fedkernels {

// "client k, tensor t", the name of a client tensor in errors.
inline std::string client_tensor_name(int64_t k, int64_t t) {
  return "client " + std::to_string(k) + ", tensor " + std::to_string(t);
}

// Raises, naming the first client tensor at fault, unless every clients[k * T + t] is on
// `device` with client 0's shape and dtype for tensor t, and client 0's dtypes are supported.
// A name is formatted only to raise: a model of hundreds of tensors pays no string per tensor.
inline void check_client_tensors(
    const char* op, at::TensorList clients, int64_t K, int64_t T, at::Device device) {
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor& ref = clients[t];
    check_supported_float(op, ref.scalar_type(), "client 0, tensor ", t);
    for (int64_t k = 0; k < K; ++k) {
      const at::Tensor& x = clients[k * T + t];
      if (x.device() != device) {
        check_device(op, x, device, /*allow_cpu=*/false, client_tensor_name(k, t));
      }
      TORCH_CHECK_VALUE(
          x.sizes() == ref.sizes(), "fedkernels.", op, ": ", client_tensor_name(k, t),
          " has shape ", x.sizes(), ", client 0 has ", ref.sizes());
      TORCH_CHECK_TYPE(
          x.scalar_type() == ref.scalar_type(), "fedkernels.", op, ": ", client_tensor_name(k, t),
          " has dtype ", x.scalar_type(), ", client 0 has ", ref.scalar_type());
    }
  }
}

// Raises unless every out tensor has one element of memory each and overlaps no other out
// tensor, no client tensor, and no base tensor (base: [] when there is none, or when it is the
// output itself, in place); `why` ends the overlap message.
inline void check_outputs_apart(
    const char* op, at::TensorList out, at::TensorList clients, int64_t K, at::TensorList base,
    const char* why) {
  const int64_t T = static_cast<int64_t>(out.size());
  std::vector<const at::Tensor*> tensors;
  tensors.reserve(out.size() + clients.size() + base.size());
  for (const auto& o : out) tensors.push_back(&o);
  for (const auto& x : clients) tensors.push_back(&x);
  for (const auto& b : base) tensors.push_back(&b);
  const int64_t client_tensors = K * T;
  check_written_apart(
      op, tensors, T,
      [&](int64_t i) {
        if (i < T) return "out tensor " + std::to_string(i);
        if (i < T + client_tensors) return client_tensor_name((i - T) / T, (i - T) % T);
        return "base tensor " + std::to_string(i - T - client_tensors);
      },
      "", why);
}

}  // namespace fedkernels
