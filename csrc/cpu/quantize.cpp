// CPU kernels of the quantized-update ops (schemas: csrc/ops.cpp; host side:
// csrc/quantize_host.h; per-element math: QuantizeMath in csrc/elementwise.h).
//
// quantize_int8: chunks of whole blocks of one tensor are the work items; a block is read
// twice (max|v|, then the rounding) from a buffer of v = x (+ residual) in the accumulate type.
// The stochastic words are Philox words of the element's index in the whole list, so the
// values do not depend on the chunks or the threads.
// dequantize_weighted_sum: chunks of every tensor are the work items, walked in L1 tiles of
// fp32 accumulators; each client's int8 values stream through the tile once, in client order,
// with one coefficient w_k s_kb per block.
#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../elementwise.h"
#include "../quantize_host.h"
#include "chunk_loop.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

constexpr int64_t kQuantChunk = 1 << 14;  // elements per quantize work item (whole blocks)
constexpr int64_t kSumChunk = 1 << 14;    // elements per dequantize work item
constexpr int64_t kSumTile = 1024;        // fp32 accumulators of one tile: 4 KiB of L1
constexpr int kLanes = 16;                // independent maxima per block (vectorizable)

// Elements per chunk: a multiple of the block, about `want` elements.
inline int64_t block_chunk(int64_t block, int64_t want) {
  return block >= want ? block : want / block * block;
}

struct QuantizeCpu {
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
        // max|v| in kLanes lanes, and a lane sum of v * 0, NaN when any v is NaN or infinite.
        A m[kLanes] = {}, z[kLanes] = {};
        int64_t j = 0;
        for (; j + kLanes <= len; j += kLanes) {
          for (int i = 0; i < kLanes; ++i) {
            const A a = std::abs(v[j + i]);
            m[i] = m[i] < a ? a : m[i];
            z[i] = z[i] + v[j + i] * A(0);
          }
        }
        for (; j < len; ++j) {
          const A a = std::abs(v[j]);
          m[0] = m[0] < a ? a : m[0];
          z[0] = z[0] + v[j] * A(0);
        }
        A amax = m[0], zs = z[0];
        for (int i = 1; i < kLanes; ++i) {
          amax = amax < m[i] ? m[i] : amax;
          zs = zs + z[i];
        }
        const float s = QuantizeMath::scale_of<A>(amax, !std::isnan(zs));
        scales[b0 / B] = s;
        int8_t* qb = q + b0;
        if (l.stochastic) {
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
          for (int64_t i = 0; i < len; ++i) qb[i] = QuantizeMath::quantize<A>(v[i], s, false, 0.0f);
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

  template <typename T>
  static void dequantize_sum(DequantizeList& l) {
    const int64_t B = l.block_size, K = l.K, T_ = l.T;
    const int64_t total = total_of(l.numels);
    const int64_t bytes = K * total + 4 * K * (total / B + T_) + total * int64_t(sizeof(T));
    const int64_t chunk = block_chunk(B, kSumChunk);
    for_each_chunk(l.numels, chunk, bytes, PassCost::kStreaming, [&](int64_t, const ChunkRange& r) {
      alignas(64) float acc[kSumTile];
      T* out = static_cast<T*>(l.outs[r.tensor]);
      for (int64_t off = r.begin; off < r.end; off += kSumTile) {
        const int64_t len = std::min(kSumTile, r.end - off);
        std::fill(acc, acc + len, 0.0f);
        for (int64_t k = 0; k < K; ++k) {
          const int8_t* q = l.values[k * T_ + r.tensor];
          const float* s = l.scales[k * T_ + r.tensor];
          const float w = l.weights[k];
          // The tile's blocks, one coefficient each (a tile may start or end inside a block).
          for (int64_t j = off; j < off + len;) {
            const int64_t b = j / B;
            const int64_t end = std::min(off + len, (b + 1) * B);
            const float c = QuantizeMath::coefficient(w, s[b]);
            float* a = acc + (j - off);
            const int8_t* qj = q + j;
            for (int64_t i = 0; i < end - j; ++i) a[i] = a[i] + c * static_cast<float>(qj[i]);
            j = end;
          }
        }
        if constexpr (std::is_same_v<T, float>) {
          std::copy(acc, acc + len, out + off);
        } else {
          for (int64_t i = 0; i < len; ++i) out[off + i] = static_cast<T>(acc[i]);
        }
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_quantize<QuantizeCpu>(m);
}

}  // namespace fedkernels
