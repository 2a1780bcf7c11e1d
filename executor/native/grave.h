// Tensors Python holds too, let go of under the GIL: shared by the engine (engine.h) and the
// capture's worker (capture_worker.h), threads that never take the GIL.
//
// Since torch 2.10 a tensor with a Python object keeps that object alive while C++ holds it as
// well (c10/util/intrusive_ptr.h, "PyObject preservation"): a C++ reference count going from 2
// to 1 decrefs the Python object, which takes the GIL, so letting go of a parameter on such a
// thread would wait for the skeleton's Python (docs/coexec.md, The native engine). The thread
// lays those tensors aside (bury) and the skeleton lets go of them where it holds the GIL
// (exhume).
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

namespace coexec {

// Does Python hold `t` too (it has a Python object)?
inline bool python_holds(const at::Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj() != nullptr;
}

class Grave {
 public:
  // Lay `t` aside if Python holds it (else the caller lets go of it).
  void bury(at::Tensor&& t) {
    if (!python_holds(t)) return;
    std::lock_guard<std::mutex> g(mu_);
    dead_.push_back(std::move(t));
    buried_.store(static_cast<int64_t>(dead_.size()), std::memory_order_release);
  }

  // Those of `ts` Python holds are laid aside, the others let go of (after the lock); `ts` ends
  // empty.
  void bury(std::vector<at::Tensor>& ts) {
    if (ts.empty()) return;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& t : ts)
        if (python_holds(t)) dead_.push_back(std::move(t));
      buried_.store(static_cast<int64_t>(dead_.size()), std::memory_order_release);
    }
    ts.clear();
  }

  // Let go of what was laid aside: GIL held.
  void exhume() {
    if (buried_.load(std::memory_order_acquire) == 0) return;
    std::vector<at::Tensor> dead;
    {
      std::lock_guard<std::mutex> g(mu_);
      dead.swap(dead_);
      buried_.store(0, std::memory_order_release);
    }
  }

  // how many tensors lie aside (read without the lock: a hint)
  int64_t count() const { return buried_.load(std::memory_order_acquire); }

 private:
  std::mutex mu_;
  std::vector<at::Tensor> dead_;
  std::atomic<int64_t> buried_{0};
};

}  // namespace coexec
