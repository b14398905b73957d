// Per-coordinate order statistics over K client values, shared by the CPU and CUDA kernels of
// the robust rules (formulas in csrc/ops.cpp; the rules and their NumPy/Flower equivalents in
// docs/algorithms/robust_and_private.md). Each function takes the K values of one coordinate
// in a scratch array v (in the accumulate type A), sorts it ascending with NaN last, and
// reduces it; the sum over kept values runs in ascending order, so a result never depends on
// the order of the clients, the thread count or the device.
#pragma once

#include <cstdint>
#include <type_traits>

#include "host_device.h"

namespace fedkernels {

enum class RobustRule : int { kMedian = 0, kTrimmedMean = 1, kMedianWindow = 2 };

struct OrderStats {
  template <typename A>
  FEDKERNELS_HD static bool is_nan(A x) {
    return x != x;
  }

  // The NaN a rule returns (the vector kernels return the same bits).
  template <typename A>
  FEDKERNELS_HD static A nan() {
    return A(0) / A(0);
  }

  // Moves the NaNs of v[0, n) to the end and sorts the others ascending (insertion sort: K is
  // small, and it needs no extra memory on the device). Returns the number of numbers.
  template <typename A>
  FEDKERNELS_HD static int64_t sort_nan_last(A* v, int64_t n) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (!is_nan(v[i])) {
        const A x = v[i];
        v[i] = v[m];
        v[m++] = x;
      }
    }
    for (int64_t i = 1; i < m; ++i) {
      const A x = v[i];
      int64_t j = i - 1;
      while (j >= 0 && v[j] > x) {
        v[j + 1] = v[j];
        --j;
      }
      v[j + 1] = x;
    }
    return m;
  }

  // Mean of the sorted v[lo, hi), summed in ascending order. (V: a pointer, or a type with
  // operator[] and ascending_sum, such as the CUDA kernels' register arrays, which add the same
  // terms in the same order without indexing at run time.)
  template <typename A, typename V>
  FEDKERNELS_HD static A mean_of(const V& v, int64_t lo, int64_t hi) {
    A s;
    if constexpr (std::is_pointer_v<V>) {
      s = v[lo];
      for (int64_t i = lo + 1; i < hi; ++i) s += v[i];
    } else {
      s = v.template ascending_sum<A>(lo, hi);
    }
    return s / static_cast<A>(hi - lo);
  }

  // The rule on sorted v[0, n) whose first m entries are numbers (the rest NaN):
  //   median: middle value (odd n) or (v[n/2 - 1] + v[n/2]) / 2 (even n, as np.median), NaN
  //           when any value is NaN;
  //   trimmed mean (param = cut c): mean of ranks [c, n - c), NaN when that range holds a NaN;
  //   median window (param = window w): mean of the w values closest to the median, a
  //           contiguous range grown from the lower middle value towards the closer side (the
  //           lower side on a tie); NaN when any value is NaN.
  template <typename A, typename V>
  FEDKERNELS_HD static A reduce_sorted(const V& v, int64_t n, int64_t m, RobustRule rule,
                                       int64_t param) {
    const A nan = OrderStats::nan<A>();
    if (rule == RobustRule::kTrimmedMean) {
      return n - param > m ? nan : mean_of<A>(v, param, n - param);
    }
    if (m < n) return nan;
    const int64_t lo_mid = (n - 1) / 2;
    const A med = (n % 2) ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / A(2);
    if (rule == RobustRule::kMedian) return med;
    int64_t lo = lo_mid, hi = lo_mid;  // inclusive window
    for (int64_t grown = 1; grown < param; ++grown) {
      const bool can_lo = lo > 0, can_hi = hi < n - 1;
      const A d_lo = can_lo ? med - v[lo - 1] : A(0);
      const A d_hi = can_hi ? v[hi + 1] - med : A(0);
      const A a_lo = d_lo < A(0) ? -d_lo : d_lo;
      const A a_hi = d_hi < A(0) ? -d_hi : d_hi;
      if (can_lo && (!can_hi || a_lo <= a_hi)) {
        --lo;
      } else {
        ++hi;
      }
    }
    return mean_of<A>(v, lo, hi + 1);
  }

  template <typename A>
  FEDKERNELS_HD static A reduce(A* v, int64_t n, RobustRule rule, int64_t param) {
    const int64_t m = sort_nan_last(v, n);
    return reduce_sorted<A>(v, n, m, rule, param);
  }
};

}  // namespace fedkernels
