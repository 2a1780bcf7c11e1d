// Capture's tape and worker (capture.cpp): a taped op, and the thread that runs taped ops without the GIL.
// Internal to capture.cpp, the only file that includes it (hence the anonymous namespace).
#pragma once

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <Python.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "capture_placeholders.h"
#include "grave.h"

namespace coexec {
namespace {

namespace py = pybind11;

// -- the tape --------------------------------------------------------------------------------
// A taped op holds its placeholders' slots, not the placeholders: autograd lets a gradient be
// stolen into ``.grad`` only when nothing else holds its TensorImpl (AccumulateGrad's use-count
// check), so a tape holding them would change which ops the backward makes.

struct Arg {
  c10::IValue value;                         // the argument, placeholders left undefined
  std::vector<std::shared_ptr<Slot>> slots;  // per tensor in it: its placeholder's slot, or null
};

std::shared_ptr<Slot> slot_of(const at::Tensor& t) { return is_ph(t) ? impl_of(t)->slot : nullptr; }

Arg arg_of(const c10::IValue& iv) {
  if (!has_tensor(iv)) return Arg{iv, {}};
  Arg a;
  bool any = false;
  each_tensor(iv, [&](const at::Tensor& t) {
    a.slots.push_back(slot_of(t));
    any = any || a.slots.back();
  });
  if (!any) return Arg{iv, {}};
  a.value = map_tensors(iv, [](const at::Tensor& t) { return is_ph(t) ? at::Tensor() : t; });
  return a;
}

c10::IValue real_arg(const Arg& a) {
  if (a.slots.empty()) return a.value;
  size_t i = 0;
  return map_tensors(a.value, [&](const at::Tensor& t) {
    const auto& s = a.slots[i++];
    return s ? s->real : t;
  });
}

struct TapeEntry {
  const c10::OperatorHandle* op = nullptr;  // null: the worker stops
  std::vector<Arg> args;
  std::vector<std::vector<std::shared_ptr<Slot>>> outs;  // per return: its placeholders' slots
  bool grad_mode = true;
  int64_t index = 0;  // the op's place in its step (errors name it)
};

// Run one taped op on real tensors (the caller is below autograd) and give its outputs' values to
// their slots.
void run_entry(const TapeEntry& e) {
  c10::AutoGradMode grad(e.grad_mode);
  torch::jit::Stack stack;
  stack.reserve(e.args.size());
  for (const Arg& a : e.args) stack.push_back(real_arg(a));
  e.op->callBoxed(stack);
  for (size_t r = 0; r < e.outs.size(); ++r) {
    const auto& slots = e.outs[r];
    if (slots.empty()) continue;
    if (stack[r].isTensorList()) {
      auto l = stack[r].toTensorVector();
      for (size_t i = 0; i < slots.size(); ++i)
        if (slots[i]) slots[i]->real = l[i];
    } else if (slots[0]) {
      slots[0]->real = stack[r].toTensor();
    }
  }
}

std::string failure(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// -- the worker ------------------------------------------------------------------------------
// Ops cross to the worker through a locked queue. Neither side sleeps at once when there is
// nothing to do: the worker polls for a while before it waits (a wake-up per op cost a system
// call on both sides), and so does a drain.
constexpr auto kSpin = std::chrono::microseconds(200);

class Worker {
 public:
  explicit Worker(int threads) : threads_(threads) { thread_ = std::thread([this] { loop(); }); }

  ~Worker() {
    push(TapeEntry());  // (the stop)
    thread_.join();
  }

  void push(TapeEntry e) {
    bool wake;
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.push_back(std::move(e));
      pushed_.fetch_add(1, std::memory_order_release);
      wake = idle_;
    }
    if (wake) cv_.notify_all();
  }

  // Wait until every op pushed so far has run (without the GIL, if this thread holds it).
  void drain() {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      wait_done();
    } else {
      wait_done();
    }
  }

  // The first failure since clear_error(): (op index, message), or index -1.
  std::pair<int64_t, std::string> error() {
    std::lock_guard<std::mutex> g(mu_);
    return {failed_at_, error_};
  }

  // nanoseconds the worker spent running ops
  int64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }

  // Let go of the arguments Python holds too that the worker laid aside (bury): GIL held.
  void exhume() { grave_.exhume(); }

  void clear_error() {
    std::lock_guard<std::mutex> g(mu_);
    failed_at_ = -1;
    error_.clear();
    failed_.store(false, std::memory_order_release);
  }

 private:
  int threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TapeEntry> queue_;
  std::atomic<int64_t> pushed_{0}, done_{0}, busy_ns_{0};
  int64_t taken_ = 0;  // (the worker's own count of ops popped)
  std::atomic<bool> failed_{false};  // ops after a failure are dropped until clear_error()
  int64_t failed_at_ = -1;
  std::string error_;
  Grave grave_;  // arguments Python holds too, let go of under the GIL
  std::vector<at::Tensor> held_;  // (scratch for bury)
  bool idle_ = false;      // the worker sleeps: a push must wake it
  bool draining_ = false;  // a drain sleeps: the op that ends it must say so
  std::thread thread_;

  // An op's arguments that Python holds too (parameters, a batch) are not let go of here but
  // by the skeleton, where it holds the GIL anyway (grave.h; Capture::locate exhumes).
  // (a tensor argument moves to the grave: the entry is let go of next; one in a list is copied)
  void bury(TapeEntry& e) {
    for (Arg& a : e.args) {
      if (a.value.isTensor()) {
        if (python_holds(a.value.toTensor())) held_.push_back(std::move(a.value).toTensor());
        continue;
      }
      each_tensor(a.value, [this](const at::Tensor& t) {
        if (python_holds(t)) held_.push_back(t);
      });
    }
    grave_.bury(held_);
  }

  // The next op: polled for without the lock (the skeleton pushes under it), then slept for.
  TapeEntry next() {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (pushed_.load(std::memory_order_acquire) == taken_ && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    std::unique_lock<std::mutex> g(mu_);
    if (queue_.empty()) {
      idle_ = true;
      cv_.wait(g, [this] { return !queue_.empty(); });
      idle_ = false;
    }
    TapeEntry e = std::move(queue_.front());
    queue_.pop_front();
    ++taken_;
    return e;
  }

  void loop() {
    at::init_num_threads();
    // intra-op threads are per thread: the skeleton's count, as eager runs (a parallel
    // reduction's result depends on how many threads split it)
    at::set_num_threads(threads_);
    at::AutoDispatchBelowADInplaceOrView below;  // the skeleton did the autograd side
    for (;;) {
      TapeEntry e = next();
      if (e.op == nullptr) return;
      if (!failed_.load(std::memory_order_acquire)) {
        const auto t0 = std::chrono::steady_clock::now();
        try {
          run_entry(e);
          busy_ns_.fetch_add(ns_since(t0), std::memory_order_relaxed);
        } catch (const std::exception& ex) {
          std::lock_guard<std::mutex> g(mu_);
          failed_at_ = e.index;
          error_ = failure(ex);
          failed_.store(true, std::memory_order_release);
        }
      }
      bury(e);
      e = TapeEntry();  // (its tensors go before the op counts as done)
      bool tell;
      {
        std::lock_guard<std::mutex> g(mu_);
        done_.fetch_add(1, std::memory_order_release);
        tell = draining_;
      }
      if (tell) cv_.notify_all();
    }
  }

  void wait_done() {
    const int64_t want = pushed_.load(std::memory_order_acquire);
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (done_.load(std::memory_order_acquire) < want) {
      if (std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> g(mu_);
        draining_ = true;
        cv_.wait(g, [this, want] { return done_.load(std::memory_order_acquire) >= want; });
        draining_ = false;
        return;
      }
      std::this_thread::yield();
    }
  }
};

}  // namespace
}  // namespace coexec
