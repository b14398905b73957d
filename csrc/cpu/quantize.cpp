// CPU kernels of the quantized-update ops (schemas: csrc/ops.cpp; host side:
// csrc/quantize_host.h; per-element math: QuantizeMath in csrc/elementwise.h).
//
// quantize_int8 / quantize_int4: chunks of whole blocks of one tensor are the work items; a
// block is read twice (max|v|, then the rounding) from a buffer of v = x (+ residual) in the
// accumulate type; 4-bit levels are packed from a buffer of the block's levels (an even block
// ends on a byte boundary). quantize_fp8: one pass of per-chunk maxima (combined per tensor,
// an order-free max), then the rounding pass with the tensor's scale. The stochastic words are
// Philox words of the element's index in the whole list, so the values do not depend on the
// chunks or the threads.
// dequantize_*weighted_sum: chunks of whole blocks of every tensor are the work items; per
// block, the K coefficients w_k s_kb, then a few vectors at a time the K clients' values
// (int8, nibbles widened and split by shifts, or e4m3 decoded by bit operations) in client
// order into float32 registers, written once.
#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../elementwise.h"
#include "../quantize_host.h"
#include "chunk_loop.h"
#include "output_pool.h"
#include "vec_io.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace fedkernels {
namespace {

constexpr int64_t kQuantChunk = 1 << 14;  // elements per quantize work item (whole blocks)
constexpr int64_t kSumChunk = 1 << 14;    // elements per dequantize work item (whole blocks)
constexpr int64_t kStreamOutBytes = int64_t(32) << 20;  // outputs this large bypass the caches

// Elements per chunk: a multiple of the block, about `want` elements.
inline int64_t block_chunk(int64_t block, int64_t want) {
  return block >= want ? block : want / block * block;
}

// 64-byte vectors (GCC vector extensions: one register in the AVX-512 build, two or four in
// the others), loaded and stored unaligned through memcpy.
typedef float F16 __attribute__((vector_size(64)));
typedef double D8 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef int64_t L8 __attribute__((vector_size(64)));
typedef int8_t B16 __attribute__((vector_size(16)));
typedef int8_t B8 __attribute__((vector_size(8)));

template <typename A>
struct VecOf;
template <>
struct VecOf<float> {
  using V = F16;
  using I = I16;
  using B = B16;
  static constexpr int kN = 16;
  static constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: x + m - m rounds x to an integer
};
template <>
struct VecOf<double> {
  using V = D8;
  using I = L8;
  using B = B8;
  static constexpr int kN = 8;
  static constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
};

template <typename V, typename S>
inline V load_vec(const S* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V, typename S>
inline V splat(S x) {
  return V{} + x;
}

// The value of element e of a client's bytes in each format, as float32 (exact): one (at), a
// vector of kW (load), or for int4 (kPairs) two vectors of kW from 2 kW elements.
struct Int8Values {
  static constexpr bool kPairs = false;
  static float at(const uint8_t* p, int64_t e) {
    return static_cast<float>(reinterpret_cast<const int8_t*>(p)[e]);
  }
#if defined(CPU_CAPABILITY_AVX512)
  static __m512 load(const uint8_t* p, int64_t e) {
    // vpmovsxbd: GCC's generic vectors widen int8 lane by lane here
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + e))));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  static __m256 load(const uint8_t* p, int64_t e) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + e))));
  }
#endif
};

struct Int4Values {
  static float at(const uint8_t* p, int64_t e) {
    return static_cast<float>(QuantizeMath::nibble(p, e));
  }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  // Vectors come in pairs: kW bytes widened to 32-bit lanes give the kW even elements (low
  // nibbles) and the kW odd ones (high nibbles) by two shifts each, with one shuffle (the
  // widening) per 2 kW values. The sums stay even/odd across the K clients and are put back
  // in element order once, by interleave.
  static constexpr bool kPairs = true;
#endif
#if defined(CPU_CAPABILITY_AVX512)
  static void load_pair(const uint8_t* p, int64_t e, __m512& even, __m512& odd) {
    const __m512i x =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + e / 2)));
    even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 28), 28));
    odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 24), 28));
  }
  static void interleave(__m512& lo, __m512& hi) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512 even = lo, odd = hi;
    lo = _mm512_permutex2var_ps(even, first, odd);
    hi = _mm512_permutex2var_ps(even, second, odd);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  static void load_pair(const uint8_t* p, int64_t e, __m256& even, __m256& odd) {
    const __m256i x =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + e / 2)));
    even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28));
    odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 24), 28));
  }
  static void interleave(__m256& lo, __m256& hi) {
    const __m256 l = _mm256_unpacklo_ps(lo, hi), h = _mm256_unpackhi_ps(lo, hi);
    lo = _mm256_permute2f128_ps(l, h, 0x20);
    hi = _mm256_permute2f128_ps(l, h, 0x31);
  }
#endif
};

struct Fp8Values {
  static constexpr bool kPairs = false;
  static float at(const uint8_t* p, int64_t e) { return QuantizeMath::fp8_value(p[e]); }
  // e4m3fn by bit operations, as QuantizeMath::fp8_value: the magnitude's bits m7 << 20
  // rebiased (+120 in the exponent) are the value f of a normal e4m3; for exponent 0
  // (subnormal, m 2^-9) f is 2^-7 + m 2^-10, so the value is 2 f - 2^-6 (exact: one fused
  // multiply-subtract); 0x7F is NaN; then the sign bit.
#if defined(CPU_CAPABILITY_AVX512)
  static __m512 load(const uint8_t* p, int64_t e) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + e)));
    const __m512i m7 = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    __m512 a = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(m7, 20), _mm512_set1_epi32(120 << 23)));
    a = _mm512_mask_fmsub_ps(a, _mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x78)),
                             _mm512_set1_ps(2.0f), _mm512_set1_ps(0.015625f));
    a = _mm512_mask_mov_ps(a, _mm512_cmpeq_epi32_mask(m7, _mm512_set1_epi32(0x7F)),
                           _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    // a | (x << 24 & sign bit): a's own sign bit is 0
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
        _mm512_castps_si512(a), _mm512_slli_epi32(x, 24), _mm512_set1_epi32(INT32_MIN), 0xF8));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  static __m256 load(const uint8_t* p, int64_t e) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + e)));
    const __m256i m7 = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(m7, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_fmsub_ps(normal, _mm256_set1_ps(2.0f), _mm256_set1_ps(0.015625f));
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), m7);
    __m256 a = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(small));
    const __m256i nan = _mm256_cmpeq_epi32(m7, _mm256_set1_epi32(0x7F));
    a = _mm256_blendv_ps(a, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                         _mm256_castsi256_ps(nan));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(a), sign));
  }
#endif
};

struct QuantizeCpu {
  // Fresh sums from the output pool, as weighted_sum's: a server's next round reuses the
  // faulted-in pages of the model it dropped.
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    return pooled_empty(sizes, options);
  }

  // max|v| over the block, and whether every v is finite (a sum of v * 0 is NaN otherwise).
  template <typename A>
  static void block_max(const A* v, int64_t len, A& amax, bool& finite) {
    using VO = VecOf<A>;
    using V = typename VO::V;
    V m{}, z{};
    int64_t j = 0;
    for (; j + VO::kN <= len; j += VO::kN) {
      const V x = load_vec<V>(v + j);
      const V a = x < A(0) ? -x : x;
      m = m < a ? a : m;
      z = z + x * A(0);
    }
    A mx = 0, zs = 0;
    for (int i = 0; i < VO::kN; ++i) {
      mx = mx < m[i] ? m[i] : mx;
      zs = zs + z[i];
    }
    for (; j < len; ++j) {
      const A a = std::abs(v[j]);
      mx = mx < a ? a : mx;
      zs = zs + v[j] * A(0);
    }
    amax = mx;
    finite = !std::isnan(zs);
  }

  // q = QuantizeMath::quantize(v, s, nearest, levels) for s > 0, in vectors: round half to
  // even by the magic constant (exact here: |v / s| <= levels and change), then the clamp.
  template <typename A>
  static void round_nearest(const A* v, int64_t len, float s, int levels, int8_t* q) {
    using VO = VecOf<A>;
    using V = typename VO::V;
    const V sv = splat<V>(static_cast<A>(s)), magic = splat<V>(VO::kMagic);
    const V lo = splat<V>(A(-levels)), hi = splat<V>(A(levels));
    int64_t i = 0;
    for (; i + VO::kN <= len; i += VO::kN) {
      V r = (load_vec<V>(v + i) / sv + magic) - magic;
      r = r < lo ? lo : r;
      r = r > hi ? hi : r;
      const typename VO::B b = __builtin_convertvector(
          __builtin_convertvector(r, typename VO::I), typename VO::B);
      std::memcpy(q + i, &b, sizeof b);
    }
    for (; i < len; ++i) q[i] = QuantizeMath::quantize<A>(v[i], s, false, 0.0f, levels);
  }

  // v[0..len) = x (+ residual) of elements [b0, b0 + len) of a tensor, in the accumulate type.
  template <typename T, typename A>
  static void load_v(const T* x, const T* res, int64_t b0, int64_t len, std::vector<A>& v_buf,
                     std::vector<A>& r_buf) {
    v_buf.resize(len);
    convert_to_acc<T, A>(x + b0, v_buf.data(), len);
    if (res) {
      r_buf.resize(len);
      convert_to_acc<T, A>(res + b0, r_buf.data(), len);
      for (int64_t j = 0; j < len; ++j) v_buf[j] = v_buf[j] + r_buf[j];
    }
  }

  // Calls f(i, u) for i in [0, len) with u the uniform of element first + i: word (first + i)
  // % 4 of the Philox block (seed, subsequence (first + i) / 4, offset).
  template <typename F>
  static void for_each_uniform(const QuantizeList& l, int64_t first, int64_t len, F f) {
    uint32_t words[4] = {};
    for (int64_t i = 0; i < len; ++i) {
      const uint64_t e = static_cast<uint64_t>(first + i);
      if (i == 0 || (e & 3) == 0) {
        at::philox_engine engine(l.seed, e / 4, l.offset);
        for (auto& w : words) w = engine();
      }
      f(i, QuantizeMath::uniform24(words[e & 3]));
    }
  }

  template <typename T>
  static void quantize(QuantizeList& l) {
    if (l.format == QuantFormat::kFp8) {
      quantize_fp8<T>(l);
    } else {
      quantize_blocks<T>(l);
    }
  }

  // int8 and packed int4: one scale per block.
  template <typename T>
  static void quantize_blocks(QuantizeList& l) {
    using A = acc_type<T>;
    const bool int4 = l.format == QuantFormat::kInt4;
    const int levels = int4 ? QuantizeMath::kLevels4 : QuantizeMath::kLevels;
    const int64_t B = l.block_size;
    const int64_t total = total_of(l.numels);
    const int64_t bytes = total * (int64_t(sizeof(T)) * (l.feedback ? 3 : 1)) +
        packed_bytes(l.format, total) + 4 * total / B;
    const PassCost cost = l.stochastic ? PassCost::kArithmetic : PassCost::kStreaming;
    const int64_t chunk = block_chunk(B, kQuantChunk);
    for_each_chunk(l.numels, chunk, bytes, cost, [&](int64_t, const ChunkRange& r) {
      thread_local std::vector<A> v_buf, r_buf;
      thread_local std::vector<int8_t> q_buf;
      const T* x = static_cast<const T*>(l.x[r.tensor]);
      const T* res = l.feedback ? static_cast<const T*>(l.residual[r.tensor]) : nullptr;
      float* scales = l.scales[r.tensor];
      T* res_out = l.feedback ? static_cast<T*>(l.residual_out[r.tensor]) : nullptr;
      const int64_t first = l.first[r.tensor];
      for (int64_t b0 = r.begin; b0 < r.end; b0 += B) {
        const int64_t len = std::min(B, r.end - b0);
        load_v<T, A>(x, res, b0, len, v_buf, r_buf);
        const A* v = v_buf.data();
        A amax;
        bool finite;
        block_max<A>(v, len, amax, finite);
        const float s = QuantizeMath::scale_of<A>(amax, finite, A(levels));
        scales[b0 / B] = s;
        int8_t* qb;
        if (int4) {
          q_buf.resize(len + 1);
          qb = q_buf.data();
        } else {
          qb = static_cast<int8_t*>(l.values[r.tensor]) + b0;
        }
        if (!(s > 0.0f)) {
          std::fill(qb, qb + len, int8_t{0});
        } else if (l.stochastic) {
          for_each_uniform(l, first + b0, len, [&](int64_t i, float u) {
            qb[i] = QuantizeMath::quantize<A>(v[i], s, true, u, levels);
          });
        } else {
          round_nearest<A>(v, len, s, levels, qb);
        }
        if (int4) {
          // B is even, so b0 is: the block starts a byte; an odd last block pads a 0 nibble
          qb[len] = 0;
          uint8_t* packed = static_cast<uint8_t*>(l.values[r.tensor]) + b0 / 2;
          for (int64_t j = 0; 2 * j < len; ++j) packed[j] = QuantizeMath::pack4(qb[2 * j], qb[2 * j + 1]);
        }
        if (res_out) {
          const A sa = static_cast<A>(s);
          for (int64_t i = 0; i < len; ++i) {
            res_out[b0 + i] = static_cast<T>(v[i] - static_cast<A>(qb[i]) * sa);
          }
        }
      }
    });
  }

  // fp8 e4m3fn with one scale per tensor: the maxima of chunks, their per-tensor maximum (exact
  // in any order), then the rounding.
  template <typename T>
  static void quantize_fp8(QuantizeList& l) {
    using A = acc_type<T>;
    const int64_t n = l.num_tensors();
    const int64_t total = total_of(l.numels);
    const int64_t in_bytes = total * int64_t(sizeof(T)) * (l.feedback ? 2 : 1);
    int64_t chunks = 0;
    for (const auto numel : l.numels) chunks += (numel + kQuantChunk - 1) / kQuantChunk;
    std::vector<A> chunk_max(chunks);
    std::vector<char> chunk_finite(chunks);
    std::vector<int64_t> chunk_tensor(chunks);
    for_each_chunk(l.numels, kQuantChunk, in_bytes, PassCost::kStreaming,
                   [&](int64_t c, const ChunkRange& r) {
      thread_local std::vector<A> v_buf, r_buf;
      const T* x = static_cast<const T*>(l.x[r.tensor]);
      const T* res = l.feedback ? static_cast<const T*>(l.residual[r.tensor]) : nullptr;
      load_v<T, A>(x, res, r.begin, r.end - r.begin, v_buf, r_buf);
      bool finite;
      block_max<A>(v_buf.data(), r.end - r.begin, chunk_max[c], finite);
      chunk_finite[c] = finite;
      chunk_tensor[c] = r.tensor;
    });
    std::vector<A> amax(n, A(0));
    std::vector<char> finite(n, 1);
    for (int64_t c = 0; c < chunks; ++c) {
      A& m = amax[chunk_tensor[c]];
      m = m < chunk_max[c] ? chunk_max[c] : m;
      finite[chunk_tensor[c]] &= chunk_finite[c];
    }
    for (int64_t t = 0; t < n; ++t) {
      l.scales[t][0] = QuantizeMath::scale_of<A>(amax[t], finite[t], A(QuantizeMath::kFp8Max));
    }
    const int64_t bytes = in_bytes + total * (1 + (l.feedback ? int64_t(sizeof(T)) : 0));
    for_each_chunk(l.numels, kQuantChunk, bytes, PassCost::kArithmetic,
                   [&](int64_t, const ChunkRange& r) {
      thread_local std::vector<A> v_buf, r_buf;
      const T* x = static_cast<const T*>(l.x[r.tensor]);
      const T* res = l.feedback ? static_cast<const T*>(l.residual[r.tensor]) : nullptr;
      const int64_t len = r.end - r.begin;
      load_v<T, A>(x, res, r.begin, len, v_buf, r_buf);
      const A* v = v_buf.data();
      uint8_t* q = static_cast<uint8_t*>(l.values[r.tensor]) + r.begin;
      T* res_out = l.feedback ? static_cast<T*>(l.residual_out[r.tensor]) + r.begin : nullptr;
      const float s = l.scales[r.tensor][0];
      const A sa = static_cast<A>(s);
      auto put = [&](int64_t i, A qv) {
        q[i] = QuantizeMath::fp8_bits(static_cast<float>(qv));
        if (res_out) res_out[i] = static_cast<T>(v[i] - qv * sa);
      };
      if (!(s > 0.0f)) {
        // q = 0; the residual keeps v (s = 0) or turns NaN (s = NaN), as v - 0 s
        for (int64_t i = 0; i < len; ++i) put(i, A(0));
      } else if (l.stochastic) {
        for_each_uniform(l, l.first[r.tensor] + r.begin, len, [&](int64_t i, float u) {
          put(i, QuantizeMath::fp8_round<A>(v[i] / sa, true, u));
        });
      } else {
        for (int64_t i = 0; i < len; ++i) put(i, QuantizeMath::fp8_round<A>(v[i] / sa, false, 0.0f));
      }
    });
  }

  // Elements [b0, b1) of one block: out = sum_k c_k q_k, k in order, from 0 (no fused
  // multiply-add: the reference's bits); q_k element i of client k's bytes through Fmt
  // (Int8Values, Int4Values, Fp8Values above).
  // stream: float32 results go around the caches (non-temporal stores) where aligned.
  template <typename T, typename Fmt>
  static void block_sum(const uint8_t* const* src, const float* coef, int64_t K, int64_t b0,
                        int64_t b1, T* out, bool stream) {
    int64_t i = b0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    // kU independent chains of kW lanes
    constexpr int kU = 4;
#if defined(CPU_CAPABILITY_AVX512)
    constexpr int kW = 16;
    using R = __m512;
    auto madd = [](R a, R c, R q) { return _mm512_add_ps(a, _mm512_mul_ps(c, q)); };
    auto set1 = [](float c) { return _mm512_set1_ps(c); };
    auto zero = [] { return _mm512_setzero_ps(); };
    auto store = [](float* p, R a) { _mm512_storeu_ps(p, a); };
    auto store_nt = [](float* p, R a) { _mm512_stream_ps(p, a); };
#else
    constexpr int kW = 8;
    using R = __m256;
    auto madd = [](R a, R c, R q) { return _mm256_add_ps(a, _mm256_mul_ps(c, q)); };
    auto set1 = [](float c) { return _mm256_set1_ps(c); };
    auto zero = [] { return _mm256_setzero_ps(); };
    auto store = [](float* p, R a) { _mm256_storeu_ps(p, a); };
    auto store_nt = [](float* p, R a) { _mm256_stream_ps(p, a); };
#endif
    alignas(64) float buf[kU * kW];
    for (; i + kU * kW <= b1; i += kU * kW) {
      R a[kU];
      for (int u = 0; u < kU; ++u) a[u] = zero();
      for (int64_t k = 0; k < K; ++k) {
        const R c = set1(coef[k]);
        if constexpr (Fmt::kPairs) {
          for (int u = 0; u < kU; u += 2) {
            R even, odd;
            Fmt::load_pair(src[k], i + u * kW, even, odd);
            a[u] = madd(a[u], c, even);
            a[u + 1] = madd(a[u + 1], c, odd);
          }
        } else {
          for (int u = 0; u < kU; ++u) a[u] = madd(a[u], c, Fmt::load(src[k], i + u * kW));
        }
      }
      if constexpr (Fmt::kPairs) {
        for (int u = 0; u < kU; u += 2) Fmt::interleave(a[u], a[u + 1]);
      }
      float* dst = std::is_same_v<T, float> ? reinterpret_cast<float*>(out + i) : buf;
      if (std::is_same_v<T, float> && stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
        for (int u = 0; u < kU; ++u) store_nt(dst + u * kW, a[u]);
      } else {
        for (int u = 0; u < kU; ++u) store(dst + u * kW, a[u]);
      }
      if constexpr (!std::is_same_v<T, float>) {
        for (int e = 0; e < kU * kW; ++e) out[i + e] = static_cast<T>(buf[e]);
      }
    }
#else
    (void)stream;
    // One client at a time over a tile of accumulators (a loop GCC vectorizes for int8).
    constexpr int64_t kTile = 256;
    alignas(64) float acc[kTile];
    for (; i + kTile <= b1; i += kTile) {
      std::fill(acc, acc + kTile, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float c = coef[k];
        const uint8_t* p = src[k];
        for (int64_t e = 0; e < kTile; ++e) acc[e] = acc[e] + c * Fmt::at(p, i + e);
      }
      for (int64_t e = 0; e < kTile; ++e) out[i + e] = static_cast<T>(acc[e]);
    }
#endif
    for (; i < b1; ++i) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = acc + coef[k] * Fmt::at(src[k], i);
      out[i] = static_cast<T>(acc);
    }
  }

  template <typename T>
  static void dequantize_sum(DequantizeList& l) {
    switch (l.format) {
      case QuantFormat::kInt8: return dequantize_sum_as<T, Int8Values>(l);
      case QuantFormat::kInt4: return dequantize_sum_as<T, Int4Values>(l);
      case QuantFormat::kFp8: return dequantize_sum_as<T, Fp8Values>(l);
    }
  }

  template <typename T, typename Fmt>
  static void dequantize_sum_as(DequantizeList& l) {
    const bool per_tensor = l.format == QuantFormat::kFp8;
    const int64_t B = l.block_size, K = l.K, T_ = l.T;
    const int64_t total = total_of(l.numels);
    const int64_t scale_words = per_tensor ? T_ : total / B + T_;
    const int64_t bytes =
        K * packed_bytes(l.format, total) + 4 * K * scale_words + total * int64_t(sizeof(T));
    // per-block scales: chunks of whole blocks (even for int4: whole bytes); one per tensor:
    // any chunk
    const int64_t chunk = per_tensor ? kSumChunk : block_chunk(B, kSumChunk);
    // An output larger than the caches is not read back soon: writing it around them saves
    // reading every line before it is written.
    const bool stream = total * int64_t(sizeof(T)) >= kStreamOutBytes;
    for_each_chunk(l.numels, chunk, bytes, PassCost::kStreaming, [&](int64_t, const ChunkRange& r) {
      thread_local std::vector<float> coef;
      thread_local std::vector<const uint8_t*> src;
      coef.resize(K);
      src.resize(K);
      for (int64_t k = 0; k < K; ++k) {
        src[k] = static_cast<const uint8_t*>(l.values[k * T_ + r.tensor]);
      }
      T* out = static_cast<T*>(l.outs[r.tensor]);
      for (int64_t b0 = r.begin; b0 < r.end;) {
        const int64_t b = per_tensor ? 0 : b0 / B;
        const int64_t b1 = per_tensor ? r.end : std::min(r.end, (b + 1) * B);
        for (int64_t k = 0; k < K; ++k) {
          coef[k] = QuantizeMath::coefficient(l.weights[k], l.scales[k * T_ + r.tensor][b]);
        }
        block_sum<T, Fmt>(src.data(), coef.data(), K, b0, b1, out, stream);
        b0 = b1;
      }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      if (stream) _mm_sfence();  // the streamed stores are visible before the thread reports done
#endif
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_quantize<QuantizeCpu>(m);
}

}  // namespace fedkernels
