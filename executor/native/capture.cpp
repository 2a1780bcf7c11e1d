// Capture: every ATen op of a step comes to one boxed C++ kernel, which answers it with
// placeholders at once and hands the op to a worker thread that computes it without the GIL
// (docs/coexec.md, "The floor of a skeleton in C++", says what this design was measured at).
//
// * Placeholders are TensorImpls without storage under the PrivateUse3 dispatch key (PrivateUse1
//   is taken by out-of-tree devices such as Ascend's NPU), reporting the CPU as their device, so
//   autograd, views, modules and optimizers run above them as over any backend. Autograd's
//   shallow copies (detach, saved tensors, a view's metadata) share a Slot that receives the
//   value; at the step's end every placeholder still alive gets its value's storage and keys in
//   place, so after a step Python holds plain CPU tensors.
// * Capture is the key in the step thread's included dispatch keys, so ops on real tensors
//   (a batch, parameters, factories) come to the kernel too. It is restored whole at the end:
//   removing a per-backend key leaves its backend bit (every op would still come here).
// * An op's output metadata comes from a cache keyed by the op, the Python location of the call
//   (code object, bytecode offset) and its count at that location in the step (the backward's
//   ops all come from one location), checked against the inputs' metadata and the arguments that
//   are not tensors. An op the cache cannot answer (a new size) is answered by the shape oracle
//   (capture_shapes.h), which computes its output metadata from its own CPU code without data,
//   as a new variant. One neither answers, one whose result Python reads (``.item()``), one
//   whose output shape depends on data, or an in-place op that changes metadata (a miss) waits
//   for the worker and runs at once, as eager would, and fills the cache.
// * A plain ``loss.backward()`` after a path seen before issues the ops the engine made then,
//   without running it (capture_blocks.h); executor/capture.py swaps ``torch.autograd.backward``
//   in a step to ask.
// * Modes: "async" (the worker computes as ops come), "replay" (nothing computed during the
//   step; replay() runs the tape afterwards: the check that the tape is complete) and "tape"
//   (nothing computed: what the skeleton alone costs). Where nothing is computed during the
//   step, a miss the oracle cannot answer takes its metadata from the op's meta kernel
//   (150-300 us where it is Python; ``.item()`` fails).
//
// The kernel is registered at the first Capture, never at import.
#include "capture.h"

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/EmptyTensor.h>
#include <ATen/SavedTensorHooks.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>
#include <Python.h>
#include <frameobject.h>
#include <pybind11/stl.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// CPython 3.11's interpreter frames, read without the GIL (Capture::locate)
#define COEXEC_FRAME_WITHOUT_GIL 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "capture_blocks.h"
#include "capture_cache.h"
#include "capture_placeholders.h"
#include "capture_shapes.h"
#include "capture_trace.h"
#include "capture_worker.h"
#include "cpu_bytes.h"

namespace py = pybind11;

namespace coexec {
namespace {

// -- registration ----------------------------------------------------------------------------

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack);
void sparse_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack);

// The kernel for PrivateUse3: a fallback for every op, and registered for each ATen op with a
// CompositeExplicitAutograd(NonFunctional) kernel too (those are used for every backend ahead of a
// fallback, and read data pointers), as a lazy backend's codegen does. Ops with a
// CompositeImplicitAutograd kernel decompose above autograd and are left alone. Once per process.
void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* fallback = new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&kernel>());
    // (sparse tensors: the key makes their ops come to SparsePrivateUse3 (SparseCsrPrivateUse3 for
    // CSR and the like), which has no kernels; they run at once on the values, as eager)
    static auto* sparse = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::SparsePrivateUse3,
                                             __FILE__, __LINE__);
    sparse->fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_kernel>());
    static auto* csr = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::SparseCsrPrivateUse3,
                                          __FILE__, __LINE__);
    csr->fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_kernel>());
    static auto* ops = new torch::Library(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
    // (ops outside aten without an autograd kernel of their own, c10d's collectives among them,
    // reach AutogradPrivateUse3, for which torch registers no backend fallback as it does for
    // AutogradCPU: "Could not run 'c10d::allreduce_' ... from the 'AutogradPrivateUse3' backend".
    // The one eager's AutogradCPU uses)
    static auto* autograd = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::AutogradPrivateUse3,
                                               __FILE__, __LINE__);
    autograd->fallback(torch::autograd::basicAutogradNotImplementedFallback());
    // (the functional collectives' CompositeExplicitAutograd kernels would launch a collective on
    // placeholders and key its Work by their storage: they come to the kernel too, and run at
    // once on the values, must_run_now)
    static auto* functional = new torch::Library(torch::Library::IMPL, "_c10d_functional", kKey, __FILE__, __LINE__);
    // (a CompositeExplicitAutograd kernel serves the sparse keys too, ahead of their fallback:
    // sparse_dim's default kernel then met a sparse tensor and raised, where SparseCPU has a
    // kernel of its own; so the sparse keys get the kernel per op as well, and their ops reach
    // the real backend's kernels)
    static auto* sparse_ops = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::SparsePrivateUse3,
                                                 __FILE__, __LINE__);
    static auto* csr_ops = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::SparseCsrPrivateUse3,
                                              __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      const auto ns = name.getNamespace();
      const bool aten = ns == std::optional<std::string_view>("aten");
      if (!aten && ns != std::optional<std::string_view>("_c10d_functional")) continue;
      auto op = dispatcher.findOp(name);
      if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
      if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
          !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
        continue;
      std::string full = name.name.substr(ns->size() + 2);  // without its namespace ("aten::")
      if (!name.overload_name.empty()) full += "." + name.overload_name;
      if (!aten) {  // (_c10d_functional's)
        if (!op->hasKernelForDispatchKey(kKey)) functional->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
        continue;
      }
      if (!op->hasKernelForDispatchKey(kKey)) ops->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
      if (!op->hasKernelForDispatchKey(c10::DispatchKey::SparsePrivateUse3))
        sparse_ops->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&sparse_kernel>());
      if (!op->hasKernelForDispatchKey(c10::DispatchKey::SparseCsrPrivateUse3))
        csr_ops->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&sparse_kernel>());
    }
  });
}

// -- the capture -----------------------------------------------------------------------------

enum class Mode { kAsync, kReplay, kTape };

constexpr size_t kVariants = 16;  // cached variants per op and location
constexpr size_t kMaxLocations = 1 << 16;  // locations counted before the count starts afresh
constexpr int64_t kBuriedBeforeExhume = 256;  // see locate
constexpr int64_t kTimedEvery = 8;  // the kernel's time is sampled (a clock read costs ~25 ns)
// gradient blocks (capture_blocks.h)
constexpr int kBlocksPerSite = 16;  // made at a backward() line and not used, before making slows
constexpr int kMaxWait = 1024;       // backward() calls there between tries, at the slowest
constexpr int64_t kMaxBlocks = 4096;  // kept in all
constexpr int64_t kAheadBytes = 64;  // the largest storage an op runs ahead of the worker on (Capture::runs_ahead)
constexpr uint64_t kAheadSalt = 0xA4EAD;  // (a path tells an op run ahead from the same op queued)
constexpr int64_t kConstElements = 4096;  // the largest tensor made outside the dispatcher kept
const bool g_debug = std::getenv("COEXEC_CAPTURE_DEBUG") != nullptr;  // each op to stderr (read once)

// What backward_begin() tells the caller to do.
enum Backward : int { kReplayed = 0, kEngine = 1, kRecord = 2 };

// ``ks`` without the capture's key. (A key set's operator- removes a functionality bit only: less
// PrivateUse3 it kept the PrivateUse3 backend bit, and a CPU tensor's Dense bit with it made
// PrivateUse3 again. The Dense bit stays where another backend's is left: FakeTensorMode's Meta.)
c10::DispatchKeySet without_capture(c10::DispatchKeySet ks) {
  ks = ks.remove_backend(c10::BackendComponent::PrivateUse3Bit);
  if (ks.highestBackendKey() == c10::BackendComponent::InvalidBit) ks = ks - c10::DispatchKeySet(c10::DispatchKey::Dense);
  return ks;
}

int64_t made_bytes(const c10::FunctionSchema& schema, const std::vector<int>& written, const std::vector<OutMeta>& outputs);

class Capture {
 public:
  // `internal`: the directories of torch's and coexec's code; `libraries`: those of other
  // installed code (site-packages, the standard library), whose try blocks are not looked at;
  // `catching`: a code object's spans where an ``except`` may catch (and swallow) an op's error
  // (executor/try_scopes.py, try_scopes); `with_place`: an op's error given the note and traceback of where
  // the op was called (executor/capture.py)
  Capture(const std::string& mode, int threads, std::vector<std::string> internal,
          std::vector<std::string> libraries, py::object catching, py::object with_place)
      : internal_(std::move(internal)),
        libraries_(std::move(libraries)),
        catching_(std::move(catching)),
        with_place_(std::move(with_place)) {
    if (mode == "async") {
      mode_ = Mode::kAsync;
    } else if (mode == "replay") {
      mode_ = Mode::kReplay;
    } else if (mode == "tape") {
      mode_ = Mode::kTape;
    } else {
      TORCH_CHECK(false, "coexec: a capture's mode is 'async', 'replay' or 'tape', not '", mode, "'");
    }
    install();
    if (mode_ == Mode::kAsync) worker_ = std::make_unique<Worker>(threads);
  }

  ~Capture() {
    if (stepping()) end_quietly();
    if (worker_) {
      py::gil_scoped_release nogil;
      worker_.reset();
    }
    if (!codes_.empty()) {
      py::gil_scoped_acquire gil;
      for (auto& [code, facts] : codes_) Py_DECREF(code);
    }
  }

  // The step starts: every op of this thread comes to the kernel until end().
  void begin() {
    TORCH_CHECK(try_begin(), "coexec: a step is already being captured (one at a time, in one thread)");
  }

  // begin(), or false where a step (this capture's or another's, in any thread) is being
  // captured now: nothing changes then (coexec/tape.py runs that step eagerly).
  bool try_begin() {
    Capture* none = nullptr;
    if (!g_active.compare_exchange_strong(none, this)) return false;
    ++steps_;
    eager_rest_ = false;
    path_.clear();
    path_hash_ = 0;
    queued_small_.clear();
    ahead_writes_.clear();
    first_value_ = next_value_;
    step_nodes_ = StepNodes::from_now();
    find_step_frame();
    describing_ = describe_next_ && worker_ != nullptr;
    describe_next_ = false;
    tracing_ = trace_next_;
    trace_next_ = false;
    if (!trace_.empty()) trace_.clear();  // (a log not taken: an untraced step clears nothing)
    last_user_ = Where{nullptr, -1};
    untraced_lines_ = newly_traced_lines_ = 0;
    if (traced_lines_.size() > kMaxLocations) traced_lines_.clear();
    shadow_ = Shadow{};
    if (describing_) {
      std::lock_guard<std::mutex> g(g_released_mu);
      g_released.clear();
      alive_.clear();
      g_issued.store(0);
    }
    g_describing.store(describing_);
    if (worker_) {
      worker_->set_step(describing_ ? nullptr : drops_, describing_, first_value_, cap_, other_paths_);
      // (the worker computes the step: this thread's team goes, openmp_team.h; at most every
      // kTeamReleaseEvery: a step that runs parallel ops at once here, a backward inside a
      // catching try, makes the team again within the step, and letting it go at every step
      // took try_except's 0.34 ms step to 1.6 ms)
      const auto now = std::chrono::steady_clock::now();
      if (now - team_released_at_ >= kTeamReleaseEvery) {
        release_openmp_team();
        team_released_at_ = now;
      }
    }
    saved_hooks_ = false;
    forward_ = true;
    missed_ = false;
    recording_ = false;
    if (seen_.size() > kMaxLocations) seen_.clear();
    if (g_shapes_broken.load(std::memory_order_relaxed) && !forgot_shapes_) {
      // (an answer of the shape oracle was wrong: what it answered is let go of, with the
      // blocks made over it; from now on such ops run at once and fill the cache as they ran)
      forgot_shapes_ = true;
      cache_.clear();
      blocks_.clear();
      making_at_.clear();
      blocks_made_ = 0;
    }
    auto tls = c10::impl::tls_local_dispatch_key_set();
    included_before_ = tls.included_;
    tls.included_ = tls.included_ | c10::DispatchKeySet(kKey);
    c10::impl::_force_tls_local_dispatch_key_set(tls);
    if (worker_) t_trash = &trash_;
    t_banish = worker_ && cap_ > 0 ? &banished_ : nullptr;
    t_shared_slots = worker_ && (cap_ > 0 || (drops_ != nullptr && !describing_));
    return true;
  }

  // The step ends: its ops are computed, placeholders still alive become their values, and a
  // failure on the worker is raised.
  void end() {
    TORCH_CHECK(stepping(), "coexec: end() without begin()");
    end_quietly();
    raise_failure();
    places_.clear();
    ahead_writes_.clear();
  }

  // Capture off and on again within a step, around what reads memory outside the dispatcher
  // (nested: printing calls tolist()).
  // (the capture's key only: the keys set since the step began stay, a FakeTensorMode's Python
  // key among them, which from_tensor's storage read unset)
  void pause() {
    if (stepping() && paused_++ == 0) set_included(without_capture(included_now()));
  }

  void resume() {
    if (stepping() && paused_ > 0 && --paused_ == 0) set_included(included_now() | c10::DispatchKeySet(kKey));
  }

  // A torch.compile'd region begins (executor/capture.py calls this before Dynamo reads the
  // thread's keys): from here to the step's end every op runs as eager. Dynamo's compiling runs
  // FakeTensor ops, its compiled code reads its inputs' memory outside the dispatcher, and its
  // guards check the thread's keys (the capture's key in them: a compile of its own). So the
  // worker catches up, every placeholder alive becomes its value, and the capture's key leaves
  // the thread's keys as pause() takes it, not resumed until the step ends.
  void run_rest_eagerly() {
    if (!stepping() || eager_rest_) return;
    if (tracing_) trace_.cut("a torch.compile'd region ran in the step (its ops from there on ran eagerly, unlogged)");
    if (recording_) refuse("a torch.compile'd region ran in the backward");
    if (mode_ == Mode::kReplay) replay();
    drain();
    raise_failure();
    if (worker_) {
      py::gil_scoped_acquire gil;
      worker_->exhume();  // (values a memory plan dropped, made again: as at the step's end)
    }
    if (mode_ != Mode::kTape) g_live.take_all([](PlaceholderImpl* p) { p->realize(); });
    eager_rest_ = true;
    ++eager_rests_;
    if (paused_++ == 0) set_included(without_capture(included_now()));
  }

  bool eager_rest() const { return eager_rest_; }

  // The worker catches up (a failure is raised).
  void wait() {
    drain();
    raise_failure();
  }

  // A tensor's value now: the worker catches up (a real tensor may be waiting for a write too:
  // ``rand`` fills an ``empty`` made at once), and a placeholder becomes its value in place.
  void realize(const at::Tensor& t, const std::string& kind) {
    wait();
    if (tracing_) trace_.fetch(t, kind, frames_now());
    if (is_ph(t) && describing_ && impl_of(t)->slot) worker_->last_log().fetched.push_back(impl_of(t)->slot->id);
    if (is_ph(t)) impl_of(t)->realize();
  }

  // replay mode: run the step's tape (after its ops were captured, before end()).
  int64_t replay() {
    TORCH_CHECK(mode_ == Mode::kReplay, "coexec: replay() is for a capture in 'replay' mode");
    at::AutoDispatchBelowADInplaceOrView below;
    c10::impl::ForceDispatchKeyGuard off(included_before_, c10::impl::tls_local_dispatch_key_set().excluded_);
    int64_t n = 0;
    for (const TapeEntry& e : tape_) {
      run_entry(e);
      ++n;
    }
    tape_.clear();
    return n;
  }

  // executor/capture.py's CaptureCounters, its fields in its order (times in seconds): read
  // twice a step, made into the NamedTuple as they are
  py::tuple counters() const {
    constexpr double s = 1e-9;
    return py::make_tuple(ops_, misses_, run_now_, kernel_ns_ * s, (int64_t)tape_.size(), wait_ns_ * s,
                          worker_ ? worker_->busy_ns() * s : 0.0, replayed_, backwards_,
                          worker_ ? worker_->dropped() : int64_t(0), g_remade.load(), g_remade_ns.load() * s, shaped_,
                          worker_ ? worker_->evicted() : int64_t(0), worker_ ? worker_->overruns() : int64_t(0),
                          eager_rests_, ahead_, g_parked.load(), g_back_early.load(), g_arena_placed.load());
  }

  // -- gradient blocks (capture_blocks.h) --

  // A plain ``loss.backward()`` in the step (no `inputs`), or a plain
  // ``torch.autograd.grad(loss, inputs, allow_unused=...)`` for leaves `inputs`: kReplayed (a
  // block did it; take_grads() has grad()'s gradients), kEngine (run the engine; backward_why
  // says why), or kRecord (run the engine, then call backward_end: its ops become a block).
  int backward_begin(const at::Tensor& loss, const std::vector<at::Tensor>& inputs, bool allow_unused);

  // The engine ran for a kRecord (ok: without an error; `python`: Python it saw run inside the
  // engine, if any; `again`: the block could not be watched for it this time (a profiler was
  // active), so none is kept and the next step at this path tries again; `results`: grad()'s
  // gradients, per input).
  void backward_end(bool ok, const std::string& python, bool again,
                    const std::vector<std::optional<at::Tensor>>& results);

  // The gradients a replayed grad() returns, per input (None: the input was not reached).
  std::vector<std::optional<at::Tensor>> take_grads() { return std::move(grads_); }

  // Why the latest backward() ran the engine ("" if a block answered it).
  const std::string& backward_why() const { return backward_why_; }

  // -- traces (capture_trace.h) --

  // The next step is traced: take_trace() after it says what it did.
  void trace_next(bool on) { trace_next_ = on; }
  bool tracing() const { return tracing_; }

  // The last traced step's log (TraceLog::to_python), let go of here.
  py::tuple take_trace() {
    py::tuple out = trace_.to_python();
    trace_.clear();
    return out;
  }

  // The last step's user lines (where its ops were called) that no traced step had met, and,
  // traced, those it met first: (untraced, newly traced).
  py::tuple lines() const { return py::make_tuple(untraced_lines_, newly_traced_lines_); }

  // answer() (or run_sparse()), with what the op did logged for the step's trace.
  void answer_traced(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool sparse) {
    const size_t nargs = op.schema().arguments().size();
    const size_t at = trace_.begin_op(op, torch::jit::last(*stack, nargs), frames_now());
    const size_t places = places_.size();
    if (sparse)
      run_sparse(op, stack);
    else
      answer(op, stack);
    const bool in_try = outer_try_ || (places_.size() > places && places_[places].in_try);
    const size_t nret = op.schema().returns().size();
    trace_.end_op(at, in_try, torch::jit::last(*stack, nret));
  }

  // -- memory plans (capture_worker.h: StepLog, Drops) --

  // The next step is described (it follows no plan): description() after it.
  void describe_next() { describe_next_ = true; }

  // The last described step: (ops, storage bytes, storages that existed before it, values Python
  // read, (value, ops issued when the program let go of it), values alive at its end, the
  // addresses of the storages that existed before it, 0 for the others). Per op:
  // (place, name, op id, ns, ran at once, random, storages read, written, made, (value, storage)
  // per placeholder made, bytes its kernel allocated and freed again, issued after a backward() began,
  // per storage made the allocations of its bytes the kernel made before it).
  // Values are numbered from 0 in the step.
  py::tuple description() {
    TORCH_CHECK(worker_ != nullptr, "coexec: only an 'async' capture describes steps");
    const StepLog& log = worker_->last_log();
    const uint64_t first = first_value_;
    const auto rel = [first](uint64_t id) { return static_cast<int64_t>(id) - static_cast<int64_t>(first); };
    py::list ops;
    for (const LoggedOp& o : log.ops) {
      py::list values;
      for (const auto& [id, sid] : o.values) values.append(py::make_tuple(rel(id), sid));
      const auto& name = o.op->schema().operator_name();
      ops.append(py::make_tuple(o.index, name.name + (name.overload_name.empty() ? "" : "." + name.overload_name),
                                reinterpret_cast<int64_t>(o.op), o.ns, o.at_once, o.random, o.reads, o.writes,
                                o.makes, values, o.workspace, o.backward, o.made_after));
    }
    py::list fetched, released, alive;
    for (uint64_t id : log.fetched)
      if (id >= first) fetched.append(rel(id));
    {
      std::lock_guard<std::mutex> g(g_released_mu);
      for (const auto& [id, at] : g_released)
        if (id >= first) released.append(py::make_tuple(rel(id), at));
    }
    for (uint64_t id : alive_)
      if (id >= first) alive.append(rel(id));
    return py::make_tuple(ops, log.nbytes, log.before, fetched, released, alive, log.where);
  }

  using Parks = std::vector<std::tuple<std::vector<uint32_t>, int64_t, int64_t, int64_t, int64_t>>;
  using Placements = std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>;

  // A plan as the worker follows it (set_drops, add_path).
  std::shared_ptr<const Drops> make_drops(const std::vector<int64_t>& ops, const std::vector<int64_t>& keep,
                                         const std::vector<std::pair<int64_t, std::vector<uint32_t>>>& after,
                                         const std::vector<int64_t>& value_bytes, const Parks& parks,
                                         int64_t arena_bytes, const Placements& placed) {
    auto d = std::make_shared<Drops>();
    if (arena_bytes > 0 && !placed.empty()) place(*d, ops.size(), arena_bytes, placed, arena_learnt_);
    d->value_bytes = value_bytes;
    for (const auto& [values, out_after, back_after, host_offset, host_bytes] : parks) {
      TORCH_CHECK(out_after < back_after && host_offset >= 0 && host_bytes >= 0,
                  "coexec: a park is copied out before it comes back, into a slice of the pool");
      const auto k = static_cast<uint32_t>(d->parks.size());
      d->parks.push_back({values, out_after, back_after, host_offset, host_bytes});
      d->park_events.push_back({out_after, false, k});
      d->park_events.push_back({back_after, true, k});
      d->host_bytes = std::max(d->host_bytes, host_offset + host_bytes);
      for (uint32_t n : values) {
        if (n >= d->park_of.size()) d->park_of.resize(n + 1, -1);
        d->park_of[n] = static_cast<int32_t>(k);
      }
    }
    std::sort(d->park_events.begin(), d->park_events.end(), [](const ParkEvent& a, const ParkEvent& b) {
      return a.place != b.place ? a.place < b.place : a.back < b.back;
    });
    for (int64_t id : ops) d->ops.push_back(reinterpret_cast<const c10::OperatorHandle*>(id));
    for (int64_t n : keep) {
      if (n < 0) continue;
      if (static_cast<size_t>(n) >= d->keep.size()) d->keep.resize(n + 1, 0);
      d->keep[n] = 1;
    }
    d->after = after;
    std::sort(d->after.begin(), d->after.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    return d;
  }

  // Follow this memory plan from the next step on (see Drops): per place the op id expected
  // there (0: an op that ran at once), the values whose producers are kept, per place the
  // values dropped after it, and per value its bytes in the planned step.
  void set_drops(const std::vector<int64_t>& ops, const std::vector<int64_t>& keep,
                 const std::vector<std::pair<int64_t, std::vector<uint32_t>>>& after,
                 const std::vector<int64_t>& value_bytes, const Parks& parks, int64_t arena_bytes,
                 const Placements& placed) {
    keep_learnt();
    drops_ = make_drops(ops, keep, after, value_bytes, parks, arena_bytes, placed);
    other_paths_.clear();
  }

  // Beside the plan set_drops gave: the plan of another path of the program, which a step takes
  // where its ops leave the first plan's for this one's (Worker::switch_path). No arena: a
  // plan's arena is held whole, one per step.
  void add_path(const std::vector<int64_t>& ops, const std::vector<int64_t>& keep,
                const std::vector<std::pair<int64_t, std::vector<uint32_t>>>& after,
                const std::vector<int64_t>& value_bytes, const Parks& parks) {
    TORCH_CHECK(drops_ != nullptr && !drops_->arena, "coexec: another path's plan goes beside a plan without an arena");
    other_paths_.push_back(make_drops(ops, keep, after, value_bytes, parks, 0, {}));
  }

  void clear_drops() {
    keep_learnt();
    drops_.reset();
    other_paths_.clear();
  }

  // What the arena of the plan in use learnt of kernels' allocations (Arena::learn), kept for
  // the next plan's (a new plan of the same path starts from it; between steps, while the
  // worker has nothing to run).
  void keep_learnt() {
    if (drops_ && drops_->arena) arena_learnt_ = drops_->arena->arena->learnt();
  }

  // The plan's arena (arena.h): one block of `bytes` from the counting allocator, and per
  // placement (place of the op that makes the storage, its bytes, its offset) a region its
  // kernel's allocation of exactly those bytes may take.
  static void place(Drops& d, size_t places, int64_t bytes,
                    const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>& placed,
                    const std::vector<std::tuple<int64_t, int64_t, int32_t>>& learnt) {
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> sorted(placed);
    std::sort(sorted.begin(), sorted.end());
    std::vector<ArenaRegion> regions;
    d.arena_at.assign(places, {});
    std::vector<int32_t> skips;
    for (const auto& [at, nbytes, offset, skip] : sorted) {
      TORCH_CHECK(at >= 0 && static_cast<size_t>(at) < places && nbytes > 0 && offset >= 0 && offset % 64 == 0 &&
                      offset + nbytes <= bytes,
                  "coexec: an arena placement is an op's place, its bytes and a 64-byte aligned offset within the arena");
      const auto r = static_cast<uint32_t>(regions.size());
      regions.push_back({at, offset, nbytes, {}});
      skips.push_back(static_cast<int32_t>(std::max<int64_t>(skip, 0)));
      Drops::ArenaPlace& where = d.arena_at[at];
      if (where.begin == where.end) where.begin = where.end = r;
      ++where.end;
      where.bytes += nbytes;
      d.arena_regions.push_back(r);
    }
    c10::DataPtr memory = count_cpu_bytes().allocate(static_cast<size_t>(bytes));
    d.arena = std::make_unique<ArenaHandle>(new Arena(std::move(memory), bytes, std::move(regions)));
    d.arena->arena->pass_over(skips);
    d.arena->arena->learn_from(learnt);
  }

  // Keep the next steps' ops within `cap` bytes of blocks the CPU allocator handed out since its
  // reset_peak() and still held (0: no guard), by dropping values where an op would go past it
  // (Worker::make_room).
  void guard(int64_t cap) {
    TORCH_CHECK(cap >= 0, "coexec: a guard's cap is a byte count (0: none), not ", cap);
    cap_ = cap;
  }

  // Did the last step follow its memory plan to its end (false: it met another op first, or had none)?
  bool followed() const { return followed_; }
  // the plan the last step followed to its end: 0 set_drops's, i add_path's i-th (-1: none)
  int followed_path() const { return followed_path_; }
  // Did it stop following because a value was larger than the planned step's (its sizes grew)?
  bool outgrew() const { return outgrew_; }

  bool stepping() const { return g_active.load() == this; }

  void answer(const c10::OperatorHandle& op, torch::jit::Stack* stack);

  using Frame = std::tuple<std::string, int, std::string>;  // file, line, function

  // Where the last failure raised on the worker was called: the user's frame, then the
  // library's (file, line, function), outermost first; empty where unknown.


  void add_kernel_ns(int64_t ns) { kernel_ns_ += ns; }

  // Is this op's time in the kernel measured? (one in kTimedEvery at random, counted for all of
  // them: every kTimedEvery-th op would time the same ops of every step where a step's op count
  // is a multiple of it)
  bool timed_now() {
    sample_ ^= sample_ << 13;  // (xorshift)
    sample_ ^= sample_ >> 7;
    sample_ ^= sample_ << 17;
    return sample_ % kTimedEvery == 0;
  }

 private:
  Mode mode_ = Mode::kAsync;
  std::unique_ptr<Worker> worker_;
  int paused_ = 0;
  bool eager_rest_ = false;  // (run_rest_eagerly)
  int64_t eager_rests_ = 0;  // steps that ran their rest eagerly
  int64_t ahead_ = 0;  // ops run ahead of the worker on this thread (runs_ahead)
  // the small real storages an op queued in this step reads or writes (runs_ahead), each held
  // weakly to the step's end: one freed meanwhile keeps its address, which a new small tensor
  // (a Python number an op wraps) would otherwise take and, refused, run ahead in some steps
  // only, by the worker's progress
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> queued_small_;
  // what each op run ahead in this step wrote, as it was before (its place, the storage, its
  // bytes): a queued op before it that fails gives them back before its error is raised, so the
  // tensors are eager's wherever the error is caught (raise_failure)
  struct AheadWrite {
    int64_t place;
    c10::intrusive_ptr<c10::StorageImpl> storage;
    c10::SmallVector<char, kAheadBytes> bytes;
  };
  std::vector<AheadWrite> ahead_writes_;
  c10::DispatchKeySet included_before_;
  // per key, the variants seen (sizes that come back: a last batch, lengths drawn from a
  // range), the latest last; at most kVariants, the oldest dropped first
  std::unordered_map<Key, std::vector<Entry>, KeyHash> cache_;
  // ops per location in this step: (count, step it counts for), kept across steps (a map
  // cleared per step allocated a node per location per step)
  std::unordered_map<Where, std::pair<int64_t, int64_t>, WhereHash> seen_;
  int64_t steps_ = 0;
  std::vector<TapeEntry> tape_;                          // replay and tape modes
  std::vector<at::Tensor> trash_;  // values let go of since the last op (t_trash)
  std::vector<std::weak_ptr<Slot>> banished_;  // slots let go of that something else holds (t_banish)
  // per op of the step: where it was called (errors name it)
  struct Place {
    PyCodeObject* code;  // the innermost Python frame
    int lasti;
    PyCodeObject* user;  // the innermost frame outside torch and coexec (null: none)
    int user_lasti;
    bool in_try = false;  // a user frame up to the step's calls it inside a try that may catch its error
  };
  std::vector<Place> places_;
  // every code object met on the way to an op, owned (places_ and the cache's keys point into
  // it; a reference per op would need the GIL per op), and whether it is torch's or coexec's
  struct CodeFacts {
    bool internal = false;  // torch's or coexec's
    // the user's own (not installed code's): [begin, end) offsets where a try may catch an op's
    // error, and where it may also swallow it (its clause can end without raising)
    std::vector<std::pair<int, int>> catching, swallowing;
  };
  std::unordered_map<PyCodeObject*, CodeFacts> codes_;
  static constexpr size_t kHotCodes = 61;
  std::array<std::pair<PyCodeObject*, const CodeFacts*>, kHotCodes> hot_codes_{};
  std::vector<std::string> internal_;  // the directories whose code is not the user's
  std::vector<std::string> libraries_;  // the directories of installed code (not torch's or coexec's)
  py::object catching_, with_place_;  // (the constructor's)
  // the frame of the step's ``with`` (the first user frame at begin(); null: none), and whether a
  // frame above it calls it inside a try that may catch an op's error (then every op runs at once)
  const void* step_frame_ = nullptr;
  bool outer_try_ = false;
  int64_t ops_ = 0, misses_ = 0, run_now_ = 0, kernel_ns_ = 0, wait_ns_ = 0;
  int64_t shaped_ = 0;  // ops new at their line whose outputs the shape oracle computed
  int64_t cap_ = 0;     // the guard's cap (guard())
  static constexpr auto kTeamReleaseEvery = std::chrono::milliseconds(100);
  std::chrono::steady_clock::time_point team_released_at_{};  // (try_begin: this thread's OpenMP team let go)
  bool forward_ = true;  // no backward() yet in this step
  bool forgot_shapes_ = false;  // (the cache was emptied after a wrong answer: begin())
  uint64_t sample_ = 0x9E3779B97F4A7C15ull;  // (timed_now)
  uint64_t next_entry_id_ = 1;

  // -- gradient blocks (capture_blocks.h) --
  // The step's path: per op, its cache entry, where its tensors came from, and its numbers
  // where autograd may save them; a block made after a path is replayed after the same path.
  std::vector<uint64_t> path_;
  uint64_t path_hash_ = 0;
  // the step's placeholders by number (their slots, not held: a value lives as long as eager's)
  uint64_t next_value_ = 1, first_value_ = 1;
  std::vector<std::weak_ptr<Slot>> values_;
  // the step's real tensors (parameters, a batch) by number, in the order first met (weak:
  // held, their addresses are not reused within the step)
  std::unordered_map<const c10::TensorImpl*, uint32_t> outer_ids_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> outers_;
  bool saved_hooks_ = false;  // saved-tensor hooks were active at an op of the step
  bool missed_ = false;       // an op of the step was new at its line (its path is new)
  std::unordered_map<uint64_t, std::vector<Block>> blocks_;  // by the hash of their path
  std::vector<Block> no_blocks_;
  GraphWalker walker_;
  StepNodes step_nodes_;  // the autograd nodes this step makes (a block's graph is made of them)
  // per backward() line: blocks made there since one was last used; past kBlocksPerSite (paths
  // that never repeat) one is made only every `wait` calls there, `wait` doubling each time
  struct Making {
    int unused = 0, skipped = 0, wait = kBlocksPerSite;
  };
  std::unordered_map<Where, Making, WhereHash> making_at_;
  int64_t blocks_made_ = 0;
  uint64_t next_block_ = 1;
  int64_t replayed_ = 0, backwards_ = 0;
  std::string backward_why_;
  std::vector<std::optional<at::Tensor>> grads_;  // (take_grads)
  // memory plans
  std::shared_ptr<const Drops> drops_;
  std::vector<std::shared_ptr<const Drops>> other_paths_;  // (add_path)
  std::vector<std::tuple<int64_t, int64_t, int32_t>> arena_learnt_;  // (keep_learnt)
  bool describe_next_ = false, describing_ = false, followed_ = false, outgrew_ = false;
  int followed_path_ = -1;
  std::vector<uint64_t> alive_;  // (described) values Python held at the step's end
  // traces
  bool trace_next_ = false, tracing_ = false;
  TraceLog trace_;
  // the user's lines (the innermost frame outside torch and coexec, where an op was called) a
  // traced step met: a step not traced that meets another may have gone where the TraceGraph
  // has not (coexec/native_traces.py). Looked up where an op's line is not the op before's.
  std::unordered_map<Where, bool, WhereHash> traced_lines_;
  Where last_user_{nullptr, -1};
  int64_t untraced_lines_ = 0, newly_traced_lines_ = 0;  // (this step's)

  void note_user_place(const Place& place) {
    last_user_ = Where{place.user, place.user_lasti};
    if (tracing_) {
      if (traced_lines_.emplace(last_user_, true).second) ++newly_traced_lines_;
    } else if (traced_lines_.count(last_user_) == 0) {
      ++untraced_lines_;
    }
  }
  // a traced step's backward that a block would have replayed (backward_begin)
  struct Shadow {
    bool active = false;
    size_t path_len = 0;
    uint64_t path_hash = 0, block = 0;
  } shadow_;

  // This thread's Python frames from the innermost to the step's ``with`` frame (a trace's
  // locations are made of them, tracegraph/from_capture.py).
  TracedFrames frames_now() {
    TracedFrames out;
    std::optional<py::gil_scoped_acquire> gil;
    each_frame(kUserDepth, gil, [&](const void* frame, PyCodeObject* code, int lasti, const auto& globals_of) {
      facts(code, globals_of, gil);  // (held from now on)
      out.emplace_back(code, lasti);
      return frame == step_frame_;
    });
    return out;
  }
  struct Recording {
    Block block;
    size_t path_len = 0;
    uint64_t path_hash = 0;
    uint32_t first_outer = 0;
    std::vector<at::Tensor> leaves, grads_before;
    std::string why_not;  // the first reason found why no block can be made
    bool again = false;   // the reason will not hold next time: no block is kept (nor counted)
    std::unordered_map<uint32_t, Ref> made_of;  // real tensors made in the backward, by number
    Where site{nullptr, -1};
  } rec_;

  // No block from this recording: the first reason found is kept.
  bool refuse(const char* why) {
    if (!rec_.why_not.empty()) return false;
    rec_.why_not = why;
    return true;
  }
  bool recording_ = false;

  // `d` ends the path's next op.
  void extend_path(uint64_t d) {
    path_.push_back(d);
    path_hash_ = mix(path_hash_, d);
  }

  // The path since the first `len` ops (`hash` then) is block `id`'s replay: a backward whose
  // ops the engine ran goes on as a replay of its block will.
  void path_as_block(size_t len, uint64_t hash, uint64_t id) {
    path_.resize(len);
    path_hash_ = hash;
    extend_path(mix(0xB10C, id));
  }

  // A part of a path no other path has (an op new at its line, one on sparse tensors).
  uint64_t never_matched() { return ~next_entry_id_++; }

  // The number of a real tensor of the step (given at first sight).
  uint32_t outer(const at::Tensor& t) {
    auto [it, fresh] = outer_ids_.try_emplace(t.unsafeGetTensorImpl(), static_cast<uint32_t>(outers_.size()));
    if (fresh) outers_.emplace_back(t.getIntrusivePtr());
    return it->second;
  }

  // Where a tensor argument comes from, for the path.
  uint64_t wiring(const at::Tensor& t) {
    if (!t.defined()) return 1;
    if (!is_ph(t)) return static_cast<uint64_t>(outer(t)) << 2;
    const Slot* s = impl_of(t)->slot.get();
    return s != nullptr && s->id >= first_value_ ? ((s->id - first_value_) << 2) | 2 : 3;
  }

  // A new placeholder of the step gets its number.
  void number(const at::Tensor& t) {
    if (!t.defined()) return;
    const auto& slot = impl_of(t)->slot;
    slot->id = next_value_++;
    values_.emplace_back(slot);
  }

  Ref ref_of(const at::Tensor& t, Block& b, bool written);
  void record(const c10::OperatorHandle& op, const Entry& e, Args args, bool grad_mode);
  std::string issue_block(Block& b, const GraphWalk& w, const Place& site);
  Place here();

  // The step's next op was called at `p` (described: the ops issued so far, g_issued).
  void add_place(const Place& p) {
    places_.push_back(p);
    if (describing_) g_issued.store(static_cast<int64_t>(places_.size()), std::memory_order_relaxed);
  }

  // Wait for the worker, counting the time.
  void drain() {
    if (!worker_) return;
    const auto t0 = std::chrono::steady_clock::now();
    worker_->drain();
    wait_ns_ += ns_since(t0);
  }

  static c10::DispatchKeySet included_now() { return c10::impl::tls_local_dispatch_key_set().included_; }

  static void set_included(c10::DispatchKeySet included) {
    auto tls = c10::impl::tls_local_dispatch_key_set();
    tls.included_ = included;
    c10::impl::_force_tls_local_dispatch_key_set(tls);
  }

  void end_quietly() {
    set_included(included_before_);
    paused_ = 0;
    eager_rest_ = false;
    recording_ = false;
    if (describing_)  // (the values Python still holds, before the list goes)
      for (const auto& w : values_)
        if (auto v = w.lock(); v && v->holders > 0) alive_.push_back(v->id);
    values_.clear();
    outer_ids_.clear();
    outers_.clear();
    g_active.store(nullptr);
    t_trash = nullptr;
    t_banish = nullptr;
    t_shared_slots = false;
    drain();
    if (worker_) worker_->release_team();  // (this thread computes again: the worker's team goes)
    trash_.clear();  // (let go of after the ops that use them)
    banished_.clear();
    if (worker_) {
      py::gil_scoped_acquire gil;
      worker_->exhume();
    }
    const bool realize = mode_ != Mode::kTape;
    g_live.take_all([realize](PlaceholderImpl* p) {
      if (realize) p->realize();
    });
    if (worker_) {
      followed_ = worker_->followed();
      followed_path_ = worker_->followed_path();
      outgrew_ = worker_->outgrew();
      worker_->end_step();
    }
    g_describing.store(false);
    if (mode_ == Mode::kTape) tape_.clear();
  }

  // The worker's first failure, raised as eager raises it (the same Python exception type and
  // message: torch's own translation of the op's C++ error), with a note and a traceback through
  // the line that called the op (the program had gone on past it); the capture is usable again
  // after it.
  void raise_failure() {
    if (!worker_) return;
    auto [index, error] = worker_->error();
    if (index < 0) return;
    worker_->clear_error();
    give_back_ahead_writes(index);
    py::gil_scoped_acquire gil;
    std::vector<Frame> frames;  // (outermost first)
    if (index < static_cast<int64_t>(places_.size()) && places_[index].code != nullptr) {
      const Place& p = places_[index];
      // the user's line first, then the library's where the op was made inside it
      const bool inside = p.user != nullptr && (p.user != p.code || p.user_lasti != p.lasti);
      if (inside) frames.push_back(frame_of(p.user, p.user_lasti));
      frames.push_back(frame_of(p.code, p.lasti));
    }
    places_.clear();
    as_python_error(error);  // (sets Python's error indicator)
    py::error_already_set raised;
    py::object found = with_place_(raised.value(), index, frames);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(found.ptr())), found.ptr());
    throw py::error_already_set();
  }

  // A queued op at place `failed` failed: what ops run ahead after it wrote is given back, the
  // latest first (eager never ran them).
  void give_back_ahead_writes(int64_t failed) {
    for (auto w = ahead_writes_.rbegin(); w != ahead_writes_.rend(); ++w)
      if (w->place > failed) std::memcpy(w->storage->mutable_data(), w->bytes.data(), w->bytes.size());
    ahead_writes_.clear();
  }

  // Set Python's error as torch sets it for `error` thrown by an op called from Python.
  static void as_python_error(std::exception_ptr error) {
    [&]() -> PyObject* {
      HANDLE_TH_ERRORS
      std::rethrow_exception(error);
      return nullptr;
      END_HANDLE_TH_ERRORS
    }();
  }

  static Frame frame_of(PyCodeObject* code, int lasti) {  // (GIL held)
    return {py::str(code->co_filename).cast<std::string>(), PyCode_Addr2Line(code, lasti),
            py::str(code->co_name).cast<std::string>()};
  }

  // What is known of `code`: torch's or coexec's (not the user's), and where a try of it may
  // catch an op's error. It is held from now on; the GIL is taken for a code object not seen before.
  // `globals_of()`: the namespace the code runs in (called with the GIL, only for a code object
  // not seen before), where try_scopes looks up the classes an ``except`` names.
  template <class Globals>
  const CodeFacts& facts(PyCodeObject* code, const Globals& globals_of, std::optional<py::gil_scoped_acquire>& gil) {
    // (a direct-mapped cache in front of the map: locate asks 3-8 times an op)
    auto& hot = hot_codes_[(reinterpret_cast<uintptr_t>(code) >> 4) % kHotCodes];
    if (hot.first == code) return *hot.second;
    auto it = codes_.find(code);
    if (it == codes_.end()) {
      if (!gil) gil.emplace();
      Py_INCREF(code);
      const std::string file = py::str(code->co_filename).cast<std::string>();
      CodeFacts f;
      const auto under = [&file](const std::vector<std::string>& dirs) {
        for (const std::string& dir : dirs)
          if (file.compare(0, dir.size(), dir) == 0) return true;
        return false;
      };
      f.internal = under(internal_);
      if (!f.internal && !under(libraries_) && catching_) {
        const py::tuple scopes = catching_(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(code)), globals_of());
        for (const auto& span : scopes[0]) f.catching.emplace_back(span.cast<std::pair<int, int>>());
        for (const auto& span : scopes[1]) f.swallowing.emplace_back(span.cast<std::pair<int, int>>());
      }
      it = codes_.emplace(code, std::move(f)).first;
    }
    hot = {code, &it->second};  // (a map's values stay where they are)
    return it->second;
  }

  static bool covers(const std::vector<std::pair<int, int>>& spans, int lasti) {
    for (const auto& [begin, end] : spans)
      if (begin <= lasti && lasti < end) return true;
    return false;
  }

  // Calls `visit(frame, code, lasti, globals_of)` for this thread's Python frames, innermost
  // first (`globals_of()`: the frame's globals, or None; with the GIL), until it
  // returns true or `depth` frames were seen: on CPython 3.11 through its interpreter frames,
  // without the GIL (this thread's own, which only this thread changes); elsewhere through frame
  // objects, with it.
  template <class Visit>
  void each_frame(int depth, std::optional<py::gil_scoped_acquire>& gil, Visit&& visit) {
#ifdef COEXEC_FRAME_WITHOUT_GIL
    PyThreadState* ts = PyGILState_GetThisThreadState();
    _PyInterpreterFrame* f = ts != nullptr && ts->cframe != nullptr ? ts->cframe->current_frame : nullptr;
    for (int d = 0; f != nullptr && d < depth; f = f->previous, ++d)
      if (!_PyFrame_IsIncomplete(f) &&
          visit(static_cast<const void*>(f), f->f_code,
                _PyInterpreterFrame_LASTI(f) * static_cast<int>(sizeof(_Py_CODEUNIT)), [f] {
                  return f->f_globals != nullptr ? py::reinterpret_borrow<py::object>(f->f_globals) : py::none();
                }))
        return;
#else
    if (!gil) gil.emplace();
    PyFrameObject* f = PyEval_GetFrame();  // (borrowed)
    Py_XINCREF(f);
    for (int d = 0; f != nullptr && d < depth; ++d) {
      PyCodeObject* code = PyFrame_GetCode(f);  // (a new reference: facts() holds its own)
      const auto globals_of = [f]() -> py::object {
#if PY_VERSION_HEX >= 0x030B0000
        return py::reinterpret_steal<py::object>(PyFrame_GetGlobals(f));
#else
        return py::none();  // (no exception table before 3.11: try_scopes finds nothing)
#endif
      };
      const bool stop = visit(static_cast<const void*>(f), code, PyFrame_GetLasti(f), globals_of);
      Py_DECREF(code);
      if (stop) break;
      PyFrameObject* back = PyFrame_GetBack(f);  // (a new reference)
      Py_DECREF(f);
      f = back;
    }
    Py_XDECREF(f);
#endif
  }

  // At begin(): the step's ``with`` frame (the first user frame), and whether a frame above it
  // calls it inside a try that may catch an op's error and go on (``try: train_step() except
  // IndexError: continue``): such a step runs every op at once, as eager, so that the Python
  // after a failing op does not run (its optimizer step, say). A clause that re-raises (logs,
  // then ``raise``) does not count: the error reaches it at the step's end all the same.
  void find_step_frame() {
    step_frame_ = nullptr;
    outer_try_ = false;
    std::optional<py::gil_scoped_acquire> gil;
    each_frame(kOuterDepth, gil, [&](const void* frame, PyCodeObject* code, int lasti, const auto& globals_of) {
      const CodeFacts& c = facts(code, globals_of, gil);
      if (c.internal) return false;
      if (step_frame_ == nullptr) {
        step_frame_ = frame;
        return false;
      }
      outer_try_ = covers(c.swallowing, lasti);
      return outer_try_;
    });
  }

  static constexpr int kUserDepth = 128;  // frames looked through for the user's and the step's
  static constexpr int kOuterDepth = 1024;  // frames looked through above the step's

  // The op's key (its innermost Python frame's code and offset: an op inside a library function
  // is told apart by its line there), and where it was called kept under its index in the step
  // (places_: that frame, and the innermost one outside torch and coexec, the user's line that
  // errors name). The torch bindings release the GIL before an op reaches the kernel; on CPython
  // 3.11 the frames are read without it (this thread's own, which only this thread changes), and
  // the GIL is taken only for a code object not seen before, and to let go of what the worker
  // laid aside once enough has gathered (elsewhere, per op).
  Key locate(const c10::OperatorHandle& op) {
    Key k{&op, {nullptr, -1}, 0};
    Place place{nullptr, -1, nullptr, -1};
    std::optional<py::gil_scoped_acquire> gil;
    walk(place, gil);
    if (worker_ && (gil || worker_->buried() > kBuriedBeforeExhume)) {
      if (!gil) gil.emplace();
      worker_->exhume();
    }
    if (place.code != nullptr) k.where = Where{place.code, place.lasti};
    add_place(place);
    if (place.user != last_user_.code || place.user_lasti != last_user_.lasti) note_user_place(place);
    auto& seen = seen_[k.where];
    if (seen.second != steps_) seen = {0, steps_};
    k.nth = seen.first++;
    return k;
  }

  // The walk outwards from the innermost Python frame: the op's own place, the user's (the first
  // frame outside torch and coexec), and whether a user frame from there to the step's ``with``
  // calls it inside a try that may catch its error (Place::in_try).
  void walk(Place& place, std::optional<py::gil_scoped_acquire>& gil) {
    each_frame(kUserDepth, gil, [&](const void* frame, PyCodeObject* code, int lasti, const auto& globals_of) {
      const CodeFacts& c = facts(code, globals_of, gil);
      if (place.code == nullptr) {
        place.code = code;
        place.lasti = lasti;
      }
      if (c.internal) return place.user != nullptr && frame == step_frame_;
      if (place.user == nullptr) {
        place.user = code;
        place.user_lasti = lasti;
      }
      if (covers(c.catching, lasti)) {
        place.in_try = true;
        return true;
      }
      return step_frame_ == nullptr || frame == step_frame_;
    });
  }

  // Cache what `op` made (its returns on `stack`) from `args`, whose tensors had the metadata
  // `inputs` before it ran (an ``out=`` that resizes changed its argument's since).
  const Entry& fill(const c10::OperatorHandle& op, const Key& key, Args args, std::vector<TensorMeta> inputs,
                    const torch::jit::Stack& stack) {
    const auto& schema = op.schema();
    Entry e;
    e.inputs = std::move(inputs);
    e.tensors = tensor_inputs(schema, args);
    e.consts = consts_of(schema, args, e.tensors);
    e.outputs = out_metas(stack, schema.returns().size());
    for (size_t r = 0; r < schema.returns().size(); ++r) e.written.push_back(written_arg(schema, r));
    e.run_now = must_run_now(op) || python_kernel(op);
    e.id = next_entry_id_++;
    auto& variants = cache_[key];
    for (auto it = variants.begin(); it != variants.end(); ++it)
      if (it->inputs == e.inputs && same_consts(it->consts, e.consts)) {
        if (it->outputs == e.outputs) e.id = it->id;  // (``.item()``, run again: the same)
        variants.erase(it);  // (the same arguments made other outputs: a data-dependent op)
        break;
      }
    if (variants.size() >= kVariants) variants.erase(variants.begin());
    variants.push_back(std::move(e));
    return variants.back();
  }

  // A call at `key` that no variant there matches (a new size), answered by the shape oracle
  // (capture_shapes.h) as a new variant; null where it cannot (the op runs at once).
  const Entry* shape(const c10::OperatorHandle& op, const Key& key, Args args) {
    // (under a budget's guard: room for what answering it holds here, released after `out`)
    AnswerRoom room(worker_ && cap_ > 0 ? AnswerRoom::Reserve([this](int64_t need) {
      if (worker_->reserve_for_stand_ins(need)) return;
      drain();
      worker_->make_room_for_stand_ins();
    }) : AnswerRoom::Reserve());
    torch::jit::Stack out;
    if (!shape_outputs(op, args, out, included_before_, room)) return nullptr;
    std::vector<TensorMeta> inputs;
    input_metas(args, inputs);
    ++shaped_;
    return &fill(op, key, args, std::move(inputs), out);
  }

  void run_now(const c10::OperatorHandle& op, const Key& key, Args args,
               torch::jit::Stack* stack);
  void run_at_once(const c10::OperatorHandle& op, Args args, torch::jit::Stack* stack);

  // An op's small real tensors (storages of at most kAheadBytes), gathered as answer() first
  // looks at its arguments: whether it may run ahead, and what a queued op keeps from running
  // ahead.
  static const c10::StorageImpl* small_storage(const at::Tensor& t) {
    if (!t.defined() || is_ph(t) || !t.has_storage()) return nullptr;
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    return static_cast<int64_t>(s->nbytes()) <= kAheadBytes ? s : nullptr;
  }

  struct SmallArgs {
    bool all = true;  // every tensor argument is small and real
    bool any = false;  // it has a tensor argument
    c10::SmallVector<const c10::StorageImpl*, 4> storages;

    void add(const at::Tensor& t) {
      any = true;
      if (const c10::StorageImpl* s = small_storage(t))
        storages.push_back(s);
      else
        all = false;
    }
  };

  // A queued op reads or writes these: an op on them no longer runs ahead in this step.
  void note_queued(const SmallArgs& small) {
    for (const c10::StorageImpl* s : small.storages) note_queued(s);
  }

  void note_queued(const c10::StorageImpl* s) {
    if (queued_small_.count(s) == 0)  // (the tensor holding it is alive: the copy is safe)
      queued_small_.emplace(s, c10::weak_intrusive_ptr<c10::StorageImpl>(
                                   c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(const_cast<c10::StorageImpl*>(s))));
  }

  // Before an op that writes runs ahead: the small storages it touches, as they are (the ones
  // answer()'s pass over its arguments found, lists included; those it only reads come back
  // unchanged).
  void keep_ahead_writes(const c10::FunctionSchema& schema, const SmallArgs& small) {
    if (!schema.is_mutable()) return;
    const int64_t place = static_cast<int64_t>(places_.size()) - 1;
    for (const c10::StorageImpl* s : small.storages) {
      auto* st = const_cast<c10::StorageImpl*>(s);
      if (st->data() == nullptr) continue;
      AheadWrite w{place, c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(st), {}};
      w.bytes.resize(st->nbytes());
      std::memcpy(w.bytes.data(), st->data(), st->nbytes());
      ahead_writes_.push_back(std::move(w));
    }
  }

  // Does the op run ahead: at once on this thread, without waiting for the worker? An op on
  // small real tensors only (at most kAheadBytes each: an optimizer's step count, a scalar's
  // bookkeeping), none requiring grad, none whose storage an op queued in this step reads or
  // writes, making at most kAheadBytes of new storage, drawing from no generator: no queued op
  // can see its effect or change its inputs, so running it now is eager's order on every
  // storage it touches. Adam's ``step_t += 1`` and ``step_t.item()`` per parameter waited for
  // the whole backward before each (issue 52). Not under a memory plan or a budget (their
  // places count the ops queued), nor while a step is described or a backward recorded, nor
  // inside a try that may catch an op's error (there every op runs in eager's order: what a
  // handler sees is eager's state). An op queued before it that fails has let it run, as it
  // let the Python after that line run; what it wrote is given back before that error is raised
  // (give_back_ahead_writes), so the tensors are eager's wherever the error is caught (a
  // notebook's cell, a trainer's handler: try blocks outside the program's code do not count).
  bool runs_ahead(const c10::OperatorHandle& op, const Entry& e, const SmallArgs& small, bool needs_grad, bool in_try) {
    if (!small.any || !small.all || needs_grad || !worker_ || mode_ != Mode::kAsync || in_try || recording_ ||
        describing_ || drops_ != nullptr || cap_ > 0)
      return false;
    for (const c10::StorageImpl* s : small.storages)
      if (queued_small_.count(s) != 0) return false;
    return made_bytes(op.schema(), e.written, e.outputs) <= kAheadBytes && !op.hasTag(at::Tag::nondeterministic_seeded) &&
           !is_collective(op) && !python_kernel(op);
  }

 public:
  // An op on sparse tensors: run at once on the values (no placeholder is sparse); a step with
  // one has a path no block follows, and a backward with one makes no block.
  void run_sparse(const c10::OperatorHandle& op, torch::jit::Stack* stack);
};

// Run ``op`` on the values of ``args`` (below autograd, with ``included`` as this thread's
// included keys) and return real tensors, the written arguments themselves (a placeholder among
// them takes the metadata the op gave its value).
void run_on_values(const c10::OperatorHandle& op, Args args, torch::jit::Stack* stack,
                   c10::DispatchKeySet included) {
  const auto& schema = op.schema();
  const size_t nret = schema.returns().size();
  for (const c10::IValue& a : args) stack->push_back(map_tensors(a, real_of));
  {
    at::AutoDispatchBelowADInplaceOrView below;
    c10::impl::ForceDispatchKeyGuard off(included, c10::impl::tls_local_dispatch_key_set().excluded_);
    op.callBoxed(*stack);
  }
  for (size_t r = 0; r < nret; ++r) {
    const int w = written_arg(schema, r);
    if (w < 0) continue;
    c10::IValue& out = (*stack)[stack->size() - nret + r];
    if (args[w].isTensor() && is_ph(args[w].toTensor()) && out.isTensor()) {
      const at::Tensor& real = out.toTensor();
      impl_of(args[w].toTensor())->take_metadata(real.sizes(), real.strides(), real.storage_offset());
    }
    out = args[w];
  }
}

// As eager: wait for the ops before it, run it on the values, and cache what it made.
void Capture::run_now(const c10::OperatorHandle& op, const Key& key, Args args,
                      torch::jit::Stack* stack) {
  std::vector<TensorMeta> before;  // (a miss met again must match what came in, not what went out)
  input_metas(args, before);
  run_at_once(op, args, stack);
  fill(op, key, args, std::move(before), *stack);
}

// Wait for the ops before it and run it on the values.
void Capture::run_at_once(const c10::OperatorHandle& op, Args args, torch::jit::Stack* stack) {
  ++run_now_;
  drain();
  raise_failure();
  StepLog* log = describing_ && worker_ ? worker_->log() : nullptr;
  if (log == nullptr) {
    run_on_values(op, args, stack, included_before_);
    return;
  }
  torch::jit::Stack real;
  for (const c10::IValue& a : args) real.push_back(map_tensors(a, real_of));
  log->start(op, static_cast<int64_t>(places_.size()) - 1, real, true, !forward_);
  const auto t0 = std::chrono::steady_clock::now();
  run_on_values(op, args, stack, included_before_);
  torch::jit::Stack out(stack->end() - op.schema().returns().size(), stack->end());
  log->finish(out, {}, ns_since(t0));
}

// -- gradient blocks (capture_blocks.h) --------------------------------------------------------

Capture::Place Capture::here() {
  Place place{nullptr, -1, nullptr, -1};
  std::optional<py::gil_scoped_acquire> gil;
  walk(place, gil);
  return place;
}

int Capture::backward_begin(const at::Tensor& loss, const std::vector<at::Tensor>& inputs, bool allow_unused) {
  ++backwards_;
  forward_ = false;  // (the guard keeps recipes for the forward's values only: Worker::guard)
  auto engine = [this](std::string why) {
    backward_why_ = std::move(why);
    return static_cast<int>(kEngine);
  };
  if (!worker_ || !stepping() || paused_ > 0) return engine("not in a captured step that computes as it goes");
  if (recording_) return engine("a backward inside a backward");
  if (saved_hooks_) return engine("saved-tensor hooks were active in the step (checkpointing, offloading)");
  if (torch::autograd::AnomalyMode::is_enabled()) return engine("anomaly detection is on");
  if (!loss.defined() || !loss.grad_fn()) return engine("the loss has no gradient function");
  const GraphWalk& w = walker_.walk(loss.grad_fn().get(), step_nodes_);
  struct Forget {  // (whichever way this returns)
    GraphWalker& walker;
    ~Forget() { walker.forget(); }
  } forget{walker_};
  if (!w.why_not.empty()) return engine(w.why_not);
  // grad(): per input, its leaf in the walk (the engine reads no leaf's .grad then)
  std::vector<int32_t> leaf_of(inputs.size(), -1);
  if (!inputs.empty()) {
    std::unordered_map<const c10::TensorImpl*, int32_t> leaf_at;
    for (size_t i = 0; i < w.leaves.size(); ++i) leaf_at.emplace(w.leaves[i].unsafeGetTensorImpl(), static_cast<int32_t>(i));
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto it = leaf_at.find(inputs[i].unsafeGetTensorImpl());
      if (it != leaf_at.end()) leaf_of[i] = it->second;
    }
  } else {
    for (const at::Tensor& leaf : w.leaves)
      if (leaf.grad().defined() && leaf.grad().layout() != c10::kStrided)
        return engine("a leaf's .grad is not a strided tensor");
  }
  const Place site = here();
  if (site.in_try || outer_try_) return engine("the backward() is inside a try (its ops run at once, so that an error is raised there)");
  const auto bucket = blocks_.find(path_hash_);
  for (Block& b : bucket != blocks_.end() ? bucket->second : no_blocks_) {
    if (b.graph != w.digest || b.path != path_ || b.inputs != leaf_of) continue;
    if (tracing_ && b.why_not.empty()) {
      // (a traced step runs the engine, its ops logged one by one; its path then goes on as a
      // replay's would, so that a traced step's path is an untraced one's: backward_end)
      shadow_ = Shadow{true, path_.size(), path_hash_, b.id};
      backward_why_ = "the step is traced (its backward's ops are logged one by one)";
      return kRecord;
    }
    // (met again: worth its making, or its refusal; the blocks made at its line before it that
    // were not used are forgiven: a sweep's next model at one train() line makes its own)
    auto met = [&] {
      if (b.replays++ == 0) making_at_[b.site] = Making{};
    };
    if (!b.why_not.empty()) {
      met();
      return engine(b.why_not);
    }
    if (!allow_unused && b.results.size() < b.inputs.size()) {
      met();
      return engine("an input is not reached and allow_unused is False (the engine raises)");
    }
    // (made in another state of the step: the leaves' .grad, the placeholders made before it.
    // Another block of this path may fit, or one is made below for this state: the first step's
    // grads are None, the next steps' are not)
    if (!issue_block(b, w, site).empty()) continue;
    met();
    backward_why_.clear();
    return kReplayed;
  }
  if (missed_) return engine("ops new at their line ran in this step before it");
  if (blocks_made_ >= kMaxBlocks) {  // (a long sweep of models: the old ones' blocks go)
    blocks_.clear();
    making_at_.clear();
    blocks_made_ = 0;
  }
  Making& making = making_at_[Where{site.user, site.user_lasti}];
  if (making.unused >= kBlocksPerSite && ++making.skipped < making.wait)
    return engine("no block for the ops before it, and the last " + std::to_string(kBlocksPerSite) +
                  " made at this line were not used");
  if (making.unused >= kBlocksPerSite) {  // (tried now and then: the paths may settle)
    making.skipped = 0;
    making.wait = std::min(2 * making.wait, kMaxWait);
  }
  ++making.unused;
  rec_ = Recording{};
  rec_.site = Where{site.user, site.user_lasti};
  rec_.block.path = path_;
  rec_.block.graph = w.digest;
  rec_.block.inputs = std::move(leaf_of);
  rec_.block.first_value = static_cast<uint32_t>(values_.size());
  rec_.path_len = path_.size();
  rec_.path_hash = path_hash_;
  rec_.first_outer = static_cast<uint32_t>(outers_.size());
  if (inputs.empty()) rec_.leaves = w.leaves;  // (grad() neither reads nor sets .grad)
  for (const at::Tensor& leaf : rec_.leaves) {
    rec_.grads_before.push_back(leaf.grad());
    rec_.block.grads.push_back(meta_of(leaf.grad()));
  }
  recording_ = true;
  backward_why_ = "its block was being made";
  return kRecord;
}

Ref Capture::ref_of(const at::Tensor& t, Block& b, bool written) {
  if (!t.defined()) return {Ref::kNone, 0};
  for (size_t i = 0; i < rec_.leaves.size(); ++i)  // (first: an in-place add to it moves its version)
    if (rec_.grads_before[i].defined() && rec_.grads_before[i].unsafeGetTensorImpl() == t.unsafeGetTensorImpl())
      return {Ref::kGrad, static_cast<uint32_t>(i)};
  if (is_ph(t)) {
    const Slot* s = impl_of(t)->slot.get();
    if (s != nullptr && s->id >= first_value_) return {Ref::kStep, static_cast<uint32_t>(s->id - first_value_)};
    refuse("the backward read a placeholder of another step");
    return {Ref::kNone, 0};
  }
  const uint32_t o = outer(t);
  if (o < rec_.first_outer) return {Ref::kOuter, o};
  const auto known = rec_.made_of.find(o);  // (met before in the block: as then)
  if (known != rec_.made_of.end()) {
    if (written && known->second.kind == Ref::kConst) refuse("the backward wrote to a tensor it keeps");
    return known->second;
  }
  // an unpacked saved tensor is a shallow copy of the one the forward saw (make_variable): the
  // same storage and metadata (no formula writes to one in place); a wrapped number too (``loss
  // * w``: the step's w, not the recording's)
  if (t.has_storage()) {
    const TensorMeta m = meta_of(t);
    for (uint32_t k = 0; k < rec_.first_outer; ++k) {
      const auto p = outers_[k].lock();
      if (p && p->has_storage() && p->storage().unsafeGetStorageImpl() == t.storage().unsafeGetStorageImpl() &&
          m.same(at::Tensor(p)))
        return {Ref::kOuter, k};
    }
  }
  // a tensor a formula made without the kernel (a factory's BackendSelect, a wrapped number):
  // filled by the block, or (read first) computed at once from numbers and sizes, the same each
  // time, so the block keeps it (written to later, it would not be the same: no block)
  Ref r{Ref::kNone, 0};
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
    b.consts.push_back(t);
    r = {Ref::kConst, static_cast<uint32_t>(b.consts.size() - 1)};
  } else if (written && t.storage_offset() == 0) {
    b.fresh.push_back(meta_of(t));
    r = {Ref::kFresh, static_cast<uint32_t>(b.fresh.size() - 1)};
  } else if (t.numel() <= kConstElements) {
    c10::impl::ForceDispatchKeyGuard off(included_before_, c10::impl::tls_local_dispatch_key_set().excluded_);
    at::AutoDispatchBelowADInplaceOrView below;
    b.consts.push_back(t.clone());
    r = {Ref::kConst, static_cast<uint32_t>(b.consts.size() - 1)};
  } else {
    refuse("the backward read a tensor made outside the dispatcher");
    return r;
  }
  if (written && r.kind == Ref::kConst) refuse("the backward wrote to a tensor it keeps");
  rec_.made_of.emplace(o, r);
  return r;
}

// While a block is made: the op as the engine issued it.
void Capture::record(const c10::OperatorHandle& op, const Entry& e, Args args, bool grad_mode) {
  Block& b = rec_.block;
  BlockOp o;
  o.op = &op;
  o.grad_mode = grad_mode;
  o.written = e.written;
  o.outputs = e.outputs;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& a = args[i];
    o.ref_begin.push_back(static_cast<uint32_t>(o.refs.size()));
    if (!has_tensor(a)) {
      o.args.push_back(a);
      continue;
    }
    bool written = false;
    for (int w : e.written) written = written || w == static_cast<int>(i);
    each_tensor(a, [&](const at::Tensor& t) { o.refs.push_back(ref_of(t, b, written)); });
    o.args.push_back(map_tensors(a, [](const at::Tensor&) { return at::Tensor(); }));
  }
  b.ops.push_back(std::move(o));
}

void Capture::backward_end(bool ok, const std::string& python, bool again,
                           const std::vector<std::optional<at::Tensor>>& results) {
  if (shadow_.active) {
    shadow_.active = false;
    if (ok) path_as_block(shadow_.path_len, shadow_.path_hash, shadow_.block);
    return;
  }
  if (!recording_) return;
  recording_ = false;
  // not watched (a profiler), or refused for an op new at its line: no block, nor counted; the
  // next step at this path tries again
  if (again || (ok && python.empty() && rec_.again)) {
    backward_why_ = again ? python : rec_.why_not;
    --making_at_[rec_.site].unused;
    rec_ = Recording{};
    return;
  }
  Block b = std::move(rec_.block);
  b.id = next_block_++;
  if (!ok) {
    b.why_not = "the engine raised when its block was made";
  } else if (!python.empty()) {
    b.why_not = "Python ran inside the backward (" + python + ")";
  } else {
    b.why_not = rec_.why_not;
  }
  for (size_t i = 0; i < rec_.leaves.size() && b.why_not.empty(); ++i) {
    const at::Tensor& after = rec_.leaves[i].grad();
    const at::Tensor& before = rec_.grads_before[i];
    if (after.defined() ? before.defined() && after.unsafeGetTensorImpl() == before.unsafeGetTensorImpl()
                        : !before.defined())
      continue;  // (accumulated in place, or not reached)
    const Slot* s = after.defined() && is_ph(after) && after.layout() == c10::kStrided ? impl_of(after)->slot.get()
                                                                                        : nullptr;
    if (s == nullptr || s->id < first_value_ + b.first_value || s->id >= first_value_ + values_.size()) {
      b.why_not = "a leaf's .grad was set to what the backward's ops did not make";
      break;
    }
    b.bindings.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(s->id - first_value_), meta_of(after)});
  }
  for (size_t i = 0; i < results.size() && b.why_not.empty(); ++i) {
    if (!results[i] || !results[i]->defined()) continue;
    const at::Tensor& g = *results[i];
    const Slot* s = is_ph(g) && g.layout() == c10::kStrided ? impl_of(g)->slot.get() : nullptr;
    if (s == nullptr || s->id < first_value_ + b.first_value || s->id >= first_value_ + values_.size()) {
      b.why_not = "a gradient it returns is not what the backward's ops made";
      break;
    }
    b.results.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(s->id - first_value_), meta_of(g)});
  }
  if (b.why_not.empty() && results.size() != b.inputs.size()) b.why_not = "grad() returned another number of gradients";
  b.values = static_cast<uint32_t>(values_.size()) - b.first_value;
  if (b.why_not.empty()) {  // (the path goes on as a replay's will: the block in place of its ops)
    path_as_block(rec_.path_len, rec_.path_hash, b.id);
    backward_why_ = "its block was made";
  } else {
    b.ops.clear();
    b.consts.clear();
    b.fresh.clear();
    backward_why_ = b.why_not;
  }
  b.site = rec_.site;
  ++blocks_made_;
  blocks_[rec_.path_hash].push_back(std::move(b));  // (the hash of its path)
  rec_ = Recording{};
}

// The bytes of the new storages an op's returns will have (`written`, `outputs`: per return; a
// return the schema says aliases an argument, a view, has none).
int64_t made_bytes(const c10::FunctionSchema& schema, const std::vector<int>& written, const std::vector<OutMeta>& outputs) {
  int64_t n = 0;
  for (size_t r = 0; r < outputs.size() && r < written.size(); ++r) {
    if (written[r] >= 0 || (r < schema.returns().size() && schema.returns()[r].alias_info() != nullptr)) continue;
    for (const TensorMeta& m : outputs[r].tensors)
      if (m.dtype != c10::ScalarType::Undefined)
        n += static_cast<int64_t>(at::detail::computeStorageNbytes(m.sizes, m.strides, c10::elementSize(m.dtype), m.offset));
  }
  return n;
}

// Issue block `b` for this step (graph `w`), or say why not (nothing issued then).
std::string Capture::issue_block(Block& b, const GraphWalk& w, const Place& site) {
  const bool grad = !b.inputs.empty();  // (torch.autograd.grad: no leaf's .grad is read)
  if (!grad && w.leaves.size() != b.grads.size()) return "the graph reaches other leaves than when its block was made";
  for (size_t i = 0; i < b.grads.size(); ++i) {
    const at::Tensor& g = w.leaves[i].grad();
    const TensorMeta& m = b.grads[i];
    if ((m.dtype == c10::ScalarType::Undefined) != !g.defined() || (g.defined() && !m.same(g)))
      return "a leaf's .grad is not as when its block was made";
  }
  if (values_.size() != b.first_value) return "the step made other placeholders before it";
  // every tensor the block reads is found before any op is issued
  std::vector<std::shared_ptr<Slot>> new_values(b.values);
  for (auto& v : new_values) v = std::make_shared<Slot>();
  struct Got {
    std::shared_ptr<Slot> slot;
    at::Tensor t;
  };
  std::vector<Got> got;
  std::vector<at::Tensor> made_fresh(b.fresh.size());
  for (const BlockOp& o : b.ops)
    for (const Ref& r : o.refs) {
      Got g;
      switch (r.kind) {
        case Ref::kNone:
          break;
        case Ref::kStep:
          g.slot = r.a >= b.first_value ? new_values[r.a - b.first_value] : values_[r.a].lock();
          if (!g.slot) return "a value its block reads was let go of";
          break;
        case Ref::kOuter: {
          auto p = outers_[r.a].lock();
          if (!p) return "a tensor its block reads was let go of";
          g.t = at::Tensor(std::move(p));
          break;
        }
        case Ref::kGrad:
          g.t = w.leaves[r.a].grad();
          if (is_ph(g.t)) g.slot = impl_of(g.t)->slot;
          break;
        case Ref::kConst:
          g.t = b.consts[r.a];
          break;
        case Ref::kFresh:
          if (!made_fresh[r.a].defined()) {
            const TensorMeta& m = b.fresh[r.a];
            made_fresh[r.a] = at::Tensor(at::detail::empty_strided_cpu(m.sizes, m.strides, m.dtype));
          }
          g.t = made_fresh[r.a];
          break;
      }
      got.push_back(std::move(g));
    }
  for (const auto& v : new_values) {
    v->id = next_value_++;
    values_.emplace_back(v);
  }
  // (retain_graph=False: the nodes the engine would have run let go of what they saved, as the
  // engine would have, node by node, as it ran them: described, each at its last use, -1.
  // Before the block's first op is published, so that the worker meets its ops with the program's
  // holds on the forward's values gone (a budget's guard drops a value once only recipes hold it);
  // the ops' slots, read above, keep what they read)
  if (describing_) g_issued.store(-1, std::memory_order_relaxed);
  if (grad) {
    for (torch::autograd::Node* n : walker_.needed(b.inputs)) n->release_variables();
  } else {
    for (torch::autograd::Node* n : w.nodes) n->release_variables();
  }
  if (describing_) g_issued.store(static_cast<int64_t>(places_.size()), std::memory_order_relaxed);
  std::vector<bool> bound(new_values.size(), false);  // (a leaf's .grad, a result: bound after the loop)
  for (const Binding& bd : b.bindings) bound[bd.value - b.first_value] = true;
  for (const Binding& r : b.results) bound[r.value - b.first_value] = true;
  size_t g0 = 0, next_new = 0;
  for (const BlockOp& o : b.ops) {
    TapeEntry& e = worker_->next_entry();
    e.op = o.op;
    e.grad_mode = o.grad_mode;
    e.index = static_cast<int64_t>(places_.size());
    add_place(site);
    for (size_t i = 0; i < o.args.size(); ++i) {
      const auto [rb, re] = o.refs_of(i);
      e.arg_slots.push_back(static_cast<uint32_t>(e.slots.size()));
      bool real = false;
      for (uint32_t k = rb; k < re; ++k) {
        real = real || (!got[g0 + k].slot && got[g0 + k].t.defined());
        if (const c10::StorageImpl* s = got[g0 + k].slot ? nullptr : small_storage(got[g0 + k].t))
          note_queued(s);
      }
      if (!real) {
        e.args.push_back(o.args[i]);
      } else {
        size_t k = g0 + rb;
        e.args.push_back(map_tensors(o.args[i], [&](const at::Tensor&) {
          const Got& x = got[k++];
          return x.slot ? at::Tensor() : x.t;
        }));
      }
      // (moved: once the op is published only the tape holds what it reads, so that the
      // worker, running right behind this loop, lets go of a value after its last read)
      for (uint32_t k = rb; k < re; ++k) e.slots.push_back(std::move(got[g0 + k].slot));
    }
    for (size_t r = 0; r < o.written.size(); ++r) {
      e.out_begin.push_back(static_cast<uint32_t>(e.out_slots.size()));
      const int wr = o.written[r];
      if (wr >= 0) {  // (in place: its tensor's version moves, as autograd's kernel moves it)
        const auto [rb, re] = o.refs_of(wr);
        for (uint32_t k = rb; k < re; ++k)
          if (got[g0 + k].t.defined()) got[g0 + k].t.unsafeGetTensorImpl()->bump_version();
        continue;
      }
      for (const TensorMeta& m : o.outputs[r].tensors) {
        if (m.dtype == c10::ScalarType::Undefined) {
          e.out_slots.push_back(nullptr);
          continue;
        }
        const size_t v = next_new++;  // (a value bound below stays in new_values; the rest move)
        e.out_slots.push_back(bound[v] ? new_values[v] : std::move(new_values[v]));
      }
    }
    if (cap_ > 0) e.made_bytes = made_bytes(o.op->schema(), o.written, o.outputs);
    e.forward = false;
    g0 += o.refs.size();
    e.trash.swap(trash_);
    e.banished.swap(banished_);
    worker_->publish();
  }
  ops_ += static_cast<int64_t>(b.ops.size());
  for (const Binding& bd : b.bindings)
    w.leaves[bd.leaf].mutable_grad() = make_ph(bd.meta, new_values[bd.value - b.first_value]);
  grads_.assign(b.inputs.size(), std::nullopt);
  for (const Binding& r : b.results) grads_[r.leaf] = make_ph(r.meta, new_values[r.value - b.first_value]);
  extend_path(mix(0xB10C, b.id));
  ++replayed_;
  if (worker_->buried() > kBuriedBeforeExhume) worker_->exhume();
  return "";
}

void Capture::answer(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nret = schema.returns().size();
  auto args = take_args(op, stack);
  // the op's part of the step's path: where its tensors came from, and its numbers where
  // autograd may save them (its entry is added below)
  const bool grad_mode = c10::GradMode::is_enabled();
  bool needs_grad = false, meta = false;
  SmallArgs small;
  uint64_t d = grad_mode;
  for (const auto& a : args)  // (placeholders report the CPU: a CUDA step would be answered wrong)
    each_tensor(a, [&](const at::Tensor& t) {
      if (t.defined() && t.is_meta()) {
        meta = true;
        return;
      }
      TORCH_CHECK(!t.defined() || t.is_cpu(), "coexec: capture runs steps on the CPU only for now; ",
                  op.schema().name(), " got a tensor on ", t.device());
      d = mix(d, wiring(t));
      needs_grad = needs_grad || (t.defined() && t.requires_grad());
      if (t.defined()) small.add(t);
    });
  // An op on a meta tensor: Meta is the highest backend, so one comes here only where it carries
  // another backend's keys (FakeTensorMode's tensors carry their fake device's: a CPU tensor's
  // keys and the capture's key in the thread's make PrivateUse3). Answered with a placeholder, a
  // CPU tensor without storage, it crashed Dynamo compiling in a step (extract_tensor_metadata
  // read its storage); it runs below the capture instead, as without it.
  if (meta) {
    wait();
    run_on_values(op, args, stack, without_capture(included_now()));
    return;
  }
  ++ops_;
  if (grad_mode && needs_grad)
    for (const auto& a : args) {
      if (a.isDouble()) {
        const double x = a.toDouble();
        uint64_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        d = mix(d, bits);
      } else if (a.isInt()) {
        d = mix(d, static_cast<uint64_t>(a.toInt()));
      } else if (a.isBool()) {
        d = mix(d, a.toBool() ? 7 : 5);
      }
    }
  if (!at::SavedTensorDefaultHooks::get_tls_state().stack.empty()) saved_hooks_ = true;
  const int64_t index = static_cast<int64_t>(places_.size());  // (locate adds this op's place)
  const Key key = locate(op);
  // (called inside a try that may catch its error: run at once, so that the error is raised
  // here, into the handler, and the Python after it does not run first)
  const bool in_try = outer_try_ || places_.back().in_try;
  const Entry* cached = nullptr;
  auto it = cache_.find(key);
  if (it != cache_.end())
    for (auto v = it->second.rbegin(); v != it->second.rend() && cached == nullptr; ++v)
      if (matches(*v, schema, args)) cached = &*v;
  // (a new variant the oracle answered: its outputs checked when the worker runs it, once: the
  // cache's answers are its)
  bool shaped = false;
  if (cached == nullptr && !(in_try && mode_ == Mode::kAsync)) {
    cached = shape(op, key, args);
    shaped = cached != nullptr;
  }
  if (cached != nullptr && !shaped && runs_ahead(op, *cached, small, needs_grad, in_try) && !changes_written(*cached, args)) {
    ++ahead_;
    if (g_debug) std::cerr << "coexec capture: (runs ahead) " << schema.name() << "." << schema.overload_name() << std::endl;
    extend_path(mix(d, cached->id ^ kAheadSalt));
    keep_ahead_writes(schema, small);
    try {
      run_on_values(op, args, stack, included_before_);
    } catch (...) {
      drain();  // (an op queued before it may have failed: that error is the one eager raised)
      raise_failure();
      throw;
    }
    return;
  }
  if (mode_ == Mode::kAsync && (in_try || cached == nullptr || cached->run_now || changes_written(*cached, args))) {
    if (cached == nullptr) {
      ++misses_;
      missed_ = true;
      if (g_debug) std::cerr << "coexec capture: (a miss: runs at once) " << schema.name() << "." << schema.overload_name() << std::endl;
    }
    if (recording_ && refuse("an op of the backward ran at once (new at its line, or its result read)"))
      rec_.again = cached == nullptr;  // (new at its line: the next step at this path tries again)
    // (a miss's entry is new: no block follows a path with one)
    extend_path(mix(d, cached != nullptr ? cached->id : never_matched()));
    run_now(op, key, args, stack);
    return;
  }
  if (cached == nullptr) {  // (nothing computed) the op's meta kernel says what it makes
    ++misses_;
    for (const c10::IValue& a : args) stack->push_back(map_tensors(a, as_meta));
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
    std::vector<TensorMeta> inputs;
    input_metas(args, inputs);
    cached = &fill(op, key, args, std::move(inputs), *stack);
    torch::jit::drop(*stack, nret);
  }
  extend_path(mix(d, cached->id));
  if (recording_ && rec_.why_not.empty()) record(op, *cached, args, grad_mode);  // (none if refused)
  if (mode_ != Mode::kAsync) take_written_metadata(*cached, args, included_before_);
  TapeEntry& entry = worker_ ? worker_->next_entry() : tape_.emplace_back();
  entry.op = &op;
  entry.grad_mode = grad_mode;
  entry.index = index;
  for (size_t r = 0; r < nret; ++r) {
    const int w = cached->written[r];
    const OutMeta& m = cached->outputs[r];
    entry.out_begin.push_back(static_cast<uint32_t>(entry.out_slots.size()));
    c10::IValue out;
    if (w >= 0) {
      out = args[w];  // (its slot already has the value it will have)
    } else if (m.is_list) {
      std::vector<at::Tensor> l;
      const int base = view_of_inference(schema, r, args);
      for (const TensorMeta& t : m.tensors) {
        l.push_back(make_ph(t));
        if (base >= 0 && l.back().defined()) impl_of(l.back())->set_inference(base == 1);
        number(l.back());
        entry.out_slots.push_back(slot_of(l.back()));
        if (shaped) entry.expect.push_back(t);
      }
      out = std::move(l);
    } else {
      at::Tensor t = make_ph(m.tensors[0]);
      if (const int base = view_of_inference(schema, r, args); base >= 0 && t.defined())
        impl_of(t)->set_inference(base == 1);
      number(t);
      entry.out_slots.push_back(slot_of(t));
      if (shaped) entry.expect.push_back(m.tensors[0]);
      out = std::move(t);
    }
    stack->push_back(std::move(out));
  }
  if (cap_ > 0) entry.made_bytes = made_bytes(schema, cached->written, cached->outputs);
  entry.forward = forward_;
  if (worker_) note_queued(small);
  // (moved, after the outputs took the written ones: a copy and a destroy an argument less)
  for (c10::IValue& a : args) entry.add_arg(std::move(a));
  if (worker_) {
    entry.trash.swap(trash_);  // (capacity goes back and forth: no allocation)
    entry.banished.swap(banished_);
    worker_->publish();
  }
}

void Capture::run_sparse(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = take_args(op, stack);
  ++ops_;
  missed_ = true;
  if (recording_) refuse("the backward has an op on sparse tensors");
  extend_path(never_matched());
  run_at_once(op, args, stack);
}

// Outside a step a placeholder stands for its value (one that outlived its step without a value
// is an error there).
void outside(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = take_args(op, stack);
  run_on_values(op, args, stack, c10::impl::tls_local_dispatch_key_set().included_);
}


// The one handle of `op` kept for the process: the handle a kernel is given is the caller's, and a
// caller from Python (``torch.ops``, a tensor subclass such as the functional collectives'
// AsyncCollectiveTensor) may pass a temporary one. The capture keeps handles past the call (a
// taped op, a cache key, a block), so it keeps this one, found by the op's schema (which lives as
// long as the op); the same op then also meets its cache entry every time.
const c10::OperatorHandle& lasting(const c10::OperatorHandle& op) {
  const c10::FunctionSchema* key = &op.schema();
  thread_local std::array<std::pair<const c10::FunctionSchema*, const c10::OperatorHandle*>, 256> hot{};
  auto& h = hot[(reinterpret_cast<uintptr_t>(key) >> 4) & 255];
  if (h.first == key) return *h.second;
  static std::mutex mu;
  static auto* kept = new std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<c10::OperatorHandle>>();
  std::lock_guard<std::mutex> g(mu);
  auto& held = (*kept)[key];
  if (!held) held = std::make_unique<c10::OperatorHandle>(op);
  h = {key, held.get()};
  return *held;
}

void sparse_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  Capture* c = g_active.load(std::memory_order_relaxed);
  if (c == nullptr) {
    outside(op, stack);
    return;
  }
  if (c->tracing())
    c->answer_traced(lasting(op), stack, true);
  else
    c->run_sparse(lasting(op), stack);
}

// After a torch.compile'd region began (Capture::run_rest_eagerly): below the capture, at once
// (placeholders stand for their values, the worker caught up first).
void below(Capture* c, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c->wait();
  auto args = take_args(op, stack);
  run_on_values(op, args, stack, without_capture(c10::impl::tls_local_dispatch_key_set().included_));
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  Capture* c = g_active.load(std::memory_order_relaxed);
  if (g_debug) std::cerr << "coexec capture: " << op.schema().name() << "." << op.schema().overload_name() << (c ? "" : " (outside a step)") << std::endl;
  if (t_shaping) {  // (an op the shape oracle's kernel called: answered the same way)
    shape_call(op, stack);
    return;
  }
  if (c == nullptr) {
    outside(op, stack);
    return;
  }
  if (c->eager_rest()) {
    below(c, op, stack);
    return;
  }
  const bool timed = c->timed_now();
  const auto t0 = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  if (c->tracing())
    c->answer_traced(lasting(op), stack, false);
  else
    c->answer(lasting(op), stack);
  // (kernel_ns_ is the capture's, updated only on its step's thread)
  if (timed) c->add_kernel_ns(ns_since(t0) * kTimedEvery);
}

}  // namespace

void bind_capture(py::module_& m) {
  py::class_<Capture>(m, "Capture")
      .def(py::init<const std::string&, int, std::vector<std::string>, std::vector<std::string>, py::object,
                    py::object>(),
           py::arg("mode"), py::arg("threads"), py::arg("internal"), py::arg("libraries"), py::arg("catching"),
           py::arg("with_place"))
      .def("begin", &Capture::begin)
      .def("try_begin", &Capture::try_begin)
      .def("end", &Capture::end)
      .def("pause", &Capture::pause)
      .def("resume", &Capture::resume)
      .def("run_rest_eagerly", &Capture::run_rest_eagerly)
      .def("realize", &Capture::realize, py::arg("t"), py::arg("kind") = "tensor")
      .def("wait", &Capture::wait)
      .def("replay", &Capture::replay)
      .def("backward_begin", &Capture::backward_begin)
      .def("backward_end", &Capture::backward_end)
      .def("take_grads", &Capture::take_grads)
      .def("describe_next", &Capture::describe_next)
      .def("trace_next", &Capture::trace_next, py::arg("on") = true)
      .def("take_trace", &Capture::take_trace)
      .def_property_readonly("lines", &Capture::lines)
      .def("description", &Capture::description)
      .def("set_drops", &Capture::set_drops)
      .def("clear_drops", &Capture::clear_drops)
      .def("add_path", &Capture::add_path)
      .def_property_readonly("followed_path", &Capture::followed_path)
      .def("guard", &Capture::guard)
      .def_property_readonly("followed", &Capture::followed)
      .def_property_readonly("outgrew", &Capture::outgrew)
      .def_property_readonly("backward_why", &Capture::backward_why)
      .def_property_readonly("stepping", &Capture::stepping)
      .def_property_readonly("counters", &Capture::counters);
  m.def("is_placeholder", &is_ph);
  // (bench/native_memory.py) the CPU allocator's bytes: counted from the first call on
  m.def("count_cpu_bytes", [] { count_cpu_bytes(); });
  m.def("cpu_bytes", [] {
    auto& c = count_cpu_bytes();
    return py::make_tuple(c.live(), c.peak());
  });
  m.def("reset_cpu_peak", [] { count_cpu_bytes().reset_peak(); });
  m.def("cpu_bytes_made", [] {  // (the bytes allocated since reset_cpu_peak still held, their peak)
    auto& c = count_cpu_bytes();
    return py::make_tuple(c.made(), c.made_peak());
  });
  // the capture worker's kept blocks (cpu_block_cache.h)
  m.def("cpu_block_cache", [] {
    const BlockCacheStats s = count_cpu_bytes().cache().stats();
    py::dict d;
    d["in_use"] = s.in_use;
    d["cached"] = s.cached;
    d["peak_in_use"] = s.peak_in_use;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    return d;
  });
  m.def("empty_cpu_block_cache", [] { count_cpu_bytes().cache().empty(); });
  // (coexec/skeleton.py, Skeleton.output_metas) a structured kernel's C++ meta function on meta
  // tensors: what the op makes, without the Python meta kernel torch registers over it (which
  // takes 50-500 us); None where the op has none (the caller asks the Meta key instead)
  m.def("structured_meta", [](const std::string& name, const std::string& overload, py::tuple args,
                              py::dict kw) -> py::object {
    const auto kwargs = py::reinterpret_borrow<py::kwargs>(kw);
    const auto& table = structured_meta();
    const auto it = table.find(c10::OperatorName(name, overload));
    if (it == table.end()) return py::none();
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    torch::jit::Stack stack = torch::jit::createStackForSchema(op.schema(), args, kwargs, std::nullopt);
    it->second.callBoxed(op, c10::DispatchKeySet(c10::DispatchKey::Meta), &stack);
    return torch::jit::createPyObjectForStack(std::move(stack));
  });
}

}  // namespace coexec
