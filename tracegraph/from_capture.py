"""A traced native step's log (``executor.step_log.CapturedStep``) as a :class:`Trace`.

The native capture answers every ATen op of a step in C++ and, in a traced step, logs what each
did (``executor/native/capture_trace.h``); this turns that log into the trace the recorder of
``recorder.py`` makes of an eager step, so steps merge into the TraceGraph alike.

Op identity, as the graph needs it: an op's location is the stack of user frames from the
step's ``with`` frame to the call (:data:`CODES` ids, offsets), then a ``SUB`` pseudo-frame
counting the ATen ops one call made. The capture's own cache keys by the innermost frame and
the op's occurrence there in the step, which tells a loop's trips apart; a graph keyed so would
see a new op in every trip a loop had not made before (each new trip count a new trace), so
the graph keys by the stack and finds loops from it (``structure.py``). Without a Python-level
call boundary (the capture sits below autograd, not at ``__torch_function__``), the ATen ops of
one call are told from the next call at the same place by their op: a run at one place starts
again where the op that began it comes again (``x = layer(x)`` in a loop, each trip one op),
as the gradient runs of ``recorder.py`` do. A call whose first two ops are the same op is then
counted as two calls, the same way every step.

In a backward the engine ran, an op's location mirrors the forward op whose autograd node it
ran for (its sequence number, claimed by the forward op it came before, as ``recorder.py``
claims them), so the gradient ops of a loop body form a loop too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .location import ACC, BSUB, BWD, CODES, RUN, SUB, UNKNOWN, Location
from .schema import TENSOR_ARG, TensorMeta, hashable, schema_of
from .trace import Fetch, OpKey, OpRecord, Trace, Value

if TYPE_CHECKING:
    from executor.step_log import CapturedOp, CapturedStep, CapturedTensor, Frames

_CPU = torch.device("cpu")
_NO_SEQ = (1 << 64) - 1  # (an AccumulateGrad's sequence number)
_OPS: dict[str, torch._ops.OpOverload] = {}


def op_named(name: str) -> torch._ops.OpOverload:
    """The overload ``ns::op.overload`` names."""
    func = _OPS.get(name)
    if func is None:
        qualified, overload = name.rsplit(".", 1)
        ns, op = qualified.split("::", 1)
        func = _OPS[name] = getattr(getattr(getattr(torch.ops, ns), op), overload)
    return func


def meta_of(t: CapturedTensor) -> TensorMeta:
    layout = torch.strided if t.stride is not None else torch.sparse_coo
    return TensorMeta.interned(TensorMeta(t.shape, t.dtype, _CPU, layout, t.stride, t.requires_grad, t.bits))


def trace_of(step: CapturedStep, outside_loops: frozenset = frozenset()) -> Trace:
    """The step's trace; ``outside_loops``: the loops around the ``with`` (``loops_around``)."""
    return _Converter(step, outside_loops).trace


class _Converter:
    def __init__(self, step: CapturedStep, outside_loops: frozenset) -> None:
        self.trace = Trace(computed=False, outside_loops=outside_loops)
        self.value: dict[int, int] = {}  # tensor number -> its latest value id
        self.storage: dict[int, int] = {}  # capture's storage -> trace storage id
        self.seq_op: dict[int, int] = {}  # autograd sequence number -> forward op index
        self.last_seq: int | None = None
        self.first_use: dict[int, tuple[int, int]] = {}  # leaf's number -> (op index, input position)
        self.mirrored: dict[int, Location] = {}
        self.locs: dict[Frames, Location] = {}
        self.run_loc: Location | None = None  # (forward SUB runs)
        self.run_first: Any = None
        self.sub = 0
        self.node_key: Any = None  # (backward runs per node)
        self.bsub = 0
        self.brun_first: Any = None
        fetches = sorted(step.fetches, key=lambda f: f.after)
        fi = 0
        for n, op in enumerate(step.ops):
            while fi < len(fetches) and fetches[fi].after <= n:
                self.fetch(fetches[fi].kind, fetches[fi].id, fetches[fi].frames)
                fi += 1
            self.op(op)
        for f in fetches[fi:]:
            self.fetch(f.kind, f.id, f.frames)
        self.trace.status = "complete"

    # -- locations ------------------------------------------------------------------------
    def location(self, frames: Frames) -> Location:
        loc = self.locs.get(frames)
        if loc is None:
            loc = self.locs[frames] = CODES.location_of(frames)
        return loc

    def forward_location(self, func: Any, frames: Frames) -> Location:
        loc = self.location(frames)
        if loc != self.run_loc or func is self.run_first:
            self.run_loc, self.run_first, self.sub = loc, func, 0
        else:
            self.sub += 1
        return loc + ((SUB, self.sub),)

    def mirror(self, op_index: int) -> Location:
        m = self.mirrored.get(op_index)
        if m is None:
            from .recorder import mirror_location

            m = self.mirrored[op_index] = mirror_location(self.trace, op_index)
        return m

    def backward_location(self, op: CapturedOp, func: Any) -> tuple[Location, int | None]:
        fwd = self.seq_op.get(op.node) if op.node >= 0 else None
        key: Any = op.node if op.leaf < 0 else (_NO_SEQ, op.leaf)
        if key != self.node_key:
            self.node_key, self.bsub, self.brun_first = key, 0, None
        self.run_loc = None
        site = self.location(op.frames) + ((BWD, 0),)
        if fwd is not None:
            where = self.mirror(fwd)
            if where[-1][0] == RUN and (self.brun_first is None or func is self.brun_first):
                self.brun_first, self.bsub = func, 0
        elif op.leaf >= 0 and op.leaf in self.first_use:
            op_index, pos = self.first_use[op.leaf]
            where = self.mirror(op_index) + ((ACC, pos),)
        else:
            where = ((UNKNOWN, 0),)
        bsub = self.bsub
        self.bsub += 1
        return site + where + ((BSUB, bsub),), fwd

    def claim(self, seq: int, index: int) -> None:
        """The autograd nodes made since the last op belong to op ``index``."""
        if self.last_seq is not None:
            for s in range(self.last_seq, seq):
                self.seq_op[s] = index
        self.last_seq = seq

    # -- values ---------------------------------------------------------------------------
    def new_storage(self, t: CapturedTensor) -> int:
        sid = len(self.trace.storage_bytes)
        self.trace.storage_bytes[sid] = meta_of(t).span_bytes
        return sid

    def new_value(self, producer: int | None, out_index: int, t: CapturedTensor, sid: int) -> int:
        values = self.trace.values
        vid = len(values)
        values.append(Value(vid, producer, out_index, meta_of(t), sid))
        self.value[t.id] = vid
        return vid

    def value_of(self, t: CapturedTensor) -> int:
        vid = self.value.get(t.id)
        if vid is None:  # an external input: first met here
            sid = self.storage.get(t.storage) if t.storage else None
            if sid is None:
                sid = self.new_storage(t)
                if t.storage:
                    self.storage[t.storage] = sid
            vid = self.new_value(None, 0, t, sid)
            self.trace.externals.append(vid)
        return vid

    # -- ops and fetches ------------------------------------------------------------------
    def fetch(self, kind: str, tensor: int, frames: Frames) -> None:
        vid = self.value.get(tensor)
        self.trace.fetches.append(Fetch(kind, vid, len(self.trace.ops), self.location(frames)))

    def op(self, op: CapturedOp) -> None:
        func = op_named(op.name)
        sch = schema_of(func)
        inputs = tuple(self.value_of(t) for t in op.inputs)
        if op.name == "aten::_local_scalar_dense.default":  # ``.item()``, ``bool(t)``: a fetch
            self.trace.fetches.append(
                Fetch("item", inputs[0] if inputs else None, len(self.trace.ops), self.location(op.frames))
            )
            return
        index = len(self.trace.ops)
        backward = op.node >= 0 or op.leaf >= 0
        backward_of = None
        if backward:
            loc, backward_of = self.backward_location(op, func)
            if op.grad_mode:  # (create_graph: the nodes it made are its)
                self.claim(op.seq, index)
        else:
            loc = self.forward_location(func, op.frames)
            self.claim(op.seq, index)
        attrs, owner = _attrs(op)
        if not backward:
            for pos, t in enumerate(op.inputs):
                if t.requires_grad and t.leaf and t.id not in self.first_use:
                    self.first_use[t.id] = (index, pos)
        writes = tuple(i for i, arg in enumerate(owner) if arg in sch.writes)
        rec = OpRecord(
            index=index,
            key=OpKey.of(func, attrs, tuple(meta_of(t) for t in op.inputs), loc),
            inputs=inputs,
            outputs=(),
            writes=writes,
            python_result=op.python_result and not op.outputs,
            backward_of=backward_of,
        )
        if op.in_try:
            self.trace.in_try.add(index)
        values = self.trace.values
        alias = _aliases(func, op, owner)
        outputs, returned = [], set()
        for t, a in zip(op.outputs, alias):
            returned.add(t.id)
            sid = values[inputs[a]].storage if a is not None else self.new_storage(t)
            if a is None and t.storage:
                self.storage[t.storage] = sid
            outputs.append(self.new_value(index, len(outputs), t, sid))
        rec.n_returned = len(outputs)
        for i in writes:  # a mutated argument not returned has a new value now
            t = op.inputs[i]
            if t.id not in returned:
                outputs.append(self.new_value(index, len(outputs), t, values[inputs[i]].storage))
                alias = (*alias, i)
        rec.outputs = tuple(outputs)
        rec.out_alias = tuple(alias)
        rec.out_struct = tuple(1 if s == 1 else None if s == 0 else -s if s < 0 else "py" for s in op.out_struct)
        self.trace.ops.append(rec)


def _attrs(op: CapturedOp) -> tuple[tuple, list[int]]:
    """The op's non-tensor arguments as ``OpSchema.normalize`` gives them (tensors marked), and
    per flattened tensor input the argument it is."""
    attrs: list[Any] = []
    owner: list[int] = []
    for i, (kind, value) in enumerate(op.args):
        if kind == "v":
            attrs.append(hashable(value))
        elif kind == "t":
            if value[0] >= 0:
                attrs.append(TENSOR_ARG)
                owner.append(i)
            else:
                attrs.append(None)
        else:
            shape = []
            for vid in value:
                if vid >= 0:
                    shape.append(TENSOR_ARG)
                    owner.append(i)
                else:
                    shape.append(None)
            attrs.append(tuple(shape))
    return tuple(attrs), owner


def _aliases(func: Any, op: CapturedOp, owner: list[int]) -> tuple[int | None, ...]:
    """Per output, the input whose storage it shares: the same storage (a real tensor and its
    in-place result, a placeholder written in place), else the schema's alias annotation (a
    view of a placeholder is another value, with a storage of its own in the capture)."""
    by_storage: dict[int, int] = {}
    for pos, t in enumerate(op.inputs):
        if t.storage:
            by_storage.setdefault(t.storage, pos)
    return_alias = schema_of(func).return_alias
    first_of_arg: dict[int, int] = {}
    for pos, arg in enumerate(owner):
        first_of_arg.setdefault(arg, pos)
    returns = []  # per flattened output: its schema return
    for r, s in enumerate(op.out_struct):
        if s == 1:
            returns.append(r)
        elif s < 0:
            returns.extend([r] * -s)
    out = []
    for t, r in zip(op.outputs, returns):
        a = by_storage.get(t.storage) if t.storage else None
        if a is None and return_alias[r] is not None:
            a = first_of_arg.get(return_alias[r])
        out.append(a)
    return tuple(out)
