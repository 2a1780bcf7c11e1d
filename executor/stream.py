"""The executor thread: runs confirmed ops off the Python skeleton's thread.

The skeleton submits instructions, a closed set (:data:`Instruction`): :class:`Run` (an ATen
op with its arguments, placeholders replaced by value ids), :class:`Free` (Python let go of
these values), :class:`FreeRange` (a finished step), :class:`Launch` (run the block of
deferred ops just submitted), and the memory plan's own (``ResetPeak``, ``HostPool``,
``Offload``/``Wait``/``Prefetch``, ``Drop``/``Restore``). Each type has one handler.

Ops run either as they arrive, in submission order, or, when the skeleton defers them, a
whole block at a time at its :class:`Launch`, in the block's planned order (a
``planner.schedule.Block``: a permutation of the block that keeps every dependency). Either
way only ops the skeleton confirmed run, so persistent state is only mutated by confirmed
ops, and a fetch never waits for a feed that comes later (DESIGN.md §4, "Deadlock"): a wait
always launches the open block first. A value Python let go of is freed when no op of the
open block still reads it: after its last use in the planned order.

Waiting is cheap on the executor side: after each instruction it compares its progress with
the one position someone waits for, and only then signals.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

import torch

from planner.schedule import Block

from .memory import LiveBytes, ResetPeak, laid_out
from .offload import HostPool, Offload, Offloads, Prefetch, Wait
from .guard import MIN_BYTES, Cap, Guard
from .remat import Drop, Recipes, Restore, replayed_rng, rng_state


class ExecutorError(RuntimeError):
    """An op failed on the executor. ``op_index`` and ``location`` say which op and where the
    skeleton issued it; the original exception is the ``__cause__``."""

    def __init__(self, message: str, op_index: int | None = None, location: Any = None) -> None:
        super().__init__(message)
        self.op_index = op_index
        self.location = location


class ExecutorDied(RuntimeError):
    """The executor thread stopped while work was pending."""


class ExecutorTimeout(TimeoutError):
    """A wait on the executor exceeded its time limit."""


@dataclass(slots=True)
class Run:
    """Run ``func(*args, **kwargs)``; ``refs`` put values into the arguments first.

    ``refs``: ``(arg, item, vid)``: argument position (an int, or a kwarg name), index in a
    tensor-list argument or -1, and the value id to put there. ``outs``: value ids for the
    returned tensors, flattened. ``moves``: ``(old, new)`` value ids of arguments the op wrote
    in place: after it, the same tensor is value ``new`` and ``old`` is gone.
    """

    func: Any
    args: list
    kwargs: dict
    refs: tuple
    outs: tuple
    moves: tuple = ()
    op_index: int = -1
    location: Any = None
    keep_result: bool = False  # store the Python result (a fetch of a data-dependent op)
    # write the outputs into the step's arena (attached by ResetPeak): (out_variant, out
    # argument names, ((offset, shape, stride, dtype, bytes spanned) per returned tensor))
    arena_out: tuple | None = None
    grad_mode: bool = True  # grad mode when the op was issued: some kernels consult it
    recipe: bool = False  # keep it to recompute its outputs after a Drop (executor/remat.py)
    random: bool = False  # a random op: a recipe keeps the RNG state it ran with
    deferred: bool = False  # held until the block's Launch, then run in its planned order
    new_bytes: int = 0  # bytes of the new tensors it makes, where a guard needs room (Cap)
    writes: tuple = ()  # argument positions it writes in place, where a guard keeps recipes
    backward: bool = False  # an op of a backward pass, where a guard keeps no recipe


@dataclass(slots=True)
class Launch:
    """The open block is complete: run its deferred ops not yet run, in ``block.order`` when
    it is a plan for exactly these ops, else in submission order."""

    block: Block | None = None


@dataclass(slots=True)
class Follow:
    """The open block is probably ``block``: run its deferred ops in ``block.order`` as they
    arrive, as long as the executor then holds at most ``bound`` bytes (the least that any
    planned block the skeleton may be in allows)."""

    block: Block
    bound: int


@dataclass(slots=True)
class Free:
    vids: tuple


@dataclass(slots=True)
class FreeRange:
    """Forget every value with an id in [lo, hi): a finished step's values."""

    lo: int
    hi: int


@dataclass(slots=True)
class _Fault:
    """Test hook: make the thread die, raise or hang when it reaches this instruction."""

    kind: str
    release: threading.Event = field(default_factory=threading.Event)


Instruction = Union[
    Run, Free, FreeRange, Launch, Follow, ResetPeak, HostPool, Offload, Wait, Prefetch, Drop, Restore, Cap,
    _Fault,
]


class RunAhead(NamedTuple):
    """Counters of deferred ops: run ahead of their block's launch, or at it; and the ops at
    which running ahead stopped, by why: not issued yet, over the block's bound, or a planned
    arena region still held (a value the program has not let go of yet). Each op is counted
    once per reason, however often it is tried."""

    ahead: int = 0
    at_launch: int = 0
    waited_for_issue: int = 0
    waited_for_bytes: int = 0
    waited_for_region: int = 0

    def __sub__(self, other: RunAhead) -> RunAhead:  # type: ignore[override]
        return RunAhead(*(a - b for a, b in zip(self, other)))


@dataclass(frozen=True)
class ExecutorStats:
    """A snapshot of what the executor has done (counters since it started)."""

    submitted: int
    done: int
    busy_seconds: float
    peak_bytes: int  # the most live bytes since the step began (ResetPeak), arena whole
    arena_hits: int  # op results written into the arena
    arena_misses: int  # planned arena outputs whose bytes were taken: from the allocator
    blocks: int  # blocks run in a planned order
    native_ops: int  # ops run by the native engine, without the GIL (executor/engine.py); 0 here
    run_ahead: RunAhead  # how deferred ops ran: before or at their block's launch
    recomputed: int  # ops run again (memory budget)
    offloaded: int  # storages parked on the host
    copy_wait_seconds: float  # waiting for copies to land
    guard_drops: int = 0  # values the guard dropped to hold its cap (executor/guard.py)


_STOP = object()
_ISSUE, _BYTES, _REGION = 2, 3, 4  # why running ahead stopped (indices into RunAhead)


def _flatten(out: Any) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        flat = []
        for x in out:
            if isinstance(x, torch.Tensor):
                flat.append(x)
            elif isinstance(x, (tuple, list)):
                flat.extend(y for y in x if isinstance(y, torch.Tensor))
        return flat
    return []


class _Worker:
    """One thread with its queue, value table and counters. A worker that is abandoned (dead,
    or stuck and replaced) keeps its own state, so it can never disturb its successor."""

    def __init__(self, name: str) -> None:
        self.values: dict[int, Any] = {}  # value id -> tensor
        self.results: dict[int, Any] = {}  # op index -> Python result (kept on request)
        self.submitted = 0
        self.done = 0
        self.error: ExecutorError | None = None
        self.busy_seconds = 0.0
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.arena_misses = 0  # planned arena outputs that had to use the allocator
        self.arena_hits = 0  # op results written into the arena
        self.memory = LiveBytes()
        self.recipes = Recipes(self.values, self.recall, self.free_value, self.memory)
        self.offloads = Offloads(self.values, self.memory)
        self.guard = Guard(self.values, self.recipes, self.memory)
        self.want: int | None = None
        self.event = threading.Event()
        # the open block: deferred runs, instructions taken meanwhile (counted done at the
        # launch), per value the deferred runs that read it, values they make, values Python
        # let go of while a deferred run still needs them (freed after the last one)
        self.block: list[Run] = []
        self.ran: list[bool] = []  # per deferred run: run already (ahead of its launch)
        self.following: Block | None = None  # the plan being run ahead in (Follow)
        self.bound = 0
        self.cursor = 0  # how far into the followed order it has run
        self.issued = 0  # the first op, in issue order, not run yet (or before it)
        self.held = 0
        self.pending: dict[int, int] = {}
        self.future: set[int] = set()
        self.released: set[int] = set()
        self.blocks = 0
        self.ahead = [0, 0, 0, 0, 0]  # RunAhead's fields
        self.stopped: tuple[int, int] = (-1, -1)  # (cursor, reason) where running ahead last stopped
        self.handlers = {
            Run: self._on_run, Free: self._on_free, FreeRange: self._on_free_range,
            Launch: self._on_launch, Follow: self._on_follow, Drop: self._on_drop, Offload: self._on_offload,
            Wait: self._on_wait, Prefetch: self._on_prefetch, HostPool: self._on_host_pool,
            ResetPeak: self._on_reset_peak, Restore: self._on_restore, _Fault: self._on_fault,
            Cap: self._on_cap,
        }  # fmt: skip
        threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self.loop, args=(threads,), name=name, daemon=True)
        self.thread.start()

    def loop(self, threads: int) -> None:
        # intra-op threads are per thread: match the skeleton's, as eager would run (a parallel
        # reduction's result depends on how many threads split it: fewer is not bit-equal)
        torch.set_num_threads(threads)
        torch.set_grad_enabled(False)
        self.grad_mode = False
        # below autograd and ADInplaceOrView: the skeleton already did the autograd side of
        # every op (graph, views, version counters); bumping versions again here, at some
        # later moment, would break autograd's saved-tensor checks
        with torch._C._AutoDispatchBelowADInplaceOrView():
            self._serve(threads)

    def _serve(self, threads: int) -> None:
        q = self.q
        handlers = self.handlers
        while True:
            ins = q.get()
            if ins is _STOP:
                return
            t0 = time.perf_counter()
            if handlers[type(ins)](ins) is _STOP:
                return  # (a test's fault: the thread ends with work pending, as a crash would)
            self.busy_seconds += time.perf_counter() - t0
            if self.block:
                self.held += 1  # done when the block is: a wait launches it first
                continue
            self.done += 1 + self.held
            self.held = 0
            w = self.want
            if w is not None and self.done >= w:
                self.event.set()

    # -- handlers (one per instruction type) ---------------------------------------------
    def _on_run(self, ins: Run) -> None:
        if ins.deferred:
            self._defer(ins)
        elif self.error is None:
            self.run(ins, self.values)

    def _on_free(self, ins: Free) -> None:
        recipes = self.recipes
        for v in ins.vids:
            if v in self.future or self.pending.get(v):
                self.released.add(v)  # a deferred run still makes or reads it
            elif not (recipes and recipes.holds(v)):
                self.free_value(v)
            elif self.guard.mine:
                self.guard.released(v)
        if self.following is not None:
            self._advance()  # memory went down: maybe the next op fits

    def _on_free_range(self, ins: FreeRange) -> None:
        if self.block:
            self._on_launch(Launch())
        values = self.values
        for v in [v for v in values if ins.lo <= v < ins.hi]:
            self.memory.remove(values.pop(v))
        self.recipes.clear_range(ins.lo, ins.hi)
        self.guard.clear_range(ins.lo, ins.hi)
        self.offloads.clear_range(ins.lo, ins.hi)
        self.released = {v for v in self.released if not ins.lo <= v < ins.hi}

    def _on_launch(self, ins: Launch) -> None:
        block, ran = self.block, self.ran
        order = ins.block.order if ins.block is not None else ()
        if len(order) == len(block):
            self.blocks += 1
        else:
            order = range(len(block))
        todo = [k for k in order if not ran[k]]
        for k in todo:
            self._run_deferred(k)  # (after an error: retired, not run)
        self.ahead[1] += len(todo)
        self.block, self.ran, self.following, self.cursor, self.issued = [], [], None, 0, 0
        self.stopped = (-1, -1)

    def _on_follow(self, ins: Follow) -> None:
        if ins.block is not self.following:
            self.following, self.cursor = ins.block, 0
        self.bound = ins.bound
        self._advance()

    def _on_drop(self, ins: Drop) -> None:
        self.recipes.drop(ins.vids)

    def _on_offload(self, ins: Offload) -> None:
        self.offloads.offload(ins)

    def _on_wait(self, ins: Wait) -> None:
        self.offloads.wait_out(ins)

    def _on_prefetch(self, ins: Prefetch) -> None:
        if self.error is None:
            self.offloads.prefetch(ins)

    def _on_host_pool(self, ins: HostPool) -> None:
        self.offloads.size_pool(ins.nbytes, torch.cuda.is_available())

    def _on_reset_peak(self, ins: ResetPeak) -> None:
        self.memory.attach(ins.arena)
        self.memory.reset_peak()
        self.guard.set_cap(None)  # (a step under a budget sends its own: Cap)

    def _on_cap(self, ins: Cap) -> None:
        self.guard.set_cap(ins.nbytes)

    def _on_restore(self, ins: Restore) -> None:
        if self.error is None:
            self.restore(ins)

    def _on_fault(self, ins: _Fault) -> Any:
        if ins.kind == "die":
            return _STOP
        if ins.kind == "hang":
            ins.release.wait(3600)
        elif ins.kind == "raise":
            self.error = ExecutorError("injected fault")
        return None

    # -- the open block ------------------------------------------------------------------
    def _defer(self, ins: Run) -> None:
        self.block.append(ins)
        self.ran.append(False)
        pending = self.pending
        for _arg, _item, vid in ins.refs:
            pending[vid] = pending.get(vid, 0) + 1
        for old, new in ins.moves:
            pending[old] = pending.get(old, 0) + 1
            self.future.add(new)
        self.future.update(ins.outs)
        if self.following is not None:
            self._advance()

    def _advance(self) -> None:
        """Run the followed block's ops in its order while they have arrived and the bytes
        held stay within the bound (a value Python let go of late, or an arena region still
        taken, can make the next op wait for the skeleton's frees or the block's launch).

        Where the plan's next op is not issued yet (a plan moves ops issued late, such as
        weight updates, early), run the issued ops in issue order instead, within the same
        bound and where their planned regions are free. Either order is
        safe, and so is any mix of the two: every edge of the planning graph goes forward in
        issue order (the order eager ran), the next op in issue order has all its
        predecessors run, and the next op in the plan's order has all of its own."""
        order, block, ran = self.following.order, self.block, self.ran
        while self.cursor < len(order) and self.error is None:
            k = order[self.cursor]
            if k >= len(block):
                self._stop(_ISSUE)
                break
            if not ran[k] and not self._run_ahead(k):
                return
            self.cursor += 1
        else:
            return
        while self.issued < len(block) and self.error is None:
            if not ran[self.issued] and not self._run_ahead(self.issued):
                return
            self.issued += 1

    def _run_ahead(self, k: int) -> bool:
        """Run deferred op ``k`` of the block now if the bytes held stay within the bound and
        its planned regions are free; else count why not."""
        news = self.following.new_bytes
        if self.memory.live + (news[k] if k < len(news) else 0) > self.bound:
            self._stop(_BYTES)
            return False
        if not self._arena_ready(self.block[k]):
            self._stop(_REGION)
            return False
        self._run_deferred(k)
        self.ahead[0] += 1
        return True

    def _stop(self, reason: int) -> None:
        """Count where running ahead stopped (once per op and reason)."""
        if self.stopped != (self.cursor, reason):
            self.stopped = (self.cursor, reason)
            self.ahead[reason] += 1

    def _arena_ready(self, ins: Run) -> bool:
        """Are an op's planned arena regions free? (Run ahead into a region that a value
        Python has not let go of yet still holds, the output would go to the allocator, and
        stay there, over the plan, for the rest of the step: the op waits instead.)"""
        if ins.arena_out is None or self.memory.arena is None:
            return True
        out_func, _names, outs = ins.arena_out
        if out_func in _NOT_IN_PLACE:
            return True  # (planned there, but it lays out otherwise: the allocator, as planned for)
        return self.memory.all_free(outs)

    def _run_deferred(self, k: int) -> None:
        run = self.block[k]
        self.ran[k] = True
        if self.error is None:
            self.run(run, self.values)
        self._retire(run)

    def _retire(self, ins: Run) -> None:
        """A deferred run ran (or was skipped after an error): the values it read or made
        that Python let go of and nothing else pending needs are freed."""
        pending, released, future = self.pending, self.released, self.future
        done = [vid for _arg, _item, vid in ins.refs] + [old for old, _new in ins.moves]
        for vid in done:
            left = pending[vid] - 1
            if left:
                pending[vid] = left
            else:
                del pending[vid]
        for vid in (*ins.outs, *(new for _old, new in ins.moves)):
            future.discard(vid)
            done.append(vid)
        if not released:  # (most runs read and make nothing Python let go of early)
            return
        for vid in done:
            if vid in released and vid not in pending and vid not in future:
                released.discard(vid)
                if not (self.recipes and self.recipes.holds(vid)):
                    self.free_value(vid)
                elif self.guard.mine:
                    self.guard.released(vid)

    def free_value(self, vid: int) -> None:
        t = self.values.pop(vid, None)
        if t is not None:
            self.memory.remove(t)
        recipes = self.recipes
        if recipes or recipes.dropped:  # (the last recipe may be gone, not its dropped values)
            recipes.forget(vid)
            if self.guard.made:
                self.guard.forget(vid)
        if self.offloads:
            self.offloads.forget(vid)

    def arguments(self, ins: Run, values: dict) -> tuple[list, dict]:
        """The instruction's arguments with its value references filled in (dropped values
        recomputed first)."""
        args = list(ins.args)
        kwargs = dict(ins.kwargs)
        for arg, item, vid in ins.refs:
            box = kwargs if isinstance(arg, str) else args
            t = values.get(vid)
            if t is None:
                t = self.fetch(vid)
            if item < 0:
                box[arg] = t
            else:
                if not isinstance(box[arg], list):
                    box[arg] = list(box[arg])
                box[arg][item] = t
        return args, kwargs

    def away(self, vid: int | None = None) -> bool:
        """Is ``vid`` (None: any value) out of the table but retrievable: dropped (to be
        recomputed) or parked on the host (to be copied back)?"""
        if vid is None:
            return bool(self.recipes.dropped or self.offloads.parcels)
        return vid in self.recipes.dropped or vid in self.offloads.parcels

    def fetch(self, vid: int) -> Any:
        """A value not in the table: parked on the host (copied back) or dropped (recomputed);
        KeyError if neither."""
        if vid in self.offloads.parcels:
            return self.offloads.get(vid)
        return self.recipes.get(vid)

    def set_grad_mode(self, mode: bool) -> None:
        if mode != self.grad_mode:  # (below autograd: it records nothing either way)
            torch.set_grad_enabled(mode)
            self.grad_mode = mode

    def recall(self, ins: Run) -> list:
        """Run a recipe again, into its planned arena regions where they are free (a storage
        comes back where it was): its flattened outputs."""
        mode = self.grad_mode
        args, kwargs = self.arguments(ins, self.values)
        self.set_grad_mode(ins.grad_mode)
        try:
            # a random op draws the same numbers as the first time; the stream goes on
            with replayed_rng(self.recipes.rng_states[id(ins)]) if ins.random else contextlib.nullcontext():
                out = self.run_in_arena(ins, args, kwargs) if ins.arena_out is not None else None
                if out is None:
                    out = ins.func(*args, **kwargs)
            return _flatten(out)
        finally:
            self.set_grad_mode(mode)

    def restore(self, ins: Restore) -> None:
        recipes = self.recipes
        offloads = self.offloads
        if ins.vids is not None:
            vids = ins.vids
        else:
            # (not what the program let go of, dropped while only recipes read it)
            dropped = [v for v in recipes.dropped if v not in recipes.waiting]
            vids = [v for v in (*dropped, *offloads.parcels) if ins.lo <= v < ins.hi]
        guard = self.guard
        cap, guard.cap = guard.cap, None  # (what the program holds: not dropped again meanwhile)
        try:
            offloads.restore(vids)
            recipes.restore(vids)
        except BaseException as e:  # noqa: BLE001 - reported to the skeleton's thread
            err = ExecutorError(f"recomputing a dropped value failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            self.error = err
        finally:
            guard.cap = cap

    def run(self, ins: Run, values: dict) -> None:
        args = ins.args
        kwargs = ins.kwargs
        self.set_grad_mode(ins.grad_mode)
        guard = self.guard
        if guard.cap is not None:
            guard.before(ins)
        try:
            if ins.refs:
                args, kwargs = self.arguments(ins, values)
            if ins.moves and self.recipes:
                self.recipes.before_write([old for old, _new in ins.moves])
            if ins.moves and self.offloads.out:
                self.offloads.before_write([old for old, _new in ins.moves])
            if ins.writes and guard.mine:
                guard.before_write(_written(ins, args, kwargs), guard.links(ins), bool(ins.moves))
            if ins.random and (ins.recipe or (guard.cap is not None and (ins.moves or ins.new_bytes >= MIN_BYTES))):
                self.recipes.rng_states[id(ins)] = rng_state(args, kwargs)
            out = None
            if ins.arena_out is not None:
                out = self.run_in_arena(ins, args, kwargs)
            if out is None:
                out = ins.func(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the skeleton's thread
            self.error = _failed(ins, e)
            return
        for old, new in ins.moves:
            values[new] = values.pop(old)
        if ins.outs:
            memory = self.memory
            inputs = (*args, *kwargs.values())
            for vid, t in zip(ins.outs, _flatten(out)):
                prev = values.get(vid)  # set by a move: the written argument, returned
                values[vid] = t
                if prev is not t:
                    if prev is not None:
                        memory.remove(prev)
                    memory.add(t, inputs)
            if ins.recipe:
                self.recipes.keep(ins)
            elif guard.cap is not None:
                if ins.moves:
                    guard.ran_in_place(ins)
                else:
                    guard.ran(ins, args, kwargs)
        if self.recipes.remade:
            guard.settle()
        if ins.keep_result:
            self.results[ins.op_index] = out


    def run_in_arena(self, ins: Run, args: list, kwargs: dict) -> Any:
        """Run the op's ``out=`` variant into arena memory at the planned offsets; None (run
        it normally) if a planned region is still in use: a plan is a hint, never a risk.

        Each output gets its own fixed-size storage over its region, so an ``out=`` kernel
        that wants to resize its output fails instead of writing past the region; results
        that do not have the planned layout are discarded, and the op is not tried again.
        (A failed try writes only bytes that no live value holds.)"""
        out_func, names, outs = ins.arena_out
        memory = self.memory
        if out_func in _NOT_IN_PLACE or memory.arena is None:
            return None
        if not memory.all_free(outs):
            self.arena_misses += 1
            return None
        views = [
            laid_out(memory.region(offset, n), shape, stride, dtype) for offset, shape, stride, dtype, n in outs
        ]
        kw = dict(kwargs)
        kw.update(zip(names, views))
        try:
            out_func(*args, **kw)
        except RuntimeError:
            _NOT_IN_PLACE.add(out_func)
            return None
        for v, (_o, shape, stride, dtype, _n) in zip(views, outs):
            if tuple(v.shape) != shape or tuple(v.stride()) != stride or v.dtype != dtype:
                _NOT_IN_PLACE.add(out_func)
                return None
        _IN_PLACE.add(out_func)
        self.arena_hits += 1
        return views[0] if len(views) == 1 else tuple(views)


def _written(ins: Run, args: list, kwargs: dict) -> list:
    """The tensors ``ins`` writes in place (its arguments at ``ins.writes``)."""
    names = ins.func._schema.arguments
    found: list = []
    for i in ins.writes:
        x = args[i] if i < len(args) else kwargs.get(names[i].name)
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found.extend(y for y in x if isinstance(y, torch.Tensor))
    return found


def _failed(ins: Run, e: BaseException) -> ExecutorError:
    """The error to report for ``ins`` raising ``e``."""
    err = ExecutorError(f"{ins.func} failed on the executor: {type(e).__name__}: {e}", ins.op_index, ins.location)
    err.__cause__ = e
    return err


def writes_in_place(out_func: Any) -> bool | None:
    """Has ``out_func`` (an ``out=`` overload) written into the arena as planned in this
    process (True), laid its outputs out otherwise (False), or not been tried (None)?"""
    return True if out_func in _IN_PLACE else False if out_func in _NOT_IN_PLACE else None


# out= overloads tried into the arena: good ones keep writing there, the others (they lay out
# their output differently, e.g. mse_loss.out) use the allocator
_IN_PLACE: set = set()
_NOT_IN_PLACE: set = set()


class Executor:
    """The background thread the skeleton feeds (replaced by a fresh one after a failure)."""

    def __init__(self, name: str = "coexec-executor") -> None:
        self.name = name
        self._w = _Worker(name)
        self._open = 0  # position of the first deferred run not yet launched (0: none)

    # the current worker's state (read after a wait, or as a snapshot)
    error = property(lambda self: self._w.error)
    submitted = property(lambda self: self._w.submitted)

    def value(self, vid: int) -> Any:
        """The tensor of value ``vid`` (None if it is not in the table); after a wait."""
        return self._w.values.get(vid)

    def take_result(self, op_index: int) -> Any:
        """The Python result of a data-dependent op (``keep_result``), after waiting for it."""
        return self._w.results.pop(op_index)

    def stats(self) -> ExecutorStats:
        w = self._w
        return ExecutorStats(
            submitted=w.submitted, done=w.done, busy_seconds=w.busy_seconds,
            peak_bytes=w.memory.peak, arena_hits=w.arena_hits, arena_misses=w.arena_misses,
            blocks=w.blocks, native_ops=0, run_ahead=RunAhead(*w.ahead),
            recomputed=w.recipes.recomputed,
            offloaded=w.offloads.offloaded, copy_wait_seconds=w.offloads.wait_seconds,
            guard_drops=w.guard.evicted,
        )  # fmt: skip

    def away(self, vid: int | None = None) -> bool:
        """Whether ``vid`` (None: any value) is dropped or parked, so a ``Restore`` brings it
        back."""
        return self._w.away(vid)

    @property
    def alive(self) -> bool:
        return self._w.thread.is_alive()

    def submit(self, ins: Instruction) -> int:
        """Queue an instruction; returns its position (wait for it with :meth:`wait`)."""
        w = self._w
        w.q.put(ins)
        w.submitted += 1
        if type(ins) is Run and ins.deferred:
            self._open = self._open or w.submitted
        elif type(ins) is Launch:
            self._open = 0
        return w.submitted

    def wait(self, position: int, timeout: float) -> None:
        """Block until the instruction at ``position`` (1-based) has run.

        Raises the executor's error, :class:`ExecutorDied`, or :class:`ExecutorTimeout`. A
        wait for deferred ops launches their block first (in submission order: the skeleton
        launches it with its plan before it waits)."""
        w = self._w
        if self._open and position >= self._open:
            position = max(position, self.submit(Launch()))
        if w.done < position:
            deadline = time.monotonic() + timeout
            w.event.clear()
            w.want = position
            try:
                while w.done < position:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ExecutorTimeout(
                            f"the executor did not finish the pending ops within {timeout:g} s "
                            f"({w.done} of {position} instructions done)"
                        )
                    if w.event.wait(min(left, 0.5)):
                        w.event.clear()
                    elif not w.thread.is_alive():
                        raise ExecutorDied(
                            f"the executor thread stopped with {position - w.done} "
                            "instructions pending"
                        )
            finally:
                w.want = None
        if w.error is not None:
            raise w.error

    def clear_error(self) -> None:
        """Forget the error of the last op run (the skeleton raised it where the program
        handles it), so the ops submitted next run. Only once everything submitted is done:
        ops queued behind the failed one were skipped, not run."""
        w = self._w
        if w.done < w.submitted:
            raise RuntimeError("clear_error() with instructions pending")
        w.error = None

    def drain(self, timeout: float) -> None:
        """Wait for everything submitted so far."""
        self.wait(self._w.submitted, timeout)

    def reset(self) -> None:
        """Forget values and errors; a dead or stuck worker is replaced by a fresh one."""
        w = self._w
        self._open = 0
        if w.done < w.submitted or not w.thread.is_alive():
            w.q.put(_STOP)  # a stuck thread exits when (if) it gets here
            self._w = _Worker(self.name)
        else:
            w.values.clear()
            w.results.clear()
            w.error = None
            w.memory.clear()
            w.recipes.__init__(w.values, w.recall, w.free_value, w.memory)
            w.guard.__init__(w.values, w.recipes, w.memory)
            w.offloads.clear()
            w.block, w.ran, w.held, w.pending, w.future, w.released = [], [], 0, {}, set(), set()
            w.following, w.cursor, w.issued, w.stopped = None, 0, 0, (-1, -1)

    def inject_fault(self, kind: str) -> _Fault:
        """Test hook: the thread ``"die"`` s, ``"raise"`` s or ``"hang"`` s when it gets here."""
        fault = _Fault(kind)
        self.submit(fault)
        return fault

    def close(self, timeout: float = 0.0) -> None:
        """Stop the thread after what it was given; wait up to ``timeout`` seconds for that."""
        self._w.q.put(_STOP)
        if timeout > 0:
            self._w.thread.join(timeout)
