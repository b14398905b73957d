// Vector loads, stores and sums shared by the CPU kernels: any supported input dtype is read as
// the accumulate type (fp32, fp64 for fp64) and written back in the storage dtype.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "../common.h"

namespace fedkernels {

// Loads 2 * Vectorized<A>::size() elements of type T as two vectors of the accumulate type A.
template <typename T, typename A>
inline void load2(const T* p, at::vec::Vectorized<A>& lo, at::vec::Vectorized<A>& hi) {
  if constexpr (std::is_same_v<T, A>) {
    lo = at::vec::Vectorized<A>::loadu(p);
    hi = at::vec::Vectorized<A>::loadu(p + at::vec::Vectorized<A>::size());
  } else {
    at::vec::load_to_float<T>(p, lo, hi);
  }
}

// dst[0..n) = src[0..n) in the accumulate type A: pairs of vectors through load2, then one by
// one, because a scalar fp16-to-float cast does not vectorize; the values are the same.
template <typename T, typename A>
inline void convert_to_acc(const T* src, A* dst, int64_t n) {
  using Vec = at::vec::Vectorized<A>;
  constexpr int64_t W = Vec::size();
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    Vec lo, hi;
    load2<T, A>(src + i, lo, hi);
    lo.store(dst + i);
    hi.store(dst + i + W);
  }
  for (; i < n; ++i) dst[i] = static_cast<A>(src[i]);
}

// Stores two vectors of the accumulate type A as 2 * Vectorized<A>::size() elements of type U.
template <typename U, typename A>
inline void store2(U* p, const at::vec::Vectorized<A>& lo, const at::vec::Vectorized<A>& hi) {
  if constexpr (std::is_same_v<U, A>) {
    lo.store(p);
    hi.store(p + at::vec::Vectorized<A>::size());
  } else {
    at::vec::convert_from_float<U>(lo, hi).store(p);
  }
}

// dst[0..n) = src[0..n) in the storage dtype U (the inverse of convert_to_acc): pairs of
// vectors through store2, then one by one.
template <typename A, typename U>
inline void convert_from_acc(const A* src, U* dst, int64_t n) {
  using Vec = at::vec::Vectorized<A>;
  constexpr int64_t W = Vec::size();
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) store2<U, A>(dst + i, Vec::loadu(src + i), Vec::loadu(src + i + W));
  for (; i < n; ++i) dst[i] = static_cast<U>(src[i]);
}

// The lanes of two vectors added in lane order, in float64.
template <typename A>
inline double horizontal_sum(const at::vec::Vectorized<A>& lo, const at::vec::Vectorized<A>& hi) {
  constexpr int n = at::vec::Vectorized<A>::size();
  alignas(64) A buf[2 * n];
  lo.store(buf);
  hi.store(buf + n);
  double s = 0;
  for (int i = 0; i < 2 * n; ++i) s += static_cast<double>(buf[i]);
  return s;
}

}  // namespace fedkernels
