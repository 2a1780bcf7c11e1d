// Capture's placeholders (capture.cpp): TensorImpls without storage whose value a Slot receives, and
// the helpers that walk an op's tensor arguments.
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

namespace coexec {
namespace {

namespace py = pybind11;

constexpr auto kKey = c10::DispatchKey::PrivateUse3;

// -- placeholders ----------------------------------------------------------------------------

struct Recipe;  // (capture_worker.h) the op that made a value, kept so that it can be made again
struct Parked;  // (capture_worker.h) a storage parked in the host pool, its values with it

struct Slot {
  at::Tensor real;  // the value, once computed (empty again while dropped: `recipe` remakes it)
  uint64_t id = 0;  // its number among the capture's placeholders (capture_blocks.h; 0: none)
  int32_t holders = 0;  // placeholders alive with this slot
  // under a memory plan (capture_worker.h, Drops) or a budget's guard: how to make the value
  // again once dropped
  std::shared_ptr<Recipe> recipe;
  int64_t dropped_bytes = 0;  // what its value held when the guard dropped it (its remake's bytes)
  const void* dropped_from = nullptr;  // the storage it had then (a described step's log: StepLog::remade)
  int64_t remake_cost = 0;    // its op's modeled cost (the guard's cost of making it again: guard_cost)
  std::atomic<int32_t> recipe_holds{0};  // guard's recipes holding it (Worker::bury)
  // under a memory plan that offloads: its storage in the host pool (`real` empty until it comes back)
  std::shared_ptr<Parked> parked;
  // the storage its placeholders hold until they become the value: one per value, without data.
  // C++ outside the dispatcher compares storages without asking for data: DDP's reducer asks
  // ``grad.is_alias_of(bucket_view)`` in its autograd hook, and a storage-less tensor's null
  // StorageImpl made c10::isSharedStorageAlias dereference null (a SIGSEGV); one storage for
  // all of them made a placeholder .grad alias the placeholder views of buckets the reducer
  // rebuilt in a step (its assert). Placeholders alias where they share a value (a view of one
  // does not: it is another value).
  c10::Storage identity;
};

// The slot's value, made again first if a memory plan dropped it (capture_worker.h).
const at::Tensor& value_of(Slot& s);

// While a step is described (capture_worker.h, StepLog): the step's op count when each value's
// last placeholder died, by value number (the program let go of it then).
std::atomic<bool> g_describing{false};
std::atomic<int64_t> g_issued{0};  // ops the described step has issued so far
std::mutex g_released_mu;
std::vector<std::pair<uint64_t, int64_t>> g_released;

// In the thread whose step is captured (async mode): the values its placeholders let go of last,
// for the worker to let go of in turn (Capture::answer hands them over with the next op), so
// buffers the worker allocated are freed in its thread, not across threads (the allocator's
// arena locks; the worker could not reuse its own chunks). The slots themselves are freed here,
// where they are allocated.
thread_local std::vector<at::Tensor>* t_trash = nullptr;
// Under a budget's guard: slots whose last placeholder died while something else held them (a
// guard's recipe, an op not run yet), handed to the worker the same way; there a value that
// can be made again is dropped (Worker::bury), as eager would free it.
thread_local std::vector<std::weak_ptr<Slot>>* t_banish = nullptr;
// The step follows a memory plan or runs under a budget's guard: the worker holds weak pointers
// to the step's slots (kept values, guarded values, recipes' inputs) and may lock one at any time,
// then read or drop its value. The step's thread then never touches a dying slot's value (retire).
thread_local bool t_shared_slots = false;

class Capture;
std::atomic<Capture*> g_active{nullptr};  // the capture a step is running under, if any
struct PlaceholderImpl;
void made(PlaceholderImpl* impl);
void gone(PlaceholderImpl* impl);

// A storage of no bytes and no data (a null data pointer; writing through it throws).
c10::Storage no_data_storage() {
  auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), 0,
                                                    at::DataPtr(nullptr, c10::Device(c10::kCPU)), nullptr, false);
  impl->set_throw_on_mutable_data_ptr();
  return c10::Storage(std::move(impl));
}

struct PlaceholderImpl : c10::TensorImpl {
  std::shared_ptr<Slot> slot;
  // (the step's live placeholders are a list through them: Live below)
  PlaceholderImpl* live_prev = nullptr;
  PlaceholderImpl* live_next = nullptr;
  bool live = false;

  PlaceholderImpl(caffe2::TypeMeta dtype, std::shared_ptr<Slot> s)
      : TensorImpl(c10::DispatchKeySet(kKey), dtype, c10::Device(c10::kCPU)), slot(std::move(s)) {
    if (slot) {
      if (!slot->identity) slot->identity = no_data_storage();  // (the value's first placeholder)
      storage_ = slot->identity;
      ++slot->holders;
    }
  }

  c10::intrusive_ptr<TensorImpl> shallow_copy_and_detach(const c10::VariableVersion& version,
                                                         bool allow_metadata_change) const override {
    return copy(version, allow_metadata_change);
  }

  c10::intrusive_ptr<TensorImpl> shallow_copy_and_detach(c10::VariableVersion&& version,
                                                         bool allow_metadata_change) const override {
    return copy(std::move(version), allow_metadata_change);
  }

  void shallow_copy_from(const c10::intrusive_ptr<TensorImpl>& impl) override {
    // (``t.data = t``: Module._apply does ``p.grad.data = p.grad.to(device)``, which is the same
    // tensor; letting go of the slot first lost it, and the tensor never got its value)
    if (impl.get() == this) return;
    TensorImpl::shallow_copy_from(impl);
    if (auto* other = dynamic_cast<PlaceholderImpl*>(impl.get())) {
      let_go_of_slot();
      slot = other->slot;
      if (slot) ++slot->holders;
    }
  }

  // (intrusive_ptr calls release_resources only where weak references remain: the destructor
  // lets go of the slot in the other case)
  ~PlaceholderImpl() override { retire(); }

  void release_resources() override {
    retire();
    TensorImpl::release_resources();
  }

  // Out of the live list, and the slot let go of; a value nothing else holds goes to the worker
  // (t_trash). (use_count 1: nothing else holds the slot, and, with no weak pointer to it on the
  // worker (t_shared_slots), nothing can take it now; the fence orders the read of its value
  // after the worker's last release of it, which wrote the value. Under a plan or a guard the
  // worker may lock the slot between the count and the move, and both threads wrote `real`: a
  // tensor released twice, its memory reused under a live value)
  void retire() {
    gone(this);
    if (t_trash != nullptr && !t_shared_slots && slot && slot.use_count() == 1) {
      std::atomic_thread_fence(std::memory_order_acquire);
      if (slot->real.defined()) t_trash->push_back(std::move(slot->real));
    } else if (t_banish != nullptr && slot && slot->holders == 1) {
      t_banish->push_back(slot);
    }
    let_go_of_slot();
  }

  // This placeholder no longer holds its slot (described: the program let go of the value if
  // it was the last).
  void let_go_of_slot() {
    if (slot && --slot->holders == 0 && g_describing.load(std::memory_order_relaxed) && slot->id != 0) {
      std::lock_guard<std::mutex> g(g_released_mu);
      g_released.emplace_back(slot->id, g_issued.load(std::memory_order_relaxed));
    }
    slot.reset();
  }

  // Take these sizes, strides and offset (an op that changed a written argument's metadata).
  void take_metadata(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t offset) {
    set_sizes_and_strides(sizes, strides);
    set_storage_offset(offset);
  }

  // Be an inference tensor (no autograd keys, no version counter) or a normal one. A new
  // placeholder is what the mode makes it; a view must be what its base is, as eager's view
  // TensorImpl takes its base's keys (a view of a parameter under torch.inference_mode() is a
  // normal tensor, whose view metadata autograd then sets: an inference one raised there).
  void set_inference(bool inference) {
    if (inference == is_inference()) return;
    if (inference) {
      key_set_ = key_set_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
      set_version_counter(c10::VariableVersion(c10::VariableVersion::DISABLED));
    } else {
      key_set_ = key_set_ | c10::getAutogradRelatedKeySetFromBackend(key_set_.highestBackendKey());
      set_version_counter(c10::VariableVersion(0));
    }
  }

  // Hold a storage of `nbytes` whose data cannot be read or written (a shape placeholder,
  // capture_shapes.h): a kernel run on it fails where it would touch data, and finds a storage
  // where it asks for one (TensorIterator's overlap checks).
  void hold_no_data(int64_t nbytes) {
    auto s = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                   at::DataPtr(nullptr, c10::Device(c10::kCPU)), nullptr, false);
    s->release_data_and_set_meta_custom_data_ptr_error_msg_("coexec: a shape placeholder has no data");
    s->set_throw_on_mutable_data_ptr();
    storage_ = c10::Storage(std::move(s));
    storage_access_should_throw_ = false;
  }

  // Become the value: its storage, offset and dispatch keys. False: it has none (yet).
  bool realize() {
    if (!key_set_.has(kKey) || !slot) return false;
    const at::Tensor& r = value_of(*slot);
    if (!r.defined()) return false;
    storage_ = r.storage();
    storage_offset_ = r.storage_offset();
    storage_access_should_throw_ = false;
    device_opt_ = r.device();
    set_sizes_and_strides(r.sizes(), r.strides());
    // (the worker's value is a normal tensor: an inference placeholder stays one, as eager's)
    const bool inference = is_inference();
    key_set_ = r.key_set();
    if (inference) key_set_ = key_set_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    return true;
  }

 private:
  template <typename Version>
  c10::intrusive_ptr<TensorImpl> copy(Version&& version, bool allow_metadata_change) const {
    auto impl = c10::make_intrusive<PlaceholderImpl>(dtype(), slot);
    copy_tensor_metadata(this, impl.get(), std::forward<Version>(version), allow_metadata_change);
    made(impl.get());
    return impl;
  }
};

// The placeholders made during the step being captured that are still alive (each becomes its
// value at the step's end): a list through them, so a dead one is freed at once (a weak
// reference per placeholder kept their memory to the step's end: the allocator's slow path per
// op, and a burst of frees at the end). Locked: a placeholder may die in another thread.
class Live {
 public:
  void add(PlaceholderImpl* p) {
    std::lock_guard<std::mutex> g(mu_);
    p->live = true;
    p->live_prev = nullptr;
    p->live_next = head_;
    if (head_ != nullptr) head_->live_prev = p;
    head_ = p;
  }

  void remove(PlaceholderImpl* p) {
    std::lock_guard<std::mutex> g(mu_);
    if (!p->live) return;
    if (p->live_prev != nullptr) p->live_prev->live_next = p->live_next;
    else head_ = p->live_next;
    if (p->live_next != nullptr) p->live_next->live_prev = p->live_prev;
    p->live = false;
    p->live_prev = p->live_next = nullptr;
  }

  // Call f on each and empty the list.
  template <typename F>
  void take_all(F f) {
    std::lock_guard<std::mutex> g(mu_);
    for (PlaceholderImpl* p = head_; p != nullptr;) {
      PlaceholderImpl* next = p->live_next;
      f(p);
      p->live = false;
      p->live_prev = p->live_next = nullptr;
      p = next;
    }
    head_ = nullptr;
  }

 private:
  std::mutex mu_;
  PlaceholderImpl* head_ = nullptr;
};

Live g_live;

// A placeholder was made (kept in the list while a step is captured) or dies.
void made(PlaceholderImpl* impl) {
  if (g_active.load(std::memory_order_relaxed) != nullptr) g_live.add(impl);
}

void gone(PlaceholderImpl* impl) {
  if (impl->live) g_live.remove(impl);
}

int64_t ns_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

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

// A placeholder with metadata `m` whose value `slot` receives (a new slot if none).
at::Tensor make_ph(const TensorMeta& m, std::shared_ptr<Slot> slot = nullptr) {
  if (m.dtype == c10::ScalarType::Undefined) return at::Tensor();
  if (!slot) slot = std::make_shared<Slot>();
  auto impl = c10::make_intrusive<PlaceholderImpl>(c10::scalarTypeToTypeMeta(m.dtype), std::move(slot));
  impl->take_metadata(m.sizes, m.strides, m.offset);
  made(impl.get());
  return at::Tensor(std::move(impl));
}

at::Tensor real_of(const at::Tensor& t) {
  if (!is_ph(t)) return t;
  const auto& slot = impl_of(t)->slot;
  TORCH_CHECK(slot && value_of(*slot).defined(),
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

// Is return ``r`` a view (its alias set without a write: ``t``, ``view``), and of which
// inference tensors or normal ones? -1: not a view (or of no tensor argument), 1: of an
// inference tensor, 0: of a normal one.
int view_of_inference(const c10::FunctionSchema& schema, size_t r, c10::ArrayRef<c10::IValue> args) {
  const auto* alias = schema.returns()[r].alias_info();
  if (alias == nullptr || alias->isWrite()) return -1;
  auto sets = alias->beforeSets();  // (a list of views, ``split``'s Tensor(a)[]: its elements')
  for (const auto& c : alias->containedTypes()) sets.insert(c.beforeSets().begin(), c.beforeSets().end());
  for (size_t a = 0; a < schema.arguments().size() && a < args.size(); ++a) {
    const auto* ai = schema.arguments()[a].alias_info();
    if (ai == nullptr || ai->isWrite() || !args[a].isTensor()) continue;
    bool shared = false;
    for (const auto& set : ai->beforeSets()) shared = shared || sets.count(set) > 0;
    if (!shared) continue;
    const at::Tensor& t = args[a].toTensor();
    if (t.defined()) return t.is_inference() ? 1 : 0;
  }
  return -1;
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

// Is this op a collective (or its wait), of torch.distributed's namespaces?
bool is_collective(const c10::OperatorHandle& op) {
  const std::string& name = op.schema().name();
  return name.rfind("c10d::", 0) == 0 || name.rfind("_c10d_functional", 0) == 0 || name.rfind("c10d_functional::", 0) == 0;
}

// Must this op run now, on real tensors? (Python reads its result, or its output's shape
// depends on the data, or it is a collective: every rank issues them in one order, once each,
// on the values; the worker would run it behind the program, a plan could run it again. Its
// launch does not wait for it: gloo reduces on its own threads while the step goes on.)
bool must_run_now(const c10::OperatorHandle& op) {
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output)) return true;
  if (is_collective(op)) return true;
  for (const auto& r : op.schema().returns()) {
    const auto kind = r.type()->kind();
    if (kind != c10::TypeKind::TensorType && kind != c10::TypeKind::ListType && kind != c10::TypeKind::OptionalType)
      return true;
  }
  return false;
}

}  // namespace
}  // namespace coexec
