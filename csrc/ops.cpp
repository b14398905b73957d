// The schemas of every fedkernels op. This file builds the `fedkernels._C` library, which
// always loads first; CPU kernels (one library per instruction set) and CUDA kernels register
// their implementations in libraries of their own (see fedkernels/_native.py).
#include <torch/library.h>

TORCH_LIBRARY(fedkernels, m) {
  // Weighted sum of K client models, each a list of T tensors, given client-major:
  // updates[k * T + t] is tensor t of client k, and K = weights.numel().
  //   plain (base = []):     out_t = scale * sum_k w_k * x_kt
  //   delta (delta = true):  out_t = base_t + scale * sum_k w_k * (x_kt - base_t)
  //   accumulate (false):    out_t = base_t + scale * sum_k w_k * x_kt
  // Accumulation is in fp32 for fp16/bf16/fp32 inputs and fp64 for fp64, in client order.
  m.def(
      "weighted_sum(Tensor[] updates, Tensor weights, Tensor[] base, float scale, bool delta) "
      "-> Tensor[]");
  m.def(
      "weighted_sum.out(Tensor[] updates, Tensor weights, Tensor[] base, float scale, "
      "bool delta, *, Tensor(a!)[] out) -> ()");
  // In place into base: base_t <- base_t + scale * sum_k w_k * (x_kt - [delta] base_t).
  m.def(
      "weighted_sum_(Tensor(a!)[] base, Tensor[] updates, Tensor weights, float scale, "
      "bool delta) -> ()");
}
