// Capture's tape and worker (capture.cpp): a taped op, and the thread that runs taped ops without the GIL.
// Internal to capture.cpp, the only file that includes it (hence the anonymous namespace).
#pragma once

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <Python.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "capture_placeholders.h"
#include "capture_shapes.h"
#include "cpu_bytes.h"
#include "grave.h"
#include "openmp_team.h"

namespace coexec {
namespace {

namespace py = pybind11;

// -- the tape --------------------------------------------------------------------------------
// A taped op holds its placeholders' slots, not the placeholders: autograd lets a gradient be
// stolen into ``.grad`` only when nothing else holds its TensorImpl (AccumulateGrad's use-count
// check), so a tape holding them would change which ops the backward makes.
//
// An entry is flat (its vectors are cleared, not freed, when the op has run), and the worker's
// entries are reused in place (its ring, below): in steady state taping an op allocates nothing.

std::shared_ptr<Slot> slot_of(const at::Tensor& t) { return is_ph(t) ? impl_of(t)->slot : nullptr; }

struct TapeEntry {
  const c10::OperatorHandle* op = nullptr;  // null: the worker stops
  bool grad_mode = true;
  int64_t index = 0;  // the op's place in its step (errors name it)
  // per argument: its value (placeholders left undefined) and where its slots begin in `slots`
  // (one per tensor in it: its placeholder's slot, or null; none for an argument without one)
  std::vector<c10::IValue> args;
  std::vector<uint32_t> arg_slots;
  std::vector<std::shared_ptr<Slot>> slots;
  // per return: where its placeholders' slots begin in `out_slots`
  std::vector<uint32_t> out_begin;
  std::vector<std::shared_ptr<Slot>> out_slots;
  // values the skeleton let go of since the op before (t_trash): let go of by the worker
  std::vector<at::Tensor> trash;
  // slots the skeleton let go of that something else holds (t_banish)
  std::vector<std::weak_ptr<Slot>> banished;  // (weakly: an op's own hold ends when it ran)
  // per out slot, the metadata the shape oracle answered with (capture_shapes.h): checked when it runs
  std::vector<TensorMeta> expect;
  // under a budget's guard: the bytes of the new storages its outputs will have (not views), and
  // whether it ran before the step's first backward() (its values may get a recipe)
  int64_t made_bytes = 0;
  bool forward = true;

  // Ready for another op (capacity kept).
  void clear() {
    op = nullptr;
    args.clear();
    arg_slots.clear();
    slots.clear();
    out_begin.clear();
    out_slots.clear();
    trash.clear();
    banished.clear();
    expect.clear();
    made_bytes = 0;
    forward = true;
  }

  // Append argument `iv`.
  void add_arg(c10::IValue&& iv) {
    const auto begin = static_cast<uint32_t>(slots.size());
    arg_slots.push_back(begin);
    if (!has_tensor(iv)) {
      args.push_back(std::move(iv));
      return;
    }
    bool any = false;
    each_tensor(iv, [&](const at::Tensor& t) {
      slots.push_back(slot_of(t));
      any = any || slots.back();
    });
    if (!any) {
      slots.resize(begin);
      args.push_back(std::move(iv));
      return;
    }
    args.push_back(map_tensors(iv, [](const at::Tensor& t) { return is_ph(t) ? at::Tensor() : t; }));
  }

  // Argument `i` with its placeholders' values in place.
  c10::IValue real_arg(size_t i) const {
    const uint32_t begin = arg_slots[i];
    const uint32_t end = i + 1 < arg_slots.size() ? arg_slots[i + 1] : static_cast<uint32_t>(slots.size());
    if (begin == end) return args[i];
    uint32_t k = begin;
    return map_tensors(args[i], [&](const at::Tensor& t) {
      const auto& s = slots[k++];
      return s ? value_of(*s) : t;
    });
  }

  // The slots of return `r` (begin, end) in out_slots.
  std::pair<uint32_t, uint32_t> outs_of(size_t r) const {
    return {out_begin[r], r + 1 < out_begin.size() ? out_begin[r + 1] : static_cast<uint32_t>(out_slots.size())};
  }
};

// Does `op` write its argument `i`? As its schema says, and batch norm's running statistics,
// which native_batch_norm (the CPU's training batch norm) updates in place with no annotation.
bool writes_argument(const c10::OperatorHandle& op, size_t i) {
  const auto& args = op.schema().arguments();
  if (i < args.size() && args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) return true;
  static const c10::OperatorName bn("aten::native_batch_norm", "");
  return (i == 3 || i == 4) && op.operator_name() == bn;
}

// -- a described step: what each op read, wrote and made, for a memory plan ------------------
// Storages are numbered in the order met (a view shares its base's); one first met as an input
// existed before the step. The log holds them weakly: the StorageImpl's memory stays (so its
// address is not reused within the step), its data goes when the program lets go of it.

struct LoggedOp {
  int64_t index = 0;  // the op's place in the step
  const c10::OperatorHandle* op = nullptr;
  int64_t ns = 0;
  bool at_once = false;  // ran at once on the step's thread (its result read by Python)
  bool random = false;   // draws from a generator
  bool backward = false;  // issued after the step's first backward() began (its gradients, the update)
  int64_t workspace = 0;  // bytes its kernel allocated and freed again (counted: cpu_bytes.h)
  std::vector<int64_t> reads, writes, makes;  // storage numbers
  // per storage made: the allocations of its bytes its kernel made before it (an arena region
  // passes over as many: native/arena.h)
  std::vector<int32_t> made_after;
  std::vector<std::pair<uint64_t, int64_t>> values;  // per placeholder it made: (number, storage)
};

class StepLog {
 public:
  std::vector<LoggedOp> ops;
  std::vector<int64_t> nbytes;   // per storage
  std::vector<bool> before;      // per storage: it existed before the step
  // per storage that existed before the step: its StorageImpl's address, which names it in other
  // steps' logs too (a program's state, read by some of its paths; 0: made in the step)
  std::vector<uintptr_t> where;
  std::vector<uint64_t> fetched;  // numbers of the values Python read

  void clear() {
    ops.clear();
    nbytes.clear();
    before.clear();
    where.clear();
    fetched.clear();
    ids_.clear();
    held_.clear();
  }

  // Op `op` (place `index`) is about to run on the tensors of `stack` (its arguments).
  void start(const c10::OperatorHandle& op, int64_t index, const torch::jit::Stack& stack, bool at_once,
             bool backward) {
    LoggedOp l;
    l.index = index;
    l.op = &op;
    l.at_once = at_once;
    l.backward = backward;
    l.random = op.hasTag(at::Tag::nondeterministic_seeded);
    CountingCPUAllocator::open_window();  // (installed with the worker: Worker's constructor)
    allocations_.clear();
    t_allocations = &allocations_;
    for (size_t i = 0; i < stack.size(); ++i) {
      const bool written = writes_argument(op, i);
      each_tensor(stack[i], [&](const at::Tensor& t) {
        if (!t.defined() || !t.has_storage()) return;
        (written ? l.writes : l.reads).push_back(storage(t, true));
      });
    }
    ops.push_back(std::move(l));
  }

  // The op started last ran for `ns`, giving `out` (its returns on the stack), whose
  // placeholders' slots are `slots` (per tensor returned, in order; null: none).
  void finish(const torch::jit::Stack& out, const std::vector<const Slot*>& slots, int64_t ns) {
    LoggedOp& l = ops.back();
    l.ns = ns;
    t_allocations = nullptr;
    const auto [peak, end] = CountingCPUAllocator::close_window();
    l.workspace = std::max<int64_t>(0, peak - std::max<int64_t>(0, end));
    size_t k = 0;
    const auto one = [&](const at::Tensor& t) {
      const Slot* s = k < slots.size() ? slots[k] : nullptr;
      ++k;
      // (a placeholder written in place holds its slot's identity, not its value's storage)
      if (!t.defined() || is_ph(t) || !t.has_storage()) return;
      const size_t known = nbytes.size();
      const int64_t sid = storage(t, false);
      if (static_cast<size_t>(sid) >= known) {
        l.makes.push_back(sid);
        l.made_after.push_back(allocated_before(t.storage().data(), static_cast<int64_t>(t.storage().nbytes())));
      }
      if (s != nullptr && s->id != 0) l.values.emplace_back(s->id, sid);
    };
    for (const c10::IValue& r : out) each_tensor(r, one);
  }

  // A value dropped from storage `was` is made again in `t`: the same storage to the plan (read
  // as an input, a storage first met counts as existing before the step, its state; a guarded
  // description counted the values the guard made again so, and planned them as persistent).
  void remade(const at::Tensor& t, const void* was) {
    if (was == nullptr || !t.has_storage()) return;
    const auto it = ids_.find(static_cast<const c10::StorageImpl*>(was));
    if (it == ids_.end()) return;
    if (ids_.try_emplace(t.storage().unsafeGetStorageImpl(), it->second).second)
      held_.emplace_back(t.storage().getWeakStorageImpl());
  }

 private:
  std::unordered_map<const c10::StorageImpl*, int64_t> ids_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> held_;
  std::vector<std::pair<int64_t, const void*>> allocations_;  // the op's (t_allocations)

  // How many allocations of `nbytes` the op made before the one at `data` (0 where not found).
  int32_t allocated_before(const void* data, int64_t nbytes) const {
    int32_t before = 0;
    for (const auto& [n, p] : allocations_) {
      if (p == data) return before;
      if (n == nbytes) ++before;
    }
    return 0;
  }

  int64_t storage(const at::Tensor& t, bool input) {
    const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    auto [it, fresh] = ids_.try_emplace(impl, static_cast<int64_t>(nbytes.size()));
    if (fresh) {
      nbytes.push_back(static_cast<int64_t>(t.storage().nbytes()));
      before.push_back(input);
      where.push_back(input ? reinterpret_cast<uintptr_t>(impl) : 0);
      held_.emplace_back(t.storage().getWeakStorageImpl());
    }
    return it->second;
  }
};

// -- memory plans: values dropped after an op and made again when next read -------------------

// Values parked in the host pool (executor/step_plans.py, Park): all those on one storage, copied
// into its slice of the pool and released after the op at `out_after`, copied back into new
// memory after the op at `back_after`.
struct ParkPlan {
  std::vector<uint32_t> values;
  int64_t out_after = 0, back_after = 0, host_offset = 0, host_bytes = 0;
};

// A park's two moments in the step: out (after `place`) or back.
struct ParkEvent {
  int64_t place = 0;
  bool back = false;
  uint32_t park = 0;  // index in Drops::parks
};

// A memory plan for a path (made from a described step): per place, the op expected there (null:
// one that ran at once), which values (by number in the step) keep the op that made them, and
// after which place which of them are dropped, and which are parked in the host pool (parks).
// A step that meets another op than the plan's, or
// a value larger than the planned step's (its sizes grew: the plan's drops were chosen for less),
// stops following it there; what it dropped is made again when read, so a plan never changes a
// value, only when memory is held.
struct Drops {
  std::vector<const c10::OperatorHandle*> ops;
  std::vector<uint8_t> keep;  // per value number
  std::vector<std::pair<int64_t, std::vector<uint32_t>>> after;  // (place, values), ascending
  std::vector<int64_t> value_bytes;  // per value number: its storage's bytes in the planned step (0: not known)
  std::vector<ParkPlan> parks;
  std::vector<ParkEvent> park_events;  // by place, ascending (at one place: outs before backs)
  std::vector<int32_t> park_of;        // per value number: its park (-1: none)
  int64_t host_bytes = 0;              // the pool the parks need
  // the arena (arena=True): per place, the regions its kernel's allocations may take
  // (arena_regions[begin, end)); the plan holds the arena, a storage in it holds it too
  std::unique_ptr<ArenaHandle> arena;
  std::vector<uint32_t> arena_regions;
  struct ArenaPlace {
    uint32_t begin = 0, end = 0;  // its regions: arena_regions[begin, end)
    int64_t bytes = 0;            // theirs together
  };
  std::vector<ArenaPlace> arena_at;  // per place

  // The placements of the op at `place` if it is the plan's op there (false: none).
  bool offer(int64_t place, const c10::OperatorHandle* op, ArenaOffer& out) const {
    if (!arena || place < 0 || static_cast<size_t>(place) >= arena_at.size() || ops[place] != op) return false;
    const ArenaPlace& at = arena_at[place];
    if (at.begin == at.end) return false;
    out = ArenaOffer{arena->arena, arena_regions.data() + at.begin, at.end - at.begin, at.bytes};
    return true;
  }
};

// A storage parked in the host pool (Worker::park): the slots whose values were on it, as they
// were, and where its bytes are. Its values come back together on one new storage (so views
// still alias), when the plan says, when one is read first (value_of), or at the step's end
// (the pool is the next step's).
struct Parked {
  struct Member {
    std::weak_ptr<Slot> slot;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
    caffe2::TypeMeta dtype;
    c10::DispatchKeySet keys;
  };
  std::vector<Member> members;
  const uint8_t* host = nullptr;  // its slice of the pool
  int64_t nbytes = 0;
  c10::Allocator* allocator = nullptr;  // its storage's: the memory it comes back to
  bool back = false;
};

std::atomic<int64_t> g_parked{0};       // storages parked (in all)
std::atomic<int64_t> g_back_early{0};   // of them, brought back before the plan said (read early, or at the step's end)

// Bring parked storage `p` back: new memory from its allocator, its bytes copied in, each
// member slot's value on it again, as it was. `early`: before its planned place.
void bring_back(Parked& p, bool early) {
  if (p.back) return;
  p.back = true;
  if (std::none_of(p.members.begin(), p.members.end(), [](const Parked::Member& m) { return !m.slot.expired(); }))
    return;  // (let go of meanwhile: nothing to bring back)
  c10::Storage st(c10::Storage::use_byte_size_t(), p.nbytes, p.allocator, /*resizable=*/false);
  if (p.nbytes > 0) std::memcpy(st.mutable_data(), p.host, p.nbytes);
  for (Parked::Member& m : p.members) {
    auto s = m.slot.lock();
    if (!s || s->parked.get() != &p) continue;
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(st), m.keys, m.dtype);
    t.unsafeGetTensorImpl()->set_sizes_and_strides(m.sizes, m.strides, m.offset);
    s->real = std::move(t);
    s->parked.reset();
  }
  if (early) g_back_early.fetch_add(1, std::memory_order_relaxed);
}

// The op that made a value, kept to make it again: the taped op, holding its inputs (not its
// outputs: they hold it).
struct Recipe {
  TapeEntry entry;  // (its out_slots null: `outs` instead)
  std::vector<std::weak_ptr<Slot>> outs;
  // a guard's (Worker::guard): kept after a remake, so the value may be dropped again (a plan's
  // goes, letting go of its inputs, as the plan counts); its slots count it (Slot::recipe_holds)
  bool again = false;
  // a guard's inputs that cannot be dropped (no recipe: random, written, small), held weakly
  // until one of its values is dropped (arm): holding them would keep memory eager frees
  std::vector<std::pair<uint32_t, std::weak_ptr<Slot>>> weak;  // (place in entry.slots, slot)
  // a guard's in a described step: its log, told of the values made again (StepLog::remade)
  StepLog* log = nullptr;

  // Hold the weakly held inputs: false if one is gone (its values cannot be made again).
  bool arm() {
    if (weak.empty()) return true;
    std::vector<std::shared_ptr<Slot>> held;  // (the step's thread may let go of one meanwhile)
    held.reserve(weak.size());
    for (const auto& [k, w] : weak) {
      held.push_back(w.lock());
      if (!held.back()) return false;
    }
    for (size_t i = 0; i < weak.size(); ++i) {
      held[i]->recipe_holds.fetch_add(1, std::memory_order_relaxed);
      entry.slots[weak[i].first] = std::move(held[i]);
    }
    weak.clear();
    return true;
  }

  Recipe() = default;
  Recipe(const Recipe&) = delete;
  Recipe& operator=(const Recipe&) = delete;
  ~Recipe() {
    if (again)
      for (const auto& s : entry.slots)
        if (s) s->recipe_holds.fetch_sub(1, std::memory_order_relaxed);
  }
};

// Drop the value of `s`, which has a recipe (made again where it is next read).
void drop(Slot& s) {
  s.dropped_from = nullptr;
  if (s.real.has_storage()) {
    s.dropped_bytes = static_cast<int64_t>(s.real.storage().nbytes());
    s.dropped_from = s.real.storage().unsafeGetStorageImpl();
  }
  s.real = at::Tensor();
}

std::atomic<int64_t> g_remade{0};  // values made again (in all)
std::atomic<int64_t> g_remade_ns{0};  // the time their ops took
// Remakes running on this thread: one inside another (a dropped input of a dropped value, made
// while the outer one gathers its arguments) is in the outer one's time, not counted again.
thread_local int t_remaking = 0;
// On the worker: recipes used up there, whose arguments Python may hold too (a parameter): let
// go of like a taped op's (Worker::bury), not on the worker, where that would take the GIL.
thread_local std::vector<std::shared_ptr<Recipe>>* t_used_recipes = nullptr;
// On the worker under a guard: the values a guard's recipe made again since the last op ended
// (dropped again there if nothing but recipes holds them: Worker::bury).
thread_local std::vector<std::shared_ptr<Slot>>* t_remade = nullptr;

// On the worker under a guard: the guard (Worker), which makes room before a value is made
// again as before an op (a chain of dropped values made again at once would hold them all).
struct RoomMaker {
  virtual void make_room(const TapeEntry& e, int64_t need) = 0;
};
// (set while a step runs under a guard; the step's thread makes values again only while the
// worker has nothing to run, so the two never use it at once)
std::atomic<RoomMaker*> g_room{nullptr};

// Run one taped op on real tensors (the caller is below autograd) and give its outputs' values to
// their slots (`outs`: per tensor returned, its slot or null). `log`: the op is described in it.
// `room`: bytes it makes (a value made again), for the guard to make room for once its
// arguments are gathered (those made again first are held by the stack then, not dropped).
// The arena placements of the next op run_op calls on this thread (the worker's, following a
// plan with an arena): its kernel's allocations only, not those of dropped inputs it makes again.
// (set by the worker's loop right before the op's run_op, which takes it first)
thread_local const ArenaOffer* t_next_offer = nullptr;

// After a kernel ran with arena placements (its outputs on `stack`): a region holding one of
// them counts as placed; the others learn which allocation of their size is the output's
// (Arena::learn). Here, before anything may drop the outputs: learnt after the guard, a
// region whose output the guard dropped at once looked passed over, the next step's output
// skipped it, and every other step went 64 KB over a budget.
inline void learn_placements(const ArenaOffer& offer, const torch::jit::Stack& stack) {
  for (size_t i = 0; i < offer.count; ++i) {
    const uint32_t r = offer.regions[i];
    bool held = false;
    for (const c10::IValue& v : stack)
      each_tensor(v, [&](const at::Tensor& t) {
        held = held || (t.defined() && t.has_storage() && offer.arena->holds(r, t.storage().data()));
      });
    if (held) {
      g_arena_placed.fetch_add(1, std::memory_order_relaxed);
    } else {
      offer.arena->learn(r);
    }
  }
}

template <typename Out>
void run_op(const TapeEntry& e, Out outs, StepLog* log, int64_t room = -1, int64_t* workspace = nullptr) {
  const ArenaOffer* offer = std::exchange(t_next_offer, nullptr);
  c10::AutoGradMode grad(e.grad_mode);
  torch::jit::Stack stack;
  stack.reserve(e.args.size());
  for (size_t i = 0; i < e.args.size(); ++i) stack.push_back(e.real_arg(i));
  if (room >= 0)
    if (RoomMaker* m = g_room.load(std::memory_order_acquire)) m->make_room(e, room);
  std::chrono::steady_clock::time_point t0;  // (read only where the op is described)
  if (log != nullptr) {
    t0 = std::chrono::steady_clock::now();
    log->start(*e.op, e.index, stack, false, !e.forward);
  }
  // (the kernel's own bytes only: a window opened before the arguments were gathered also
  // counted the dropped inputs made again for it and the values evicted to make room for them,
  // a workspace of 120 KB for a ones_like of 4 bytes, which the guard then kept room for)
  if (workspace != nullptr && log == nullptr) CountingCPUAllocator::open_window();
  {
    ArenaOfferScope placed(offer);
    e.op->callBoxed(stack);
  }
  if (offer != nullptr) learn_placements(*offer, stack);
  if (workspace != nullptr && log == nullptr) {
    const auto [peak, end] = CountingCPUAllocator::close_window();
    *workspace = std::max<int64_t>(0, peak - std::max<int64_t>(0, end));
  }
  if (log != nullptr) {
    std::vector<const Slot*> made;
    for (size_t i = 0; i < e.out_slots.size(); ++i) made.push_back(e.out_slots[i].get());
    log->finish(stack, made, ns_since(t0));
  }
  for (size_t r = 0; r < e.out_begin.size(); ++r) {
    const auto [begin, end] = e.outs_of(r);
    if (begin == end) continue;
    if (stack[r].isTensorList()) {
      auto l = stack[r].toTensorVector();
      for (uint32_t i = begin; i < end; ++i) outs(i, l[i - begin]);
    } else {
      outs(begin, stack[r].toTensor());
    }
  }
}

// The shape oracle's answer against what the op made: a mismatch (a coexec bug) stops the oracle
// in this process (the capture empties its cache at the next step), and the step fails at its
// next wait (Python already holds tensors of the wrong shape).
void check_shaped(const TapeEntry& e, uint32_t i, const at::Tensor& t) {
  const TensorMeta& m = e.expect[i];
  if (m.dtype == c10::ScalarType::Undefined || m.same(t)) return;
  g_shapes_broken.store(true);
  TORCH_CHECK(false, "coexec: the capture computed that ", e.op->schema().name(), " makes sizes ",
              c10::IntArrayRef(m.sizes), ", strides ", c10::IntArrayRef(m.strides), ", offset ", m.offset, " and dtype ",
              m.dtype, ", but it made sizes ", t.sizes(), ", strides ", t.strides(), ", offset ", t.storage_offset(),
              " and dtype ", t.scalar_type(),
              " (a coexec bug: please report it; the capture runs such ops at once from now on in this process)");
}

// `workspace`: set to the bytes the op's kernel allocated and freed again (a described op's are its log's).
void run_entry(const TapeEntry& e, StepLog* log = nullptr, int64_t* workspace = nullptr) {
  run_op(e, [&e](uint32_t i, const at::Tensor& t) {
    if (!e.expect.empty()) check_shaped(e, i, t);
    if (e.out_slots[i]) e.out_slots[i]->real = t;
  }, log, -1, workspace);
}

const at::Tensor& value_of(Slot& s) {
  if (s.real.defined()) return s.real;
  if (s.parked) {
    const std::shared_ptr<Parked> p = s.parked;  // (bring_back resets the slot's)
    bring_back(*p, true);
    return s.real;
  }
  if (!s.recipe) return s.real;
  // (in either thread: the worker reading it, or the step's thread after the worker caught up)
  std::shared_ptr<Recipe> r = s.recipe;
  // (the capture's key off the step's thread: its bits cleared, the backend's too, which a set
  // difference keeps: with it, the op would come back to the capture's kernel)
  const auto tls = c10::impl::tls_local_dispatch_key_set();
  const c10::DispatchKeySet off(c10::DispatchKeySet::RAW,
                                tls.included_.raw_repr() & ~c10::DispatchKeySet(kKey).raw_repr());
  c10::impl::ForceDispatchKeyGuard no_capture(off, tls.excluded_);
  at::AutoDispatchBelowADInplaceOrView below;
  const TapeEntry& e = r->entry;
  const auto t0 = std::chrono::steady_clock::now();
  struct Nested {
    bool outer = t_remaking++ == 0;
    ~Nested() { --t_remaking; }
  } nested;
  run_op(e, [&r](uint32_t i, const at::Tensor& t) {
    auto o = r->outs[i].lock();
    if (o && !o->real.defined()) {
      if (r->again && t_remade != nullptr) t_remade->push_back(o);
      if (r->log != nullptr) r->log->remade(t, o->dropped_from);
      o->real = t;
      if (!r->again) o->recipe.reset();  // (a plan's: made again once, its inputs let go of, as it counts)
    }
  }, nullptr, s.dropped_bytes);
  g_remade.fetch_add(1, std::memory_order_relaxed);
  if (nested.outer) g_remade_ns.fetch_add(ns_since(t0), std::memory_order_relaxed);
  if (t_used_recipes != nullptr) t_used_recipes->push_back(std::move(r));
  return s.real;
}

// -- the worker ------------------------------------------------------------------------------
// Ops cross to the worker through a ring of entries with one writer (the step's thread) and one
// reader (the worker): the writer fills the next free entry in place and publishes it by a
// count, the reader runs it, clears it and counts it done. Neither side takes a lock per op;
// neither sleeps at once when there is nothing to do: the worker polls for a while before it
// waits (a wake-up per op cost a system call on both sides), and so does a drain. A full ring
// makes the writer wait for the worker (it is far ahead then).
// The worker polls for kSpin after its last op: long enough to span the Python between two
// steps of a loop (a batch drawn, a loss logged; 200 us did not span an eager step of a
// third of a millisecond, and each step paid for waking the worker). Then it naps, then sleeps.
constexpr auto kSpin = std::chrono::microseconds(1000);
constexpr auto kNap = std::chrono::microseconds(50);  // (the timer's slack makes it ~100 us)
constexpr auto kNapping = std::chrono::milliseconds(100);
constexpr int64_t kRing = 8192;  // entries (a power of two)

class Worker final : public RoomMaker {
 public:
  explicit Worker(int threads) : threads_(threads), ring_(kRing) {
    count_cpu_bytes();  // (coexec's CPU allocator: the worker's blocks kept for reuse)
    thread_ = std::thread([this] { loop(); });
  }

  ~Worker() {
    RoomMaker* self = this;
    g_room.compare_exchange_strong(self, nullptr);
    next_entry();  // (op null: the stop)
    publish();
    thread_.join();
  }

  // The entry the next op is written into (cleared); publish() hands it to the worker. The
  // step's thread only; waits while the ring is full.
  TapeEntry& next_entry() {
    const int64_t next = published_.load(std::memory_order_relaxed);  // (this thread's own count)
    if (next - done_seen_ >= kRing) {  // (done_ read only when the ring looks full)
      wait_without_gil(next - kRing + 1);
      done_seen_ = done_.load(std::memory_order_acquire);
    }
    TapeEntry& e = ring_[next & (kRing - 1)];
    e.clear();
    return e;
  }

  void publish() {
    published_.fetch_add(1, std::memory_order_seq_cst);
    wake_if(idle_);
  }

  // Wait until every op published so far has run (without the GIL, if this thread holds it).
  void drain() { wait_without_gil(published_.load(std::memory_order_relaxed)); }

  // The step ended: the worker lets its OpenMP team go if no op comes within its poll
  // (openmp_team.h).
  void release_team() {
    release_team_.store(true, std::memory_order_seq_cst);
    if (idle_.load(std::memory_order_seq_cst)) {  // (asleep: woken for it)
      { std::lock_guard<std::mutex> g(mu_); }
      cv_.notify_all();
    }
  }

  // The first failure since clear_error(): the op's index (-1: none) and what it threw.
  std::pair<int64_t, std::exception_ptr> error() {
    std::lock_guard<std::mutex> g(mu_);
    return {failed_at_, error_};
  }

  // nanoseconds the worker spent running ops
  int64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }

  // The next step's memory plan (null: none) and whether it is described, from the step's
  // thread while the worker has nothing to run (before the step's first op is published).
  // `cap`: the bytes the CPU allocator handed out since its reset_peak() (made()) that the step's
  // ops keep within (0: no guard; Worker::guard).
  // `paths`: the plans of the program's other paths (none with an arena), which the step may
  // take instead where its ops leave this plan's (switch_path).
  void set_step(std::shared_ptr<const Drops> drops, bool describe, uint64_t first_value, int64_t cap,
                const std::vector<std::shared_ptr<const Drops>>& paths = {}) {
    drops_ = std::move(drops);
    paths_.clear();
    path_ = 0;
    if (drops_) {
      paths_.push_back(drops_);
      paths_.insert(paths_.end(), paths.begin(), paths.end());
    }
    following_ = drops_ != nullptr;
    outgrew_ = false;
    next_drop_ = 0;
    next_park_ = 0;
    parkable_.clear();
    parked_.assign(drops_ ? drops_->parks.size() : 0, nullptr);
    int64_t host_bytes = 0;
    for (const auto& d : paths_) host_bytes = std::max(host_bytes, d->host_bytes);
    if (host_bytes > pool_bytes_) {  // (plain memory: the CPU allocator does not count it)
      pool_.reset(new uint8_t[host_bytes]);
      pool_bytes_ = host_bytes;
    }
    first_value_ = first_value;
    kept_.clear();
    readers_.clear();
    guarded_.clear();
    cap_ = cap;
    g_room.store(cap > 0 ? this : nullptr, std::memory_order_release);
    describing_ = describe;
    if (describe) log_.clear();
  }

  // The step ended (its live placeholders took their values): recipes let go of their inputs.
  void end_step() {
    for (auto& [n, w] : kept_)
      if (auto s = w.lock()) s->recipe.reset();
    for (auto& g : guarded_)
      if (auto s = g.slot.lock()) s->recipe.reset();
    kept_.clear();
    guarded_.clear();
    remade_.clear();
    readers_.clear();
    // (values parked and still held, by what the step left: back now, the pool is the next step's)
    for (auto& p : parked_)
      if (p) bring_back(*p, true);
    parked_.clear();
    for (auto& p : parked_on_other_paths_) bring_back(*p, true);
    parked_on_other_paths_.clear();
    paths_.clear();
    parkable_.clear();
    drops_.reset();
    cap_ = 0;
    g_room.store(nullptr, std::memory_order_release);
  }

  // The described step's log: the worker's ops, and those the step's thread ran at once (both
  // only while the worker has nothing to run).
  StepLog* log() { return describing_ ? &log_ : nullptr; }
  StepLog& last_log() { return log_; }

  // Did the step follow its plan to the end? Values dropped so far.
  bool followed() const { return following_; }
  // Which plan it followed to the end: 0 the step's, i the i-th of its other paths' (-1: none).
  int followed_path() const { return following_ ? path_ : -1; }
  // Did it stop following because a value was larger than the planned step's (sizes grew)?
  bool outgrew() const { return outgrew_; }
  int64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  // Values the guard dropped so far (Worker::make_room), and times it could not drop enough.
  int64_t evicted() const { return evicted_.load(std::memory_order_relaxed); }
  int64_t overruns() const { return overruns_.load(std::memory_order_relaxed); }

  // Let go of the arguments Python holds too that the worker laid aside (bury): GIL held.
  void exhume() { grave_.exhume(); }

  // how many arguments lie aside for exhume()
  int64_t buried() const { return grave_.count(); }

  void clear_error() {
    std::lock_guard<std::mutex> g(mu_);
    failed_at_ = -1;
    error_ = nullptr;
    failed_.store(false, std::memory_order_release);
  }

 private:
  int threads_;
  std::vector<TapeEntry> ring_;
  // (each side's counts on a cache line of their own: sharing one, every op of either side
  // took the line from the other core)
  alignas(64) std::atomic<int64_t> published_{0};  // entries the worker may run (written by the step's thread)
  int64_t done_seen_ = 0;                          // done_ as the step's thread last read it
  alignas(64) std::atomic<int64_t> done_{0};       // entries run (and cleared) by the worker
  std::atomic<int64_t> busy_ns_{0};
  alignas(64) std::mutex mu_;  // for sleeping and waking, and the failure
  std::condition_variable cv_;
  std::atomic<bool> idle_{false};      // the worker sleeps: a publish must wake it
  std::atomic<bool> napping_{false};   // the worker naps: a drain wakes it
  std::atomic<bool> draining_{false};  // a drain sleeps: the op that ends it must say so
  std::atomic<bool> failed_{false};    // ops after a failure are dropped until clear_error()
  int64_t failed_at_ = -1;
  std::exception_ptr error_;  // (raised in the step's thread as eager raises it: Capture::raise_failure)
  Grave grave_;                   // arguments Python holds too, let go of under the GIL
  std::vector<at::Tensor> held_;  // (scratch for bury)
  // the step's memory plan (Drops), as the worker follows it
  std::shared_ptr<const Drops> drops_;
  std::vector<std::shared_ptr<const Drops>> paths_;  // the step's plan, then its other paths' (set_step)
  int path_ = 0;                                     // which of them drops_ is
  std::vector<std::shared_ptr<Parked>> parked_on_other_paths_;  // parked by a plan the step left (switch_path)
  bool following_ = false;
  bool outgrew_ = false;
  std::atomic<bool> release_team_{false};  // (release_team: the worker lets its OpenMP team go)
  std::atomic<int64_t> making_{0};  // bytes the op in flight may make (make_room; reserve_for_stand_ins)
  size_t next_drop_ = 0;
  size_t next_park_ = 0;
  std::unordered_map<uint32_t, std::weak_ptr<Slot>> parkable_;  // by value number: a value a park names
  std::vector<std::shared_ptr<Parked>> parked_;  // per park of the plan: its storage, once parked
  std::unique_ptr<uint8_t[]> pool_;  // the host pool
  int64_t pool_bytes_ = 0;
  uint64_t first_value_ = 0;
  std::unordered_map<uint32_t, std::weak_ptr<Slot>> kept_;  // by value number: a value with a recipe
  // what recipes read (a slot, a storage) -> the recipes: a write to it first makes a dropped value
  // again, and makes the others values no plan may drop (their recipe would give another value)
  std::unordered_multimap<const void*, std::weak_ptr<Recipe>> readers_;
  std::atomic<int64_t> dropped_{0};
  // the budget's guard (make_room): the cap, the values it may drop (this step's, with a recipe),
  // per op the most its kernel allocated and freed again (its workspace), what it did
  struct Guarded {
    std::weak_ptr<Slot> slot;
    int64_t at;  // the op's place
  };
  int64_t cap_ = 0;
  std::vector<Guarded> guarded_;
  std::unordered_map<uint64_t, int64_t> workspace_;  // by op and place (workspace_key)
  std::atomic<int64_t> evicted_{0}, overruns_{0};
  bool describing_ = false;
  StepLog log_;
  std::vector<std::shared_ptr<Recipe>> used_recipes_;  // (t_used_recipes)
  std::vector<std::shared_ptr<Slot>> remade_;          // (t_remade)
  std::thread thread_;

  // Before op `e` runs: what it writes is no longer what a recipe reads.
  void guard_writes(const TapeEntry& e) {
    if (readers_.empty()) return;
    for (size_t i = 0; i < e.args.size(); ++i) {
      if (!writes_argument(*e.op, i)) continue;
      const uint32_t begin = e.arg_slots[i];
      const uint32_t end = i + 1 < e.arg_slots.size() ? e.arg_slots[i + 1] : static_cast<uint32_t>(e.slots.size());
      if (begin < end) {
        for (uint32_t k = begin; k < end; ++k)
          if (e.slots[k]) {
            Slot& w = *e.slots[k];
            if (w.recipe) {  // (written: its recipe would make the value before the write)
              if (!w.real.defined()) value_of(w);
              used_recipes_.push_back(std::move(w.recipe));
            }
            unrecipe(e.slots[k].get());
            if (e.slots[k]->real.defined()) unrecipe(e.slots[k]->real.storage().unsafeGetStorageImpl());
          }
      } else {
        each_tensor(e.args[i], [this](const at::Tensor& t) {
          if (t.defined() && t.has_storage()) unrecipe(t.storage().unsafeGetStorageImpl());
        });
      }
    }
  }

  // `input` is about to change: every recipe that reads it makes its dropped values now, and
  // its values can no longer be dropped.
  void unrecipe(const void* input) {
    auto [a, b] = readers_.equal_range(input);
    if (a == b) return;
    std::vector<std::shared_ptr<Recipe>> hit;
    for (auto it = a; it != b; ++it)
      if (auto r = it->second.lock()) hit.push_back(std::move(r));
    readers_.erase(a, b);
    for (auto& r : hit)
      for (auto& w : r->outs)
        if (auto o = w.lock()) {
          if (!o->real.defined() && o->recipe) {
            // (dropped: made now if it may be read, by the program, an op to run or another
            // dropped value's recipe; else forgotten, and so are recipes reading it)
            if (needed(o, kNeeded)) {
              value_of(*o);
            } else {
              forget(*o);
              continue;
            }
          }
          o->recipe.reset();
        }
    for (auto& r : hit) used_recipes_.push_back(std::move(r));  // (let go of in bury)
  }

  // Does something hold `s` besides the guard's recipes and `here` references: a placeholder
  // (the step's thread writes `holders`: a relaxed read sees it or an older count), an op to
  // run, a plan's recipe?
  static bool held_beside_recipes(const std::shared_ptr<Slot>& s, long here) {
    return __atomic_load_n(&s->holders, __ATOMIC_RELAXED) > 0 ||
           s.use_count() > here + s->recipe_holds.load(std::memory_order_relaxed);
  }

  // `s` can no longer be made again: nor can the values whose recipes read it (unrecipe).
  void forget(Slot& s) {
    s.recipe.reset();
    unrecipe(&s);
  }

  // May dropped `o` be read: does the program hold it, an op to run, or the recipe of a dropped
  // value that may be read (to `depth`: further, it counts as read)?
  bool needed(const std::shared_ptr<Slot>& o, int depth) {
    std::unordered_set<const Slot*> seen;
    return needed(o, depth, seen);
  }
  bool needed(const std::shared_ptr<Slot>& o, int depth, std::unordered_set<const Slot*>& seen) {
    if (!seen.insert(o.get()).second) return false;  // (found not needed, or being looked at)
    if (depth == 0 || held_beside_recipes(o, 1)) return true;
    auto [a, b] = readers_.equal_range(o.get());
    std::vector<std::shared_ptr<Recipe>> readers;
    for (auto it = a; it != b; ++it)
      if (auto r = it->second.lock()) readers.push_back(std::move(r));
    for (const auto& r : readers)
      for (const auto& w : r->outs)
        if (auto u = w.lock(); u && u != o && !u->real.defined() && u->recipe == r && needed(u, depth - 1, seen))
          return true;
    return false;
  }

  // After op `e` ran under a plan: its kept values get their recipe, and the values the plan
  // drops after it are dropped.
  void follow(const TapeEntry& e) {
    // (a value larger than planned: the guard alone holds the step from here, unless another
    // path's plan has this op here with values of these sizes. The plan's drops, followed beside
    // the guard at larger sizes, left it values to make again in chains: a batch grown 67% past
    // the planned one went up to 9% over its budget)
    const Fit fit = on_plan(*drops_, e) ? fits(*drops_, e) : Fit::kNo;
    if (fit != Fit::kExactly && !switch_path(e) && fit == Fit::kNo) {
      following_ = false;  // (another path: what was dropped is made again when read)
      outgrew_ = on_plan(*drops_, e);
      return;
    }
    const Drops& d = *drops_;
    if (!d.parks.empty())
      for (const auto& s : e.out_slots) {
        if (!s || s->id < first_value_) continue;
        const uint64_t n = s->id - first_value_;
        if (n < d.park_of.size() && d.park_of[n] >= 0) parkable_[static_cast<uint32_t>(n)] = s;
      }
    std::shared_ptr<Recipe> recipe;
    const bool remake = !e.out_slots.empty() && remakeable(*e.op);
    for (const auto& s : e.out_slots) {
      if (!remake || !s || s->id < first_value_) continue;
      const uint64_t n = s->id - first_value_;
      if (n >= d.keep.size() || !d.keep[n]) continue;
      if (!recipe) recipe = recipe_of(e);
      s->recipe = recipe;
      kept_[static_cast<uint32_t>(n)] = s;
    }
    for (; next_drop_ < d.after.size() && d.after[next_drop_].first <= e.index; ++next_drop_)
      for (uint32_t n : d.after[next_drop_].second) {
        const auto it = kept_.find(n);
        if (it == kept_.end()) continue;
        const auto s = it->second.lock();
        if (!s || !s->recipe || !s->real.defined()) continue;
        drop(*s);
        dropped_.fetch_add(1, std::memory_order_relaxed);
      }
    for (; next_park_ < d.park_events.size() && d.park_events[next_park_].place <= e.index; ++next_park_) {
      const ParkEvent& ev = d.park_events[next_park_];
      if (!ev.back) {
        park(ev.park);
      } else if (const auto& p = parked_[ev.park]) {
        bring_back(*p, false);
      }
    }
  }

  static bool on_plan(const Drops& d, const TapeEntry& e) {
    return e.index >= 0 && static_cast<size_t>(e.index) < d.ops.size() && d.ops[e.index] == e.op;
  }

  // Do op `e`'s values (on plan `d`'s path) have the planned step's sizes, or at most them?
  enum class Fit { kNo, kSmaller, kExactly };
  Fit fits(const Drops& d, const TapeEntry& e) const {
    Fit fit = Fit::kExactly;
    for (const auto& s : e.out_slots) {
      if (!s || s->id < first_value_ || !s->real.defined()) continue;
      const uint64_t n = s->id - first_value_;
      if (n >= d.value_bytes.size() || d.value_bytes[n] <= 0) continue;
      const auto nbytes = static_cast<int64_t>(s->real.storage().nbytes());
      if (nbytes > d.value_bytes[n]) return Fit::kNo;
      if (nbytes < d.value_bytes[n]) fit = Fit::kSmaller;
    }
    return fit;
  }

  // Op `e` left the plan's path, or made values of other sizes than it planned: follow instead
  // another path's plan with the same ops before it and `e` here with values of these sizes (a
  // branch the program took; a branch may differ in sizes alone, a layer's width). What this
  // plan did before `e` stands: values it dropped are made again where read, values it kept a
  // recipe for but the other drops are dropped when it says, values it parked come back when
  // read or at the step's end; the other plan's drops and parks before `e` are passed over (the
  // guard holds what they would have freed). So the step stays eager's whichever plans it
  // followed; planned together (coexec/native_budget.py, plan_native_paths), the two agree
  // before the branch.
  bool switch_path(const TapeEntry& e) {
    const auto k = static_cast<size_t>(std::max<int64_t>(e.index, 0));
    for (size_t i = 0; i < paths_.size(); ++i) {
      const Drops& o = *paths_[i];
      const auto& ours = drops_->ops;
      if (static_cast<int>(i) == path_ || !on_plan(o, e) || fits(o, e) != Fit::kExactly || ours.size() < k ||
          !std::equal(o.ops.begin(), o.ops.begin() + static_cast<std::ptrdiff_t>(k), ours.begin()))
        continue;
      for (auto& p : parked_)
        if (p) parked_on_other_paths_.push_back(std::move(p));
      drops_ = paths_[i];
      path_ = static_cast<int>(i);
      parked_.assign(o.parks.size(), nullptr);
      parkable_.clear();
      const auto place = static_cast<int64_t>(k);
      next_drop_ = static_cast<size_t>(
          std::lower_bound(o.after.begin(), o.after.end(), place, [](const auto& a, int64_t p) { return a.first < p; }) -
          o.after.begin());
      next_park_ = static_cast<size_t>(
          std::lower_bound(o.park_events.begin(), o.park_events.end(), place,
                           [](const ParkEvent& a, int64_t p) { return a.place < p; }) -
          o.park_events.begin());
      return true;
    }
    return false;
  }

  // Park the storage of plan park `k`'s values in its slice of the host pool and release it,
  // where that frees it: its values are all on one dense CPU storage of at most the slice's
  // bytes, which only their slots hold (else they stay, as eager keeps them).
  void park(uint32_t k) {
    const ParkPlan& plan = drops_->parks[k];
    std::vector<std::shared_ptr<Slot>> slots;
    const c10::StorageImpl* storage = nullptr;
    for (uint32_t n : plan.values) {
      const auto it = parkable_.find(n);
      if (it == parkable_.end()) continue;
      auto s = it->second.lock();
      if (!s || !s->real.defined()) continue;  // (let go of, or dropped by the guard: nothing to park)
      const at::Tensor& t = s->real;
      if (!t.has_storage() || t.layout() != c10::kStrided || !t.device().is_cpu() || t.requires_grad() ||
          t.use_count() != 1)
        return;
      const c10::StorageImpl* here = t.storage().unsafeGetStorageImpl();
      if (storage != nullptr && here != storage) return;
      storage = here;
      slots.push_back(std::move(s));
    }
    if (slots.empty()) return;
    const c10::Storage& st = slots.front()->real.storage();
    const auto nbytes = static_cast<int64_t>(st.nbytes());
    if (static_cast<size_t>(st.use_count()) != slots.size() || nbytes > plan.host_bytes || st.allocator() == nullptr ||
        plan.host_offset + nbytes > pool_bytes_)
      return;
    auto p = std::make_shared<Parked>();
    p->host = pool_.get() + plan.host_offset;
    p->nbytes = nbytes;
    p->allocator = st.allocator();
    if (nbytes > 0) std::memcpy(pool_.get() + plan.host_offset, st.data(), nbytes);
    for (const auto& s : slots) {
      const at::Tensor& t = s->real;
      p->members.push_back({s, t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.dtype(), t.key_set()});
    }
    for (const auto& s : slots) {
      s->parked = p;
      s->real = at::Tensor();
    }
    parked_[k] = std::move(p);
    g_parked.fetch_add(1, std::memory_order_relaxed);
  }

  // -- the budget's guard: values dropped where the step would go over its cap ----------------
  // A plan is made for the step described; a step larger than it (a longer sequence) or one
  // before the plan arrives is held within the budget by this guard instead, on the worker
  // (after DTR, Kirisame et al. 2021): every value the forward makes (of a storage of 4 KiB or
  // more, views included) keeps a recipe holding its inputs' slots (weakly those that cannot be
  // made again, until the value is dropped); a value the program lets go of that only recipes
  // hold is dropped then (bury), as eager frees it, its slot kept to make it again; before an op
  // (or a remake) whose outputs, inputs to make again and workspace would take the allocator past
  // the cap, values are dropped, cheapest to make again per byte and oldest first, values sharing
  // a storage together, none that would make a chain of dropped values longer than
  // kLongestChain, until they fit. What is dropped is made again where it is read, as a plan's
  // drops are; a write to what a recipe reads makes its dropped values first if they may still
  // be read (needed), else forgets them.
  static constexpr int64_t kGuardMinBytes = 4096;  // (smaller values are not worth a recipe)

  // What making `e`'s outputs again costs, modeled from sizes (the bytes it reads and writes,
  // and a matmul's or convolution's multiply-adds), never measured: a kernel's time varies with
  // the machine's load, and with it the guard's choice between values of equal size; one choice
  // made a chain of dropped values that a backward op needed at once, 5-21 KB past the budget in
  // 1 of 4 runs of tests/coexec/test_native_budget.py.
  static int64_t guard_cost(const TapeEntry& e) {
    int64_t bytes = 0;
    std::vector<at::Tensor> ins;  // (in argument order; its inputs are all made: it just ran)
    for (size_t i = 0; i < e.args.size(); ++i)
      each_tensor(e.real_arg(i), [&](const at::Tensor& t) {
        if (!t.defined()) return;
        bytes += static_cast<int64_t>(t.numel() * t.element_size());
        ins.push_back(t);
      });
    int64_t out_numel = 0;
    for (const auto& s : e.out_slots)
      if (s && s->real.defined()) {
        bytes += static_cast<int64_t>(s->real.numel() * s->real.element_size());
        out_numel += s->real.numel();
      }
    return bytes + multiply_adds(*e.op, ins, out_numel);
  }

  // A matmul's or convolution's multiply-adds (per output element, times its outputs); 0 for
  // other ops. `ins`: its tensor arguments in order.
  static int64_t multiply_adds(const c10::OperatorHandle& op, const std::vector<at::Tensor>& ins, int64_t out_numel) {
    const std::string& name = op.schema().name();
    if (name.find("conv") != std::string::npos) {  // (the weight: its elements per output channel)
      if (ins.size() < 2 || ins[1].dim() < 3) return 0;
      return ins[1].numel() / std::max<int64_t>(1, ins[1].size(0)) * out_numel;
    }
    // (the first matrix: `self` of mm, bmm, matmul, linear; mat1 where the first is added)
    size_t first = 0;
    if (name == "aten::addmm" || name == "aten::baddbmm" || name == "aten::addmv" || name == "aten::addbmm") {
      first = 1;
    } else if (name != "aten::mm" && name != "aten::bmm" && name != "aten::matmul" && name != "aten::linear" &&
               name != "aten::mv" && name != "aten::dot") {
      return 0;
    }
    if (ins.size() <= first || ins[first].dim() == 0) return 0;
    return ins[first].size(-1) * out_numel;
  }

  // After op `e` ran under a guard: its values get a recipe; those in storages of their own may
  // be dropped by make_room.
  void guard(const TapeEntry& e) {
    // (a gradient's recipe would hold the forward's values to the step's end through .grad)
    if (!e.forward || e.out_slots.empty() || t_remaking > 0 || !remakeable(*e.op)) return;
    std::shared_ptr<Recipe> recipe;
    int64_t cost = -1;
    for (const auto& s : e.out_slots) {
      if (!s || s->recipe || !s->real.defined() || s->id < first_value_ || !s->real.has_storage()) continue;
      const c10::Storage& st = s->real.storage();
      if (static_cast<int64_t>(st.nbytes()) < kGuardMinBytes) continue;
      if (!recipe) {
        recipe = recipe_of(e);
        recipe->again = true;
        recipe->log = log();
        for (uint32_t k = 0; k < recipe->entry.slots.size(); ++k)
          if (auto& in = recipe->entry.slots[k]) {
            if (in->recipe) {
              in->recipe_holds.fetch_add(1, std::memory_order_relaxed);
            } else {
              recipe->weak.emplace_back(k, std::exchange(in, nullptr));
            }
          }
      }
      s->recipe = recipe;
      if (cost < 0) cost = guard_cost(e);
      s->remake_cost = cost;
      guarded_.push_back({s, e.index});  // (a view, too: once its base is dropped, it holds the storage)
    }
  }

  // Before op `e`: drop values until what it needs (its new storages, its workspace as measured
  // before, its dropped inputs made again) fits under the cap. `in_arena`: the bytes of its new
  // storages the plan's arena offers regions for (held whole beside the cap, not counted again:
  // counted, the guard dropped a value a plan with most storages in its arena parked a few ops
  // later, made it again outside the arena, and the step held 8% over its plan and its budget).
  void make_room_for_op(const TapeEntry& e, const ArenaOffer* in_arena) {
    int64_t need = e.made_bytes;
    if (in_arena != nullptr) need = std::max<int64_t>(0, need - in_arena->bytes);
    for (const auto& s : e.slots)
      if (s && !s->real.defined() && s->recipe) need += remaking(*s, kLongestChain).bytes;
    make_room(e, need);
  }

  // Before `e` runs (an op, or a recipe making a value again), making `need` bytes and its workspace.
  void make_room(const TapeEntry& e, int64_t need) override {
    if (auto w = workspace_.find(workspace_key(e)); w != workspace_.end()) need += w->second;
    // (until the op ran: reserve_for_stand_ins; a value made again inside an op keeps the op's
    // larger count, the op's own bytes still to come)
    if (need > making_.load(std::memory_order_relaxed)) making_.store(need, std::memory_order_seq_cst);
    evict(need, &e);
  }

 public:
  // The shape oracle's stand-ins are about to hold `need` bytes on the step's thread (0: they
  // are gone), allocated beside the worker's count: with them, steps of a random-length
  // transformer went up to 6% over their budget. Reserved, the worker's evict keeps room for
  // them from its next op on; true if they fit now beside what the allocator holds and the op
  // the worker is making room for (a store, then a load, on each side: one of the two sees the
  // other), else the caller drains the worker and calls make_room_for_stand_ins().
  bool reserve_for_stand_ins(int64_t need) {
    g_stand_in_reserved.store(need, std::memory_order_seq_cst);
    if (need == 0 || cap_ <= 0) return true;
    return count_cpu_bytes().made() + making_.load(std::memory_order_seq_cst) + need <= cap_;
  }
  // From the step's thread, the worker drained (it has nothing to run): room for the reserved.
  void make_room_for_stand_ins() { evict(0, nullptr); }

 private:

  // What making `s` again takes (once dropped): the bytes and cost (guard_cost) of it and of its
  // dropped inputs, to `depth`, and how long the chain of dropped values ending at it is.
  struct Remake {
    int64_t bytes = 0, cost = 0;
    int chain = 0;
  };
  static Remake remaking(const Slot& s, int depth) {
    Remake c{s.dropped_bytes, s.remake_cost, 0};
    if (depth > 0 && s.recipe)
      for (const auto& in : s.recipe->entry.slots)
        if (in && in.get() != &s && !in->real.defined() && in->recipe) {
          const Remake r = remaking(*in, depth - 1);
          c.bytes += r.bytes;
          c.cost += r.cost;
          c.chain = std::max(c.chain, 1 + r.chain);
        }
    return c;
  }
  // The longest chain of dropped values (each made from the next) a drop may make: a value
  // read at its end is made again with the whole chain at once (with no limit, a backward read
  // the last of twelve dropped layers and held 60% more than eager; 4 and 6 left a transformer
  // 1-5% over its budget, 8 held it: bench/dynamic_budget.py's length 128).
  static constexpr int kLongestChain = 8;

  // How long the chain of dropped values made from `s` is, through the recipes that read it.
  int chain_down(const Slot& s, int depth) {
    if (depth <= 0) return 0;
    int n = 0;
    auto [a, b] = readers_.equal_range(&s);
    for (auto it = a; it != b; ++it)
      if (auto r = it->second.lock())
        for (const auto& w : r->outs)
          if (auto u = w.lock(); u && u.get() != &s && !u->real.defined() && u->recipe == r)
            n = std::max(n, 1 + chain_down(*u, depth - 1));
    return n;
  }
  static constexpr int kNeeded = 256;  // (needed(): further, a value counts as needed)

  // Drop values until `need` more bytes fit under the cap, one at a time, the one with the least
  // modeled cost to make again (guard_cost, its dropped inputs' included) per byte and per op
  // since it was made first, the oldest of equals; values the program let go of (kept for a
  // recipe) before those it holds. Not `e`'s inputs (the op about to run).
  void evict(int64_t need, const TapeEntry* e) {
    CountingCPUAllocator& bytes = count_cpu_bytes();
    // (and room for what the shape oracle's stand-ins may hold meanwhile on the step's thread:
    // reserve_for_stand_ins)
    need += g_stand_in_reserved.load(std::memory_order_seq_cst);
    if (cap_ <= 0 || bytes.made() + need <= cap_) return;
    const auto uses = [e](const Slot* s) {
      if (e != nullptr)
        for (const auto& x : e->slots)
          if (x.get() == s) return true;
      return false;
    };
    const int64_t now = e != nullptr ? e->index : (guarded_.empty() ? 0 : guarded_.back().at + 1);
    while (bytes.made() + need > cap_) {
      // (values sharing a storage, a view and its base, are dropped together: one alone frees
      // nothing)
      std::unordered_map<const c10::StorageImpl*, std::vector<std::pair<std::shared_ptr<Slot>, int64_t>>> groups;
      size_t kept = 0;
      for (auto& g : guarded_) {
        auto s = g.slot.lock();
        if (!s) continue;  // (let go of: forgotten)
        guarded_[kept++] = g;
        if (!s->recipe || !s->real.defined() || !s->real.has_storage() || uses(s.get())) continue;
        if (s->real.use_count() != 1) continue;  // (held elsewhere too: dropping it frees nothing)
        groups[s->real.storage().unsafeGetStorageImpl()].emplace_back(std::move(s), g.at);
      }
      guarded_.resize(kept);
      double best = 0;
      int64_t pick_at = 0;
      const std::vector<std::pair<std::shared_ptr<Slot>, int64_t>>* pick = nullptr;
      for (const auto& [storage, members] : groups) {
        if (static_cast<size_t>(members.front().first->real.storage().use_count()) != members.size()) continue;
        int64_t cost = 0, at = now;
        bool ok = true;
        for (const auto& [m, made_at] : members) {
          const Remake r = remaking(*m, kLongestChain);
          if (r.chain + 1 + chain_down(*m, kLongestChain) > kLongestChain) ok = false;
          cost += r.cost;
          at = std::min(at, made_at);
        }
        if (!ok) continue;
        const auto nb = static_cast<double>(storage->nbytes());
        const double age = std::max(static_cast<double>(now - at), 0.0) + 1.0;
        // (not whether the program still holds it: how far the step's thread has got is timing,
        // and with it the choice was: two outcomes of test_capture_guard's determinism test in
        // 2 of 2 full-suite runs on 2026-12-07)
        const double score = static_cast<double>(cost + 1) / (nb * age);
        // (a tie to the oldest: not to the order of storages' addresses in `groups`)
        if (pick == nullptr || score < best || (score == best && at < pick_at)) {
          best = score;
          pick_at = at;
          pick = &members;
        }
      }
      if (pick == nullptr) {
        overruns_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      bool armed = true;
      for (const auto& [m, made_at] : *pick)
        if (!m->recipe->arm()) {  // (an input it needs was let go of: it stays)
          m->recipe.reset();
          armed = false;
        }
      if (!armed) continue;
      for (const auto& [m, made_at] : *pick) {
        drop(*m);
        evicted_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  // May this op run again? Not one that draws from a generator (its values would differ) or
  // writes an argument (batch norm's running statistics would move twice).
  static bool remakeable(const c10::OperatorHandle& op) {
    if (op.hasTag(at::Tag::nondeterministic_seeded)) return false;
    for (size_t i = 0; i < op.schema().arguments().size(); ++i)
      if (writes_argument(op, i)) return false;
    return true;
  }

  std::shared_ptr<Recipe> recipe_of(const TapeEntry& e) {
    auto r = std::make_shared<Recipe>();
    TapeEntry& c = r->entry;
    c.op = e.op;
    c.grad_mode = e.grad_mode;
    c.index = e.index;
    c.args = e.args;
    c.arg_slots = e.arg_slots;
    c.slots = e.slots;
    c.out_begin = e.out_begin;
    c.out_slots.assign(e.out_slots.size(), nullptr);
    for (const auto& s : e.out_slots) r->outs.emplace_back(s);
    for (const auto& s : c.slots)
      if (s) {
        readers_.emplace(s.get(), r);
        if (s->real.defined()) readers_.emplace(s->real.storage().unsafeGetStorageImpl(), r);
      }
    for (const c10::IValue& a : c.args)
      each_tensor(a, [&](const at::Tensor& t) {
        if (t.defined() && t.has_storage()) readers_.emplace(t.storage().unsafeGetStorageImpl(), r);
      });
    return r;
  }

  // An op's arguments that Python holds too (parameters, a batch) are not let go of here but
  // by the skeleton, where it holds the GIL anyway (grave.h; Capture::locate exhumes).
  void bury(TapeEntry& e) {
    for (auto& r : used_recipes_)  // (the last holder: its arguments go like the op's)
      if (r.use_count() == 1)
        for (c10::IValue& a : r->entry.args)
          each_tensor(a, [this](const at::Tensor& t) {
            if (python_holds(t)) held_.push_back(t);
          });
    used_recipes_.clear();
    // (let go of by the program, held by a recipe: dropped, as eager frees it; so is a value no
    // placeholder holds, a gradient block's, once no op to run holds it)
    const auto banish = [this](Slot& s) {
      if (!s.real.defined()) return;
      if (s.recipe && s.recipe->arm()) {
        drop(s);
        return;
      }
      forget(s);  // (it cannot be made again, and only recipes hold it: they are given up, and so is it)
      s.real = at::Tensor();
    };
    // (only recipes hold it: `here` references besides, this entry's and the list's)
    const auto unheld = [](const std::shared_ptr<Slot>& s, long here) {
      return s->recipe_holds.load(std::memory_order_relaxed) > 0 && !held_beside_recipes(s, here);
    };
    for (auto& w : e.banished)
      if (auto s = w.lock(); s && unheld(s, 1)) banish(*s);
    e.banished.clear();
    if (cap_ > 0) {
      for (const auto& s : e.slots) {
        if (!s || s->recipe_holds.load(std::memory_order_relaxed) == 0) continue;
        long here = 0;
        for (const auto& x : e.slots) here += x == s;
        if (unheld(s, here)) banish(*s);
      }
      for (auto& s : remade_)
        if (unheld(s, 1 + static_cast<long>(std::count(e.slots.begin(), e.slots.end(), s)))) banish(*s);
      remade_.clear();
    }
    for (at::Tensor& t : e.trash)  // (a value Python holds: an op that returned its input, lift_fresh)
      if (python_holds(t)) held_.push_back(std::move(t));
    for (c10::IValue& a : e.args) {
      if (a.isTensor()) {
        if (python_holds(a.toTensor())) held_.push_back(std::move(a).toTensor());
        continue;
      }
      each_tensor(a, [this](const at::Tensor& t) {
        if (python_holds(t)) held_.push_back(t);
      });
    }
    grave_.bury(held_);
  }

  // Wait until `count` reaches `want`: polled for, then (the worker only) napped for in
  // turns of kNap for up to kNapping, then slept for; `sleeping` is set while asleep so that
  // the side that moves `count` wakes this one (wake_if), and `napping` while napping, when
  // only a drain wakes it. The worker waits for published ops, a drain for done ones.
  // (Woken by the step's first op, the worker cost the step ~25 us: a woken thread takes the
  // waker's core first; and a read early in the step waited for its wake-up. Napping, it
  // wakes by itself and catches up while the skeleton goes on, and a read wakes it.)
  void await(const std::atomic<int64_t>& count, int64_t want, std::atomic<bool>& sleeping,
             std::atomic<bool>* napping) {
    const bool worker = napping != nullptr;
    const auto ready = [this, &count, want, worker] {
      return count.load(std::memory_order_seq_cst) >= want || (worker && release_team_.load(std::memory_order_seq_cst));
    };
    const auto start = std::chrono::steady_clock::now();
    bool ended = false, released = false;  // (the worker, after its step ended: release_team)
    while (count.load(std::memory_order_acquire) < want) {
      if (worker && release_team_.load(std::memory_order_relaxed)) {
        release_team_.store(false, std::memory_order_relaxed);
        ended = true;
      }
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited <= kSpin) {
        std::this_thread::yield();
        continue;
      }
      if (ended && !released) {
        // (once no step came within the poll: back to back, steps keep the team; let go of at
        // every step's end, a team made again per step cost a 0.16 ms step 0.09 ms)
        release_openmp_team();
        released = true;
      }
      // (napping between steps, the worker woke every ~100 us for 100 ms and took a core from
      // eager steps after the captured ones: 1.2-1.5x their time until it slept)
      const bool nap = napping != nullptr && !ended && waited <= kNapping;
      std::atomic<bool>& flag = nap ? *napping : sleeping;
      std::unique_lock<std::mutex> g(mu_);
      flag.store(true, std::memory_order_seq_cst);
      if (nap) {
        cv_.wait_for(g, kNap, ready);
      } else {
        cv_.wait(g, ready);
      }
      flag.store(false, std::memory_order_relaxed);
    }
  }

  // After moving a count: wake the other side if it sleeps on it.
  void wake_if(const std::atomic<bool>& sleeping) {
    if (!sleeping.load(std::memory_order_seq_cst)) return;
    { std::lock_guard<std::mutex> g(mu_); }  // (it is either not yet waiting, or asleep)
    cv_.notify_all();
  }

  void loop() {
    at::init_num_threads();
    // intra-op threads are per thread: the skeleton's count, as eager runs (a parallel
    // reduction's result depends on how many threads split it)
    at::set_num_threads(threads_);
    at::AutoDispatchBelowADInplaceOrView below;  // the skeleton did the autograd side
    t_used_recipes = &used_recipes_;
    t_remade = &remade_;
    t_cache_blocks = true;
    for (int64_t taken = 0;; ++taken) {
      await(published_, taken + 1, idle_, &napping_);
      TapeEntry& e = ring_[taken & (kRing - 1)];
      if (e.op == nullptr) return;
      if (!failed_.load(std::memory_order_acquire)) {
        const auto t0 = std::chrono::steady_clock::now();
        try {
          if (drops_ || cap_ > 0) guard_writes(e);
          ArenaOffer offer;
          const bool offered = drops_ && following_ && drops_->offer(e.index, e.op, offer);
          if (cap_ > 0) make_room_for_op(e, offered ? &offer : nullptr);
          // (offered after what may make dropped values again first: each remake's run_op would take it)
          if (offered) {
            offer.arena->begin(offer.regions, offer.count);
            t_next_offer = &offer;
          }
          if (cap_ > 0) {
            run_guarded(e);
          } else if (StepLog* l = log()) {
            run_entry(e, l);
            note_workspace(e, l->ops.back().workspace);  // (for a guard on the steps after)
          } else {
            run_entry(e, nullptr);
          }
          if (drops_ && following_) follow(e);
          busy_ns_.fetch_add(ns_since(t0), std::memory_order_relaxed);
        } catch (const std::exception& ex) {
          std::lock_guard<std::mutex> g(mu_);
          failed_at_ = e.index;
          error_ = std::current_exception();
          failed_.store(true, std::memory_order_release);
        }
      }
      bury(e);
      e.clear();  // (its tensors go before the op counts as done)
      done_.store(taken + 1, std::memory_order_seq_cst);
      wake_if(draining_);
    }
  }

  // An op at its place in the step (a matmul's workspace differs from one call to another).
  static uint64_t workspace_key(const TapeEntry& e) {
    return reinterpret_cast<uintptr_t>(e.op) ^ (static_cast<uint64_t>(e.index) * 0x9E3779B97F4A7C15ull);
  }

  // The most bytes `e`'s kernel allocated and freed again, per op and place (make_room counts them).
  void note_workspace(const TapeEntry& e, int64_t ws) {
    int64_t& known = workspace_[workspace_key(e)];
    known = std::max(known, ws);
  }

  // Run `e` under the guard: its workspace measured, its new values guarded.
  void run_guarded(TapeEntry& e) {
    StepLog* log = this->log();
    int64_t ws = 0;
    run_entry(e, log, &ws);
    making_.store(0, std::memory_order_relaxed);
    if (log != nullptr) ws = log->ops.back().workspace;  // (a described op's window is the log's)
    note_workspace(e, ws);
    guard(e);
    evict(0, nullptr);  // (values made again for it, beyond what make_room counted)
  }

  // Wait until `want` ops are done, without the GIL if this thread holds it.
  void wait_without_gil(int64_t want) {
    if (done_.load(std::memory_order_acquire) >= want) return;
    wake_if(napping_);  // (a napping worker would make this wait out its nap)
    std::optional<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) nogil.emplace();
    await(done_, want, draining_, nullptr);
  }
};

}  // namespace
}  // namespace coexec
