// CPU kernels of the secure-aggregation ops (schemas: csrc/ops.cpp; host side:
// csrc/secagg_host.h; Philox and the fixed-point code: csrc/ring_masks.h).
//
// Chunks of one tensor are the work items. A chunk's int32 outputs are the accumulator: first
// the codes of x (client) or the K clients' sum (server), then each mask's words, a window of
// kWindow elements at a time from a stack buffer, added or subtracted mod 2^32. No mask is
// ever whole in memory, and element e's value depends on e alone: the same bits for any
// number of threads.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../ring_masks.h"
#include "../secagg_host.h"
#include "chunk_loop.h"
#include "output_pool.h"

namespace fedkernels {
namespace {

constexpr int64_t kRingChunk = 1 << 14;  // elements per work item
constexpr int kLanes = 16;               // Philox blocks computed side by side
constexpr int64_t kWindow = 4 * kLanes * 4;  // words a window holds (4 vector steps)

// 16 uint32 lanes (GCC vector extensions: one register in the AVX-512 build, two or four in
// the others); products in 64-bit lanes.
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint64_t W16 __attribute__((vector_size(128)));

struct VectorU32Ops {
  using U = U16;
  static inline __attribute__((always_inline)) void mulhilo(uint32_t m, U x, U& hi, U& lo) {
    const W16 p = __builtin_convertvector(x, W16) * static_cast<uint64_t>(m);
    lo = __builtin_convertvector(p, U16);
    hi = __builtin_convertvector(p >> 32, U16);
  }
};

// Words of the stream (key, offset) for elements [e0, e0 + n), n <= kWindow, into w: whole
// blocks 16 at a time in vectors, the partial blocks at either end one word at a time.
void stream_words(uint64_t key, uint64_t offset, uint64_t e0, int64_t n, uint32_t* w) {
  int64_t i = 0;
  for (; i < n && ((e0 + i) & 3); ++i) w[i] = philox_word(key, offset, e0 + i);
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    const uint64_t g0 = (e0 + i) >> 2;
    U16 x0, x1, x2, x3;
    for (int j = 0; j < kLanes; ++j) {
      const uint64_t g = g0 + j;
      x0[j] = static_cast<uint32_t>(offset);
      x1[j] = static_cast<uint32_t>(offset >> 32);
      x2[j] = static_cast<uint32_t>(g);
      x3[j] = static_cast<uint32_t>(g >> 32);
    }
    Philox10<VectorU32Ops>::block(x0, x1, x2, x3, k0, k1);
    uint32_t* o = w + i;
    for (int j = 0; j < kLanes; ++j) {
      o[4 * j] = x0[j];
      o[4 * j + 1] = x1[j];
      o[4 * j + 2] = x2[j];
      o[4 * j + 3] = x3[j];
    }
  }
  for (; i < n; ++i) w[i] = philox_word(key, offset, e0 + i);
}

// acc[i] +/-= the mask's word for element e0 + i, for i < n.
void add_mask(const RingMask& m, uint64_t e0, int64_t n, uint32_t* acc) {
  alignas(64) uint32_t w[kWindow];
  for (int64_t i = 0; i < n; i += kWindow) {
    const int64_t len = std::min(kWindow, n - i);
    stream_words(m.key, m.offset, e0 + i, len, w);
    uint32_t* a = acc + i;
    if (m.negate) {
      for (int64_t j = 0; j < len; ++j) a[j] -= w[j];
    } else {
      for (int64_t j = 0; j < len; ++j) a[j] += w[j];
    }
  }
}

struct SecaggCpu {
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    return pooled_empty(sizes, options);
  }

  // The codes of x[0, n) (elements e0...) into acc.
  template <typename T>
  static void encode(const RingList& l, const T* x, int64_t n, uint64_t e0, uint32_t* acc) {
    if (!l.stochastic) {
      for (int64_t i = 0; i < n; ++i) {
        acc[i] = RingMath::encode(static_cast<double>(x[i]), l.clip, l.scale, false, 0u);
      }
      return;
    }
    alignas(64) uint32_t w[kWindow];
    for (int64_t i = 0; i < n; i += kWindow) {
      const int64_t len = std::min(kWindow, n - i);
      stream_words(l.seed, l.offset, e0 + i, len, w);
      for (int64_t j = 0; j < len; ++j) {
        acc[i + j] = RingMath::encode(static_cast<double>(x[i + j]), l.clip, l.scale, true, w[j]);
      }
    }
  }

  static void mask(RingList& l) {
    const int64_t total = l.total();
    const int64_t bytes = total * 8;
    const PassCost cost =
        l.masks.empty() && !l.stochastic ? PassCost::kStreaming : PassCost::kArithmetic;
    for_each_chunk(l.numels, kRingChunk, bytes, cost, [&](int64_t, const ChunkRange& r) {
      uint32_t* acc = l.outs[r.tensor] + r.begin;
      const int64_t n = r.end - r.begin;
      const uint64_t e0 = static_cast<uint64_t>(l.first[r.tensor] + r.begin);
      dispatch_float(l.dtypes[r.tensor], "secagg_mask", [&](auto tag) {
        using T = typename decltype(tag)::type;
        encode<T>(l, static_cast<const T*>(l.x[r.tensor]) + r.begin, n, e0, acc);
      });
      for (const auto& m : l.masks) add_mask(m, e0, n, acc);
    });
  }

  static void unmask_sum(RingList& l) {
    const int64_t total = l.total();
    const int64_t bytes = total * 4 * (l.K + 1);
    const PassCost cost = l.masks.empty() ? PassCost::kStreaming : PassCost::kArithmetic;
    for_each_chunk(l.numels, kRingChunk, bytes, cost, [&](int64_t, const ChunkRange& r) {
      uint32_t* acc = l.outs[r.tensor] + r.begin;
      const int64_t n = r.end - r.begin;
      std::memcpy(acc, static_cast<const uint32_t*>(l.x[r.tensor]) + r.begin, n * 4);
      for (int64_t k = 1; k < l.K; ++k) {
        const uint32_t* y = static_cast<const uint32_t*>(l.x[k * l.T + r.tensor]) + r.begin;
        for (int64_t i = 0; i < n; ++i) acc[i] += y[i];
      }
      const uint64_t e0 = static_cast<uint64_t>(l.first[r.tensor] + r.begin);
      for (const auto& m : l.masks) add_mask(m, e0, n, acc);
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_secagg<SecaggCpu>(m);
}

}  // namespace fedkernels
