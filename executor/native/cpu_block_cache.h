// A cache of the capture worker's large CPU blocks. A step's values are freed and allocated
// again, at the same sizes, every step; glibc gives a freed large block back to the kernel (it
// unmaps it, or trims the worker thread's arena), so each step touched its pages afresh: a
// page fault per 4 KiB, which cost GPT-2 (zoo, batch 16) ~10% of its step on this CPU
// (docs/coexec.md, *Troubleshooting*). The cache keeps them for the next step, as the CUDA
// caching allocator does: what it holds never exceeds the most the worker's blocks held at once,
// so the process reaches no higher a footprint than without it. It sits below the counting
// allocator (cpu_bytes.h): budgets and peaks count the bytes tensors hold, not the cache.
#pragma once

#include <c10/core/Allocator.h>
#include <pthread.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>

namespace coexec {

// Whether this thread's large blocks go through the cache (the worker's only: values the
// skeleton's thread allocates are Python's, freed at Python's pace).
inline thread_local bool t_cache_blocks = false;

struct BlockCacheStats {
  int64_t in_use = 0;  // bytes of blocks tensors hold
  int64_t cached = 0;  // bytes of blocks kept for reuse
  int64_t peak_in_use = 0;
  int64_t hits = 0, misses = 0;
};

class CPUBlockCache {
 public:
  static constexpr size_t kMinBytes = 64 * 1024;  // (smaller blocks stay in malloc's bins)

  explicit CPUBlockCache(c10::Allocator* base) : base_(base) { guard_forks(); }

  // Whether an allocation of n bytes on this thread goes through the cache.
  static bool wants(size_t n) { return t_cache_blocks && n >= kMinBytes; }

  // A block of at least n bytes: a kept one at most an eighth larger, or a new one.
  c10::DataPtr allocate(size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = free_.lower_bound(n);
    Block* b = nullptr;
    if (it != free_.end() && it->first <= n + n / 8) {
      b = it->second;
      free_.erase(it);
      stats_.cached -= b->capacity;
      ++stats_.hits;
    } else {
      const size_t capacity = (n + kPage - 1) / kPage * kPage;
      make_room(capacity);
      b = new Block{base_->allocate(capacity), capacity, this};
      ++stats_.misses;
    }
    stats_.in_use += b->capacity;
    stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
    return {b->data.get(), b, &give_back, c10::Device(c10::kCPU)};
  }

  // Frees every kept block.
  void empty() {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [capacity, b] : free_) delete b;
    free_.clear();
    stats_.cached = 0;
  }

  BlockCacheStats stats() {
    std::lock_guard<std::mutex> g(mu_);
    return stats_;
  }

 private:
  static constexpr size_t kPage = 4096;

  struct Block {
    c10::DataPtr data;  // the base allocator's
    size_t capacity;
    CPUBlockCache* owner;
  };

  c10::Allocator* base_;
  std::mutex mu_;
  std::multimap<size_t, Block*> free_;  // by capacity
  BlockCacheStats stats_;

  // Frees kept blocks, the largest first, until a new block of `capacity` bytes keeps what the
  // cache holds within the most its blocks were ever in use (a new peak is its own room).
  void make_room(size_t capacity) {
    const int64_t limit = std::max(stats_.peak_in_use, stats_.in_use + static_cast<int64_t>(capacity));
    while (!free_.empty() && stats_.in_use + stats_.cached + static_cast<int64_t>(capacity) > limit) {
      auto last = std::prev(free_.end());
      stats_.cached -= last->first;
      delete last->second;
      free_.erase(last);
    }
  }

  // A fork while another thread holds the lock would leave it held for good in the child (a
  // DataLoader worker that frees a tensor there would hang): it is taken around fork(), as glibc
  // does for its arenas. (One cache per process: the counting allocator's, never destroyed.)
  void guard_forks() {
    static CPUBlockCache* guarded = nullptr;
    if (guarded != nullptr) return;
    guarded = this;
    pthread_atfork([] { guarded->mu_.lock(); }, [] { guarded->mu_.unlock(); }, [] { guarded->mu_.unlock(); });
  }

  static void give_back(void* context) {
    auto* b = static_cast<Block*>(context);
    CPUBlockCache* c = b->owner;
    std::lock_guard<std::mutex> g(c->mu_);
    c->stats_.in_use -= b->capacity;
    c->stats_.cached += b->capacity;
    c->free_.emplace(b->capacity, b);
  }
};

}  // namespace coexec
