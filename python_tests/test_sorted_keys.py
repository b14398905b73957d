"""The CUDA order-statistics kernel's sorting network (csrc/cuda/sorted_keys.cuh), run on the
CPU: the header is host-compilable, so a driver checks it against OrderStats::reduce (the CPU
kernels' arithmetic) on random coordinates of every network size, with NaN, signed zeros,
infinities and ties, for float and double; and the keys' round trip. A GPU run of the kernel
itself is test_robust_ops.py's CUDA tests."""

from __future__ import annotations

import pytest
from native_driver import run_driver

pytestmark = pytest.mark.slow

DRIVER = r"""
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/sorted_keys.cuh"
#include "order_stats.h"

using namespace fedkernels;

static int failures = 0;

template <typename A, int N>
void check(std::mt19937& g, int cases) {
  std::uniform_int_distribution<int> count(1, N), kind(0, 9), small(-2, 2);
  std::normal_distribution<double> normal;
  for (int c = 0; c < cases; ++c) {
    const int K = count(g);
    const bool with_nan = kind(g) < 5;
    std::vector<A> v(K);
    for (auto& x : v) {
      const int t = kind(g);
      x = t == 0 ? (with_nan ? A(NAN) : A(1.5)) : t == 1 ? A(-0.0) : t == 2 ? A(0.0)
          : t == 3 ? A(INFINITY) : t == 4 ? A(-INFINITY) : t < 7 ? A(small(g)) : A(normal(g));
    }
    SortedKeys<A, N> r;
    int64_t numbers = 0;
    for (int k = 0; k < N; ++k) {
      if (k < K) {
        numbers += v[k] == v[k];
        r.k[k] = SortKey<A>::of(v[k]);
      } else {
        r.k[k] = SortKey<A>::kNaN;
      }
    }
    r.sort();
    for (int k = 1; k < N; ++k) {
      if (r.k[k - 1] > r.k[k]) {
        std::printf("N=%d K=%d: not sorted at %d\n", N, K, k);
        ++failures;
        break;
      }
    }
    for (int rule = 0; rule < 3; ++rule) {
      const int64_t param = rule == 1 ? (K - 1) / 3 : rule == 2 ? std::max(1, K - 2) : 0;
      std::vector<A> w = v;
      const A want = OrderStats::reduce<A>(w.data(), K, RobustRule(rule), param);
      const A got = OrderStats::reduce_sorted<A>(r, K, numbers, RobustRule(rule), param);
      // == treats -0 and +0 as equal: which zero comes first is the one thing the network
      // orders differently from the CPU sort
      if (!((want != want && got != got) || want == got)) {
        if (failures < 10) {
          std::printf("N=%d K=%d rule=%d: %.17g, expected %.17g\n", N, K, rule, double(got),
                      double(want));
        }
        ++failures;
      }
    }
  }
}

template <typename A>
void round_trip() {
  const A xs[] = {A(0.0), A(-0.0), A(1), A(-1), A(INFINITY), A(-INFINITY),
                  std::numeric_limits<A>::denorm_min(), -std::numeric_limits<A>::denorm_min(),
                  std::numeric_limits<A>::max(), std::numeric_limits<A>::lowest()};
  for (A x : xs) {
    const A y = SortKey<A>::value(SortKey<A>::of(x));
    if (std::memcmp(&x, &y, sizeof(A)) != 0) {
      std::printf("round trip of %g\n", double(x));
      ++failures;
    }
  }
  if (!(SortKey<A>::of(A(-0.0)) < SortKey<A>::of(A(0.0)))) ++failures;
  if (!(SortKey<A>::of(A(INFINITY)) < SortKey<A>::of(A(NAN)))) ++failures;
  if (!(SortKey<A>::of(-A(NAN)) == SortKey<A>::kNaN)) ++failures;  // every NaN is one key
  const A back = SortKey<A>::value(SortKey<A>::kNaN);
  if (back == back) ++failures;
}

int main() {
  std::mt19937 g(7);
  check<float, 8>(g, 20000);
  check<float, 16>(g, 20000);
  check<float, 32>(g, 10000);
  check<float, 64>(g, 5000);
  check<float, 128>(g, 2000);
  check<double, 16>(g, 10000);
  check<double, 128>(g, 1000);
  round_trip<float>();
  round_trip<double>();
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
"""


def test_sorting_network_matches_the_cpu_order_statistics(tmp_path):
    assert run_driver(DRIVER, "cuda/sorted_keys.cuh", tmp_path).strip() == "ok"
