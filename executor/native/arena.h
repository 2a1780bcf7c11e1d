// A planned arena on the CPU: one block allocated whole, in which the capture worker's ops put
// the storages a plan placed (arena=True; coexec/native_budget.py plans the offsets over a
// described step's lifetimes). The counting allocator (cpu_bytes.h) asks the worker's pending
// placements (t_arena_offer, set around one op's kernel) before it allocates: an allocation of
// exactly a region's bytes takes the region, unless the region or one that shares its bytes is
// still held. That check is what makes a plan unable to change a value: a later step that holds
// a tensor longer than the planned one did (kept in a list, another path) keeps its region, and
// the storage planned over it comes from the allocator instead.
#pragma once

#include <c10/core/Allocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace coexec {

// One storage's place in the arena.
struct ArenaRegion {
  int64_t place = 0;  // of the op that makes the storage
  int64_t offset = 0, nbytes = 0;
  std::vector<uint32_t> overlaps;  // the regions whose bytes overlap these
};

class Arena;

// The arenas whose bytes a release may be in: the allocator's free looks here first (a region
// has no header before it, as the allocator's own blocks have). A short list, never shrunk:
// an arena that is gone leaves its entry empty for the next one.
struct ArenaSpan {
  std::atomic<bool> used{false};
  std::atomic<uintptr_t> lo{0}, hi{0};
  std::atomic<Arena*> arena{nullptr};  // (set after lo and hi, cleared before them)
  ArenaSpan* next = nullptr;
};
inline std::atomic<ArenaSpan*> g_arena_spans{nullptr};
inline std::atomic<int64_t> g_arenas_alive{0};  // (0: a release checks no span)
inline std::atomic<int64_t> g_arena_placed{0};  // ops' outputs put in an arena (in all)

class Arena {
 public:
  // `memory`: the block (`bytes` long) from the allocator; `regions`: the plan's, whose overlaps
  // are found here.
  Arena(c10::DataPtr memory, int64_t bytes, std::vector<ArenaRegion> regions)
      : memory_(std::move(memory)), bytes_(bytes), regions_(std::move(regions)),
        live_(new std::atomic<bool>[regions_.size()]) {
    for (size_t i = 0; i < regions_.size(); ++i) live_[i].store(false, std::memory_order_relaxed);
    skip_.assign(regions_.size(), 0);
    seen_.assign(regions_.size(), 0);
    took_at_.assign(regions_.size(), -1);
    // (sweep by offset: a region overlaps those that start before it ends)
    std::vector<uint32_t> by_offset(regions_.size());
    for (uint32_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
    std::sort(by_offset.begin(), by_offset.end(),
              [this](uint32_t a, uint32_t b) { return std::make_pair(regions_[a].offset, a) < std::make_pair(regions_[b].offset, b); });
    for (size_t x = 0; x < by_offset.size(); ++x) {
      ArenaRegion& a = regions_[by_offset[x]];
      for (size_t y = x + 1; y < by_offset.size(); ++y) {
        ArenaRegion& b = regions_[by_offset[y]];
        if (b.offset >= a.offset + a.nbytes) break;
        a.overlaps.push_back(by_offset[y]);
        b.overlaps.push_back(by_offset[x]);
      }
    }
    for (uint32_t i : by_offset) starts_.emplace_back(regions_[i].offset, i);
    base_ = static_cast<uint8_t*>(memory_.get());
    span_ = enlist(reinterpret_cast<uintptr_t>(base_), reinterpret_cast<uintptr_t>(base_) + bytes_, this);
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // The region `r`'s bytes for an allocation of `n` bytes, if they are its size and free, no
  // region sharing them is held, and the allocations of its size its op makes before its
  // storage have been passed over (learn()); null otherwise. The worker's thread only (placements
  // are made there alone, so what it finds free stays free until it takes it).
  void* take(uint32_t r, size_t n) {
    const ArenaRegion& g = regions_[r];
    if (static_cast<int64_t>(n) != g.nbytes) return nullptr;
    const int32_t k = seen_[r]++;
    if (k < skip_[r] || live_[r].load(std::memory_order_acquire)) return nullptr;
    for (uint32_t o : g.overlaps)
      if (live_[o].load(std::memory_order_acquire)) return nullptr;
    took_at_[r] = k;
    live_[r].store(true, std::memory_order_relaxed);
    refs_.fetch_add(1, std::memory_order_relaxed);
    return base_ + g.offset;
  }

  // Before the op whose regions are `rs` runs (the worker's thread).
  void begin(const uint32_t* rs, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      seen_[rs[i]] = 0;
      took_at_[rs[i]] = -1;
    }
  }

  int64_t region_bytes(uint32_t r) const { return regions_[r].nbytes; }

  // After it ran: does region `r` hold the storage at `data` (one of the op's outputs)?
  bool holds(uint32_t r, const void* data) const { return base_ + regions_[r].offset == data; }

  // After it ran, region `r` holding none of its outputs: a kernel that allocates a temporary of
  // the output's size first gave the temporary the region (and the output the allocator's
  // memory), so the next steps pass over as many allocations of that size as came before the
  // output's (a convolution's reordered input, the size of its output, took ResNet-18's regions
  // at batch 16: 26% over the planned peak); an allocation counts stay the same from step to
  // step where the kernel's do. Where no allocation of its size came after those passed over,
  // fewer are.
  void learn(uint32_t r) {
    if (took_at_[r] >= 0) {
      skip_[r] = took_at_[r] + 1;
    } else if (seen_[r] > 0 && seen_[r] <= skip_[r]) {
      skip_[r] = seen_[r] - 1;
    }
  }

  // What learn() found, for a plan's arena after this one: per (place, bytes) of a region, the
  // allocations of its size its op makes before its storage.
  std::vector<std::tuple<int64_t, int64_t, int32_t>> learnt() const {
    std::vector<std::tuple<int64_t, int64_t, int32_t>> out;
    for (size_t r = 0; r < regions_.size(); ++r)
      if (skip_[r] > 0) out.emplace_back(regions_[r].place, regions_[r].nbytes, skip_[r]);
    return out;
  }
  // Per region, the allocations of its size its op makes before its storage (a described step's).
  void pass_over(const std::vector<int32_t>& skips) {
    for (size_t r = 0; r < regions_.size() && r < skips.size(); ++r) skip_[r] = skips[r];
  }
  // Start from what an arena before this one learnt (regions at the same place, of the same bytes).
  void learn_from(const std::vector<std::tuple<int64_t, int64_t, int32_t>>& known) {
    for (const auto& [place, nbytes, skip] : known)
      for (size_t r = 0; r < regions_.size(); ++r)
        if (regions_[r].place == place && regions_[r].nbytes == nbytes) skip_[r] = skip;
  }

  // The owner (a plan) lets go; the arena goes once no region is held either.
  void unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // Free the region at `data` if it is in an arena: true if it was.
  static bool release(void* data) {
    if (g_arenas_alive.load(std::memory_order_acquire) == 0) return false;
    const auto p = reinterpret_cast<uintptr_t>(data);
    for (ArenaSpan* s = g_arena_spans.load(std::memory_order_acquire); s != nullptr; s = s->next) {
      Arena* a = s->arena.load(std::memory_order_acquire);
      if (a == nullptr) continue;
      if (p < s->lo.load(std::memory_order_relaxed) || p >= s->hi.load(std::memory_order_relaxed)) continue;
      a->free(static_cast<uint8_t*>(data));
      return true;
    }
    return false;
  }

 private:
  c10::DataPtr memory_;
  int64_t bytes_;
  std::vector<ArenaRegion> regions_;
  std::unique_ptr<std::atomic<bool>[]> live_;
  // per region, the worker's: allocations of its size its op makes before its storage (passed
  // over), and in the op running now those seen and the one that took it (-1: none)
  std::vector<int32_t> skip_, seen_, took_at_;
  std::atomic<int64_t> refs_{1};  // the owner's, and one per region held
  std::vector<std::pair<int64_t, uint32_t>> starts_;  // (offset, region), sorted: free()'s lookup
  uint8_t* base_ = nullptr;
  ArenaSpan* span_ = nullptr;

  ~Arena() {
    // (before the memory goes: the allocator may hand out these bytes again, and their release
    // must not be taken for a region's)
    span_->arena.store(nullptr, std::memory_order_seq_cst);
    span_->lo.store(0, std::memory_order_relaxed);
    span_->hi.store(0, std::memory_order_relaxed);
    span_->used.store(false, std::memory_order_release);
    g_arenas_alive.fetch_sub(1, std::memory_order_acq_rel);
  }

  // The region held at `data` (of the regions starting there, the one held: one at most is).
  void free(uint8_t* data) {
    const int64_t offset = data - base_;
    auto it = std::lower_bound(starts_.begin(), starts_.end(), std::make_pair(offset, uint32_t{0}));
    for (; it != starts_.end() && it->first == offset; ++it)
      if (live_[it->second].load(std::memory_order_acquire)) {
        live_[it->second].store(false, std::memory_order_release);
        unref();
        return;
      }
  }

  static ArenaSpan* enlist(uintptr_t lo, uintptr_t hi, Arena* a) {
    ArenaSpan* s = g_arena_spans.load(std::memory_order_acquire);
    for (; s != nullptr; s = s->next) {
      bool no = false;
      if (s->used.compare_exchange_strong(no, true)) break;
    }
    if (s == nullptr) {
      s = new ArenaSpan;  // (never freed: a release may be reading the list)
      s->used.store(true, std::memory_order_relaxed);
      s->next = g_arena_spans.load(std::memory_order_relaxed);
      while (!g_arena_spans.compare_exchange_weak(s->next, s)) {
      }
    }
    s->lo.store(lo, std::memory_order_relaxed);
    s->hi.store(hi, std::memory_order_relaxed);
    s->arena.store(a, std::memory_order_seq_cst);
    g_arenas_alive.fetch_add(1, std::memory_order_acq_rel);
    return s;
  }
};

// An arena as a plan holds it (its owner's reference).
struct ArenaHandle {
  Arena* arena = nullptr;
  explicit ArenaHandle(Arena* a) : arena(a) {}
  ArenaHandle(const ArenaHandle&) = delete;
  ArenaHandle& operator=(const ArenaHandle&) = delete;
  ~ArenaHandle() {
    if (arena != nullptr) arena->unref();
  }
};

// One op's placements: the arena and the regions its kernel's allocations may take.
struct ArenaOffer {
  Arena* arena = nullptr;
  const uint32_t* regions = nullptr;
  size_t count = 0;
  int64_t bytes = 0;  // its regions' bytes (the op's storages the plan puts in the arena)

  void* take(size_t n) const {
    for (size_t i = 0; i < count; ++i)
      if (void* p = arena->take(regions[i], n)) return p;
    return nullptr;
  }
};

// The placements of the op whose kernel runs on this thread now (null: none).
inline thread_local const ArenaOffer* t_arena_offer = nullptr;

// Offer `offer` to the allocations of a scope (a kernel's call), none outside it.
class ArenaOfferScope {
 public:
  explicit ArenaOfferScope(const ArenaOffer* offer) : was_(std::exchange(t_arena_offer, offer)) {}
  ~ArenaOfferScope() { t_arena_offer = was_; }
  ArenaOfferScope(const ArenaOfferScope&) = delete;
  ArenaOfferScope& operator=(const ArenaOfferScope&) = delete;

 private:
  const ArenaOffer* was_;
};

}  // namespace coexec
