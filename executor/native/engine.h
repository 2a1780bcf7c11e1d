// The native engine: the executor's queue, value table and run loop on a C++ thread that never
// takes the GIL (executor/engine.py drives it; executor/stream.py's _Worker is the same machine
// in Python, kept for memory budgets and for machines without a compiler).
//
// The skeleton's thread converts each instruction while it holds the GIL (steps.h) and pushes
// it; the engine's thread pops and runs them: ops as they arrive, or deferred into the open
// block and run in its planned order, ahead of the launch while they fit the block's bound
// (Follow), the rest at its Launch. Values Python let go of are freed after their last use.
// The rules are those of executor/stream.py, whose docstrings explain them; this file mirrors
// its handlers one for one.
//
// Locks: the queue has one, the table of values and results another. Neither is held while a
// tensor is destroyed: a tensor whose Python object died while the engine held it owns that
// object, and destroying it takes the GIL, which a Python thread waiting on one of these locks
// would hold.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "live_bytes.h"
#include "steps.h"

namespace coexec {

// A planned block (planner.schedule.Block): the order of its ops, and per op the bytes its new
// outputs hold.
struct Plan {
  std::vector<int64_t> order;
  std::vector<int64_t> new_bytes;
};

struct Instr {
  enum Kind : uint8_t { kRun, kPut, kFree, kFreeRange, kLaunch, kFollow, kResetPeak, kFail, kInject, kHang, kDie, kStop };
  Kind kind = kRun;
  bool deferred = false;
  std::unique_ptr<Step> step;  // kRun
  std::vector<int64_t> vids;  // kFree; kPut: the values made
  std::vector<at::Tensor> tensors;  // kPut: their tensors
  std::vector<int64_t> keys;  // kPut: the storages of the op's inputs
  std::vector<std::pair<int64_t, int64_t>> moves;  // kPut
  int64_t lo = 0, hi = 0;  // kFreeRange
  std::shared_ptr<const Plan> plan;  // kLaunch (null: as issued), kFollow
  int64_t bound = 0;  // kFollow
  std::optional<at::Tensor> arena;  // kResetPeak
};

// why the ops after one are skipped: it raised (its exception is kept), a test's fault, or an op
// Python ran in the engine's place raised (executor/engine.py keeps that one)
enum ErrorKind : int { kNone = 0, kOpFailed = 1, kInjected = 2, kPython = 3 };
enum Ahead : int { kRanAhead = 0, kAtLaunch = 1, kIssue = 2, kBytes = 3, kRegion = 4 };

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(int threads) : threads_(threads) {}

  // Start the thread; it keeps the engine alive until it stops (an engine abandoned while
  // stuck lives on with it).
  void start() {
    auto self = shared_from_this();
    std::thread([self] { self->loop(); }).detach();
  }

  // -- the skeleton's side (GIL held) --------------------------------------------------------
  void push(Instr&& ins) {
    bool wake;
    {
      std::lock_guard<std::mutex> g(q_mu_);
      q_.push_back(std::move(ins));
      queued_.store(true, std::memory_order_release);
      wake = sleeping_;
    }
    if (wake) q_cv_.notify_one();
  }

  // Block until `position` instructions are done: 0 done, 1 timed out, 2 the thread stopped.
  int wait(int64_t position, double timeout) {
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout));
    std::unique_lock<std::mutex> lk(done_mu_);
    want_.store(position);
    int status = 0;
    while (done_.load() < position) {
      if (!alive_.load()) {
        status = 2;
        break;
      }
      if (done_cv_.wait_until(lk, deadline) == std::cv_status::timeout && done_.load() < position) {
        status = alive_.load() ? 1 : 2;
        break;
      }
    }
    want_.store(std::numeric_limits<int64_t>::max());
    return status;
  }

  // Wait up to `timeout` seconds for the thread to stop.
  void join(double timeout) {
    std::unique_lock<std::mutex> lk(done_mu_);
    done_cv_.wait_for(lk, std::chrono::duration<double>(timeout), [this] { return !alive_.load(); });
  }

  std::optional<at::Tensor> value(int64_t vid) {
    std::lock_guard<std::mutex> g(table_mu_);
    auto it = values_.find(vid);
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }

  std::optional<Stack> take_result(int64_t op_index) {
    std::lock_guard<std::mutex> g(table_mu_);
    auto it = results_.find(op_index);
    if (it == results_.end()) return std::nullopt;
    Stack s = std::move(it->second);
    results_.erase(it);
    return s;
  }

  // Let go of the tensors the thread laid aside (grave.h): GIL held.
  void exhume() { grave_.exhume(); }

  // (only while nothing is pending: the thread is waiting for work)
  void clear_error() {
    error_.store(kNone);
    failure_ = nullptr;
  }

  // Forget values, results, errors and the open block (only while nothing is pending).
  void clear() {
    std::unordered_map<int64_t, at::Tensor> dead;
    std::unordered_map<int64_t, Stack> results;
    {
      std::lock_guard<std::mutex> g(table_mu_);
      dead.swap(values_);
      results.swap(results_);
    }
    clear_error();
    memory_.clear();
    block_.clear();
    ran_.clear();
    pending_.clear();
    future_.clear();
    released_.clear();
    following_.reset();
    cursor_ = 0;
    issued_ = 0;
    held_ = 0;
    stopped_ = {-1, -1};
    snapshot();
  }

  void release_hang() {
    {
      std::lock_guard<std::mutex> g(hang_mu_);
      hang_released_ = true;
    }
    hang_cv_.notify_all();
  }

  // The op indices run from now on, in the order run (tests: the planned order is the order run).
  void record_order(bool on) {
    std::lock_guard<std::mutex> g(table_mu_);
    recording_ = on;
    order_.clear();
    times_.clear();
  }

  std::vector<int64_t> ran_order() {
    std::lock_guard<std::mutex> g(table_mu_);
    return order_;
  }

  // With record_order: per op run, its (start, end) on the steady clock, in seconds (the clock
  // of Python's time.perf_counter on Linux).
  std::vector<std::pair<double, double>> ran_times() {
    std::lock_guard<std::mutex> g(table_mu_);
    return times_;
  }

  [[noreturn]] void raise_failure() const {
    if (failure_) std::rethrow_exception(failure_);
    throw std::runtime_error("no failure");
  }

  // state read by Python (atomics: the thread writes them as it goes)
  std::atomic<int64_t> done_{0};
  std::atomic<int> error_{kNone};
  std::atomic<int64_t> error_op_index_{-1};
  std::shared_ptr<Op> error_op_;
  std::atomic<bool> alive_{true};
  std::atomic<int64_t> ops_run_{0}, arena_hits_{0}, arena_misses_{0}, blocks_{0}, peak_{0}, live_{0};
  std::atomic<int64_t> busy_ns_{0};
  std::atomic<int64_t> ahead_[5] = {{0}, {0}, {0}, {0}, {0}};

  // out= variants found laid out otherwise (failed) or as planned (wrote) since Python last
  // asked: it keeps a process-wide record (executor/stream.py writes_in_place)
  std::pair<std::vector<py::object>, std::vector<py::object>> take_out_reports() {
    std::lock_guard<std::mutex> g(table_mu_);
    std::pair<std::vector<py::object>, std::vector<py::object>> r;
    for (auto* op : new_failed_) r.first.push_back(op->func);
    for (auto* op : new_wrote_) r.second.push_back(op->func);
    new_failed_.clear();
    new_wrote_.clear();
    return r;
  }

 private:
  int threads_;
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<Instr> q_;
  bool sleeping_ = false;
  std::atomic<bool> queued_{false};

  std::mutex done_mu_;
  std::condition_variable done_cv_;
  std::atomic<int64_t> want_{std::numeric_limits<int64_t>::max()};
  int64_t held_ = 0;  // instructions taken while a block is open: done with it

  std::mutex table_mu_;
  std::unordered_map<int64_t, at::Tensor> values_;
  std::unordered_map<int64_t, Stack> results_;  // op index -> result kept for Python

  std::exception_ptr failure_;
  LiveBytes memory_;

  // the open block (executor/stream.py _Worker: block, ran, following, bound, cursor, pending,
  // future, released, stopped)
  std::vector<std::unique_ptr<Step>> block_;
  std::vector<bool> ran_;
  std::shared_ptr<const Plan> following_;
  int64_t bound_ = 0;
  size_t cursor_ = 0;
  size_t issued_ = 0;  // the first op, in issue order, not run yet (or before it)
  std::unordered_map<int64_t, int64_t> pending_;
  std::unordered_set<int64_t> future_;
  std::unordered_set<int64_t> released_;
  std::pair<int64_t, int> stopped_{-1, -1};

  std::mutex hang_mu_;
  std::condition_variable hang_cv_;
  bool hang_released_ = false;

  std::unordered_set<Op*> failed_out_, wrote_out_;  // out= variants that failed, that wrote
  std::vector<Op*> new_failed_, new_wrote_;  // (under table_mu_) not yet reported to Python

  std::atomic<bool> recording_{false};  // record_order
  std::vector<int64_t> order_;
  std::vector<std::pair<double, double>> times_;

  std::vector<int64_t> keys_;  // scratch
  std::vector<at::Tensor> outs_;
  std::vector<at::Tensor> kept_;  // scratch: run_op's arguments Python holds too

  Grave grave_;  // let go of by the thread, to be destroyed under the GIL
  std::vector<int64_t> retired_;

  void snapshot() {
    peak_.store(memory_.peak, std::memory_order_relaxed);
    live_.store(memory_.live, std::memory_order_relaxed);
  }

  void loop() {
    at::init_num_threads();
    // intra-op threads are per thread: the skeleton's count, as eager would run (a parallel
    // reduction's result depends on how many threads split it)
    at::set_num_threads(threads_);
    c10::GradMode::set_enabled(false);
    // below autograd and ADInplaceOrView: the skeleton did the autograd side of every op
    at::AutoDispatchBelowADInplaceOrView below;
    std::deque<Instr> batch;
    while (true) {
      {
        // Yield a while before sleeping: the skeleton pushes an op every 10-100 us, and waking
        // a sleeping thread at each push was a tenth of the skeleton's time per op at batch 1
        // (docs/coexec.md, The native engine)
        for (int k = 0; k < 2000 && !queued_.load(std::memory_order_acquire); ++k) std::this_thread::yield();
        std::unique_lock<std::mutex> lk(q_mu_);
        while (q_.empty()) {
          sleeping_ = true;
          q_cv_.wait(lk);
          sleeping_ = false;
        }
        batch.swap(q_);
        queued_.store(false, std::memory_order_release);
      }
      while (!batch.empty()) {
        auto t0 = std::chrono::steady_clock::now();
        bool go_on;
        {
          Instr ins = std::move(batch.front());
          batch.pop_front();
          go_on = handle(ins);
        }  // (its step and tensors are let go of here, no lock held)
        busy_ns_.fetch_add(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
            std::memory_order_relaxed);
        snapshot();
        if (!go_on) {
          stop();
          return;
        }
        if (!block_.empty()) {
          ++held_;  // done when the block is: a wait launches it first
          continue;
        }
        done_.fetch_add(1 + held_);
        held_ = 0;
        if (done_.load() >= want_.load()) {
          std::lock_guard<std::mutex> g(done_mu_);
          done_cv_.notify_all();
        }
      }
    }
  }

  void stop() {
    alive_.store(false);
    std::lock_guard<std::mutex> g(done_mu_);
    done_cv_.notify_all();
  }

  bool handle(Instr& ins) {
    switch (ins.kind) {
      case Instr::kRun:
        if (ins.deferred)
          defer(std::move(ins.step));
        else if (error_.load() == kNone)
          run(*ins.step);
        return true;
      case Instr::kPut:
        if (error_.load() == kNone) store(ins.vids, ins.tensors, ins.moves, ins.keys);  // (Python ran it)
        return true;
      case Instr::kFree:
        on_free(ins.vids);
        return true;
      case Instr::kFreeRange:
        on_free_range(ins.lo, ins.hi);
        return true;
      case Instr::kLaunch:
        launch(ins.plan.get());
        return true;
      case Instr::kFollow:
        if (ins.plan != following_) {
          following_ = ins.plan;
          cursor_ = 0;
        }
        bound_ = ins.bound;
        advance();
        return true;
      case Instr::kResetPeak:
        memory_.attach(ins.arena);
        memory_.reset_peak();
        return true;
      case Instr::kFail:  // (Python ran an op and it failed: skip what follows, as after an error)
        if (error_.load() == kNone) error_.store(kPython);
        return true;
      case Instr::kInject:  // (a test's fault)
        error_.store(kInjected);
        return true;
      case Instr::kHang: {
        std::unique_lock<std::mutex> lk(hang_mu_);
        hang_cv_.wait_for(lk, std::chrono::hours(1), [this] { return hang_released_; });
        return true;
      }
      case Instr::kDie:
      case Instr::kStop:
        return false;
    }
    return true;
  }

  // -- running one op (Worker.run, run_in_arena) ------------------------------------------
  static double now_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  void run(Step& s) {
    if (!recording_) return run_op(s);
    double t0 = now_seconds();
    run_op(s);
    double t1 = now_seconds();
    std::lock_guard<std::mutex> g(table_mu_);
    order_.push_back(s.op_index);
    times_.emplace_back(t0, t1);
  }

  void run_op(Step& s) {
    {
      Stack stack = std::move(s.stack);
      run_stack(s, stack);
    }  // (the stack let go of its arguments here; those Python holds are still in kept_)
    grave_.bury(kept_);
  }

  void run_stack(Step& s, Stack& stack) {
    c10::GradMode::set_enabled(s.grad_mode);
    for (const auto& r : s.refs) {
      auto it = values_.find(r.vid);
      if (it == values_.end()) {
        // (a KeyError in Python, as the Python executor's table raises)
        fail(s, std::make_exception_ptr(py::key_error(
                               "value " + std::to_string(r.vid) + " is not in the executor's table")));
        return;
      }
      coexec::put(stack, r, it->second);
    }
    // (the arguments Python holds go into kept_: the stack letting go of them is then not the
    // 2 -> 1 step; they are buried after it)
    scan_inputs(stack, keys_, kept_);
    std::vector<at::Tensor>& outs = outs_;
    try {
      bool placed = false;
      if (s.out && !failed_out_.count(s.out->op.get()) && memory_.arena().has_value()) {
        if (!memory_.all_free(s.arena))
          arena_misses_.fetch_add(1, std::memory_order_relaxed);
        else
          placed = call_out(s, stack, outs);
      }
      if (!placed) {
        s.op->handle.callBoxed(&stack);
        flatten(stack, outs);
        if (s.keep_result) {
          std::lock_guard<std::mutex> g(table_mu_);
          results_[s.op_index] = std::move(stack);
        }
      }
    } catch (...) {
      fail(s, std::current_exception());
      return;
    }
    ops_run_.fetch_add(1, std::memory_order_relaxed);
    store(s.outs, outs, s.moves, keys_);
    outs.clear();
  }

  // Outputs into the table (after the moves of arguments written in place), counted.
  void store(const std::vector<int64_t>& vids, const std::vector<at::Tensor>& outs,
             const std::vector<std::pair<int64_t, int64_t>>& moves, const std::vector<int64_t>& keys) {
    std::vector<at::Tensor> dead;  // let go of after the lock
    {
      std::lock_guard<std::mutex> g(table_mu_);
      for (const auto& m : moves) {
        auto it = values_.find(m.first);
        if (it == values_.end()) continue;
        at::Tensor t = std::move(it->second);
        values_.erase(it);
        auto& slot = values_[m.second];
        if (slot.defined()) dead.push_back(std::move(slot));
        slot = std::move(t);
      }
      size_t n = std::min(outs.size(), vids.size());
      for (size_t j = 0; j < n; ++j) {
        const at::Tensor& t = outs[j];
        auto it = values_.find(vids[j]);
        if (it != values_.end()) {
          if (it->second.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) continue;  // (a move)
          memory_.remove(it->second);
          dead.push_back(std::move(it->second));
          it->second = t;
        } else {
          values_.emplace(vids[j], t);
        }
        int64_t key = storage_key(t);
        if (key && !memory_.counted(key)) memory_.add_new(t, key, keys);
      }
    }
    grave_.bury(dead);
  }

  bool call_out(Step& s, const Stack& stack, std::vector<at::Tensor>& outs) {
    std::vector<at::Tensor> views;
    for (const auto& o : s.arena) {
      at::Tensor raw = memory_.region(o.offset, o.nbytes);
      int64_t item = c10::elementSize(o.dtype);
      views.push_back(raw.view(o.dtype).slice(0, 0, raw.numel() / item).as_strided(o.shape, o.stride));
    }
    Stack call;
    const OutVariant& out = *s.out;
    call.reserve(out.map.size());
    for (auto j : out.map) call.push_back(j < 0 ? c10::IValue(views[-1 - j]) : stack[j]);
    try {
      out.op->handle.callBoxed(&call);
    } catch (const c10::IndexError&) {
      throw;  // (not a RuntimeError in Python: the Python runner would not catch these either)
    } catch (const c10::ValueError&) {
      throw;
    } catch (const c10::TypeError&) {
      throw;
    } catch (const c10::NotImplementedError&) {
      throw;
    } catch (const c10::Error&) {
      note_out(out.op.get(), false);
      return false;
    }
    for (size_t j = 0; j < views.size(); ++j) {
      if (!laid_out_as_planned(views[j], s.arena[j])) {
        note_out(out.op.get(), false);
        return false;
      }
    }
    note_out(out.op.get(), true);
    arena_hits_.fetch_add(1, std::memory_order_relaxed);
    outs = views;
    return true;
  }

  void note_out(Op* op, bool wrote) {
    auto& seen = wrote ? wrote_out_ : failed_out_;
    if (!seen.insert(op).second) return;
    std::lock_guard<std::mutex> g(table_mu_);
    (wrote ? new_wrote_ : new_failed_).push_back(op);
  }

  void fail(const Step& s, std::exception_ptr e) {
    failure_ = e;
    error_op_ = s.op;
    error_op_index_.store(s.op_index);
    error_.store(kOpFailed);
  }

  void free_value(int64_t vid) {
    at::Tensor dead;
    {
      std::lock_guard<std::mutex> g(table_mu_);
      auto it = values_.find(vid);
      if (it == values_.end()) return;
      memory_.remove(it->second);
      dead = std::move(it->second);
      values_.erase(it);
    }
    grave_.bury(std::move(dead));
  }

  // -- the other instructions ----------------------------------------------------------------
  void on_free(const std::vector<int64_t>& vids) {
    for (auto v : vids) {
      auto p = pending_.find(v);
      if (future_.count(v) || (p != pending_.end() && p->second > 0))
        released_.insert(v);  // a deferred run still makes or reads it
      else
        free_value(v);
    }
    if (following_) advance();  // memory went down: maybe the next op fits
  }

  void on_free_range(int64_t lo, int64_t hi) {
    if (!block_.empty()) launch(nullptr);
    std::vector<at::Tensor> dead;
    {
      std::lock_guard<std::mutex> g(table_mu_);
      for (auto it = values_.begin(); it != values_.end();) {
        if (lo <= it->first && it->first < hi) {
          memory_.remove(it->second);
          dead.push_back(std::move(it->second));
          it = values_.erase(it);
        } else {
          ++it;
        }
      }
    }
    grave_.bury(dead);
    for (auto it = released_.begin(); it != released_.end();)
      it = (lo <= *it && *it < hi) ? released_.erase(it) : std::next(it);
  }

  // -- the open block (Worker._defer, _advance, _on_launch, _run_deferred, _retire) -----------
  void defer(std::unique_ptr<Step> s) {
    for (const auto& r : s->refs) ++pending_[r.vid];
    for (const auto& m : s->moves) {
      ++pending_[m.first];
      future_.insert(m.second);
    }
    for (auto v : s->outs) future_.insert(v);
    block_.push_back(std::move(s));
    ran_.push_back(false);
    if (following_) advance();
  }

  // Run the followed block's ops in its order while they have arrived and the bytes held stay
  // within the bound; where the plan's next op is not issued yet, the issued ones in issue
  // order, within the same bound (stream.py _Worker._advance says why either order is safe).
  void advance() {
    const auto& order = following_->order;
    const auto& news = following_->new_bytes;
    auto fits = [&](size_t k) { return memory_.live + (k < news.size() ? news[k] : 0) <= bound_; };
    bool waiting_for_issue = false;
    while (cursor_ < order.size() && error_.load() == kNone) {
      auto k = static_cast<size_t>(order[cursor_]);
      if (k >= block_.size()) {
        stopped(kIssue);
        waiting_for_issue = true;
        break;
      }
      if (!ran_[k]) {
        if (!fits(k)) return stopped(kBytes);
        if (!arena_ready(*block_[k])) return stopped(kRegion);
        run_deferred(k);
        ahead_[kRanAhead].fetch_add(1, std::memory_order_relaxed);
      }
      ++cursor_;
    }
    if (!waiting_for_issue) return;
    while (issued_ < block_.size() && error_.load() == kNone) {
      if (ran_[issued_]) {
        ++issued_;
        continue;
      }
      if (!fits(issued_)) return stopped(kBytes);
      if (!arena_ready(*block_[issued_])) return stopped(kRegion);
      run_deferred(issued_);
      ahead_[kRanAhead].fetch_add(1, std::memory_order_relaxed);
      ++issued_;
    }
  }

  void stopped(int reason) {
    std::pair<int64_t, int> at{static_cast<int64_t>(cursor_), reason};
    if (stopped_ != at) {
      stopped_ = at;
      ahead_[reason].fetch_add(1, std::memory_order_relaxed);
    }
  }

  bool arena_ready(const Step& s) {
    if (!s.out || !memory_.arena().has_value() || failed_out_.count(s.out->op.get())) return true;
    return memory_.all_free(s.arena);
  }

  void launch(const Plan* plan) {
    size_t n = block_.size();
    int64_t ran = 0;
    if (plan != nullptr && plan->order.size() == n) {
      blocks_.fetch_add(1, std::memory_order_relaxed);
      for (auto k : plan->order)
        if (!ran_[k]) {
          run_deferred(static_cast<size_t>(k));
          ++ran;
        }
    } else {
      for (size_t k = 0; k < n; ++k)
        if (!ran_[k]) {
          run_deferred(k);
          ++ran;
        }
    }
    ahead_[kAtLaunch].fetch_add(ran, std::memory_order_relaxed);
    block_.clear();
    ran_.clear();
    following_.reset();
    cursor_ = 0;
    issued_ = 0;
    stopped_ = {-1, -1};
  }

  void run_deferred(size_t k) {
    ran_[k] = true;
    Step& s = *block_[k];
    if (error_.load() == kNone) run(s);
    retire(s);
    block_[k].reset();  // (its constant arguments let go of)
  }

  void retire(const Step& s) {
    std::vector<int64_t>& done = retired_;
    done.clear();
    for (const auto& r : s.refs) done.push_back(r.vid);
    for (const auto& m : s.moves) done.push_back(m.first);
    for (auto v : done) {
      auto p = pending_.find(v);
      if (p != pending_.end() && --p->second <= 0) pending_.erase(p);
    }
    for (auto v : s.outs) {
      future_.erase(v);
      done.push_back(v);
    }
    for (const auto& m : s.moves) {
      future_.erase(m.second);
      done.push_back(m.second);
    }
    if (released_.empty()) return;  // (most runs read and make nothing Python let go of early)
    for (auto v : done) {
      if (released_.count(v) && !pending_.count(v) && !future_.count(v)) {
        released_.erase(v);
        free_value(v);
      }
    }
  }
};

}  // namespace coexec
