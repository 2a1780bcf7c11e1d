// coexec's CPU allocator: the default one wrapped, counting the bytes it hands out (live bytes
// and their peak in atomics: a step's peak on the CPU, for budgets and bench/native_memory.py),
// with the capture worker's large blocks kept for reuse below the count (cpu_block_cache.h).
// Installed when the first capture worker starts, or on request (count_cpu_bytes), for the
// process's life: tensors allocated before it are not counted.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <new>
#include <utility>
#include <vector>

#include "arena.h"
#include "cpu_block_cache.h"

namespace coexec {

// A thread's window of its own allocations (CountingCPUAllocator::open_window).
struct CPUBytesWindow {
  bool open = false;
  int64_t live = 0, peak = 0;
};
inline thread_local CPUBytesWindow t_window;
// A described op's allocations on this thread, in order: (bytes, data) (null: not recorded).
inline thread_local std::vector<std::pair<int64_t, const void*>>* t_allocations = nullptr;

// A window of this thread's allocations opened inside whatever window it has open (whose count
// they join when it closes): what a stretch of code on the step's thread held at its most.
class NestedCPUBytesWindow {
 public:
  NestedCPUBytesWindow() : outer_(t_window) { t_window = CPUBytesWindow{true, 0, 0}; }
  ~NestedCPUBytesWindow() {
    const CPUBytesWindow inner = t_window;
    t_window = outer_;
    if (outer_.open) {
      t_window.peak = std::max(outer_.peak, outer_.live + inner.peak);
      t_window.live += inner.live;
    }
  }
  NestedCPUBytesWindow(const NestedCPUBytesWindow&) = delete;
  NestedCPUBytesWindow& operator=(const NestedCPUBytesWindow&) = delete;
  int64_t peak() const { return t_window.peak; }

 private:
  CPUBytesWindow outer_;
};

// Bytes the shape oracle's stand-ins (capture_shapes.h, stand_in_outputs) may hold now on the
// step's thread (0: none), beside what the worker holds: a budget's guard keeps room for them
// (capture_worker.h, Worker::reserve_for_stand_ins).
inline std::atomic<int64_t> g_stand_in_reserved{0};

class CountingCPUAllocator final : public c10::Allocator {
 public:
  explicit CountingCPUAllocator(c10::Allocator* base) : base_(base), cache_(base) {}

  // A block of the base allocator, `kHeader` bytes longer: the header says how to free it and
  // how many bytes it counts, and the data pointer is its own context (some kernels allocate
  // through raw_allocate, which requires that).
  // An allocation the op on this thread has an arena region for (arena.h) takes it: its bytes
  // are counted with the arena's, which is one allocation held whole.
  c10::DataPtr allocate(size_t n) override {
    if (t_arena_offer != nullptr)
      if (void* p = t_arena_offer->take(n)) return {p, p, &release, c10::Device(c10::kCPU)};
    const size_t bytes = n + kHeader;
    c10::DataPtr inner = CPUBlockCache::wants(bytes) ? cache_.allocate(bytes) : base_->allocate(bytes);
    char* block = static_cast<char*>(inner.get());
    const c10::DeleterFnPtr deleter = inner.get_deleter();
    void* context = inner.release_context();
    const uint64_t mark = mark_.load(std::memory_order_acquire);
    new (block) Header{context, deleter, static_cast<int64_t>(n), this, mark};
    add(static_cast<int64_t>(n));
    void* data = block + kHeader;
    if (t_allocations != nullptr) t_allocations->emplace_back(static_cast<int64_t>(n), data);
    return {data, data, &release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t live() const { return live_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  // The bytes of blocks allocated since reset_peak() still held, and their peak: a step's own
  // bytes (live() also falls where the step frees what was allocated before it, such as the
  // gradients of the step before, which ``zero_grad()`` lets go of without any op reading them;
  // a step's bytes counted from live() missed them, 12% of a planned MLP step's).
  int64_t made() const { return made_.load(std::memory_order_relaxed); }
  int64_t made_peak() const { return made_peak_.load(std::memory_order_relaxed); }
  // The peaks start again from now, and the blocks allocated from now on are the ones made() counts.
  void reset_peak() {
    made_.store(0, std::memory_order_seq_cst);
    made_peak_.store(0, std::memory_order_relaxed);
    // (after the store: a block allocated meanwhile with the older mark is counted and never
    // taken off, too many bytes, not too few)
    mark_.fetch_add(1, std::memory_order_seq_cst);
    peak_.store(live(), std::memory_order_relaxed);
  }
  CPUBlockCache& cache() { return cache_; }
  // A window of this thread's own allocations and frees (a described step's op: what its kernel
  // allocates and frees again; other threads' bytes, such as values Python lets go of, are not
  // in it). open_window() starts it at 0; close_window() ends it: (bytes at its peak, at its end).
  static void open_window() {
    t_window = CPUBytesWindow{true, 0, 0};
  }
  static std::pair<int64_t, int64_t> close_window() {
    t_window.open = false;
    return {t_window.peak, t_window.live};
  }

 private:
  static constexpr size_t kHeader = 64;  // (keeps the data at the base's 64-byte alignment)

  struct Header {
    void* context;  // the base allocator's, and its deleter
    c10::DeleterFnPtr deleter;
    int64_t n;
    CountingCPUAllocator* owner;
    uint64_t mark;  // the count of reset_peak() calls as it was allocated (made())
  };
  static_assert(sizeof(Header) <= kHeader);

  c10::Allocator* base_;
  CPUBlockCache cache_;
  std::atomic<int64_t> live_{0}, peak_{0}, made_{0}, made_peak_{0};
  std::atomic<uint64_t> mark_{0};

  void add(int64_t n) {
    const int64_t now = live_.fetch_add(n, std::memory_order_relaxed) + n;
    raise(peak_, now);
    raise(made_peak_, made_.fetch_add(n, std::memory_order_relaxed) + n);
    if (t_window.open) {
      t_window.live += n;
      t_window.peak = std::max(t_window.peak, t_window.live);
    }
  }

  static void raise(std::atomic<int64_t>& peak, int64_t now) {
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }

  static void release(void* data) {
    if (Arena::release(data)) return;
    auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
    const Header h = *header;
    h.owner->live_.fetch_sub(h.n, std::memory_order_relaxed);
    if (h.mark == h.owner->mark_.load(std::memory_order_relaxed)) h.owner->made_.fetch_sub(h.n, std::memory_order_relaxed);
    if (t_window.open) t_window.live -= h.n;
    h.deleter(h.context);
  }
};

// The process's counting allocator, installed at the first call.
inline CountingCPUAllocator& count_cpu_bytes() {
  static CountingCPUAllocator* counting = [] {
    auto* a = new CountingCPUAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(a, /*priority=*/100);
    return a;
  }();
  return *counting;
}

}  // namespace coexec
