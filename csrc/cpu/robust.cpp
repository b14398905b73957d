// CPU kernels of the robust-aggregation ops (schemas: csrc/ops.cpp; host side:
// csrc/robust_host.h; per-coordinate rules: csrc/order_stats.h, shared with the CUDA kernels).
//
// Order statistics: chunks of every tensor are the parallel unit. A chunk takes its
// coordinates a vector width at a time: the K client values of those coordinates are gathered,
// sorted by a branch-free network of vector min/max (Batcher's) and reduced, with the values of
// the scalar rule of csrc/order_stats.h (NaN last). A group with a NaN goes through the same
// network with stand-ins for its NaNs, and the lanes whose rule sees a NaN return NaN, so one
// client sending NaN (the simplest attack on a robust rule) does not send every group to the
// much slower scalar rule. No [K, P] stack is built: each client is read once, in place.
//
// Distances: chunks of up to kDistChunk elements, sized from the model alone (balanced_chunk),
// are the work items; a chunk converts its K slices to float64 a block at a time and adds
// sum_e (x_i[e] - x_j[e])^2 for every pair i < j to its own row of partial sums, which are added
// chunk by chunk in chunk order at the end, so the result is the same for any number of
// threads.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../order_stats.h"
#include "../robust_host.h"
#include "chunk_loop.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kRobustChunk = 4096;     // the most coordinates per work item (balanced_chunk)
constexpr int64_t kRobustAlign = 64;       // whole vector groups per work item, in any build
constexpr int64_t kDistChunk = 1 << 16;    // most elements per distance work item (a partial row)
constexpr int64_t kDistBlock = 256;        // elements converted to float64 at a time
constexpr int kPairGroup = 4;              // pairs whose sums run together

// Order statistics of more than kPrefetchFromClients clients prefetch each client's values
// kPrefetchAhead bytes ahead into L2: the hardware prefetchers follow about that many streams,
// and fewer clients lose by the extra instructions. Both values chosen by
// bench/bench_robust_ops.py.
constexpr int64_t kPrefetchFromClients = 16;
constexpr int64_t kPrefetchAhead = 1024;

// The distances read each client's next block kDistPrefetchAhead bytes ahead into L2 as they
// convert a block (chosen by bench/bench_robust_ops.py).
constexpr int64_t kDistPrefetchAhead = 2048;

// The compare-exchanges (i, j), i < j, of Batcher's odd-even merge sort of K values: the network
// for the next power of two with every pair that reaches past K - 1 dropped (those would compare
// with padding values above every number, which never move). K = 10 takes 32 of them and
// K = 50 403, where an odd-even transposition sort takes 45 and 1225.
// fn(i, j) for each compare-exchange in order; constexpr, so it also builds the compile-time
// lists below.
template <typename Fn>
constexpr void for_each_batcher_pair(int64_t K, Fn&& fn) {
  for (int64_t p = 1; p < K; p <<= 1) {
    for (int64_t k = p; k >= 1; k >>= 1) {
      for (int64_t j = k % p; j + k < K; j += 2 * k) {
        for (int64_t i = 0; i < std::min(k, K - j - k); ++i) {
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) fn(i + j, i + j + k);
        }
      }
    }
  }
}

std::vector<std::pair<int32_t, int32_t>> batcher_pairs(int64_t K) {
  std::vector<std::pair<int32_t, int32_t>> pairs;
  for_each_batcher_pair(K, [&](int64_t i, int64_t j) {
    pairs.emplace_back(static_cast<int32_t>(i), static_cast<int32_t>(j));
  });
  return pairs;
}

// Lane-wise min and max of vectors without NaN: one instruction each (at::vec::minimum and
// maximum add two more to carry NaN, which the callers have ruled out). Same operand order as
// those, so equal zeros of either sign resolve as they would.
template <typename A>
C10_ALWAYS_INLINE Vectorized<A> min_number(Vectorized<A> a, Vectorized<A> b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) return _mm512_min_ps(a, b);
  if constexpr (std::is_same_v<A, double>) return _mm512_min_pd(a, b);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) return _mm256_min_ps(a, b);
  if constexpr (std::is_same_v<A, double>) return _mm256_min_pd(a, b);
#endif
  return at::vec::minimum(a, b);
}
template <typename A>
C10_ALWAYS_INLINE Vectorized<A> max_number(Vectorized<A> a, Vectorized<A> b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) return _mm512_max_ps(a, b);
  if constexpr (std::is_same_v<A, double>) return _mm512_max_pd(a, b);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) return _mm256_max_ps(a, b);
  if constexpr (std::is_same_v<A, double>) return _mm256_max_pd(a, b);
#endif
  return at::vec::maximum(a, b);
}

// Sorts W coordinates at once: v[k] holds client k's values of the W coordinates (no NaN), by
// the network `pairs` (batcher_pairs). Branch-free; any sorting network leaves the same sorted
// values (equal zeros of opposite signs may trade places).
template <typename A>
void sort_columns(Vectorized<A>* v, const std::vector<std::pair<int32_t, int32_t>>& pairs) {
  for (const auto& [i, j] : pairs) {
    const Vectorized<A> lo = min_number(v[i], v[j]);
    v[j] = max_number(v[i], v[j]);
    v[i] = lo;
  }
}

// row[g] += sum_e (xi[e] - xj[e])^2 for the G clients j = j0 .. j0 + G - 1 of a block (client
// j's len values at buf + j * kDistBlock): vector partial sums in element order, their lanes
// added in lane order, then the scalar tail.
template <int G>
C10_ALWAYS_INLINE void pair_sums(const double* xi, const double* buf, int64_t j0, int64_t len,
                                 double* row) {
  using Vec = Vectorized<double>;
  constexpr int64_t W = Vec::size();
  const double* xj[G];
  Vec acc[G];
  for (int g = 0; g < G; ++g) {
    xj[g] = buf + (j0 + g) * kDistBlock;
    acc[g] = Vec(0.0);
  }
  int64_t e = 0;
  for (; e + W <= len; e += W) {
    const Vec a = Vec::loadu(xi + e);
    for (int g = 0; g < G; ++g) {
      const Vec diff = a - Vec::loadu(xj[g] + e);
      acc[g] = acc[g] + diff * diff;
    }
  }
  for (int g = 0; g < G; ++g) {
    double lanes[W];
    acc[g].store(lanes);
    double s = 0.0;
    for (int64_t l = 0; l < W; ++l) s += lanes[l];
    for (int64_t t = e; t < len; ++t) s += (xi[t] - xj[g][t]) * (xi[t] - xj[g][t]);
    row[g] += s;
  }
}

// The same network as a compile-time list, run on K vectors held in registers: for up to
// kFixedNetworkMax clients in the AVX-512 build, whose 32 vector registers hold them. Builds
// with fewer registers keep the run-time list (sort_columns), which is faster there.
template <int K>
constexpr int batcher_size() {
  int count = 0;
  for_each_batcher_pair(K, [&](int64_t, int64_t) { ++count; });
  return count;
}
template <int K>
constexpr std::array<std::pair<int, int>, batcher_size<K>()> batcher_array() {
  std::array<std::pair<int, int>, batcher_size<K>()> out{};
  int n = 0;
  for_each_batcher_pair(K, [&](int64_t i, int64_t j) {
    out[n++] = {static_cast<int>(i), static_cast<int>(j)};
  });
  return out;
}
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kFixedNetworkMax = 16;
#else
constexpr int64_t kFixedNetworkMax = 0;  // none
#endif

template <typename A>
C10_ALWAYS_INLINE void compare_exchange(Vectorized<A>& a, Vectorized<A>& b) {
  const Vectorized<A> lo = min_number(a, b);
  b = max_number(a, b);
  a = lo;
}

template <int K, typename A>
C10_ALWAYS_INLINE void sort_fixed(Vectorized<A>* v) {
  constexpr auto net = batcher_array<K>();
  Vectorized<A> r[K];
  for (int k = 0; k < K; ++k) r[k] = v[k];
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (compare_exchange(r[net[I].first], r[net[I].second]), ...);
  }(std::make_index_sequence<net.size()>{});
  for (int k = 0; k < K; ++k) v[k] = r[k];
}

template <typename A>
void sort_fixed_any(Vectorized<A>* v, int64_t K) {
  switch (K) {
    case 2: sort_fixed<2>(v); break;
    case 3: sort_fixed<3>(v); break;
    case 4: sort_fixed<4>(v); break;
    case 5: sort_fixed<5>(v); break;
    case 6: sort_fixed<6>(v); break;
    case 7: sort_fixed<7>(v); break;
    case 8: sort_fixed<8>(v); break;
    case 9: sort_fixed<9>(v); break;
    case 10: sort_fixed<10>(v); break;
    case 11: sort_fixed<11>(v); break;
    case 12: sort_fixed<12>(v); break;
    case 13: sort_fixed<13>(v); break;
    case 14: sort_fixed<14>(v); break;
    case 15: sort_fixed<15>(v); break;
    case 16: sort_fixed<16>(v); break;
    default: break;
  }
}

// The median window rule (OrderStats::reduce_sorted) of W coordinates at once, from their K
// sorted columns: the window of w values grown from the lower middle one is [s, s + w) for the
// lowest start s that keeps that value inside, moved up by one for every later start t where
// |v[t + w] - med| < |med - v[t]|. That test, on the same differences the growth compares, is
// true and then false as t grows, so the window is found without the growth's per-lane
// branches; its values are then picked by blends and summed in ascending order, as the scalar
// rule does. An infinite median breaks that order (inf - inf is NaN): false then, and the
// caller takes the scalar rule. Infinite values around a finite median keep it (their
// distances are +inf, ordered like any other), so one client sending +inf does not send every
// group to the scalar rule. `moved` holds K vectors of scratch.
template <typename A>
bool median_window_sorted(const Vectorized<A>* cols, int64_t K, int64_t w, Vectorized<A>* moved,
                          A* res) {
  using Vec = Vectorized<A>;
  const Vec med = K % 2 ? cols[K / 2] : (cols[K / 2 - 1] + cols[K / 2]) / Vec(A(2));
  const Vec infinite = (med - med) != Vec(A(0));
  if (infinite.zero_mask() != (1 << Vec::size()) - 1) return false;  // a lane is not 0
  const int64_t lo_mid = (K - 1) / 2;
  const int64_t first = std::max<int64_t>(0, lo_mid - w + 1);
  const int64_t moves = std::min(lo_mid, K - w) - first;
  for (int64_t o = 0; o < moves; ++o) {  // moved[o]: the window starts above first + o
    const int64_t t = first + o;
    moved[o] = (cols[t + w] - med).abs() < (med - cols[t]).abs();
  }
  auto value = [&](int64_t j) {  // the window's j-th value
    Vec v = cols[first + j];
    for (int64_t o = 0; o < moves; ++o) v = Vec::blendv(v, cols[first + o + 1 + j], moved[o]);
    return v;
  };
  Vec sum = value(0);
  for (int64_t j = 1; j < w; ++j) sum = sum + value(j);
  (sum / Vec(static_cast<A>(w))).store(res);
  return true;
}

struct RobustCpu {
  template <typename T>
  static void robust(ClientListPlan& p) {
    using A = acc_type<T>;
    using Vec = Vectorized<A>;
    constexpr int64_t W = Vec::size();
    const int64_t K = p.K, n = p.num_tensors();
    const int64_t bytes = (K + 1) * total_numel(p.numels) * int64_t(sizeof(T));
    const auto network = batcher_pairs(K);
    const bool prefetch = K > kPrefetchFromClients;
    // Chunks that split evenly between the threads (split_for_threads). Each coordinate's
    // result is its own, whatever the chunks.
    const int64_t chunk = split_for_threads(kRobustChunk, total_numel(p.numels), kRobustAlign,
                                            bytes, PassCost::kArithmetic);
    for_each_chunk(p.numels, chunk, bytes, PassCost::kArithmetic, [&](int64_t, const ChunkRange& r) {
      std::vector<A> v(K), lanes(K * W);
      std::vector<Vec> cols(K), moved(K);
      // Client k's coordinates [r.begin, r.end) as A at x[k][0..len): the input itself, or
      // for fp16/bf16 converted by vector instructions into a per-thread buffer first (a
      // scalar cast per value does not vectorize). The results go to `res` and are converted
      // back at the end.
      const int64_t len = r.end - r.begin;
      constexpr bool kConvert = !std::is_same_v<T, A>;
      thread_local std::vector<A> converted;
      if (kConvert && converted.size() < static_cast<size_t>((K + 1) * len)) {
        converted.resize((K + 1) * len);
      }
      std::vector<const A*> x(K);
      for (int64_t k = 0; k < K; ++k) {
        const T* src = static_cast<const T*>(p.inputs[k * n + r.tensor]) + r.begin;
        if constexpr (kConvert) {
          convert_to_acc(src, converted.data() + k * len, len);
          x[k] = converted.data() + k * len;
        } else {
          x[k] = src;
        }
      }
      T* out = static_cast<T*>(p.outs[r.tensor]) + r.begin;
      A* res_out = nullptr;
      if constexpr (kConvert) {
        res_out = converted.data() + K * len;
      } else {
        res_out = out;
      }
      auto scalar = [&](int64_t e) {
        for (int64_t k = 0; k < K; ++k) v[k] = x[k][e];
        res_out[e] = OrderStats::reduce<A>(v.data(), K, p.rule, p.param);
      };
      int64_t e = 0;
      for (; e + W <= len; e += W) {
        bool has_nan = false;
        Vec unordered(A(0));  // all ones in a lane where some client is NaN
        for (int64_t k = 0; k < K; ++k) {
          if (prefetch && !kConvert) {  // an address: it may lie past the tensor's end (never read)
            __builtin_prefetch(
                reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(x[k] + e) + kPrefetchAhead),
                0, 2);
          }
          cols[k] = Vec::loadu(x[k] + e);
          unordered = unordered | (cols[k] != cols[k]);
        }
        unordered.store(lanes.data());
        for (int64_t l = 0; l < W; ++l) has_nan |= lanes[l] != A(0);
        // A lane returns NaN where its rule sees one (OrderStats::reduce_sorted): for the median
        // and the window, any NaN; for the trimmed mean, more NaNs than the cut, which drops
        // them otherwise (NaN sorts last). So a NaN enters the network as +inf for the trimmed
        // mean (after every number; a tie with a real +inf changes no value) and as 0 for the
        // others, whose NaN lanes are overwritten (with +inf, a lane of many NaNs would have an
        // infinite median, which sends the window's group to the scalar rule).
        alignas(64) A nan_count[W];
        if (has_nan) {
          const Vec stand_in(p.rule == RobustRule::kTrimmedMean
                                 ? std::numeric_limits<A>::infinity() : A(0));
          Vec count(A(0));
          for (int64_t k = 0; k < K; ++k) {
            const Vec is_nan = cols[k] != cols[k];
            count = count + (is_nan & Vec(A(1)));
            cols[k] = Vec::blendv(cols[k], stand_in, is_nan);
          }
          count.store(nan_count);
        }
        bool sorted = false;
        if constexpr (kFixedNetworkMax > 0) {
          if (K <= kFixedNetworkMax) {
            sort_fixed_any(cols.data(), K);
            sorted = true;
          }
        }
        if (!sorted) sort_columns(cols.data(), network);
        A res[W];
        if (p.rule == RobustRule::kMedianWindow) {
          if (!median_window_sorted(cols.data(), K, p.param, moved.data(), res)) {
            for (int64_t k = 0; k < K; ++k) cols[k].store(lanes.data() + k * W);
            for (int64_t l = 0; l < W; ++l) {
              for (int64_t k = 0; k < K; ++k) v[k] = lanes[k * W + l];
              res[l] = OrderStats::reduce_sorted<A>(v.data(), K, K, p.rule, p.param);
            }
          }
        } else {
          // the same operations, in the same order, as OrderStats::reduce_sorted
          const int64_t lo = p.rule == RobustRule::kMedian ? (K - 1) / 2 : p.param;
          const int64_t hi = p.rule == RobustRule::kMedian ? K / 2 + 1 : K - p.param;
          Vec sum = cols[lo];
          for (int64_t k = lo + 1; k < hi; ++k) sum = sum + cols[k];
          (sum / Vec(static_cast<A>(hi - lo))).store(res);
        }
        if (has_nan) {
          const A allowed = p.rule == RobustRule::kTrimmedMean ? A(p.param) : A(0);
          for (int64_t l = 0; l < W; ++l) {
            if (nan_count[l] > allowed) res[l] = OrderStats::nan<A>();
          }
        }
        for (int64_t l = 0; l < W; ++l) res_out[e + l] = res[l];
      }
      for (; e < len; ++e) scalar(e);
      if constexpr (kConvert) convert_from_acc(res_out, out, len);
    });
  }

  template <typename T>
  static void distances(ClientListPlan& p) {
    const int64_t K = p.K, n = p.num_tensors();
    const int64_t pairs = K * (K - 1) / 2;
    std::vector<int64_t> prefix(n + 1);
    const int64_t chunk = balanced_chunk(total_numel(p.numels), kDistChunk, kDistBlock);
    const int64_t chunks = fill_chunk_prefix(p.numels.data(), n, chunk, prefix.data());
    std::vector<double> partial(static_cast<size_t>(chunks * pairs), 0.0);
    const int64_t bytes = K * total_numel(p.numels) * int64_t(sizeof(T));
    for_each_chunk(p.numels, chunk, bytes, PassCost::kArithmetic, [&](int64_t c, const ChunkRange& r) {
      double* row = partial.data() + c * pairs;
      thread_local std::vector<double> buf;  // reused: small models have many small chunks
      buf.resize(static_cast<size_t>(K * kDistBlock));
      for (int64_t b0 = r.begin; b0 < r.end; b0 += kDistBlock) {
        const int64_t len = std::min(kDistBlock, r.end - b0);
        for (int64_t k = 0; k < K; ++k) {
          const T* x = static_cast<const T*>(p.inputs[k * n + r.tensor]) + b0;
          double* d = buf.data() + k * kDistBlock;
          // The same span kDistPrefetchAhead bytes on (an address: past the tensor's end at its
          // last blocks, never read).
          const uintptr_t ahead = reinterpret_cast<uintptr_t>(x) + kDistPrefetchAhead;
          for (int64_t o = 0; o < len * int64_t(sizeof(T)); o += 64) {
            __builtin_prefetch(reinterpret_cast<const void*>(ahead + o), 0, 2);
          }
          for (int64_t e = 0; e < len; ++e) d[e] = static_cast<double>(x[e]);
        }
        // Pairs (i, j) a group of up to kPairGroup j's at a time: their sums are independent
        // chains that overlap (one pair's chain of dependent adds leaves the core mostly idle),
        // and x_i is loaded once for the group. Each pair adds its terms in the same order as
        // alone.
        int64_t q = 0;
        for (int64_t i = 0; i < K; ++i) {
          const double* xi = buf.data() + i * kDistBlock;
          for (int64_t j0 = i + 1; j0 < K; j0 += kPairGroup) {
            const int g = static_cast<int>(std::min<int64_t>(kPairGroup, K - j0));
            switch (g) {
              case 4: pair_sums<4>(xi, buf.data(), j0, len, row + q); break;
              case 3: pair_sums<3>(xi, buf.data(), j0, len, row + q); break;
              case 2: pair_sums<2>(xi, buf.data(), j0, len, row + q); break;
              default: pair_sums<1>(xi, buf.data(), j0, len, row + q); break;
            }
            q += g;
          }
        }
      }
    });
    double* d = p.sums.mutable_data_ptr<double>();
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t q = 0;
      for (int64_t i = 0; i < K; ++i) {
        for (int64_t j = i + 1; j < K; ++j, ++q) d[i * K + j] += partial[c * pairs + q];
      }
    }
    for (int64_t i = 0; i < K; ++i) {
      for (int64_t j = i + 1; j < K; ++j) d[j * K + i] = d[i * K + j];
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  register_robust<RobustCpu>(m);
}

}  // namespace fedkernels
