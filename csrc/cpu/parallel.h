// When the CPU kernels use a thread team: a pass that touches fewer than kSerialMaxBytes (read
// plus written), counted at its cost, runs on the calling thread. Waking the team costs more
// than such a pass saves, and on a busy machine it costs a scheduler quantum:
// bench/bench_serial_threshold.py measures the trade-off for one memory-bound pass, and each
// op's cost per byte against it (results in bench/results/<device>.json).
//
// On the 2-core CI machine (AMD EPYC, shared, load ~10): a pass of 4 MiB took ~150 us on one
// thread; two threads were faster from 128-256 KiB when the second core happened to be free,
// but took ~27 ms whenever it was not, which only passes of ~64 MiB outweigh. 4 MiB bounds
// what staying on one thread can cost at about half of a 150 us pass, so inputs under ~1 MB
// never wait for a core, while large inputs keep every thread.
//
// That bound holds for streaming passes (a few operations per value: weighted_sum, the SuPerFed
// mix). Passes with an exp, a sort or a double-precision sum per value take 3-100x a streaming
// pass's time per byte from cache (one thread, 3 MiB, Zen 4): a 3 MiB KL took ~400 us and a
// 3 MiB coordinate median of 100 clients ~1.3 ms on one thread while a second core sat idle.
// They count each byte kArithmetic times, which puts their threshold at 1 MiB: below it the
// slowest of them (pairwise distances of 100 clients, ~1.3 ms) still takes less than the
// quantum a busy core costs, so inputs under ~1 MB still never wait for one.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace fedkernels {

constexpr int64_t kSerialMaxBytes = int64_t(4) << 20;

// What a pass does per byte it touches, as a multiple of a streaming pass's time per byte.
enum class PassCost : int64_t { kStreaming = 1, kArithmetic = 4 };

// Whether a pass touching `bytes` in all runs on the calling thread.
inline bool run_serial(int64_t bytes, PassCost cost) {
  return bytes < kSerialMaxBytes / static_cast<int64_t>(cost);
}

// at::parallel_for(begin, end, grain, fn), or fn(begin, end) on the calling thread when the
// pass touches fewer than kSerialMaxBytes at its cost.
template <typename Fn>
void parallel_for_bytes(int64_t begin, int64_t end, int64_t grain, int64_t bytes, PassCost cost,
                        const Fn& fn) {
  if (begin >= end) return;
  if (run_serial(bytes, cost)) {
    fn(begin, end);
  } else {
    at::parallel_for(begin, end, grain, fn);
  }
}

}  // namespace fedkernels
