// The K values of one coordinate, held in registers and sorted by a sorting network, for the
// CUDA order-statistics kernel (csrc/cuda/robust.cu). Host-compilable (FEDKERNELS_HD), so the
// network can be checked against OrderStats::reduce on the CPU.
//
// Each value is stored as an unsigned integer key whose integer order is the order the rules
// need: -inf < ... < -0 < +0 < ... < +inf < NaN (every NaN as one key). A compare-exchange is
// then a min and a max, two instructions, where comparing floats with NaN-last needs several
// compares and selects. The network is Batcher's odd-even merge sort (N = 16: 63
// compare-exchanges, N = 64: 543, against 120 and 2016 for odd-even transposition). Every index
// is a compile-time constant once the loops are unrolled, so the keys never leave registers.
// Ordering -0 before +0 makes the result independent of the order of the clients, bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../host_device.h"

namespace fedkernels {

template <typename A>
struct SortKey {
  using Key = std::conditional_t<sizeof(A) == 8, uint64_t, uint32_t>;
  static constexpr Key kSign = Key(1) << (8 * sizeof(A) - 1);
  static constexpr Key kNaN = ~Key(0);

  FEDKERNELS_HD static Key of(A x) {
    Key b;
    memcpy(&b, &x, sizeof(A));
    // negative: flip every bit (larger magnitude sorts lower); else set the sign bit
    const Key flip = (b & kSign) ? ~Key(0) : kSign;
    return x != x ? kNaN : (b ^ flip);
  }

  FEDKERNELS_HD static A value(Key k) {
    const Key b = (k & kSign) ? (k ^ kSign) : ~k;  // kNaN gives a NaN
    A x;
    memcpy(&x, &b, sizeof(A));
    return x;
  }
};

template <typename A, int N>
struct SortedKeys {
  static_assert((N & (N - 1)) == 0, "the network is built for a power of two");
  using Key = typename SortKey<A>::Key;
  Key k[N];

  static constexpr int log2(int n) { return n <= 1 ? 0 : 1 + log2(n / 2); }

  FEDKERNELS_HD static void compare_exchange(Key& a, Key& b) {
    const Key lo = a < b ? a : b, hi = a < b ? b : a;
    a = lo;
    b = hi;
  }

  // Batcher's odd-even merge sort, ascending. Stage (p, d) compares a with a + d for
  // a = j + i, j = d % p, d % p + 2 d, ..., i < d, when a and a + d lie in one block of 2 p.
  // Every loop has a constant trip count, so that unrolling leaves constant indices only.
  FEDKERNELS_HD void sort() {
    constexpr int kLog = log2(N);
    FEDKERNELS_UNROLL
    for (int lp = 0; lp < kLog; ++lp) {
      FEDKERNELS_UNROLL
      for (int lk = kLog - 1; lk >= 0; --lk) {
        if (lk > lp) continue;
        const int p = 1 << lp, d = 1 << lk, j0 = d % p;
        FEDKERNELS_UNROLL
        for (int a = 0; a < N; ++a) {
          if (a >= j0 && (a - j0) % (2 * d) < d && a + d < N && a / (2 * p) == (a + d) / (2 * p)) {
            compare_exchange(k[a], k[a + d]);
          }
        }
      }
    }
  }

  // The sorted value at a run-time position i, as a chain of selects.
  FEDKERNELS_HD A operator[](int64_t i) const {
    Key r = k[0];
    FEDKERNELS_UNROLL
    for (int j = 1; j < N; ++j) r = i == j ? k[j] : r;
    return SortKey<A>::value(r);
  }

  // v[lo] + v[lo + 1] + ... + v[hi - 1], added in that order (OrderStats::mean_of).
  template <typename S>
  FEDKERNELS_HD S ascending_sum(int64_t lo, int64_t hi) const {
    S s = (*this)[lo];
    FEDKERNELS_UNROLL
    for (int j = 1; j < N; ++j) {
      const S x = SortKey<A>::value(k[j]);
      s = (j > lo && j < hi) ? s + x : s;
    }
    return s;
  }
};

}  // namespace fedkernels
