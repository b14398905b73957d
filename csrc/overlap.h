// The memory checks of the tensors an op writes, one implementation for every op family: a
// written tensor must hold one element of memory each, and share no byte with another written
// tensor nor with a tensor the op reads (the kernels read inputs while they write outputs, and
// write each output once). Tensors the op only reads may share memory with each other.
// Included by common.h.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fedkernels {

// Whether two of t's elements may share memory, for a tensor an op writes. at::has_internal_overlap
// says Yes only for a zero stride (an expanded view) and TooHard for every other view that is not
// dense, including as_strided ones whose rows overlap (strides (2, 1) over sizes (2, 3)), which
// an op trusting it would write with no error and a wrong result. Those are decided here:
// sorted by stride, each dimension's stride must reach past the elements the smaller ones span
// (the test of fedkernels/memory_footprints.py). Conservative: an interleaved view that
// overlaps nothing (strides (4, 3) over sizes (2, 3)) is refused too, and can be written
// through a clone.
inline bool may_overlap_itself(const at::Tensor& t) {
  const at::MemOverlap status = at::has_internal_overlap(t);
  if (status != at::MemOverlap::TooHard) return status == at::MemOverlap::Yes;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 1;  // elements spanned by the dimensions of smaller stride
  for (const auto& [stride, size] : dims) {
    if (stride < reach) return true;
    reach += (size - 1) * stride;
  }
  return false;
}

namespace overlap_detail {

// The bytes [begin, end) that a tensor's elements lie in, and the tensor's index in the call's
// list. Two tensors whose ranges intersect are taken to share memory: exact for dense tensors,
// conservative for interleaved views of one buffer, which are refused too (as may_overlap_itself
// refuses an interleaved view of itself).
struct ByteRange {
  uintptr_t begin, end;
  int64_t index;
};

// The range of t, or nullopt when it touches no memory (undefined, empty, or no data).
inline std::optional<ByteRange> byte_range(const at::Tensor& t, int64_t index, bool written) {
  if (!t.defined() || t.numel() == 0) return std::nullopt;
  // A written tensor's own address (mutable_data_ptr, as the kernels will take it); a read one's
  // without making its storage writable.
  const void* data = written ? t.data_ptr() : t.const_data_ptr();
  if (data == nullptr) return std::nullopt;
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * t.stride(d);
  const auto begin = reinterpret_cast<uintptr_t>(data);
  return ByteRange{begin, begin + static_cast<uintptr_t>(span) * t.element_size(), index};
}

// Whether a and b are the same elements in the same memory (one view under two names).
inline bool same_elements(const at::Tensor& a, const at::Tensor& b) {
  return a.const_data_ptr() == b.const_data_ptr() && a.scalar_type() == b.scalar_type() &&
      a.sizes() == b.sizes() && a.strides() == b.strides();
}

}  // namespace overlap_detail

// The first pair (i, j), i < j, in index order (lowest i, then lowest j), of tensors that share
// memory where tensors[i] is written: tensors[0, num_written) are written, the rest read (a null
// pointer or an undefined tensor stands for none). nullopt when there is none. With
// same_elements_ok, a read tensor that is a written one's very elements (same address, dtype,
// sizes and strides) is no conflict: for elementwise kernels, which read each element before
// writing it. The ranges are sorted once, and each written tensor looks up the ranges that
// start before its end (a binary search and, when nothing overlaps, one step back), so a call
// of K = 1000 clients of 200 tensors costs milliseconds.
inline std::optional<std::pair<int64_t, int64_t>> find_shared_memory(
    const std::vector<const at::Tensor*>& tensors, int64_t num_written,
    bool same_elements_ok = false) {
  using overlap_detail::ByteRange;
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<ByteRange> ranges;
  ranges.reserve(tensors.size());
  std::vector<std::optional<ByteRange>> written(num_written);
  for (int64_t i = 0; i < n; ++i) {
    if (tensors[i] == nullptr) continue;
    const auto r = overlap_detail::byte_range(*tensors[i], i, i < num_written);
    if (!r) continue;
    ranges.push_back(*r);
    if (i < num_written) written[i] = r;
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  // reach[p]: the furthest end among ranges[0, p], so that a walk back from a range stops as
  // soon as no earlier range can reach a written tensor.
  std::vector<uintptr_t> reach(ranges.size());
  for (size_t p = 0; p < ranges.size(); ++p) {
    reach[p] = std::max(ranges[p].end, p > 0 ? reach[p - 1] : uintptr_t(0));
  }
  for (int64_t i = 0; i < num_written; ++i) {
    if (!written[i]) continue;
    const ByteRange& w = *written[i];
    int64_t first = n;  // the lowest index that shares memory with tensor i
    auto it = std::lower_bound(ranges.begin(), ranges.end(), w.end,
                               [](const ByteRange& r, uintptr_t v) { return r.begin < v; });
    for (auto p = it - ranges.begin() - 1; p >= 0 && reach[p] > w.begin; --p) {
      const ByteRange& r = ranges[p];
      if (r.index == i || r.end <= w.begin || r.index >= first) continue;
      if (same_elements_ok && r.index >= num_written &&
          overlap_detail::same_elements(*tensors[i], *tensors[r.index])) {
        continue;
      }
      first = r.index;
    }
    // A lower index here is a written tensor that would have been found at its own turn.
    if (first < n) return std::make_pair(i, first);
  }
  return std::nullopt;
}

// ValueError unless every written tensor (tensors[0, num_written); the rest are read, and a
// null pointer stands for none) has one element of memory each and shares none with another
// tensor of the list:
//   "fedkernels.<op>: <name(i)> has elements that share memory (an expanded or overlapping
//    view)<self_why>"
//   "fedkernels.<op>: <name(i)> overlaps <name(j)><pair_why>"
// for the first such tensor i, and the first j (find_shared_memory). name(index) gives a
// tensor's name; it is called only to raise, so valid calls format no string.
template <typename Name>
void check_written_apart(
    const char* op, const std::vector<const at::Tensor*>& tensors, int64_t num_written,
    const Name& name, const char* self_why, const char* pair_why) {
  for (int64_t i = 0; i < num_written; ++i) {
    const at::Tensor* t = tensors[i];
    if (t == nullptr || !t->defined() || t->numel() == 0) continue;
    TORCH_CHECK_VALUE(
        !may_overlap_itself(*t), "fedkernels.", op, ": ", name(i),
        " has elements that share memory (an expanded or overlapping view)", self_why);
  }
  if (const auto pair = find_shared_memory(tensors, num_written)) {
    TORCH_CHECK_VALUE(
        false, "fedkernels.", op, ": ", name(pair->first), " overlaps ", name(pair->second),
        pair_why);
  }
}

}  // namespace fedkernels
