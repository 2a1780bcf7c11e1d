// One executor Run (executor/stream.py) as a boxed dispatcher call: converted once, while the
// GIL is held, so that the engine (engine.h) runs it without Python.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grave.h"
#include "live_bytes.h"

namespace coexec {

namespace py = pybind11;
using torch::jit::Stack;

// How an argument is converted from Python: the common types directly, the rest by
// torch::jit::toIValue (what the Python binding of a schema does for every argument).
enum ArgBase : uint8_t { kTensor, kInt, kFloat, kBool, kNumber, kIntList, kTensorList, kOptTensorList, kOther };

struct ArgKind {
  ArgBase base;
  bool optional;  // None is an answer too
};

inline ArgKind kind_of(const c10::TypePtr& type) {
  using c10::TypeKind;
  bool optional = type->kind() == TypeKind::OptionalType;
  c10::TypePtr t = optional ? type->castRaw<c10::OptionalType>()->getElementType() : type;
  switch (t->kind()) {
    case TypeKind::TensorType:
      return {kTensor, optional};
    case TypeKind::IntType:
      return {kInt, optional};
    case TypeKind::FloatType:
      return {kFloat, optional};
    case TypeKind::BoolType:
      return {kBool, optional};
    case TypeKind::NumberType:
      return {kNumber, optional};
    case TypeKind::ListType: {
      auto elem = t->castRaw<c10::ListType>()->getElementType();
      if (elem->kind() == TypeKind::IntType) return {kIntList, optional};
      if (optional) return {kOther, false};
      if (elem->kind() == TypeKind::TensorType) return {kTensorList, false};
      if (elem->kind() == TypeKind::OptionalType &&
          elem->castRaw<c10::OptionalType>()->getElementType()->kind() == TypeKind::TensorType)
        return {kOptTensorList, false};
      return {kOther, false};
    }
    default:
      return {kOther, false};
  }
}

struct OutVariant;

// An ATen overload the dispatcher knows (looked up once per OpOverload).
struct Op {
  c10::OperatorHandle handle;
  py::object func;  // the OpOverload: named in errors, reported back after a failed out= try
  std::vector<ArgKind> kinds;  // per schema argument
  // its out= variants met so far, by their OpOverload (found once, not at every op)
  std::unordered_map<PyObject*, std::shared_ptr<const OutVariant>> outs;
};

// An op's out= variant, as the arena calls it: per argument of the variant, -1 - k for the
// op's output k, else the index of the op's own argument.
struct OutVariant {
  std::shared_ptr<Op> op;
  std::vector<int64_t> map;
};

struct Ref {
  size_t index;  // position in the schema's arguments
  int64_t item;  // index in a tensor-list argument, or -1
  int64_t vid;
};

// A Run, ready to call: no Python objects in it, so it can be run and destroyed without the
// GIL.
struct Step {
  std::shared_ptr<Op> op;
  Stack stack;  // the arguments, value references still to fill in
  std::vector<Ref> refs;
  std::vector<int64_t> outs;
  std::vector<std::pair<int64_t, int64_t>> moves;  // (old, new) value ids of written arguments
  std::shared_ptr<const OutVariant> out;  // when planned into the arena
  std::vector<ArenaOut> arena;
  bool grad_mode = true;
  bool keep_result = false;
  int64_t op_index = -1;
};

// (leaked on purpose: it holds Python objects, which must not be released after the
// interpreter has finalized, nor by the engine's thread)
inline std::unordered_map<PyObject*, std::shared_ptr<Op>>& op_cache() {
  static auto* cache = new std::unordered_map<PyObject*, std::shared_ptr<Op>>();
  return *cache;
}

// The dispatcher's handle for an OpOverload, or null (not an ATen-style operator).
inline std::shared_ptr<Op> find_op(const py::handle& func) {
  auto& cache = op_cache();
  auto it = cache.find(func.ptr());
  if (it != cache.end()) return it->second;
  std::shared_ptr<Op> found;
  if (py::hasattr(func, "_schema") && py::hasattr(func, "_overloadname")) {
    auto name = py::str(func.attr("_schema").attr("name")).cast<std::string>();
    auto overload = py::str(func.attr("_overloadname")).cast<std::string>();
    if (overload == "default") overload = "";
    auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
    if (handle.has_value()) {
      found = std::make_shared<Op>(Op{*handle, py::reinterpret_borrow<py::object>(func), {}});
      for (const auto& formal : handle->schema().arguments()) found->kinds.push_back(kind_of(formal.real_type()));
    }
  }
  cache.emplace(func.ptr(), found);
  return found;
}

// `op`'s out= variant `func` with the names of its output arguments, or null (it cannot be
// called so: the Python path knows how).
inline std::shared_ptr<const OutVariant> out_variant(Op& op, const py::handle& func, const py::handle& names) {
  auto it = op.outs.find(func.ptr());
  if (it != op.outs.end()) return it->second;
  std::shared_ptr<const OutVariant> found;
  auto out_op = find_op(func);
  if (out_op) {
    auto names_ = py::cast<std::vector<std::string>>(names);
    std::vector<int64_t> map;
    for (const auto& arg : out_op->handle.schema().arguments()) {
      auto named = std::find(names_.begin(), names_.end(), arg.name());
      if (named != names_.end()) {
        map.push_back(-1 - (named - names_.begin()));
        continue;
      }
      auto index = op.handle.schema().argumentIndexWithName(arg.name());
      if (!index.has_value()) {
        map.clear();
        break;
      }
      map.push_back(static_cast<int64_t>(*index));
    }
    if (!map.empty()) found = std::make_shared<const OutVariant>(OutVariant{out_op, std::move(map)});
  }
  op.outs.emplace(py::reinterpret_borrow<py::object>(func).release().ptr(), found);  // (kept, as op_cache)
  return found;
}

inline std::vector<int64_t> int_list(PyObject* seq) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<int64_t> out(n);
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = PyLong_AsLongLong(items[i]);
  return out;
}

inline bool is_number(PyObject* x) {
  return PyBool_Check(x) || PyLong_Check(x) || PyFloat_Check(x) || PyComplex_Check(x);
}

// A Python number where the schema wants a tensor is a wrapped-number tensor, as the Python
// binding makes it. Made here, in C++, so that no Python object owns it: the engine's thread
// lets go of it without the GIL.
inline at::Tensor wrapped_number(PyObject* x) {
  at::Tensor t = at::scalar_to_tensor(torch::jit::toIValue(x, c10::NumberType::get()).toScalar());
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// One Python argument as the IValue its schema type wants. `holes`: a value reference goes in
// this list item later (left an undefined tensor, or None in a list of optional tensors).
inline c10::IValue to_ivalue(PyObject* x, ArgKind kind, const c10::Argument& formal,
                             const std::vector<int64_t>& holes) {
  if (kind.optional && x == Py_None) return c10::IValue();
  switch (kind.base) {
    case kTensor:
      if (THPVariable_Check(x)) return THPVariable_Unpack(x);
      if (is_number(x)) return wrapped_number(x);
      break;
    case kInt:
      if (PyLong_CheckExact(x)) return static_cast<int64_t>(PyLong_AsLongLong(x));
      break;
    case kFloat:
      if (PyFloat_CheckExact(x)) return PyFloat_AS_DOUBLE(x);
      if (PyLong_CheckExact(x)) return static_cast<double>(PyLong_AsLongLong(x));
      break;
    case kBool:
      if (PyBool_Check(x)) return x == Py_True;
      break;
    case kNumber:
      if (PyBool_Check(x)) return x == Py_True;
      if (PyLong_CheckExact(x)) return static_cast<int64_t>(PyLong_AsLongLong(x));
      if (PyFloat_CheckExact(x)) return PyFloat_AS_DOUBLE(x);
      break;
    case kIntList: {
      if (!PyList_Check(x) && !PyTuple_Check(x)) break;
      Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
      PyObject** items = PySequence_Fast_ITEMS(x);
      c10::List<int64_t> list;
      list.reserve(n);
      bool plain = true;
      for (Py_ssize_t i = 0; i < n && plain; ++i) {
        plain = PyLong_CheckExact(items[i]);
        if (plain) list.push_back(PyLong_AsLongLong(items[i]));
      }
      if (plain) return list;
      break;
    }
    case kTensorList:
    case kOptTensorList: {
      if (!PyList_Check(x) && !PyTuple_Check(x)) break;
      Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
      PyObject** items = PySequence_Fast_ITEMS(x);
      auto hole = [&](Py_ssize_t i) { return std::find(holes.begin(), holes.end(), i) != holes.end(); };
      if (kind.base == kTensorList) {
        c10::List<at::Tensor> list;
        list.reserve(n);
        for (Py_ssize_t i = 0; i < n; ++i) {
          if (hole(i)) {
            list.push_back(at::Tensor());
          } else if (THPVariable_Check(items[i])) {
            list.push_back(THPVariable_Unpack(items[i]));
          } else {
            throw std::invalid_argument("not a tensor in a Tensor[] argument");
          }
        }
        return list;
      }
      c10::List<std::optional<at::Tensor>> list;
      list.reserve(n);
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (hole(i) || items[i] == Py_None) {
          list.push_back(std::nullopt);
        } else if (THPVariable_Check(items[i])) {
          list.push_back(THPVariable_Unpack(items[i]));
        } else {
          throw std::invalid_argument("not a tensor in a Tensor?[] argument");
        }
      }
      return list;
    }
    case kOther:
      break;
  }
  return torch::jit::toIValue(py::handle(x), formal.real_type());
}

// Attribute names of a Run, interned once.
struct RunFields {
  PyObject *func, *args, *kwargs, *refs, *outs, *moves, *grad_mode, *keep_result, *op_index, *arena_out;
  RunFields() {
    auto name = [](const char* s) { return PyUnicode_InternFromString(s); };
    func = name("func");
    args = name("args");
    kwargs = name("kwargs");
    refs = name("refs");
    outs = name("outs");
    moves = name("moves");
    grad_mode = name("grad_mode");
    keep_result = name("keep_result");
    op_index = name("op_index");
    arena_out = name("arena_out");
  }
};

inline const RunFields& run_fields() {
  static auto* fields = new RunFields();  // (leaked, as op_cache)
  return *fields;
}

inline py::object field(const py::handle& run, PyObject* name) {
  PyObject* v = PyObject_GetAttr(run.ptr(), name);
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

// A Run instruction as a Step: its arguments converted by its schema (the value references
// left as holes until the step runs). False: the engine cannot call it (the caller runs it in
// Python).
inline bool convert(const py::handle& run, const py::set& not_in_place, Step& step) {
  const RunFields& f = run_fields();
  step.op = find_op(field(run, f.func));
  if (!step.op) return false;
  const auto& schema = step.op->handle.schema();
  const auto& formals = schema.arguments();
  const size_t n_formals = formals.size();
  py::object args = field(run, f.args);
  py::object kwargs = field(run, f.kwargs);
  py::object refs = field(run, f.refs);
  if (!PyList_Check(args.ptr()) && !PyTuple_Check(args.ptr())) return false;
  if (!PyDict_Check(kwargs.ptr()) || !PyTuple_Check(refs.ptr())) return false;
  // the value references: whole arguments (holes[i] == {-1}) or items of list arguments
  std::vector<std::vector<int64_t>> holes(n_formals);
  for (Py_ssize_t r = 0; r < PyTuple_GET_SIZE(refs.ptr()); ++r) {
    PyObject* ref = PyTuple_GET_ITEM(refs.ptr(), r);
    PyObject* arg = PyTuple_GET_ITEM(ref, 0);
    int64_t item = PyLong_AsLongLong(PyTuple_GET_ITEM(ref, 1));
    int64_t vid = PyLong_AsLongLong(PyTuple_GET_ITEM(ref, 2));
    std::optional<int> index;
    if (PyUnicode_Check(arg)) {
      index = schema.argumentIndexWithName(PyUnicode_AsUTF8(arg));
    } else {
      index = static_cast<int>(PyLong_AsLongLong(arg));
    }
    if (!index.has_value() || *index < 0 || static_cast<size_t>(*index) >= n_formals) return false;
    holes[*index].push_back(item);
    step.refs.push_back(Ref{static_cast<size_t>(*index), item, vid});
  }
  Py_ssize_t n_args = PySequence_Fast_GET_SIZE(args.ptr());
  if (static_cast<size_t>(n_args) > n_formals) return false;
  PyObject** items = PySequence_Fast_ITEMS(args.ptr());
  std::vector<PyObject*> given(n_formals, nullptr);  // (borrowed)
  for (Py_ssize_t i = 0; i < n_args; ++i) given[i] = items[i];
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs.ptr(), &pos, &key, &value)) {
    auto index = schema.argumentIndexWithName(PyUnicode_AsUTF8(key));
    if (!index.has_value() || given[*index] != nullptr) return false;
    given[*index] = value;
  }
  step.stack.reserve(n_formals);
  try {
    for (size_t i = 0; i < n_formals; ++i) {
      const auto& h = holes[i];
      if (!h.empty() && h[0] < 0) {
        step.stack.emplace_back();  // (the value goes here when the step runs)
      } else if (given[i] != nullptr) {
        step.stack.push_back(to_ivalue(given[i], step.op->kinds[i], formals[i], h));
      } else if (formals[i].default_value().has_value()) {
        step.stack.push_back(*formals[i].default_value());
      } else {
        return false;
      }
    }
  } catch (const std::exception&) {
    return false;  // (arguments only Python's binding knows how to convert)
  }
  py::object outs = field(run, f.outs);
  for (const auto& o : outs) step.outs.push_back(PyLong_AsLongLong(o.ptr()));
  py::object moves = field(run, f.moves);
  for (const auto& m : moves) {
    step.moves.emplace_back(PyLong_AsLongLong(PyTuple_GET_ITEM(m.ptr(), 0)),
                            PyLong_AsLongLong(PyTuple_GET_ITEM(m.ptr(), 1)));
  }
  step.grad_mode = field(run, f.grad_mode).ptr() == Py_True;
  step.keep_result = field(run, f.keep_result).ptr() == Py_True;
  step.op_index = PyLong_AsLongLong(field(run, f.op_index).ptr());
  py::object arena_out = field(run, f.arena_out);
  if (!arena_out.is_none()) {  // (out_func, out argument names, per output its planned place)
    PyObject* planned = arena_out.ptr();
    PyObject* func = PyTuple_GET_ITEM(planned, 0);
    if (!not_in_place.contains(func)) {
      step.out = out_variant(*step.op, func, PyTuple_GET_ITEM(planned, 1));
      if (!step.out) return false;
      PyObject* places = PyTuple_GET_ITEM(planned, 2);
      for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(places); ++k) {
        PyObject* o = PyTuple_GET_ITEM(places, k);  // (offset, shape, stride, dtype, bytes)
        step.arena.push_back(ArenaOut{
            PyLong_AsLongLong(PyTuple_GET_ITEM(o, 0)), int_list(PyTuple_GET_ITEM(o, 1)),
            int_list(PyTuple_GET_ITEM(o, 2)), reinterpret_cast<THPDtype*>(PyTuple_GET_ITEM(o, 3))->scalar_type,
            PyLong_AsLongLong(PyTuple_GET_ITEM(o, 4))});
      }
    }
  }
  return true;
}

inline void put(Stack& stack, const Ref& ref, const at::Tensor& t) {
  if (ref.item < 0) {
    stack[ref.index] = t;
    return;
  }
  // (a copy of the list: the converted one may be shared, and must not keep the value alive)
  auto list = stack[ref.index].toList().copy();
  list.set(ref.item, t);
  stack[ref.index] = list;
}

// An op's tensor arguments: the storages they use (an output on one of them is not new memory)
// into `keys`, and those Python holds too, referenced once more, into `held`.
inline void scan_inputs(const Stack& stack, std::vector<int64_t>& keys, std::vector<at::Tensor>& held) {
  keys.clear();
  auto one = [&](const at::Tensor& t) {
    keys.push_back(storage_key(t));
    if (python_holds(t)) held.push_back(t);
  };
  for (const auto& v : stack) {
    if (v.isTensor()) {
      one(v.toTensor());
    } else if (v.isList()) {  // (a Tensor[] is a list of IValues too)
      for (const auto& x : v.toListRef())
        if (x.isTensor()) one(x.toTensor());
    }
  }
}

// An op's returned tensors, flattened as the Python executor flattens them (undefined
// tensors, Python's None, are skipped).
inline void flatten(const Stack& stack, std::vector<at::Tensor>& out) {
  out.clear();
  for (const auto& v : stack) {
    if (v.isTensor()) {
      if (v.toTensor().defined()) out.push_back(v.toTensor());
    } else if (v.isList()) {
      for (const auto& x : v.toListRef())
        if (x.isTensor() && x.toTensor().defined()) out.push_back(x.toTensor());
    }
  }
}

inline bool laid_out_as_planned(const at::Tensor& t, const ArenaOut& o) {
  return t.sizes().vec() == o.shape && t.strides().vec() == o.stride && t.scalar_type() == o.dtype;
}

}  // namespace coexec
