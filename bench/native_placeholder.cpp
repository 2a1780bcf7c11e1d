// A probe, not part of coexec: what intercepting every ATen op in C++ would cost the skeleton
// (issue 16, deliverable 2). Placeholders here are TensorImpls without storage whose dispatch
// key is PrivateUse3 (PrivateUse1 is what out-of-tree device backends take; the device is still
// reported as the CPU), so autograd, views and the dispatcher
// all work above them as they do for any backend; one boxed kernel answers every op on them.
// It finds the op's output metadata either by running the op's meta kernel or, once seen,
// from a cache keyed by (op, Python code object, bytecode offset, occurrence): the "per-location
// cache of the ATen ops a call produced" the issue describes. Each op goes on a tape (what an
// executor would run). Two modes:
//  * tape: nothing is computed while the step runs; replay() runs the tape on real tensors
//    afterwards, to check it against eager;
//  * async: a C++ worker thread, which never takes the GIL, runs each op as it is taped, below
//    autograd, in the order the kernel saw them; an op the cache cannot answer (first sight,
//    other input metadata, a data-dependent output shape, a Python value such as ``.item()``)
//    waits for the worker and runs at once on real tensors, as eager would.
// Built and driven by bench/native_skeleton_floor.py.
#include <torch/extension.h>
#include <pybind11/stl.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <frameobject.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

// -- placeholders ------------------------------------------------------------------------
// where a placeholder's value goes once computed; autograd detaches by shallow copies
// (``detach``, views' metadata, saved tensors), which must share it
struct Slot {
  at::Tensor real;
};

struct PlaceholderImpl : c10::TensorImpl {
  std::shared_ptr<Slot> slot;

  PlaceholderImpl(caffe2::TypeMeta dtype, std::shared_ptr<Slot> s)
      : TensorImpl(c10::DispatchKeySet(c10::DispatchKey::PrivateUse3), dtype, c10::Device(c10::kCPU)),
        slot(std::move(s)) {}

  c10::intrusive_ptr<TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version, bool allow_metadata_change) const override {
    return copy(version, allow_metadata_change);
  }

  c10::intrusive_ptr<TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version, bool allow_metadata_change) const override {
    return copy(std::move(version), allow_metadata_change);
  }

  void shallow_copy_from(const c10::intrusive_ptr<TensorImpl>& impl) override {
    TensorImpl::shallow_copy_from(impl);
    if (auto* other = dynamic_cast<PlaceholderImpl*>(impl.get())) slot = other->slot;
  }

 private:
  template <typename Version>
  c10::intrusive_ptr<TensorImpl> copy(Version&& version, bool allow_metadata_change) const {
    auto impl = c10::make_intrusive<PlaceholderImpl>(dtype(), slot);
    copy_tensor_metadata(this, impl.get(), std::forward<Version>(version), allow_metadata_change);
    return impl;
  }
};

at::Tensor make_ph(c10::IntArrayRef sizes, c10::IntArrayRef strides, c10::ScalarType dtype,
                   at::Tensor real = at::Tensor()) {
  auto slot = std::make_shared<Slot>();
  slot->real = std::move(real);
  auto impl = c10::make_intrusive<PlaceholderImpl>(c10::scalarTypeToTypeMeta(dtype), std::move(slot));
  impl->set_sizes_and_strides(sizes, strides);
  return at::Tensor(std::move(impl));
}

bool is_ph(const at::Tensor& t) { return t.defined() && t.key_set().has(c10::DispatchKey::PrivateUse3); }

PlaceholderImpl* impl_of(const at::Tensor& t) { return dynamic_cast<PlaceholderImpl*>(t.unsafeGetTensorImpl()); }

at::Tensor real_of(const at::Tensor& t) {
  if (!is_ph(t)) return t;
  PlaceholderImpl* impl = impl_of(t);
  TORCH_CHECK(impl != nullptr && impl->slot->real.defined(), "a placeholder without a value");
  return impl->slot->real;
}

// ``iv`` with ``f`` applied to each tensor in it: a tensor, a ``Tensor[]``, a ``Tensor?[]``
// (``index``); anything else as it is
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

c10::IValue real_iv(const c10::IValue& iv) { return map_tensors(iv, real_of); }

at::Tensor to_meta(const at::Tensor& t) {
  return t.defined() ? at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta)) : t;
}

// a placeholder whose value is the real tensor ``t``
at::Tensor holding(const at::Tensor& t) {
  return t.defined() ? make_ph(t.sizes(), t.strides(), t.scalar_type(), t) : t;
}

// the argument that return ``r`` is, written in place (``add_``, ``out=``), or -1
int written_arg(const c10::FunctionSchema& schema, size_t r) {
  const auto* alias = schema.returns()[r].alias_info();
  if (alias == nullptr || !alias->isWrite()) return -1;
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    const auto* ai = schema.arguments()[a].alias_info();
    if (ai != nullptr && ai->isWrite() && ai->beforeSets() == alias->beforeSets()) return static_cast<int>(a);
  }
  return -1;
}

// -- the metadata cache -----------------------------------------------------------------
struct TensorMeta {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;  // Undefined: an undefined tensor
};

TensorMeta meta_of(const at::Tensor& t) {
  return t.defined() ? TensorMeta{t.sizes().vec(), t.strides().vec(), t.scalar_type()}
                     : TensorMeta{{}, {}, c10::ScalarType::Undefined};
}

struct OutMeta {  // one return: a tensor, or a list of them
  bool is_list;
  std::vector<TensorMeta> tensors;
};

// an op's place in the step: the op, the Python location of the call, and how many ops that
// location has made before in this step (the backward's ops all come from one location, the
// call into the engine, so the count tells them apart: the real skeleton follows the graph)
struct Key {
  const void* op;
  const void* code;
  int lasti;
  int64_t nth;
  bool operator==(const Key& o) const {
    return op == o.op && code == o.code && lasti == o.lasti && nth == o.nth;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<const void*>()(k.op) ^ (std::hash<const void*>()(k.code) << 1) ^
           (size_t)k.lasti * 31 ^ (size_t)k.nth * 1000003;
  }
};
struct Where {
  const void* code;
  int lasti;
  bool operator==(const Where& o) const { return code == o.code && lasti == o.lasti; }
};
struct WhereHash {
  size_t operator()(const Where& w) const { return std::hash<const void*>()(w.code) ^ (size_t)w.lasti * 31; }
};

struct Entry {
  std::vector<TensorMeta> inputs;  // the tensor arguments' metadata when it was cached
  std::vector<c10::IValue> consts;  // its other arguments (tensors as None)
  std::vector<OutMeta> outputs;
};

// the arguments that are not tensors (a view's shape, a slice's bounds, a dtype): as much a part
// of what an op makes as its inputs' metadata (the dynamic-size programs caught the cache
// without them: a ``view`` answered with a shape from another step's sizes)
// A number argument (``Scalar``, ``float``: an ``alpha``, a learning rate, Adam's step size)
// counts by its kind only: type promotion reads the kind, no output's shape reads the value,
// and such values change from step to step (coexec feeds them as numbers).
std::vector<c10::IValue> consts_of(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  std::vector<c10::IValue> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& iv = args[i];
    bool tensor = iv.isTensor() || iv.isTensorList();
    if (!tensor && iv.isList())
      for (const c10::IValue& x : iv.toListRef()) tensor = tensor || x.isTensor();
    if (tensor) {
      out.push_back(c10::IValue());
      continue;
    }
    auto kind = schema.arguments()[i].type()->kind();
    if (kind == c10::TypeKind::OptionalType)
      kind = schema.arguments()[i].type()->castRaw<c10::OptionalType>()->getElementType()->kind();
    const bool number =
        kind == c10::TypeKind::NumberType || kind == c10::TypeKind::FloatType || kind == c10::TypeKind::ComplexType;
    if (number && iv.isDouble()) {
      out.push_back(0.0);
    } else if (number && iv.isInt()) {
      out.push_back(int64_t(0));
    } else if (number && iv.isComplexDouble()) {
      out.push_back(c10::complex<double>(0, 0));
    } else if (number && iv.isBool()) {
      out.push_back(false);
    } else {
      out.push_back(iv);
    }
  }
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
  if (a.isGenerator()) return a.isSameIdentity(b);
  std::ostringstream x, y;  // strings, devices, dtypes, scalars, other lists: as printed
  x << a;
  y << b;
  return x.str() == y.str();
}

bool consts_match(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                  const std::vector<c10::IValue>& want) {
  auto got = consts_of(schema, args);
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i)
    if (!same_const(got[i], want[i])) return false;
  return true;
}

bool g_use_cache = true, g_keep_tape = false, g_async = false;
int64_t g_ops = 0, g_misses = 0, g_run_now = 0;
std::unordered_map<Key, Entry, KeyHash> g_cache;
std::unordered_map<Where, int64_t, WhereHash> g_seen;  // ops per location in this step

// the metadata of the tensor arguments (list elements included), in order
void input_metas(const std::vector<c10::IValue>& args, std::vector<TensorMeta>& out) {
  for (const auto& iv : args) {
    if (iv.isTensor()) {
      if (iv.toTensor().defined()) out.push_back(meta_of(iv.toTensor()));
    } else if (iv.isList()) {
      for (const c10::IValue& x : iv.toListRef())
        if (x.isTensor() && x.toTensor().defined()) out.push_back(meta_of(x.toTensor()));
    }
  }
}

// do the tensor arguments have the metadata the entry was cached with? (what the real
// skeleton must check before it answers from the cache; it also checks which values they are)
bool inputs_match(const std::vector<c10::IValue>& args, const std::vector<TensorMeta>& want) {
  size_t k = 0;
  auto same = [&want, &k](const at::Tensor& t) {
    if (!t.defined()) return true;
    if (k >= want.size()) return false;
    const TensorMeta& m = want[k++];
    return t.scalar_type() == m.dtype && t.sizes().equals(m.sizes) && t.strides().equals(m.strides);
  };
  for (const auto& iv : args) {
    if (iv.isTensor()) {
      if (!same(iv.toTensor())) return false;
    } else if (iv.isList()) {
      for (const c10::IValue& x : iv.toListRef())
        if (x.isTensor() && !same(x.toTensor())) return false;
    }
  }
  return k == want.size();
}

std::vector<OutMeta> out_metas(const torch::jit::Stack& stack, size_t nret) {
  std::vector<OutMeta> metas;
  for (size_t r = 0; r < nret; ++r) {
    const c10::IValue& iv = stack[stack.size() - nret + r];
    if (iv.isTensorList()) {
      OutMeta m{true, {}};
      for (const at::Tensor& t : iv.toTensorVector()) m.tensors.push_back(meta_of(t));
      metas.push_back(std::move(m));
    } else {
      metas.push_back({false, {meta_of(iv.isTensor() ? iv.toTensor() : at::Tensor())}});
    }
  }
  return metas;
}

Key location(const c10::OperatorHandle& op) {
  PyGILState_STATE st = PyGILState_Ensure();
  PyFrameObject* f = PyEval_GetFrame();  // borrowed
  Key k{&op, nullptr, -1, 0};
  if (f != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(f);
    k.code = code;
    k.lasti = PyFrame_GetLasti(f);
    Py_DECREF(code);
  }
  PyGILState_Release(st);
  k.nth = g_seen[Where{k.code, k.lasti}]++;
  return k;
}

// -- the tape and the worker ---------------------------------------------------------------
// A taped op holds its placeholders' slots, not the placeholders: autograd lets a gradient be
// stolen into ``.grad`` only when nothing else holds its TensorImpl (AccumulateGrad's use
// count check), so a queue holding them would change which ops the backward makes, and when.
struct Arg {
  c10::IValue value;                         // the argument, placeholders left undefined
  std::vector<std::shared_ptr<Slot>> slots;  // per tensor in it: its placeholder's slot, or null
};

Arg arg_of(const c10::IValue& iv) {
  auto slot_of = [](const at::Tensor& t) { return is_ph(t) ? impl_of(t)->slot : nullptr; };
  if (iv.isTensor()) {
    const at::Tensor& t = iv.toTensor();
    return is_ph(t) ? Arg{at::Tensor(), {slot_of(t)}} : Arg{iv, {}};
  }
  if (iv.isTensorList()) {
    Arg a;
    std::vector<at::Tensor> l;
    for (const at::Tensor& t : iv.toTensorVector()) {
      a.slots.push_back(slot_of(t));
      l.push_back(is_ph(t) ? at::Tensor() : t);
    }
    a.value = l;
    return a;
  }
  if (iv.isList()) {
    bool tensors = false;
    for (const c10::IValue& x : iv.toListRef()) tensors = tensors || x.isTensor();
    if (!tensors) return Arg{iv, {}};
    Arg a;
    c10::List<std::optional<at::Tensor>> l;
    for (const c10::IValue& x : iv.toListRef()) {
      const bool ph = x.isTensor() && is_ph(x.toTensor());
      a.slots.push_back(ph ? slot_of(x.toTensor()) : nullptr);
      l.push_back(x.isTensor() && !ph ? std::optional<at::Tensor>(x.toTensor()) : std::nullopt);
    }
    a.value = l;
    return a;
  }
  return Arg{iv, {}};
}

c10::IValue real_arg(const Arg& a) {
  if (a.slots.empty()) return a.value;
  if (a.value.isTensorList()) {
    std::vector<at::Tensor> l = a.value.toTensorVector();
    for (size_t i = 0; i < l.size(); ++i)
      if (a.slots[i]) l[i] = a.slots[i]->real;
    return l;
  }
  if (a.value.isList()) {
    c10::List<std::optional<at::Tensor>> l;
    const auto& ref = a.value.toListRef();
    for (size_t i = 0; i < ref.size(); ++i) {
      if (a.slots[i]) {
        l.push_back(a.slots[i]->real);
      } else {
        l.push_back(ref[i].isTensor() ? std::optional<at::Tensor>(ref[i].toTensor()) : std::nullopt);
      }
    }
    return l;
  }
  return a.slots[0]->real;
}

struct TapeEntry {
  const c10::OperatorHandle* op;
  std::vector<Arg> args;
  std::vector<std::vector<std::shared_ptr<Slot>>> outs;  // per return: its placeholders' slots
};

TapeEntry entry_of(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                   const std::vector<c10::IValue>& outs) {
  TapeEntry e{&op, {}, {}};
  for (const auto& a : args) e.args.push_back(arg_of(a));
  for (const auto& o : outs) {
    std::vector<std::shared_ptr<Slot>> slots;
    if (o.isTensor() && is_ph(o.toTensor())) {
      slots.push_back(impl_of(o.toTensor())->slot);
    } else if (o.isTensorList()) {
      for (const at::Tensor& t : o.toTensorVector()) slots.push_back(is_ph(t) ? impl_of(t)->slot : nullptr);
    }
    e.outs.push_back(std::move(slots));
  }
  return e;
}

// run one op on real tensors, below autograd (as an executor does); its outputs' values
// go to their placeholders' slots
void run_entry(const TapeEntry& e) {
  at::AutoDispatchBelowADInplaceOrView below;
  torch::jit::Stack stack;
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

std::vector<TapeEntry> g_tape;  // tape mode

// Ops cross from the skeleton's thread to the worker through a locked queue. Neither side sleeps
// at once when there is nothing to do: the worker polls for a while before it waits on the
// condition variable (a wake-up per op costs a system call on both sides), and so does a drain.
constexpr auto kSpin = std::chrono::microseconds(200);

struct Worker {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<TapeEntry> queue;
  std::atomic<int64_t> pushed{0}, done{0};
  std::string error;
  std::thread thread;
  bool idle = false;      // the worker sleeps: a push must wake it
  bool draining = false;  // the skeleton sleeps in a drain: the op that ends it must say so

  void start() {
    if (!thread.joinable()) thread = std::thread([this] { loop(); });
  }

  void push(TapeEntry e) {
    bool wake;
    {
      std::lock_guard<std::mutex> g(mu);
      queue.push_back(std::move(e));
      pushed.fetch_add(1, std::memory_order_release);
      wake = idle;
    }
    if (wake) cv.notify_all();
  }

  TapeEntry next() {  // the next op, polling for a while, then sleeping
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (;;) {
      {
        std::unique_lock<std::mutex> g(mu);
        if (queue.empty() && std::chrono::steady_clock::now() > until) {
          idle = true;
          cv.wait(g, [this] { return !queue.empty(); });
          idle = false;
        }
        if (!queue.empty()) {
          TapeEntry e = std::move(queue.front());
          queue.pop_front();
          return e;
        }
      }
      std::this_thread::yield();
    }
  }

  void loop() {
    at::set_num_threads(1);
    for (;;) {
      TapeEntry e = next();
      try {
        if (error.empty()) run_entry(e);
      } catch (const std::exception& ex) {
        error = ex.what();
      }
      e = TapeEntry();  // (its tensors go before the op counts as done)
      bool tell;
      {
        std::lock_guard<std::mutex> g(mu);
        done.fetch_add(1, std::memory_order_release);
        tell = draining;
      }
      if (tell) cv.notify_all();
    }
  }

  // wait until every op pushed so far has run (without the GIL: torch's bindings mostly
  // release it before an op reaches the kernel, but not always)
  void drain() {
    if (PyGILState_Check()) {
      pybind11::gil_scoped_release nogil;
      wait_done();
    } else {
      wait_done();
    }
    TORCH_CHECK(error.empty(), "the probe's worker failed: ", error);
  }

  void wait_done() {
    const int64_t want = pushed.load(std::memory_order_acquire);
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (done.load(std::memory_order_acquire) < want) {
      if (std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> g(mu);
        draining = true;
        cv.wait(g, [this, want] { return done.load(std::memory_order_acquire) >= want; });
        draining = false;
        return;
      }
      std::this_thread::yield();
    }
  }
};

Worker* g_worker = nullptr;

Worker& worker() {
  if (g_worker == nullptr) {
    g_worker = new Worker();  // (left running at exit: a probe)
    g_worker->start();
  }
  return *g_worker;
}

// must this op run now, on real tensors? (a Python value, or an output whose shape depends on
// the data)
bool must_run_now(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output)) return true;
  for (const auto& r : schema.returns()) {
    const auto kind = r.type()->kind();
    if (kind != c10::TypeKind::TensorType && kind != c10::TypeKind::ListType &&
        kind != c10::TypeKind::OptionalType)
      return true;
  }
  return false;
}

// The capture mode: PrivateUse3 in this thread's included dispatch keys sends every op to the
// kernel, those on real tensors too (a batch, parameters, factories such as ``randn``), as a
// dispatch mode would, but without Python. Off while the kernel runs an op for real.
// (Saved and restored whole: removing a per-backend key from a key set leaves its backend bit,
// which still makes PrivateUse3 the highest backend of every op.)
bool g_capturing = false;
c10::DispatchKeySet g_included_before;  // this thread's included keys before begin_step

struct IncludedOff {  // the included keys as before the step, the excluded ones as they are now
  c10::impl::ForceDispatchKeyGuard guard;
  IncludedOff()
      : guard(g_capturing ? g_included_before : c10::impl::tls_local_dispatch_key_set().included_,
              c10::impl::tls_local_dispatch_key_set().excluded_) {}
};

// -- the kernel ----------------------------------------------------------------------------
void answer(const c10::OperatorHandle& op, torch::jit::Stack* stack);

int64_t g_kernel_ns = 0;  // time spent in the kernel (what it costs per op beside PyTorch's own)

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto t0 = std::chrono::steady_clock::now();
  answer(op, stack);
  g_kernel_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

const bool g_debug = std::getenv("PROBE_DEBUG") != nullptr;  // print each op (read once)

// the cache's entry for ``key``, made of the op's arguments and the outputs now on the stack
const std::vector<OutMeta>& cache(const Key& key, const c10::FunctionSchema& schema,
                                  const std::vector<c10::IValue>& args, const torch::jit::Stack& stack) {
  Entry& e = g_cache[key];
  e.inputs.clear();
  input_metas(args, e.inputs);
  e.consts = consts_of(schema, args);
  e.outputs = out_metas(stack, schema.returns().size());
  return e.outputs;
}

void answer(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t nret = schema.returns().size();
  std::vector<c10::IValue> args(stack->end() - n, stack->end());
  torch::jit::drop(*stack, n);
  ++g_ops;
  Key key = location(op);
  const std::vector<OutMeta>* cached = nullptr;
  if (g_use_cache) {
    auto it = g_cache.find(key);
    if (it != g_cache.end() && inputs_match(args, it->second.inputs) && consts_match(schema, args, it->second.consts))
      cached = &it->second.outputs;
  }
  if (g_async && (cached == nullptr || must_run_now(op))) {
    // as eager: wait for the ops before it, run it on real tensors, hand out placeholders
    // that already have their values (or the Python value itself)
    ++g_run_now;
    if (g_debug)
      std::cerr << "run now: " << schema.name() << "." << schema.overload_name() << (cached ? "" : " (not cached)")
                << std::endl;
    worker().drain();
    for (const c10::IValue& a : args) stack->push_back(real_iv(a));
    {
      at::AutoDispatchBelowADInplaceOrView below;
      IncludedOff off;
      op.callBoxed(*stack);
    }
    cache(key, schema, args, *stack);
    for (size_t r = 0; r < nret; ++r) {
      c10::IValue& iv = (*stack)[stack->size() - nret + r];
      const int w = written_arg(schema, r);
      iv = w >= 0 ? args[w] : map_tensors(iv, holding);
    }
    return;
  }
  if (cached == nullptr) {  // the op's meta kernel says what it makes
    ++g_misses;
    for (const c10::IValue& a : args) stack->push_back(map_tensors(a, to_meta));
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
    cached = &cache(key, schema, args, *stack);
    torch::jit::drop(*stack, nret);
  }
  std::vector<c10::IValue> outs(nret);
  auto make = [](const TensorMeta& t) {
    return t.dtype == c10::ScalarType::Undefined ? at::Tensor() : make_ph(t.sizes, t.strides, t.dtype);
  };
  for (size_t r = 0; r < nret; ++r) {
    const int w = written_arg(schema, r);
    const OutMeta& m = (*cached)[r];
    if (w >= 0) {
      outs[r] = args[w];
    } else if (m.is_list) {
      std::vector<at::Tensor> l;
      for (const TensorMeta& t : m.tensors) l.push_back(make(t));
      outs[r] = l;
    } else {
      outs[r] = make(m.tensors[0]);
    }
  }
  if (g_debug) {
    std::cerr << schema.name() << "." << schema.overload_name() << " ->";
    for (auto& o : outs)
      if (o.isTensor() && o.toTensor().defined()) std::cerr << " " << o.toTensor().sizes() << o.toTensor().strides();
    std::cerr << std::endl;
  }
  TapeEntry entry = entry_of(op, args, outs);
  if (g_async) {
    worker().push(std::move(entry));
  } else {
    g_tape.push_back(std::move(entry));
  }
  for (auto& o : outs) stack->push_back(std::move(o));
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse3, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// Ops with a CompositeExplicitAutograd(NonFunctional) kernel use it for every backend key,
// ahead of a backend fallback, and those kernels read data pointers: the probe's kernel is
// registered for each of them on PrivateUse3 (as a lazy backend's codegen does). Ops with a
// CompositeImplicitAutograd kernel decompose above autograd and are left alone.
int64_t install() {
  static std::unique_ptr<torch::Library> lib;
  if (lib) return 0;
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse3, __FILE__,
                                         __LINE__);
  int64_t n = 0;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.getNamespace() != std::optional<std::string_view>("aten")) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse3)) continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    std::string full = name.name.substr(6);  // without "aten::"
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    ++n;
  }
  return n;
}

// the placeholder for a real tensor (with it as its value: a fed input)
at::Tensor placeholder_like(const at::Tensor& t) { return make_ph(t.sizes(), t.strides(), t.scalar_type(), t); }

// ops seen, ops answered by meta kernels (misses), ops run at once (async mode: run_now),
// nanoseconds spent in the kernel
std::map<std::string, int64_t> counters() {
  return {{"ops", g_ops}, {"misses", g_misses}, {"run_now", g_run_now}, {"kernel_ns", g_kernel_ns}};
}

// mode: "tape" (a step's tape dropped at its end), "replay" (kept for replay()), "async"
void reset(bool use_cache, const std::string& mode) {
  TORCH_CHECK(mode == "tape" || mode == "replay" || mode == "async", "mode: tape, replay or async");
  if (g_async) worker().drain();
  g_use_cache = use_cache;
  g_keep_tape = mode == "replay";
  g_async = mode == "async";
  g_cache.clear();
  g_tape.clear();
  g_seen.clear();
  g_ops = g_misses = g_run_now = g_kernel_ns = 0;
}

// the step's start in capture mode: every op of this thread goes to the kernel until end_step
void begin_step() {
  TORCH_CHECK(!g_capturing, "begin_step twice");
  g_capturing = true;
  auto tls = c10::impl::tls_local_dispatch_key_set();
  g_included_before = tls.included_;
  tls.included_ = tls.included_ | c10::DispatchKeySet(c10::DispatchKey::PrivateUse3);
  c10::impl::_force_tls_local_dispatch_key_set(tls);
}

// the step's end: ops are counted per location from the next one on (async: waits for the
// worker, as a step's end does)
void end_step() {
  if (g_capturing) {
    auto tls = c10::impl::tls_local_dispatch_key_set();
    tls.included_ = g_included_before;
    c10::impl::_force_tls_local_dispatch_key_set(tls);
    g_capturing = false;
  }
  if (g_async) worker().drain();
  if (!g_keep_tape) g_tape.clear();
  g_seen.clear();
}

// Run the tape on real tensors in the order the kernel saw the ops and give every placeholder
// its value: the check that the kernel saw all an eager step does. Returns the ops run.
int64_t replay() {
  int64_t n = 0;
  for (const TapeEntry& e : g_tape) {
    run_entry(e);
    ++n;
  }
  g_tape.clear();
  return n;
}

// capture off and on again within a step (around what reads a value in Python: ``numpy()``
// detaches through the dispatcher, which would capture the detach)
void pause_capture() {
  if (!g_capturing) return;
  auto tls = c10::impl::tls_local_dispatch_key_set();
  tls.included_ = g_included_before;
  c10::impl::_force_tls_local_dispatch_key_set(tls);
}

void resume_capture() {
  if (!g_capturing) return;
  auto tls = c10::impl::tls_local_dispatch_key_set();
  tls.included_ = g_included_before | c10::DispatchKeySet(c10::DispatchKey::PrivateUse3);
  c10::impl::_force_tls_local_dispatch_key_set(tls);
}

// a placeholder's value, once the worker has computed it (a real tensor is itself)
at::Tensor value(const at::Tensor& t) {
  if (!is_ph(t)) return t;
  if (g_async) worker().drain();
  return real_of(t);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("value", &value);
  m.def("pause", &pause_capture);
  m.def("resume", &resume_capture);
  m.def("is_placeholder", &is_ph);
  m.def("placeholder_like", &placeholder_like);
  m.def("counters", &counters);
  m.def("reset", &reset);
  m.def("begin_step", &begin_step);
  m.def("end_step", &end_step);
  m.def("install", &install);
  m.def("replay", &replay);
  m.def("real_of", &real_of);
}
