// The client tiles of the CPU kernels that add up K client lists (weighted_sum, private_sum):
// a chunk is walked in tiles of kTile elements whose accumulators stay in L1, and the clients of
// a tile are read in groups of kClientGroup, their loads in flight together and the next group's
// prefetched, so every client element is read from memory once. Included by each
// csrc/cpu/*.cpp that uses it, so it is compiled once per instruction set like they are.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>

#include "../elementwise.h"
#include "vec_io.h"

namespace fedkernels {
namespace client_tiles {

using at::vec::Vectorized;

constexpr int64_t kTile = 2048;    // elements whose accumulators stay in L1 (8 KiB in fp32)
constexpr int kClientGroup = 4;    // clients whose loads are in flight together

template <typename T, typename U>
struct TileArgs {
  const T* const* src;  // K client pointers, already offset to the tile
  const U* base;        // null without a base
  U* out;               // unused by accumulate_tile
  const acc_type<T>* weights;
  int64_t num_clients;
  int64_t len;
};

// Where the loads of client k's tile prefetch from: the same offsets of the client kClientGroup
// further on, that is of the next group of this tile or, after the last group, of the first
// clients of the next tile. The hardware prefetchers follow few of the K streams, which switch
// every tile (8 KiB), so a line is prefetched into L2 per line loaded; prefetches into L1 would
// hold the core's few L1 miss buffers.
// An address, not a pointer: after a tensor's last tile it lies past the tensor's end, which is
// prefetched (harmless) but never read, and a pointer there would be undefined behaviour.
template <typename T>
inline uintptr_t prefetch_source(const T* const* src, int64_t num_clients, int64_t k) {
  const int64_t next = k + kClientGroup;
  return reinterpret_cast<uintptr_t>(src[next % num_clients]) +
      static_cast<uintptr_t>((next / num_clients) * kTile) * sizeof(T);
}

// acc[0, len) += sum over clients [k0, k0 + n) of w_k * (x_k - [delta] base).
template <int n, typename T, typename U>
inline void accumulate_clients(
    const TileArgs<T, U>& a, int64_t k0, acc_type<T>* acc, const WeightedSumMath& math,
    bool first) {
  using A = acc_type<T>;
  using Vec = Vectorized<A>;
  constexpr int64_t step = 2 * Vec::size();
  constexpr int64_t kStepBytes = step * int64_t(sizeof(T));
  const int64_t vec_len = a.len - a.len % step;
  Vec w[n];
  uintptr_t pf[n];
  for (int i = 0; i < n; ++i) {
    w[i] = Vec(a.weights[k0 + i]);
    pf[i] = prefetch_source(a.src, a.num_clients, k0 + i);
  }
  for (int64_t j = 0; j < vec_len; j += step) {
    Vec acc_lo = first ? Vec(A(0)) : Vec::loadu(acc + j);
    Vec acc_hi = first ? Vec(A(0)) : Vec::loadu(acc + j + Vec::size());
    Vec b_lo(A(0)), b_hi(A(0));
    if (math.delta) load2<U, A>(a.base + j, b_lo, b_hi);
    for (int i = 0; i < n; ++i) {
      // A line per 64 bytes loaded (a step of 32 bytes prefetches every other time).
      if (kStepBytes >= 64 || j % (64 / int64_t(sizeof(T))) == 0) {
        const char* line = reinterpret_cast<const char*>(pf[i] + j * sizeof(T));
        for (int64_t o = 0; o < kStepBytes; o += 64) __builtin_prefetch(line + o, 0, 2);
      }
      Vec x_lo, x_hi;
      load2<T, A>(a.src[k0 + i] + j, x_lo, x_hi);
      acc_lo = math.accumulate(acc_lo, w[i], x_lo, b_lo);
      acc_hi = math.accumulate(acc_hi, w[i], x_hi, b_hi);
    }
    acc_lo.store(acc + j);
    acc_hi.store(acc + j + Vec::size());
  }
  for (int64_t j = vec_len; j < a.len; ++j) {
    A s = first ? A(0) : acc[j];
    const A b = math.delta ? static_cast<A>(a.base[j]) : A(0);
    for (int i = 0; i < n; ++i) {
      s = math.accumulate(s, a.weights[k0 + i], static_cast<A>(a.src[k0 + i][j]), b);
    }
    acc[j] = s;
  }
}

// acc[0, len) = sum over the tile's clients, in client order, of w_k * (x_k - [delta] base):
// kClientGroup clients per pass over acc, every product and sum rounded as in one pass per client.
template <typename T, typename U>
inline void accumulate_tile(const TileArgs<T, U>& a, const WeightedSumMath& math, acc_type<T>* acc) {
  int64_t k0 = 0;
  for (; k0 + kClientGroup <= a.num_clients; k0 += kClientGroup) {
    accumulate_clients<kClientGroup>(a, k0, acc, math, k0 == 0);
  }
  switch (a.num_clients - k0) {
    case 3: accumulate_clients<3>(a, k0, acc, math, k0 == 0); break;
    case 2: accumulate_clients<2>(a, k0, acc, math, k0 == 0); break;
    case 1: accumulate_clients<1>(a, k0, acc, math, k0 == 0); break;
    default: break;
  }
}

}  // namespace client_tiles
}  // namespace fedkernels
