// The executor's count of live storages and arena regions, in C++ (executor/memory.py has the
// same class in Python, whose docstring explains the rules; a property test keeps the two
// equal). The native engine (engine.h) counts with this one.
#pragma once

#include <torch/extension.h>

#include <map>
#include <optional>
#include <unordered_map>
#include <vector>

namespace coexec {


inline constexpr int64_t kAllocated = -1;
inline constexpr int64_t kOldArena = -2;

// The storage a tensor's memory belongs to, by its data address (0: none to count).
inline int64_t storage_key(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || !t.has_storage()) return 0;
  return reinterpret_cast<int64_t>(t.storage().data());
}

struct ArenaOut {
  int64_t offset;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;
  at::ScalarType dtype;
  int64_t nbytes;
};

struct Entry {
  int64_t count;
  int64_t nbytes;
  int64_t offset;  // in the arena, or kAllocated, or kOldArena
};

class LiveBytes {
 public:
  int64_t live = 0;
  int64_t peak = 0;

  std::optional<at::Tensor> arena() const { return arena_; }

  void attach(const std::optional<at::Tensor>& arena) {
    if (arena.has_value() == arena_.has_value() &&
        (!arena.has_value() || arena->unsafeGetTensorImpl() == arena_->unsafeGetTensorImpl()))
      return;
    for (auto& kv : storages_)
      if (kv.second.offset >= 0) kv.second.offset = kOldArena;
    live -= size_;
    arena_ = arena;
    regions_.clear();
    if (!arena.has_value()) {
      base_ = 0;
      size_ = 0;
      return;
    }
    base_ = reinterpret_cast<int64_t>(arena->data_ptr());
    size_ = arena->numel();
    live += size_;
    if (live > peak) peak = live;
  }

  at::Tensor region(int64_t offset, int64_t nbytes) const {
    TORCH_CHECK(arena_.has_value(), "no arena attached");
    int64_t n = std::max<int64_t>(nbytes, 1);
    TORCH_CHECK(offset >= 0 && offset + n <= size_, "region outside the arena");
    at::Tensor keep = *arena_;
    return torch::from_blob(
        reinterpret_cast<char*>(base_) + offset, {n}, [keep](void*) {},
        at::TensorOptions().dtype(at::kByte).device(keep.device()));
  }

  bool free(int64_t offset, int64_t nbytes) const {
    if (offset < 0 || offset + nbytes > size_) return false;
    auto it = regions_.lower_bound(offset + nbytes);
    if (it == regions_.begin()) return true;
    --it;
    return it->second <= offset;
  }

  bool all_free(const std::vector<ArenaOut>& outs) const {
    for (const auto& o : outs)
      if (!free(o.offset, o.nbytes)) return false;
    return true;
  }

  bool in_arena(const at::Tensor& t) const {
    if (!arena_.has_value() || t.layout() != at::kStrided || !t.has_storage()) return false;
    int64_t p = storage_key(t);
    return base_ <= p && p < base_ + size_;
  }

  int64_t offset_of(const at::Tensor& t) const { return storage_key(t) - base_; }

  // Is t's storage counted already? (then add only counts one more value on it)
  bool counted(int64_t key) {
    auto it = storages_.find(key);
    if (it == storages_.end()) return false;
    it->second.count += 1;
    return true;
  }

  // A storage not counted yet: the step's, unless one of the op's inputs lies on it.
  void add_new(const at::Tensor& t, int64_t key, const std::vector<int64_t>& inputs) {
    for (int64_t k : inputs)
      if (k == key) return;
    int64_t n = static_cast<int64_t>(t.storage().nbytes());
    int64_t offset = key - base_;
    if (arena_.has_value() && 0 <= offset && offset < size_) {
      storages_[key] = Entry{1, n, offset};
      regions_[offset] = offset + std::max<int64_t>(n, 1);
      return;
    }
    storages_[key] = Entry{1, n, kAllocated};
    live += n;
    if (live > peak) peak = live;
  }

  void remove(const at::Tensor& t) {
    int64_t key = storage_key(t);
    if (!key) return;
    auto it = storages_.find(key);
    if (it == storages_.end()) return;
    if (--it->second.count == 0) {
      Entry e = it->second;
      storages_.erase(it);
      if (e.offset == kAllocated)
        live -= e.nbytes;
      else if (e.offset >= 0)
        regions_.erase(e.offset);
    }
  }

  void reset_peak() { peak = live; }

  void clear() {
    live = peak = 0;
    storages_.clear();
    regions_.clear();
    arena_.reset();
    base_ = size_ = 0;
  }

 private:
  std::optional<at::Tensor> arena_;
  int64_t base_ = 0;
  int64_t size_ = 0;
  std::unordered_map<int64_t, Entry> storages_;
  std::map<int64_t, int64_t> regions_;  // live arena storages: offset -> end
};

}  // namespace coexec
