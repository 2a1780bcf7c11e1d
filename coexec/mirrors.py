"""Mirrors: the values of tiny CPU tensors, computed by the skeleton itself, so that Python can
read them without waiting for the executor.

A fetch (``.item()``, ``bool(t)``, ``print``) is a sync point: the skeleton waits until the
executor has run everything before it, or, for a tensor that is not a placeholder of the step
(optimizer state, written in place), everything issued. Some programs fetch tiny counters every
step: ``torch.optim.Adam`` and ``AdamW`` on a CPU read ``state["step"]`` with ``.item()`` once
per parameter after adding 1 to it, so the skeleton waited for the whole backward at the first
parameter and for the executor at every other one. The counter's next value needs one scalar
op on data the skeleton can see. So where an op's tensors are all tiny CPU tensors
(:func:`_mirrorable`) whose values the skeleton knows, it runs the op itself as well, on copies
(the same kernel on the same data: the same result), and a fetch of a value it knows reads the
copy instead of waiting. The executor still runs the op on the real tensors. Only ops whose
values some fetch of the graph reads, directly or through other ops (:func:`fetch_feeders`),
are mirrored: copying the inputs and running the kernel again is waste for a value nobody reads.

What the skeleton knows: a tensor from outside the step (a parameter, optimizer state) as it is
when the step first uses it, if nothing of this step wrote its storage before (no executor work
of an earlier step is pending either: the skeleton is started only then), copied once; and the
outputs of mirrored ops. An op the skeleton does not mirror that writes a storage forgets every
value known of it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from tracegraph.recorder import flat_outputs
from tracegraph.schema import TENSOR_LIST, schema_of
from tracegraph.trace import OpRecord

MAX_NUMEL = 64  # elements of the largest tensor mirrored (counters, scalars, small vectors)
_CPU = torch.device("cpu")

# per graph: node id -> may the op be mirrored (its tensors are all tiny CPU tensors)
_NODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# per graph: (traces merged, the op nodes whose outputs Python reads, through other ops)
_FED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tiny(meta: Any) -> bool:
    if meta.device != _CPU or meta.layout != torch.strided or meta.requires_grad:
        return False
    n = 1
    for s in meta.shape:
        n *= s
    return n <= MAX_NUMEL


def _mirrorable(by_node: dict[int, bool], node: Any, func: Any) -> bool:
    """May ``node``'s op run on copies: deterministic, without tensor lists, data-dependent
    shapes, Python results or metadata changed in place, every tensor a tiny CPU tensor?"""
    ok = by_node.get(node.id)
    if ok is None:
        sch = schema_of(func)
        ok = by_node[node.id] = bool(
            node.key.metas and node.out_metas and "py" not in node.out_struct
            and not (sch.random or sch.data_dependent or sch.dynamic_shape or sch.inplace_view)
            and TENSOR_LIST not in sch.kinds
            and all(map(_tiny, node.key.metas)) and all(map(_tiny, node.out_metas))
        )  # fmt: skip
    return ok


def fetch_feeders(graph: Any) -> frozenset[int] | None:
    """Ids of the op nodes whose outputs some fetch of the graph reads, directly or through
    the ops that read them; None where the walk meets a value it cannot follow (then every
    tiny op is mirrored). Mirroring an op no fetch reads costs a copy of its inputs and a
    second kernel call for nothing (200 tiny in-place updates: most of the step)."""
    cached = _FED.get(graph)
    if cached is None or cached[0] != graph.traces:
        cached = _FED[graph] = (graph.traces, _feeders(graph))
    return cached[1]


# where a source (tracegraph.graph.Source, or a loop's ENTER description) names its node
_NODE_AT = {"node": 1, "outer": 1, "loop": 2, "back": 3}
_FROM_OUTSIDE = (None, ("ext",), ("outer", "ext"))


def _feeders(graph: Any) -> frozenset[int] | None:
    nodes = {n.id: n for n in graph.nodes()}
    stack = [src for region in graph.regions() for n in (region.start, *region.nodes) for _kind, src in n.fetches]
    seen: set[int] = set()
    while stack:
        src = stack.pop()
        if src in _FROM_OUTSIDE:
            continue
        at = _NODE_AT.get(src[0])
        node = nodes.get(src[at]) if at is not None else None
        if node is None:  # ("enter",) at a fetch: where from is not recorded there
            return None
        if node.id in seen:
            continue
        seen.add(node.id)
        for i, alts in enumerate(node.sources):
            for a in alts:
                stack.extend(node.enter_sources.get(i, ((None,),)) if a == ("enter",) else (a,))
    return frozenset(seen)


class Mirrors:
    """The values of one co-executed step that the skeleton knows (by trace value id)."""

    def __init__(self, graph: Any, trace: Any, externals: dict, run: Any) -> None:
        by_node = _NODES.get(graph)
        if by_node is None:
            by_node = _NODES[graph] = {}
        self._nodes: dict[int, bool] = by_node  # node id -> may its op be mirrored
        self._fed = fetch_feeders(graph)  # the nodes worth mirroring (None: all)
        # the op issued last, if it may be mirrored and all its inputs are known: the one
        # :meth:`mirror` runs (callers check it first, to build nothing for the others)
        self.ready: OpRecord | None = None
        self._trace = trace
        self._externals = externals  # value id -> the tensor from outside the step
        self._run = run  # runs an op unrecorded (the skeleton's ``unrecorded``)
        self.values: dict[int, torch.Tensor] = {}
        self._by_storage: dict[int, set[int]] = {}  # trace storage -> known values on it
        self._unindexed: list[int] = []  # known values the trace has not numbered yet
        self._written: set[int] = set()  # trace storages some op of the step wrote
        self._pending: OpRecord | None = None  # the op issued last, if it writes

    def issued(self, node: Any, rec: OpRecord) -> None:
        """Op ``rec`` (matched to ``node``) is about to go to the executor: copies of the
        tensors from outside the step it reads are taken now, before the executor can write
        them; the storages it writes are written from then on (applied at the next call, so
        that :meth:`mirror` of the same op still reads their values)."""
        if self._pending is not None:
            self._settle()
        self.ready = None
        fed = self._fed
        if (
            (fed is None or node.id in fed) and _mirrorable(self._nodes, node, rec.key.func)
            and (not node.sized or all(map(_tiny, rec.key.metas)))  # (its sizes as first seen were)
        ):  # fmt: skip
            values = self.values
            for vid in rec.inputs:
                if vid not in values and self._external(vid) is None:
                    break
            else:
                self.ready = rec
        if rec.writes:
            self._pending = rec

    def mirror(
        self, rec: OpRecord, func: Any, args: Sequence, kwargs: dict, tensors: Sequence[torch.Tensor], first: int
    ) -> None:
        """Run op ``rec`` (:attr:`ready`; issued with ``args``/``kwargs`` whose tensors are
        ``tensors``, in ``rec.inputs`` order) on the known values of its inputs; its outputs
        are values ``first``, ``first + 1``, ... (as the recorder numbers them). Call after
        :meth:`issued` and the submission."""
        self.ready = None
        try:
            out = self._run_on_copies(rec, func, args, kwargs, tensors)
        finally:
            self._settle()
        if out is not None:
            for j, t in enumerate(out):
                self.values[first + j] = t
                self._unindexed.append(first + j)

    def _run_on_copies(
        self, rec: OpRecord, func: Any, args: Sequence, kwargs: dict, tensors: Sequence[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        copies: dict[int, torch.Tensor] = {}
        for t, vid in zip(tensors, rec.inputs):
            m = self.values.get(vid)
            if m is None:
                return None
            copies[id(t)] = m
        try:
            margs = [_swap(a, copies) for a in args]
            mkwargs = {k: _swap(v, copies) for k, v in kwargs.items()}
        except KeyError:  # a tensor of the call that is not among its inputs: leave it
            return None
        out = self._run(func, *margs, **mkwargs)
        return flat_outputs(func, margs, mkwargs, out)

    def _settle(self) -> None:
        """The op issued last wrote its storages: what was known of them is not any more."""
        rec, self._pending = self._pending, None
        if rec is None:
            return
        if self._unindexed:
            self._index()
        values = self._trace.values
        for p in rec.writes:
            sid = values[rec.inputs[p]].storage
            self._written.add(sid)
            known = self._by_storage.pop(sid, None)
            if known:
                for vid in known:
                    self.values.pop(vid, None)

    def known(self, vid: int | None) -> torch.Tensor | None:
        """The value ``vid`` as the skeleton computed it (None: not known)."""
        self._settle()
        return self.values.get(vid) if vid is not None else None

    def _external(self, vid: int) -> torch.Tensor | None:
        """A copy of a tensor from outside the step, as it is now, if nothing of the step
        wrote its storage yet (so the executor has no pending write to it)."""
        value = self._trace.values[vid]
        t = self._externals.get(vid) if value.producer is None else None
        if t is None or value.storage in self._written or type(t) is not torch.Tensor:
            return None
        m = self._run(torch.Tensor.clone, t)
        self.values[vid] = m
        self._by_storage.setdefault(value.storage, set()).add(vid)
        return m

    def _index(self) -> None:
        """Index by storage the known values the trace has numbered since."""
        values = self._trace.values
        rest = []
        for vid in self._unindexed:
            if vid < len(values):
                if vid in self.values:
                    self._by_storage.setdefault(values[vid].storage, set()).add(vid)
            else:
                rest.append(vid)
        self._unindexed = rest


def _swap(a: Any, copies: dict[int, torch.Tensor]) -> Any:
    """``a`` with each tensor in it replaced by its copy (KeyError: one has none; an op run
    on a real tensor instead would write it)."""
    if isinstance(a, torch.Tensor):
        return copies[id(a)]
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return type(a)(copies[id(x)] if isinstance(x, torch.Tensor) else x for x in a)
    return a
