// Which tensors of a step are gone (coexec/tracking.py drives it): the skeleton holds each
// placeholder by a weak reference to its C++ tensor and asks, every few ops, which died. In
// Python that scan cost a tenth of a co-executed step; here it is a few nanoseconds a tensor.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <unordered_set>
#include <vector>

namespace coexec {

class Tracker {
 public:
  // Track `t` as holding value `vid`; its slot.
  int64_t add(const at::Tensor& t, int64_t vid) {
    auto slot = static_cast<int64_t>(refs_.size());
    refs_.emplace_back(t.getIntrusivePtr());
    vids_.push_back(vid);
    live_.push_back(slot);
    return slot;
  }

  // The tensor in `slot` holds value `vid` now (an in-place op made a new value of it).
  void retarget(int64_t slot, int64_t vid) { vids_.at(slot) = vid; }

  bool expired(int64_t slot) const { return refs_.at(slot).expired(); }

  // The values of the tensors gone since the last sweep, each once; with `aliased`, not those
  // a tensor still alive holds too.
  std::vector<int64_t> sweep(bool aliased) {
    std::vector<int64_t> dead;
    size_t kept = 0;
    for (size_t r = 0; r < live_.size(); ++r) {
      int64_t s = live_[r];
      if (refs_[s].expired()) {
        dead.push_back(vids_[s]);
        refs_[s].reset();
      } else {
        live_[kept++] = s;
      }
    }
    live_.resize(kept);
    if (dead.empty()) return dead;
    std::sort(dead.begin(), dead.end());
    dead.erase(std::unique(dead.begin(), dead.end()), dead.end());
    if (aliased && !live_.empty()) {
      std::unordered_set<int64_t> held;
      for (auto s : live_) held.insert(vids_[s]);
      dead.erase(std::remove_if(dead.begin(), dead.end(), [&](int64_t v) { return held.count(v) > 0; }), dead.end());
    }
    return dead;
  }

 private:
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> refs_;
  std::vector<int64_t> vids_;
  std::vector<int64_t> live_;  // slots whose tensors were alive at the last sweep
};

}  // namespace coexec
