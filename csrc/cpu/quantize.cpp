// CPU kernels of the quantized-update ops (schemas: csrc/ops.cpp; host side:
// csrc/quantize_host.h; per-element math: QuantizeMath in csrc/elementwise.h).
//
// quantize_int8: chunks of whole blocks of one tensor are the work items; a block is read
// twice (max|v|, then the rounding) from a buffer of v = x (+ residual) in the accumulate type.
// The stochastic words are Philox words of the element's index in the whole list, so the
// values do not depend on the chunks or the threads.
// dequantize_weighted_sum: chunks of whole blocks of every tensor are the work items; per
// block, the K coefficients w_k s_kb, then a few vectors at a time the K clients' int8 values
// in client order into float32 registers, written once.
#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

  // q = QuantizeMath::quantize(v, s, nearest) for s > 0, in vectors: round half to even by
  // the magic constant (exact here: |v / s| <= 127 and change), then the clamp.
  template <typename A>
  static void round_nearest(const A* v, int64_t len, float s, int8_t* q) {
    using VO = VecOf<A>;
    using V = typename VO::V;
    const V sv = splat<V>(static_cast<A>(s)), magic = splat<V>(VO::kMagic);
    const V lo = splat<V>(A(-QuantizeMath::kLevels)), hi = splat<V>(A(QuantizeMath::kLevels));
    int64_t i = 0;
    for (; i + VO::kN <= len; i += VO::kN) {
      V r = (load_vec<V>(v + i) / sv + magic) - magic;
      r = r < lo ? lo : r;
      r = r > hi ? hi : r;
      const typename VO::B b = __builtin_convertvector(
          __builtin_convertvector(r, typename VO::I), typename VO::B);
      std::memcpy(q + i, &b, sizeof b);
    }
    for (; i < len; ++i) q[i] = QuantizeMath::quantize<A>(v[i], s, false, 0.0f);
  }

  template <typename T>
  static void quantize(QuantizeList& l) {
    using A = acc_type<T>;
    const int64_t B = l.block_size;
    const int64_t bytes = total_of(l.numels) *
        (int64_t(sizeof(T)) * (l.feedback ? 3 : 1) + 1) + 4 * total_of(l.numels) / B;
    const PassCost cost = l.stochastic ? PassCost::kArithmetic : PassCost::kStreaming;
    const int64_t chunk = block_chunk(B, kQuantChunk);
    for_each_chunk(l.numels, chunk, bytes, cost, [&](int64_t, const ChunkRange& r) {
      thread_local std::vector<A> v_buf, r_buf;
      const T* x = static_cast<const T*>(l.x[r.tensor]);
      const T* res = l.feedback ? static_cast<const T*>(l.residual[r.tensor]) : nullptr;
      int8_t* q = l.values[r.tensor];
      float* scales = l.scales[r.tensor];
      T* res_out = l.feedback ? static_cast<T*>(l.residual_out[r.tensor]) : nullptr;
      const int64_t first = l.first[r.tensor];
      for (int64_t b0 = r.begin; b0 < r.end; b0 += B) {
        const int64_t len = std::min(B, r.end - b0);
        v_buf.resize(len);
        A* v = v_buf.data();
        convert_to_acc<T, A>(x + b0, v, len);
        if (res) {
          r_buf.resize(len);
          convert_to_acc<T, A>(res + b0, r_buf.data(), len);
          for (int64_t j = 0; j < len; ++j) v[j] = v[j] + r_buf[j];
        }
        A amax;
        bool finite;
        block_max<A>(v, len, amax, finite);
        const float s = QuantizeMath::scale_of<A>(amax, finite);
        scales[b0 / B] = s;
        int8_t* qb = q + b0;
        if (!(s > 0.0f)) {
          std::fill(qb, qb + len, int8_t{0});
        } else if (l.stochastic) {
          uint32_t words[4] = {};
          for (int64_t i = 0; i < len; ++i) {
            const uint64_t e = static_cast<uint64_t>(first + b0 + i);
            if (i == 0 || (e & 3) == 0) {
              at::philox_engine engine(l.seed, e / 4, l.offset);
              for (auto& w : words) w = engine();
            }
            qb[i] = QuantizeMath::quantize<A>(v[i], s, true, QuantizeMath::uniform24(words[e & 3]));
          }
        } else {
          round_nearest<A>(v, len, s, qb);
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

  // Elements [b0, b1) of one block: out = sum_k c_k q_k, k in order, from 0 (no fused
  // multiply-add: the reference's bits).
  // stream: float32 results go around the caches (non-temporal stores) where aligned.
  template <typename T>
  static void block_sum(const int8_t* const* src, const float* coef, int64_t K, int64_t b0,
                        int64_t b1, T* out, bool stream) {
    int64_t i = b0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    // kU independent chains of kW lanes; int8 widened with vpmovsxbd (GCC's generic vectors
    // widen int8 lane by lane here).
    constexpr int kU = 4;
#if defined(CPU_CAPABILITY_AVX512)
    constexpr int kW = 16;
    using R = __m512;
    auto load = [](const int8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    auto madd = [](R a, R c, R q) { return _mm512_add_ps(a, _mm512_mul_ps(c, q)); };
    auto set1 = [](float c) { return _mm512_set1_ps(c); };
    auto zero = [] { return _mm512_setzero_ps(); };
    auto store = [](float* p, R a) { _mm512_storeu_ps(p, a); };
    auto store_nt = [](float* p, R a) { _mm512_stream_ps(p, a); };
#else
    constexpr int kW = 8;
    using R = __m256;
    auto load = [](const int8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
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
        const int8_t* p = src[k] + i;
        for (int u = 0; u < kU; ++u) a[u] = madd(a[u], c, load(p + u * kW));
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
    // One client at a time over a tile of accumulators (a loop GCC vectorizes).
    constexpr int64_t kTile = 256;
    alignas(64) float acc[kTile];
    for (; i + kTile <= b1; i += kTile) {
      std::fill(acc, acc + kTile, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float c = coef[k];
        const int8_t* p = src[k] + i;
        for (int64_t e = 0; e < kTile; ++e) acc[e] = acc[e] + c * static_cast<float>(p[e]);
      }
      for (int64_t e = 0; e < kTile; ++e) out[i + e] = static_cast<T>(acc[e]);
    }
#endif
    for (; i < b1; ++i) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = acc + coef[k] * static_cast<float>(src[k][i]);
      out[i] = static_cast<T>(acc);
    }
  }

  template <typename T>
  static void dequantize_sum(DequantizeList& l) {
    const int64_t B = l.block_size, K = l.K, T_ = l.T;
    const int64_t total = total_of(l.numels);
    const int64_t bytes = K * total + 4 * K * (total / B + T_) + total * int64_t(sizeof(T));
    const int64_t chunk = block_chunk(B, kSumChunk);
    // An output larger than the caches is not read back soon: writing it around them saves
    // reading every line before it is written.
    const bool stream = total * int64_t(sizeof(T)) >= kStreamOutBytes;
    for_each_chunk(l.numels, chunk, bytes, PassCost::kStreaming, [&](int64_t, const ChunkRange& r) {
      thread_local std::vector<float> coef;
      thread_local std::vector<const int8_t*> src;
      coef.resize(K);
      src.resize(K);
      for (int64_t k = 0; k < K; ++k) src[k] = l.values[k * T_ + r.tensor];
      T* out = static_cast<T*>(l.outs[r.tensor]);
      for (int64_t b0 = r.begin; b0 < r.end;) {
        const int64_t b = b0 / B;
        const int64_t b1 = std::min(r.end, (b + 1) * B);
        for (int64_t k = 0; k < K; ++k) {
          coef[k] = QuantizeMath::coefficient(l.weights[k], l.scales[k * T_ + r.tensor][b]);
        }
        block_sum<T>(src.data(), coef.data(), K, b0, b1, out, stream);
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
