// Host side of the secure-aggregation ops (secagg_mask, secagg_unmask_sum; schemas in
// csrc/ops.cpp), shared by the CPU and CUDA backends: validation (nothing is written before it
// passes), output allocation, and the lists of pointers and mask seeds the kernels walk.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace fedkernels {

// One mask the pass adds (or, negate, subtracts): the words of the Philox stream (key, offset).
struct RingMask {
  uint64_t key, offset;
  bool negate;
};

// The kernels' view of a call. Client (secagg_mask): x holds the T tensors to
// encode (of any float dtypes). Server (secagg_unmask_sum): x holds K * T int32 tensors,
// client-major.
struct RingList {
  std::vector<at::ScalarType> dtypes;  // of the client's x tensors
  at::Device device{at::kCPU};
  double clip = 0, scale = 0;
  bool stochastic = false;
  uint64_t seed = 0, offset = 0;
  int64_t K = 1, T = 0;
  std::vector<const void*> x;
  std::vector<uint32_t*> outs;
  std::vector<int64_t> numels, first;  // first: index of the tensor's first element in the list
  std::vector<RingMask> masks;
  int64_t total() const {
    int64_t n = 0;
    for (const auto v : numels) n += v;
    return n;
  }
};

using RingRunner = void (*)(RingList&);

// The M seeds (int64 [M, 2]: key, offset; on the CPU or the data's device) and their signs
// (+1 or -1); subtract flips every sign (the server removes what the clients added).
inline std::vector<RingMask> checked_masks(const char* op, const at::Tensor& seeds,
                                           at::IntArrayRef signs, at::Device device,
                                           bool subtract) {
  check_device(op, seeds, device, true, "mask_seeds");
  TORCH_CHECK_TYPE(seeds.scalar_type() == at::kLong, "fedkernels.", op,
                   ": mask_seeds must be int64, got ", seeds.scalar_type());
  TORCH_CHECK_VALUE(seeds.dim() == 2 && seeds.size(1) == 2, "fedkernels.", op,
                    ": mask_seeds must be [M, 2] (key, offset), got shape ", seeds.sizes());
  const int64_t M = seeds.size(0);
  TORCH_CHECK_VALUE(static_cast<int64_t>(signs.size()) == M, "fedkernels.", op, ": ",
                    signs.size(), " mask_signs for ", M, " mask_seeds");
  const at::Tensor s = seeds.to(at::kCPU).contiguous();
  const int64_t* p = s.const_data_ptr<int64_t>();
  std::vector<RingMask> out;
  for (const auto m : c10::irange(M)) {
    TORCH_CHECK_VALUE(signs[m] == 1 || signs[m] == -1, "fedkernels.", op, ": mask_signs[", m,
                      "] must be 1 or -1, got ", signs[m]);
    out.push_back({static_cast<uint64_t>(p[2 * m]), static_cast<uint64_t>(p[2 * m + 1]),
                   (signs[m] < 0) != subtract});
  }
  return out;
}

// The largest clip * scale: a code and a sum of a few of them stay clear of 2^31.
constexpr double kMaxRingCode = 2147483647.0;

inline std::vector<at::Tensor> secagg_mask_host(
    at::TensorList x, double clip, double scale, bool stochastic, int64_t seed, int64_t offset,
    const at::Tensor& mask_seeds, at::IntArrayRef mask_signs, RingRunner runner,
    EmptyFn empty = &plain_empty) {
  const char* op = "secagg_mask";
  check_finite_positive(op, "clip", clip);
  check_finite_positive(op, "scale", scale);
  TORCH_CHECK_VALUE(clip * scale <= kMaxRingCode, "fedkernels.", op,
                    ": clip * scale must be at most 2^31 - 1 (codes are int32), got ",
                    clip * scale);
  const int64_t T = static_cast<int64_t>(x.size());
  const at::Device device = T ? x[0].device() : mask_seeds.device();
  for (const auto t : c10::irange(T)) {
    check_supported_float(op, x[t].scalar_type(), "x tensor ", t);
    check_device(op, x[t], device, false, "x tensor ", t);
  }
  const auto masks = checked_masks(op, mask_seeds, mask_signs, device, false);
  std::vector<at::Tensor> out;
  RingList l;
  l.device = device;
  l.clip = clip;
  l.scale = scale;
  l.stochastic = stochastic;
  l.seed = static_cast<uint64_t>(seed);
  l.offset = static_cast<uint64_t>(offset);
  l.masks = masks;
  l.T = T;
  DenseBuffers dense;
  int64_t first = 0;
  for (const auto t : c10::irange(T)) {
    out.push_back(empty(x[t].sizes(), x[t].options().dtype(at::kInt)));
    l.dtypes.push_back(x[t].scalar_type());
    l.x.push_back(dense.in(x[t]));
    l.outs.push_back(static_cast<uint32_t*>(out.back().data_ptr()));
    l.numels.push_back(x[t].numel());
    l.first.push_back(first);
    first += x[t].numel();
  }
  if (first > 0) runner(l);
  return out;
}

inline std::vector<at::Tensor> secagg_unmask_sum_host(
    at::TensorList masked, int64_t num_clients, const at::Tensor& mask_seeds,
    at::IntArrayRef mask_signs, RingRunner runner, EmptyFn empty = &plain_empty) {
  const char* op = "secagg_unmask_sum";
  TORCH_CHECK_VALUE(num_clients >= 1, "fedkernels.", op, ": num_clients must be >= 1, got ",
                    num_clients);
  const int64_t n = static_cast<int64_t>(masked.size());
  TORCH_CHECK_VALUE(n % num_clients == 0, "fedkernels.", op, ": ", n,
                    " masked tensors for num_clients = ", num_clients,
                    " (expected K * T, client-major)");
  const int64_t T = n / num_clients;
  const at::Device device = n ? masked[0].device() : mask_seeds.device();
  for (const auto i : c10::irange(n)) {
    const int64_t k = i / T, t = i % T;
    check_device(op, masked[i], device, false, "masked tensor ", i);
    TORCH_CHECK_TYPE(masked[i].scalar_type() == at::kInt, "fedkernels.", op, ": masked tensor ",
                     i, " (client ", k, ", tensor ", t, ") has dtype ", masked[i].scalar_type(),
                     ", expected int32");
    TORCH_CHECK_VALUE(masked[i].sizes() == masked[t].sizes(), "fedkernels.", op,
                      ": masked tensor ", i, " (client ", k, ", tensor ", t, ") has shape ",
                      masked[i].sizes(), ", client 0's has ", masked[t].sizes());
  }
  RingList l;
  l.device = device;
  l.K = num_clients;
  l.T = T;
  l.masks = checked_masks(op, mask_seeds, mask_signs, device, true);
  std::vector<at::Tensor> out;
  DenseBuffers dense;
  for (const auto i : c10::irange(n)) l.x.push_back(dense.in(masked[i]));
  int64_t first = 0;
  for (const auto t : c10::irange(T)) {
    out.push_back(empty(masked[t].sizes(), masked[t].options()));
    l.outs.push_back(static_cast<uint32_t*>(out.back().data_ptr()));
    l.numels.push_back(masked[t].numel());
    l.first.push_back(first);
    first += masked[t].numel();
  }
  if (first > 0) runner(l);
  return out;
}

// Registers the secure-aggregation ops of one backend, whose kernels are
// Kernels::mask(RingList&) and Kernels::unmask_sum(RingList&).
template <typename Kernels>
void register_secagg(torch::Library& m) {
  m.impl("secagg_mask",
         [](at::TensorList x, double clip, double scale, bool stochastic, int64_t seed,
            int64_t offset, const at::Tensor& mask_seeds, at::IntArrayRef mask_signs) {
           return secagg_mask_host(x, clip, scale, stochastic, seed, offset, mask_seeds,
                                   mask_signs, &Kernels::mask, empty_of<Kernels>());
         });
  m.impl("secagg_unmask_sum",
         [](at::TensorList masked, int64_t num_clients, const at::Tensor& mask_seeds,
            at::IntArrayRef mask_signs) {
           return secagg_unmask_sum_host(masked, num_clients, mask_seeds, mask_signs,
                                         &Kernels::unmask_sum, empty_of<Kernels>());
         });
}

}  // namespace fedkernels
