// The parallel loop of the CPU multi-tensor kernels: every chunk of every tensor of a list
// (layout in csrc/multi_tensor.h) is one work item of at::parallel_for, or the whole list runs
// on the calling thread when the pass touches few bytes (csrc/cpu/parallel.h). A chunk's result
// never depends on which thread ran it, so the output is the same for any number of threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../multi_tensor.h"
#include "parallel.h"

namespace fedkernels {

// Elements [begin, end) of tensor `tensor` of the list.
struct ChunkRange {
  int64_t tensor, begin, end;
};

// Calls fn(chunk index, range) for every chunk of tensors of numels[i] elements, chunk
// elements a chunk; `bytes` is what the whole pass reads and writes, at `cost` (parallel.h).
template <typename Fn>
void for_each_chunk(const std::vector<int64_t>& numels, int64_t chunk, int64_t bytes,
                    PassCost cost, Fn fn) {
  const int64_t n = static_cast<int64_t>(numels.size());
  std::vector<int64_t> prefix(n + 1);
  const int64_t total = fill_chunk_prefix(numels.data(), n, chunk, prefix.data());
  auto body = [&](int64_t c0, int64_t c1) {
    int64_t i = tensor_of_chunk(prefix.data(), n, c0);
    for (int64_t c = c0; c < c1; ++c) {
      while (c >= prefix[i + 1]) ++i;
      const int64_t begin = (c - prefix[i]) * chunk;
      fn(c, ChunkRange{i, begin, std::min(numels[i], begin + chunk)});
    }
  };
  parallel_for_bytes(0, total, 1, bytes, cost, body);
}

// A flag is not a byte count: it would turn every pass serial.
template <typename Fn>
void for_each_chunk(const std::vector<int64_t>&, int64_t, bool, PassCost, Fn) = delete;

inline int64_t total_numel(const std::vector<int64_t>& numels) {
  int64_t total = 0;
  for (const auto n : numels) total += n;
  return total;
}

// Elements per chunk of a pass over `total` elements: at most max_chunk, a multiple of align,
// and small enough for about chunks_wanted chunks. at::parallel_for gives each thread an equal
// run of chunk indices, not of work: a large weight and its bias as two chunks (one tiny) would
// leave one thread all the work. The size depends on the sizes alone, so a pass whose chunks
// keep partial sums gives the same values for any number of threads.
inline int64_t balanced_chunk(int64_t total, int64_t max_chunk, int64_t align,
                              int64_t chunks_wanted = 32) {
  const int64_t want = (total / chunks_wanted + align - 1) / align * align;
  return std::clamp(want, align, max_chunk);
}

}  // namespace fedkernels
