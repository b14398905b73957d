// The device-side tables of one ClientListPlan (csrc/robust_host.h) for the robust and DP
// kernels: client-major input pointers, base and out pointers, numels, the chunk prefix, each
// tensor's first element in the model and the K coefficients, uploaded once per launch
// (LaunchMetadata, csrc/cuda/multi_tensor.cuh).
#pragma once

#include <cstdint>
#include <memory>

#include "../robust_host.h"
#include "multi_tensor.cuh"

namespace fedkernels {

struct ClientListTables {
  const uint64_t* inputs;   // [K][n]
  const uint64_t* bases;    // [n] or null
  const uint64_t* outs;     // [n] or null
  const int64_t* numels;    // [n]
  const int64_t* prefix;    // [n + 1] chunk prefix
  const int64_t* offsets;   // [n]
  const double* coefficients;  // [K] or null
  int64_t K, n, total_chunks;

  __device__ __forceinline__ const void* input(int64_t k, int64_t t) const {
    return reinterpret_cast<const void*>(inputs[k * n + t]);
  }
};

// Fills and uploads the tables of plan p for chunks of `chunk` elements; `meta` keeps the
// device buffer alive until the call's kernels are queued.
inline ClientListTables upload_tables(
    const ClientListPlan& p, int64_t chunk, cudaStream_t stream,
    std::unique_ptr<LaunchMetadata>& meta) {
  const int64_t K = p.K, n = p.num_tensors();
  const bool coef = p.coefficients.defined();
  MetadataLayout layout;
  const size_t inputs_at = layout.add<uint64_t>(K * n);
  const size_t bases_at = layout.add<uint64_t>(p.bases.empty() ? 0 : n);
  const size_t outs_at = layout.add<uint64_t>(p.outs.empty() ? 0 : n);
  const size_t numels_at = layout.add<int64_t>(n);
  const size_t prefix_at = layout.add<int64_t>(n + 1);
  const size_t offsets_at = layout.add<int64_t>(n);
  const size_t coef_at = layout.add<double>(coef ? K : 0);
  meta = std::make_unique<LaunchMetadata>(layout, p.device);
  auto* h_inputs = meta->host<uint64_t>(inputs_at);
  for (int64_t i = 0; i < K * n; ++i) h_inputs[i] = reinterpret_cast<uint64_t>(p.inputs[i]);
  if (!p.bases.empty()) {
    auto* h = meta->host<uint64_t>(bases_at);
    for (int64_t t = 0; t < n; ++t) h[t] = reinterpret_cast<uint64_t>(p.bases[t]);
  }
  if (!p.outs.empty()) {
    auto* h = meta->host<uint64_t>(outs_at);
    for (int64_t t = 0; t < n; ++t) h[t] = reinterpret_cast<uint64_t>(p.outs[t]);
  }
  auto* h_numels = meta->host<int64_t>(numels_at);
  auto* h_offsets = meta->host<int64_t>(offsets_at);
  for (int64_t t = 0; t < n; ++t) {
    h_numels[t] = p.numels[t];
    h_offsets[t] = p.offsets[t];
  }
  const int64_t total = fill_chunk_prefix(p.numels.data(), n, chunk, meta->host<int64_t>(prefix_at));
  if (coef) {
    const double* c = p.coefficients.const_data_ptr<double>();
    auto* h = meta->host<double>(coef_at);
    for (int64_t k = 0; k < K; ++k) h[k] = c[k];
  }
  meta->upload(stream);
  ClientListTables tables;
  tables.inputs = meta->device<uint64_t>(inputs_at);
  tables.bases = p.bases.empty() ? nullptr : meta->device<uint64_t>(bases_at);
  tables.outs = p.outs.empty() ? nullptr : meta->device<uint64_t>(outs_at);
  tables.numels = meta->device<int64_t>(numels_at);
  tables.prefix = meta->device<int64_t>(prefix_at);
  tables.offsets = meta->device<int64_t>(offsets_at);
  tables.coefficients = coef ? meta->device<double>(coef_at) : nullptr;
  tables.K = K;
  tables.n = n;
  tables.total_chunks = total;
  return tables;
}

}  // namespace fedkernels
