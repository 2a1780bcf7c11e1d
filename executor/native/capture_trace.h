// A traced step's log (Capture::trace_next): what the TraceGraph needs of each op the step
// issued, read by tracegraph/from_capture.py into a tracegraph.Trace.
// Internal to capture.cpp, the only file that includes it (hence the anonymous namespace).
//
// The capture answers every op of the step on this thread, so the log is kept here, beside the
// answer: the op, the Python frames it was called from (up to the step's ``with`` frame), its
// arguments with each tensor replaced by its number in the step, its tensors' metadata before it
// ran and its outputs' after, and, in a backward the engine runs, the autograd node it runs for.
// A tensor's number is its value's, not its object's: placeholders that share a slot (autograd's
// saved copy of an output, ``t.data``) are one tensor, as they are one value to the worker, and
// real tensors over the same memory with the same layout are one tensor.
// Nothing is logged in a step not traced (one branch per op).
#pragma once

#include <torch/extension.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/SequenceNumber.h>
#include <Python.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "capture_placeholders.h"

namespace py = pybind11;

namespace coexec {
namespace {

using TracedFrames = std::vector<std::pair<PyCodeObject*, int>>;  // (code, offset), innermost first

struct TracedTensor {
  int64_t id;  // its number in the step
  std::vector<int64_t> sizes, strides;
  bool strided;
  c10::ScalarType dtype;
  bool requires_grad, leaf;
  uint8_t bits;  // a lazy conjugate (1) or negation (2)
  const void* storage;  // what it shares memory with (a placeholder's slot's identity storage)
};

struct TracedArg {
  bool tensors = false;      // a tensor or a list of them: `ids` (-1: None or undefined)
  bool list = false;
  std::vector<int64_t> ids;
  c10::IValue value;         // otherwise: the argument itself
};

struct TracedOp {
  const c10::OperatorHandle* op;
  TracedFrames frames;
  std::vector<TracedArg> args;
  std::vector<TracedTensor> inputs;   // the defined tensor arguments, flattened, as they came
  std::vector<TracedTensor> outputs;  // the tensors it returned, flattened, as they went
  std::vector<int8_t> out_struct;     // per return: 1 a tensor, 0 an undefined one, -n a list of n, 2 not a tensor
  bool python_result = false;         // it returned a number or a bool (read from data)
  bool grad_mode = false, in_try = false;
  uint64_t seq = 0;      // at::sequence_number::peek() as it came (autograd nodes made before it are its)
  int64_t node = -1;     // in a backward: the sequence number of the node the engine runs (-1: none)
  int64_t leaf = -1;     // ... an AccumulateGrad's: its variable's number
};

struct TracedFetch {
  int64_t after;  // ops logged before it
  int64_t id;
  std::string kind;
  TracedFrames frames;
};

class TraceLog {
 public:
  void clear() {
    ops_.clear();
    fetches_.clear();
    ids_.clear();
    real_ids_.clear();
    next_id_ = 0;
    held_slots_.clear();
    held_impls_.clear();
    held_storages_.clear();
    cut_.clear();
  }

  bool empty() const { return ops_.empty() && fetches_.empty() && next_id_ == 0; }

  // The step went on without its ops logged from here (a torch.compile'd region: its rest
  // runs eagerly): the trace holds part of the step and is not merged.
  void cut(std::string why) {
    if (cut_.empty()) cut_ = std::move(why);
  }

  // Before `op` is answered: its arguments and inputs (`args`: the stack's top), where it was
  // called from, and the autograd node it runs for in a backward.
  // (the op's place in the log: `ops_` may grow while it is answered)
  size_t begin_op(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, TracedFrames frames) {
    TracedOp& o = ops_.emplace_back();
    o.op = &op;
    o.frames = std::move(frames);
    o.grad_mode = c10::GradMode::is_enabled();
    o.seq = at::sequence_number::peek();
    if (const auto node = torch::autograd::get_current_node()) {
      if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node.get())) {
        o.leaf = id_of(acc->variable);
      } else {
        o.node = static_cast<int64_t>(node->sequence_nr());
      }
    }
    for (const c10::IValue& a : args) {
      TracedArg& ta = o.args.emplace_back();
      if (a.isTensor()) {
        ta.tensors = true;
        add_input(o, ta, a.toTensor());
      } else if (a.isList() && has_tensor_or_none(a)) {
        ta.tensors = ta.list = true;
        for (const c10::IValue& x : a.toListRef()) {
          if (x.isTensor())
            add_input(o, ta, x.toTensor());
          else
            ta.ids.push_back(-1);
        }
      } else {
        ta.value = a;
      }
    }
    return ops_.size() - 1;
  }

  // After it was answered: what it returned (`outputs`: the stack's top).
  void end_op(size_t index, bool in_try, c10::ArrayRef<c10::IValue> outputs) {
    TracedOp& o = ops_[index];
    o.in_try = in_try;
    for (const c10::IValue& r : outputs) {
      if (r.isTensor()) {
        const at::Tensor& t = r.toTensor();
        o.out_struct.push_back(t.defined() ? 1 : 0);
        if (t.defined()) o.outputs.push_back(traced(t));
      } else if (r.isTensorList()) {
        const auto l = r.toTensorVector();
        o.out_struct.push_back(static_cast<int8_t>(-static_cast<int>(l.size())));
        for (const at::Tensor& t : l)
          if (t.defined()) o.outputs.push_back(traced(t));
      } else {
        o.out_struct.push_back(2);
        o.python_result = true;
      }
    }
  }

  void fetch(const at::Tensor& t, std::string kind, TracedFrames frames) {
    fetches_.push_back({static_cast<int64_t>(ops_.size()), id_of(t), std::move(kind), std::move(frames)});
  }


  // For Python (the GIL held): (ops, fetches, why it was cut or ""). Per op: (name, frames, args,
  // inputs, outputs, out_struct, python_result, grad_mode, in_try, seq, node, leaf); a frame is
  // (code, offset), innermost first; an argument is ("t", ids) for a tensor, ("l", ids) for a
  // list of them, ("v", value) otherwise; a tensor is (number, sizes, strides or None, dtype,
  // requires_grad, is_leaf, bits, storage). Per fetch: (ops before it, number, kind, frames).
  py::tuple to_python() const {
    py::list ops, fetches;
    for (const TracedOp& o : ops_) {
      const auto& name = o.op->schema().operator_name();
      py::list args;
      for (const TracedArg& a : o.args) {
        if (a.tensors)
          args.append(py::make_tuple(a.list ? "l" : "t", py::tuple(py::cast(a.ids))));
        else
          args.append(py::make_tuple("v", torch::jit::toPyObject(a.value)));
      }
      ops.append(py::make_tuple(name.name + "." + (name.overload_name.empty() ? "default" : name.overload_name),
                                frames_of(o.frames), args, tensors_of(o.inputs), tensors_of(o.outputs),
                                py::tuple(py::cast(std::vector<int>(o.out_struct.begin(), o.out_struct.end()))),
                                o.python_result, o.grad_mode, o.in_try, o.seq, o.node, o.leaf));
    }
    for (const TracedFetch& f : fetches_) fetches.append(py::make_tuple(f.after, f.id, f.kind, frames_of(f.frames)));
    return py::make_tuple(ops, fetches, cut_);
  }

 private:
  std::vector<TracedOp> ops_;
  std::vector<TracedFetch> fetches_;
  // a tensor's number by its value: a placeholder's slot; a real tensor's storage, offset, sizes,
  // strides and dtype (torch makes another TensorImpl over the same memory where it pleases:
  // ``torch.ones`` returns a shallow copy of what its ``fill_`` wrote where anything else holds
  // a reference, even a weak one, to it). Each is held weakly to the step's end, so that no
  // other takes its address meanwhile.
  struct RealKey {
    const void* storage;
    int64_t offset;
    std::vector<int64_t> sizes, strides;
    c10::ScalarType dtype;
    bool operator==(const RealKey& o) const {
      return storage == o.storage && offset == o.offset && dtype == o.dtype && sizes == o.sizes && strides == o.strides;
    }
  };
  struct RealKeyHash {
    size_t operator()(const RealKey& k) const {
      size_t h = std::hash<const void*>()(k.storage) ^ (static_cast<size_t>(k.offset) * 0x9E3779B97F4A7C15ull);
      for (int64_t s : k.sizes) h = h * 31 + static_cast<size_t>(s);
      return h;
    }
  };
  std::unordered_map<const void*, int64_t> ids_;
  std::unordered_map<RealKey, int64_t, RealKeyHash> real_ids_;
  int64_t next_id_ = 0;
  std::vector<std::weak_ptr<Slot>> held_slots_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> held_impls_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> held_storages_;
  std::string cut_;

  static bool has_tensor_or_none(const c10::IValue& list) {
    const auto elem = list.type()->castRaw<c10::ListType>()->getElementType();
    if (elem->kind() == c10::TypeKind::TensorType) return true;
    if (const auto* opt = elem->castRaw<c10::OptionalType>()) return opt->getElementType()->kind() == c10::TypeKind::TensorType;
    return false;
  }

  int64_t id_of(const at::Tensor& t) {
    if (!t.defined()) return -1;
    if (is_ph(t) && impl_of(t)->slot) {
      const std::shared_ptr<Slot>& slot = impl_of(t)->slot;
      auto [it, fresh] = ids_.try_emplace(slot.get(), next_id_);
      if (fresh) {
        ++next_id_;
        held_slots_.emplace_back(slot);
      }
      return it->second;
    }
    if (!t.has_storage() || is_ph(t)) {  // (sparse: by its object)
      auto [it, fresh] = ids_.try_emplace(t.unsafeGetTensorImpl(), next_id_);
      if (fresh) {
        ++next_id_;
        held_impls_.emplace_back(t.getIntrusivePtr());
      }
      return it->second;
    }
    RealKey key{t.storage().unsafeGetStorageImpl(), t.storage_offset(), t.sizes().vec(), t.strides().vec(), t.scalar_type()};
    auto [it, fresh] = real_ids_.try_emplace(std::move(key), next_id_);
    if (fresh) {
      ++next_id_;
      held_storages_.emplace_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl()));
    }
    return it->second;
  }

  TracedTensor traced(const at::Tensor& t) {
    const bool strided = t.layout() == c10::kStrided;
    const void* storage = t.has_storage() ? static_cast<const void*>(t.storage().unsafeGetStorageImpl()) : nullptr;
    return {id_of(t), t.sizes().vec(), strided ? t.strides().vec() : std::vector<int64_t>{}, strided, t.scalar_type(),
            t.requires_grad(), t.is_leaf(), static_cast<uint8_t>(t.is_conj() | (t.is_neg() << 1)), storage};
  }

  void add_input(TracedOp& o, TracedArg& a, const at::Tensor& t) {
    if (!t.defined()) {
      a.ids.push_back(-1);
      return;
    }
    o.inputs.push_back(traced(t));
    a.ids.push_back(o.inputs.back().id);
  }

  static py::list frames_of(const TracedFrames& frames) {
    py::list out;
    for (const auto& [code, lasti] : frames)
      out.append(py::make_tuple(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(code)), lasti));
    return out;
  }

  static py::list tensors_of(const std::vector<TracedTensor>& ts) {
    py::list out;
    for (const TracedTensor& t : ts)
      out.append(py::make_tuple(t.id, py::tuple(py::cast(t.sizes)),
                                t.strided ? py::object(py::tuple(py::cast(t.strides))) : py::object(py::none()),
                                py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(t.dtype))),
                                t.requires_grad, t.leaf, static_cast<int>(t.bits), reinterpret_cast<uintptr_t>(t.storage)));
    return out;
  }
};

}  // namespace
}  // namespace coexec
