"""The host-side layout of the multi-tensor launches (csrc/multi_tensor.h), checked on the CPU:
the chunk prefix and the chunk-to-tensor search that the CPU and CUDA kernels share, the
sections of a launch's metadata buffer, and its split into the blocks that the CUDA graph-capture
upload carries in kernel parameters (so the metadata a captured graph replays is complete).

The header is plain C++, so the test compiles a small driver against it with the system
compiler (native_driver); it is skipped where the sources or a compiler are missing.
"""

from __future__ import annotations

import pytest
from native_driver import run_driver

pytestmark = pytest.mark.slow

DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "multi_tensor.h"

using namespace fedkernels;

static int failures = 0;
#define EXPECT(cond)                                             \
  do {                                                           \
    if (!(cond)) {                                               \
      std::printf("FAILED line %d: %s\n", __LINE__, #cond);      \
      ++failures;                                                \
    }                                                            \
  } while (0)

int main() {
  // Chunk prefix and the owner of every chunk, for several chunk sizes and odd numels.
  const std::vector<int64_t> numels = {1, 2048, 2049, 5, 4096, 1, 65537, 3};
  for (int64_t chunk : {1, 7, 2048, 4096, 65536}) {
    const int64_t n = static_cast<int64_t>(numels.size());
    std::vector<int64_t> prefix(n + 1, -1);
    const int64_t total = fill_chunk_prefix(numels.data(), n, chunk, prefix.data());
    EXPECT(prefix[0] == 0);
    EXPECT(total == prefix[n]);
    int64_t covered = 0;
    for (int64_t t = 0; t < n; ++t) {
      EXPECT(prefix[t + 1] - prefix[t] == (numels[t] + chunk - 1) / chunk);
      // Every element of tensor t in exactly one of its chunks.
      int64_t elements = 0;
      for (int64_t c = prefix[t]; c < prefix[t + 1]; ++c) {
        const int64_t begin = (c - prefix[t]) * chunk;
        const int64_t end = begin + chunk < numels[t] ? begin + chunk : numels[t];
        EXPECT(begin < end);
        elements += end - begin;
      }
      EXPECT(elements == numels[t]);
      covered += prefix[t + 1] - prefix[t];
    }
    EXPECT(covered == total);
    for (int64_t c = 0; c < total; ++c) {
      int64_t owner = 0;
      while (!(prefix[owner] <= c && c < prefix[owner + 1])) ++owner;
      EXPECT(tensor_of_chunk(prefix.data(), n, c) == owner);
    }
  }
  // One tensor: every chunk is tensor 0.
  {
    const int64_t one[1] = {10};
    int64_t prefix[2];
    EXPECT(fill_chunk_prefix(one, 1, 3, prefix) == 4);
    for (int64_t c = 0; c < 4; ++c) EXPECT(tensor_of_chunk(prefix, 1, c) == 0);
  }

  // Metadata sections: 8-byte aligned, in order, none overlapping, empty ones take no room.
  {
    MetadataLayout layout;
    const size_t a = layout.add<unsigned long long>(6);
    const size_t b = layout.add<unsigned char>(3);
    const size_t c = layout.add<float>(0);
    const size_t d = layout.add<float>(5);
    const size_t e = layout.add<long long>(1);
    EXPECT(a == 0);
    EXPECT(b == 48);
    EXPECT(c == 56 && d == 56);
    EXPECT(e == 80);
    EXPECT(layout.bytes() == 88 && layout.words() == 11);
    for (size_t off : {a, b, c, d, e}) EXPECT(off % 8 == 0);
  }

  // The capture-time upload: blocks of at most kMetadataBlockWords words that together write
  // every word once, in order (a copy through them reproduces the buffer).
  for (int64_t words : {int64_t(0), int64_t(1), kMetadataBlockWords - 1, kMetadataBlockWords,
                        kMetadataBlockWords + 1, 5 * kMetadataBlockWords + 17}) {
    std::vector<unsigned long long> src(words), dst(words, 0);
    for (int64_t i = 0; i < words; ++i) src[i] = 0x9E3779B97F4A7C15ull * (i + 1);
    int64_t next = 0, blocks = 0;
    for_each_metadata_block(words, [&](int64_t first, int64_t count) {
      EXPECT(first == next);
      EXPECT(count > 0 && count <= kMetadataBlockWords);
      for (int64_t i = 0; i < count; ++i) dst[first + i] = src[first + i];
      next = first + count;
      ++blocks;
    });
    EXPECT(next == words);
    EXPECT(blocks == (words + kMetadataBlockWords - 1) / kMetadataBlockWords);
    EXPECT(src == dst);
  }
  // A block and its destination pointer and count fit the 4 KiB of kernel parameters.
  EXPECT(kMetadataBlockWords * 8 + 16 <= 4096);

  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
"""


def test_multi_tensor_layout(tmp_path):
    assert run_driver(DRIVER, "multi_tensor.h", tmp_path).strip() == "ok"
