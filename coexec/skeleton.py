"""The skeleton: the user's step runs as Python while ops go to the executor.

:class:`Skeleton` is a :class:`tracegraph.Recorder` whose ops do not compute: each op is
matched against the TraceGraph (a :class:`tracegraph.Cursor`), sent to the executor, and
answered with placeholders whose metadata comes from the matched node. The step's trace is
recorded as in the tracing phase, so after a fallback the same trace goes on eagerly and is
merged at the end.

Fallback (DESIGN.md §4): when an op does not match, the executor finishes exactly the ops
confirmed so far, every placeholder is bound to its value, and the rest of the step runs
eagerly while it is recorded. Autograd's graph of the prefix is built on placeholders, which
now compute on their real values, so ``backward()`` just works.
"""

from __future__ import annotations

import itertools
import time
import weakref
from typing import Any

import torch

from executor import (
    Cap,
    Drop,
    Executor,
    ExecutorError,
    Follow,
    Free,
    FreeRange,
    HostPool,
    Launch,
    Offload,
    Prefetch,
    ResetPeak,
    Restore,
    Run,
    Wait,
    span_bytes,
)  # fmt: skip
from executor import native
from planner import Block, Schedule, Site, StorageKey
from planner import Drop as PlannedDrop
from planner import Offload as PlannedOffload
from planner import Prefetch as PlannedPrefetch
from tracegraph import Cursor, NotCovered, OpRecord, Recorder, TraceGraph
from tracegraph.graph import same_sizes
from tracegraph.location import CODES
from tracegraph.reasons import OTHER, FallbackReason
from tracegraph.recorder import flat_outputs
from tracegraph.schema import TensorMeta, schema_of

from .arena import is_arena_backed, iterations, out_variant, sweep_every
from .blocks import BlockIndex
from .calls import MISS, TEMPLATES, issue, make_template, needs_grad, signature
from .errors import ValueLostError
from .gradients import HOOK_CALLS, Backwards, GradientBlocks
from .mirrors import Mirrors
from .placeholder import Placeholder
from .tracebacks import attach_issue_traceback
from .tracking import tracker

_UNKNOWN = object()
_session_ids = itertools.count(1)
_VID_SPACE = 1 << 40  # executor value ids are session base + trace value id

_STRUCTURED: dict[Any, bool] = {}  # op -> has a structured kernel's meta function (native module)


def _on_meta(func: Any, args: list, kwargs: dict) -> Any:
    """``func`` on meta tensors: through the native module's table of structured kernels' C++
    meta functions where the op has one (1-2 us; executor/structured_meta.py), else through the
    dispatcher's Meta key, where torch registers Python meta kernels (50-500 us per op)."""
    mod = native.ready()
    if mod is not None and _STRUCTURED.get(func, True):
        sch = func._schema
        try:
            out = mod.structured_meta(sch.name, sch.overload_name, tuple(args), kwargs)
        except (RuntimeError, TypeError):  # an argument the schema takes only from Python (a float as a Tensor)
            out = None
        else:
            _STRUCTURED[func] = out is not None
        if out is not None:
            return out
    with torch.no_grad():
        return func(*args, **kwargs)


class Session:
    """A step's link to the executor: its placeholders and where their values come from.

    A value may be freed when its placeholder's C++ tensor is gone. Not its Python object: C++
    code (autograd's saved tensors, an ATen composite between two calls) can keep the tensor
    while the Python object is deallocated and later brought back, and holding the Python
    object ourselves would change what autograd does (it copies gradients others refer to).
    So each placeholder is tracked by a weak reference to its C++ tensor, and the session
    sweeps now and then, freeing the values whose tensors are gone.
    """

    def __init__(
        self,
        executor: Executor,
        timeout: float,
        schedule: Schedule | None = None,
        arena: Any = None,
        index: BlockIndex | None = None,
        arena_outs: dict | None = None,
        budget: int | None = None,
        state_bytes: int = 0,
        site_bytes: dict | None = None,
    ) -> None:
        self.executor = executor
        self.timeout = timeout
        self.schedule = schedule  # the plan in use (None: unplanned, ops run as issued)
        self.arena = arena  # its arena tensor, or None
        # per op (node, iterations): where its outputs go in the arena (Skeleton._arena_out),
        # kept with the plan, which it depends on alone
        self.arena_outs = arena_outs if arena_outs is not None else {}
        # under a memory budget: ops run as issued, with drops and moves after given sites;
        # else, with a plan: block by block, each in its planned order (``index``, the plan's
        # blocks: coexec/blocks.py)
        remat = schedule if schedule is not None and schedule.budget is not None else None
        self.remat = remat
        self.index = index if remat is None else None
        self.blocks = self.index is not None
        # the open block: where its ops are in the index (None: in no planned block, its ops
        # run as issued), the plan the executor runs ahead in, and whether ops were deferred
        self.node = self.index.root if self.index is not None else None
        self.following: Block | None = None
        self.bound = 0
        self.deferred = False
        self.base = next(_session_ids) * _VID_SPACE
        # per placeholder: [current value id, weak ref to the Python object, its tracker slot];
        # the tracker holds each one's C++ tensor weakly (coexec/tracking.py)
        self.tracked: list[list] = []
        self.tracker = tracker()
        self.aliased = False  # some values have two placeholders (Session.alias)
        self.dropped: list[int] = []  # values made with no tensor to hold them (coexec/calls.py)
        self.orphans: dict[int, torch.Tensor] = {}  # values of tensors only C++ held at the end
        self.produced_at: dict[int, int] = {}  # trace value id -> executor position
        self.open = True
        self.stall_seconds = 0.0  # time the skeleton spent waiting on the executor
        if remat is not None and remat.host_bytes:
            executor.submit(HostPool(remat.host_bytes))
        self.sweep_every = sweep_every(budget)  # (the tape's memory budget: plans count on it)
        self._until_sweep = self.sweep_every
        executor.submit(ResetPeak(arena))
        # under a budget the executor holds its live bytes within the budget less the state
        # (executor/guard.py: the state the program's last step found, until this one finds
        # more), wherever the plan does not: from the start without one, else from the first op
        # that makes more than at its site in the steps planned for (``site_bytes``)
        self.budget = budget
        self.state_bytes = state_bytes
        self.state_storages: set[int] = set()
        self.found_state = 0
        self.site_bytes = site_bytes if remat is not None else None
        self.guarded = False
        if budget is not None and self.site_bytes is None:
            self.guard()

    def guard(self) -> None:
        """Hold the executor within the budget from the next op on (executor/guard.py)."""
        self.guarded = True
        self.executor.submit(Cap(max(self.budget - self.state_bytes, 0)))

    def sweep_before_write(self) -> None:
        """An op is about to write state in place (an optimizer's update, running
        statistics): the guard's recipes that read it are retired then, and those that dropped
        an output make it first, unless the program let go of it. Let go of what it let go of
        now, not a sweep later."""
        self._until_sweep = self.sweep_every
        dead = self.sweep()
        if dead:
            self.executor.submit(Free(dead))

    def outgrew(self, site: Site, new_bytes: int) -> bool:
        """Does an op at ``site`` making ``new_bytes`` make more than the plan counted?"""
        planned = self.site_bytes.get(site)
        return planned is None or new_bytes > planned

    def met_state(self, storage: int, nbytes: int) -> None:
        """The step read a storage from outside it (a parameter, a batch): past the state
        counted, the executor's cap comes down."""
        if storage in self.state_storages:
            return
        self.state_storages.add(storage)
        self.found_state += nbytes
        if self.found_state > self.state_bytes:
            self.state_bytes = self.found_state
            if self.guarded:
                self.executor.submit(Cap(max(self.budget - self.state_bytes, 0)))

    def new_placeholder(self, meta: TensorMeta, vid: int, position: int) -> Placeholder:
        ph = Placeholder(meta, self, vid)
        self.produced_at[vid] = position
        entry = [vid, weakref.ref(ph), self.tracker.add(ph, vid)]
        ph._entry = entry
        self.tracked.append(entry)
        return ph

    def alias(self, ph: Placeholder) -> Placeholder:
        """Another placeholder of ``ph``'s value, without its autograd history: the value
        is kept while either lives (coexec/gradients.py holds saved tensors so)."""
        self.aliased = True
        return self.new_placeholder(TensorMeta.of(ph), ph._vid, self.produced_at[ph._vid])

    def retarget(self, ph: Placeholder, vid: int, position: int) -> None:
        """An in-place op made a new value of ``ph``'s tensor."""
        ph._vid = ph._entry[0] = vid
        self.tracker.retarget(ph._entry[2], vid)
        self.produced_at[vid] = position

    def sweep(self) -> tuple:
        """Forget the placeholders whose tensors are gone; their executor value ids."""
        vids = self.tracker.sweep(self.aliased)
        dropped = self.dropped
        if dropped:
            vids = {*vids, *dropped}
            dropped.clear()
        elif not vids:
            return ()
        base = self.base
        return tuple(base + v for v in vids)

    def submit(self, ins: Any) -> int:
        position = self.executor.submit(ins)
        self._until_sweep -= 1
        if self._until_sweep <= 0:
            self._until_sweep = self.sweep_every
            dead = self.sweep()
            if dead:
                self.executor.submit(Free(dead))
        return position

    def encode(self, args: tuple, kwargs: dict) -> tuple[list, dict, tuple]:
        """Arguments for the executor: this step's placeholders become value-id references
        (``refs``: argument position or name, index in a list or -1, executor value id),
        other steps' placeholders their real tensors."""
        refs: list = []
        out_args = list(args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                out_args[i] = self._ref(a, i, -1, refs)
            elif isinstance(a, (list, tuple)) and any(isinstance(x, Placeholder) for x in a):
                out_args[i] = [
                    self._ref(x, i, j, refs) if isinstance(x, torch.Tensor) else x
                    for j, x in enumerate(a)
                ]
        out_kwargs = dict(kwargs)
        for name, a in kwargs.items():
            if isinstance(a, torch.Tensor):
                out_kwargs[name] = self._ref(a, name, -1, refs)
        return out_args, out_kwargs, tuple(refs)

    def _ref(self, t: torch.Tensor, arg: Any, item: int, refs: list) -> Any:
        if isinstance(t, Placeholder):
            if t._session is self and t._real is None:
                refs.append((arg, item, self.base + t._vid))
                return None
            return t.real_tensor()
        return t

    def enter(self, site: Site) -> bool:
        """The next op of the open block is at ``site``: True if it is deferred to run in a
        planned block's order (the executor is told which block to follow), False if it runs
        as issued (the ops so far fit no planned block)."""
        node = self.node
        if node is None:
            return False
        nxt = node.children.get(site)
        if nxt is None:  # no planned block goes on like this: the rest runs as issued
            self.close_block()
            self.node = None
            return False
        self.node = nxt
        if (nxt.follow is not self.following or nxt.bound != self.bound):
            self.following, self.bound = nxt.follow, nxt.bound
            self.executor.submit(Follow(nxt.follow, nxt.bound))
        self.deferred = True
        return True

    def close_block(self) -> None:
        """A sync point (planner.graph.sync_points): the executor runs what is left of the open
        block, in its planned order when the ops make a planned block (else as issued), after
        learning which of the block's values Python let go of (freed after their last use)."""
        if self.deferred:
            dead = self.sweep()
            if dead:
                self.executor.submit(Free(dead))
            self.executor.submit(Launch(self.node.block if self.node is not None else None))
            self.deferred = False
        self.node = self.index.root if self.index is not None else None
        self.following = None

    def wait(self, position: int) -> None:
        """Wait (as the skeleton) for the executor to reach ``position``."""
        self.close_block()
        t0 = time.perf_counter()
        try:
            self.executor.wait(position, self.timeout)
        finally:
            self.stall_seconds += time.perf_counter() - t0

    def drain(self) -> None:
        self.wait(self.executor.submitted)

    def resolve(self, ph: Placeholder) -> torch.Tensor:
        """Wait for ``ph``'s value and bind it."""
        if ph._real is not None:
            return ph._real
        if not self.open:
            real = self.orphans.get(ph._vid)
            if real is None:
                raise ValueLostError("this tensor's value was never computed or is gone")
            ph._real = real
            return real
        position = self.produced_at.get(ph._vid)
        if position is None:
            raise ValueLostError(
                "this tensor's value was never computed: the step that made it failed before "
                "its op ran"
            )
        self.wait(position)
        vid = self.base + ph._vid
        real = self.executor.value(vid)
        if real is None and self.executor.away(vid):
            self.wait(self.executor.submit(Restore((vid,))))
            real = self.executor.value(vid)
        if real is None:
            raise ValueLostError("this tensor's value was never computed")
        ph._real = real
        return real

    def bind_all(self, release: bool = True) -> None:
        """After the executor drained: every live placeholder gets its value, copied out of
        the arena (which the next step reuses). ``release``: the placeholders also let go of
        the session, so a kept one does not keep the step's bookkeeping alive."""
        if self.budget is not None and self.executor.away():  # (dropped: by the plan or the guard)
            dead = self.sweep()  # (only what the program still holds is made again)
            if dead:
                self.executor.submit(Free(dead))
            self.wait(self.executor.submit(Restore(None, self.base, self.base + _VID_SPACE)))
        value = self.executor.value
        for entry in self.tracked:
            ph = entry[1]()
            if ph is not None:
                if ph._real is None:
                    ph._real = value(self.base + ph._vid)
                self.copy_out(ph)
                if release:
                    ph._session = None
            elif not self.tracker.expired(entry[2]) and entry[0] not in self.orphans:
                # only C++ holds the tensor now (say, an autograd graph kept past the step):
                # keep its value where the placeholder will look when it comes back
                real = value(self.base + entry[0])
                if real is not None and self.arena is not None and is_arena_backed(real, self.arena):
                    real = real.clone()
                self.orphans[entry[0]] = real

    def copy_out(self, ph: Placeholder) -> None:
        """Give ``ph`` its own copy if its value lives in the arena."""
        if self.arena is not None and ph._real is not None and is_arena_backed(ph._real, self.arena):
            ph._real = ph._real.clone()

    def close(self) -> None:
        """Values now live in the placeholders; the executor lets go of the step's values."""
        self.open = False
        self.executor.submit(FreeRange(self.base, self.base + _VID_SPACE))
        self.tracked = []
        if not self.orphans:
            self.produced_at.clear()


class Skeleton(Recorder):
    """Records the step while matching it against ``graph`` and sending ops to the executor."""

    skip_subclass_torch_function = True

    def __init__(self, graph: TraceGraph, session: Session, gradient_blocks: GradientBlocks | None = None) -> None:
        super().__init__()
        self.graph = graph
        self.session = session
        # (None: the step keeps autograd's saved tensors and runs every backward on the engine)
        self.backwards = Backwards(self, gradient_blocks)
        self.special = dict.fromkeys(HOOK_CALLS, self._hooked)
        self.special[torch.Tensor.backward] = self.backwards.backward
        self.special.update(dict.fromkeys(_FILLS_NEW_TENSORS, self._eagerly))
        self.cursor: Cursor | None = None
        self.eager = False
        self.fallback_reason: str | None = None  # its message (fallback_why.message)
        self.fallback_why: FallbackReason | None = None
        self.end_reason: FallbackReason | None = None  # why a covered prefix did not end there
        self.optimizers: list[Any] = []
        # rematerialization (session.remat): trace storage id -> storage key of the storages
        # the plan drops, trace values per storage, recipe ops not yet indexed, drops due
        self._drop_sids: dict[int, StorageKey] = {}
        self._sid_of_key: dict[StorageKey, int] = {}
        self._by_storage: dict[int, list[int]] = {}
        self._indexed = 0
        self._new_recipes: list[tuple] = []
        self._new_parked: list[tuple] = []  # (op index, output slot, storage key) to offload
        self._due: list[Any] = []  # planned instructions due after the op just issued
        self._swept_for_writes = False  # the op just issued wrote state in place, after a sweep
        self._node_bytes: dict[int, int] = {}  # node id -> its new bytes, for nodes not sized
        self._issued: list | None = None  # while a call is captured: the ops execute issued
        self.templated = 0  # calls issued from templates
        # with a plan: the site of each op issued, in order (the step's path signature), and
        # the latest cursor context with its loop iterations
        self.sites: list[Site] = []
        self._ctx: Any = None
        self._its: tuple = ()
        # values of tiny CPU tensors the skeleton computes too (coexec/mirrors.py): only where
        # no executor work of an earlier step is pending, so outside tensors are as Python sees
        self.mirrors: Mirrors | None = None
        self.mirrored_fetches = 0

    def on_external(self, t: torch.Tensor) -> None:
        session = self.session
        if session.budget is not None:  # (value_of has just added its value)
            sid = self.trace.values[-1].storage
            session.met_state(sid, self.trace.storage_bytes.get(sid, 0))

    def start(self, base: Any, mirrors: bool = True) -> None:
        self.trace.computed = False
        super().start(base)
        if mirrors:
            self.mirrors = Mirrors(self.graph, self.trace, self.externals, self.unrecorded)
        self.cursor = Cursor(self.graph, self.trace, mutate=False)  # after outside_loops is set
        if self.backwards.blocks is not None:
            self.backwards.saved.install()

    def stop(self, error: BaseException | None = None) -> None:
        self.backwards.saved.remove()
        self.mirrors = None  # (it refers to this skeleton)
        super().stop(error)
        self.backwards.close()
        self.special = {}

    def _eagerly(self, func: Any, args: tuple, kwargs: dict, loc: Any) -> Any:
        """A call the step runs eagerly from here on (:data:`_FILLS_NEW_TENSORS`)."""
        if not self.eager:
            self.fall_back(f"{getattr(func, '__name__', func)} fills the tensors it makes in C++")
        return self.call(func, args, kwargs, loc)

    def _hooked(self, func: Any, args: tuple, kwargs: dict, loc: Any) -> Any:
        """A hook or ``retain_grad``: this step's backward runs Python the graph does not show."""
        self.backwards.hooked = True
        return self.call(func, args, kwargs, loc)

    # -- torch-level calls -----------------------------------------------------------------
    def call(self, func: Any, args: tuple, kwargs: dict, loc: Any) -> Any:
        """A torch-level call: issued from its template where one fits (coexec/calls.py), else
        through the dispatcher (and a template made of it where it can be)."""
        if self.eager or func in TEMPLATES.plain:
            return super().call(func, args, kwargs, loc)
        # (placeholders' metadata read as a plain tensor's, not through __torch_function__)
        with torch._C.DisableTorchFunctionSubclass():
            if (torch.is_grad_enabled() and needs_grad(args, kwargs)) or not self._templatable(kwargs, loc):
                return super().call(func, args, kwargs, loc)
            sig = signature(func, args, kwargs)
            if sig is None or (torch.is_grad_enabled() and any(t.requires_grad for t in sig.tensors)):
                return super().call(func, args, kwargs, loc)
            template, capture = TEMPLATES.find(sig)
            if template is not None:
                out = issue(self, template, sig, loc)
                if out is not MISS:
                    self.templated += 1
                    return out
        if template is not None or not capture:
            return super().call(func, args, kwargs, loc)
        trace = self.trace
        n0, f0 = len(trace.ops), len(trace.fetches)
        self._issued = issued = []
        try:
            out = super().call(func, args, kwargs, loc)
        finally:
            self._issued = None  # (it holds the op's tensors)
        if self.eager or len(trace.fetches) != f0:
            return out
        made = None
        if len(trace.ops) == n0 + 1 and len(issued) == 1 and issued[0][0] == n0:
            made = make_template(self, sig, trace.ops[n0], issued[0][1:], out)
        elif len(trace.ops) == n0 and not isinstance(out, torch.Tensor):
            TEMPLATES.plain.add(func)  # a Python value without an op (``dim``, ``shape``)
        TEMPLATES.learn(sig, made)
        return out

    def _templatable(self, kwargs: dict, loc: Any) -> bool:
        """Could a call here be issued from a template? Not if autograd, autocast, inference
        mode or another mode may act on it, under a memory budget, inside a backward, or
        inside a ``try`` (its op runs at once there)."""
        return (
            self.session.remat is None
            and not kwargs.get("requires_grad")
            and torch._C._current_autograd_node() is None
            and not torch._C._is_any_autocast_enabled()
            and not torch.is_inference_mode_enabled()
            and torch._C._len_torch_dispatch_stack() == 1
            and torch._C._len_torch_function_stack() == 0
            and not CODES.catches(loc, self.base_lasti)
        )

    # -- ops ------------------------------------------------------------------------------
    def execute(
        self, rec: OpRecord, func: Any, args: tuple, kwargs: dict, tensors: list
    ) -> tuple[Any, tuple | None]:
        if self.eager:
            return super().execute(rec, func, args, kwargs, tensors)
        session = self.session
        if session.executor.error is not None:
            raise_executor_error(session.executor.error)
        remat = session.remat
        if remat is not None:
            self._remat_catch_up()
        if schema_of(func).inplace_view:
            # eager changes the tensor's metadata right now; a deferred op cannot
            self.fall_back(f"{func} changes a tensor's metadata in place")
            if _repoints_inside_a_call(func, args, self.call_func, session):
                return _repoint(func, args, kwargs)
            return super().execute(rec, func, args, kwargs, tensors)
        try:
            node = self.cursor.op(rec, lambda: self.output_metas(func, args, kwargs))
        except NotCovered as e:
            self.fall_back(e.reason)
            return super().execute(rec, func, args, kwargs, tensors)

        base, first, n_ret = session.base, len(self.trace.values), node.n_returned
        data_dependent = "py" in node.out_struct or schema_of(func).dynamic_shape
        check = node.sized and not data_dependent and node.inferred is not True
        if check and any(a is not None for a in node.out_alias):
            node.inferred, check = True, False  # a view: C++ meta kernels (view, as_strided) say
        plan = _returns(func)
        struct = node.out_struct  # per return: 1, None (undefined), n (list length), "py"
        # the flattened outputs as the recorder numbers them (value ids first, first+1, ...):
        # returned tensors, then arguments written in place and not returned
        slots: list[Any] = []  # the written argument itself, or None for a new tensor
        for (kind, i), shape in zip(plan, struct):
            if kind == "w":
                slots.append(args[i] if i < len(args) else kwargs[func._schema.arguments[i].name])
            elif shape == 1:
                slots.append(None)
            elif isinstance(shape, int) and not isinstance(shape, bool):
                slots.extend([None] * shape)
        returned = {id(x) for x in slots if x is not None}
        slots.extend(tensors[p] for p in rec.writes if id(tensors[p]) not in returned)
        moves = [
            (x, base + first + j)
            for j, x in enumerate(slots)
            if isinstance(x, Placeholder) and x._session is session and x._real is None
        ]
        ins_args, ins_kwargs, refs = session.encode(args, kwargs)
        if self._issued is not None:  # a call template may be made of it
            self._issued.append((rec.index, func, args, kwargs, node))
        clean = not data_dependent and slots and all(x is None for x in slots)
        grad_mode = torch.is_grad_enabled()
        new_bytes = 0
        if session.budget is not None and clean:  # (the guard's room for it: executor/guard.py)
            if node.sized:
                new_bytes = _new_bytes(node, self.cursor.metas)
            else:  # (the same every step)
                new_bytes = self._node_bytes.get(node.id, -1)
                if new_bytes < 0:
                    new_bytes = self._node_bytes[node.id] = _new_bytes(node, node.out_metas)
        position = self._issue(
            rec, node, func, ins_args, ins_kwargs, refs,
            tuple((base + x._vid, new) for x, new in moves), data_dependent or check, clean, grad_mode,
            new_bytes,
        )  # fmt: skip
        if self.backwards.capturing:
            self.backwards.log(rec, func, args, kwargs, moves, refs, base, grad_mode)
        for x, new in moves:
            session.retarget(x, new - base, position)
        if self.mirrors is not None and self.mirrors.ready is rec:
            self.mirrors.mirror(rec, func, args, kwargs, tensors, first)
        if data_dependent:  # Python needs the result (or its shape) now: a fetch
            session.wait(position)
            return session.executor.take_result(rec.index), None

        if check:
            session.wait(position)
            metas = self._check_inferred(node, func, args, kwargs, session.executor.take_result(rec.index))
        else:
            metas = self.cursor.metas if node.sized else node.out_metas
        made = [
            x if x is not None else session.new_placeholder(metas[j], first + j, position)
            for j, x in enumerate(slots[:n_ret])
        ]
        out: list[Any] = []
        j = 0
        for (kind, _), shape in zip(plan, struct):
            if shape is None:
                out.append(None)
            elif kind == "tl":  # (a list of one tensor has the shape of a tensor: 1)
                out.append(made[j : j + shape])
                j += shape
            else:
                out.append(made[j])
                j += 1
        if not plan:
            return None, ()
        return (out[0] if len(plan) == 1 else tuple(out)), node.out_alias[:n_ret]

    def _issue(
        self, rec: OpRecord, node: Any, func: Any, ins_args: list, ins_kwargs: dict, refs: tuple,
        moves: tuple, data_dependent: bool, clean: bool, grad_mode: bool, new_bytes: int = 0,
    ) -> int:
        """Send op ``rec`` (matched to ``node``) to the executor: into the open planned block,
        with its arena place and, under a budget, its recipe and due drops and moves.
        ``clean``: every output is a new tensor (none written in place). Its position."""
        session = self.session
        remat = session.remat
        base, first, n_ret = session.base, len(self.trace.values), node.n_returned
        its = ()
        if session.schedule is not None:
            ctx = self.cursor.placed[rec.index][1]
            if ctx is not self._ctx:  # (ops of one loop iteration share their context)
                self._ctx, self._its = ctx, iterations(ctx)
            its = self._its
            site = Site(node.id, its)
            self.sites.append(site)
            if session.site_bytes is not None and not session.guarded and session.outgrew(site, new_bytes):
                session.guard()
        arena_out = None
        if session.arena is not None and clean:
            arena_out = self._arena_out(func, node, its, n_ret)
        recipe = False
        if remat is not None and not session.guarded:  # (outgrown: the guard alone, from here)
            if clean:
                recipe = self._is_recipe(remat, node, rec, its, n_ret)
            due = remat.after.get(Site(node.id, its))
            if due:
                self._due.extend(due)
            if remat.parked:
                for k in range(n_ret):
                    key = StorageKey(node.id, k, its)
                    if key in remat.parked and (k >= len(node.out_alias) or node.out_alias[k] is None):
                        self._new_parked.append((rec.index, k, key))
        self.backwards.grad_modes.append(grad_mode)
        if self.mirrors is not None:
            self.mirrors.issued(node, rec)
        writes = schema_of(func).writes if session.budget is not None else ()
        if session.guarded:
            if writes and not moves and not self._swept_for_writes:
                session.sweep_before_write()
            self._swept_for_writes = bool(writes) and not moves
        deferred = session.blocks and session.enter(self.sites[-1])
        position = session.submit(
            Run(
                func, ins_args, ins_kwargs, refs,
                tuple(base + first + j for j in range(n_ret)),
                moves, rec.index, rec.key.loc, data_dependent, arena_out, grad_mode, recipe,
                (recipe or session.budget is not None) and schema_of(func).random, deferred, new_bytes,
                writes, session.guarded and rec.is_backward,
            )
        )  # fmt: skip
        if rec.index in self.trace.in_try:
            self._run_now(position, rec)
        return position

    def _run_now(self, position: int, rec: OpRecord) -> None:
        """An op inside a user's ``try``: wait for it, so that if it fails its error is raised
        here, where eager raises it and the ``except`` can catch it. The ops before it ran; it
        did not: the step goes on eagerly from here (a fallback), as the program's handler
        continues it."""
        session = self.session
        try:
            session.wait(position)
            return
        except ExecutorError as e:
            err = e
        if err.op_index != rec.index or err.__cause__ is None:
            raise_executor_error(err)  # an earlier op failed: not this try's business
        cause = err.__cause__
        try:
            session.drain()  # what was queued behind it (frees) goes through
        except ExecutorError:
            pass
        session.executor.clear_error()
        self.fall_back(
            f"{type(cause).__name__} raised by {rec.name} at {CODES.describe(rec.key.loc)}, "
            "inside a try block"
        )
        raise cause.with_traceback(None)

    # -- rematerialization ---------------------------------------------------------------
    def _is_recipe(self, remat: Schedule, node: Any, rec: OpRecord, its: tuple, n_ret: int) -> bool:
        """Does the op make (or view) a storage the plan drops? Then the executor keeps it."""
        values = self.trace.values
        fresh = []
        for k in range(n_ret):
            alias = node.out_alias[k] if k < len(node.out_alias) else None
            if alias is None:
                key = StorageKey(node.id, k, its)
                if key in remat.recompute:
                    fresh.append((k, key))
            elif alias < len(rec.inputs) and values[rec.inputs[alias]].storage in self._drop_sids:
                return True
        if fresh:
            self._new_recipes.append((rec.index, fresh))
            return True
        return False

    def _remat_catch_up(self) -> None:
        """Before the next op: learn the storages of the ops just recorded, then drop what
        the plan frees after them."""
        trace = self.trace
        values = trace.values
        by_storage = self._by_storage
        for v in values[self._indexed :]:
            by_storage.setdefault(v.storage, []).append(v.vid)
        self._indexed = len(values)
        for index, fresh in self._new_recipes:
            outputs = trace.ops[index].outputs
            for k, key in fresh:
                sid = values[outputs[k]].storage
                self._drop_sids[sid] = key
                self._sid_of_key[key] = sid
        self._new_recipes.clear()
        for index, k, key in self._new_parked:
            self._sid_of_key[key] = values[trace.ops[index].outputs[k]].storage
        self._new_parked.clear()
        if not self._due:
            return
        base, session = self.session.base, self.session
        dropped: list[int] = []
        for planned in self._due:  # moves, then drops (planner.schedule.Schedule.after)
            sid = self._sid_of_key.get(planned.storage)
            if sid is None:
                continue
            vids = tuple(base + v for v in by_storage.get(sid, ()))
            if type(planned) is PlannedDrop:
                dropped.extend(vids)
            elif type(planned) is PlannedOffload:
                session.submit(Offload(vids, planned.host_offset, planned.host_bytes))
            elif type(planned) is PlannedPrefetch:
                session.submit(Prefetch(vids))
            else:
                session.submit(Wait(vids))
        self._due.clear()
        if dropped:
            session.submit(Drop(tuple(dropped)))

    def _arena_out(self, func: Any, node: Any, its: tuple, n_ret: int) -> tuple | None:
        """Where the planned arena wants this op's outputs: all of them fresh, planned, and
        the op has an ``out=`` variant; else None (the allocator). Worked out once per op and
        plan (``Session.arena_outs``)."""
        cache = self.session.arena_outs
        key = (node.id, its)
        found = cache.get(key, _UNKNOWN)
        if found is _UNKNOWN:
            found = cache[key] = self._plan_arena_out(func, node, its, n_ret)
        return found

    def _plan_arena_out(self, func: Any, node: Any, its: tuple, n_ret: int) -> tuple | None:
        if n_ret == 0 or len(node.out_struct) != n_ret or any(a is not None for a in node.out_alias[:n_ret]):
            return None
        if node.sized:  # (the arena places sizes as planned; this step's may be larger)
            return None
        ov = out_variant(func)
        if ov is None:
            return None
        offsets = self.session.schedule.offsets
        outs = []
        for k in range(n_ret):
            offset = offsets.get(StorageKey(node.id, k, its))
            if offset is None:
                return None
            meta = node.out_metas[k]
            shape, stride = tuple(meta.shape), tuple(meta.stride)
            outs.append((offset, shape, stride, meta.dtype, span_bytes(shape, stride, meta.dtype)))
        return (ov[0], ov[1], tuple(outs))

    def _check_inferred(self, node: Any, func: Any, args: tuple, kwargs: dict, result: Any) -> tuple:
        """A sized node's outputs were worked out on the meta device (``output_metas``): the
        first time, the op's real ``result`` (waited for) says whether its meta kernel is right
        (``mkldnn_rnn_layer``'s says its workspace is empty). Where it is not, the node's
        results are waited for from now on, so Python never sees a wrong size. Its outputs'
        metadata, from the result."""
        inferred = self.cursor.metas
        real = tuple(TensorMeta.of(x) for x in flat_outputs(func, args, kwargs, result))
        node.inferred = inferred is not None and same_sizes(real, inferred)
        return real

    def output_metas(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        """The metadata of the op's outputs, flattened as the recorder numbers them (returned
        tensors, then arguments written and not returned), worked out on the meta device
        without running it (None: it cannot be): for a graph node whose fed integer may have
        changed a size (``Cursor.sizes_hold``)."""

        def meta(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                if x.layout is not torch.strided:
                    raise TypeError("not strided")
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            if isinstance(x, (list, tuple)):
                return type(x)(meta(y) for y in x)
            return x

        self.suppress += 1  # (making the meta tensors is no op of the program either)
        try:
            m_args = [meta(a) for a in args]
            m_kwargs = {k: meta(v) for k, v in kwargs.items()}
            if "device" in m_kwargs:  # a factory: made there too, not allocated
                m_kwargs["device"] = torch.device("meta")
            out = _on_meta(func, m_args, m_kwargs)
        except Exception:  # noqa: BLE001  (no meta kernel, an argument it cannot take: unknown)
            return None
        finally:
            self.suppress -= 1
        return tuple(TensorMeta.of(x) for x in flat_outputs(func, m_args, m_kwargs, out))

    def storage_key(self, t: torch.Tensor) -> int | None:
        if isinstance(t, Placeholder):
            if t._real is None:
                return None  # a placeholder of this step: its storage is the node's business
            t = t._real
        return super().storage_key(t)

    # -- fetches --------------------------------------------------------------------------
    def on_fetch(self, kind: str, t: Any, loc: Any) -> None:
        super().on_fetch(kind, t, loc)
        if not self.eager:
            self.session.close_block()  # every fetch is a sync point, waiting or not
            try:
                self.cursor.fetch(self.trace.fetches[-1])
            except NotCovered as e:
                self.fall_back(e.reason)

    def before_fetch(self, kind: str, t: Any) -> torch.Tensor | None:
        if self.eager:
            return None
        if self.mirrors is not None and kind in _MIRRORED_FETCHES and isinstance(t, torch.Tensor):
            known = self.mirrors.known(self.vmap.get(t))
            if known is not None:  # the skeleton computed it too: no wait
                self.mirrored_fetches += 1
                return known
        session = self.session
        if isinstance(t, Placeholder) and t._session is session and kind not in ("numpy", "cpu"):
            session.resolve(t)
        else:
            # a real tensor, or a writable view of the data: everything issued must be done
            self.sync()
            if isinstance(t, Placeholder):
                t.real_tensor()
                self.suppress += 1  # our copy is not the program's op
                try:
                    session.copy_out(t)  # Python may keep the view: not into the arena
                finally:
                    self.suppress -= 1
        return None

    def fetched(self, t: torch.Tensor) -> torch.Tensor:
        return t.real_tensor() if isinstance(t, Placeholder) else t

    # -- control --------------------------------------------------------------------------
    def sync(self) -> None:
        self.session.drain()

    def fall_back(self, reason: str | FallbackReason) -> None:
        """Finish the confirmed prefix, bind placeholders, go on eagerly."""
        if not isinstance(reason, FallbackReason):
            reason = FallbackReason(OTHER, reason, "")
        self.eager = True
        self.fallback_why = reason
        self.fallback_reason = reason.message
        self.sync()
        # the rest of the step computes eagerly on these values: give them their own memory
        self.session.bind_all(release=False)

    def finish(self) -> bool:
        """The step's Python is done: True if its path (up to ``end``) is in the graph."""
        covered = not self.eager
        if covered:
            try:
                self.cursor.finish()
            except NotCovered as e:
                covered = False
                self.end_reason = e.reason
        return covered

    def leaves(self) -> list[torch.Tensor]:
        return list(self.first_use.keys())


# fetches that only read the values (a view of the data, a copy Python keeps, waits as before)
_MIRRORED_FETCHES = frozenset({"item", "bool", "float", "int", "index", "tolist", "repr", "format", "tensor"})


# torch-level calls whose C++ writes into a tensor it made through its data pointer
# (``at::tensor(std::vector)``): a placeholder has no data, so the step runs them eagerly
_FILLS_NEW_TENSORS = (torch._VF._pad_packed_sequence,)


def _new_bytes(node: Any, metas: Any) -> int:
    """Bytes of the new tensors among an op's returned outputs (not views of its arguments)."""
    if not metas:
        return 0
    alias = node.out_alias
    return sum(
        m.nbytes for k, m in enumerate(metas[: node.n_returned])
        if m is not None and (k >= len(alias) or alias[k] is None)
    )  # fmt: skip


def _repoints_inside_a_call(func: Any, args: tuple, call: Any, session: Any) -> bool:
    """Is ``func`` a ``set_`` of a placeholder of this step onto a real storage, made inside
    a torch-level call other than ``set_`` itself? (cuDNN's LSTM makes its flat weight buffer
    as ``at::empty({0}).set_(storage)`` inside ``torch._VF.lstm``.)"""
    return (
        func.overloadpacket is torch.ops.aten.set_
        and "Storage" in func._overloadname
        and len(args) > 1
        and isinstance(args[0], Placeholder)
        and args[0]._session is session
        and args[1].data_ptr() != 0  # a real storage (not a placeholder's)
        and call is not None
        and getattr(call, "__name__", None) != "set_"
    )


def _repoint(func: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """Run such a ``set_`` on the placeholder's real tensor (the step has fallen back). The
    placeholder keeps its metadata: the call that made it sees it as it was (cuDNN's LSTM: an
    empty buffer, so it copies the weights into one of its own, with the same values), and
    what reads its values reads the real, re-pointed tensor."""
    ph = args[0]
    func(ph.real_tensor(), *args[1:], **kwargs)
    return ph, (0,)


def raise_executor_error(err: ExecutorError) -> None:
    raise attach_issue_traceback(err, err.location)


_RETURN_PLANS: dict[Any, tuple] = {}


def _returns(func: Any) -> tuple:
    """How to build an op's result: per schema return, ``("w", arg)`` the written argument
    itself, ``("t", -1)`` a tensor, ``("tl", -1)`` a list of tensors, ``("py", -1)`` a
    Python value."""
    plan = _RETURN_PLANS.get(func)
    if plan is None:
        sch = func._schema
        items = []
        for k, r in enumerate(sch.returns):
            ty = r.type
            if isinstance(ty, torch.TensorType):
                ai = r.alias_info
                if ai is not None and ai.is_write:
                    items.append(("w", schema_of(func).return_alias[k]))
                else:
                    items.append(("t", -1))
            elif isinstance(ty, torch.ListType) and isinstance(ty.getElementType(), torch.TensorType):
                items.append(("tl", -1))
            else:
                items.append(("py", -1))
        plan = _RETURN_PLANS[func] = tuple(items)
    return plan
