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
#include <optional>
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
//
// An entry is flat (its vectors are cleared, not freed, when the op has run), and the worker's
// entries are reused in place (its ring, below): in steady state taping an op allocates nothing.

std::shared_ptr<Slot> slot_of(const at::Tensor& t) { return is_ph(t) ? impl_of(t)->slot : nullptr; }

struct TapeEntry {
  const c10::OperatorHandle* op = nullptr;  // null: the worker stops
  bool grad_mode = true;
  int64_t index = 0;  // the op's place in its step (errors name it)
  // per argument: its value (placeholders left undefined) and where its slots begin in `slots`
  // (one per tensor in it: its placeholder's slot, or null; none for an argument without one)
  std::vector<c10::IValue> args;
  std::vector<uint32_t> arg_slots;
  std::vector<std::shared_ptr<Slot>> slots;
  // per return: where its placeholders' slots begin in `out_slots`
  std::vector<uint32_t> out_begin;
  std::vector<std::shared_ptr<Slot>> out_slots;
  // values the skeleton let go of since the op before (t_trash): let go of by the worker
  std::vector<at::Tensor> trash;

  // Ready for another op (capacity kept).
  void clear() {
    op = nullptr;
    args.clear();
    arg_slots.clear();
    slots.clear();
    out_begin.clear();
    out_slots.clear();
    trash.clear();
  }

  // Append argument `iv`.
  void add_arg(c10::IValue&& iv) {
    const auto begin = static_cast<uint32_t>(slots.size());
    arg_slots.push_back(begin);
    if (!has_tensor(iv)) {
      args.push_back(std::move(iv));
      return;
    }
    bool any = false;
    each_tensor(iv, [&](const at::Tensor& t) {
      slots.push_back(slot_of(t));
      any = any || slots.back();
    });
    if (!any) {
      slots.resize(begin);
      args.push_back(std::move(iv));
      return;
    }
    args.push_back(map_tensors(iv, [](const at::Tensor& t) { return is_ph(t) ? at::Tensor() : t; }));
  }

  // Argument `i` with its placeholders' values in place.
  c10::IValue real_arg(size_t i) const {
    const uint32_t begin = arg_slots[i];
    const uint32_t end = i + 1 < arg_slots.size() ? arg_slots[i + 1] : static_cast<uint32_t>(slots.size());
    if (begin == end) return args[i];
    uint32_t k = begin;
    return map_tensors(args[i], [&](const at::Tensor& t) {
      const auto& s = slots[k++];
      return s ? s->real : t;
    });
  }

  // The slots of return `r` (begin, end) in out_slots.
  std::pair<uint32_t, uint32_t> outs_of(size_t r) const {
    return {out_begin[r], r + 1 < out_begin.size() ? out_begin[r + 1] : static_cast<uint32_t>(out_slots.size())};
  }
};

// Run one taped op on real tensors (the caller is below autograd) and give its outputs' values to
// their slots.
void run_entry(const TapeEntry& e) {
  c10::AutoGradMode grad(e.grad_mode);
  torch::jit::Stack stack;
  stack.reserve(e.args.size());
  for (size_t i = 0; i < e.args.size(); ++i) stack.push_back(e.real_arg(i));
  e.op->callBoxed(stack);
  for (size_t r = 0; r < e.out_begin.size(); ++r) {
    const auto [begin, end] = e.outs_of(r);
    if (begin == end) continue;
    if (stack[r].isTensorList()) {
      auto l = stack[r].toTensorVector();
      for (uint32_t i = begin; i < end; ++i)
        if (e.out_slots[i]) e.out_slots[i]->real = l[i - begin];
    } else if (e.out_slots[begin]) {
      e.out_slots[begin]->real = stack[r].toTensor();
    }
  }
}

std::string failure(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// -- the worker ------------------------------------------------------------------------------
// Ops cross to the worker through a ring of entries with one writer (the step's thread) and one
// reader (the worker): the writer fills the next free entry in place and publishes it by a
// count, the reader runs it, clears it and counts it done. Neither side takes a lock per op;
// neither sleeps at once when there is nothing to do: the worker polls for a while before it
// waits (a wake-up per op cost a system call on both sides), and so does a drain. A full ring
// makes the writer wait for the worker (it is far ahead then).
// The worker polls for kSpin after its last op: long enough to span the Python between two
// steps of a loop (a batch drawn, a loss logged; 200 us did not span an eager step of a
// third of a millisecond, and each step paid for waking the worker). Then it naps, then sleeps.
constexpr auto kSpin = std::chrono::microseconds(1000);
constexpr auto kNap = std::chrono::microseconds(50);  // (the timer's slack makes it ~100 us)
constexpr auto kNapping = std::chrono::milliseconds(100);
constexpr int64_t kRing = 8192;  // entries (a power of two)

class Worker {
 public:
  explicit Worker(int threads) : threads_(threads), ring_(kRing) { thread_ = std::thread([this] { loop(); }); }

  ~Worker() {
    next_entry();  // (op null: the stop)
    publish();
    thread_.join();
  }

  // The entry the next op is written into (cleared); publish() hands it to the worker. The
  // step's thread only; waits while the ring is full.
  TapeEntry& next_entry() {
    const int64_t next = published_.load(std::memory_order_relaxed);  // (this thread's own count)
    if (next - done_seen_ >= kRing) {  // (done_ read only when the ring looks full)
      wait_without_gil(next - kRing + 1);
      done_seen_ = done_.load(std::memory_order_acquire);
    }
    TapeEntry& e = ring_[next & (kRing - 1)];
    e.clear();
    return e;
  }

  void publish() {
    published_.fetch_add(1, std::memory_order_seq_cst);
    wake_if(idle_);
  }

  // Wait until every op published so far has run (without the GIL, if this thread holds it).
  void drain() { wait_without_gil(published_.load(std::memory_order_relaxed)); }

  // The first failure since clear_error(): (op index, message), or index -1.
  std::pair<int64_t, std::string> error() {
    std::lock_guard<std::mutex> g(mu_);
    return {failed_at_, error_};
  }

  // nanoseconds the worker spent running ops
  int64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }

  // Let go of the arguments Python holds too that the worker laid aside (bury): GIL held.
  void exhume() { grave_.exhume(); }

  // how many arguments lie aside for exhume()
  int64_t buried() const { return grave_.count(); }

  void clear_error() {
    std::lock_guard<std::mutex> g(mu_);
    failed_at_ = -1;
    error_.clear();
    failed_.store(false, std::memory_order_release);
  }

 private:
  int threads_;
  std::vector<TapeEntry> ring_;
  // (each side's counts on a cache line of their own: sharing one, every op of either side
  // took the line from the other core)
  alignas(64) std::atomic<int64_t> published_{0};  // entries the worker may run (written by the step's thread)
  int64_t done_seen_ = 0;                          // done_ as the step's thread last read it
  alignas(64) std::atomic<int64_t> done_{0};       // entries run (and cleared) by the worker
  std::atomic<int64_t> busy_ns_{0};
  alignas(64) std::mutex mu_;  // for sleeping and waking, and the failure
  std::condition_variable cv_;
  std::atomic<bool> idle_{false};      // the worker sleeps: a publish must wake it
  std::atomic<bool> napping_{false};   // the worker naps: a drain wakes it
  std::atomic<bool> draining_{false};  // a drain sleeps: the op that ends it must say so
  std::atomic<bool> failed_{false};    // ops after a failure are dropped until clear_error()
  int64_t failed_at_ = -1;
  std::string error_;
  Grave grave_;                   // arguments Python holds too, let go of under the GIL
  std::vector<at::Tensor> held_;  // (scratch for bury)
  std::thread thread_;

  // An op's arguments that Python holds too (parameters, a batch) are not let go of here but
  // by the skeleton, where it holds the GIL anyway (grave.h; Capture::locate exhumes).
  void bury(TapeEntry& e) {
    for (at::Tensor& t : e.trash)  // (a value Python holds: an op that returned its input, lift_fresh)
      if (python_holds(t)) held_.push_back(std::move(t));
    for (c10::IValue& a : e.args) {
      if (a.isTensor()) {
        if (python_holds(a.toTensor())) held_.push_back(std::move(a).toTensor());
        continue;
      }
      each_tensor(a, [this](const at::Tensor& t) {
        if (python_holds(t)) held_.push_back(t);
      });
    }
    grave_.bury(held_);
  }

  // Wait until `count` reaches `want`: polled for, then (the worker only) napped for in
  // turns of kNap for up to kNapping, then slept for; `sleeping` is set while asleep so that
  // the side that moves `count` wakes this one (wake_if), and `napping` while napping, when
  // only a drain wakes it. The worker waits for published ops, a drain for done ones.
  // (Woken by the step's first op, the worker cost the step ~25 us: a woken thread takes the
  // waker's core first; and a read early in the step waited for its wake-up. Napping, it
  // wakes by itself and catches up while the skeleton goes on, and a read wakes it.)
  void await(const std::atomic<int64_t>& count, int64_t want, std::atomic<bool>& sleeping,
             std::atomic<bool>* napping) {
    const auto ready = [&count, want] { return count.load(std::memory_order_seq_cst) >= want; };
    const auto start = std::chrono::steady_clock::now();
    while (count.load(std::memory_order_acquire) < want) {
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited <= kSpin) {
        std::this_thread::yield();
        continue;
      }
      const bool nap = napping != nullptr && waited <= kNapping;
      std::atomic<bool>& flag = nap ? *napping : sleeping;
      std::unique_lock<std::mutex> g(mu_);
      flag.store(true, std::memory_order_seq_cst);
      if (nap) {
        cv_.wait_for(g, kNap, ready);
      } else {
        cv_.wait(g, ready);
      }
      flag.store(false, std::memory_order_relaxed);
    }
  }

  // After moving a count: wake the other side if it sleeps on it.
  void wake_if(const std::atomic<bool>& sleeping) {
    if (!sleeping.load(std::memory_order_seq_cst)) return;
    { std::lock_guard<std::mutex> g(mu_); }  // (it is either not yet waiting, or asleep)
    cv_.notify_all();
  }

  void loop() {
    at::init_num_threads();
    // intra-op threads are per thread: the skeleton's count, as eager runs (a parallel
    // reduction's result depends on how many threads split it)
    at::set_num_threads(threads_);
    at::AutoDispatchBelowADInplaceOrView below;  // the skeleton did the autograd side
    for (int64_t taken = 0;; ++taken) {
      await(published_, taken + 1, idle_, &napping_);
      TapeEntry& e = ring_[taken & (kRing - 1)];
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
      e.clear();  // (its tensors go before the op counts as done)
      done_.store(taken + 1, std::memory_order_seq_cst);
      wake_if(draining_);
    }
  }

  // Wait until `want` ops are done, without the GIL if this thread holds it.
  void wait_without_gil(int64_t want) {
    if (done_.load(std::memory_order_acquire) >= want) return;
    wake_if(napping_);  // (a napping worker would make this wait out its nap)
    std::optional<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) nogil.emplace();
    await(done_, want, draining_, nullptr);
  }
};

}  // namespace
}  // namespace coexec
