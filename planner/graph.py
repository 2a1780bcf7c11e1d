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

Edges say which op must run before which: data flow, the order of accesses to each storage (a
mutation is an ordering constraint, not a new allocation), the order of random ops (so random
streams match eager), and fetches (ops issued after Python read a value cannot run before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracegraph import Trace

PERSISTENT, ESCAPING, LOCAL = "persistent", "escaping", "local"


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
    def __init__(self, ops: list[OpNode], storages: dict[int, Storage], preds: list[set[int]]) -> None:
        self.ops = ops
        self.storages = storages
        self.preds = preds
        self.succs: list[set[int]] = [set() for _ in ops]
        for v, ps in enumerate(preds):
            for u in ps:
                self.succs[u].add(v)

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
    def from_trace(cls, trace: Trace) -> "PlanningGraph":
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
        last_write: dict[int, int] = {}
        reads_since: dict[int, list[int]] = {}
        last_random = None
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
                    storages[sid] = Storage(sid, trace.storage_bytes.get(sid, 0), kind, j)
                    node.allocates.append(sid)
                    made.append(sid)
                elif k < op.n_returned and (op.out_alias[k] is None if k < len(op.out_alias) else True):
                    written.add(sid)
            for sid in read:
                if sid in last_write:
                    preds[j].add(last_write[sid])
                reads_since.setdefault(sid, []).append(j)
            for sid in written:
                preds[j].update(reads_since.get(sid, ()))
                if sid in last_write:
                    preds[j].add(last_write[sid])
                last_write[sid] = j
                reads_since[sid] = []
            for sid in made:
                last_write[sid] = j
                reads_since[sid] = []
            if op.random:
                if last_random is not None:
                    preds[j].add(last_random)
                last_random = j
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
        g = cls(ops, storages, preds)
        g._add_fetch_barriers(trace)
        return g

    def _add_fetch_barriers(self, trace: Trace) -> None:
        """Ops issued after Python read a value run after the op that made it (Terra's control
        edges from fetches to later feeds, DESIGN.md §4)."""
        n = len(self.ops)
        points = [(f.after, trace.values[f.vid].producer) for f in trace.fetches if f.vid is not None]
        points += [(op.index + 1, op.index) for op in trace.ops if op.python_result]
        for after, producer in points:
            if producer is None or after >= n:
                continue
            for j in range(after, n):
                if not any(p >= after for p in self.preds[j]):
                    self.add_edge(producer, j)


def needed_at(g: PlanningGraph, order: list[int]) -> dict[int, list[int]]:
    """Per storage the step makes (local or escaping), the positions in ``order`` where it
    must be on the device whatever a plan does: its allocation, its uses and, in the issue
    order, where the program let go of it (the executor frees a value then, not at its last
    use), ascending."""
    n = len(order)
    pos = {v: i for i, v in enumerate(order)}
    issue_order = order == list(range(n))
    out = {}
    for s in g.storages.values():
        if s.kind != PERSISTENT:
            ps = {pos[s.producer]} | {pos[u] for u in s.uses}
            if s.release is not None and issue_order:
                ps.add(min(s.release, n - 1))
            out[s.sid] = sorted(ps)
    return out


def longest_gap(points) -> tuple[int, int] | None:
    """The two consecutive positions furthest apart (the earliest such pair), if at least one
    position lies strictly between them."""
    ps = sorted(points)
    if len(ps) < 2:
        return None
    a, b = max(zip(ps, ps[1:]), key=lambda ab: (ab[1] - ab[0], -ab[0]))
    return (a, b) if b - a >= 2 else None
