// The output pool: fresh CPU results of the allocating ops come from blocks that earlier results
// gave back when their storage was freed, so a server that aggregates every round and drops the
// previous global model writes into memory whose pages are already faulted in, instead of
// paying a first-touch fault per 4 KiB page of a fresh allocation. A block is reused only
// after its storage is freed, so a live tensor's memory is never handed out twice.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>

namespace fedkernels {

// Results smaller than this come from PyTorch's allocator: malloc serves them from its heap,
// whose pages stay faulted in between calls.
constexpr int64_t kPooledMinBytes = int64_t{256} << 10;

// An uninitialised contiguous CPU tensor, from the pool when it is at least kPooledMinBytes and
// the pool is on (a limit above 0), else at::empty.
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace fedkernels
