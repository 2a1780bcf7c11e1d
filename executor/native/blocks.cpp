// Native block runs for the executor (executor/native.py builds and loads this file).
//
// Two things live here, both mirrors of Python code in executor/ with the same contracts:
//
// * LiveBytes: the executor's count of live storages and arena regions (executor/memory.py,
//   whose docstring explains the rules). With the extension loaded the executor uses this one,
//   so a block run without the GIL and the Python handlers count the same storages.
// * run_block: a launched block's remaining ops (executor/stream.py Run instructions, in the
//   planned order), converted to boxed dispatcher calls while the GIL is held, then run with
//   the GIL released: the same ATen kernels, on the same thread, with the same dispatch and
//   grad-mode state as the Python loop (Worker.run, run_in_arena, _retire), so results are
//   bit-equal. Values freed and made go back into the worker's table when the block is done.

#include <torch/extension.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>

#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;
using torch::jit::Stack;

namespace {

constexpr int64_t kAllocated = -1;
constexpr int64_t kOldArena = -2;

// The storage a tensor's memory belongs to, by its data address (0: none to count).
int64_t storage_key(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || !t.has_storage()) return 0;
  return reinterpret_cast<int64_t>(t.storage().data());
}

struct ArenaOut {
  int64_t offset;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;
  at::ScalarType dtype;
  int64_t nbytes;
};

struct Entry {
  int64_t count;
  int64_t nbytes;
  int64_t offset;  // in the arena, or kAllocated, or kOldArena
};

class LiveBytes {
 public:
  int64_t live = 0;
  int64_t peak = 0;

  std::optional<at::Tensor> arena() const { return arena_; }

  void attach(const std::optional<at::Tensor>& arena) {
    if (arena.has_value() == arena_.has_value() &&
        (!arena.has_value() || arena->unsafeGetTensorImpl() == arena_->unsafeGetTensorImpl()))
      return;
    for (auto& kv : storages_)
      if (kv.second.offset >= 0) kv.second.offset = kOldArena;
    live -= size_;
    arena_ = arena;
    regions_.clear();
    if (!arena.has_value()) {
      base_ = 0;
      size_ = 0;
      return;
    }
    base_ = reinterpret_cast<int64_t>(arena->data_ptr());
    size_ = arena->numel();
    live += size_;
    if (live > peak) peak = live;
  }

  at::Tensor region(int64_t offset, int64_t nbytes) const {
    TORCH_CHECK(arena_.has_value(), "no arena attached");
    int64_t n = std::max<int64_t>(nbytes, 1);
    TORCH_CHECK(offset >= 0 && offset + n <= size_, "region outside the arena");
    at::Tensor keep = *arena_;
    return torch::from_blob(
        reinterpret_cast<char*>(base_) + offset, {n}, [keep](void*) {},
        at::TensorOptions().dtype(at::kByte).device(keep.device()));
  }

  bool free(int64_t offset, int64_t nbytes) const {
    if (offset < 0 || offset + nbytes > size_) return false;
    auto it = regions_.lower_bound(offset + nbytes);
    if (it == regions_.begin()) return true;
    --it;
    return it->second <= offset;
  }

  bool all_free(const std::vector<ArenaOut>& outs) const {
    for (const auto& o : outs)
      if (!free(o.offset, o.nbytes)) return false;
    return true;
  }

  bool in_arena(const at::Tensor& t) const {
    if (!arena_.has_value() || t.layout() != at::kStrided || !t.has_storage()) return false;
    int64_t p = storage_key(t);
    return base_ <= p && p < base_ + size_;
  }

  int64_t offset_of(const at::Tensor& t) const { return storage_key(t) - base_; }

  // Is t's storage counted already? (then add only counts one more value on it)
  bool counted(int64_t key) {
    auto it = storages_.find(key);
    if (it == storages_.end()) return false;
    it->second.count += 1;
    return true;
  }

  // A storage not counted yet: the step's, unless one of the op's inputs lies on it.
  void add_new(const at::Tensor& t, int64_t key, const std::vector<int64_t>& inputs) {
    for (int64_t k : inputs)
      if (k == key) return;
    int64_t n = static_cast<int64_t>(t.storage().nbytes());
    int64_t offset = key - base_;
    if (arena_.has_value() && 0 <= offset && offset < size_) {
      storages_[key] = Entry{1, n, offset};
      regions_[offset] = offset + std::max<int64_t>(n, 1);
      return;
    }
    storages_[key] = Entry{1, n, kAllocated};
    live += n;
    if (live > peak) peak = live;
  }

  void remove(const at::Tensor& t) {
    int64_t key = storage_key(t);
    if (!key) return;
    auto it = storages_.find(key);
    if (it == storages_.end()) return;
    if (--it->second.count == 0) {
      Entry e = it->second;
      storages_.erase(it);
      if (e.offset == kAllocated)
        live -= e.nbytes;
      else if (e.offset >= 0)
        regions_.erase(e.offset);
    }
  }

  void reset_peak() { peak = live; }

  // Take over the count of executor/memory.py's LiveBytes (its storages: key -> [values on
  // it, bytes, offset]) when the native runner becomes ready mid-run.
  void adopt(int64_t live_now, int64_t peak_now, const std::optional<at::Tensor>& arena,
             const py::dict& storages) {
    clear();
    live = live_now;
    peak = peak_now;
    arena_ = arena;
    if (arena.has_value()) {
      base_ = reinterpret_cast<int64_t>(arena->data_ptr());
      size_ = arena->numel();
    }
    for (const auto& kv : storages) {
      auto e = kv.second.cast<std::vector<int64_t>>();
      storages_[kv.first.cast<int64_t>()] = Entry{e[0], e[1], e[2]};
      if (e[2] >= 0) regions_[e[2]] = e[2] + std::max<int64_t>(e[1], 1);
    }
  }

  void clear() {
    live = peak = 0;
    storages_.clear();
    regions_.clear();
    arena_.reset();
    base_ = size_ = 0;
  }

 private:
  std::optional<at::Tensor> arena_;
  int64_t base_ = 0;
  int64_t size_ = 0;
  std::unordered_map<int64_t, Entry> storages_;
  std::map<int64_t, int64_t> regions_;  // live arena storages: offset -> end
};

void input_keys(const Stack& stack, std::vector<int64_t>& keys) {
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
void flatten(const Stack& stack, std::vector<at::Tensor>& out) {
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

// An ATen overload the dispatcher knows (looked up once per OpOverload).
struct Op {
  c10::OperatorHandle handle;
  py::object func;  // the OpOverload: kept alive, reported back on a failed out= try
};

struct Ref {
  size_t index;  // position in the schema's arguments
  int64_t item;  // index in a tensor-list argument, or -1
  int64_t vid;
};

struct Step {
  std::shared_ptr<Op> op;
  Stack stack;  // the arguments, value references still to fill in
  std::vector<Ref> refs;
  std::vector<int64_t> outs;
  std::vector<std::pair<int64_t, int64_t>> moves;
  std::shared_ptr<Op> out_op;  // the out= variant when planned into the arena
  std::vector<int64_t> out_map;  // per out= argument: -1 - k for output k, else the stack index
  std::vector<ArenaOut> arena;
  bool grad_mode = true;
  bool keep_result = false;
  int64_t op_index = -1;
  Stack result;  // kept for keep_result
};

// (leaked on purpose: it holds Python objects, which must not be released after the
// interpreter has finalized)
std::unordered_map<PyObject*, std::shared_ptr<Op>>& op_cache() {
  static auto* cache = new std::unordered_map<PyObject*, std::shared_ptr<Op>>();
  return *cache;
}

// The dispatcher's handle for an OpOverload, or null (not an ATen-style operator).
std::shared_ptr<Op> find_op(const py::handle& func) {
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
std::vector<int64_t> out_arguments(const Op& op, const Op& out_op, const py::tuple& names) {
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
py::object dummy_tensor() {
  static PyObject* dummy = THPVariable_Wrap(at::empty({0}));
  return py::reinterpret_borrow<py::object>(dummy);
}

// A new list with the items of a sequence (the Run's own lists stay as they are).
py::list copied(const py::handle& seq) {
  return py::reinterpret_steal<py::list>(PySequence_List(seq.ptr()));
}

bool wants_tensor(const c10::Argument& formal) {
  return formal.type()->kind() == c10::TypeKind::TensorType;
}

py::object wrapped(const py::handle& x) {
  if (THPVariable_Check(x.ptr()) || x.is_none()) return py::reinterpret_borrow<py::object>(x);
  if (!(PyBool_Check(x.ptr()) || PyLong_Check(x.ptr()) || PyFloat_Check(x.ptr()) || PyComplex_Check(x.ptr())))
    return py::reinterpret_borrow<py::object>(x);
  at::Tensor t = at::scalar_to_tensor(torch::jit::toIValue(x, c10::NumberType::get()).toScalar());
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}

// One Run instruction as a Step: its arguments converted by its schema (the value references
// hold a stand-in tensor until the block fills them in). False: not runnable natively.
bool convert(const py::handle& run, const py::set& not_in_place, bool arena_attached, Step& step) {
  step.op = find_op(run.attr("func"));
  if (!step.op) return false;
  const auto& schema = step.op->handle.schema();
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
  // a Python number where the schema wants a tensor becomes a wrapped-number tensor, as the
  // Python binding makes it
  const auto& formals = schema.arguments();
  for (size_t i = 0; i < args.size() && i < formals.size(); ++i)
    if (wants_tensor(formals[i])) args[i] = wrapped(args[i]);
  for (const auto& kv : kwargs) {
    auto index = schema.argumentIndexWithName(kv.first.cast<std::string>());
    if (index.has_value() && wants_tensor(formals[*index])) kwargs[kv.first] = wrapped(kv.second);
  }
  try {
    step.stack = torch::jit::createStackForSchema(
        schema, py::tuple(args), py::reinterpret_borrow<py::kwargs>(kwargs), std::nullopt);
  } catch (const std::exception&) {
    return false;  // (arguments only Python's binding knows how to convert)
  }
  for (const auto& o : py::tuple(run.attr("outs"))) step.outs.push_back(o.cast<int64_t>());
  for (const auto& m : py::tuple(run.attr("moves"))) {
    auto move = py::reinterpret_borrow<py::tuple>(m);
    step.moves.emplace_back(move[0].cast<int64_t>(), move[1].cast<int64_t>());
  }
  step.grad_mode = run.attr("grad_mode").cast<bool>();
  step.keep_result = run.attr("keep_result").cast<bool>();
  step.op_index = run.attr("op_index").cast<int64_t>();
  py::object arena_out = run.attr("arena_out");
  if (!arena_out.is_none() && arena_attached) {
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

void put(Stack& stack, const Ref& ref, const at::Tensor& t) {
  if (ref.item < 0) {
    stack[ref.index] = t;
    return;
  }
  // (a copy of the list: the converted one is shared with the step's template, which must
  // not keep the value alive)
  auto list = stack[ref.index].toList().copy();
  list.set(ref.item, t);
  stack[ref.index] = list;
}

bool laid_out_as_planned(const at::Tensor& t, const ArenaOut& o) {
  return t.sizes().vec() == o.shape && t.strides().vec() == o.stride && t.scalar_type() == o.dtype;
}

class BlockRun {
 public:
  int64_t ran = 0;  // steps run (and retired): all, or those up to one that raised
  int64_t arena_hits = 0;
  int64_t arena_misses = 0;
  int64_t failed_at = -1;  // position of the step that raised (the last one run), or -1
  py::list not_in_place;  // out= overloads that did not write as planned
  py::list in_place;  // out= overloads that did

  void raise_error() const {
    if (error_) std::rethrow_exception(error_);
  }

  // Run the steps in order, the GIL released, up to one that raises. values, released,
  // pending and future are the worker's table and bookkeeping (Worker._retire); they are read
  // for the values these steps touch and written back after. False (nothing run) when a value
  // a step reads is not in the table: dropped or parked, which the Python runner brings back.
  bool run(std::vector<Step>& steps, py::dict values, py::set released, py::dict pending_py,
           py::set future_py, LiveBytes& memory, py::dict results) {
    std::unordered_map<int64_t, at::Tensor> table;
    std::unordered_map<int64_t, int64_t> pending;
    std::unordered_set<int64_t> future, let_go, made, freed, produced;
    // the worker's bookkeeping of a value the steps touch (read or made), taken once
    auto learn = [&](int64_t v) {
      if (pending.count(v)) return false;
      py::int_ key(v);
      pending[v] = pending_py.contains(key) ? pending_py[key].cast<int64_t>() : 0;
      if (released.contains(key)) let_go.insert(v);
      if (future_py.contains(key)) future.insert(v);
      return true;
    };
    for (const auto& s : steps) {
      std::vector<int64_t> reads;
      for (const auto& r : s.refs) reads.push_back(r.vid);
      for (const auto& m : s.moves) reads.push_back(m.first);
      for (auto v : reads) {
        if (!learn(v) || produced.count(v)) continue;  // (known, or made by an earlier step)
        PyObject* t = PyDict_GetItem(values.ptr(), py::int_(v).ptr());  // (borrowed)
        if (t == nullptr || !THPVariable_Check(t)) return false;
        table.emplace(v, THPVariable_Unpack(t));
      }
      for (auto v : s.outs) {
        learn(v);  // (runs after these may read it)
        produced.insert(v);
      }
      for (const auto& m : s.moves) {
        learn(m.second);
        produced.insert(m.second);
      }
    }
    std::unordered_set<Op*> failed_out, wrote_out;  // out= variants that failed, that wrote
    {
      py::gil_scoped_release no_gil;
      bool mode = c10::GradMode::is_enabled();
      std::vector<int64_t> keys;
      std::vector<at::Tensor> outs;
      std::vector<int64_t> done;
      for (size_t k = 0; k < steps.size() && !error_; ++k) {
        Step& s = steps[k];
        step(s, k, table, memory, failed_out, wrote_out, keys, outs);
        ++ran;
        // retire (Worker._retire): the values it read or made that Python let go of and
        // nothing still to run needs are freed
        done.clear();
        for (const auto& r : s.refs) done.push_back(r.vid);
        for (const auto& m : s.moves) done.push_back(m.first);
        for (auto v : done) --pending[v];
        for (auto v : s.outs) {
          future.erase(v);
          made.insert(v);
          done.push_back(v);
        }
        for (const auto& m : s.moves) {
          future.erase(m.second);
          made.insert(m.second);
          done.push_back(m.second);
        }
        if (let_go.empty()) continue;
        for (auto v : done) {
          auto p = pending.find(v);
          if (!let_go.count(v) || (p != pending.end() && p->second > 0) || future.count(v)) continue;
          let_go.erase(v);
          freed.insert(v);
          auto it = table.find(v);
          if (it != table.end()) {
            memory.remove(it->second);
            table.erase(it);
          }
          gone_.insert(v);
        }
      }
      c10::GradMode::set_enabled(mode);
    }
    for (auto* op : failed_out) not_in_place.append(op->func);
    for (auto* op : wrote_out) in_place.append(op->func);
    py::object pop = values.attr("pop");
    for (auto v : gone_)
      if (!table.count(v)) pop(py::int_(v), py::none());
    for (auto v : made) {
      auto it = table.find(v);
      if (it != table.end()) values[py::int_(v)] = py::cast(it->second);
    }
    py::object pop_pending = pending_py.attr("pop");
    for (const auto& kv : pending) {
      if (kv.second > 0)
        pending_py[py::int_(kv.first)] = py::int_(kv.second);
      else
        pop_pending(py::int_(kv.first), py::none());
    }
    py::object discard_future = future_py.attr("discard");
    for (auto v : made) discard_future(py::int_(v));
    py::object discard = released.attr("discard");
    for (auto v : freed) discard(py::int_(v));
    for (auto& s : steps)
      if (s.keep_result && !s.result.empty())
        results[py::int_(s.op_index)] = torch::jit::createPyObjectForStack(std::move(s.result));
    return true;
  }

 private:
  std::exception_ptr error_;
  std::unordered_set<int64_t> gone_;

  void step(Step& s, size_t k, std::unordered_map<int64_t, at::Tensor>& table, LiveBytes& memory,
            std::unordered_set<Op*>& failed_out, std::unordered_set<Op*>& wrote_out,
            std::vector<int64_t>& keys, std::vector<at::Tensor>& outs) {
    c10::GradMode::set_enabled(s.grad_mode);
    Stack stack = s.stack;
    for (const auto& r : s.refs) {
      auto it = table.find(r.vid);
      if (it == table.end()) {
        fail(k, std::make_exception_ptr(std::runtime_error(
                    "value " + std::to_string(r.vid) + " is not in the executor's table")));
        return;
      }
      put(stack, r, it->second);
    }
    input_keys(stack, keys);
    try {
      bool placed = false;
      if (s.out_op && !failed_out.count(s.out_op.get()) && memory.arena().has_value()) {
        if (!memory.all_free(s.arena)) {
          ++arena_misses;
        } else {
          placed = call_out(s, stack, memory, failed_out, wrote_out, outs);
        }
      }
      if (!placed) {
        s.op->handle.callBoxed(&stack);
        flatten(stack, outs);
        if (s.keep_result) s.result = stack;
      }
    } catch (...) {
      fail(k, std::current_exception());
      return;
    }
    
    for (const auto& m : s.moves) {
      auto it = table.find(m.first);
      if (it == table.end()) continue;
      at::Tensor t = it->second;
      table.erase(it);
      table[m.second] = t;
      gone_.erase(m.second);
    }
    for (const auto& m : s.moves) gone_.insert(m.first);
    size_t n = std::min(outs.size(), s.outs.size());
    for (size_t j = 0; j < n; ++j) {
      const at::Tensor& t = outs[j];
      auto it = table.find(s.outs[j]);
      if (it != table.end()) {
        if (it->second.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) continue;
        memory.remove(it->second);
        it->second = t;
      } else {
        table.emplace(s.outs[j], t);
      }
      int64_t key = storage_key(t);
      if (key && !memory.counted(key)) memory.add_new(t, key, keys);
    }
  }

  bool call_out(Step& s, const Stack& stack, LiveBytes& memory, std::unordered_set<Op*>& failed_out,
                std::unordered_set<Op*>& wrote_out, std::vector<at::Tensor>& outs) {
    std::vector<at::Tensor> views;
    for (const auto& o : s.arena) {
      at::Tensor raw = memory.region(o.offset, o.nbytes);
      int64_t item = c10::elementSize(o.dtype);
      views.push_back(raw.view(o.dtype).slice(0, 0, raw.numel() / item).as_strided(o.shape, o.stride));
    }
    Stack call;
    call.reserve(s.out_map.size());
    for (auto j : s.out_map) call.push_back(j < 0 ? c10::IValue(views[-1 - j]) : stack[j]);
    try {
      s.out_op->handle.callBoxed(&call);
    } catch (const c10::IndexError&) {
      throw;  // (not a RuntimeError in Python: the Python path would not catch these either)
    } catch (const c10::ValueError&) {
      throw;
    } catch (const c10::TypeError&) {
      throw;
    } catch (const c10::NotImplementedError&) {
      throw;
    } catch (const c10::Error&) {
      failed_out.insert(s.out_op.get());
      return false;
    }
    for (size_t j = 0; j < views.size(); ++j) {
      if (!laid_out_as_planned(views[j], s.arena[j])) {
        failed_out.insert(s.out_op.get());
        return false;
      }
    }
    wrote_out.insert(s.out_op.get());
    ++arena_hits;
    outs = views;
    return true;
  }

  void fail(size_t k, std::exception_ptr e) {
    error_ = e;
    failed_at = static_cast<int64_t>(k);
  }
};

}  // namespace

// Run a launched block's deferred runs natively (see BlockRun::run); None when one of them
// cannot run natively or a value it reads must be brought back first (the caller runs them in
// Python).
py::object run_block(py::list runs, py::dict values, py::set released, py::dict pending,
                     py::set future, LiveBytes& memory, py::dict results, py::set not_in_place) {
  std::vector<Step> steps(runs.size());
  bool arena = memory.arena().has_value();
  try {
    for (size_t k = 0; k < steps.size(); ++k)
      if (!convert(runs[k], not_in_place, arena, steps[k])) return py::none();
  } catch (const std::exception&) {
    return py::none();  // (a Run the Python runner reports on, if it is wrong)
  }
  auto block = std::make_shared<BlockRun>();
  if (!block->run(steps, values, released, pending, future, memory, results))
    return py::none();
  return py::cast(block);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<LiveBytes>(m, "LiveBytes")
      .def(py::init<>())
      .def_readwrite("live", &LiveBytes::live)
      .def_readwrite("peak", &LiveBytes::peak)
      .def_property_readonly("arena", &LiveBytes::arena)
      .def("attach", &LiveBytes::attach)
      .def("region", &LiveBytes::region)
      .def("free", &LiveBytes::free)
      .def("all_free",
           [](const LiveBytes& self, const py::tuple& outs) {
             for (const auto& o : outs) {
               auto out = py::reinterpret_borrow<py::tuple>(o);
               if (!self.free(out[0].cast<int64_t>(), out[4].cast<int64_t>())) return false;
             }
             return true;
           })
      .def("in_arena",
           [](const LiveBytes& self, const py::object& t) {
             return THPVariable_Check(t.ptr()) && self.in_arena(THPVariable_Unpack(t.ptr()));
           })
      .def("offset_of", &LiveBytes::offset_of)
      .def(
          "add",
          [](LiveBytes& self, const py::object& t, const py::object& inputs) {
            if (!THPVariable_Check(t.ptr())) return;
            const at::Tensor& x = THPVariable_Unpack(t.ptr());
            int64_t key = storage_key(x);
            if (!key || self.counted(key)) return;
            std::vector<int64_t> keys;
            for (const auto& a : inputs) {
              if (THPVariable_Check(a.ptr())) {
                keys.push_back(storage_key(THPVariable_Unpack(a.ptr())));
              } else if (py::isinstance<py::list>(a) || py::isinstance<py::tuple>(a)) {
                for (const auto& y : a)
                  if (THPVariable_Check(y.ptr())) keys.push_back(storage_key(THPVariable_Unpack(y.ptr())));
              }
            }
            self.add_new(x, key, keys);
          },
          py::arg("t"), py::arg("inputs") = py::tuple())
      .def("remove",
           [](LiveBytes& self, const py::object& t) {
             if (THPVariable_Check(t.ptr())) self.remove(THPVariable_Unpack(t.ptr()));
           })
      .def("reset_peak", &LiveBytes::reset_peak)
      .def("adopt", &LiveBytes::adopt)
      .def("clear", &LiveBytes::clear);
  py::class_<BlockRun, std::shared_ptr<BlockRun>>(m, "BlockRun")
      .def_readonly("ran", &BlockRun::ran)
      .def_readonly("arena_hits", &BlockRun::arena_hits)
      .def_readonly("arena_misses", &BlockRun::arena_misses)
      .def_readonly("failed_at", &BlockRun::failed_at)
      .def_readonly("not_in_place", &BlockRun::not_in_place)
      .def_readonly("in_place", &BlockRun::in_place)
      .def("raise_error", &BlockRun::raise_error);
  m.def("run_block", &run_block);
}
