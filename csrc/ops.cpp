// The schemas of every fedkernels op. This file builds the `fedkernels._C` library, which
// always loads first; CPU kernels (one library per instruction set) and CUDA kernels register
// their implementations in libraries of their own, each through its family's registration
// template (register_weighted_sum, register_superfed, register_distill, register_sgld in the
// csrc/*_host.h headers), so a backend file holds only kernels.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <string>
#include <vector>

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
  // The CPU output pool of the allocating weighted_sum (csrc/cpu/output_pool.h): the most idle
  // bytes it keeps (0: no pool), freeing its idle blocks (returns the bytes freed), and
  // [limit, idle bytes, idle blocks, hits, misses].
  m.def("output_pool_set_limit(int limit_bytes) -> ()");
  m.def("output_pool_release() -> int");
  m.def("output_pool_stats() -> int[]");
}

// ---------------------------------------------------------------- SuPerFed
// The method: docs/superfed.md. Host side: csrc/superfed_host.h; kernels: csrc/cpu/superfed.cpp,
// csrc/cuda/superfed.cu; per-element math: csrc/elementwise.h.
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // theta_t = (1 - lam_t) g_t + lam_t l_t, computed as torch.lerp does (exact at lam = 0 and 1).
  // lam: one value (model mixing, MM) or one per tensor (layer mixing, LM).
  m.def("mix_endpoints(Tensor[] global_params, Tensor[] local_params, Tensor lam) -> Tensor[]");
  // One pass over (G, g, l): grad_g = (1 - lam) G, grad_l = lam G, grad_lam = sum <G, l - g>
  // (per tensor for LM, over all tensors for MM; shaped like lam). A false output_mask entry
  // returns an empty list (a zero lam gradient for the third).
  m.def(
      "mix_endpoints_backward(Tensor[] grads, Tensor[] global_params, Tensor[] local_params, "
      "Tensor lam, bool[3] output_mask) -> (Tensor[], Tensor[], Tensor)");
  // One read pass over g, l, a: float64 [T, 4] with per-tensor rows
  //   [<g, l>, ||g||^2, ||l||^2, ||g - a||^2]
  // (columns of an empty list are 0). Cosine orthogonality and both proximal forms are scalar
  // functions of these rows, so they share this one pass.
  m.def(
      "superfed_stats(Tensor[] global_params, Tensor[] local_params, Tensor[] anchor) -> Tensor");
  // One elementwise pass, given H = d loss / d stats [T, 4]:
  //   grad_g = H0 l + 2 H1 g + 2 H3 (g - a),  grad_l = H0 g + 2 H2 l,  grad_a = -2 H3 (g - a).
  m.def(
      "superfed_stats_backward(Tensor grad_stats, Tensor[] global_params, "
      "Tensor[] local_params, Tensor[] anchor, bool[3] output_mask) "
      "-> (Tensor[], Tensor[], Tensor[])");
  // Both of the above in one pass each way (the SuPerFed local step): theta as mix_endpoints
  // and the stats rows as superfed_stats(g, l, anchor). Backward, given G (for theta) and H:
  //   grad_g = (1 - lam) G + H0 l + 2 H1 g + 2 H3 (g - a),  grad_l = lam G + H0 g + 2 H2 l,
  //   grad_lam = sum <G, l - g>,  grad_a = -2 H3 (g - a).
  m.def(
      "mix_endpoints_with_stats(Tensor[] global_params, Tensor[] local_params, Tensor lam, "
      "Tensor[] anchor) -> (Tensor[], Tensor)");
  m.def(
      "mix_endpoints_with_stats_backward(Tensor[] grads, Tensor grad_stats, "
      "Tensor[] global_params, Tensor[] local_params, Tensor lam, Tensor[] anchor, "
      "bool[4] output_mask) -> (Tensor[], Tensor[], Tensor, Tensor[])");
  // One SGD step of both endpoints (torch.optim.SGD's update, in place) from the mixed model's
  // gradient G and H = d loss / d stats: the gradients of mix_endpoints_with_stats_backward,
  //   grad_g = (1 - lam) G + H0 l + 2 H1 g + 2 H3 (g - a),  grad_l = lam G + H0 g + 2 H2 l,
  // are used where they are computed and never stored. The momentum buffers are given when
  // momentum > 0; first_step (g's, l's): that endpoint's buffers are written, not read (torch's
  // first step sets a buffer to the gradient).
  m.def(
      "superfed_sgd_step_(Tensor(a!)[] global_params, Tensor(b!)[] local_params, "
      "Tensor(c!)[] global_momentum, Tensor(d!)[] local_momentum, Tensor[] grads, "
      "Tensor grad_stats, Tensor lam, Tensor[] anchor, float lr, float momentum, "
      "float dampening, float weight_decay, bool nesterov, bool[2] first_step) -> ()");
}

// ---------------------------------------------------------------- Ensemble distillation
// The method: docs/fedgo.md. Host side: csrc/distill_host.h; kernels: csrc/cpu/distill.cpp,
// csrc/cuda/distill.cu; per-row math: csrc/elementwise.h.
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // Pseudo-labels of K teachers' logits L[K, N, C] in one pass per sample i:
  //   weights w[k, i] (sum_k w = 1), by `weighting`:
  //     uniform:  softmax_k(log_prior_k)
  //     entropy:  softmax_k(-H(softmax(L[k, i])) / tau + log_prior_k)
  //     fedgo:    softmax_k(g(z[k, i]) + log_prior_k), g = sigmoid (double_sigmoid) or identity
  //     variance: n_k Var_c(L[k, i]) / sum_j n_j Var_c(L[j, i])  (uniform when the sum is 0)
  //     domain:   n_k sig(z[k, i]) / sum_j n_j sig(z[j, i])
  //   (n_k = exp(log_prior_k); scores z = the discriminators' logits [K, N], for fedgo/domain)
  //   combine "logits": y[i] = softmax(sum_k w[k, i] L[k, i] / T)
  //   combine "probs":  y[i] = sum_k w[k, i] softmax(L[k, i] / T)
  // Returns (y [N, C], w [K, N]), both in L's dtype; accumulation in fp32 (fp64 for fp64).
  m.def(
      "ensemble_pseudo_labels(Tensor logits, Tensor? scores, Tensor? log_prior, str weighting, "
      "str combine, float temperature, float tau, bool double_sigmoid) -> (Tensor, Tensor)");
  // Distillation loss and its gradient in one pass over (S [N, C], y [N, C]):
  //   loss = scale * sum_i sum_c y (log y - log_softmax(S / T))   (y log y = 0 at y = 0)
  //   grad = d loss / d S = (scale / T) (softmax(S / T) sum_c y - y)  (empty when not with_grad)
  // The loss is float32 (float64 for float64 S); grad has S's dtype.
  m.def(
      "distill_kl(Tensor student_logits, Tensor target, float temperature, float scale, "
      "bool with_grad) -> (Tensor, Tensor)");
}

// ---------------------------------------------------------------- FedEvg / SGLD
// The method: docs/fedevg.md. Host side: csrc/sgld_host.h; kernels: csrc/cpu/sgld.cpp,
// csrc/cuda/sgld.cu; per-element math: csrc/elementwise.h.
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // E_i = -logits[i, labels_i] (labels given) or -logsumexp_c logits[i, c]; logits [N, C],
  // labels int64 [N]; E in logits' dtype (fp32 accumulation for fp16/bf16).
  m.def("energy_from_logits(Tensor logits, Tensor? labels) -> Tensor");
  // x' = clamp(x - step_size * clip(grad, -grad_clip, grad_clip) + noise_std * eps,
  //            clamp_min, clamp_max), elementwise, one pass. eps = noise when given, else
  // standard normals from Philox-4x32-10 keyed by the generator (default generator when None):
  // element e takes lane e % 4 of block (subsequence e / 4), Box-Muller on its pairs.
  m.def(
      "sgld_step(Tensor x, Tensor grad, float step_size, float noise_std, float? grad_clip, "
      "float? clamp_min, float? clamp_max, Tensor? noise, Generator? generator) -> Tensor");
  m.def(
      "sgld_step_(Tensor(a!) x, Tensor grad, float step_size, float noise_std, "
      "float? grad_clip, float? clamp_min, float? clamp_max, Tensor? noise, "
      "Generator? generator) -> ()");
  // Mixture composition of K client energies and one SGLD step, for x [M, ...],
  // grads [K, M, ...], energies [K, M], log_weights [K]:
  //   z_kj = log_weights_k + phi(-energies_kj),  phi = identity (weighting "exact") | sign ("signed")
  //   pi_kj = softmax_k(z_kj);  a_j = sum_k pi_kj clip(grads_kj, -grad_clip, grad_clip)
  //   x'_j = clamp(x_j - step_size a_j + noise_std eps_j, clamp_min, clamp_max)
  // Returns (x', pi); pi is float32 (float64 for float64 x). Clients are summed in order.
  m.def(
      "sgld_compose_step(Tensor x, Tensor grads, Tensor energies, Tensor log_weights, str weighting, "
      "float step_size, float noise_std, float? grad_clip, float? clamp_min, float? clamp_max, "
      "Tensor? noise, Generator? generator) -> (Tensor, Tensor)");
  m.def(
      "sgld_compose_step_(Tensor(a!) x, Tensor grads, Tensor energies, Tensor log_weights, "
      "str weighting, float step_size, float noise_std, float? grad_clip, float? clamp_min, "
      "float? clamp_max, Tensor? noise, Generator? generator) -> Tensor");
}

// ---------------------------------------------------------------- Robust aggregation and DP
// The rules: docs/algorithms/robust_and_private.md. Host side: csrc/robust_host.h,
// csrc/private_host.h; kernels: csrc/{cpu,cuda}/robust.*, csrc/{cpu,cuda}/private.*;
// per-coordinate order statistics: csrc/order_stats.h.
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // Per coordinate over K clients (client-major lists, clients[k * T + t]), values sorted
  // ascending with NaN last, sums in ascending order in fp32 (fp64 for fp64); result in the
  // clients' dtype:
  //   coordinate_median: middle value, or (v[K/2-1] + v[K/2]) / 2 for even K (np.median); NaN
  //                      where any client is NaN;
  //   trimmed_mean:      mean of ranks [cut, K - cut);
  //   median_window_mean: mean of the `window` values closest to the median (Bulyan's last step).
  m.def("coordinate_median(Tensor[] clients, int num_clients) -> Tensor[]");
  m.def("coordinate_median.out(Tensor[] clients, int num_clients, *, Tensor(a!)[] out) -> ()");
  m.def("trimmed_mean(Tensor[] clients, int num_clients, int cut) -> Tensor[]");
  m.def(
      "trimmed_mean.out(Tensor[] clients, int num_clients, int cut, *, Tensor(a!)[] out) -> ()");
  m.def("median_window_mean(Tensor[] clients, int num_clients, int window) -> Tensor[]");
  m.def(
      "median_window_mean.out(Tensor[] clients, int num_clients, int window, *, "
      "Tensor(a!)[] out) -> ()");
  // D[i, j] = sum over all tensors of (x_i - x_j)^2, float64 [K, K], differences and sums in
  // float64, one pass over the clients.
  m.def("pairwise_sq_distances(Tensor[] clients, int num_clients) -> Tensor");
  // n_k = ||x_k - base||_2 over all tensors, float64 [K], one pass.
  m.def("update_norms(Tensor[] clients, int num_clients, Tensor[] base) -> Tensor");
  // out_t = base_t + sum_k c_k (x_kt - base_t) + noise_std * eps, clients in order, in fp32
  // (fp64 for fp64); eps as sgld_step's noise, element e counted over the whole list (one key
  // per call; nothing drawn when noise_std = 0). K = coefficients.numel().
  m.def(
      "private_sum(Tensor[] clients, Tensor coefficients, Tensor[] base, float noise_std, "
      "Generator? generator) -> Tensor[]");
  m.def(
      "private_sum.out(Tensor[] clients, Tensor coefficients, Tensor[] base, float noise_std, "
      "Generator? generator, *, Tensor(a!)[] out) -> ()");
  m.def(
      "private_sum_(Tensor(a!)[] base, Tensor[] clients, Tensor coefficients, float noise_std, "
      "Generator? generator) -> ()");
}

// ---------------------------------------------------------------- Quantized updates
// The method: docs/algorithms/quantized.md. Host side: csrc/quantize_host.h; kernels:
// csrc/cpu/quantize.cpp, csrc/cuda/quantize.cu; per-element math: QuantizeMath in
// csrc/elementwise.h.
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // Symmetric int8 with one float32 scale per block of block_size consecutive elements of each
  // tensor (C order; the last block may be short): v = x (+ residual), s = max|v| / 127 (0 for
  // an all-zero block, NaN for a block with a NaN or inf), q = round(v / s) clamped to
  // [-127, 127] (q = 0 where s is 0 or NaN). Rounding to nearest (ties to even), or stochastic:
  // q = floor(v / s + u), u = (word >> 8) 2^-24 with word = lane e % 4 of the Philox-4x32-10
  // block (seed, subsequence e / 4, offset), e counted over the whole list. With residual
  // given (error feedback): residual_out = v - q s, in x's dtype; else residual_out = [].
  m.def(
      "quantize_int8(Tensor[] x, Tensor[] residual, int block_size, bool stochastic, int seed, "
      "int offset) -> (Tensor[], Tensor[], Tensor[])");
  // out_t = sum_k w_k * s_kt[block] * q_kt over K = weights.numel() clients given client-major
  // (values[k * T + t], scales[k * T + t], as quantize_int8 writes them), accumulated in
  // float32 in client order (the product w_k s_kb first), stored as dtype.
  m.def(
      "dequantize_weighted_sum(Tensor[] values, Tensor[] scales, Tensor weights, int block_size, "
      "ScalarType dtype) -> Tensor[]");
  // The same into out (T tensors of dtype shaped as values[t]): a server that keeps its
  // output buffers pays no page faults for fresh ones.
  m.def(
      "dequantize_weighted_sum.out(Tensor[] values, Tensor[] scales, Tensor weights, "
      "int block_size, ScalarType dtype, *, Tensor(a!)[] out) -> ()");
}

// ---------------------------------------------------------------- Quantized updates: 4-bit, fp8
// The same method in the two smaller formats (docs/algorithms/quantized.md), same host side
// and kernel files.
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // quantize_int8 with levels [-7, 7] (s = max|v| / 7; block_size even) packed two a byte:
  // values[t] is uint8 [ceil(n / 2)], element 2j in the low nibble of byte j and 2j + 1 in the
  // high one, each a 4-bit two's complement level (a padding nibble 0 after an odd n).
  m.def(
      "quantize_int4(Tensor[] x, Tensor[] residual, int block_size, bool stochastic, int seed, "
      "int offset) -> (Tensor[], Tensor[], Tensor[])");
  // dequantize_weighted_sum of packed 4-bit values; numels[t]: tensor t's element count.
  // Results are 1-D [numels[t]] (out tensors: any shape of numels[t] elements, C order).
  m.def(
      "dequantize_int4_weighted_sum(Tensor[] values, Tensor[] scales, Tensor weights, "
      "int block_size, int[] numels, ScalarType dtype) -> Tensor[]");
  m.def(
      "dequantize_int4_weighted_sum.out(Tensor[] values, Tensor[] scales, Tensor weights, "
      "int block_size, int[] numels, ScalarType dtype, *, Tensor(a!)[] out) -> ()");
  // fp8 e4m3fn with one float32 scale per tensor: s = max|v| / 448 over the tensor (0 for an
  // all-zero or empty tensor, NaN with a NaN or inf: values 0), q = v / s saturated to
  // [-448, 448], rounded to the e4m3 grid to nearest (ties to even) or stochastically (up iff
  // u < the fractional distance between the two neighbouring values; u as quantize_int8's).
  m.def(
      "quantize_fp8(Tensor[] x, Tensor[] residual, bool stochastic, int seed, int offset) -> "
      "(Tensor[], Tensor[], Tensor[])");
  // out_t = sum_k (w_k s_kt) float(q_kt), float32 in client order, scales[i] of shape [1].
  m.def(
      "dequantize_fp8_weighted_sum(Tensor[] values, Tensor[] scales, Tensor weights, "
      "ScalarType dtype) -> Tensor[]");
  m.def(
      "dequantize_fp8_weighted_sum.out(Tensor[] values, Tensor[] scales, Tensor weights, "
      "ScalarType dtype, *, Tensor(a!)[] out) -> ()");
}

// ---------------------------------------------------------------- Secure aggregation
// The protocol: docs/algorithms/secagg.md. Host side: csrc/secagg_host.h; kernels:
// csrc/cpu/secagg.cpp, csrc/cuda/secagg.cu; Philox and the fixed-point code:
// csrc/ring_masks.h. Integers mod 2^32, stored as int32.
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // Client: out_t = code(x_t) + sum_m s_m G_m  (mod 2^32), one pass. code(v) = round(clamp(v,
  // -clip, clip) * scale) in float64 (NaN -> 0), to nearest (ties to even) or stochastically,
  // floor(w + word 2^-32) with word e of the stream (seed, offset). G_m(e) = word e % 4 of the
  // Philox-4x32-10 block (key_m, subsequence e / 4, offset_m), mask_seeds[m] = (key_m,
  // offset_m) (int64 [M, 2]), s_m = mask_signs[m] (+1 or -1); e counts over the whole list.
  m.def(
      "secagg_mask(Tensor[] x, float clip, float scale, bool stochastic, int seed, int offset, "
      "Tensor mask_seeds, int[] mask_signs) -> Tensor[]");
  // Server: out_t = sum_k y_kt - sum_m s_m G_m  (mod 2^32) over K = num_clients clients given
  // client-major (masked[k * T + t], int32), one pass; G_m as in secagg_mask.
  m.def(
      "secagg_unmask_sum(Tensor[] masked, int num_clients, Tensor mask_seeds, int[] mask_signs) "
      "-> Tensor[]");
}

// ---------------------------------------------------------------- Sparse updates
// The method: docs/algorithms/sparse.md. Host side: csrc/sparse_host.h; kernels:
// csrc/cpu/sparse.cpp, csrc/cuda/sparse.cu; per-element math: SparseMath in csrc/elementwise.h.
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // K = weights.numel() clients' (index, value) lists of T tensors, given client-major:
  // indices[k * T + t] (int32 or int64, the same for all; flat C-order positions in tensor t,
  // strictly increasing, in [0, numel)) and values[k * T + t] (1-D, as many, tensor t's dtype).
  //   out_t[e] = base_t[e] + w_0 v_0t[e] + w_1 v_1t[e] + ...   (clients in order, absent = no
  // term), accumulated in float32 (float64 for float64), no fused multiply-add, no atomics.
  m.def(
      "sparse_weighted_sum(Tensor[] base, Tensor[] indices, Tensor[] values, Tensor weights) "
      "-> Tensor[]");
  // The same into out (base = []: from zeros, out's shapes and dtypes).
  m.def(
      "sparse_weighted_sum.out(Tensor[] base, Tensor[] indices, Tensor[] values, "
      "Tensor weights, *, Tensor(a!)[] out) -> ()");
  // In place into base (the dense global model).
  m.def(
      "sparse_weighted_sum_(Tensor(a!)[] base, Tensor[] indices, Tensor[] values, "
      "Tensor weights) -> ()");
}

// ---------------------------------------------------------------- autograd of the mutating ops
// The in-place and out= overloads have no derivative formula (the functional ops carry them,
// registered from Python). The two kernels below give them what PyTorch's own in-place ops
// have. ADInplaceOrView: the written tensors' version counters advance, so a graph that saved one
// of them refuses to run backward on the overwritten values (PyTorch's stock kernel for this key
// counts only written returns; these ops write their arguments). Autograd: with grad mode on, a
// tensor that requires grad is refused, since the op cannot carry its gradient (without the
// check the result would silently leave the graph).
namespace {

constexpr const char* kMutatingOps[] = {
    "weighted_sum.out", "weighted_sum_", "sgld_step_", "sgld_compose_step_",
    "coordinate_median.out", "trimmed_mean.out", "median_window_mean.out", "private_sum.out",
    "private_sum_", "superfed_sgd_step_", "dequantize_weighted_sum.out",
    "dequantize_int4_weighted_sum.out", "dequantize_fp8_weighted_sum.out",
    // sparse updates
    "sparse_weighted_sum.out", "sparse_weighted_sum_",
};

// Calls f(t, i, j) for every defined tensor of the arguments i for which keep(i) holds: i the
// argument's index, j the tensor's position in a list argument (-1 for a single tensor).
// Nothing is copied or formatted: this runs on every call.
template <typename Keep, typename F>
void for_each_tensor_argument(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                              Keep&& keep, F&& f) {
  const size_t n = schema.arguments().size();
  const size_t start = stack.size() - n;
  for (size_t i = 0; i < n; ++i) {
    if (!keep(i)) continue;
    const c10::IValue& v = stack[start + i];
    if (v.isTensor()) {
      if (v.toTensor().defined()) f(v.toTensor(), i, int64_t{-1});
    } else if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        const at::Tensor& t = list[j];
        if (t.defined()) f(t, i, static_cast<int64_t>(j));
      }
    }
  }
}

void bump_written_versions(
    const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  std::vector<at::Tensor> written;
  for_each_tensor_argument(
      schema, *stack,  // only the written arguments: the inputs can be thousands of tensors
      [&](size_t i) { return schema.is_mutable({c10::SchemaArgType::input, i}); },
      [&](const at::Tensor& t, size_t, int64_t) { written.push_back(t); });
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
}

void refuse_gradients(
    const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (c10::GradMode::is_enabled()) {
    const auto& schema = op.schema();
    for_each_tensor_argument(
        schema, *stack, [](size_t) { return true; }, [&](const at::Tensor& t, size_t i, int64_t j) {
          if (!t.requires_grad()) return;
          const std::string name = c10::str(
              "fedkernels.", schema.name().substr(schema.name().find("::") + 2),
              schema.overload_name().empty() ? "" : ".", schema.overload_name());
          const std::string& arg = schema.arguments()[i].name();
          const std::string where = j < 0 ? arg : c10::str(arg, "[", j, "]");
          const bool written = schema.is_mutable({c10::SchemaArgType::input, i});
          TORCH_CHECK(
              !(written && t.is_leaf()), name, ": ", where,
              " is a leaf tensor that requires grad, and the op writes it in place (as "
              "PyTorch's in-place ops, this needs torch.no_grad())");
          TORCH_CHECK(
              false, name, ": ", where,
              " requires grad, but this op writes its result in place or into out= and has no "
              "derivative; use the functional form for gradients, or torch.no_grad()");
        });
  }
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, ADInplaceOrView, m) {
  for (const char* op : kMutatingOps) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
  }
}

TORCH_LIBRARY_IMPL(fedkernels, Autograd, m) {
  for (const char* op : kMutatingOps) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse_gradients>());
  }
}
