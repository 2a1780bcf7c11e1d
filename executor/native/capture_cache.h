// Capture's cache (capture.cpp): what an op made at a Python location, and the check that it applies.
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
#include <unordered_map>
#include <utility>
#include <vector>

#include "capture_placeholders.h"

namespace coexec {
namespace {

namespace py = pybind11;

// -- the cache -------------------------------------------------------------------------------

using Args = c10::ArrayRef<c10::IValue>;  // an op's arguments (taken off its stack)

// The op's arguments, taken off its stack.
c10::SmallVector<c10::IValue, 8> take_args(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  c10::SmallVector<c10::IValue, 8> args(std::make_move_iterator(stack->end() - n), std::make_move_iterator(stack->end()));
  torch::jit::drop(*stack, n);
  return args;
}

struct OutMeta {  // one return: a tensor, or a list of them
  bool is_list = false;
  std::vector<TensorMeta> tensors;
  bool operator==(const OutMeta& o) const { return is_list == o.is_list && tensors == o.tensors; }
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
  // of the op, found once here rather than at every hit: per return the argument it writes
  // (written_arg), and whether it must run at once (must_run_now)
  std::vector<int> written;
  bool run_now = false;
  bool tensors = false;  // the op reads tensors (tensor_inputs): its numbers count by kind
  uint64_t id = 0;  // the same id for the same arguments and outputs (a step's path names it)
};

bool has_tensor(const c10::IValue& iv) {
  bool any = iv.isTensor() || iv.isTensorList();
  if (!any && iv.isList())
    for (const c10::IValue& x : iv.toListRef()) any = any || x.isTensor();
  return any;
}

// Does the op read a tensor, an ``out=`` tensor aside? ``arange.start_out`` (what
// ``torch.arange`` reaches here) reads none: it resizes its ``out`` to what its numbers say.
bool tensor_inputs(const c10::FunctionSchema& schema, Args args) {
  for (size_t i = 0; i < args.size(); ++i)
    if (has_tensor(args[i]) && !schema.arguments()[i].is_out()) return true;
  return false;
}

// The arguments that are not tensors (a view's shape, a slice's bounds, a dtype) are as much a
// part of what an op makes as its inputs' metadata. A number (Scalar, float: an alpha, a learning
// rate, Adam's step size) counts by its kind only where the op has tensor inputs: type promotion
// reads the kind, no output's shape reads the value, and such values change from step to step.
// A factory's numbers (``arange``'s end) make its shape, so there they count by value, an
// ``out=`` factory's too (``arange.start_out``'s start: with it erased, ``arange(n - 1, -1, -1)``
// kept the first step's length at every ``n``).
// Argument ``i`` as the cache keeps it (``tensors``: the op has tensor inputs; a tensor: None).
c10::IValue const_of(const c10::FunctionSchema& schema, size_t i, const c10::IValue& iv, bool tensors) {
  if (has_tensor(iv)) return c10::IValue();
  // (a collective's ProcessGroup, ReduceOp: by its class, not held: the cache outlives them)
  if (iv.isObject()) return c10::IValue(iv.toObjectRef().name());
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

std::vector<c10::IValue> consts_of(const c10::FunctionSchema& schema, Args args, bool tensors) {
  std::vector<c10::IValue> out;
  out.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) out.push_back(const_of(schema, i, args[i], tensors));
  return out;
}

bool same_const(const c10::IValue& a, const c10::IValue& b) {
  // (IValue's tag is private and tagKind() makes a string: each kind is asked for in turn)
  if (a.isNone() || b.isNone()) return a.isNone() && b.isNone();
  if (a.isInt()) return b.isInt() && a.toInt() == b.toInt();
  if (a.isBool()) return b.isBool() && a.toBool() == b.toBool();
  if (a.isDouble()) {
    if (!b.isDouble()) return false;
    double x = a.toDouble(), y = b.toDouble();
    return std::memcmp(&x, &y, sizeof x) == 0;  // (-0.0 is not 0.0 here)
  }
  if (a.isList()) {  // (int[], SymInt[] of ints, float[], bool[]: compared in place, not printed)
    if (!b.isList()) return false;
    const auto x = a.toListRef(), y = b.toListRef();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i)
      if (!same_const(x[i], y[i])) return false;
    return true;
  }
  if (a.isGenerator()) return b.isGenerator();  // (which generator makes values, not shapes)
  if (a.isString()) return b.isString() && a.toStringRef() == b.toStringRef();
  if (a.isDevice()) return b.isDevice() && a.toDevice() == b.toDevice();
  if (a.tagKind() != b.tagKind()) return false;
  std::ostringstream x, y;  // scalars, symbolic ints, the rest: as printed
  x << a;
  y << b;
  return x.str() == y.str();
}

void input_metas(Args args, std::vector<TensorMeta>& out) {
  for (const auto& iv : args)
    each_tensor(iv, [&out](const at::Tensor& t) {
      if (t.defined()) out.push_back(meta_of(t));
    });
}

bool same_consts(const std::vector<c10::IValue>& a, const std::vector<c10::IValue>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!same_const(a[i], b[i])) return false;
  return true;
}

bool matches(const Entry& e, const c10::FunctionSchema& schema, Args args) {
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
  // (e.tensors: where the entry's tensor arguments are, so are these, the inputs having matched)
  for (size_t i = 0; i < args.size(); ++i)
    if (!has_tensor(args[i]) && !same_const(const_of(schema, i, args[i], e.tensors), e.consts[i])) return false;
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
// The written tensor argument of return ``r`` with the metadata the entry says it ends with, if
// the op changes it (``unsqueeze_``, ``resize_``, an ``out=`` that resizes); else null.
const at::Tensor* rewritten(const Entry& e, Args args, size_t r) {
  const int w = e.written[r];
  if (w < 0 || !args[w].isTensor() || e.outputs[r].is_list) return nullptr;
  const at::Tensor& t = args[w].toTensor();
  return e.outputs[r].tensors[0].same(t) ? nullptr : &t;
}

// Does the op change a written argument's metadata? Such an op runs now: Python sees the new
// shape at once.
bool changes_written(const Entry& e, Args args) {
  for (size_t r = 0; r < e.outputs.size(); ++r)
    if (rewritten(e, args, r) != nullptr) return true;
  return false;
}

// Where nothing is computed, an op that changes a written argument's metadata (an ``out=`` that
// resizes: ``arange``'s) changes it here: a placeholder takes it, a real tensor is resized (its
// values are computed when the tape runs).
void take_written_metadata(const Entry& e, Args args, c10::DispatchKeySet included_before) {
  for (size_t r = 0; r < e.outputs.size(); ++r) {
    const at::Tensor* t = rewritten(e, args, r);
    if (t == nullptr) continue;
    const TensorMeta& m = e.outputs[r].tensors[0];
    if (is_ph(*t)) {
      impl_of(*t)->take_metadata(m.sizes, m.strides, m.offset);
    } else {
      at::AutoDispatchBelowADInplaceOrView below;
      c10::impl::ForceDispatchKeyGuard off(included_before, c10::impl::tls_local_dispatch_key_set().excluded_);
      at::Tensor(*t).resize_(m.sizes).as_strided_(m.sizes, m.strides, m.offset);
    }
  }
}

}  // namespace
}  // namespace coexec
