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
//   are not tensors. An op the cache cannot answer, one whose result Python reads (``.item()``),
//   one whose output shape depends on data, or an in-place op that changes metadata (a miss)
//   waits for the worker and runs at once, as eager would, and fills the cache.
// * Modes: "async" (the worker computes as ops come), "replay" (nothing computed during the
//   step; replay() runs the tape afterwards: the check that the tape is complete) and "tape"
//   (nothing computed: what the skeleton alone costs). Where nothing is computed during the
//   step, a miss's metadata comes from the op's meta kernel (150-300 us; ``.item()`` fails).
//
// The kernel is registered at the first Capture, never at import.
#include "capture.h"

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <Python.h>
#include <frameobject.h>
#include <pybind11/stl.h>

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
#include <utility>
#include <vector>

namespace py = pybind11;

namespace coexec {
namespace {

constexpr auto kKey = c10::DispatchKey::PrivateUse3;

// -- placeholders ----------------------------------------------------------------------------

struct Slot {
  at::Tensor real;  // the value, once computed
};

class Capture;
std::atomic<Capture*> g_active{nullptr};  // the capture a step is running under, if any
void made(const c10::intrusive_ptr<c10::TensorImpl>& impl);

struct PlaceholderImpl : c10::TensorImpl {
  std::shared_ptr<Slot> slot;

  PlaceholderImpl(caffe2::TypeMeta dtype, std::shared_ptr<Slot> s)
      : TensorImpl(c10::DispatchKeySet(kKey), dtype, c10::Device(c10::kCPU)), slot(std::move(s)) {}

  c10::intrusive_ptr<TensorImpl> shallow_copy_and_detach(const c10::VariableVersion& version,
                                                         bool allow_metadata_change) const override {
    return copy(version, allow_metadata_change);
  }

  c10::intrusive_ptr<TensorImpl> shallow_copy_and_detach(c10::VariableVersion&& version,
                                                         bool allow_metadata_change) const override {
    return copy(std::move(version), allow_metadata_change);
  }

  void shallow_copy_from(const c10::intrusive_ptr<TensorImpl>& impl) override {
    TensorImpl::shallow_copy_from(impl);
    if (auto* other = dynamic_cast<PlaceholderImpl*>(impl.get())) slot = other->slot;
  }

  // (a dead placeholder stays allocated while the capture's weak reference to it lives: its
  // value must not)
  void release_resources() override {
    slot.reset();
    TensorImpl::release_resources();
  }

  // Become the value: its storage, offset and dispatch keys. False: it has none (yet).
  bool realize() {
    if (!key_set_.has(kKey) || !slot || !slot->real.defined()) return false;
    const at::Tensor& r = slot->real;
    storage_ = r.storage();
    storage_offset_ = r.storage_offset();
    storage_access_should_throw_ = false;
    device_opt_ = r.device();
    set_sizes_and_strides(r.sizes(), r.strides());
    key_set_ = r.key_set();
    return true;
  }

 private:
  template <typename Version>
  c10::intrusive_ptr<TensorImpl> copy(Version&& version, bool allow_metadata_change) const {
    auto impl = c10::make_intrusive<PlaceholderImpl>(dtype(), slot);
    copy_tensor_metadata(this, impl.get(), std::forward<Version>(version), allow_metadata_change);
    made(impl);
    return impl;
  }
};

bool is_ph(const at::Tensor& t) { return t.defined() && t.key_set().has(kKey); }

PlaceholderImpl* impl_of(const at::Tensor& t) { return static_cast<PlaceholderImpl*>(t.unsafeGetTensorImpl()); }

struct TensorMeta {
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;  // Undefined: an undefined tensor

  bool operator==(const TensorMeta& o) const {
    return dtype == o.dtype && offset == o.offset && sizes == o.sizes && strides == o.strides;
  }

  bool same(const at::Tensor& t) const {
    return t.scalar_type() == dtype && t.sizes().equals(sizes) && t.strides().equals(strides) &&
           t.storage_offset() == offset;
  }
};

TensorMeta meta_of(const at::Tensor& t) {
  if (!t.defined()) return {};
  return {t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.scalar_type()};
}

at::Tensor make_ph(const TensorMeta& m) {
  if (m.dtype == c10::ScalarType::Undefined) return at::Tensor();
  auto impl = c10::make_intrusive<PlaceholderImpl>(c10::scalarTypeToTypeMeta(m.dtype), std::make_shared<Slot>());
  impl->set_sizes_and_strides(m.sizes, m.strides);
  impl->set_storage_offset(m.offset);
  made(impl);
  return at::Tensor(std::move(impl));
}

at::Tensor real_of(const at::Tensor& t) {
  if (!is_ph(t)) return t;
  const auto& slot = impl_of(t)->slot;
  TORCH_CHECK(slot && slot->real.defined(),
              "coexec: this tensor has no value: it comes from a captured step whose ops did not all run "
              "(an op failed, or the capture only taped them)");
  return slot->real;
}

// ``iv`` with ``f`` applied to each tensor in it (a tensor, a Tensor[], a Tensor?[]).
template <typename F>
c10::IValue map_tensors(const c10::IValue& iv, F f) {
  if (iv.isTensor()) return f(iv.toTensor());
  if (iv.isTensorList()) {
    std::vector<at::Tensor> l;
    for (const at::Tensor& t : iv.toTensorVector()) l.push_back(f(t));
    return l;
  }
  if (iv.isList()) {
    bool tensors = false;
    for (const c10::IValue& x : iv.toListRef()) tensors = tensors || x.isTensor();
    if (!tensors) return iv;
    c10::List<std::optional<at::Tensor>> l;
    for (const c10::IValue& x : iv.toListRef())
      l.push_back(x.isTensor() ? std::optional<at::Tensor>(f(x.toTensor())) : std::nullopt);
    return l;
  }
  return iv;
}

template <typename F>
void each_tensor(const c10::IValue& iv, F f) {
  if (iv.isTensor()) {
    f(iv.toTensor());
  } else if (iv.isList()) {  // (a Tensor[] is a list of IValues too)
    for (const c10::IValue& x : iv.toListRef())
      if (x.isTensor()) f(x.toTensor());
  }
}

at::Tensor to_meta(const at::Tensor& t) {
  if (!t.defined()) return t;
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta))
      .as_strided(t.sizes(), t.strides(), t.storage_offset());
}

// the argument that return ``r`` writes in place (``add_``, ``out=``), or -1
int written_arg(const c10::FunctionSchema& schema, size_t r) {
  const auto* alias = schema.returns()[r].alias_info();
  if (alias == nullptr || !alias->isWrite()) return -1;
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    const auto* ai = schema.arguments()[a].alias_info();
    if (ai != nullptr && ai->isWrite() && ai->beforeSets() == alias->beforeSets()) return static_cast<int>(a);
  }
  return -1;
}

// Must this op run now, on real tensors? (Python reads its result, or its output's shape
// depends on the data.)
bool must_run_now(const c10::OperatorHandle& op) {
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output)) return true;
  for (const auto& r : op.schema().returns()) {
    const auto kind = r.type()->kind();
    if (kind != c10::TypeKind::TensorType && kind != c10::TypeKind::ListType && kind != c10::TypeKind::OptionalType)
      return true;
  }
  return false;
}

// -- the cache -------------------------------------------------------------------------------

struct OutMeta {  // one return: a tensor, or a list of them
  bool is_list = false;
  std::vector<TensorMeta> tensors;
};

struct Where {
  const void* code;
  int lasti;
  bool operator==(const Where& o) const { return code == o.code && lasti == o.lasti; }
};

struct WhereHash {
  size_t operator()(const Where& w) const { return std::hash<const void*>()(w.code) ^ (size_t)w.lasti * 31; }
};

struct Key {
  const void* op;
  Where where;
  int64_t nth;  // ops this location made before in the step
  bool operator==(const Key& o) const { return op == o.op && where == o.where && nth == o.nth; }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<const void*>()(k.op) ^ (WhereHash()(k.where) << 1) ^ (size_t)k.nth * 1000003;
  }
};

struct Entry {
  std::vector<TensorMeta> inputs;   // the tensor arguments' metadata when cached
  std::vector<c10::IValue> consts;  // the other arguments (tensors as None)
  std::vector<OutMeta> outputs;
};

bool has_tensor(const c10::IValue& iv) {
  bool any = iv.isTensor() || iv.isTensorList();
  if (!any && iv.isList())
    for (const c10::IValue& x : iv.toListRef()) any = any || x.isTensor();
  return any;
}

bool any_tensor(const std::vector<c10::IValue>& args) {
  for (const auto& a : args)
    if (has_tensor(a)) return true;
  return false;
}

// The arguments that are not tensors (a view's shape, a slice's bounds, a dtype) are as much a
// part of what an op makes as its inputs' metadata. A number (Scalar, float: an alpha, a learning
// rate, Adam's step size) counts by its kind only where the op has tensor inputs: type promotion
// reads the kind, no output's shape reads the value, and such values change from step to step.
// A factory's numbers (``arange``'s end) make its shape, so there they count by value.
// Argument ``i`` as the cache keeps it (``tensors``: the op has tensor inputs; a tensor: None).
c10::IValue const_of(const c10::FunctionSchema& schema, size_t i, const c10::IValue& iv, bool tensors) {
  if (has_tensor(iv)) return c10::IValue();
  if (!tensors || !(iv.isDouble() || iv.isInt() || iv.isComplexDouble() || iv.isBool())) return iv;
  auto kind = schema.arguments()[i].type()->kind();
  if (kind == c10::TypeKind::OptionalType)
    kind = schema.arguments()[i].type()->castRaw<c10::OptionalType>()->getElementType()->kind();
  if (kind != c10::TypeKind::NumberType && kind != c10::TypeKind::FloatType && kind != c10::TypeKind::ComplexType)
    return iv;
  if (iv.isDouble()) return 0.0;
  if (iv.isInt()) return int64_t(0);
  if (iv.isComplexDouble()) return c10::complex<double>(0, 0);
  return false;
}

std::vector<c10::IValue> consts_of(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  const bool tensors = any_tensor(args);
  std::vector<c10::IValue> out;
  out.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) out.push_back(const_of(schema, i, args[i], tensors));
  return out;
}

bool same_const(const c10::IValue& a, const c10::IValue& b) {
  if (a.tagKind() != b.tagKind()) return false;
  if (a.isNone()) return true;
  if (a.isInt()) return a.toInt() == b.toInt();
  if (a.isBool()) return a.toBool() == b.toBool();
  if (a.isDouble()) {
    double x = a.toDouble(), y = b.toDouble();
    return std::memcmp(&x, &y, sizeof x) == 0;  // (-0.0 is not 0.0 here)
  }
  if (a.isIntList()) return a.toIntVector() == b.toIntVector();
  if (a.isGenerator()) return true;  // (which generator makes values, not shapes)
  if (a.isString()) return a.toStringRef() == b.toStringRef();
  if (a.isDevice()) return a.toDevice() == b.toDevice();
  std::ostringstream x, y;  // strings, devices, dtypes, scalars, other lists: as printed
  x << a;
  y << b;
  return x.str() == y.str();
}

void input_metas(const std::vector<c10::IValue>& args, std::vector<TensorMeta>& out) {
  for (const auto& iv : args)
    each_tensor(iv, [&out](const at::Tensor& t) {
      if (t.defined()) out.push_back(meta_of(t));
    });
}

bool matches(const Entry& e, const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  size_t k = 0;
  bool same = true;
  for (const auto& iv : args) {
    each_tensor(iv, [&](const at::Tensor& t) {
      if (!same || !t.defined()) return;
      same = k < e.inputs.size() && e.inputs[k++].same(t);
    });
    if (!same) return false;
  }
  if (k != e.inputs.size()) return false;
  const bool tensors = !e.inputs.empty() || any_tensor(args);
  for (size_t i = 0; i < args.size(); ++i)
    if (!has_tensor(args[i]) && !same_const(const_of(schema, i, args[i], tensors), e.consts[i])) return false;
  return true;
}

std::vector<OutMeta> out_metas(const torch::jit::Stack& stack, size_t nret) {
  std::vector<OutMeta> metas;
  for (size_t r = 0; r < nret; ++r) {
    const c10::IValue& iv = stack[stack.size() - nret + r];
    OutMeta m;
    if (iv.isTensorList()) {
      m.is_list = true;
      for (const at::Tensor& t : iv.toTensorVector()) m.tensors.push_back(meta_of(t));
    } else {
      m.tensors.push_back(meta_of(iv.isTensor() ? iv.toTensor() : at::Tensor()));
    }
    metas.push_back(std::move(m));
  }
  return metas;
}

// Does the op change a written argument's metadata (``unsqueeze_``, ``resize_``, an ``out=``
// that resizes)? Such an op runs now: Python sees the new shape at once.
bool changes_written(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                     const std::vector<OutMeta>& outs) {
  for (size_t r = 0; r < outs.size(); ++r) {
    const int w = written_arg(schema, r);
    if (w < 0 || !args[w].isTensor() || outs[r].is_list) continue;
    if (!outs[r].tensors[0].same(args[w].toTensor())) return true;
  }
  return false;
}

// Where nothing is computed, an op that changes a written argument's metadata (an ``out=`` that
// resizes: ``arange``'s) changes it here: a placeholder takes it, a real tensor is resized (its
// values are computed when the tape runs).
void take_written_metadata(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                           const std::vector<OutMeta>& outs, c10::DispatchKeySet included_before) {
  for (size_t r = 0; r < outs.size(); ++r) {
    const int w = written_arg(schema, r);
    if (w < 0 || !args[w].isTensor() || outs[r].is_list) continue;
    const at::Tensor& t = args[w].toTensor();
    const TensorMeta& m = outs[r].tensors[0];
    if (m.same(t)) continue;
    if (is_ph(t)) {
      t.unsafeGetTensorImpl()->set_sizes_and_strides(m.sizes, m.strides);
      t.unsafeGetTensorImpl()->set_storage_offset(m.offset);
    } else {
      at::AutoDispatchBelowADInplaceOrView below;
      c10::impl::ForceDispatchKeyGuard off(included_before, c10::impl::tls_local_dispatch_key_set().excluded_);
      at::Tensor(t).resize_(m.sizes).as_strided_(m.sizes, m.strides, m.offset);
    }
  }
}

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
  void exhume() {
    if (!buried_.load(std::memory_order_acquire)) return;
    std::vector<c10::IValue> dead;
    {
      std::lock_guard<std::mutex> g(grave_mu_);
      dead.swap(grave_);
      buried_.store(false, std::memory_order_release);
    }
  }

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
  std::mutex grave_mu_;
  std::vector<c10::IValue> grave_;  // arguments Python holds too, let go of under the GIL
  std::atomic<bool> buried_{false};
  bool idle_ = false;      // the worker sleeps: a push must wake it
  bool draining_ = false;  // a drain sleeps: the op that ends it must say so
  std::thread thread_;

  // An op's arguments that Python holds too (parameters, a batch) are not let go of here: the
  // last reference beside Python's lets go of the Python object, which takes the GIL, and the
  // skeleton holds it while it runs Python (every op would wait for it). The skeleton lets go of
  // them where it holds the GIL anyway (Capture::locate).
  void bury(TapeEntry& e) {
    std::vector<c10::IValue> held;
    for (Arg& a : e.args) {
      bool python = false;
      each_tensor(a.value, [&python](const at::Tensor& t) {
        python = python || (t.defined() && t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj() != nullptr);
      });
      if (python) held.push_back(std::move(a.value));
    }
    if (held.empty()) return;
    std::lock_guard<std::mutex> g(grave_mu_);
    for (auto& v : held) grave_.push_back(std::move(v));
    buried_.store(true, std::memory_order_release);
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
          busy_ns_.fetch_add(
              std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
              std::memory_order_relaxed);
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

// -- registration ----------------------------------------------------------------------------

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack);

// The kernel for PrivateUse3: a fallback for every op, and registered for each ATen op with a
// CompositeExplicitAutograd(NonFunctional) kernel too (those are used for every backend ahead of a
// fallback, and read data pointers), as a lazy backend's codegen does. Ops with a
// CompositeImplicitAutograd kernel decompose above autograd and are left alone. Once per process.
void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* fallback = new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&kernel>());
    static auto* ops = new torch::Library(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.getNamespace() != std::optional<std::string_view>("aten")) continue;
      auto op = dispatcher.findOp(name);
      if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
          op->hasKernelForDispatchKey(kKey))
        continue;
      if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
          !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
        continue;
      std::string full = name.name.substr(6);  // without "aten::"
      if (!name.overload_name.empty()) full += "." + name.overload_name;
      ops->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
    }
  });
}

// -- the capture -----------------------------------------------------------------------------

enum class Mode { kAsync, kReplay, kTape };

constexpr size_t kVariants = 16;  // cached variants per op and location

class Capture {
 public:
  Capture(const std::string& mode, int threads) {
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
    if (stepping_) end_quietly();
    if (worker_) {
      py::gil_scoped_release nogil;
      worker_.reset();
    }
    forget_places();
  }

  // The step starts: every op of this thread comes to the kernel until end().
  void begin() {
    Capture* none = nullptr;
    TORCH_CHECK(g_active.compare_exchange_strong(none, this),
                "coexec: a step is already being captured (one at a time, in one thread)");
    stepping_ = true;
    auto tls = c10::impl::tls_local_dispatch_key_set();
    included_before_ = tls.included_;
    tls.included_ = tls.included_ | c10::DispatchKeySet(kKey);
    c10::impl::_force_tls_local_dispatch_key_set(tls);
  }

  // The step ends: its ops are computed, placeholders still alive become their values, and a
  // failure on the worker is raised.
  void end() {
    TORCH_CHECK(stepping_, "coexec: end() without begin()");
    end_quietly();
    raise_failure();
    forget_places();
  }

  // Capture off and on again within a step, around what reads memory outside the dispatcher
  // (nested: printing calls tolist()).
  void pause() {
    if (stepping_ && paused_++ == 0) set_included(included_before_);
  }

  void resume() {
    if (stepping_ && paused_ > 0 && --paused_ == 0) set_included(included_before_ | c10::DispatchKeySet(kKey));
  }

  // The worker catches up (a failure is raised).
  void wait() {
    drain();
    raise_failure();
  }

  // A tensor's value now: the worker catches up (a real tensor may be waiting for a write too:
  // ``rand`` fills an ``empty`` made at once), and a placeholder becomes its value in place.
  void realize(const at::Tensor& t) {
    wait();
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

  // ops seen, misses (answered by running them, or by meta kernels where nothing is computed),
  // ops run at once, nanoseconds in the kernel, ops the tape holds, nanoseconds waiting for the
  // worker, nanoseconds the worker ran ops
  py::tuple counters() const {
    return py::make_tuple(ops_, misses_, run_now_, kernel_ns_, (int64_t)tape_.size(), wait_ns_,
                          worker_ ? worker_->busy_ns() : int64_t(0));
  }

  bool stepping() const { return stepping_; }

  void answer(const c10::OperatorHandle& op, torch::jit::Stack* stack);

  void note_made(const c10::intrusive_ptr<c10::TensorImpl>& impl) { made_.emplace_back(impl); }

  void add_kernel_ns(int64_t ns) { kernel_ns_ += ns; }

 private:
  Mode mode_ = Mode::kAsync;
  std::unique_ptr<Worker> worker_;
  bool stepping_ = false;
  int paused_ = 0;
  c10::DispatchKeySet included_before_;
  // per key, the variants seen (sizes that come back: a last batch, lengths drawn from a
  // range), the latest last; at most kVariants, the oldest dropped first
  std::unordered_map<Key, std::vector<Entry>, KeyHash> cache_;
  std::unordered_map<Where, int64_t, WhereHash> seen_;  // ops per location in this step
  std::vector<TapeEntry> tape_;                          // replay and tape modes
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> made_;  // this step's placeholders
  std::vector<std::pair<PyObject*, int>> places_;  // per op of the step: its code object (owned), offset
  int64_t ops_ = 0, misses_ = 0, run_now_ = 0, kernel_ns_ = 0, wait_ns_ = 0;

  // Wait for the worker, counting the time.
  void drain() {
    if (!worker_) return;
    const auto t0 = std::chrono::steady_clock::now();
    worker_->drain();
    wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  }

  static void set_included(c10::DispatchKeySet included) {
    auto tls = c10::impl::tls_local_dispatch_key_set();
    tls.included_ = included;
    c10::impl::_force_tls_local_dispatch_key_set(tls);
  }

  void end_quietly() {
    set_included(included_before_);
    stepping_ = false;
    paused_ = 0;
    g_active.store(nullptr);
    drain();
    if (worker_) {
      py::gil_scoped_acquire gil;
      worker_->exhume();
    }
    if (mode_ != Mode::kTape)
      for (auto& weak : made_) {
        auto impl = weak.lock();
        if (impl) static_cast<PlaceholderImpl*>(impl.get())->realize();
      }
    made_.clear();
    seen_.clear();
    if (mode_ == Mode::kTape) tape_.clear();
  }

  // The worker's first failure as a Python error naming the op and the line that called it;
  // the capture is usable again after it.
  void raise_failure() {
    if (!worker_) return;
    auto [index, message] = worker_->error();
    if (index < 0) return;
    worker_->clear_error();
    std::string where = "an unknown place";
    {
      py::gil_scoped_acquire gil;
      if (index < static_cast<int64_t>(places_.size()) && places_[index].first != nullptr) {
        auto* code = reinterpret_cast<PyCodeObject*>(places_[index].first);
        int line = PyCode_Addr2Line(code, places_[index].second);
        where = py::str(code->co_filename).cast<std::string>() + ":" + std::to_string(line) + " in " +
                py::str(code->co_name).cast<std::string>();
      }
    }
    forget_places();
    throw std::runtime_error("coexec: an op of the captured step failed when the executor ran it (op " +
                             std::to_string(index) + ", called at " + where + "): " + message);
  }

  void forget_places() {
    if (places_.empty()) return;
    py::gil_scoped_acquire gil;
    for (auto& p : places_) Py_XDECREF(p.first);
    places_.clear();
  }

  // The op's key, and its Python location kept under its index in the step (places_).
  Key locate(const c10::OperatorHandle& op) {
    Key k{&op, {nullptr, -1}, 0};
    {
      py::gil_scoped_acquire gil;
      PyFrameObject* f = PyEval_GetFrame();  // (borrowed)
      PyCodeObject* code = f ? PyFrame_GetCode(f) : nullptr;  // (a new reference: kept in places_)
      if (f) k.where = Where{code, PyFrame_GetLasti(f)};
      places_.emplace_back(reinterpret_cast<PyObject*>(code), k.where.lasti);
      if (worker_) worker_->exhume();
    }
    k.nth = seen_[k.where]++;
    return k;
  }

  const Entry& fill(const Key& key, const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                    const torch::jit::Stack& stack) {
    Entry e;
    input_metas(args, e.inputs);
    e.consts = consts_of(schema, args);
    e.outputs = out_metas(stack, schema.returns().size());
    auto& variants = cache_[key];
    for (auto it = variants.begin(); it != variants.end(); ++it)
      if (it->inputs == e.inputs && matches(*it, schema, args)) {
        variants.erase(it);  // (the same arguments made other outputs: a data-dependent op)
        break;
      }
    if (variants.size() >= kVariants) variants.erase(variants.begin());
    variants.push_back(std::move(e));
    return variants.back();
  }

  void run_now(const c10::OperatorHandle& op, const Key& key, std::vector<c10::IValue>& args,
               torch::jit::Stack* stack);
};

void made(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  if (Capture* c = g_active.load(std::memory_order_relaxed)) c->note_made(impl);
}

// As eager: wait for the ops before it, run it on real tensors, return real tensors (written
// placeholders take the new metadata).
void Capture::run_now(const c10::OperatorHandle& op, const Key& key, std::vector<c10::IValue>& args,
                      torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nret = schema.returns().size();
  ++run_now_;
  drain();
  raise_failure();
  for (const c10::IValue& a : args) stack->push_back(map_tensors(a, real_of));
  {
    at::AutoDispatchBelowADInplaceOrView below;
    c10::impl::ForceDispatchKeyGuard off(included_before_, c10::impl::tls_local_dispatch_key_set().excluded_);
    op.callBoxed(*stack);
  }
  fill(key, schema, args, *stack);
  for (size_t r = 0; r < nret; ++r) {
    const int w = written_arg(schema, r);
    if (w < 0) continue;
    c10::IValue& out = (*stack)[stack->size() - nret + r];
    if (args[w].isTensor() && is_ph(args[w].toTensor()) && out.isTensor()) {
      const at::Tensor& real = out.toTensor();
      auto* impl = impl_of(args[w].toTensor());
      impl->set_sizes_and_strides(real.sizes(), real.strides());
      impl->set_storage_offset(real.storage_offset());
    }
    out = args[w];
  }
}

void Capture::answer(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t nret = schema.returns().size();
  std::vector<c10::IValue> args(std::make_move_iterator(stack->end() - n), std::make_move_iterator(stack->end()));
  torch::jit::drop(*stack, n);
  ++ops_;
  for (const auto& a : args)  // (placeholders report the CPU: a CUDA step would be answered wrong)
    each_tensor(a, [&op](const at::Tensor& t) {
      TORCH_CHECK(!t.defined() || t.is_cpu() || t.is_meta(), "coexec: capture runs steps on the CPU only for now; ",
                  op.schema().name(), " got a tensor on ", t.device());
    });
  const int64_t index = static_cast<int64_t>(places_.size());  // (locate adds this op's place)
  const Key key = locate(op);
  const Entry* cached = nullptr;
  auto it = cache_.find(key);
  if (it != cache_.end())
    for (auto v = it->second.rbegin(); v != it->second.rend() && cached == nullptr; ++v)
      if (matches(*v, schema, args)) cached = &*v;
  if (mode_ == Mode::kAsync &&
      (cached == nullptr || must_run_now(op) || changes_written(schema, args, cached->outputs))) {
    if (cached == nullptr) ++misses_;
    run_now(op, key, args, stack);
    return;
  }
  if (cached == nullptr) {  // (nothing computed) the op's meta kernel says what it makes
    ++misses_;
    for (const c10::IValue& a : args) stack->push_back(map_tensors(a, to_meta));
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
    cached = &fill(key, schema, args, *stack);
    torch::jit::drop(*stack, nret);
  }
  if (mode_ != Mode::kAsync) take_written_metadata(schema, args, cached->outputs, included_before_);
  TapeEntry entry;
  entry.op = &op;
  entry.grad_mode = c10::GradMode::is_enabled();
  entry.index = index;
  entry.args.reserve(n);
  for (const auto& a : args) entry.args.push_back(arg_of(a));
  for (size_t r = 0; r < nret; ++r) {
    const int w = written_arg(schema, r);
    const OutMeta& m = cached->outputs[r];
    c10::IValue out;
    std::vector<std::shared_ptr<Slot>> slots;
    if (w >= 0) {
      out = args[w];  // (its slot already has the value it will have)
    } else if (m.is_list) {
      std::vector<at::Tensor> l;
      for (const TensorMeta& t : m.tensors) {
        l.push_back(make_ph(t));
        slots.push_back(slot_of(l.back()));
      }
      out = l;
    } else {
      at::Tensor t = make_ph(m.tensors[0]);
      slots.push_back(slot_of(t));
      out = t;
    }
    entry.outs.push_back(std::move(slots));
    stack->push_back(std::move(out));
  }
  if (worker_) {
    worker_->push(std::move(entry));
  } else {
    tape_.push_back(std::move(entry));
  }
}

// Outside a step (a placeholder that outlived its step without a value is an error there), a
// placeholder stands for its value.
void outside(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t nret = schema.returns().size();
  std::vector<c10::IValue> args(stack->end() - n, stack->end());
  torch::jit::drop(*stack, n);
  for (const c10::IValue& a : args) stack->push_back(map_tensors(a, real_of));
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.callBoxed(*stack);
  }
  for (size_t r = 0; r < nret; ++r) {
    const int w = written_arg(schema, r);
    if (w >= 0) (*stack)[stack->size() - nret + r] = args[w];
  }
}

const bool g_debug = std::getenv("COEXEC_CAPTURE_DEBUG") != nullptr;  // each op to stderr (read once)

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  Capture* c = g_active.load(std::memory_order_relaxed);
  if (g_debug) std::cerr << "coexec capture: " << op.schema().name() << "." << op.schema().overload_name() << (c ? "" : " (outside a step)") << std::endl;
  if (c == nullptr) {
    outside(op, stack);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  c->answer(op, stack);
  // (kernel_ns_ is the capture's, updated only on its step's thread)
  c->add_kernel_ns(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace

void bind_capture(py::module_& m) {
  py::class_<Capture>(m, "Capture")
      .def(py::init<const std::string&, int>(), py::arg("mode"), py::arg("threads"))
      .def("begin", &Capture::begin)
      .def("end", &Capture::end)
      .def("pause", &Capture::pause)
      .def("resume", &Capture::resume)
      .def("realize", &Capture::realize)
      .def("wait", &Capture::wait)
      .def("replay", &Capture::replay)
      .def_property_readonly("stepping", &Capture::stepping)
      .def_property_readonly("counters", &Capture::counters);
  m.def("is_placeholder", &is_ph);
}

}  // namespace coexec
