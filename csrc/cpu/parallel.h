// When the CPU kernels use a thread team: a pass that touches fewer than kSerialMaxBytes (read
// plus written), counted at its cost, runs on the calling thread. Waking the team costs more
// than such a pass saves, and on a busy machine it costs a scheduler quantum; the bound keeps
// what staying on one thread can cost well under that quantum, while large inputs keep every
// thread. Chosen by bench/bench_serial_threshold.py (the trade-off for one memory-bound pass,
// and each op's cost per byte against it).
//
// Passes with an exp, a sort or a double-precision sum per value cost several times a
// streaming pass per byte; they count each byte kArithmetic times, so that they too stay
// serial only while they take less than the quantum a busy core costs.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define FEDKERNELS_HAS_MXCSR 1
#endif

namespace fedkernels {

constexpr int64_t kSerialMaxBytes = int64_t(4) << 20;

// What a pass does per byte it touches, as a multiple of a streaming pass's time per byte.
enum class PassCost : int64_t { kStreaming = 1, kArithmetic = 4 };

// Whether a pass touching `bytes` in all runs on the calling thread.
inline bool run_serial(int64_t bytes, PassCost cost) {
  return bytes < kSerialMaxBytes / static_cast<int64_t>(cost);
}

// How a thread treats subnormal floats (below 2^-126 in float, 2^-1022 in double): the x86
// flush-to-zero and denormals-are-zero bits of MXCSR, which torch.set_flush_denormal(True) sets on
// the calling thread only. An operation that reads or makes a subnormal can cost a microcode assist
// of a hundred cycles or more (bench/bench_subnormals.py). Each worker of parallel_for_bytes runs
// in its caller's mode, so the results and their speed do not depend on the number of threads
// (torch's own kernels flush only the calling thread's share). Elsewhere than x86 the mode is left
// as it is.
#if defined(FEDKERNELS_HAS_MXCSR)
constexpr unsigned kFlushDenormals = 0x8040;  // MXCSR: FTZ (bit 15) | DAZ (bit 6)
inline unsigned denormal_mode() { return _mm_getcsr() & kFlushDenormals; }
#else
constexpr unsigned kFlushDenormals = 0;
inline unsigned denormal_mode() { return 0; }
#endif

// Sets this thread's denormal mode for the scope and restores it after.
class DenormalModeScope {
 public:
  explicit DenormalModeScope(unsigned mode) {
#if defined(FEDKERNELS_HAS_MXCSR)
    saved_ = _mm_getcsr();
    if ((saved_ & kFlushDenormals) != mode) {
      _mm_setcsr((saved_ & ~kFlushDenormals) | mode);
      changed_ = true;
    }
#else
    (void)mode;
#endif
  }
  ~DenormalModeScope() {
#if defined(FEDKERNELS_HAS_MXCSR)
    if (changed_) _mm_setcsr(saved_);
#endif
  }
  DenormalModeScope(const DenormalModeScope&) = delete;
  DenormalModeScope& operator=(const DenormalModeScope&) = delete;

 private:
  unsigned saved_ = 0;
  bool changed_ = false;
};

// Items per piece for a pass over n items (rows, or elements) cut into pieces of at most
// max_size items (a multiple of unit) that parallel_for_bytes(0, pieces, 1, bytes, cost, ...)
// runs. at::parallel_for gives each thread ceil(pieces / threads) consecutive pieces, so few
// pieces split unevenly (13 pieces of 20 rows on two threads: 140 rows and 116) and the call
// lasts as long as the largest share. Where the pieces are few, this takes the number of
// pieces, up to twice as many, whose largest share per thread is smallest (16 of 16 rows: 128
// each); smaller pieces than that only add their overhead. The size depends on the thread
// count: only for passes whose values do not depend on the pieces (balanced_chunk,
// chunk_loop.h, sizes them from the model alone).
inline int64_t split_for_threads(int64_t max_size, int64_t n, int64_t unit, int64_t bytes,
                                 PassCost cost) {
  const int64_t threads = run_serial(bytes, cost) ? 1 : at::get_num_threads();
  const int64_t pieces = (n + max_size - 1) / max_size;
  if (threads <= 1 || pieces >= 16 * threads || max_size <= unit) return max_size;
  auto size_of = [&](int64_t count) { return ((n + count - 1) / count + unit - 1) / unit * unit; };
  auto largest_share = [&](int64_t size) {
    return ((n + size - 1) / size + threads - 1) / threads * size;
  };
  int64_t best = size_of(pieces);
  for (int64_t count = pieces + 1; count <= 2 * pieces; ++count) {
    const int64_t size = size_of(count);
    if (largest_share(size) < largest_share(best)) best = size;
  }
  return best;
}

// at::parallel_for(begin, end, grain, fn), or fn(begin, end) on the calling thread when the
// pass touches fewer than kSerialMaxBytes at its cost; every thread in the caller's denormal
// mode.
template <typename Fn>
void parallel_for_bytes(int64_t begin, int64_t end, int64_t grain, int64_t bytes, PassCost cost,
                        const Fn& fn) {
  if (begin >= end) return;
  if (run_serial(bytes, cost)) {
    fn(begin, end);
  } else {
    const unsigned mode = denormal_mode();
    at::parallel_for(begin, end, grain, [&](int64_t b0, int64_t b1) {
      DenormalModeScope scope(mode);
      fn(b0, b1);
    });
  }
}

}  // namespace fedkernels
