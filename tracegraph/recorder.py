"""Recording a step: ``with record() as trace: step()``.

Two modes cooperate (DESIGN.md §4, "Recording below autograd"):

* a ``TorchFunctionMode`` sees each torch-level call with its Python call site. It captures the
  location once per call, and it is where Python reads tensor data without an ATen op
  (``.numpy()``, ``.tolist()``, ``repr``): those calls become :class:`Fetch` es.
* a ``TorchDispatchMode`` sees the ATen ops of forward, backward and optimizer. Backward ops run
  from the autograd engine, not from the user's line, so their location is derived from the
  forward op that created the autograd node being executed (matched through autograd sequence
  numbers); that keeps the gradient ops of a loop body equal across iterations.
"""

from __future__ import annotations

import sys
import threading
import time
import types
import weakref
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .location import ACC, BSUB, BWD, CODES, RUN, SUB, UNKNOWN, Location
from .schema import TensorMeta, list_spans, schema_of
from .structure import enclosing_loops
from .trace import Fetch, OpKey, OpRecord, Trace, Value

_NO_SEQ = 2**64 - 1  # sequence number of AccumulateGrad nodes
_SKIPPED_NAMESPACES = frozenset({"profiler"})  # record_function markers: no data, no effect

_TB = torch._C.TensorBase
# torch-level calls that read tensor data into Python. The ops they run internally (printing
# runs many) are not part of the program's computation and are not recorded.
FETCH_CALLS: dict[Any, str] = {
    _TB.item: "item",
    _TB.__bool__: "bool",
    _TB.__float__: "float",
    _TB.__int__: "int",
    _TB.__index__: "index",
    _TB.tolist: "tolist",
    _TB.numpy: "numpy",
    _TB.cpu: "cpu",
    torch.Tensor.__repr__: "repr",
    torch.Tensor.__format__: "format",
    torch.Tensor.__array__: "numpy",
    # copies of the data made in Python: the copy is not part of the step's computation; the
    # new tensor is an input of the ops that use it, as a batch would be
    torch.Tensor.__deepcopy__: "deepcopy",
    torch.Tensor.__reduce_ex__: "pickle",  # torch.save, pickle, multiprocessing queues
}

# Constructors that read the data of tensors nested in their data argument (``torch.tensor([r])``
# with ``r`` a 0-d tensor): each such tensor is a fetch, and the new tensor an input, as if
# Python had read the values with ``.item()`` and built it from floats. Per constructor: the
# position of its data argument, and whether a tensor given as the data itself is copied
# (``as_tensor(t)`` returns ``t`` itself, an op on the graph like any other).
DATA_CONSTRUCTORS: dict[Any, tuple[int, bool]] = {
    torch.tensor: (0, True),
    torch.as_tensor: (0, False),
    torch.asarray: (0, False),
    _TB.new_tensor: (1, True),
}


def _rebuild_codes() -> frozenset:
    """Code objects of torch's functions that rebuild a tensor around existing bytes (unpickling
    in ``torch.load``, a ``DataLoader`` worker's batch in shared memory): the ops they issue
    (``empty`` then ``set_`` onto the storage) make a new input, not part of the step's
    computation, so they run unrecorded."""
    import torch._utils as tu
    import torch.multiprocessing.reductions as mr

    funcs = [getattr(m, n) for m in (tu, mr) for n in dir(m) if "rebuild" in n]
    return frozenset(f.__code__ for f in funcs if isinstance(f, types.FunctionType))


REBUILD_CODES = _rebuild_codes()

_active = threading.local()


class RecordError(RuntimeError):
    """Misuse of :func:`record`."""


class Recorder:
    """The state of one recording; both modes report into it.

    Subclasses change how an op runs without changing what is recorded: :meth:`execute`
    computes an op (eagerly here; the co-execution skeleton returns placeholders instead), and
    :meth:`before_fetch` runs before Python reads tensor data.
    """

    # call torch functions past tensor subclasses' own __torch_function__ (the co-execution
    # skeleton's placeholders need none: every op goes to the dispatch mode anyway)
    skip_subclass_torch_function = False

    def __init__(self, trace: Trace | None = None) -> None:
        self.trace = trace if trace is not None else Trace()
        self.base: types.FrameType | None = None
        self.base_lasti = -1
        self.vmap = _TensorMap(self._released)  # tensor -> value id
        self.first_use = _TensorMap()  # leaf -> (op, input pos)
        self.ext_storage: dict[int, int] = {}  # StorageImpl address -> storage id
        # external value id -> its tensor, alive while recording (a storage's address must not
        # be reused while mapped)
        self.externals: dict[int, torch.Tensor] = {}
        self.n_storages = 0
        self.call_loc: Location | None = None  # location of the current torch-level call
        self.call_func: Any = None  # and its function
        self.sub = 0
        self.suppress = 0
        self.seq_op: dict[int, int] = {}  # autograd sequence nr -> forward op index
        self.last_seq = _get_sequence_nr()
        self.mirrored: dict[int, Location] = {}  # forward op index -> where its gradient runs
        self.node_key: Any = None
        self.bsub = 0
        self.run_first: Any = None  # the first op of a gathering node's gradient, once seen
        self._modes: tuple | None = None
        # torch-level calls a subclass runs itself: func -> handler(func, args, kwargs, loc)
        self.special: dict[Any, Any] = {}
        self.thread = threading.get_ident()  # the recording thread (set again by start)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, base: types.FrameType) -> None:
        """Start recording ops in this thread; locations are relative to frame ``base``."""
        if getattr(_active, "recorder", None) is not None:
            raise RecordError("a recording is already active in this thread; recordings do not nest")
        self.base = base
        self.thread = threading.get_ident()
        self.base_lasti = base.f_lasti  # where the step's frame entered it
        self.trace.outside_loops = loops_around(base)
        fmode, dmode = _FunctionMode(self), _DispatchMode(self)
        fmode.__enter__()
        try:
            dmode.__enter__()
        except BaseException:
            fmode.__exit__(None, None, None)
            raise
        self._modes = (fmode, dmode)
        _active.recorder = self

    def stop(self, error: BaseException | None = None) -> None:
        """Stop recording; the trace is complete, or failed if ``error`` is given."""
        if self._modes is None:
            return
        fmode, dmode = self._modes
        self._modes = None
        try:
            dmode.__exit__(None, None, None)
        finally:
            fmode.__exit__(None, None, None)
            _active.recorder = None
            self.trace.status = "failed" if error is not None else "complete"
            self.trace.error = error
            self.trace.alive_at_end = frozenset(
                vid for _t, vid in self.vmap.items()
            )
            self.externals.clear()
            self.vmap.clear()  # (each entry's death callback refers to its map: a cycle)
            self.first_use.clear()
            self.base = None

    # -- hooks ----------------------------------------------------------------------------
    def execute(
        self, rec: OpRecord, func: Any, args: tuple, kwargs: dict, tensors: list
    ) -> tuple[Any, tuple | None]:
        """Run the op (``tensors``: its tensor arguments, flattened as in ``rec.inputs``).
        Returns its result and, if known, which input each returned tensor aliases (None:
        find out from the real storages)."""
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        rec.seconds = time.perf_counter() - t0
        return out, None

    def before_fetch(self, kind: str, t: Any) -> torch.Tensor | None:
        """Python is about to read ``t``'s data through ``kind``; a tensor holding the same
        data for Python to read instead, or None (read ``t``)."""
        return None

    def fetched(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor whose data Python reads in place of ``t`` (after :meth:`before_fetch`)."""
        return t

    def on_external(self, t: torch.Tensor) -> None:
        """The step met ``t`` from outside it for the first time (a batch, a parameter,
        optimizer state): ``coexec`` tells models apart by their parameters here."""

    def call(self, func: Any, args: tuple, kwargs: dict, loc: Location) -> Any:
        """Run a torch-level call (not a fetch) made at ``loc``; its ATen ops are recorded
        (the calls in :attr:`special` go to their handler instead)."""
        saved = self.call_loc, self.sub, self.call_func
        self.call_loc, self.sub, self.call_func = loc, 0, func
        try:
            if self.skip_subclass_torch_function:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        finally:
            self.call_loc, self.sub, self.call_func = saved

    def unrecorded(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with its ops not recorded."""
        self.suppress += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.suppress -= 1

    def storage_key(self, t: torch.Tensor) -> int | None:
        """An identity for the storage behind ``t`` (None if it has none)."""
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None

    # -- values -------------------------------------------------------------------------
    def _released(self, vid: int) -> None:
        """A tensor of the step died: it was held through the op recorded next."""
        trace = self.trace
        if trace.status == "recording":
            trace.released[vid] = len(trace.ops)

    def _new_storage(self, t: torch.Tensor | None = None) -> int:
        sid = self.n_storages
        self.n_storages += 1
        if t is not None:
            self.trace.storage_bytes[sid] = storage_nbytes(t)
        return sid

    def _new_value(self, producer: int | None, out_index: int, t: torch.Tensor, storage: int) -> int:
        values = self.trace.values
        vid = len(values)
        values.append(Value(vid, producer, out_index, TensorMeta.of(t), storage))
        self.vmap[t] = vid
        return vid

    def value_of(self, t: torch.Tensor) -> int:
        vid = self.vmap.get(t)
        if vid is not None:
            return vid
        addr = self.storage_key(t)
        sid = self.ext_storage.get(addr) if addr is not None else None
        if sid is None:
            sid = self._new_storage(t)
            if addr is not None:
                self.ext_storage[addr] = sid
        vid = self._new_value(None, 0, t, sid)
        self.externals[vid] = t
        self.trace.externals.append(vid)
        self.on_external(t)
        return vid

    def same_value(self, t: torch.Tensor, of: torch.Tensor) -> None:
        """``t`` stands for ``of``'s current value (autograd's saved copy of it)."""
        vid = self.vmap.get(of)
        if vid is not None:
            self.vmap[t] = vid

    # -- locations ------------------------------------------------------------------------
    def capture(self, frame: types.FrameType | None) -> Location:
        return CODES.capture(frame, self.base)

    def _forward_location(self) -> Location:
        loc = self.call_loc
        if loc is None:  # an ATen op issued outside any torch-level call
            loc = self.capture(sys._getframe(3))
            self.call_loc, self.sub = None, 0
            return loc + ((SUB, 0),)
        sub = self.sub
        self.sub = sub + 1
        return loc + ((SUB, sub),)

    def _mirror(self, op_index: int) -> Location:
        """Where the gradient of forward op ``op_index`` runs: its location, offsets negated;
        then a ``RUN`` pseudo-frame if the op took a tensor list gathered from a loop
        (``torch.stack(log_probs)``, :func:`_gathers_from_loop`): its gradient makes one run of
        ops per element, the iterations of that pseudo-loop, so the graph does not depend on
        the list's length."""
        m = self.mirrored.get(op_index)
        if m is None:
            m = self.mirrored[op_index] = mirror_location(self.trace, op_index)
        return m

    def _backward_location(self, node: Any, func: Any) -> tuple[Location, int | None]:
        seq = node._sequence_nr()
        fwd = self.seq_op.get(seq)
        leaf_use = None
        if fwd is None and seq == _NO_SEQ:
            leaf = getattr(node, "variable", None)
            key = (seq, id(leaf))
            if leaf is not None:
                leaf_use = self.first_use.get(leaf)
        else:
            key = seq
        if key != self.node_key:
            self.node_key, self.bsub, self.run_first = key, 0, None
        site = self.call_loc if self.call_loc is not None else self.capture(sys._getframe(4))
        site = site + ((BWD, 0),)
        if fwd is not None:
            where = self._mirror(fwd)
            if where[-1][0] == RUN and (self.run_first is None or func == self.run_first):
                # a run per element: each starts again with the op the first one started with
                self.run_first, self.bsub = func, 0
        elif leaf_use is not None:
            op_index, pos = leaf_use
            where = self._mirror(op_index) + ((ACC, pos),)
        else:
            where = ((UNKNOWN, 0),)
        bsub = self.bsub
        self.bsub += 1
        return site + where + ((BSUB, bsub),), fwd

    def _claim_nodes(self, index: int) -> None:
        """The autograd nodes made since the last op (this thread's sequence numbers) belong
        to op ``index``."""
        seq = _get_sequence_nr()
        if seq != self.last_seq:
            for s in range(self.last_seq, seq):
                self.seq_op[s] = index
            self.last_seq = seq

    # -- ops ------------------------------------------------------------------------------
    def on_op(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        sch = schema_of(func)
        attrs, tensors, owner = sch.normalize(args, kwargs)
        index = len(self.trace.ops)
        node = torch._C._current_autograd_node()
        backward_of = None
        if node is None:
            loc = self._forward_location()
            self._claim_nodes(index)
        else:
            loc, backward_of = self._backward_location(node, func)
            if torch.is_grad_enabled() and threading.get_ident() == self.thread:
                # a backward with create_graph: the nodes this op made belong to it, so the ops
                # of a double backward mirror it (and not whichever forward op came next)
                self._claim_nodes(index)

        inputs = tuple(self.value_of(t) for t in tensors)
        metas = tuple(TensorMeta.of(t) for t in tensors)
        if node is None:
            self.note_first_use(index, tensors)
        writes = tuple(i for i, arg in enumerate(owner) if arg in sch.writes)
        rec = OpRecord(
            index=index,
            key=OpKey.of(func, attrs, metas, loc),
            inputs=inputs,
            outputs=(),
            writes=writes,
            python_result=False,
            backward_of=backward_of,
        )
        if CODES.catches(loc, self.base_lasti):
            self.trace.in_try.add(index)

        out, alias = self.execute(rec, func, args, kwargs, tensors)

        values = self.trace.values
        results = _flatten_result(out)
        if alias is None:
            alias = self._aliases(tensors, results)
        outputs = []
        returned = set()
        for t, a in zip(results, alias):
            returned.add(id(t))
            sid = values[inputs[a]].storage if a is not None else self._new_storage(t)
            outputs.append(self._new_value(index, len(outputs), t, sid))
        n_returned = len(outputs)
        for i in writes:  # a mutated argument not returned still has a new value now
            t = tensors[i]
            if id(t) not in returned:
                outputs.append(self._new_value(index, len(outputs), t, values[inputs[i]].storage))
                alias = (*alias, i)
        rec.outputs = tuple(outputs)
        rec.out_alias = tuple(alias)
        rec.n_returned = n_returned
        rec.out_struct = _structure(out)
        rec.python_result = out is not None and not results and not isinstance(out, (tuple, list))
        self.trace.ops.append(rec)
        return out

    def note_first_use(self, index: int, tensors: Any) -> None:
        """The forward op ``index`` takes ``tensors`` (flattened): where each leaf that
        requires grad is first used (gradient accumulation is located by it)."""
        first_use = self.first_use
        for pos, t in enumerate(tensors):
            if t.requires_grad and t.is_leaf and first_use.get(t) is None:
                first_use[t] = (index, pos)

    def append_op(self, rec: OpRecord, out_metas: tuple, out_bytes: tuple) -> int:
        """Record op ``rec`` issued without running it here (its outputs known by metadata):
        a value per output, on a new storage of ``out_bytes[k]`` bytes, or on the storage of
        the input it aliases. Returns the first output's value id."""
        trace = self.trace
        values = trace.values
        first = len(values)
        for k, (meta, alias, nbytes) in enumerate(zip(out_metas, rec.out_alias, out_bytes)):
            if alias is None:
                sid = self._new_storage()
                trace.storage_bytes[sid] = nbytes
            else:
                sid = values[rec.inputs[alias]].storage
            values.append(Value(first + k, rec.index, k, meta, sid))
        rec.outputs = tuple(range(first, len(values)))
        trace.ops.append(rec)
        return first

    def _aliases(self, tensors: list[torch.Tensor], results: list[torch.Tensor]) -> tuple:
        """For each output, the input whose storage it shares (checked on the real storages,
        so unannotated aliasing such as ``_unsafe_view`` is caught)."""
        in_storage: dict[int, int] = {}
        for pos, t in enumerate(tensors):
            key = self.storage_key(t)
            if key is not None:
                in_storage.setdefault(key, pos)
        return tuple(
            in_storage.get(self.storage_key(t)) if in_storage else None for t in results
        )

    def on_fetch(self, kind: str, t: Any, loc: Location) -> None:
        vid = self.value_of(t) if isinstance(t, torch.Tensor) else None
        self.trace.fetches.append(Fetch(kind, vid, len(self.trace.ops), loc))


def mirror_location(trace: Trace, op_index: int) -> Location:
    """Where the gradient of forward op ``op_index`` runs (:meth:`Recorder._mirror`)."""
    m = tuple((c, -o) for c, o in trace.ops[op_index].key.loc)
    if _gathers_from_loop(trace, op_index):
        m += ((RUN, 0),)
    return m


def _gathers_from_loop(trace: Trace, op_index: int) -> bool:
    """Does forward op ``op_index`` take a tensor list whose elements one location made, inside
    a loop the op is not in? (A leaf's first use is never such an op: a leaf has no producer.)"""
    rec = trace.ops[op_index]
    for _pos, start, end in list_spans(rec.key.func, rec.key.attrs):
        producers = {trace.values[v].producer for v in rec.inputs[start:end]}
        if None in producers or not producers:
            continue
        locs = {trace.ops[p].key.loc for p in producers}
        if len(locs) != 1:
            continue
        inner = {key for key, _ in enclosing_loops(next(iter(locs)), trace.outside_loops)}
        outer = {key for key, _ in enclosing_loops(rec.key.loc, trace.outside_loops)}
        if inner - outer:
            return True
    return False


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t``; for a tensor without real storage (a placeholder),
    the bytes its own layout spans."""
    try:
        n = t.untyped_storage().nbytes()
        if n or t.numel() == 0:
            return n
    except (RuntimeError, NotImplementedError):
        pass
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return (t.storage_offset() + span) * t.element_size()


def _structure(out: Any) -> tuple:
    """The shape of an op's result, per return: 1 a tensor, None an undefined tensor, an int n
    a list of n tensors, ``"py"`` a Python value (a one-tuple for a single return)."""
    items = out if isinstance(out, tuple) else (out,)
    return tuple(
        1 if isinstance(x, torch.Tensor)
        else len(x) if isinstance(x, list)
        else None if x is None
        else "py"
        for x in items
    )  # fmt: skip


class _TensorMap:
    """tensor -> value id, by identity, without keeping tensors alive.

    A plain dict on ``id()`` with a weak reference per entry: the reference both checks that
    the id still names the same tensor and removes the entry when the tensor dies. (PyTorch
    keeps a tensor's Python object alive while autograd holds the tensor, so saved tensors
    keep their identity into the backward.)
    """

    __slots__ = ("_d", "_on_release")

    def __init__(self, on_release: Any = None) -> None:
        self._d: dict[int, tuple[weakref.ref, Any]] = {}
        # called with the value when its tensor dies; a method is held weakly (its object
        # holds this map: a cycle only the garbage collector would free)
        weak = hasattr(on_release, "__self__")
        self._on_release = weakref.WeakMethod(on_release) if weak else on_release

    def clear(self) -> None:
        """Forget every tensor (no callbacks from now on)."""
        self._d.clear()

    def keys(self) -> list[torch.Tensor]:
        """The live tensors in the map."""
        return [t for ref, _ in self._d.values() if (t := ref()) is not None]

    def items(self) -> list[tuple[torch.Tensor, Any]]:
        return [(t, v) for ref, v in self._d.values() if (t := ref()) is not None]

    def get(self, t: torch.Tensor) -> Any:
        e = self._d.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        return None

    def __setitem__(self, t: torch.Tensor, vid: Any) -> None:
        d = self._d
        key = id(t)
        on_release = self._on_release

        def drop(ref: weakref.ref, d: dict = d, key: int = key) -> None:
            e = d.get(key)
            if e is not None and e[0] is ref:
                del d[key]
                f = on_release() if isinstance(on_release, weakref.WeakMethod) else on_release
                if f is not None:
                    f(e[1])

        d[key] = (weakref.ref(t, drop), vid)


def flat_outputs(func: Any, args: tuple | list, kwargs: dict, out: Any) -> list[torch.Tensor]:
    """An op's outputs as :meth:`Recorder.on_op` numbers them: the tensors it returned, then
    the tensor arguments it wrote and did not return."""
    sch = schema_of(func)
    _attrs, tensors, owner = sch.normalize(tuple(args), kwargs)
    results = _flatten_result(out)
    returned = {id(t) for t in results}
    return results + [t for t, arg in zip(tensors, owner) if arg in sch.writes and id(t) not in returned]


def _flatten_result(out: Any) -> list[torch.Tensor]:
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


class _FunctionMode(TorchFunctionMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        rec = self.rec
        kwargs = kwargs or {}
        if rec.suppress:
            return func(*args, **kwargs)
        frame = sys._getframe(1)
        if frame.f_code in REBUILD_CODES:
            return rec.unrecorded(func, *args, **kwargs)
        loc = rec.capture(frame)
        kind = FETCH_CALLS.get(func)
        if kind is not None:
            target = args[0] if args else None
            rec.on_fetch(kind, target, loc)
            instead = rec.before_fetch(kind, target)
            if instead is not None:
                args = (instead, *args[1:])
            return rec.unrecorded(func, *args, **kwargs)
        ctor = DATA_CONSTRUCTORS.get(func)
        if ctor is not None and _reads_tensors(args, *ctor):
            pos = ctor[0]
            args = list(args)
            args[pos] = _fetch_nested(rec, args[pos], loc)
            return rec.unrecorded(func, *args, **kwargs)
        handler = rec.special.get(func)
        if handler is not None:
            return handler(func, args, kwargs, loc)
        return rec.call(func, args, kwargs, loc)


def _caller(frame: types.FrameType) -> types.FrameType:
    """The first frame at or above ``frame`` that is not mode-dispatch plumbing."""
    while frame.f_back is not None and CODES.code_id(frame.f_code) == 0:
        frame = frame.f_back
    return frame


def _reads_tensors(args: Any, pos: int, copies_tensor: bool) -> bool:
    if len(args) <= pos:
        return False
    data = args[pos]
    return _has_tensor(data) if copies_tensor or isinstance(data, (list, tuple)) else False


def _has_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    return isinstance(data, (list, tuple)) and any(_has_tensor(x) for x in data)


def _fetch_nested(rec: Recorder, data: Any, loc: Location) -> Any:
    """``data`` with each tensor in it fetched (``"tensor"``) and replaced by what Python reads."""
    if isinstance(data, torch.Tensor):
        rec.on_fetch("tensor", data, loc)
        instead = rec.before_fetch("tensor", data)
        return instead if instead is not None else rec.fetched(data)
    if isinstance(data, (list, tuple)) and _has_tensor(data):
        return type(data)(_fetch_nested(rec, x, loc) for x in data)
    return data


class _DispatchMode(TorchDispatchMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        rec = self.rec
        if rec.suppress or func.namespace in _SKIPPED_NAMESPACES:
            return func(*args, **kwargs)
        if rec.call_loc is None and _caller(sys._getframe(1)).f_code in REBUILD_CODES:
            # (``set_`` onto a storage is issued without a torch-level call)
            return rec.unrecorded(func, *args, **kwargs)
        return rec.on_op(func, args, kwargs)


def loops_around(frame: types.FrameType) -> frozenset:
    """``(code id, header)`` of the loops of ``frame`` around its current position: a ``with``
    block opened inside a training loop is inside that loop, but the loop is not in the step."""
    cid = CODES.code_id(frame.f_code)
    if cid <= 0:
        return frozenset()
    return frozenset((cid, header) for header, _ in CODES.loops_at(cid, frame.f_lasti))


class record:
    """Record the ops of the enclosed code into a :class:`Trace`.

    ``with record() as trace: train_step()`` runs the step eagerly, unchanged, and fills
    ``trace``. If the block raises, the exception propagates and the trace is marked failed, so
    :meth:`TraceGraph.merge` refuses it. Recording is per thread and does not nest.

    Op locations are relative to the frame of the ``with`` statement: record a step from the
    same place each time for its traces to match.
    """

    def __init__(self) -> None:
        self.trace = Trace()
        self._rec: Recorder | None = None

    def __enter__(self) -> Trace:
        if self._rec is not None:
            raise RecordError("this record() was already used; create a new one for each step")
        self._rec = Recorder(self.trace)
        self._rec.start(sys._getframe(1))
        return self.trace

    def __exit__(self, et, ev, tb) -> bool:  # noqa: ANN001
        assert self._rec is not None
        self._rec.stop(ev)
        return False
