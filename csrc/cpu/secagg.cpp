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

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2) || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace fedkernels {
namespace {

constexpr int64_t kRingChunk = 1 << 14;  // elements per work item

// Philox blocks side by side in one register of uint32 lanes. The 32 x 32 -> 64-bit products
// come from the even-lane multiply (pmuludq), once on the even lanes and once on the odd ones
// shifted down, and the halves are blended back into lanes.
#if defined(CPU_CAPABILITY_AVX512)
struct VectorU32Ops {
  using U = __m512i;
  static constexpr int kLanes = 16;
  static inline __attribute__((always_inline)) U mix(U a, U b, uint32_t k) {
    return _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_set1_epi32(static_cast<int>(k)));
  }
  static inline __attribute__((always_inline)) void mulhilo(uint32_t m, U x, U& hi, U& lo) {
    const U mv = _mm512_set1_epi32(static_cast<int>(m));
    const U even = _mm512_mul_epu32(x, mv), odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), mv);
    lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  }
  static U load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static void store(uint32_t* p, U v) { _mm512_storeu_si512(p, v); }
};
#elif defined(CPU_CAPABILITY_AVX2)
struct VectorU32Ops {
  using U = __m256i;
  static constexpr int kLanes = 8;
  static inline __attribute__((always_inline)) U mix(U a, U b, uint32_t k) {
    return _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_set1_epi32(static_cast<int>(k)));
  }
  static inline __attribute__((always_inline)) void mulhilo(uint32_t m, U x, U& hi, U& lo) {
    const U mv = _mm256_set1_epi32(static_cast<int>(m));
    const U even = _mm256_mul_epu32(x, mv), odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), mv);
    lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  }
  static U load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const U*>(p)); }
  static void store(uint32_t* p, U v) { _mm256_storeu_si256(reinterpret_cast<U*>(p), v); }
};
#elif defined(__SSE2__)
struct VectorU32Ops {
  using U = __m128i;
  static constexpr int kLanes = 4;
  static inline __attribute__((always_inline)) U mix(U a, U b, uint32_t k) {
    return _mm_xor_si128(_mm_xor_si128(a, b), _mm_set1_epi32(static_cast<int>(k)));
  }
  static inline __attribute__((always_inline)) void mulhilo(uint32_t m, U x, U& hi, U& lo) {
    const U mv = _mm_set1_epi32(static_cast<int>(m));
    const U even = _mm_mul_epu32(x, mv), odd = _mm_mul_epu32(_mm_srli_epi64(x, 32), mv);
    const U low_half = _mm_set1_epi64x(0xffffffffLL);
    lo = _mm_or_si128(_mm_and_si128(even, low_half), _mm_slli_epi64(odd, 32));
    hi = _mm_or_si128(_mm_srli_epi64(even, 32), _mm_andnot_si128(low_half, odd));
  }
  static U load(const uint32_t* p) { return _mm_loadu_si128(reinterpret_cast<const U*>(p)); }
  static void store(uint32_t* p, U v) { _mm_storeu_si128(reinterpret_cast<U*>(p), v); }
};
#else
struct VectorU32Ops : ScalarU32Ops {
  static constexpr int kLanes = 1;
  static U load(const uint32_t* p) { return *p; }
  static void store(uint32_t* p, U v) { *p = v; }
};
#endif

constexpr int kLanes = VectorU32Ops::kLanes;
constexpr int64_t kWindow = 256;  // words a window holds

// Words of the stream (key, offset) for elements [e0, e0 + n), n <= kWindow, into w: whole
// blocks kLanes at a time in vectors, the partial blocks at either end one word at a time.
void stream_words(uint64_t key, uint64_t offset, uint64_t e0, int64_t n, uint32_t* w) {
  using V = VectorU32Ops;
  int64_t i = 0;
  for (; i < n && ((e0 + i) & 3); ++i) w[i] = philox_word(key, offset, e0 + i);
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  alignas(64) uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    c0[j] = static_cast<uint32_t>(offset);
    c1[j] = static_cast<uint32_t>(offset >> 32);
  }
  const V::U x0_init = V::load(c0), x1_init = V::load(c1);
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    const uint64_t g0 = (e0 + i) >> 2;
    for (int j = 0; j < kLanes; ++j) {
      c2[j] = static_cast<uint32_t>(g0 + j);
      c3[j] = static_cast<uint32_t>((g0 + j) >> 32);
    }
    V::U x0 = x0_init, x1 = x1_init, x2 = V::load(c2), x3 = V::load(c3);
    Philox10<V>::block(x0, x1, x2, x3, k0, k1);
    V::store(c0, x0);
    V::store(c1, x1);
    V::store(c2, x2);
    V::store(c3, x3);
    uint32_t* o = w + i;
    for (int j = 0; j < kLanes; ++j) {
      o[4 * j] = c0[j];
      o[4 * j + 1] = c1[j];
      o[4 * j + 2] = c2[j];
      o[4 * j + 3] = c3[j];
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
