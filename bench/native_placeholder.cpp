// A probe, not part of coexec: what intercepting every ATen op in C++ would cost the skeleton
// (issue 16, deliverable 2). Placeholders here are TensorImpls without storage whose dispatch
// key is PrivateUse1 (device still reported as the CPU), so autograd, views and the dispatcher
// all work above them as they do for any backend; one boxed fallback kernel answers every op on
// them. It finds the op's output metadata either by running the op's meta kernel or, once seen,
// from a cache keyed by (op, Python code object, bytecode offset): the "per-location cache of
// the ATen ops a call produced" the issue describes. Each op is appended to a tape (what an
// executor would run). Nothing is computed while the step runs; replay() runs the tape on real
// tensors afterwards, to check it against eager. Built and driven by
// bench/native_skeleton_floor.py.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <frameobject.h>

#include <cstdlib>
#include <iostream>
#include <unordered_map>
#include <vector>

namespace {

struct TensorMeta {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;  // Undefined: an undefined tensor
};
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
std::unordered_map<Where, int64_t, WhereHash> g_seen;  // ops per location in this step

bool g_use_cache = true;
int64_t g_ops = 0, g_meta_runs = 0;
struct Entry {
  std::vector<TensorMeta> inputs;  // the tensor arguments' metadata when it was cached
  std::vector<OutMeta> outputs;
};
std::unordered_map<Key, Entry, KeyHash> g_cache;

// the metadata of the tensor arguments (list elements included), in order
void input_metas(const std::vector<c10::IValue>& args, std::vector<TensorMeta>& out) {
  auto add = [&out](const at::Tensor& t) {
    if (t.defined()) out.push_back({t.sizes().vec(), t.strides().vec(), t.scalar_type()});
  };
  for (const auto& iv : args) {
    if (iv.isTensor()) {
      add(iv.toTensor());
    } else if (iv.isList()) {
      for (const c10::IValue& x : iv.toListRef())
        if (x.isTensor()) add(x.toTensor());
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
struct TapeEntry {
  const c10::OperatorHandle* op;
  std::vector<c10::IValue> args, outs;
};
std::vector<TapeEntry> g_tape;

bool g_keep_tape = false;  // keep the tape for replay() instead of dropping it at the step's end

// where a placeholder's value goes once computed (for the replay check); autograd detaches by
// shallow copies (``detach``, views' metadata, saved tensors), which must share it
struct Slot {
  at::Tensor real;
};

struct PlaceholderImpl : c10::TensorImpl {
  std::shared_ptr<Slot> slot;

  PlaceholderImpl(caffe2::TypeMeta dtype, std::shared_ptr<Slot> s)
      : TensorImpl(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype, c10::Device(c10::kCPU)),
        slot(std::move(s)) {}

  c10::intrusive_ptr<TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version, bool allow_metadata_change) const override {
    auto impl = c10::make_intrusive<PlaceholderImpl>(dtype(), slot);
    copy_tensor_metadata(this, impl.get(), version, allow_metadata_change);
    return impl;
  }

  c10::intrusive_ptr<TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version, bool allow_metadata_change) const override {
    auto impl = c10::make_intrusive<PlaceholderImpl>(dtype(), slot);
    copy_tensor_metadata(this, impl.get(), std::move(version), allow_metadata_change);
    return impl;
  }

  void shallow_copy_from(const c10::intrusive_ptr<TensorImpl>& impl) override {
    TensorImpl::shallow_copy_from(impl);
    if (auto* other = dynamic_cast<PlaceholderImpl*>(impl.get())) slot = other->slot;
  }
};

at::Tensor make_ph(c10::IntArrayRef sizes, c10::IntArrayRef strides, c10::ScalarType dtype) {
  auto impl = c10::make_intrusive<PlaceholderImpl>(c10::scalarTypeToTypeMeta(dtype), std::make_shared<Slot>());
  impl->set_sizes_and_strides(sizes, strides);
  return at::Tensor(std::move(impl));
}

at::Tensor to_meta(const at::Tensor& t) {
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
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

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t start = stack->size() - n;
  std::vector<c10::IValue> args(stack->begin() + start, stack->end());
  ++g_ops;
  Key key = location(op);
  const std::vector<OutMeta>* cached = nullptr;
  if (g_use_cache) {
    auto it = g_cache.find(key);
    if (it != g_cache.end() && inputs_match(args, it->second.inputs)) cached = &it->second.outputs;
  }
  const size_t nret = schema.returns().size();
  std::vector<c10::IValue> outs(nret);
  if (cached == nullptr) {
    ++g_meta_runs;
    for (size_t i = start; i < stack->size(); ++i) {
      auto& iv = (*stack)[i];
      if (iv.isTensor()) {
        const auto& t = iv.toTensor();
        if (t.defined()) iv = to_meta(t);
      } else if (iv.isTensorList()) {
        std::vector<at::Tensor> l;
        for (const at::Tensor& t : iv.toTensorVector()) l.push_back(t.defined() ? to_meta(t) : t);
        iv = l;
      } else if (iv.isList()) {  // Tensor?[] (index)
        c10::List<std::optional<at::Tensor>> l;
        bool tensors = false;
        for (const c10::IValue& x : iv.toListRef()) {
          if (x.isTensor()) {
            tensors = true;
            l.push_back(to_meta(x.toTensor()));
          } else if (x.isNone()) {
            l.push_back(std::nullopt);
          }
        }
        if (tensors) iv = l;
      }
    }
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
    std::vector<OutMeta> metas;
    for (size_t r = 0; r < nret; ++r) {
      const c10::IValue& iv = (*stack)[stack->size() - nret + r];
      auto meta_of = [](const at::Tensor& t) {
        return t.defined() ? TensorMeta{t.sizes().vec(), t.strides().vec(), t.scalar_type()}
                           : TensorMeta{{}, {}, c10::ScalarType::Undefined};
      };
      if (iv.isTensorList()) {
        OutMeta m{true, {}};
        for (const at::Tensor& t : iv.toTensorVector()) m.tensors.push_back(meta_of(t));
        metas.push_back(std::move(m));
      } else {
        metas.push_back({false, {meta_of(iv.isTensor() ? iv.toTensor() : at::Tensor())}});
      }
    }
    torch::jit::drop(*stack, nret);
    Entry& e = g_cache[key];
    e.inputs.clear();
    input_metas(args, e.inputs);
    e.outputs = std::move(metas);
    cached = &e.outputs;
  } else {
    torch::jit::drop(*stack, n);
  }
  for (size_t r = 0; r < nret; ++r) {
    const auto* alias = schema.returns()[r].alias_info();
    if (alias != nullptr && alias->isWrite()) {  // in place / out=: the written argument itself
      for (size_t a = 0; a < n; ++a) {
        const auto* ai = schema.arguments()[a].alias_info();
        if (ai != nullptr && ai->isWrite() && ai->beforeSets() == alias->beforeSets()) {
          outs[r] = args[a];
          break;
        }
      }
      continue;
    }
    const OutMeta& m = (*cached)[r];
    auto make = [](const TensorMeta& t) {
      return t.dtype == c10::ScalarType::Undefined ? at::Tensor() : make_ph(t.sizes, t.strides, t.dtype);
    };
    if (m.is_list) {
      std::vector<at::Tensor> l;
      for (const TensorMeta& t : m.tensors) l.push_back(make(t));
      outs[r] = l;
    } else {
      outs[r] = make(m.tensors[0]);
    }
  }
  if (std::getenv("PROBE_DEBUG") != nullptr) {
    std::cerr << schema.name() << "." << schema.overload_name() << " ->";
    for (auto& o : outs)
      if (o.isTensor() && o.toTensor().defined())
        std::cerr << " " << o.toTensor().sizes() << o.toTensor().strides();
    std::cerr << std::endl;
  }
  g_tape.push_back(TapeEntry{&op, std::move(args), outs});
  for (auto& o : outs) stack->push_back(std::move(o));
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// the placeholder for a real tensor (its metadata; its value is not kept)
PlaceholderImpl* impl_of(const at::Tensor& t) {
  return dynamic_cast<PlaceholderImpl*>(t.unsafeGetTensorImpl());
}

void remember(const at::Tensor& ph, const at::Tensor& real) { impl_of(ph)->slot->real = real; }

at::Tensor placeholder_like(const at::Tensor& t) {
  at::Tensor p = make_ph(t.sizes(), t.strides(), t.scalar_type());
  if (g_keep_tape) remember(p, t);
  return p;
}

bool is_ph(const at::Tensor& t) { return t.defined() && t.key_set().has(c10::DispatchKey::PrivateUse1); }

at::Tensor real_of(const at::Tensor& t) {
  if (!is_ph(t)) return t;
  PlaceholderImpl* impl = impl_of(t);
  TORCH_CHECK(impl != nullptr && impl->slot->real.defined(), "replay: a placeholder without a value");
  return impl->slot->real;
}

c10::IValue real_iv(const c10::IValue& iv) {
  if (iv.isTensor()) return real_of(iv.toTensor());
  if (iv.isTensorList()) {
    std::vector<at::Tensor> l;
    for (const at::Tensor& t : iv.toTensorVector()) l.push_back(real_of(t));
    return l;
  }
  if (iv.isList()) {
    bool tensors = false;
    for (const c10::IValue& x : iv.toListRef()) tensors = tensors || x.isTensor();
    if (!tensors) return iv;
    c10::List<std::optional<at::Tensor>> l;
    for (const c10::IValue& x : iv.toListRef())
      l.push_back(x.isTensor() ? std::optional<at::Tensor>(real_of(x.toTensor())) : std::nullopt);
    return l;
  }
  return iv;
}

void bind(const c10::IValue& ph, const c10::IValue& real) {
  if (ph.isTensor()) {
    const at::Tensor& p = ph.toTensor();
    if (is_ph(p)) remember(p, real.toTensor());
  } else if (ph.isTensorList()) {
    auto ps = ph.toTensorVector();
    auto rs = real.toTensorVector();
    for (size_t i = 0; i < ps.size(); ++i) bind(ps[i], rs[i]);
  }
}

// Run the tape on real tensors, below autograd (as an executor does), in the order the kernel
// saw the ops, and give every placeholder its value: the check that the kernel saw all an
// eager step does. Returns the number of ops run.
int64_t replay() {
  at::AutoDispatchBelowADInplaceOrView below;
  int64_t n = 0;
  for (const TapeEntry& e : g_tape) {
    torch::jit::Stack stack;
    for (const c10::IValue& a : e.args) stack.push_back(real_iv(a));
    e.op->callBoxed(stack);
    for (size_t r = 0; r < e.outs.size(); ++r) bind(e.outs[r], stack[r]);
    ++n;
  }
  g_tape.clear();
  return n;
}

std::vector<int64_t> counters() { return {g_ops, g_meta_runs, (int64_t)g_tape.size()}; }

void reset(bool use_cache, bool keep_tape) {
  g_use_cache = use_cache;
  g_keep_tape = keep_tape;
  g_cache.clear();
  g_tape.clear();
  g_seen.clear();
  g_ops = g_meta_runs = 0;
}

void clear_tape() {  // the step's end
  if (!g_keep_tape) g_tape.clear();
  g_seen.clear();
}

// Ops with a CompositeExplicitAutograd(NonFunctional) kernel use it for every backend key,
// ahead of a backend fallback, and those kernels read data pointers: the probe's kernel is
// registered for each of them on PrivateUse1 (as a lazy backend's codegen does). Ops with a
// CompositeImplicitAutograd kernel decompose above autograd and are left alone.
int64_t install() {
  static std::unique_ptr<torch::Library> lib;
  if (lib) return 0;
  lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  int64_t n = 0;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.getNamespace() != std::optional<std::string_view>("aten")) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("placeholder_like", &placeholder_like);
  m.def("counters", &counters);
  m.def("reset", &reset);
  m.def("clear_tape", &clear_tape);
  m.def("install", &install);
  m.def("replay", &replay);
  m.def("real_of", &real_of);
}
