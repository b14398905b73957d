// When the CPU kernels use a thread team: a pass that touches fewer than kSerialMaxBytes (read
// plus written) runs on the calling thread. Waking the team costs more than such a pass saves,
// and on a busy machine it costs a scheduler quantum: bench/bench_serial_threshold.py measures
// the trade-off for one memory-bound pass (results in bench/results/<device>.json).
//
// On the 2-core CI machine (AMD EPYC, shared, load ~10): a pass of 4 MiB took ~150 us on one
// thread; two threads were faster from 128-256 KiB when the second core happened to be free,
// but took ~27 ms whenever it was not, which only passes of ~64 MiB outweigh. 4 MiB bounds
// what staying on one thread can cost at about half of a 150 us pass, so inputs under ~1 MB
// never wait for a core, while large inputs keep every thread.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace fedkernels {

constexpr int64_t kSerialMaxBytes = int64_t(4) << 20;

// Whether a pass touching `bytes` in all runs on the calling thread.
inline bool run_serial(int64_t bytes) {
  return bytes < kSerialMaxBytes;
}

// at::parallel_for(begin, end, grain, fn), or fn(begin, end) on the calling thread when the
// pass touches fewer than kSerialMaxBytes.
template <typename Fn>
void parallel_for_bytes(int64_t begin, int64_t end, int64_t grain, int64_t bytes, const Fn& fn) {
  if (begin >= end) return;
  if (run_serial(bytes)) {
    fn(begin, end);
  } else {
    at::parallel_for(begin, end, grain, fn);
  }
}

}  // namespace fedkernels
