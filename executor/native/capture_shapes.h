// Capture's shape oracle (capture.cpp): what an op makes that the cache has not met (a new size),
// computed exactly without running it, so that the op still goes to the worker.
// Internal to capture.cpp, the only file that includes it (hence the anonymous namespace).
//
// The answer is the op's own CPU code run on shape placeholders (placeholders without a slot,
// whose storage throws where its data is read or written), with every op it calls answered the
// same way, down to ops whose output metadata C++ computes without data:
//
// * a structured kernel: its meta function (``at::meta::add``), which its CPU kernel runs first
//   to size its output (torch's Python meta kernels over them are skipped: slow, and not the
//   CPU's code), through a table generated for the installed torch (executor/structured_meta.py);
// * an op with a C++ Meta kernel (``view``, ``as_strided``, ``empty``): that kernel, on meta tensors;
// * an in-place op that keeps its argument's metadata (``masked_fill_``, ``zero_``): the argument;
// * any other op: the kernel the CPU would run (its own, or a composite one), on shape
//   placeholders, recursively.
//
// A kernel that reads data (a CPU kernel's loop) fails there (c10's error, or NotShaped). Then
// the op's CPU kernel runs eagerly on this thread on stand-ins of its arguments (ones, or zeros
// for integers: stand_in_outputs; arguments of up to 1 MiB): its compute, but no wait for the
// worker to compute the real arguments. Ops whose result Python reads or whose shape follows
// data, and random ops that take no generator, are not answered: they run at once as before. So
// an answer is the CPU's own metadata or none. The worker checks each answer against what the op
// made on the run it was made for (capture_worker.h, check_shaped): a mismatch fails the step,
// stops answering for good, and the capture empties its cache at the next step.
#pragma once

#include <torch/extension.h>
#include <ATen/MetaFunctions.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "capture_cache.h"
#include "capture_placeholders.h"
#include "cpu_bytes.h"

namespace coexec {
namespace {

// Thrown inside the oracle: this op's outputs are not computed without running it.
struct NotShaped : std::exception {};

// On the step's thread, while the oracle runs: ops on shape placeholders come back to it.
thread_local bool t_shaping = false;

// An answer the worker found wrong (a coexec bug): the oracle answers no more in this process.
std::atomic<bool> g_shapes_broken{false};

using MetaTable = std::unordered_map<c10::OperatorName, c10::KernelFunction>;

template <class F>
void put(MetaTable& t, const char* name, const char* overload, F* fn) {
  t.emplace(c10::OperatorName(name, overload), c10::KernelFunction::makeFromUnboxedRuntimeFunction(fn));
}

// The structured kernels' meta functions, by op.
const MetaTable& structured_meta() {
  static const MetaTable* table = [] {
    auto* tp = new MetaTable;
    MetaTable& t = *tp;
#include "coexec_structured_meta.inc"
    return tp;
  }();
  return *table;
}

enum class Way : uint8_t { kNone, kStructured, kMeta, kInPlace, kKernel };

struct OpWay {
  Way way = Way::kNone;
  const c10::KernelFunction* meta = nullptr;  // (kStructured)
  int64_t tried = 0, answered = 0;  // top-level calls: an op never answered stops being tried
  bool stand_ins = false;  // whether it may run on stand-ins (stand_in_outputs)
  int generator = -1;  // a random op's Generator argument (stand-ins: a generator of its own)
  // the most bytes its stand-ins held at once per byte of arguments (their outputs' too): what a
  // budget's guard keeps room for before the next (2: the outputs as large as the arguments)
  double stand_in_ratio = 2.0;
  // the same for the oracle (a composite kernel's factory calls allocate: 0 for most ops)
  double shaped_ratio = 0.0;
};

// The registration line of dispatch key `key` in the op's dump ("" if none; "Meta (inactive)"
// lines are not "Meta: " ones).
std::string registration(const std::string& dump, const std::string& key) {
  const std::string head = key + ": registered at ";
  size_t at = ("\n" + dump).find("\n" + head);  // (at the line's start; the dump's first line too)
  if (at == std::string::npos) return "";
  const size_t end = dump.find('\n', at);
  return dump.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

bool from_python(const std::string& line) { return line.find(".py:") != std::string::npos; }

// Is the op's CPU kernel Python (a torch.library op, as FSDP2's fsdp::all_gather_copy_in)? The
// worker never takes the GIL: such an op runs at once, on the step's thread (Entry::run_now).
// Found once per op.
bool python_kernel(const c10::OperatorHandle& op) {
  static std::unordered_map<const void*, bool> known;  // (the step's thread only)
  auto it = known.find(&op.schema());
  if (it == known.end()) {
    const std::string dump = op.dumpState();
    const bool py = from_python(registration(dump, "CPU")) || from_python(registration(dump, "CompositeExplicitAutograd"));
    it = known.emplace(&op.schema(), py).first;
  }
  return it->second;
}

// Does the op keep every written argument's metadata? (Not a view in place, a resize, an out=.)
bool keeps_metadata(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  if (op.hasTag(at::Tag::inplace_view) || schema.name().find("resize") != std::string::npos ||
      schema.name() == "aten::set_")
    return false;
  bool writes = false;
  for (const auto& a : schema.arguments()) {
    const auto* alias = a.alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    if (a.kwarg_only()) return false;  // (an out=: resized to what the op makes)
    writes = true;
  }
  for (size_t r = 0; r < schema.returns().size(); ++r)
    if (written_arg(schema, r) < 0) return false;
  return writes;
}

// A random op's Generator argument, or -1.
int generator_arg(const c10::FunctionSchema& schema) {
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    auto type = schema.arguments()[i].type();
    if (type->kind() == c10::TypeKind::OptionalType) type = type->castRaw<c10::OptionalType>()->getElementType();
    if (type->kind() == c10::TypeKind::GeneratorType) return static_cast<int>(i);
  }
  return -1;
}

// How the oracle answers `op`, and whether it may run on stand-ins (found once per op).
OpWay find_way(const c10::OperatorHandle& op) {
  OpWay w;
  const auto& schema = op.schema();
  if (schema.name().rfind("aten::", 0) != 0 || must_run_now(op)) return w;
  const bool seeded = op.hasTag(at::Tag::nondeterministic_seeded);
  if (seeded) w.generator = generator_arg(schema);
  w.stand_ins = !seeded || w.generator >= 0;
  const auto& table = structured_meta();
  if (auto it = table.find(op.operator_name()); it != table.end()) {
    w.way = Way::kStructured;
    w.meta = &it->second;
    return w;
  }
  const std::string dump = op.dumpState();
  const std::string meta = registration(dump, "Meta");
  if (!meta.empty() && !from_python(meta)) {
    w.way = Way::kMeta;
  } else if (keeps_metadata(op)) {
    w.way = Way::kInPlace;
  } else if (seeded && op.hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
    // (a random op's own CPU kernel may draw from its generator before it reads data, while
    // the worker draws from it; a composite one draws through the ops it calls, and an
    // in-place one, above, is answered without drawing)
  } else if (!from_python(registration(dump, "CPU")) && !from_python(registration(dump, "CompositeExplicitAutograd")) &&
             !from_python(registration(dump, "CompositeExplicitAutogradNonFunctional")) &&
             (op.hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
              op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
              op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))) {
    w.way = Way::kKernel;
  }
  return w;
}

OpWay& way_of(const c10::OperatorHandle& op) {
  static std::unordered_map<const void*, OpWay> ways;  // (the step's thread only)
  auto it = ways.find(&op.schema());
  if (it == ways.end()) it = ways.emplace(&op.schema(), find_way(op)).first;
  return it->second;
}

// The bytes of storage a tensor with t's metadata reaches (its offset included).
int64_t reached_bytes(const at::Tensor& t) {
  return static_cast<int64_t>(at::detail::computeStorageNbytes(
      t.sizes(), t.strides(), t.dtype().itemsize(), static_cast<size_t>(t.storage_offset())));
}

// The elements of storage a tensor with t's metadata reaches.
int64_t reached_elements(const at::Tensor& t) { return reached_bytes(t) / static_cast<int64_t>(t.dtype().itemsize()); }

// A meta tensor with t's metadata (made without the dispatcher: the capture's key is on; a
// storage that reaches its offset, which Meta's bounds checks ask for).
at::Tensor as_meta(const at::Tensor& t) {
  if (!t.defined() || t.is_meta()) return t;
  at::Tensor m = at::detail::empty_meta({reached_elements(t)}, t.scalar_type(), std::nullopt, std::nullopt,
                                        std::nullopt, std::nullopt);
  auto* impl = m.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) impl->set_wrapped_number(true);
  return m;
}

// Is t a shape tensor: a shape placeholder (a placeholder without a slot) or a view a kernel
// made of one (a plain TensorImpl with the capture's key and its storage)? Only the oracle
// holds them.
bool is_shape(const at::Tensor& t) {
  if (!is_ph(t)) return false;
  const auto* p = dynamic_cast<const PlaceholderImpl*>(t.unsafeGetTensorImpl());
  return p == nullptr || !p->slot;
}

// A shape placeholder with t's metadata (t itself if it is one).
at::Tensor as_shape(const at::Tensor& t) {
  if (!t.defined() || is_shape(t)) return t;
  auto impl = c10::make_intrusive<PlaceholderImpl>(t.dtype(), nullptr);
  impl->take_metadata(t.sizes(), t.strides(), t.storage_offset());
  impl->hold_no_data(reached_bytes(t));
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) impl->set_wrapped_number(true);
  return at::Tensor(std::move(impl));
}

// Answer `op` on its stack: its returns for its arguments (shape placeholders, or tensors a
// kernel made), or throw.
void shape_call(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const OpWay& w = way_of(op);
  const auto& schema = op.schema();
  const size_t nret = schema.returns().size();
  switch (w.way) {
    case Way::kNone:
      throw NotShaped{};
    case Way::kKernel:
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
      return;
    case Way::kInPlace: {
      auto args = take_args(op, stack);
      for (size_t r = 0; r < nret; ++r) stack->push_back(args[written_arg(schema, r)]);
      return;
    }
    case Way::kStructured:
    case Way::kMeta: {
      auto args = take_args(op, stack);
      for (const c10::IValue& a : args) stack->push_back(map_tensors(a, as_meta));
      if (w.way == Way::kStructured) {
        w.meta->callBoxed(op, c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
      } else {
        op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
      }
      for (size_t r = 0; r < nret; ++r) {
        c10::IValue& out = (*stack)[stack->size() - nret + r];
        const int wa = written_arg(schema, r);
        if (wa < 0) {
          out = map_tensors(out, as_shape);
          continue;
        }
        // (in place: the argument, with the metadata the op left it: a resize_, an unsqueeze_)
        if (!args[wa].isTensor() || !out.isTensor() || !is_shape(args[wa].toTensor())) throw NotShaped{};
        const at::Tensor& m = out.toTensor();
        args[wa].toTensor().unsafeGetTensorImpl()->set_sizes_and_strides(m.sizes(), m.strides(), m.storage_offset());
        out = args[wa];
      }
      return;
    }
  }
}

// While the oracle runs: ops on shape placeholders come to shape_call (the capture's key on,
// below autograd, no Python mode or other layer above the backends).
class ShapeScope {
 public:
  ShapeScope() : was_(t_shaping) { t_shaping = true; }
  ~ShapeScope() { t_shaping = was_; }

 private:
  bool was_;
  c10::impl::IncludeDispatchKeyGuard ours_{kKey};
  c10::impl::ExcludeDispatchKeyGuard above_{c10::autograd_dispatch_keyset_with_ADInplaceOrView |
                                            c10::DispatchKeySet({c10::DispatchKey::Python,
                                                                 c10::DispatchKey::PythonTLSSnapshot,
                                                                 c10::DispatchKey::PreDispatch,
                                                                 c10::DispatchKey::Functionalize,
                                                                 c10::DispatchKey::AutocastCPU,
                                                                 c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
                                                                 c10::DispatchKey::FuncTorchDynamicLayerBackMode,
                                                                 c10::DispatchKey::FuncTorchBatched,
                                                                 c10::DispatchKey::FuncTorchVmapMode})};
};

constexpr int64_t kTriesUnanswered = 4;  // top-level calls of an op never answered, before it is not tried

// A CPU tensor with t's metadata that any kernel takes: ones where it is floating (a
// probability, a divisor), zeros elsewhere (an index). Made without the capture's dispatch.
at::Tensor stand_in(const at::Tensor& t) {
  if (!t.defined()) return t;
  const int64_t n = reached_elements(t);
  at::Tensor z = at::detail::empty_cpu({n}, t.scalar_type(), std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
    z.fill_(1);  // (a CPU tensor: the caller dispatches below the capture's key)
  } else {
    std::memset(z.mutable_data_ptr(), 0, static_cast<size_t>(n) * t.dtype().itemsize());
  }
  auto* impl = z.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) impl->set_wrapped_number(true);
  return z;
}

// What `op` makes, found by running its CPU kernel eagerly on stand-ins of its arguments
// (stand_in) on this thread (`included`: the thread's dispatch keys without the capture's): the
// kernel's own metadata, without waiting for the worker to compute the real arguments, for
// arguments of at most 1 MiB (beyond, the compute done twice costs more than the wait). A random
// op draws from a generator of its own here (never from the one the worker draws from), and one
// that takes none is not answered; a kernel that rejects the stand-ins (a singular matrix) fails
// here and the op runs at once.
constexpr int64_t kStandInBytes = 1 << 20;  // the most bytes of arguments made as stand-ins for one op

// The bytes of storage the tensors among `args` reach.
int64_t args_bytes(Args args) {
  int64_t bytes = 0;
  for (const c10::IValue& a : args)
    each_tensor(a, [&bytes](const at::Tensor& t) {
      if (t.defined()) bytes += reached_bytes(t);
    });
  return bytes;
}

// `ratio`: the most real bytes answering an op held at once per byte of its arguments.
void learn_ratio(double& ratio, int64_t held, int64_t bytes) {
  if (held > 0 && bytes > 0) ratio = std::max(ratio, static_cast<double>(held) / static_cast<double>(bytes));
}

// Room a budget's guard keeps for the real tensors answering an op holds on the step's thread
// (stand-ins, a composite kernel's factory calls), beside the worker's (Capture::shape,
// Worker::reserve_for_stand_ins): reserved before they are made, released when it goes, after
// the caller let go of the answer's outputs. Without a guard it reserves nothing.
class AnswerRoom {
 public:
  using Reserve = std::function<void(int64_t)>;
  explicit AnswerRoom(Reserve reserve) : reserve_(std::move(reserve)) {}
  ~AnswerRoom() {
    if (reserved_) reserve_(0);
  }
  AnswerRoom(const AnswerRoom&) = delete;
  AnswerRoom& operator=(const AnswerRoom&) = delete;
  bool active() const { return static_cast<bool>(reserve_); }
  // Room for `ratio` bytes per byte of the `bytes` of arguments (a page more).
  void reserve(double ratio, int64_t bytes) {
    if (!reserve_ || ratio <= 0 || bytes <= 0) return;
    reserve_(static_cast<int64_t>(ratio * static_cast<double>(bytes)) + 4096);
    reserved_ = true;
  }

 private:
  Reserve reserve_;
  bool reserved_ = false;
};

bool stand_in_outputs(OpWay& w, const c10::OperatorHandle& op, Args args, torch::jit::Stack& out,
                      c10::DispatchKeySet included, AnswerRoom& room) {
  if (!w.stand_ins) return false;
  // (bigger arguments: the op's compute twice, here and on the worker, against once at once)
  const int64_t bytes = args_bytes(args);
  if (bytes > kStandInBytes) return false;
  room.reserve(w.stand_in_ratio, bytes);
  NestedCPUBytesWindow held;  // (what they held at most, the kernel's outputs included)
  bool answered = true;
  try {
    at::AutoDispatchBelowADInplaceOrView below;
    c10::impl::ForceDispatchKeyGuard off(included, c10::impl::tls_local_dispatch_key_set().excluded_);
    for (const c10::IValue& a : args) out.push_back(map_tensors(a, stand_in));
    if (w.generator >= 0) out[w.generator] = at::detail::createCPUGenerator();
    op.callBoxed(out);
  } catch (const std::exception&) {
    out.clear();
    answered = false;
  }
  learn_ratio(w.stand_in_ratio, held.peak(), bytes);
  return answered;
}

// What `op` makes from `args`, computed without the worker, on `out` (its returns), or false:
// by the oracle where it answers, else by running the kernel on stand-ins.
bool shape_outputs(const c10::OperatorHandle& op, Args args, torch::jit::Stack& out, c10::DispatchKeySet included,
                   AnswerRoom& room) {
  if (g_shapes_broken.load(std::memory_order_relaxed)) return false;
  OpWay& w = way_of(op);
  if (w.way != Way::kNone && (w.answered > 0 || w.tried < kTriesUnanswered)) {
    ++w.tried;
    // (a composite kernel's factory calls, `zeros` in select_backward, skip the capture's key:
    // real tensors, allocated here beside the worker; a guard keeps room for what they held)
    if (room.active() && w.shaped_ratio > 0) room.reserve(w.shaped_ratio, args_bytes(args));
    NestedCPUBytesWindow held;
    bool answered = false;
    try {
      ShapeScope scope;
      for (const c10::IValue& a : args) out.push_back(map_tensors(a, as_shape));
      shape_call(op, &out);
      ++w.answered;
      answered = true;
    } catch (const std::exception&) {  // (NotShaped; c10::Error: a kernel read data, a check failed)
      out.clear();
    }
    if (held.peak() > 0) learn_ratio(w.shaped_ratio, held.peak(), args_bytes(args));
    if (answered) return true;
  }
  return stand_in_outputs(w, op, args, out, included, room);
}

}  // namespace
}  // namespace coexec
