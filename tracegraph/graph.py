"""The TraceGraph: every observed path of a step in one DAG (Terra §3.2.2).

Nodes are ops, plus a ``start`` and an ``end`` node per region, plus loop nodes whose body is a
region of its own. Merging a trace walks it from ``start``: each op is looked up among the
children of the latest matched node; on a miss the trace branches, and it merges back into an
existing node with an equal key where that keeps the graph acyclic.

Two ops are equal when their :class:`OpKey` s are equal *and* their inputs come from the same
places (:data:`Source`), so an op reading another value at the same line is another node. Where
branches merge back, an input may come from one of several producers, like a phi: each input of
a node holds its *alternatives*, and the one that applies on a path is the alternative executed
most recently (in the current loop iteration), an external feed counting as executed first.
Matching checks that rule against the trace, so a covered trace always resolves to its real
dataflow. Inside a loop body a value from outside the current iteration (carried from the
previous iteration, or from before the loop) is an ``ENTER`` source, so iterations merge.

Values that vary between steps become fed inputs instead of new branches (DESIGN.md §3): a
numeric argument that differs while the output metadata stays the same is *promoted* on the
node (matched as a wildcard from then on), and likewise the output index of a source.
Tensor sizes that vary are the same: an op whose key and outputs differ from a node's only in
sizes and strides (same ops, ranks, dtypes, devices, layouts) makes the node *sized* (its sizes
are bound per step, like fed numbers), decided from the first two distinct sizes. A sized node's
outputs are the op's own at each step: recorded, or worked out without running it (``infer``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, NamedTuple

from . import reasons
from .location import CODES
from .reasons import NotCovered
from .schema import (
    FED, GATHERED, TENSOR_ARG, TENSOR_LIST, VALUE, TensorMeta, is_gathered, is_number_like, list_spans, schema_of,
)  # fmt: skip
from .structure import LoopKey, LoopTracker, in_order
from .trace import Fetch, OpKey, OpRecord, Trace

Source = tuple  # ("ext",) | ("enter",) | ("node", id, output) | ("loop", loop_id, body_node_id, output)
EXT: Source = ("ext",)
ENTER: Source = ("enter",)
ANY_OUTPUT = -1  # output index of a promoted source: any output of the producer

START, END, OP, LOOP, LABEL = "start", "end", "op", "loop", "label"


class IncompleteTraceError(ValueError):
    """The trace did not come from a step that finished: it cannot be merged."""


class Node:
    """A node of a :class:`Region`."""

    __slots__ = (
        "id", "kind", "region", "key", "sources", "promoted", "out_metas", "body", "trips",
        "visits", "fetches", "enter_sources", "label", "out_alias", "n_returned", "out_struct",
        "match_cache", "sized", "inferred",
    )  # fmt: skip

    def __init__(self, nid: int, kind: str, region: "Region", key: Any = None) -> None:
        self.id = nid
        self.kind = kind
        self.region = region
        self.key = key  # OpKey (op), LoopKey (loop), label (hand-built)
        self.sources: tuple[tuple[Source, ...], ...] = ()  # per input: its alternatives
        self.promoted: frozenset[int] = frozenset()  # attribute positions that are fed
        self.out_metas: tuple[TensorMeta, ...] = ()  # as first seen (sized: not this step's)
        self.sized = False  # tensor sizes and strides vary: matched without them, bound per step
        # did outputs worked out without running the op (``infer``) match what it made? None:
        # not yet checked against a run (the user of ``infer`` checks it and sets this)
        self.inferred: bool | None = None
        self.out_alias: tuple[int | None, ...] = ()  # per output: input whose storage it shares
        self.n_returned = 0  # outputs the op returns (the rest are arguments it writes)
        self.out_struct: tuple = ()  # the shape of the op's result (see OpRecord.out_struct)
        # (op key, sources) -> the child they match, for children whose match needs no rule
        # (no phi alternatives, no fed arguments); cleared when a child is generalised
        self.match_cache: dict[tuple, Node] = {}
        self.body: Region | None = None  # loop nodes
        self.trips: Counter[int] = Counter()  # loop nodes: trip count -> executions seen
        self.visits = 0
        self.fetches: set[tuple[str, Source | None]] = set()  # Python reads right after it
        self.enter_sources: dict[int, set[tuple]] = {}  # input -> where ENTER values came from
        self.label: str | None = None

    @property
    def name(self) -> str:
        if self.kind == OP:
            return schema_of(self.key.func).name
        if self.kind == LOOP:
            return "loop"
        if self.kind == LABEL:
            return str(self.label)
        return self.kind

    @property
    def location(self) -> str:
        if self.kind == OP:
            return CODES.describe(self.key.loc)
        if self.kind == LOOP:
            prefix, cid, header = self.key
            return CODES.describe(prefix + ((cid, header),))
        return ""

    @property
    def feeds(self) -> int:
        """Inputs this node reads from outside the graph: external tensors, fed values."""
        return sum(EXT in alts for alts in self.sources) + len(self.promoted)

    def __repr__(self) -> str:
        where = f" at {self.location}" if self.kind in (OP, LOOP) else ""
        return f"<{self.kind} #{self.id} {self.name}{where}>"


class Region:
    """A DAG with a unique ``start`` and ``end``: the top level of a TraceGraph or a loop body."""

    def __init__(self, graph: "TraceGraph", owner: Node | None = None) -> None:
        self.graph = graph
        self.owner = owner
        self.start = graph._new_node(START, self)
        self.end = graph._new_node(END, self)
        self.nodes: list[Node] = []  # without start and end, in creation order
        self.succ: dict[Node, list[Node]] = {self.start: [], self.end: []}
        self.pred: dict[Node, list[Node]] = {self.start: [], self.end: []}
        self.index: dict[Hashable, list[Node]] = {}  # match index -> nodes (for merging back)

    def edges(self) -> list[tuple[Node, Node]]:
        return [(u, v) for u in [self.start, *self.nodes] for v in self.succ[u]]

    def reaches(self, a: Node, b: Node) -> bool:
        """Is there a path from ``a`` to ``b``?"""
        seen, stack = {a}, [a]
        while stack:
            u = stack.pop()
            if u is b:
                return True
            for v in self.succ[u]:
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
        return False

    def switch_cases(self) -> list["SwitchCase"]:
        """Terra Algorithm 1 on this region (loop nodes count as single nodes)."""
        from .cases import assign_cases

        return assign_cases(self)

    def walk(self) -> Iterator[Node]:
        """Every node of this region and, depth first, of the loop bodies inside it."""
        for n in self.nodes:
            yield n
            if n.body is not None:
                yield from n.body.walk()


_UNKNOWN = object()
_BOUND_MAX = 1 << 14


_LISTS: dict[Any, bool] = {}


def _takes_lists(func: Any) -> bool:
    found = _LISTS.get(func)
    if found is None:
        found = _LISTS[func] = TENSOR_LIST in schema_of(func).kinds
    return found


def _gather(key: OpKey, srcs: tuple, inputs: tuple) -> tuple[OpKey, tuple, tuple]:
    """The op as a node takes it: in each tensor-list argument, a run of elements made by one
    node of a nested loop (each iteration's, ``torch.stack(log_probs)``) is one input with that
    source, ``(GATHERED, length)`` in the key, so that an episode of 12 steps and one of 200
    differ only in a length, which sizes the node like a size (:func:`_index_key` and a sized
    node's match leave it out). Returns ``(key, sources, input values)``."""
    spans = list_spans(key.func, key.attrs)
    if not any(srcs[i][0] == "loop" for _p, start, end in spans for i in range(start, end)):
        return key, srcs, inputs
    attrs, metas, keep, at = list(key.attrs), key.metas, [], 0
    for p, start, end in spans:
        keep += range(at, start)
        shape, i, run = [], start, None  # run: the first element of the run going on
        for a in key.attrs[p]:
            if a is not TENSOR_ARG:
                shape.append(a)
                run = None
                continue
            if run is not None and srcs[i] == srcs[run] and sizeless(metas[i]) == sizeless(metas[run]):
                shape[-1] = (GATHERED, shape[-1][1] + 1)
            else:
                run = i if srcs[i][0] == "loop" else None
                shape.append(a if run is None else (GATHERED, 1))
                keep.append(i)
            i += 1
        attrs[p], at = tuple(shape), end
    keep += range(at, len(srcs))
    gathered = OpKey(key.func, tuple(attrs), tuple(metas[i] for i in keep), key.loc)
    return gathered, tuple(srcs[i] for i in keep), tuple(inputs[i] for i in keep)


def _lengthless(attrs: tuple) -> tuple:
    """A gathered key's arguments without the runs' lengths (see :func:`_gather`)."""
    return tuple(tuple(GATHERED if is_gathered(x) else x for x in a) if type(a) is tuple else a for a in attrs)


def _index_key(key: OpKey) -> tuple:
    """The op key with every promotable argument erased and its tensors' sizes and strides
    left out: finds nodes that differ only there (fed numbers, sizes)."""
    attrs = key.attrs
    if _takes_lists(key.func):
        attrs = _lengthless(attrs)
    prom = schema_of(key.func).promotable
    if prom:
        attrs = list(attrs)
        for p in prom:
            if is_number_like(attrs[p]):
                attrs[p] = FED
        attrs = tuple(attrs)
    return (key.func, attrs, tuple(map(sizeless, key.metas)), key.loc)


def sizeless(meta: TensorMeta) -> tuple:
    """What of a tensor's metadata a sized node keeps: all but its sizes and strides (their
    number, the rank, stays)."""
    return (len(meta.shape), meta.dtype, meta.device, meta.layout, meta.stride is None, meta.requires_grad, meta.bits)


def same_sizes(a: tuple[TensorMeta, ...], b: tuple[TensorMeta, ...]) -> bool:
    """Do two tensors' metadata (one per tensor) have the same sizes, strides and dtypes? (What
    an op's outputs worked out without running it must match.)"""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.stride == y.stride and x.dtype == y.dtype for x, y in zip(a, b)
    )


def same_but_sizes(a: tuple[TensorMeta, ...], b: tuple[TensorMeta, ...]) -> bool:
    """Do two tensors' metadata (one per tensor) differ at most in sizes and strides?"""
    return len(a) == len(b) and all(x is y or sizeless(x) == sizeless(y) for x, y in zip(a, b))


class TraceGraph:
    """All observed executions of a step, merged (see the module docstring).

    >>> graph = TraceGraph()
    >>> with record() as trace:
    ...     train_step()
    >>> graph.merge(trace)        # True: the trace added nodes or edges
    >>> graph.covers(trace)       # True: the trace is a path of the graph
    >>> graph.switch_cases()      # Terra Algorithm 1
    """

    def __init__(self) -> None:
        self._next_id = 0
        self._by_id: dict[int, Node] = {}
        self.root = Region(self)
        self.traces = 0  # traces merged
        self.bound: dict[tuple, tuple | None] = {}  # (sized node id, op key) -> its outputs' metadata

    def _new_node(self, kind: str, region: Region, key: Any = None) -> Node:
        node = Node(self._next_id, kind, region, key)
        self._by_id[node.id] = node
        self._next_id += 1
        return node

    def node(self, nid: int) -> Node:
        """The node with id ``nid`` (ids are unique across loop bodies)."""
        return self._by_id[nid]

    # -- public API -----------------------------------------------------------------------
    def merge(self, trace: Trace) -> bool:
        """Add ``trace`` to the graph; True when it added nodes or edges or generalised a node.

        All or nothing: if merging fails part way, the graph is left exactly as it was.
        """
        return self.merge_placed(trace).changed

    def merge_placed(self, trace: Trace) -> "Merged":
        """:meth:`merge`, also saying where each of the trace's ops landed in the graph."""
        _check_trace(trace, "merge")
        cursor = Cursor(self, trace, mutate=True)
        try:
            cursor.run()
        except BaseException:
            cursor.rollback()
            raise
        self.traces += 1
        places = tuple((node.id, ctx) for node, ctx in (cursor.placed[i] for i in range(len(trace.ops))))
        return Merged(cursor.changed, places)

    def covers(self, trace: Trace) -> bool:
        """True when ``trace`` is a path of the graph, with no new node, edge or feed."""
        _check_trace(trace, "check")
        try:
            Cursor(self, trace, mutate=False).run()
        except NotCovered:
            return False
        return True

    def switch_cases(self) -> list["SwitchCase"]:
        """The ordered switch-cases of the top level (Terra Algorithm 1). Loop nodes are single
        nodes here; ``loop_node.body.switch_cases()`` gives those of a loop body."""
        return self.root.switch_cases()

    def nodes(self) -> list[Node]:
        """Every op and loop node, loop bodies included."""
        return list(self.root.walk())

    def regions(self) -> list[Region]:
        return [self.root] + [n.body for n in self.root.walk() if n.body is not None]

    def to_dot(self) -> str:
        from .dot import to_dot

        return to_dot(self)

    def stats(self) -> dict[str, int]:
        """Sizes for a summary: node, edge, loop, block and switch counts (all regions, and
        ``top_switches`` at the top level only), feeds, fetch points."""
        nodes = self.nodes()
        blocks = switches = 0
        for region in self.regions():
            for sc in region.switch_cases():
                blocks += sum(1 for c in sc.cases if c.block)
                switches += sc.is_switch
        top_switches = sum(sc.is_switch for sc in self.root.switch_cases())
        return {
            "traces": self.traces,
            "nodes": sum(n.kind in (OP, LABEL) for n in nodes),
            "loops": sum(n.kind == LOOP for n in nodes),
            "edges": sum(len(r.edges()) for r in self.regions()),
            "blocks": blocks,
            "switches": switches,
            "top_switches": top_switches,
            "feeds": sum(n.feeds for n in nodes),
            "fetches": sum(len(n.fetches) for n in nodes)
            + sum(len(r.start.fetches) for r in self.regions())
            + sum(n.kind == OP and _returns_python(n) for n in nodes),
        }

    @classmethod
    def from_edges(cls, edges: Iterable[tuple[Hashable, Hashable]]) -> "TraceGraph":
        """A hand-built graph (for tests and examples): ``"start"`` and ``"end"`` name the
        special nodes; every other name becomes a labelled node."""
        g = cls()
        r = g.root
        by_label: dict[Hashable, Node] = {"start": r.start, "end": r.end}
        for u, v in edges:
            for x in (u, v):
                if x not in by_label:
                    n = g._new_node(LABEL, r, x)
                    n.label = x
                    by_label[x] = n
                    r.nodes.append(n)
                    r.succ[n], r.pred[n] = [], []
            a, b = by_label[u], by_label[v]
            if b not in r.succ[a]:
                r.succ[a].append(b)
                r.pred[b].append(a)
        for n in r.nodes:
            if not r.pred[n] or not r.succ[n]:
                raise ValueError(f"node {n.label!r} is not on a path from start to end")
        return g

    def node_by_label(self, label: Hashable) -> Node:
        for n in self.root.nodes:
            if n.label == label:
                return n
        raise KeyError(label)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<TraceGraph: {s['traces']} traces, {s['nodes']} op nodes, {s['loops']} loops, "
            f"{s['blocks']} blocks, {s['switches']} switches>"
        )


def _returns_python(n: Node) -> bool:
    return bool(schema_of(n.key.func).data_dependent)


def _check_trace(trace: Any, verb: str) -> None:
    if not isinstance(trace, Trace):
        raise TypeError(f"expected a tracegraph.Trace, got {type(trace).__name__}")
    if trace.status == "recording":
        raise IncompleteTraceError(f"cannot {verb} a trace that is still being recorded")
    if trace.status == "failed":
        raise IncompleteTraceError(
            f"cannot {verb} the trace of a step that raised "
            f"{type(trace.error).__name__}: {trace.error}; it holds only part of the step"
        )


class Merged(NamedTuple):
    """What :meth:`TraceGraph.merge_placed` did with a trace."""

    changed: bool  # it added nodes or edges or generalised a node
    places: tuple[tuple[int, "Ctx"], ...]  # per op index: its node id and loop context


Ctx = tuple  # ((loop node id, instance, iteration), ...) outermost first


def _producer(src: Source) -> int | None:
    """The node whose execution makes ``src`` available (None for feeds and ENTER)."""
    kind = src[0]
    return src[1] if kind == "node" else src[2] if kind == "loop" else None


def _source_matches(alt: Source, src: Source) -> bool:
    if alt == src:
        return True
    return alt[0] == "node" and alt[2] == ANY_OUTPUT and src[0] == "node" and src[1] == alt[1]


class _Frame:
    """Where a cursor is in one region: the latest matched node, and the loop context."""

    __slots__ = ("region", "cur", "ctx", "loop", "iteration", "instance")

    def __init__(self, region: Region, ctx: Ctx, loop: Node | None, instance: int) -> None:
        self.region = region
        self.cur = region.start
        self.ctx = ctx
        self.loop = loop
        self.iteration = 0
        self.instance = instance


class Cursor:
    """Walks a trace over the graph op by op: merging (``mutate``) or matching.

    The same walk serves :meth:`TraceGraph.merge` and :meth:`TraceGraph.covers` (fed a
    recorded trace) and the co-execution skeleton (fed ops as they happen). Loops are entered,
    iterated and left as a :class:`LoopTracker` decides, exactly as when the trace's items were
    built. When matching, a step the graph does not have raises :class:`NotCovered`.

    Every change goes through a method that logs its undo, so a failed merge rolls back.
    """

    def __init__(self, graph: TraceGraph, trace: Trace, mutate: bool) -> None:
        self.g = graph
        self.t = trace
        self.mutate = mutate
        self.changed = False
        self.placed: dict[int, tuple[Node, Ctx]] = {}  # op index -> node and context
        self.last: dict[int, tuple[Ctx, int]] = {}  # node id -> context, serial of last run
        self.serial = 0
        self.instances = 0
        self._undo: list[Callable[[], None]] = []
        self._first_id = graph._next_id
        self.tracker = LoopTracker(trace.outside_loops)
        self.frames = [_Frame(graph.root, (), None, 0)]
        # the outputs of the sized node matched last, at this step (a node not sized: its own)
        self.metas: tuple | None = None

    # -- feeding --------------------------------------------------------------------------
    def op(self, rec: OpRecord, infer: Callable[[], tuple | None] | None = None) -> Node:
        """Place the next op; returns its node. ``infer``: where the op has not run (its
        outputs are not recorded), the metadata its outputs will have (None: unknown), asked
        for only where a fed number may change a size (:meth:`sizes_hold`)."""
        ev = self.tracker.add_op(rec.index, rec.key.loc)
        self._close_to(ev.keep)
        if ev.restart:
            self._next_iteration()
        for key in ev.opened:
            self._open(key)
        f = self.frames[-1]
        node = self.match_op(f.region, f.cur, rec, f.ctx, infer)
        self.edge(f.region, f.cur, node)
        f.cur = node
        return node

    def fetch(self, item: Fetch) -> None:
        self._close_to(self.tracker.add_fetch(item))
        f = self.frames[-1]
        if not self.mutate:
            return
        src = self.source(item.vid, f.ctx) if item.vid is not None else None
        entry = (item.kind, src)
        cur = f.cur
        if entry not in cur.fetches:
            cur.fetches.add(entry)
            self._undo.append(lambda: cur.fetches.discard(entry))

    def finish(self) -> None:
        """The step ended: leave every loop and reach ``end``."""
        self._close_to(0)
        f = self.frames[0]
        self.edge(f.region, f.cur, f.region.end)

    def run(self) -> None:
        """Feed the whole trace and finish."""
        for x in in_order(self.t):
            if isinstance(x, Fetch):
                self.fetch(x)
            else:
                self.op(x)
        self.finish()

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        for nid in range(self._first_id, self.g._next_id):
            self.g._by_id.pop(nid, None)
        self.g._next_id = self._first_id

    # -- loops ----------------------------------------------------------------------------
    def _close_to(self, keep: int) -> None:
        while len(self.frames) - 1 > keep:
            f = self.frames.pop()
            self.edge(f.region, f.cur, f.region.end)
            parent = self.frames[-1]
            if self.mutate:
                self.bump(f.loop.trips, f.iteration + 1)
                self.bump_visits(f.loop)
            self.ran(f.loop, parent.ctx)

    def _next_iteration(self) -> None:
        f = self.frames[-1]
        self.edge(f.region, f.cur, f.region.end)
        f.cur = f.region.start
        f.iteration += 1
        f.ctx = self.frames[-2].ctx + ((f.loop.id, f.instance, f.iteration),)

    def _open(self, key: LoopKey) -> None:
        parent = self.frames[-1]
        region, cur = parent.region, parent.cur
        children = region.succ[cur]
        node = next((c for c in children if c.kind == LOOP and c.key == key), None)
        if node is None:
            if not self.mutate:
                raise NotCovered(reasons.loop_reason(region, cur, key))
            for cand in region.index.get(key, ()):
                if cand not in children and not region.reaches(cand, cur):
                    node = cand
                    break
            else:
                node = self.add_node(region, LOOP, key, key)
                node.body = Region(self.g, node)
        self.edge(region, cur, node)
        parent.cur = node
        self.instances += 1
        ctx = parent.ctx + ((node.id, self.instances, 0),)
        self.frames.append(_Frame(node.body, ctx, node, self.instances))

    # -- ops ------------------------------------------------------------------------------
    def match_op(
        self, region: Region, cur: Node, rec: OpRecord, ctx: Ctx, infer: Callable[[], tuple | None] | None = None
    ) -> Node:
        srcs = tuple(self.source(v, ctx) for v in rec.inputs)
        cache_key = (rec.key, srcs)
        key, inputs = rec.key, rec.inputs
        if _takes_lists(key.func):
            key, srcs, inputs = _gather(key, srcs, inputs)
        hit = cur.match_cache.get(cache_key)
        if hit is not None:
            return self.visit(hit, rec, ctx, inputs)
        children = region.succ[cur]
        for child in children:
            if child.kind == OP and self.same(child, key, srcs, ctx) and self.sizes_hold(child, rec, infer):
                if not self.mutate and not child.promoted and not child.sized and all(len(a) == 1 for a in child.sources):
                    cur.match_cache[cache_key] = child
                return self.visit(child, rec, ctx, inputs)
        if not self.mutate:
            as_node = rec if key is rec.key else dataclasses.replace(rec, key=key, inputs=inputs)
            raise NotCovered(reasons.op_reason(self, region, cur, as_node, srcs, ctx))
        out_metas = tuple(self.t.values[v].meta for v in rec.outputs)
        for child in children:
            if child.kind == OP and self.generalize(child, key, srcs, out_metas, ctx, True):
                return self.visit(child, rec, ctx, inputs)
        for cand in region.index.get(_index_key(key), ()):
            if cand in children or region.reaches(cand, cur):
                continue  # merging back there would make a cycle
            if (self.same(cand, key, srcs, ctx) and self.sizes_hold(cand, rec, None)) or self.generalize(
                cand, key, srcs, out_metas, ctx, False
            ):
                return self.visit(cand, rec, ctx, inputs)
        node = self.add_node(region, OP, key, _index_key(key))
        node.sources = tuple((s,) for s in srcs)
        node.out_metas = out_metas
        node.out_alias = rec.out_alias
        node.n_returned = rec.n_returned
        node.out_struct = rec.out_struct
        return self.visit(node, rec, ctx, inputs)

    def source(self, vid: int, ctx: Ctx) -> Source:
        value = self.t.values[vid]
        if value.producer is None:
            return ENTER if ctx else EXT
        node, pctx = self.placed[value.producer]
        depth = len(ctx)
        if pctx[:depth] != ctx:
            return ENTER
        if len(pctx) == depth:
            return ("node", node.id, value.out_index)
        # made inside a loop nested here (in its last iteration that ran the producer)
        return ("loop", pctx[depth][0], node.id, value.out_index)

    def visit(self, node: Node, rec: OpRecord, ctx: Ctx, inputs: tuple) -> Node:
        """``inputs``: the op's input values as the node takes them (a gathered run as its
        first element, :func:`_gather`)."""
        self.placed[rec.index] = (node, ctx)
        if self.mutate:
            self.bump_visits(node)
            if ctx:
                self.note_enter_sources(node, inputs, ctx)
        self.ran(node, ctx)
        return node

    def ran(self, node: Node, ctx: Ctx) -> None:
        self.serial += 1
        self.last[node.id] = (ctx, self.serial)

    # -- matching -------------------------------------------------------------------------
    def when(self, src: Source, ctx: Ctx) -> int | None:
        """When ``src`` became available in the current scope: -1 for a feed, the serial of
        its producer's last run, or None if the producer has not run in this scope."""
        if src == EXT:
            return -1
        pid = _producer(src)
        if pid is None:
            return None
        seen = self.last.get(pid)
        if seen is None or seen[0][: len(ctx)] != ctx:
            return None
        return seen[1]

    def resolves(self, alts: tuple[Source, ...], src: Source, ctx: Ctx) -> bool:
        """Does the node's rule (the latest-run alternative) pick ``src`` on this trace?"""
        if not any(_source_matches(a, src) for a in alts):
            return False
        if len(alts) == 1:
            return True
        t = self.when(src, ctx)
        if t is None:
            return False
        for a in alts:
            if not _source_matches(a, src):
                ta = self.when(a, ctx)
                if ta is not None and ta >= t:
                    return False
        return True

    def same(self, node: Node, key: OpKey, srcs: tuple, ctx: Ctx) -> bool:
        """Does the op match ``node`` as it is (promoted arguments are wildcards)?"""
        if node.key.func != key.func or len(node.key.attrs) != len(key.attrs):
            return False  # another op (before filling in promoted arguments: it may have fewer)
        if node.promoted:
            attrs = list(key.attrs)
            for p in node.promoted:
                attrs[p] = node.key.attrs[p]
            key = key.with_attrs(tuple(attrs))
        if len(node.sources) != len(srcs):
            return False
        mine = node.key
        if mine != key and not (
            node.sized
            and (
                mine.attrs == key.attrs
                or (_takes_lists(key.func) and _lengthless(mine.attrs) == _lengthless(key.attrs))
            )
            and mine.loc == key.loc
            and same_but_sizes(mine.metas, key.metas)
        ):  # (the ops are one: checked above)
            return False
        return all(self.resolves(alts, s, ctx) for alts, s in zip(node.sources, srcs))

    def sizes_hold(self, node: Node, rec: OpRecord, infer: Callable[[], tuple | None] | None) -> bool:
        """Does the op make outputs of ``node``'s sizes? Asked where the node's fed numbers
        differ from the op's at a place that may set a size (an integer argument, or any
        number of an op without tensor inputs): the slice of an epoch's shorter last chunk
        differs from the others only in its end. A recorded op's outputs are in its trace;
        else ``infer`` says (without it, or if it cannot tell, the op does not match)."""
        if node.sized:
            return self._bind_sizes(node, rec, infer)
        if not node.promoted or not node.out_metas:
            return True
        kinds = schema_of(rec.key.func).kinds
        factory = not rec.inputs
        mine, theirs = rec.key.attrs, node.key.attrs
        if not any(_may_size(theirs[p], mine[p], kinds[p], factory) for p in node.promoted):
            return True
        got = self._recorded(rec) if rec.outputs else infer() if infer is not None else None
        return got is not None and same_sizes(got, node.out_metas)

    def _recorded(self, rec: OpRecord) -> tuple:
        """The metadata of the outputs of an op that ran (its trace has them)."""
        values = self.t.values
        return tuple(values[v].meta for v in rec.outputs)

    def _bind_sizes(self, node: Node, rec: OpRecord, infer: Callable[[], tuple | None] | None) -> bool:
        """A sized node's outputs at this step (:attr:`metas`): recorded, or worked out by
        ``infer``; the op matches if they differ from the node's at most in sizes. An op whose
        output sizes come from its data (``nonzero``) is waited for: whatever it makes."""
        if rec.outputs:
            got: tuple | None = self._recorded(rec)
        elif schema_of(rec.key.func).dynamic_shape or "py" in node.out_struct:
            self.metas = None
            return True
        else:
            cache = self.g.bound
            got = cache.get((node.id, rec.key), _UNKNOWN)  # (the same op and sizes: the same outputs)
            if got is _UNKNOWN:
                got = infer() if infer is not None else None
                if got is not None and len(got) == len(node.out_metas):  # (on the meta device, no grad)
                    got = tuple(
                        m._replace(device=n.device, requires_grad=n.requires_grad) for m, n in zip(got, node.out_metas)
                    )
                if len(cache) >= _BOUND_MAX:
                    cache.clear()
                cache[(node.id, rec.key)] = got
        if got is None or not same_but_sizes(got, node.out_metas):
            return False
        self.metas = got
        return True

    def can_add(self, node: Node, alts: tuple, src: Source, ctx: Ctx) -> bool:
        """May ``src`` join an input's alternatives? The rule must pick it on this trace, and
        it must not change what earlier traces resolved to: its producer is new in this merge,
        or no existing alternative can run before it on a path."""
        kinds = ("node", "loop", "ext")
        if src[0] not in kinds or any(a[0] not in kinds for a in alts):
            return False
        if not self.resolves(alts + (src,), src, ctx):
            return False
        pid = _producer(src)
        if pid is None or pid >= self._first_id:
            return True
        if EXT in alts:
            return False
        target = self.g.node(pid)
        for a in alts:
            other = self.g.node(_producer(a))
            if other.region is not target.region or target.region.reaches(other, target):
                return False
        return True

    # -- changes (each logs its undo) -----------------------------------------------------
    def add_node(self, region: Region, kind: str, key: Any, index_key: Hashable) -> Node:
        node = self.g._new_node(kind, region, key)
        region.nodes.append(node)
        region.succ[node], region.pred[node] = [], []
        region.index.setdefault(index_key, []).append(node)
        self.changed = True

        def undo() -> None:
            region.nodes.remove(node)
            del region.succ[node], region.pred[node]
            bucket = region.index[index_key]
            bucket.remove(node)
            if not bucket:
                del region.index[index_key]

        self._undo.append(undo)
        return node

    def edge(self, region: Region, u: Node, v: Node) -> None:
        if v in region.succ[u]:
            return
        if not self.mutate:  # only an edge into ``end`` can be missing: matches are children
            raise NotCovered(reasons.end_reason(region, u))
        region.succ[u].append(v)
        region.pred[v].append(u)
        self.changed = True

        def undo() -> None:
            region.succ[u].remove(v)
            region.pred[v].remove(u)

        self._undo.append(undo)

    def generalize(
        self, node: Node, key: OpKey, srcs: tuple, out_metas: tuple, ctx: Ctx, promote: bool
    ) -> bool:
        """Match ``node`` by making it more general: numeric arguments that differ become fed
        (``promote``), a source's output index becomes any output, or a new producer joins an
        input's alternatives, or tensor sizes that differ make the node sized. Allowed only
        where the outputs keep their metadata but for sizes (ops downstream see other sizes,
        and are sized in turn)."""
        if _index_key(node.key) != _index_key(key) or len(node.sources) != len(srcs):
            return False
        sized = node.sized or node.key.metas != key.metas or node.out_metas != out_metas
        if sized and not same_but_sizes(node.out_metas, out_metas):
            return False
        if sized and not node.sized and node.id in self.last:
            return False  # other sizes in one step (a loop over parameters): other tensors, not a size that varies
        promoted = set(node.promoted)
        for p in schema_of(key.func).promotable:
            a, b = node.key.attrs[p], key.attrs[p]
            if p not in promoted and a != b:
                if not (promote and is_number_like(a) and is_number_like(b)):
                    return False
                promoted.add(p)
        new_sources = list(node.sources)
        for i, (alts, s) in enumerate(zip(node.sources, srcs)):
            if self.resolves(alts, s, ctx):
                continue
            if any(_source_matches(a, s) for a in alts):
                return False  # known, but the rule picks another alternative here
            only = alts[0]
            if len(alts) == 1 and only[0] == s[0] == "node" and only[1] == s[1]:
                new_sources[i] = (("node", s[1], ANY_OUTPUT),)
            elif self.can_add(node, alts, s, ctx):
                new_sources[i] = alts + (s,)
            else:
                return False
        old = (node.promoted, node.sources, node.sized)
        node.promoted = frozenset(promoted)
        node.sources = tuple(new_sources)
        node.sized = sized
        self.changed = True
        for pred in node.region.pred[node]:  # their cached matches may skip the new rule
            pred.match_cache.clear()

        def undo() -> None:
            node.promoted, node.sources, node.sized = old

        self._undo.append(undo)
        return True

    def bump(self, counter: Counter, key: Any) -> None:
        counter[key] += 1

        def undo() -> None:
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]

        self._undo.append(undo)

    def bump_visits(self, node: Node) -> None:
        node.visits += 1

        def undo() -> None:
            node.visits -= 1

        self._undo.append(undo)

    def note_enter_sources(self, node: Node, inputs: tuple, ctx: Ctx) -> None:
        """Remember where each ENTER input came from: lowering a loop needs the carried
        dataflow (``("back", level, distance, node, output)`` or ``("outer", node, output)``)."""
        for i, vid in enumerate(inputs):
            if node.sources[i] != (ENTER,):
                continue
            desc = self.describe_enter(vid, ctx)
            bucket = node.enter_sources.setdefault(i, set())
            if desc not in bucket:
                bucket.add(desc)
                self._undo.append(lambda b=bucket, d=desc: b.discard(d))

    def describe_enter(self, vid: int, ctx: Ctx) -> tuple:
        value = self.t.values[vid]
        if value.producer is None:
            return ("outer", "ext")
        pnode, pctx = self.placed[value.producer]
        for level, (loop_id, inst, it) in enumerate(ctx):
            if level < len(pctx) and pctx[level][:2] == (loop_id, inst):
                if pctx[level][2] != it:
                    return ("back", level, it - pctx[level][2], pnode.id, value.out_index)
                continue
            return ("outer", pnode.id, value.out_index)
        return ("outer", pnode.id, value.out_index)  # pragma: no cover - same iteration


def _may_size(a: Any, b: Any, kind: str, factory: bool) -> bool:
    """May a fed argument that was ``a`` and is ``b`` (hashable forms: ``(type, value)``)
    have changed an output's size? An integer may (a slice's end, a narrow's length); any
    number of a factory may (``arange``'s end); a float or a tensor operand's value may not."""
    if a == b or kind != VALUE:
        return False
    return factory or (type(b) is tuple and len(b) == 2 and b[0] is int)


from .cases import SwitchCase  # noqa: E402  (cases imports Node/Region types from here)
