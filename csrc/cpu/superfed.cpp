// CPU kernels of the SuPerFed ops (schemas: csrc/ops.cpp; host side: csrc/superfed_host.h;
// math: specs/superfed.md §1.5 and §3 K1-K3). Like every csrc/cpu/*.cpp this file is compiled
// once per instruction set (see setup.py) into a library of its own.
//
// Work: the plan's tensors are cut into chunks of kChunk elements (the parallel unit). The
// reductions (the lam gradient, the four statistics) are summed per tile in the accumulate
// type (fp32, fp64 for fp64 inputs) in vector lanes, each tile's sum is added in float64 to its
// chunk's partial, and the partials are added per tensor in chunk order after the parallel
// loop: the result does not depend on the number of threads, and is bitwise the same run after
// run.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "../elementwise.h"
#include "../superfed_host.h"
#include "vec_io.h"

namespace fedkernels {
namespace {

using at::vec::Vectorized;

constexpr int64_t kTile = 2048;    // elements per fp32 partial sum
constexpr int64_t kChunk = 65536;  // elements per parallel work item
// Below this many elements in all, one thread does the work: waking a thread team costs more
// than the pass (and, on a busy machine, can cost milliseconds). Models are lists of many
// small tensors, so the chunk count alone would start a team for a few thousand elements.
constexpr int64_t kParallelMin = 4 * kChunk;

template <typename A>
inline double horizontal_sum(const Vectorized<A>& lo, const Vectorized<A>& hi) {
  alignas(64) A buf[2 * Vectorized<A>::size()];
  lo.store(buf);
  hi.store(buf + Vectorized<A>::size());
  double s = 0;
  for (int i = 0; i < 2 * Vectorized<A>::size(); ++i) s += static_cast<double>(buf[i]);
  return s;
}

// The element range [begin, end) of tensor i of the plan that chunk c covers.
struct ChunkRange {
  int64_t tensor, begin, end;
};

// Calls fn(chunk index, range) for every chunk of the plan, in parallel.
template <typename Fn>
void for_each_chunk(const SuperfedPlan& p, Fn fn) {
  const int64_t n = p.num_tensors();
  std::vector<int64_t> chunk_begin(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    chunk_begin[i + 1] = chunk_begin[i] + (p.numels[i] + kChunk - 1) / kChunk;
  }
  int64_t total = 0;
  for (const auto numel : p.numels) total += numel;
  auto body = [&](int64_t c0, int64_t c1) {
    int64_t i = std::upper_bound(chunk_begin.begin(), chunk_begin.end(), c0) -
        chunk_begin.begin() - 1;
    for (int64_t c = c0; c < c1; ++c) {
      while (c >= chunk_begin[i + 1]) ++i;
      const int64_t begin = (c - chunk_begin[i]) * kChunk;
      fn(c, ChunkRange{i, begin, std::min(p.numels[i], begin + kChunk)});
    }
  };
  if (total < kParallelMin) {
    body(0, chunk_begin[n]);
  } else {
    at::parallel_for(0, chunk_begin[n], 1, body);
  }
}

int64_t num_chunks(const SuperfedPlan& p) {
  int64_t total = 0;
  for (const auto n : p.numels) total += (n + kChunk - 1) / kChunk;
  return total;
}

// Adds each chunk's partials (width per chunk) into result[index[i] * width + j], in chunk order.
void combine_partials(const SuperfedPlan& p, const std::vector<double>& partials, int width) {
  double* result = p.result.mutable_data_ptr<double>();
  int64_t c = 0;
  for (int64_t i = 0; i < p.num_tensors(); ++i) {
    const int64_t chunks = (p.numels[i] + kChunk - 1) / kChunk;
    double* row = result + p.index[i] * width;
    for (int64_t k = 0; k < chunks; ++k, ++c) {
      for (int j = 0; j < width; ++j) row[j] += partials[c * width + j];
    }
  }
}

template <typename T>
const T* in_ptr(const SuperfedPlan& p, int j, const ChunkRange& r) {
  return static_cast<const T*>(p.in[j][r.tensor]) + r.begin;
}

template <typename T>
T* out_ptr(const SuperfedPlan& p, int j, const ChunkRange& r) {
  void* o = p.out[j][r.tensor];
  return o == nullptr ? nullptr : static_cast<T*>(o) + r.begin;
}

// theta = lerp(g, l, lam_t).
template <typename T>
void mix_kernel(const SuperfedPlan& p) {
  using A = acc_type<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  const double* lam = p.coef.const_data_ptr<double>();
  for_each_chunk(p, [&](int64_t, const ChunkRange& r) {
    const T* g = in_ptr<T>(p, 0, r);
    const T* l = in_ptr<T>(p, 1, r);
    T* out = out_ptr<T>(p, 0, r);
    const A w = static_cast<A>(lam[p.index[r.tensor]]);
    const A omw = A(1) - w;
    const bool low = w < A(0.5);
    const Vec wv(w), ov(omw);
    const int64_t len = r.end - r.begin;
    const int64_t vec_len = len - len % step;
    for (int64_t j = 0; j < vec_len; j += step) {
      Vec g0, g1, l0, l1;
      load2<T, A>(g + j, g0, g1);
      load2<T, A>(l + j, l0, l1);
      store2<T, A>(out + j, MixMath::mix(g0, l0, wv, ov, low), MixMath::mix(g1, l1, wv, ov, low));
    }
    for (int64_t j = vec_len; j < len; ++j) {
      out[j] = static_cast<T>(
          MixMath::mix(static_cast<A>(g[j]), static_cast<A>(l[j]), w, omw, low));
    }
  });
}

// grad_g = (1 - lam) G, grad_l = lam G, dlam_t = sum G (l - g).
template <typename T>
void mix_backward_kernel(const SuperfedPlan& p) {
  using A = acc_type<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  const double* lam = p.coef.const_data_ptr<double>();
  const bool need_lam = p.need[2];
  std::vector<double> partials(need_lam ? num_chunks(p) : 0, 0.0);
  for_each_chunk(p, [&](int64_t c, const ChunkRange& r) {
    const T* grad = in_ptr<T>(p, 0, r);
    const T* g = in_ptr<T>(p, 1, r);
    const T* l = in_ptr<T>(p, 2, r);
    T* grad_g = out_ptr<T>(p, 0, r);
    T* grad_l = out_ptr<T>(p, 1, r);
    const A w = static_cast<A>(lam[p.index[r.tensor]]);
    const A omw = A(1) - w;
    const Vec wv(w), ov(omw);
    double chunk_sum = 0;
    for (int64_t t0 = 0; t0 < r.end - r.begin; t0 += kTile) {
      const int64_t len = std::min(kTile, r.end - r.begin - t0);
      const int64_t vec_len = len - len % step;
      Vec s0(A(0)), s1(A(0));
      for (int64_t j = t0; j < t0 + vec_len; j += step) {
        Vec G0, G1;
        load2<T, A>(grad + j, G0, G1);
        if (grad_g) store2<T, A>(grad_g + j, ov * G0, ov * G1);
        if (grad_l) store2<T, A>(grad_l + j, wv * G0, wv * G1);
        if (need_lam) {
          Vec g0, g1, l0, l1;
          load2<T, A>(g + j, g0, g1);
          load2<T, A>(l + j, l0, l1);
          s0 = s0 + MixMath::lam_term(G0, g0, l0);
          s1 = s1 + MixMath::lam_term(G1, g1, l1);
        }
      }
      double tile_sum = need_lam ? horizontal_sum(s0, s1) : 0.0;
      A tail = A(0);
      for (int64_t j = t0 + vec_len; j < t0 + len; ++j) {
        const A G = static_cast<A>(grad[j]);
        if (grad_g) grad_g[j] = static_cast<T>(omw * G);
        if (grad_l) grad_l[j] = static_cast<T>(w * G);
        if (need_lam) tail += MixMath::lam_term(G, static_cast<A>(g[j]), static_cast<A>(l[j]));
      }
      chunk_sum += tile_sum + static_cast<double>(tail);
    }
    if (need_lam) partials[c] = chunk_sum;
  });
  if (need_lam) combine_partials(p, partials, 1);
}

// Per tensor: <g, l>, ||g||^2, ||l||^2, ||g - a||^2.
template <typename T>
void stats_kernel(const SuperfedPlan& p) {
  using A = acc_type<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  const bool has_l = p.has_local, has_a = p.has_anchor;
  std::vector<double> partials(4 * num_chunks(p), 0.0);
  for_each_chunk(p, [&](int64_t c, const ChunkRange& r) {
    const T* g = in_ptr<T>(p, 0, r);
    const T* l = has_l ? in_ptr<T>(p, 1, r) : nullptr;
    const T* a = has_a ? in_ptr<T>(p, 2, r) : nullptr;
    double sums[4] = {0, 0, 0, 0};
    for (int64_t t0 = 0; t0 < r.end - r.begin; t0 += kTile) {
      const int64_t len = std::min(kTile, r.end - r.begin - t0);
      const int64_t vec_len = len - len % step;
      Vec acc[4][2];
      for (auto& v : acc) v[0] = v[1] = Vec(A(0));
      for (int64_t j = t0; j < t0 + vec_len; j += step) {
        Vec g0, g1;
        load2<T, A>(g + j, g0, g1);
        acc[1][0] = acc[1][0] + g0 * g0;
        acc[1][1] = acc[1][1] + g1 * g1;
        if (has_l) {
          Vec l0, l1;
          load2<T, A>(l + j, l0, l1);
          acc[0][0] = acc[0][0] + g0 * l0;
          acc[0][1] = acc[0][1] + g1 * l1;
          acc[2][0] = acc[2][0] + l0 * l0;
          acc[2][1] = acc[2][1] + l1 * l1;
        }
        if (has_a) {
          Vec a0, a1;
          load2<T, A>(a + j, a0, a1);
          const Vec d0 = StatsMath::diff(g0, a0), d1 = StatsMath::diff(g1, a1);
          acc[3][0] = acc[3][0] + d0 * d0;
          acc[3][1] = acc[3][1] + d1 * d1;
        }
      }
      A tail[4] = {A(0), A(0), A(0), A(0)};
      for (int64_t j = t0 + vec_len; j < t0 + len; ++j) {
        const A gj = static_cast<A>(g[j]);
        tail[1] += gj * gj;
        if (has_l) {
          const A lj = static_cast<A>(l[j]);
          tail[0] += gj * lj;
          tail[2] += lj * lj;
        }
        if (has_a) {
          const A d = StatsMath::diff(gj, static_cast<A>(a[j]));
          tail[3] += d * d;
        }
      }
      for (int k = 0; k < 4; ++k) {
        sums[k] += horizontal_sum(acc[k][0], acc[k][1]) + static_cast<double>(tail[k]);
      }
    }
    for (int k = 0; k < 4; ++k) partials[4 * c + k] = sums[k];
  });
  combine_partials(p, partials, 4);
}

// grad_g = H0 l + 2 H1 g + 2 H3 (g - a); grad_l = H0 g + 2 H2 l; grad_a = -2 H3 (g - a).
template <typename T>
void stats_backward_kernel(const SuperfedPlan& p) {
  using A = acc_type<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  const bool has_l = p.has_local, has_a = p.has_anchor;
  const double* h = p.coef.const_data_ptr<double>();
  for_each_chunk(p, [&](int64_t, const ChunkRange& r) {
    const T* g = in_ptr<T>(p, 0, r);
    const T* l = has_l ? in_ptr<T>(p, 1, r) : nullptr;
    const T* a = has_a ? in_ptr<T>(p, 2, r) : nullptr;
    T* grad_g = out_ptr<T>(p, 0, r);
    T* grad_l = out_ptr<T>(p, 1, r);
    T* grad_a = out_ptr<T>(p, 2, r);
    const double* row = h + 4 * p.index[r.tensor];
    const A h0 = has_l ? static_cast<A>(row[0]) : A(0);
    const A h1x2 = static_cast<A>(2 * row[1]);
    const A h2x2 = has_l ? static_cast<A>(2 * row[2]) : A(0);
    const A h3x2 = has_a ? static_cast<A>(2 * row[3]) : A(0);
    const Vec vh0(h0), vh1(h1x2), vh2(h2x2), vh3(h3x2), zero(A(0));
    const int64_t len = r.end - r.begin;
    const int64_t vec_len = len - len % step;
    for (int64_t j = 0; j < vec_len; j += step) {
      Vec g0, g1, l0 = zero, l1 = zero, d0 = zero, d1 = zero;
      load2<T, A>(g + j, g0, g1);
      if (has_l) load2<T, A>(l + j, l0, l1);
      if (has_a) {
        Vec a0, a1;
        load2<T, A>(a + j, a0, a1);
        d0 = StatsMath::diff(g0, a0);
        d1 = StatsMath::diff(g1, a1);
      }
      if (grad_g) {
        store2<T, A>(
            grad_g + j, StatsMath::grad_global(g0, l0, d0, vh0, vh1, vh3),
            StatsMath::grad_global(g1, l1, d1, vh0, vh1, vh3));
      }
      if (grad_l) {
        store2<T, A>(
            grad_l + j, StatsMath::grad_local(g0, l0, vh0, vh2),
            StatsMath::grad_local(g1, l1, vh0, vh2));
      }
      if (grad_a) store2<T, A>(grad_a + j, zero - vh3 * d0, zero - vh3 * d1);
    }
    for (int64_t j = vec_len; j < len; ++j) {
      const A gj = static_cast<A>(g[j]);
      const A lj = has_l ? static_cast<A>(l[j]) : A(0);
      const A d = has_a ? StatsMath::diff(gj, static_cast<A>(a[j])) : A(0);
      if (grad_g) grad_g[j] = static_cast<T>(StatsMath::grad_global(gj, lj, d, h0, h1x2, h3x2));
      if (grad_l) grad_l[j] = static_cast<T>(StatsMath::grad_local(gj, lj, h0, h2x2));
      if (grad_a) grad_a[j] = static_cast<T>(-(h3x2 * d));
    }
  });
}

// theta = lerp(g, l, lam_t) and the stats rows, in one pass over g, l, a.
template <typename T>
void mix_stats_kernel(const SuperfedPlan& p) {
  using A = acc_type<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  const bool has_a = p.has_anchor;
  const double* lam = p.coef.const_data_ptr<double>();
  std::vector<double> partials(4 * num_chunks(p), 0.0);
  for_each_chunk(p, [&](int64_t c, const ChunkRange& r) {
    const T* g = in_ptr<T>(p, 0, r);
    const T* l = in_ptr<T>(p, 1, r);
    const T* a = has_a ? in_ptr<T>(p, 2, r) : nullptr;
    T* out = out_ptr<T>(p, 0, r);
    const A w = static_cast<A>(lam[p.index[r.tensor]]);
    const A omw = A(1) - w;
    const bool low = w < A(0.5);
    const Vec wv(w), ov(omw);
    double sums[4] = {0, 0, 0, 0};
    for (int64_t t0 = 0; t0 < r.end - r.begin; t0 += kTile) {
      const int64_t len = std::min(kTile, r.end - r.begin - t0);
      const int64_t vec_len = len - len % step;
      Vec acc[4][2];
      for (auto& v : acc) v[0] = v[1] = Vec(A(0));
      for (int64_t j = t0; j < t0 + vec_len; j += step) {
        Vec g0, g1, l0, l1;
        load2<T, A>(g + j, g0, g1);
        load2<T, A>(l + j, l0, l1);
        store2<T, A>(out + j, MixMath::mix(g0, l0, wv, ov, low), MixMath::mix(g1, l1, wv, ov, low));
        acc[0][0] = acc[0][0] + g0 * l0;
        acc[0][1] = acc[0][1] + g1 * l1;
        acc[1][0] = acc[1][0] + g0 * g0;
        acc[1][1] = acc[1][1] + g1 * g1;
        acc[2][0] = acc[2][0] + l0 * l0;
        acc[2][1] = acc[2][1] + l1 * l1;
        if (has_a) {
          Vec a0, a1;
          load2<T, A>(a + j, a0, a1);
          const Vec d0 = StatsMath::diff(g0, a0), d1 = StatsMath::diff(g1, a1);
          acc[3][0] = acc[3][0] + d0 * d0;
          acc[3][1] = acc[3][1] + d1 * d1;
        }
      }
      A tail[4] = {A(0), A(0), A(0), A(0)};
      for (int64_t j = t0 + vec_len; j < t0 + len; ++j) {
        const A gj = static_cast<A>(g[j]), lj = static_cast<A>(l[j]);
        out[j] = static_cast<T>(MixMath::mix(gj, lj, w, omw, low));
        tail[0] += gj * lj;
        tail[1] += gj * gj;
        tail[2] += lj * lj;
        if (has_a) {
          const A d = StatsMath::diff(gj, static_cast<A>(a[j]));
          tail[3] += d * d;
        }
      }
      for (int k = 0; k < 4; ++k) {
        sums[k] += horizontal_sum(acc[k][0], acc[k][1]) + static_cast<double>(tail[k]);
      }
    }
    for (int k = 0; k < 4; ++k) partials[4 * c + k] = sums[k];
  });
  combine_partials(p, partials, 4);
}

// grad_g = (1 - lam) G + H0 l + 2 H1 g + 2 H3 (g - a); grad_l = lam G + H0 g + 2 H2 l;
// grad_a = -2 H3 (g - a); dlam_t = sum G (l - g): one pass over g, l, a, G.
template <typename T>
void mix_stats_backward_kernel(const SuperfedPlan& p) {
  using A = acc_type<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  const bool has_a = p.has_anchor;
  const bool need_lam = p.need[3];
  const double* lam = p.coef.const_data_ptr<double>();
  const double* h = p.coef2.const_data_ptr<double>();
  std::vector<double> partials(need_lam ? num_chunks(p) : 0, 0.0);
  for_each_chunk(p, [&](int64_t c, const ChunkRange& r) {
    const T* g = in_ptr<T>(p, 0, r);
    const T* l = in_ptr<T>(p, 1, r);
    const T* a = has_a ? in_ptr<T>(p, 2, r) : nullptr;
    const T* grad = in_ptr<T>(p, 3, r);
    T* grad_g = out_ptr<T>(p, 0, r);
    T* grad_l = out_ptr<T>(p, 1, r);
    T* grad_a = out_ptr<T>(p, 2, r);
    const int64_t t = p.index[r.tensor];
    const A w = static_cast<A>(lam[t]);
    const A omw = A(1) - w;
    const double* row = h + 4 * t;
    const A h0 = static_cast<A>(row[0]);
    const A h1x2 = static_cast<A>(2 * row[1]);
    const A h2x2 = static_cast<A>(2 * row[2]);
    const A h3x2 = has_a ? static_cast<A>(2 * row[3]) : A(0);
    const Vec wv(w), ov(omw), vh0(h0), vh1(h1x2), vh2(h2x2), vh3(h3x2), zero(A(0));
    double chunk_sum = 0;
    for (int64_t t0 = 0; t0 < r.end - r.begin; t0 += kTile) {
      const int64_t len = std::min(kTile, r.end - r.begin - t0);
      const int64_t vec_len = len - len % step;
      Vec s0(A(0)), s1(A(0));
      for (int64_t j = t0; j < t0 + vec_len; j += step) {
        Vec g0, g1, l0, l1, G0, G1, d0 = zero, d1 = zero;
        load2<T, A>(g + j, g0, g1);
        load2<T, A>(l + j, l0, l1);
        load2<T, A>(grad + j, G0, G1);
        if (has_a) {
          Vec a0, a1;
          load2<T, A>(a + j, a0, a1);
          d0 = StatsMath::diff(g0, a0);
          d1 = StatsMath::diff(g1, a1);
        }
        if (grad_g) {
          store2<T, A>(
              grad_g + j, ov * G0 + StatsMath::grad_global(g0, l0, d0, vh0, vh1, vh3),
              ov * G1 + StatsMath::grad_global(g1, l1, d1, vh0, vh1, vh3));
        }
        if (grad_l) {
          store2<T, A>(
              grad_l + j, wv * G0 + StatsMath::grad_local(g0, l0, vh0, vh2),
              wv * G1 + StatsMath::grad_local(g1, l1, vh0, vh2));
        }
        if (grad_a) store2<T, A>(grad_a + j, zero - vh3 * d0, zero - vh3 * d1);
        if (need_lam) {
          s0 = s0 + MixMath::lam_term(G0, g0, l0);
          s1 = s1 + MixMath::lam_term(G1, g1, l1);
        }
      }
      double tile_sum = need_lam ? horizontal_sum(s0, s1) : 0.0;
      A tail = A(0);
      for (int64_t j = t0 + vec_len; j < t0 + len; ++j) {
        const A gj = static_cast<A>(g[j]), lj = static_cast<A>(l[j]);
        const A G = static_cast<A>(grad[j]);
        const A d = has_a ? StatsMath::diff(gj, static_cast<A>(a[j])) : A(0);
        if (grad_g) {
          grad_g[j] = static_cast<T>(omw * G + StatsMath::grad_global(gj, lj, d, h0, h1x2, h3x2));
        }
        if (grad_l) grad_l[j] = static_cast<T>(w * G + StatsMath::grad_local(gj, lj, h0, h2x2));
        if (grad_a) grad_a[j] = static_cast<T>(-(h3x2 * d));
        if (need_lam) tail += MixMath::lam_term(G, gj, lj);
      }
      chunk_sum += tile_sum + static_cast<double>(tail);
    }
    if (need_lam) partials[c] = chunk_sum;
  });
  if (need_lam) combine_partials(p, partials, 1);
}

template <typename T>
void run_typed(const SuperfedPlan& p) {
  switch (p.kind) {
    case SuperfedKind::kMix: return mix_kernel<T>(p);
    case SuperfedKind::kMixBackward: return mix_backward_kernel<T>(p);
    case SuperfedKind::kStats: return stats_kernel<T>(p);
    case SuperfedKind::kStatsBackward: return stats_backward_kernel<T>(p);
    case SuperfedKind::kMixStats: return mix_stats_kernel<T>(p);
    case SuperfedKind::kMixStatsBackward: return mix_stats_backward_kernel<T>(p);
  }
}

void superfed_cpu_group(const SuperfedPlan& p) {
  switch (p.dtype) {
    case at::kFloat: return run_typed<float>(p);
    case at::kDouble: return run_typed<double>(p);
    case at::kHalf: return run_typed<at::Half>(p);
    case at::kBFloat16: return run_typed<at::BFloat16>(p);
    default: TORCH_CHECK(false, "fedkernels: unsupported dtype ", p.dtype);
  }
}

std::vector<at::Tensor> mix_endpoints_cpu(
    at::TensorList g, at::TensorList l, const at::Tensor& lam) {
  return mix_endpoints_host(g, l, lam, &superfed_cpu_group);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
mix_endpoints_backward_cpu(
    at::TensorList grads, at::TensorList g, at::TensorList l, const at::Tensor& lam,
    std::array<bool, 3> mask) {
  return mix_endpoints_backward_host(grads, g, l, lam, mask, &superfed_cpu_group);
}

at::Tensor superfed_stats_cpu(at::TensorList g, at::TensorList l, at::TensorList a) {
  return superfed_stats_host(g, l, a, &superfed_cpu_group);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
superfed_stats_backward_cpu(
    const at::Tensor& grad_stats, at::TensorList g, at::TensorList l, at::TensorList a,
    std::array<bool, 3> mask) {
  return superfed_stats_backward_host(grad_stats, g, l, a, mask, &superfed_cpu_group);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> mix_endpoints_with_stats_cpu(
    at::TensorList g, at::TensorList l, const at::Tensor& lam, at::TensorList a) {
  return mix_endpoints_with_stats_host(g, l, lam, a, &superfed_cpu_group);
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, std::vector<at::Tensor>>
mix_endpoints_with_stats_backward_cpu(
    at::TensorList grads, const at::Tensor& grad_stats, at::TensorList g, at::TensorList l,
    const at::Tensor& lam, at::TensorList a, std::array<bool, 4> mask) {
  return mix_endpoints_with_stats_backward_host(
      grads, grad_stats, g, l, lam, a, mask, &superfed_cpu_group);
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  m.impl("mix_endpoints", &mix_endpoints_cpu);
  m.impl("mix_endpoints_backward", &mix_endpoints_backward_cpu);
  m.impl("superfed_stats", &superfed_stats_cpu);
  m.impl("superfed_stats_backward", &superfed_stats_backward_cpu);
  m.impl("mix_endpoints_with_stats", &mix_endpoints_with_stats_cpu);
  m.impl("mix_endpoints_with_stats_backward", &mix_endpoints_with_stats_backward_cpu);
}

}  // namespace fedkernels
