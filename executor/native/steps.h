// One executor Run (executor/stream.py) as a boxed dispatcher call: converted once, while the
// GIL is held, so that the engine (engine.h) runs it without Python.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "live_bytes.h"

namespace coexec {

namespace py = pybind11;
using torch::jit::Stack;

// An ATen overload the dispatcher knows (looked up once per OpOverload).
struct Op {
  c10::OperatorHandle handle;
  py::object func;  // the OpOverload: named in errors, reported back after a failed out= try
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
  std::shared_ptr<Op> out_op;  // the out= variant when planned into the arena
  std::vector<int64_t> out_map;  // per out= argument: -1 - k for output k, else the stack index
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
    if (handle.has_value())
      found = std::make_shared<Op>(Op{*handle, py::reinterpret_borrow<py::object>(func)});
  }
  cache.emplace(func.ptr(), found);
  return found;
}

// Where the out= variant's arguments come from: the op's own stack, or its outputs.
inline std::vector<int64_t> out_arguments(const Op& op, const Op& out_op, const py::tuple& names) {
  const auto& schema = op.handle.schema();
  const auto& out_schema = out_op.handle.schema();
  std::vector<int64_t> map;
  for (const auto& arg : out_schema.arguments()) {
    int64_t k = -1;
    for (size_t j = 0; j < names.size(); ++j)
      if (names[j].cast<std::string>() == arg.name()) k = static_cast<int64_t>(j);
    if (k >= 0) {
      map.push_back(-1 - k);
      continue;
    }
    auto index = schema.argumentIndexWithName(arg.name());
    if (!index.has_value()) return {};
    map.push_back(static_cast<int64_t>(*index));
  }
  return map;
}

// The stand-in for a value reference while converting arguments (leaked, as op_cache).
inline py::object dummy_tensor() {
  static PyObject* dummy = THPVariable_Wrap(at::empty({0}));
  return py::reinterpret_borrow<py::object>(dummy);
}

// A new list with the items of a sequence (the Run's own lists stay as they are).
inline py::list copied(const py::handle& seq) {
  return py::reinterpret_steal<py::list>(PySequence_List(seq.ptr()));
}

inline bool wants_tensor(const c10::Argument& formal) {
  return formal.type()->kind() == c10::TypeKind::TensorType;
}

inline bool is_number(const py::handle& x) {
  return PyBool_Check(x.ptr()) || PyLong_Check(x.ptr()) || PyFloat_Check(x.ptr()) || PyComplex_Check(x.ptr());
}

// A Python number where the schema wants a tensor is a wrapped-number tensor, as the Python
// binding makes it. Made here, in C++, so that no Python object owns it: the engine's thread
// lets go of it without the GIL.
inline at::Tensor wrapped_number(const py::handle& x) {
  at::Tensor t = at::scalar_to_tensor(torch::jit::toIValue(x, c10::NumberType::get()).toScalar());
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// A Run instruction as a Step: its arguments converted by its schema (the value references
// hold a stand-in tensor until the step runs). False: the engine cannot call it (the caller
// runs it in Python).
inline bool convert(const py::handle& run, const py::set& not_in_place, Step& step) {
  step.op = find_op(run.attr("func"));
  if (!step.op) return false;
  const auto& schema = step.op->handle.schema();
  const auto& formals = schema.arguments();
  py::list args = copied(run.attr("args"));
  py::dict kwargs = py::reinterpret_steal<py::dict>(PyDict_Copy(run.attr("kwargs").ptr()));
  py::tuple refs(run.attr("refs"));
  py::object dummy = dummy_tensor();
  for (const auto& r : refs) {
    auto ref = py::reinterpret_borrow<py::tuple>(r);
    py::object arg = ref[0];
    int64_t item = ref[1].cast<int64_t>();
    int64_t vid = ref[2].cast<int64_t>();
    bool named = py::isinstance<py::str>(arg);
    py::object box = named ? py::object(kwargs) : py::object(args);
    auto index = named ? schema.argumentIndexWithName(arg.cast<std::string>())
                       : std::optional<int>(arg.cast<int>());
    if (!index.has_value()) return false;
    if (item < 0) {
      box[arg] = dummy;
    } else {
      py::list items = copied(box[arg]);
      items[item] = dummy;
      box[arg] = items;
    }
    step.refs.push_back(Ref{static_cast<size_t>(*index), item, vid});
  }
  std::vector<std::pair<size_t, at::Tensor>> numbers;  // wrapped numbers, put in after
  for (size_t i = 0; i < args.size() && i < formals.size(); ++i) {
    if (wants_tensor(formals[i]) && is_number(args[i])) {
      numbers.emplace_back(i, wrapped_number(args[i]));
      args[i] = dummy;
    }
  }
  for (const auto& kv : kwargs) {
    auto index = schema.argumentIndexWithName(kv.first.cast<std::string>());
    if (index.has_value() && wants_tensor(formals[*index]) && is_number(kv.second)) {
      numbers.emplace_back(*index, wrapped_number(kv.second));
      kwargs[kv.first] = dummy;
    }
  }
  try {
    step.stack = torch::jit::createStackForSchema(
        schema, py::tuple(args), py::reinterpret_borrow<py::kwargs>(kwargs), std::nullopt);
  } catch (const std::exception&) {
    return false;  // (arguments only Python's binding knows how to convert)
  }
  for (auto& n : numbers) step.stack[n.first] = std::move(n.second);
  for (const auto& o : py::tuple(run.attr("outs"))) step.outs.push_back(o.cast<int64_t>());
  for (const auto& m : py::tuple(run.attr("moves"))) {
    auto move = py::reinterpret_borrow<py::tuple>(m);
    step.moves.emplace_back(move[0].cast<int64_t>(), move[1].cast<int64_t>());
  }
  step.grad_mode = run.attr("grad_mode").cast<bool>();
  step.keep_result = run.attr("keep_result").cast<bool>();
  step.op_index = run.attr("op_index").cast<int64_t>();
  py::object arena_out = run.attr("arena_out");
  if (!arena_out.is_none()) {
    py::tuple planned(arena_out);
    if (!not_in_place.contains(planned[0])) {
      step.out_op = find_op(planned[0]);
      if (step.out_op) step.out_map = out_arguments(*step.op, *step.out_op, py::tuple(planned[1]));
      if (step.out_map.empty()) return false;  // (the Python path knows how to call it)
      for (const auto& o : py::tuple(planned[2])) {
        auto out = py::reinterpret_borrow<py::tuple>(o);
        step.arena.push_back(ArenaOut{
            out[0].cast<int64_t>(), out[1].cast<std::vector<int64_t>>(),
            out[2].cast<std::vector<int64_t>>(),
            reinterpret_cast<THPDtype*>(out[3].ptr())->scalar_type, out[4].cast<int64_t>()});
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

// The storages of an op's tensor arguments (an output on one of them is not new memory).
inline void input_keys(const Stack& stack, std::vector<int64_t>& keys) {
  keys.clear();
  for (const auto& v : stack) {
    if (v.isTensor()) {
      keys.push_back(storage_key(v.toTensor()));
    } else if (v.isList()) {  // (a Tensor[] is a list of IValues too)
      for (const auto& x : v.toListRef())
        if (x.isTensor()) keys.push_back(storage_key(x.toTensor()));
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
