// The layout of a multi-tensor pass, shared by the CPU and CUDA kernels (plain C++, so that a
// test can compile it alone):
//
// * chunks: a list of n non-empty tensors, tensor i of numels[i] elements, is cut into chunks
//   of `chunk` elements, the unit of parallel work (a parallel_for item on the CPU, a block on
//   the GPU); tensor i owns chunks [prefix[i], prefix[i + 1]);
// * launch metadata (CUDA): the per-launch tables (pointers, numels, the chunk prefix, ...) are
//   sections of one byte buffer, each 8-byte aligned, uploaded to the device once per launch
//   (the multi_tensor_apply idea with a device-side table, so the number of tensors and of
//   clients is not capped by the 4 KiB of kernel parameters). Under CUDA graph capture the
//   buffer is written by kernels that carry it in their parameters, kMetadataBlockWords words
//   at a time, so the graph owns its copy (see csrc/cuda/multi_tensor.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include "host_device.h"

namespace fedkernels {

inline int64_t chunks_of(int64_t numel, int64_t chunk) {
  return (numel + chunk - 1) / chunk;
}

// prefix[0..n] of the chunk counts of n tensors; returns the total number of chunks.
inline int64_t fill_chunk_prefix(const int64_t* numels, int64_t n, int64_t chunk, int64_t* prefix) {
  prefix[0] = 0;
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + chunks_of(numels[i], chunk);
  return prefix[n];
}

// The tensor that owns chunk c: the last t with prefix[t] <= c (no tensor is empty, so the
// prefix is strictly increasing).
FEDKERNELS_HD int64_t tensor_of_chunk(const int64_t* prefix, int64_t n, int64_t c) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The byte offsets of a launch's metadata sections, in the order they are added.
class MetadataLayout {
 public:
  // Reserves count values of type V; returns the section's byte offset (a multiple of 8).
  template <typename V>
  size_t add(int64_t count) {
    static_assert(alignof(V) <= 8, "sections are 8-byte aligned");
    const size_t at = bytes_;
    bytes_ += round_up8(sizeof(V) * static_cast<size_t>(count));
    return at;
  }
  size_t bytes() const { return bytes_; }
  size_t words() const { return bytes_ / 8; }

  static size_t round_up8(size_t bytes) { return (bytes + 7) / 8 * 8; }

 private:
  size_t bytes_ = 0;
};

// 64-bit words of metadata one capture-safe upload kernel carries in its parameters (4000
// bytes: with the destination and the count, under the 4 KiB parameter limit of every GPU).
constexpr int64_t kMetadataBlockWords = 500;

// Calls fn(first word, number of words) for each block of an upload of `words` words.
template <typename Fn>
void for_each_metadata_block(int64_t words, Fn fn) {
  for (int64_t first = 0; first < words; first += kMetadataBlockWords) {
    fn(first, words - first < kMetadataBlockWords ? words - first : kMetadataBlockWords);
  }
}

}  // namespace fedkernels
