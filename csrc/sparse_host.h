// Host side of the sparse-update op (sparse_weighted_sum and its .out and in-place forms;
// schemas in csrc/ops.cpp), shared by the CPU and CUDA backends: validation of the shapes,
// dtypes and devices, then of every index list (nothing is written before both pass), output
// allocation, and the pointer lists the kernels walk.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace fedkernels {

// The K clients' lists of one call and its outputs: the kernels' view.
struct SparseSumList {
  at::ScalarType dtype;        // of base, values and outputs
  at::ScalarType index_dtype;  // int32 or int64
  at::Device device{at::kCPU};
  int64_t K = 0, T = 0;
  std::vector<const void*> base;  // [T]; empty: the sum starts from zeros
  std::vector<void*> outs;        // [T]; may equal base (in place)
  std::vector<const void*> indices, values;  // client-major, [k * T + t]
  std::vector<int64_t> nnz;                  // entries of list k * T + t
  std::vector<int64_t> numels;               // [T]
  std::vector<double> weights;               // [K], cast to the accumulate type by the kernels
};

// Index of the first list (k * T + t order) whose indices are not strictly increasing within
// [0, numel), or -1: a backend's check of the index contents.
using SparseCheck = int64_t (*)(const SparseSumList&);
using SparseRunner = void (*)(SparseSumList&);

// Position of the first bad entry of one list on the host, or -1: an index outside
// [0, numel), or not greater than the one before it.
template <typename I>
inline int64_t first_bad_index(const I* idx, int64_t n, int64_t numel) {
  I prev = -1;
  for (int64_t j = 0; j < n; ++j) {
    const I v = idx[j];
    if (v < 0 || static_cast<int64_t>(v) >= numel || v <= prev) return j;
    prev = v;
  }
  return -1;
}

// Raises the error of list i (known bad), read on the host: out of range, duplicate, or out
// of order, naming the client, the tensor, the position and the index.
inline void raise_bad_indices(const char* op, const at::Tensor& indices, int64_t i, int64_t T,
                              int64_t numel) {
  const at::Tensor idx = indices.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = idx.const_data_ptr<int64_t>();
  const int64_t j = first_bad_index(p, idx.numel(), numel);
  TORCH_INTERNAL_ASSERT(j >= 0, "fedkernels.", op, ": index check disagrees with the host");
  const std::string where = c10::str("indices tensor ", i, " (client ", i / T, ", tensor ", i % T,
                                     ") at position ", j);
  TORCH_CHECK_VALUE(p[j] >= 0 && p[j] < numel, "fedkernels.", op, ": ", where, " holds index ",
                    p[j], ", out of range [0, ", numel, ")");
  TORCH_CHECK_VALUE(p[j] != p[j - 1], "fedkernels.", op, ": ", where, " repeats index ", p[j],
                    " (duplicate indices are not summed; merge them on the client)");
  TORCH_CHECK_VALUE(false, "fedkernels.", op, ": ", where, " holds index ", p[j], " after ",
                    p[j - 1], " (indices must be strictly increasing: sort each list by index)");
}

// The index dtypes as the Python API names them.
inline std::string index_dtype_name(at::ScalarType t) {
  return t == at::kInt ? "int32" : t == at::kLong ? "int64" : std::string(c10::toString(t));
}

// base: the dense tensors added to (empty only for .out); out_given: .out's outputs; in_place:
// the result goes into base. Returns the fresh outputs of the functional form.
inline std::vector<at::Tensor> sparse_weighted_sum_host(
    const char* op, at::TensorList base, at::TensorList indices, at::TensorList values,
    const at::Tensor& weights, at::TensorList out_given, bool check_out, bool in_place,
    SparseCheck check, SparseRunner runner, EmptyFn empty = &plain_empty) {
  const bool from_zeros = check_out && base.empty();
  at::TensorList shapes = from_zeros ? out_given : base;  // what gives the T tensors
  const int64_t T = static_cast<int64_t>(shapes.size());
  TORCH_CHECK_VALUE(
      weights.dim() == 1 && weights.numel() >= 1, "fedkernels.", op,
      ": weights must be 1-D [K] with K >= 1, got shape ", weights.sizes());
  TORCH_CHECK_TYPE(
      at::isFloatingType(weights.scalar_type()), "fedkernels.", op,
      ": weights must be floating point, got ", weights.scalar_type());
  const int64_t K = weights.numel();
  if (check_out && !from_zeros) {
    TORCH_CHECK_VALUE(
        static_cast<int64_t>(out_given.size()) == T, "fedkernels.", op, ": out has ",
        out_given.size(), " tensors, base has ", T);
  }
  const int64_t n = static_cast<int64_t>(indices.size());
  TORCH_CHECK_VALUE(
      n == K * T, "fedkernels.", op, ": ", n, " indices tensors for K = ", K, " clients and T = ",
      T, " tensors (expected K * T, client-major)");
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(values.size()) == n, "fedkernels.", op, ": ", values.size(),
      " values tensors for ", n, " indices tensors (expected one per indices tensor)");
  if (T == 0) return {};
  const at::Device device = shapes[0].device();
  const char* tname = from_zeros ? "out tensor " : "base tensor ";
  for (const auto t : c10::irange(T)) {
    check_supported_float(op, shapes[t].scalar_type(), tname, t);
    check_device(op, shapes[t], device, false, tname, t);
    if (check_out && !from_zeros) {
      check_device(op, out_given[t], device, false, "out tensor ", t);
      TORCH_CHECK_TYPE(
          out_given[t].scalar_type() == base[t].scalar_type(), "fedkernels.", op, ": out tensor ",
          t, " has dtype ", out_given[t].scalar_type(), ", base tensor ", t, " has ",
          base[t].scalar_type());
      TORCH_CHECK_VALUE(
          out_given[t].sizes() == base[t].sizes(), "fedkernels.", op, ": out tensor ", t,
          " has shape ", out_given[t].sizes(), ", base tensor ", t, " has ", base[t].sizes());
    }
  }
  const at::ScalarType index_dtype = indices[0].scalar_type();
  TORCH_CHECK_TYPE(
      index_dtype == at::kInt || index_dtype == at::kLong, "fedkernels.", op,
      ": indices tensor 0 has dtype ", index_dtype_name(index_dtype),
      ", expected int32 or int64");
  for (const auto i : c10::irange(n)) {
    const int64_t k = i / T, t = i % T;
    check_device(op, indices[i], device, false, "indices tensor ", i);
    check_device(op, values[i], device, false, "values tensor ", i);
    TORCH_CHECK_TYPE(
        indices[i].scalar_type() == index_dtype, "fedkernels.", op, ": indices tensor ", i,
        " (client ", k, ", tensor ", t, ") has dtype ", index_dtype_name(indices[i].scalar_type()),
        ", indices tensor 0 has ", index_dtype_name(index_dtype));
    TORCH_CHECK_TYPE(
        values[i].scalar_type() == shapes[t].scalar_type(), "fedkernels.", op, ": values tensor ",
        i, " (client ", k, ", tensor ", t, ") has dtype ", values[i].scalar_type(), ", ", tname,
        t, " has ", shapes[t].scalar_type());
    TORCH_CHECK_VALUE(
        indices[i].dim() == 1 && values[i].dim() == 1 &&
            values[i].numel() == indices[i].numel(),
        "fedkernels.", op, ": indices and values tensors ", i, " (client ", k, ", tensor ", t,
        ") must be 1-D of one length, got shapes ", indices[i].sizes(), " and ",
        values[i].sizes());
  }
  const bool written_given = check_out || in_place;
  if (written_given) {
    at::TensorList written = in_place ? base : out_given;
    std::vector<const at::Tensor*> tensors;
    for (const auto& o : written) tensors.push_back(&o);
    if (check_out) {
      for (const auto& b : base) tensors.push_back(&b);
    }
    for (const auto& x : indices) tensors.push_back(&x);
    for (const auto& x : values) tensors.push_back(&x);
    const int64_t n_base = check_out ? static_cast<int64_t>(base.size()) : 0;
    check_written_apart(
        op, tensors, T,
        [&](int64_t i) {
          if (i < T) return std::string(in_place ? "base tensor " : "out tensor ") +
              std::to_string(i);
          i -= T;
          if (i < n_base) return "base tensor " + std::to_string(i);
          i -= n_base;
          if (i < n) return "indices tensor " + std::to_string(i);
          return "values tensor " + std::to_string(i - n);
        },
        "", "");
  }
  SparseSumList l;
  l.dtype = shapes[0].scalar_type();
  for (const auto t : c10::irange(T)) {
    TORCH_CHECK_TYPE(
        shapes[t].scalar_type() == l.dtype, "fedkernels.", op, ": ", tname, t, " has dtype ",
        shapes[t].scalar_type(), ", ", tname, "0 has ", l.dtype,
        " (one dtype per call)");
  }
  l.index_dtype = index_dtype;
  l.device = device;
  l.K = K;
  l.T = T;
  if (!weights.device().is_cpu()) check_device(op, weights, device, false, "weights");
  const at::Tensor w = weights.to(at::kCPU, at::kDouble).contiguous();
  for (const auto k : c10::irange(K)) {
    const double wk = w.const_data_ptr<double>()[k];
    TORCH_CHECK_VALUE(std::isfinite(wk), "fedkernels.", op, ": weight of client ", k, " is ", wk);
    l.weights.push_back(wk);
  }
  DenseBuffers dense;
  for (const auto i : c10::irange(n)) {
    l.indices.push_back(dense.in(indices[i]));
    l.values.push_back(dense.in(values[i]));
    l.nnz.push_back(indices[i].numel());
  }
  for (const auto t : c10::irange(T)) l.numels.push_back(shapes[t].numel());
  const int64_t bad = check(l);
  if (bad >= 0) raise_bad_indices(op, indices[bad], bad, T, l.numels[bad % T]);
  std::vector<at::Tensor> out;
  for (const auto t : c10::irange(T)) {
    if (!from_zeros) l.base.push_back(dense.in(base[t]));
    if (in_place) {
      l.outs.push_back(dense.out(base[t]));
    } else if (check_out) {
      l.outs.push_back(dense.out(out_given[t]));
    } else {
      out.push_back(empty(base[t].sizes(), base[t].options()));
      l.outs.push_back(out.back().data_ptr());
    }
  }
  int64_t total = 0;
  for (const auto numel : l.numels) total += numel;
  if (total > 0) runner(l);
  dense.finish();
  return out;
}

template <typename Kernels>
int64_t check_sparse_list(const SparseSumList& l) {
  if (l.index_dtype == at::kInt) return Kernels::template check<int32_t>(l);
  return Kernels::template check<int64_t>(l);
}

template <typename Kernels>
void run_sparse_list(SparseSumList& l) {
  dispatch_float(l.dtype, "sparse_weighted_sum", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (l.index_dtype == at::kInt) {
      Kernels::template sum<T, int32_t>(l);
    } else {
      Kernels::template sum<T, int64_t>(l);
    }
  });
}

// Registers the sparse-update op of one backend (CPU, CUDA), whose kernels are the templates
// Kernels::check<I>(const SparseSumList&) (I: the index type; the first bad list or -1) and
// Kernels::sum<T, I>(SparseSumList&) (T: the dense dtype).
template <typename Kernels>
void register_sparse(torch::Library& m) {
  m.impl(
      "sparse_weighted_sum",
      [](at::TensorList base, at::TensorList indices, at::TensorList values,
         const at::Tensor& weights) {
        return sparse_weighted_sum_host(
            "sparse_weighted_sum", base, indices, values, weights, {}, false, false,
            &check_sparse_list<Kernels>, &run_sparse_list<Kernels>, empty_of<Kernels>());
      });
  m.impl(
      "sparse_weighted_sum.out",
      [](at::TensorList base, at::TensorList indices, at::TensorList values,
         const at::Tensor& weights, at::TensorList out) {
        sparse_weighted_sum_host(
            "sparse_weighted_sum.out", base, indices, values, weights, out, true, false,
            &check_sparse_list<Kernels>, &run_sparse_list<Kernels>);
      });
  m.impl(
      "sparse_weighted_sum_",
      [](at::TensorList base, at::TensorList indices, at::TensorList values,
         const at::Tensor& weights) {
        sparse_weighted_sum_host(
            "sparse_weighted_sum_", base, indices, values, weights, {}, false, true,
            &check_sparse_list<Kernels>, &run_sparse_list<Kernels>);
      });
}

}  // namespace fedkernels
