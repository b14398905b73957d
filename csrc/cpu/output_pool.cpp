// The output pool (output_pool.h) and its three control ops: output_pool_set_limit,
// output_pool_release, output_pool_stats (schemas in csrc/ops.cpp; Python:
// fedkernels/ops/output_pool.py).
//
// The pool is a c10::Allocator: a pooled result's storage frees through it, and its deleter
// puts the block on an idle list keyed by its exact size instead of freeing it. Idle bytes are
// bounded by the limit, the least recently idle blocks freed first. The pool object is never
// destroyed, so a tensor freed at interpreter exit, after static destructors, still finds it.
#include "output_pool.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fedkernels {
namespace {

struct Block {
  void* ptr;
  size_t bytes;
};

// A few hundred MB of idle results is one model of ResNet-50 or BERT-base size held between
// rounds; an eighth of the memory keeps a small machine's idle share small.
size_t default_limit() {
  constexpr size_t kDefault = size_t{512} << 20;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return kDefault;
  return std::min(kDefault, static_cast<size_t>(pages) * static_cast<size_t>(page) / 8);
}

class OutputPool final : public c10::Allocator {
 public:
  OutputPool() : limit_(default_limit()) {}

  c10::DataPtr allocate(size_t bytes) override {
    Block* block = pooled(bytes) ? take(bytes) : nullptr;
    if (block == nullptr) block = new Block{c10::alloc_cpu(bytes), bytes};
    return {block->ptr, block, &OutputPool::give_back_deleter, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool enabled() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_ > 0;
  }

  void set_limit(size_t limit) {
    std::vector<Block*> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = limit;
      evict_to_fit(0, limit_, evicted);
    }
    free_blocks(evicted);
  }

  int64_t release() {
    std::vector<Block*> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      evict_to_fit(0, 0, evicted);
    }
    int64_t freed = 0;
    for (Block* b : evicted) freed += static_cast<int64_t>(b->bytes);
    free_blocks(evicted);
    return freed;
  }

  std::vector<int64_t> stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(limit_), static_cast<int64_t>(idle_bytes_),
            static_cast<int64_t>(idle_.size()), hits_, misses_};
  }

 private:
  using Idle = std::list<Block*>;  // most recently idle first

  // A pooled result resized below the pool's size (resize_) is freed, not kept.
  static bool pooled(size_t bytes) { return bytes >= static_cast<size_t>(kPooledMinBytes); }

  Block* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = by_size_.find(bytes);
    if (found == by_size_.end()) {
      ++misses_;
      return nullptr;
    }
    ++hits_;
    Block* block = *found->second;
    idle_.erase(found->second);
    by_size_.erase(found);
    idle_bytes_ -= bytes;
    return block;
  }

  static void give_back_deleter(void* ctx) { pool().give_back(static_cast<Block*>(ctx)); }

  void give_back(Block* block) {
    std::vector<Block*> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (pooled(block->bytes) && block->bytes <= limit_) {
        evict_to_fit(block->bytes, limit_, evicted);
        idle_.push_front(block);
        by_size_.emplace(block->bytes, idle_.begin());
        idle_bytes_ += block->bytes;
      } else {
        evicted.push_back(block);
      }
    }
    free_blocks(evicted);  // outside the lock: freeing a large block unmaps it
  }

  // Moves the least recently idle blocks to `evicted` until `incoming` more bytes fit `limit`.
  void evict_to_fit(size_t incoming, size_t limit, std::vector<Block*>& evicted) {
    while (!idle_.empty() && idle_bytes_ + incoming > limit) {
      Block* oldest = idle_.back();
      auto [first, last] = by_size_.equal_range(oldest->bytes);
      const auto where = std::prev(idle_.end());
      for (auto it = first; it != last; ++it) {
        if (it->second == where) {
          by_size_.erase(it);
          break;
        }
      }
      idle_.pop_back();
      idle_bytes_ -= oldest->bytes;
      evicted.push_back(oldest);
    }
  }

  static void free_blocks(const std::vector<Block*>& blocks) {
    for (Block* b : blocks) {
      c10::free_cpu(b->ptr);
      delete b;
    }
  }

 public:
  static OutputPool& pool() {
    static OutputPool* const instance = new OutputPool();  // never destroyed (see the top)
    return *instance;
  }

 private:
  mutable std::mutex mutex_;
  size_t limit_;
  size_t idle_bytes_ = 0;
  Idle idle_;
  std::unordered_multimap<size_t, Idle::iterator> by_size_;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

}  // namespace

at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TORCH_INTERNAL_ASSERT(options.device().is_cpu());
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  int64_t numel = 1;
  for (const auto s : sizes) numel *= s;
  OutputPool& pool = OutputPool::pool();
  if (numel * static_cast<int64_t>(c10::elementSize(dtype)) < kPooledMinBytes || !pool.enabled()) {
    return at::empty(sizes, options);
  }
  return at::detail::empty_generic(
      sizes, &pool, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, c10::MemoryFormat::Contiguous);
}

TORCH_LIBRARY_IMPL(fedkernels, CompositeExplicitAutograd, m) {
  m.impl("output_pool_set_limit", [](int64_t limit) {
    TORCH_CHECK_VALUE(limit >= 0, "fedkernels.output_pool_set_limit: limit is ", limit,
                      " bytes; expected 0 (no pool) or more");
    OutputPool::pool().set_limit(static_cast<size_t>(limit));
  });
  m.impl("output_pool_release", []() { return OutputPool::pool().release(); });
  m.impl("output_pool_stats", []() { return OutputPool::pool().stats(); });
}

}  // namespace fedkernels
