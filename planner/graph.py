"""The planning graph: what one path of a step needs from memory, as the planner sees it.

Built from a recorded trace (:meth:`PlanningGraph.from_trace`). Ops are nodes in the order the
program issued them (eager order); storages are the allocation units: views and in-place
results are merged into the storage that owns the bytes (DESIGN.md §3), with exact byte sizes.
A storage is

* ``persistent``: it existed before the step (parameters, buffers, optimizer state, inputs),
  resident throughout, not the planner's to place;
* ``escaping``: made by the step and alive after it (gradients, optimizer state made on the
  first step, a loss the program keeps), resident from its producer to the end;
* ``local``: made and dead within the step: the arena's business.

Edges say which op must run before which: data flow (the op that made each value an op reads,
views included), the order of accesses to each storage (a mutation is an ordering constraint,
not a new allocation), the order of random ops (so random streams match eager), and fetches
(ops issued after Python read a value cannot run before it).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tracegraph import Trace
from tracegraph.schema import schema_of

PERSISTENT, ESCAPING, LOCAL = "persistent", "escaping", "local"


class Access(NamedTuple):
    """One op of a step as an executor saw it run: the storages it read, wrote and made, by
    number (:meth:`PlanningGraph.from_accesses`)."""

    name: str
    seconds: float
    reads: tuple[int, ...]
    writes: tuple[int, ...]  # existing storages it mutates
    makes: tuple[int, ...]  # storages it returned that no op before it touched (it allocated them)
    random: bool = False
    fetch: bool = False  # Python read its inputs (its result is a Python value)
    workspace: int = 0  # temporary bytes inside its kernel


class StorageFacts(NamedTuple):
    """What an executor knows of one storage of a step (:meth:`PlanningGraph.from_accesses`)."""

    nbytes: int
    existed: bool  # before the step: persistent
    released: int | None = None  # the position through which the program held it (None: unknown)
    alive_at_end: bool = False
    fetched: bool = False  # Python read its data


class Execution(NamedTuple):
    """How the executor runs a path, which decides when a value Python let go of is freed
    (the simulator, ``planner.simulate.needed_at``, is the one statement of the rule).

    * ``blocks=False``: ops run as they are issued, and a value is freed ``lag`` ops after
      Python let go of its last tensor (the skeleton learns of it when it next sweeps); with
      ``lag=0`` this is eager PyTorch. Only the issue order runs this way.
    * ``blocks=True``: each block (the ops between two sync points, ``PlanningGraph.block_starts``)
      runs once it is complete, in a planned order: a value is freed after its last use in
      that order if Python let go of it within the block, else when the block in which Python
      let go of it starts.
    * ``ahead=True`` (with ``blocks``): the executor runs a block's ops ahead of its launch, as
      the skeleton issues them, so it learns only at the end of a value Python lets go of as
      the step returns: such a value is held to the end (freed after its last use, its bytes
      would be waited for: the executor idles while the skeleton finishes the step).
    """

    blocks: bool = False
    lag: int = 0
    ahead: bool = False


EAGER = Execution()


@dataclass(eq=False)
class Storage:
    sid: int
    nbytes: int
    kind: str
    producer: int | None  # op that allocates it (None when persistent)
    uses: list[int] = field(default_factory=list)  # ops that read or write it, ascending
    # the op position through which the program held it (its last tensor died then; None:
    # unknown or held to the end); at or after the last use
    release: int | None = None
    fetched: bool = False  # Python read its data (so Python holds it, not only the executor)
    out_index: int = 0  # which output of its producer it is (among the op's outputs)


@dataclass(eq=False)
class OpNode:
    index: int
    name: str
    seconds: float  # measured eagerly (0 if unknown)
    workspace: int = 0  # temporary bytes inside the kernel (unknown on CPU: 0)
    allocates: list[int] = field(default_factory=list)  # storages it creates
    uses: list[int] = field(default_factory=list)  # storages it reads or writes
    writes: list[int] = field(default_factory=list)  # existing storages it mutates
    random: bool = False
    gradient_update: bool = False  # writes a persistent storage from a gradient (optimizer)


class PlanningGraph:
    def __init__(
        self,
        ops: list[OpNode],
        storages: dict[int, Storage],
        preds: list[set[int]],
        block_starts: Sequence[int] = (0,),
        execution: Execution = EAGER,
    ) -> None:
        self.ops = ops
        self.storages = storages
        self.preds = preds
        self.succs: list[set[int]] = [set() for _ in ops]
        for v, ps in enumerate(preds):
            for u in ps:
                self.succs[u].add(v)
        # where the runtime's blocks start (issue positions, ascending, 0 first): the ops
        # before a sync point (a fetch, a wait for an op's Python result, an op in a user's
        # ``try``) are executed before those after it (see :func:`sync_points`)
        self.block_starts = tuple(block_starts) or (0,)
        self.execution = execution

    def with_execution(self, execution: Execution) -> "PlanningGraph":
        """The same graph (shared, not copied: do not mutate either) run by ``execution``."""
        g = object.__new__(PlanningGraph)
        g.__dict__.update(self.__dict__)
        g.execution = execution
        return g

    def blocks(self) -> list[range]:
        """The runtime's blocks, as ranges of issue positions."""
        ends = (*self.block_starts[1:], len(self.ops))
        return [range(a, b) for a, b in zip(self.block_starts, ends) if b > a]

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def persistent_bytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values() if s.kind == PERSISTENT)

    def planned(self) -> list[Storage]:
        """The storages the planner places: local and escaping."""
        return [s for s in self.storages.values() if s.kind != PERSISTENT]

    def is_order(self, order: list[int]) -> bool:
        """Is ``order`` a permutation of the ops that respects every edge?"""
        if sorted(order) != list(range(len(self.ops))):
            return False
        pos = {v: i for i, v in enumerate(order)}
        return all(pos[u] < pos[v] for v, ps in enumerate(self.preds) for u in ps)

    def add_edge(self, u: int, v: int) -> None:
        if u != v and u not in self.preds[v]:
            self.preds[v].add(u)
            self.succs[u].add(v)

    @classmethod
    def from_trace(cls, trace: Trace, execution: Execution = EAGER) -> "PlanningGraph":
        values = trace.values
        ops = [
            OpNode(op.index, op.name, op.seconds, random=op.random) for op in trace.ops
        ]
        storages: dict[int, Storage] = {}
        for vid in trace.externals:
            sid = values[vid].storage
            storages.setdefault(sid, Storage(sid, trace.storage_bytes.get(sid, 0), PERSISTENT, None))
        alive_storages = {values[v].storage for v in trace.alive_at_end}
        preds: list[set[int]] = [set() for _ in trace.ops]
        accesses = _AccessOrder()
        for op in trace.ops:
            j = op.index
            node = ops[j]
            written = {values[op.inputs[i]].storage for i in op.writes}
            read = {values[v].storage for v in op.inputs} - written
            made = []
            for k, vid in enumerate(op.outputs):
                sid = values[vid].storage
                if sid not in storages:  # a new storage: this op allocates it
                    kind = ESCAPING if sid in alive_storages else LOCAL
                    storages[sid] = Storage(sid, trace.storage_bytes.get(sid, 0), kind, j, out_index=k)
                    node.allocates.append(sid)
                    made.append(sid)
                elif k < op.n_returned and (op.out_alias[k] is None if k < len(op.out_alias) else True):
                    written.add(sid)
            for vid in op.inputs:  # the values it reads (a view is made by its view op)
                producer = values[vid].producer
                if producer is not None:
                    preds[j].add(producer)
            preds[j] |= accesses.edges(j, read, written, made)
            if op.random:
                preds[j] |= accesses.random(j)
            node.uses = sorted(read | written | set(made))
            node.writes = sorted(written)
            for sid in node.uses:
                storages[sid].uses.append(j)
            node.gradient_update = not op.is_backward and any(
                storages[s].kind == PERSISTENT for s in written
            ) and any(storages[s].kind != PERSISTENT for s in read)
            preds[j].discard(j)
        for vid, at in trace.released.items():
            s = storages.get(values[vid].storage)
            if s is not None and s.kind == LOCAL:
                s.release = max(at, s.release or 0, s.uses[-1] if s.uses else 0)
        for f in trace.fetches:
            if f.vid is not None and values[f.vid].storage in storages:
                storages[values[f.vid].storage].fetched = True
        for op in trace.ops:
            if op.python_result:
                for vid in op.outputs:
                    if values[vid].storage in storages:
                        storages[values[vid].storage].fetched = True
        g = cls(ops, storages, preds, sync_points(trace), execution)
        g._add_fetch_barriers(trace)
        return g

    @classmethod
    def from_accesses(
        cls, ops: Sequence[Access], storages: Sequence[StorageFacts], execution: Execution = EAGER
    ) -> PlanningGraph:
        """A graph from what an executor saw a step's ops touch (a step captured elsewhere than
        a trace: ``executor/capture.py``'s described steps), ops in issue order, storages by
        their number. The edges are the storages': each op after the last write of what it
        reads, each write after the reads and the write before it, random ops in order."""
        nodes = [OpNode(j, a.name, a.seconds, a.workspace, random=a.random) for j, a in enumerate(ops)]
        made_by: dict[int, int] = {}
        for j, a in enumerate(ops):
            for sid in a.makes:
                made_by.setdefault(sid, j)
        table: dict[int, Storage] = {}
        for sid, f in enumerate(storages):
            if f.existed or sid not in made_by:
                table[sid] = Storage(sid, f.nbytes, PERSISTENT, None)
            else:
                kind = ESCAPING if f.alive_at_end else LOCAL
                table[sid] = Storage(sid, f.nbytes, kind, made_by[sid], release=f.released, fetched=f.fetched)
        preds: list[set[int]] = [set() for _ in ops]
        accesses = _AccessOrder()
        for j, a in enumerate(ops):
            node = nodes[j]
            made = [sid for sid in a.makes if made_by.get(sid) == j]
            written = set(a.writes) | (set(a.makes) - set(made))
            read = set(a.reads) - written
            preds[j] |= accesses.edges(j, read, written, made)
            if a.random:
                preds[j] |= accesses.random(j)
            node.allocates = made
            node.uses = sorted(read | written | set(made))
            node.writes = sorted(written)
            for sid in node.uses:
                table[sid].uses.append(j)
                if a.fetch:
                    table[sid].fetched = True
            node.gradient_update = any(table[s].kind == PERSISTENT for s in written) and any(
                table[s].kind != PERSISTENT for s in read
            )
            preds[j].discard(j)
        for st in table.values():
            if st.release is not None and st.kind == LOCAL:
                st.release = max(st.release, st.uses[-1] if st.uses else 0)
        return cls(nodes, table, preds, (0,), execution)

    def _add_fetch_barriers(self, trace: Trace) -> None:
        """Ops issued after Python read a value run after the op that made it (Terra's control
        edges from fetches to later feeds, DESIGN.md §4)."""
        for u, v in fetch_barrier_edges(self.preds, fetch_points(trace)):
            self.add_edge(u, v)


class _AccessOrder:
    """The edges storage accesses impose, op by op in issue order: a read after the last write
    of its storage, a write after the reads and the write before it; random ops in order."""

    def __init__(self) -> None:
        self.last_write: dict[int, int] = {}
        self.reads_since: dict[int, list[int]] = {}
        self.last_random: int | None = None

    def edges(self, j: int, read: Iterable[int], written: Iterable[int], made: Iterable[int]) -> set[int]:
        out: set[int] = set()
        for sid in read:
            if sid in self.last_write:
                out.add(self.last_write[sid])
            self.reads_since.setdefault(sid, []).append(j)
        for sid in written:
            out.update(self.reads_since.get(sid, ()))
            if sid in self.last_write:
                out.add(self.last_write[sid])
            self.last_write[sid] = j
            self.reads_since[sid] = []
        for sid in made:
            self.last_write[sid] = j
            self.reads_since[sid] = []
        return out

    def random(self, j: int) -> set[int]:
        before, self.last_random = self.last_random, j
        return set() if before is None else {before}


def sync_points(trace: Trace) -> tuple[int, ...]:
    """Where the co-execution skeleton closes a block (coexec/skeleton.py: every fetch, every
    op whose Python result or output shape the program waits for, every op inside a user's
    ``try``): the issue positions that start a block, 0 first. The ops of a block are confirmed
    together; a planned order never moves an op across a block's start."""
    n = len(trace.ops)
    cuts = {f.after for f in trace.fetches}
    cuts.update(
        op.index + 1
        for op in trace.ops
        if op.python_result or op.index in trace.in_try or schema_of(op.func).dynamic_shape
    )
    return (0, *sorted(c for c in cuts if 0 < c < n))


def fetch_points(trace: Trace) -> list[tuple[int, int | None]]:
    """Where Python read a value: ``(after, producer)``, the number of ops issued before the
    read and the op that made the value (None: an external input). An op that returns a
    Python value is its own read."""
    values = trace.values
    points = [(f.after, values[f.vid].producer) for f in trace.fetches if f.vid is not None]
    points += [(op.index + 1, op.index) for op in trace.ops if op.python_result]
    return points


def fetch_barrier_edges(
    preds: Sequence[Collection[int]], points: Iterable[tuple[int, int | None]]
) -> list[tuple[int, int]]:
    """Edges that make every op ``j >= after`` a descendant of ``producer``, for every point,
    in O((n + edges + points) log n) plus the edges returned.

    ``preds`` are the other edges, all forward (``u < v`` for ``u`` in ``preds[v]``). Only a
    *source* of the suffix [after, n) needs an edge (an op ``j`` with every pred before
    ``after``: ``maxpred(j) < after <= j``); the rest descend from one. So op ``j`` needs the
    points with ``after`` in (maxpred(j), j]. Among those, let ``top`` be the latest producer:
    a point with ``after <= top`` reaches ``top`` (it is in its suffix, by induction on the op
    index), so ``top -> j`` serves it, and only the points with ``after > top`` need their own
    edge. A producer read several times needs only its earliest read. The scan of every
    suffix per point that this replaced gave the same closure with a superset of these edges
    (checked against it: tests/planner/test_fetch_barriers.py).
    """
    n = len(preds)
    earliest: dict[int, int] = {}
    for after, producer in points:
        # producer < after always holds for a recorded read; anything else is no barrier
        if producer is not None and producer < after < n:
            earliest[producer] = min(after, earliest.get(producer, n))
    if not earliest:
        return []
    pts = sorted((a, p) for p, a in earliest.items())
    afters = [a for a, _ in pts]
    latest = _RangeMax([p for _, p in pts])
    edges: list[tuple[int, int]] = []
    for j in range(afters[0], n):
        lo = bisect_right(afters, max(preds[j], default=-1))
        hi = bisect_right(afters, j)
        if lo >= hi:
            continue
        top = latest.query(lo, hi)
        own = [pts[k][1] for k in range(max(lo, bisect_right(afters, top)), hi)]
        for u in (top, *(p for p in own if p != top)):
            if u not in preds[j]:  # not an edge already
                edges.append((u, j))
    return edges


class _RangeMax:
    """Maximum of ``xs[lo:hi]`` in O(1) after O(len(xs) log len(xs)) (a sparse table)."""

    def __init__(self, xs: list[int]) -> None:
        self.table = [xs]
        width = 1
        while 2 * width <= len(xs):
            row = self.table[-1]
            self.table.append([max(row[i], row[i + width]) for i in range(len(row) - width)])
            width *= 2

    def query(self, lo: int, hi: int) -> int:
        level = (hi - lo).bit_length() - 1
        row = self.table[level]
        return max(row[lo], row[hi - (1 << level)])


def longest_gap(points) -> tuple[int, int] | None:
    """The two consecutive positions furthest apart (the earliest such pair), if at least one
    position lies strictly between them."""
    ps = sorted(points)
    if len(ps) < 2:
        return None
    a, b = max(zip(ps, ps[1:]), key=lambda ab: (ab[1] - ab[0], -ab[0]))
    return (a, b) if b - a >= 2 else None
