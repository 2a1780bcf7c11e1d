"""Rematerialization under a memory budget: which activations to free and recompute.

The model (a Checkmate/Rockmate-style choice, restricted so that it stays exact and linear):
for a fixed op order, each *candidate* op may be **dropped**: the storages it allocates are
freed after the last use before their longest idle stretch (the *gap*, typically forward to
backward) and the op is run again just before the first use after it. Re-running needs the op's
inputs, so a drop extends their lifetimes to the recompute point (possibly through their own
gap, when an input is dropped too). Each op is kept or dropped, nothing else, and everything
follows from that choice:

* :func:`remat_replay` is the simulator: exact live bytes at every position (the recomputations
  before an op count together with it), the peak, the added seconds;
* :func:`plan_remat` meets a budget at the least added time: a greedy (best bytes per
  recomputed second at the current peak, then undo what is not needed) warm-starts a CP-SAT
  model whose memory constraints are grouped by the set of decisions that matter at each
  position; the result is replayed, so it is always valid. CP-SAT proves optimality within this
  model on small and mid-sized graphs (``tests/planner/test_remat.py`` checks it against
  exhaustive search); when it runs out of time the best plan found is returned with its gap;
* :func:`min_feasible_budget` is the lowest peak any choice reaches: the number a
  :class:`BudgetTooSmall` error names.

Lifetimes: a storage is needed at its uses and, in the issue order, until the program's last
tensor on it died when the step was traced (``Storage.release``): the executor frees a value
when Python lets go of it, not at its last use, and only dropped storages are freed earlier.

What may be dropped (:func:`candidates`): ops that allocate only local storages, mutate nothing,
whose outputs nobody mutates later or reads from Python, and whose inputs nobody mutates before
the recompute point. Random ops qualify: the executor replays them with the RNG state they
first ran with.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from .address import aligned
from .graph import ESCAPING, LOCAL, PERSISTENT, PlanningGraph, longest_gap, needed_at
from .offload import Bandwidth, OffloadCandidate, channel_shares, offload_candidates, predict_seconds

# the model lists, per path, each pair (x, e) of a chain of dropped readers x <- ... <- e; the
# pairs grow with the square of the chains' reach. Past this many, a chain may reach at most
# MAX_CASCADE_PAIRS // candidates candidates ahead (at least MIN_SPAN), so the model grows
# linearly with the graph: a restriction (longer chains are forbidden), exact within it
MAX_CASCADE_PAIRS = 20_000
MIN_SPAN = 8
# memory rows list every storage in play at a position (the strongest form for the solver)
# while that takes at most this many terms in all; past it, a running sum per position
MAX_DENSE_TERMS = 300_000
# with offloading, the floor a BudgetTooSmall names rests on measured times: say so
OFFLOAD_FLOOR_NOTE = (
    "with offloading, the smallest budget moves slightly with the op and copy times each run "
    "measures (a copy window may span one op more or less): leave some headroom"
)
MICROSECOND = 1e-6  # cost unit of the CP-SAT objective; every recomputation costs at least one
# an offload costs no compute when its copies overlap (the channel rows see to that): one unit,
# so that storages are parked only when the budget needs it
OFFLOAD_COST = 1


class BudgetTooSmall(ValueError):
    """No plan fits the budget; ``smallest`` is the lowest peak (bytes) any plan reaches."""

    def __init__(self, budget: int, smallest: int, detail: str = "") -> None:
        self.budget = budget
        self.smallest = smallest
        self.detail = detail
        super().__init__(
            f"a memory budget of {format_bytes(budget)} ({budget} bytes) cannot be met: the "
            f"smallest feasible budget for this step is {format_bytes(smallest)} ({smallest} bytes)"
            + (f"; {detail}" if detail else "")
        )


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Candidate:
    """An op that may be dropped: its storages freed after position ``free_after`` and the op
    run again just before position ``recompute_at`` (positions in the plan's order)."""

    op: int
    storages: tuple[int, ...]
    nbytes: int
    seconds: float
    free_after: int
    recompute_at: int
    inputs: tuple[int, ...]  # non-persistent storages the op reads
    at: int = -1  # the op's position in the order


@dataclass
class RematReplay:
    peak: int  # persistent + max over positions of live bytes (+ workspace)
    peak_at: int
    extra_seconds: float
    live: list[int]  # live planned bytes at each position (without persistent, workspace)
    segments: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # sid -> [first, last]s
    offloaded: list[OffloadCandidate] = field(default_factory=list)


@dataclass
class RematPlan:
    order: list[int]
    dropped: list[Candidate]  # sorted by recompute position
    peak: int
    base_peak: int  # the same order without recomputation
    budget: int | None
    extra_seconds: float
    # "none", "greedy", "cp-sat" (proven optimal), "cp-sat-timeout", "lowest-peak" (the
    # solver found nothing in time; the plan of the lowest peak, which fits)
    method: str
    seconds: float
    gap: float | None = None  # CP-SAT's relative gap on the added time (0: optimal)
    offloaded: list[OffloadCandidate] = field(default_factory=list)  # storages parked on the host
    predicted_seconds: float = 0.0  # the step with recomputation and copies (predict_seconds)
    stall_seconds: float = 0.0  # of which waiting for copies
    segments: dict = field(default_factory=dict)  # the replay's: sid -> its stretches on the device

    @property
    def optimal(self) -> bool:
        return self.method in ("none", "cp-sat")


def candidates(g: PlanningGraph, order: list[int]) -> list[Candidate]:
    """The ops that may be dropped in ``order``, each with its gap: the longest stretch between
    two of its uses; for an op with none, the longest stretch up to the recompute point of a
    candidate that reads it (so a chain ``a -> b`` whose ``b`` is recomputed late can be
    recomputed as a whole: ``a`` just before ``b``)."""
    pos = {v: i for i, v in enumerate(order)}
    written_at: dict[int, list[int]] = {}
    for v, op in enumerate(g.ops):
        for sid in op.writes:
            written_at.setdefault(sid, []).append(pos[v])
    found: dict[int, Candidate] = {}
    for v in reversed(order):  # readers first: their recompute points are needs too
        op = g.ops[v]
        if op.writes or not op.allocates:
            continue
        made = [g.storages[s] for s in op.allocates]
        if any(s.kind != LOCAL or s.nbytes <= 0 or s.fetched or written_at.get(s.sid) for s in made):
            continue
        own = {pos[u] for s in made for u in s.uses}
        virtual = {
            found[u].recompute_at
            for s in made
            for u in s.uses
            if u in found and found[u].recompute_at > pos[v]
        }
        gap = longest_gap(own) or longest_gap(own | virtual)
        if gap is None:
            continue
        a, b = gap
        reads = [s for s in op.uses if s not in op.allocates]
        if any(pos[v] <= p < b for s in reads for p in written_at.get(s, ())):
            continue
        inputs = tuple(s for s in reads if g.storages[s].kind != PERSISTENT)
        found[v] = Candidate(
            v, tuple(op.allocates), sum(s.nbytes for s in made), op.seconds, a, b, inputs, pos[v]
        )
    return [found[v] for v in order if v in found]


Term = tuple
# ("keep", c): c is kept; ("drop", d): d is dropped; ("drop-keep", d, c): d dropped, c kept;
# ("reach", c, p): c is dropped and made again by position p for a dropped reader (see _Cascade)


class _Cascade:
    """Who makes whom again on the executor. To recompute a dropped op at ``p`` the executor
    needs its inputs; an input dropped and not yet made again is recomputed first, and so on
    down the chain. So candidate ``x`` is made again at ``p_e`` (the recompute point of ``e``)
    when there is a chain ``x <- d <- ... <- e`` of dropped readers with ``p_e`` inside the gap
    of every op on it. ``points[x]``: the ``(p_e, e)`` that may reach ``x``, by ``p_e``;
    ``via[x][e]``: the readers of ``x`` that lead to ``e`` (``e`` itself when direct).

    With ``span``, only chains whose end ``e`` is at most that many candidates after ``x`` are
    listed: the pairs grow with the square of the chains' reach, the span keeps them linear. That
    is exact for drops without a longer chain of dropped readers (``_Model`` forbids longer ones
    when the span cuts one off: ``truncated``)."""

    def __init__(self, cands: list[Candidate], span: int | None = None) -> None:
        readers: dict[int, list[Candidate]] = {}
        for c in cands:
            for s in c.inputs:
                readers.setdefault(s, []).append(c)
        self.span = span if span is not None else len(cands)
        self.rank = {c.op: i for i, c in enumerate(sorted(cands, key=lambda c: c.at))}
        self.via: dict[int, dict[int, list[int]]] = {}
        self.points: dict[int, list[tuple[int, int]]] = {}
        self.readers: dict[int, list[int]] = {}  # x -> the candidates that read x's storages
        self.truncated = False  # a longer chain was left out (the span mattered)
        at: dict[int, int] = {}  # e -> p_e
        for x in sorted(cands, key=lambda c: -c.at):  # readers before what they read
            via: dict[int, list[int]] = {}
            ds = {d.op: d for s in x.storages for d in readers.get(s, ())}
            self.readers[x.op] = sorted(ds)
            reach = self.rank[x.op] + self.span
            for d in ds.values():
                at[d.op] = d.recompute_at
                for e in (d.op, *self.via[d.op]):
                    if not x.free_after < at[e] < x.recompute_at:
                        continue
                    if self.rank[e] > reach:
                        self.truncated = True
                        continue
                    via.setdefault(e, []).append(d.op)
            self.via[x.op] = via
            self.points[x.op] = sorted((at[e], e) for e in via)

    def pairs(self) -> int:
        return sum(len(v) for v in self.via.values())

    def made_again(self, x: int, p: int, dropped: set[int], memo: dict) -> bool:
        """Is dropped ``x`` made again by position ``p``?"""
        return any(
            self.reaches(x, e, dropped, memo) for pe, e in self.points.get(x, ()) if pe <= p
        )

    def reaches(self, x: int, e: int, dropped: set[int], memo: dict) -> bool:
        """Is there a chain of dropped readers from ``x`` to ``e``? A search, not a recursion:
        chains may be thousands of ops long."""
        if (x, e) in memo:
            return memo[x, e]
        seen, stack, found = {x}, [x], False
        while stack and not found:
            for d in self.via[stack.pop()].get(e, ()):
                if d not in dropped or d in seen or memo.get((d, e)) is False:
                    continue
                if d == e or memo.get((d, e)):
                    found = True
                    break
                seen.add(d)
                stack.append(d)
        if found:
            memo[x, e] = True
        else:  # nothing reachable from x reaches e either
            memo.update(((y, e), False) for y in seen)
        return found


def _holds(term: Term, dropped: set[int], offloaded: set[int], cascade: _Cascade, memo: dict) -> bool:
    kind = term[0]
    if kind == "keep":
        return term[1] not in dropped
    if kind == "drop":
        return term[1] in dropped
    if kind == "drop-keep":
        return term[1] in dropped and term[2] not in dropped
    if kind == "on":  # ("on", sid, inner): the storage is not offloaded, and inner holds
        return term[1] not in offloaded and (term[2] is None or _holds(term[2], dropped, offloaded, cascade, memo))
    return term[1] in dropped and cascade.made_again(term[1], term[2], dropped, memo)


def _with_offloads(pieces, offs: list[OffloadCandidate]):
    """Residency pieces with each offload candidate's off-device stretch made conditional on
    the storage staying (term ``("on", sid, inner)``)."""
    by_sid = {o.sid: o for o in offs}
    for sid, a, b, terms in pieces:
        o = by_sid.get(sid)
        if o is None:
            yield sid, a, b, terms
            continue
        lo, hi = o.released + 1, o.prefetch
        for x, y in ((a, min(b, lo)), (max(a, lo), min(b, hi)), (max(a, hi), b)):
            if x >= y:
                continue
            if lo <= x and y <= hi:
                on = frozenset({("on", sid, None)}) if terms is None else frozenset(("on", sid, t) for t in terms)
                yield sid, x, y, on
            else:
                yield sid, x, y, terms


def _residency(g: PlanningGraph, order: list[int], cands: list[Candidate], cascade: _Cascade):
    """For every planned storage, ``(sid, start, stop, terms)`` pieces covering positions
    ``[start, stop)``: resident throughout when ``terms`` is None, else resident iff one of the
    terms holds for the chosen drops. The one statement of the semantics, shared by the
    simulator and the solver so that they cannot disagree:

    a storage is resident at ``t`` when it exists and is needed at some ``p >= t`` by the same
    instance; needs are its uses and the recompute points of dropped ops that read it. A
    dropped op's storages are freed after the last use before its gap and made again at its
    first need after that: its recompute point ``r``, or earlier, where a chain of dropped
    readers is recomputed inside the gap (:class:`_Cascade`); a storage made again early is
    counted resident from then on through the gap (an upper bound when it has no use after the
    gap), and a remade storage is resident at ``r`` even if nothing needs it there."""
    n = len(order)
    pos = {v: i for i, v in enumerate(order)}
    owner = {s: c for c in cands for s in c.storages}
    needs = needed_at(g, order)
    extra: dict[int, list[tuple[int, int]]] = {}
    for c in cands:
        for s in c.inputs:
            extra.setdefault(s, []).append((c.recompute_at, c.op))
    for s in g.storages.values():
        if s.kind == PERSISTENT:
            continue
        first = pos[s.producer]
        base = needs[s.sid]
        c = owner.get(s.sid)
        xs = extra.get(s.sid, [])
        if s.kind == ESCAPING or (c is None and not xs):
            yield s.sid, first, (n if s.kind == ESCAPING else base[-1] + 1), None
            continue
        r = c.recompute_at if c else None
        remade_at = [p for p, _ in cascade.points.get(c.op, ())] if c else []
        horizon = max([base[-1], *(p for p, _ in xs), *([r] if c else [])])
        cuts = {first, horizon + 1, *(p + 1 for p in base), *(p + 1 for p, _ in xs), *remade_at}
        if c:
            cuts |= {r, r + 1}
        cuts = sorted(x for x in cuts if first <= x <= horizon + 1)
        for a, b in zip(cuts, cuts[1:]):
            terms: set | None
            if c and a < r:
                i = bisect.bisect_left(base, a)
                if i < len(base) and base[i] < r:
                    terms = None
                else:
                    if base[-1] >= r:  # needed after the gap: resident if kept
                        terms = {("keep", c.op)}
                    else:  # only readers need it: resident if kept until the last of them
                        terms = {("drop-keep", d, c.op) for p, d in xs if p >= a}
                    if remade_at and remade_at[0] <= a:  # or if made again by now
                        terms.add(("reach", c.op, max(p for p in remade_at if p <= a)))
            elif base[-1] >= a:
                terms = None
            else:
                terms = {("drop", d) for p, d in xs if p >= a}
                if c and a == r:
                    terms.add(("drop", c.op))
            if terms is None or terms:
                yield s.sid, a, b, (None if terms is None else frozenset(terms))


def remat_replay(
    g: PlanningGraph, order: list[int], dropped: list[Candidate], offloaded: list[OffloadCandidate] = ()
) -> RematReplay:
    """Exact live bytes of ``order`` with the ``dropped`` ops freed and recomputed and the
    ``offloaded`` storages parked on the host in their windows."""
    n = len(order)
    chosen = {c.op for c in dropped}
    delta = [0] * (n + 1)
    segments: dict[int, list[tuple[int, int]]] = {}
    cascade = _Cascade(dropped)
    clash = [(o.sid, d) for o in offloaded for d in offload_conflicts(o, dropped, cascade)]
    if clash or any(o.producer in chosen for o in offloaded):
        raise ValueError(f"offloaded storages needed while parked (storage, dropped op): {clash}")
    parked = {o.sid for o in offloaded}
    memo: dict = {}
    for sid, a, b, terms in _with_offloads(_residency(g, order, dropped, cascade), list(offloaded)):
        if terms is not None and not any(_holds(t, chosen, parked, cascade, memo) for t in terms):
            continue
        size = g.storages[sid].nbytes
        delta[a] += size
        delta[b] -= size
        segs = segments.setdefault(sid, [])
        if segs and segs[-1][1] == a - 1:
            segs[-1] = (segs[-1][0], b - 1)
        else:
            segs.append((a, b - 1))
    live, run = [], 0
    for i in range(n):
        run += delta[i]
        live.append(run)
    work = [live[i] + g.ops[order[i]].workspace for i in range(n)]
    peak_at = max(range(n), key=work.__getitem__) if n else 0
    peak = g.persistent_bytes + (work[peak_at] if n else 0)
    extra_seconds = sum(c.seconds for c in dropped)
    return RematReplay(peak, peak_at, extra_seconds, live, segments, list(offloaded))


def offload_conflicts(o: OffloadCandidate, cands: list[Candidate], cascade: _Cascade) -> list[int]:
    """The candidates that cannot be dropped if ``o`` is offloaded: readers of its storage
    that may be recomputed (or made again for a chain) while it is off the device."""
    off = o.off
    return [
        c.op
        for c in cands
        if o.sid in c.inputs
        and (c.recompute_at in off or any(p in off for p, _e in cascade.points.get(c.op, ())))
    ]


def predict(g: PlanningGraph, order: list[int], dropped: list[Candidate], offloaded: list[OffloadCandidate]) -> tuple[float, float]:
    """:func:`planner.offload.predict_seconds` of a plan: (step seconds, of which stalls).
    A dropped op is counted at its recompute point (chains made again earlier cost the same)."""
    at: dict[int, float] = {}
    for c in dropped:
        at[c.recompute_at] = at.get(c.recompute_at, 0.0) + c.seconds
    return predict_seconds(g, order, at, offloaded)


def _cost(c: Candidate) -> int:
    return max(1, round(c.seconds / MICROSECOND))


def _greedy(g, order, cands, budget) -> list[Candidate] | None:
    """Drop, at the current peak, the candidate freeing the most bytes per recomputed second
    until the budget holds; then undo drops that turn out unnecessary (costliest first)."""
    dropped: list[Candidate] = []
    rest = list(cands)
    rep = remat_replay(g, order, dropped)
    while rep.peak > budget:
        at = rep.peak_at
        useful = [c for c in rest if c.free_after < at < c.recompute_at]
        if not useful:
            return None
        best = max(useful, key=lambda c: (c.nbytes / _cost(c), -c.op))
        rest.remove(best)
        trial = remat_replay(g, order, dropped + [best])
        if trial.peak <= rep.peak and trial.live[at] < rep.live[at]:
            dropped.append(best)
            rep = trial
    for c in sorted(dropped, key=lambda c: -_cost(c)):
        without = [d for d in dropped if d is not c]
        if remat_replay(g, order, without).peak <= budget:
            dropped = without
    return dropped


@dataclass
class RematPath:
    """One path of a step to plan: its graph, its op order, and a key per op index that names
    the same op on every path (the TraceGraph node and loop iterations; default: the index).
    A drop decision is made per key, so all paths agree on it."""

    g: PlanningGraph
    order: list[int]
    keys: list[Hashable] | None = None
    # storages placed in one arena shared by all paths (None: no arena). The arena holds
    # whole, from the start: a plan needs persistent + arena + the rest at every moment, where
    # the arena is the largest sum of placed storages resident at once on any path
    placed: frozenset | None = None

    def key(self, op: int) -> Hashable:
        return op if self.keys is None else self.keys[op]


def _sizer(g: PlanningGraph, placed: frozenset | None) -> Callable[[int], int]:
    """A storage's bytes as a plan counts them: placed ones as the arena holds them (aligned)."""
    if not placed:
        return lambda sid: g.storages[sid].nbytes
    return lambda sid: aligned(g.storages[sid].nbytes) if sid in placed else g.storages[sid].nbytes


def split_peaks(g: PlanningGraph, order: list[int], segments: dict, placed: frozenset) -> tuple[int, int]:
    """Peaks of the ``placed`` storages resident at once (aligned as the arena holds them) and
    of the rest (op workspace included), given when each storage is resident (a replay's
    ``segments``)."""
    n = len(order)
    inside, outside = [0] * (n + 1), [0] * (n + 1)
    size_of = _sizer(g, placed)
    for sid, spans in segments.items():
        delta = inside if sid in placed else outside
        for a, b in spans:
            delta[a] += size_of(sid)
            delta[b + 1] -= size_of(sid)
    i_live = o_live = i_peak = o_peak = 0
    for t in range(n):
        i_live += inside[t]
        o_live += outside[t]
        i_peak = max(i_peak, i_live)
        o_peak = max(o_peak, o_live + g.ops[order[t]].workspace)
    return i_peak, o_peak


def bound_of(paths: list[RematPath], replays: list[RematReplay]) -> int:
    """The device bytes plans need at their peak over all paths: with an arena, persistent
    state, the arena (the most placed bytes resident at once on any path) and the rest."""
    peak = max((r.peak for r in replays), default=0)
    if not paths or paths[0].placed is None:
        return peak
    split = [split_peaks(p.g, p.order, r.segments, p.placed) for p, r in zip(paths, replays)]
    arena = max(i for i, _o in split)
    return max(peak, *(p.g.persistent_bytes + arena + o for p, (_i, o) in zip(paths, split)))


def _runs(paths: list[RematPath]) -> dict[Hashable, int]:
    """Per op key, how many paths run it (a decision about it must hold on all of them)."""
    runs: dict[Hashable, int] = {}
    for p in paths:
        for k in {p.key(op) for op in p.order}:
            runs[k] = runs.get(k, 0) + 1
    return runs


def _allowed_candidates(paths: list[RematPath], banned: set) -> list[list[Candidate]]:
    """Per path, its candidates whose key may be dropped: a candidate on every path that runs
    the op, and not banned."""
    per = [candidates(p.g, p.order) for p in paths]
    runs = _runs(paths)
    droppable: dict[Hashable, int] = {}
    for p, cs in zip(paths, per):
        for c in cs:
            droppable[p.key(c.op)] = droppable.get(p.key(c.op), 0) + 1
    allowed = {k for k, n in droppable.items() if n == runs[k] and k not in banned}
    return [[c for c in cs if p.key(c.op) in allowed] for p, cs in zip(paths, per)]


def offload_key(p: RematPath, o: OffloadCandidate) -> Hashable:
    """The decision key of offloading ``o``'s storage: its producer's key and output slot."""
    return ("off", p.key(o.producer), o.index)


class _Model:
    """The CP-SAT model over all paths: one drop literal per op key and one offload literal per
    storage key, memory rows per path grouped by the decisions in play at each position, and
    the copy channel's capacity."""

    def __init__(self, paths: list[RematPath], per: list[list[Candidate]], offs: list[list[OffloadCandidate]] | None = None) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.model = cp_model.CpModel()
        offs = offs or [[] for _ in paths]
        self.drop: dict[Hashable, Any] = {}
        self.off: dict[Hashable, Any] = {}
        self.cost: dict[Hashable, int] = {}
        for p, cands, os in zip(paths, per, offs):
            for c in cands:
                k = p.key(c.op)
                if k not in self.drop:
                    self.drop[k] = self.model.NewBoolVar(f"drop{len(self.drop)}")
                self.cost[k] = max(self.cost.get(k, 0), _cost(c))
            for o in os:
                k = offload_key(p, o)
                if k not in self.off:
                    self.off[k] = self.model.NewBoolVar(f"off{len(self.off)}")
                self.cost[k] = OFFLOAD_COST
        self._live: dict[tuple, Any] = {}
        self._reach: dict[tuple, Any] = {}  # (path, x, e) -> R: e's recomputation remakes x
        self._by: dict[tuple, Any] = {}  # (path, x, p) -> x is remade by position p (if dropped)
        self.cascades: list[_Cascade] = []
        self.chain_span: int | None = None  # how far a chain of dropped readers may reach, if capped
        # (fixed bytes, the bytes decisions leave resident (a linear expression), their most,
        # and what they count: "all" storages, those "in" the arena, or those "out" of it)
        self.rows: list[tuple[int, Any, int, str]] = []
        self.arena: Any = None  # with an arena: its size, the most placed bytes at once
        self._channel: set = set()
        self._offs: list[dict[int, OffloadCandidate]] = []  # per path: sid -> candidate
        for i, (p, cands, os) in enumerate(zip(paths, per, offs)):
            self._add_path(i, p, cands, os)
        if any(kind == "in" for *_r, kind in self.rows):
            top = max(base + most for base, _l, most, kind in self.rows if kind == "in")
            self.arena = self.model.NewIntVar(0, top, "arena")

    def limit(self, limit: Any) -> None:
        """Every row within ``limit`` (bytes, or a variable): with an arena, the placed bytes
        within the arena's size and the rest beside the whole arena."""
        for base, level, most, kind in self.rows:
            if kind == "in":
                self.model.Add(base + level <= self.arena)
            elif kind == "out":
                self.model.Add(base + level + self.arena <= limit)
            elif not isinstance(limit, int) or base + most > limit:
                self.model.Add(base + level <= limit)

    @property
    def decisions(self) -> dict[Hashable, Any]:
        return {**self.drop, **self.off}

    def _add_path(self, i: int, p: RematPath, cands: list[Candidate], offs: list[OffloadCandidate]) -> None:
        g, order = p.g, p.order
        n = len(order)
        fixed = [g.ops[order[t]].workspace for t in range(n)]
        cascade = _Cascade(cands, max(MIN_SPAN, MAX_CASCADE_PAIRS // max(1, len(cands))))
        self.cascades.append(cascade)
        if cascade.truncated:
            self._cap_chains(i, p, cands, cascade)
        self._offs.append({o.sid: o for o in offs})
        for o in offs:  # a parked storage is needed by nobody: not made again, not read
            off = self.off[offload_key(p, o)]
            if p.key(o.producer) in self.drop:
                self.model.AddBoolOr([off.Not(), self.drop[p.key(o.producer)].Not()])
            for c in cands:
                if o.sid not in c.inputs:
                    continue
                drop = self.drop[p.key(c.op)]
                if c.recompute_at in o.off:
                    self.model.AddBoolOr([off.Not(), drop.Not()])
                    continue
                for pe, e in cascade.points.get(c.op, ()):
                    if pe in o.off:  # c is made again there for a chain of dropped readers
                        self.model.Add(off + drop + self._reaches(i, p, c.op, e) <= 2)
        classes = {"all": (fixed, [], [0] * (n + 1))}
        if p.placed is not None:  # the arena's storages apart from the rest (workspace is out)
            classes = {"out": (fixed, [], [0] * (n + 1)), "in": ([0] * n, [], [0] * (n + 1))}
        size_of = _sizer(g, p.placed)
        for sid, a, b, ts in _with_offloads(_residency(g, order, cands, cascade), offs):
            size = size_of(sid)
            _fixed, pieces, delta = classes["all" if p.placed is None else "in" if sid in p.placed else "out"]
            if ts is None:
                delta[a] += size
                delta[b] -= size
            else:
                pieces.append((sid, a, b, self._resident(i, p, sid, tuple(sorted(ts, key=repr)))))
        for kind, (base, pieces, delta) in classes.items():
            run = 0
            for t in range(n):
                run += delta[t]
                base[t] += run
            if kind != "in":
                base = [g.persistent_bytes + f for f in base]
            if sum(b - a for _, a, b, _ in pieces) <= MAX_DENSE_TERMS:
                self._dense_rows(size_of, n, base, pieces, kind)
            else:
                self._running_rows(size_of, n, base, pieces, kind)
        by_sid = {o.sid: o for o in offs}
        for shares in channel_shares(g, order, offs):
            if len(shares) > 1 and sum(shares.values()) > 1:
                row = tuple(sorted((offload_key(p, by_sid[sid]), round(x * 1000)) for sid, x in shares.items()))
                if row not in self._channel:
                    self._channel.add(row)
                    self.model.Add(sum(w * self.off[k] for k, w in row) <= 1000)

    def _dense_rows(self, size_of: Callable, n: int, fixed: list[int], pieces: list, kind: str) -> None:
        """A row per set of storages in play: every literal of every storage resident there
        (rows repeat rarely; the solver propagates them best)."""
        at: list[dict[int, Any]] = [dict() for _ in range(n)]
        for sid, a, b, lit in pieces:
            for t in range(a, b):
                at[t][sid] = lit
        groups: dict[tuple, int] = {}
        for t in range(n):
            key = tuple(sorted((sid, lit.Index()) for sid, lit in at[t].items()))
            if key not in groups or groups[key][0] < fixed[t]:
                groups[key] = (fixed[t], at[t])
        for base, lits in groups.values():
            sizes = [(size_of(sid), lit) for sid, lit in lits.items()]
            self.rows.append((base, sum(size * lit for size, lit in sizes), sum(size for size, _ in sizes), kind))

    def _running_rows(self, size_of: Callable, n: int, fixed: list[int], pieces: list, kind: str) -> None:
        """The bytes in play as a running sum: a variable per position that adds the pieces
        starting there and takes off those that stop (linear in the graph, where a row listing
        every storage in play grows with its square)."""
        steps: list[dict[int, list]] = [dict() for _ in range(n + 1)]  # t -> literal -> [lit, bytes]
        in_play = [0] * (n + 1)
        for sid, a, b, lit in pieces:
            size = size_of(sid)
            in_play[a] += size
            in_play[b] -= size
            for t, sign in ((a, size), (b, -size)):
                steps[t].setdefault(lit.Index(), [lit, 0])[1] += sign
        level, most = None, 0  # the running sum's variable, and the most it can hold
        for t in range(n):
            most += in_play[t]
            change = [(size, lit) for lit, size in steps[t].values() if size]
            if change or level is None:
                var = self.model.NewIntVar(0, most, f"mem{t}")
                self.model.Add(var == (level if level is not None else 0) + sum(size * lit for size, lit in change))
                level = var
                self.rows.append((fixed[t], level, most, kind))
            else:  # the same variable bytes: one row, at the most fixed bytes
                base, _, was, _kind = self.rows[-1]
                self.rows[-1] = (max(base, fixed[t]), level, max(was, most), kind)

    def _cap_chains(self, i: int, p: RematPath, cands: list[Candidate], cascade: _Cascade) -> None:
        """No chain of dropped readers reaching further than the cascade's span: ``far[x]``
        bounds the rank of the last candidate on a chain of dropped readers from ``x`` (over
        every reader, a superset of the chains that remake: sound)."""
        self.chain_span = cascade.span if self.chain_span is None else min(self.chain_span, cascade.span)
        rank = cascade.rank
        far = {c.op: self.model.NewIntVar(0, rank[c.op] + cascade.span, f"far{c.op}") for c in cands}
        for c in cands:
            drop = self.drop[p.key(c.op)]
            self.model.Add(far[c.op] >= rank[c.op]).OnlyEnforceIf(drop)
            for d in cascade.readers[c.op]:
                self.model.Add(far[c.op] >= far[d]).OnlyEnforceIf(drop)

    def _resident(self, i: int, p: RematPath, sid: int, ts: tuple) -> Any:
        """A literal that is true when one of the terms holds (the solver keeps it false
        otherwise, as it only ever tightens the memory rows)."""
        if len(ts) == 1:
            return self._lit(i, p, ts[0])
        cache = (i, sid, ts)
        if cache not in self._live:
            var = self.model.NewBoolVar(f"live{sid}")
            for term in ts:
                self.model.AddImplication(self._lit(i, p, term), var)
            self._live[cache] = var
        return self._live[cache]

    def _lit(self, i: int, p: RematPath, term: Term) -> Any:
        """A literal at least as true as ``term`` (the rows only ever want it false)."""
        kind = term[0]
        if kind == "keep":
            return self.drop[p.key(term[1])].Not()
        if kind == "drop":
            return self.drop[p.key(term[1])]
        cache = (i, term)
        if cache not in self._live:
            var = self.model.NewBoolVar(kind)
            if kind == "drop-keep":
                self.model.Add(var >= self.drop[p.key(term[1])] - self.drop[p.key(term[2])])
            elif kind == "reach":
                self.model.Add(var >= self.drop[p.key(term[1])] + self._remade_by(i, p, term[1], term[2]) - 1)
            else:  # on
                off = self.off[offload_key(p, self._offs[i][term[1]])]
                if term[2] is None:
                    self.model.AddImplication(off.Not(), var)
                else:
                    self.model.Add(var >= self._lit(i, p, term[2]) - off)
            self._live[cache] = var
        return self._live[cache]

    def _remade_by(self, i: int, p: RematPath, x: int, at: int) -> Any:
        """A literal: a chain of dropped readers remakes ``x`` by position ``at`` (prefix ORs
        over the recompute points, so each position costs two constraints). Built forwards,
        without recursion: chains may be thousands of ops long."""
        key = (i, p.key(x), at)
        if key not in self._by:
            points = sorted(pe for pe in self.cascades[i].points[x] if pe[0] <= at)
            prev = None
            for pos in sorted({pe for pe, _ in points} | {at}):
                k = (i, p.key(x), pos)
                if k not in self._by:
                    var = self.model.NewBoolVar("by")
                    if prev is not None:
                        self.model.AddImplication(prev, var)
                    for pe, e in points:
                        if pe == pos:
                            self.model.AddImplication(self._reaches(i, p, x, e), var)
                    self._by[k] = var
                prev = self._by[k]
        return self._by[key]

    def _reaches(self, i: int, p: RematPath, x: int, e: int) -> Any:
        """A literal: recomputing ``e`` remakes ``x`` (a chain of dropped readers). Every
        literal of the chain is made first, then its constraints: no recursion."""
        key = (i, p.key(x), p.key(e))
        if key not in self._reach:
            made, stack = [], [x]
            while stack:
                y = stack.pop()
                k = (i, p.key(y), p.key(e))
                if k in self._reach:
                    continue
                self._reach[k] = self.model.NewBoolVar("reach")
                made.append(y)
                stack.extend(d for d in self.cascades[i].via[y][e] if d != e)
            for y in made:
                var = self._reach[(i, p.key(y), p.key(e))]
                for d in self.cascades[i].via[y][e]:
                    if d == e:
                        self.model.AddImplication(self.drop[p.key(d)], var)
                    else:
                        reach_d = self._reach[(i, p.key(d), p.key(e))]
                        self.model.Add(var >= self.drop[p.key(d)] + reach_d - 1)
        return self._reach[key]

    def fit(self, budget: int) -> bool:
        """Add the budget rows; False when a row cannot hold whatever is dropped."""
        if any(base > budget for base, *_r in self.rows):
            return False
        self.limit(budget)
        return True

    def solve(self, time_limit: float, hint: set | None, workers: int = 8):
        decisions = self.decisions
        if hint is not None:
            for k, var in decisions.items():
                self.model.AddHint(var, k in hint)
        solver = self.cp.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.1, time_limit)
        solver.parameters.num_workers = workers
        status = solver.Solve(self.model)
        chosen = None
        if status in (self.cp.OPTIMAL, self.cp.FEASIBLE):
            chosen = {k for k, var in decisions.items() if solver.Value(var)}
        return solver, status, chosen


def _chosen(p: RematPath, cands: list[Candidate], offs: list[OffloadCandidate], chosen: set):
    dropped = sorted((c for c in cands if p.key(c.op) in chosen), key=lambda c: (c.recompute_at, c.op))
    return dropped, [o for o in offs if offload_key(p, o) in chosen]


def _replays(paths: list[RematPath], per, offs, chosen: set) -> list[RematReplay]:
    return [remat_replay(p.g, p.order, *_chosen(p, cands, os, chosen)) for p, cands, os in zip(paths, per, offs)]


def _allowed_offloads(paths: list[RematPath], bandwidth: Bandwidth | None, banned: set) -> list[list[OffloadCandidate]]:
    """Per path, the storages that may be offloaded: a candidate on every path that runs its
    producer, moved after the same ops (by key) on each, and not banned. None without a
    bandwidth (no offloading)."""
    if bandwidth is None:
        return [[] for _ in paths]
    per = [offload_candidates(p.g, p.order, bandwidth) for p in paths]
    runs = _runs(paths)
    able: dict[Hashable, int] = {}
    windows: dict[Hashable, set] = {}
    for p, os in zip(paths, per):
        for o in os:
            key = offload_key(p, o)
            able[key] = able.get(key, 0) + 1
            windows.setdefault(key, set()).add(offload_window(p, o))

    def allowed(p: RematPath, o: OffloadCandidate) -> bool:
        key = offload_key(p, o)
        return key not in banned and able[key] == runs[p.key(o.producer)] and len(windows[key]) == 1

    return [[o for o in os if allowed(p, o)] for p, os in zip(paths, per)]


def offload_window(p: RematPath, o: OffloadCandidate) -> tuple:
    """Where an offload takes effect, by op key: the ops after which its copy out starts, its
    device copy is released and its copy back starts; and its size."""
    return tuple(p.key(p.order[t]) for t in (o.start, o.released, o.prefetch - 1)), o.nbytes


def min_feasible_budget_paths(
    paths: list[RematPath], time_limit: float = 20.0, banned: set = frozenset(), bandwidth: Bandwidth | None = None
) -> tuple[int, set]:
    """The lowest peak (over all paths) reachable by dropping candidates (and offloading, given
    the copy ``bandwidth``), and the keys that reach it: proven lowest unless the solver ran
    out of time (then an achievable bound) or the model capped the chains of dropped readers
    (then lowest among plans within the cap)."""
    per = _allowed_candidates(paths, set(banned))
    offs = _allowed_offloads(paths, bandwidth, set(banned))

    def peak_of(keys: set) -> int:
        return bound_of(paths, _replays(paths, per, offs, keys))

    everything = {p.key(c.op) for p, cs in zip(paths, per) for c in cs}
    options = [set()]
    if any(offs):  # the recompute-only floor first: offloading starts from it, never above it
        spent = time.perf_counter()
        options.append(min_feasible_budget_paths(paths, time_limit / 3, banned)[1])
        time_limit -= time.perf_counter() - spent
    model = _Model(paths, per, offs) if everything or any(offs) else None
    if model is not None:  # all drops breaks a capped model (and replays slowly): checkpoints then
        options += [everything] if model.chain_span is None else _periodic(paths, per, model.chain_span)
    scored = [(peak_of(o), o) for o in options]
    if model is not None:
        top = sum(max((base + most for base, _, most, k in model.rows if k == kind), default=0) for kind in ("in", "out", "all"))
        peak = model.model.NewIntVar(0, top, "peak")
        model.limit(peak)
        model.model.Minimize(peak)
        _solver, _status, chosen = model.solve(time_limit, min(scored, key=lambda s: s[0])[1])
        if chosen is not None:
            scored.append((peak_of(chosen), chosen))
    return min(scored, key=lambda s: (s[0], len(s[1])))


def _periodic(paths: list[RematPath], per: list[list[Candidate]], span: int) -> list[set]:
    """Plans that keep every k-th candidate (in each path's order) and drop the rest, for k up
    to the span: uniform checkpoints, rotor's simplest schedule, for large graphs."""
    plans = []
    k = 2
    while k <= span:
        plans.append({p.key(c.op) for p, cs in zip(paths, per) for r, c in enumerate(cs) if r % k != k - 1})
        k *= 2
    return plans


def min_feasible_budget(
    g: PlanningGraph, order: list[int] | None = None, time_limit: float = 20.0, bandwidth: Bandwidth | None = None
) -> tuple[int, list[Candidate]]:
    """:func:`min_feasible_budget_paths` for one graph: the peak and the candidates dropped."""
    path = RematPath(g, list(range(len(g))) if order is None else order)
    peak, chosen = min_feasible_budget_paths([path], time_limit, bandwidth=bandwidth)
    return peak, [c for c in candidates(g, path.order) if c.op in chosen]


def plan_remat_paths(
    paths: list[RematPath],
    budget: int,
    time_limit: float = 30.0,
    banned: set = frozenset(),
    bandwidth: Bandwidth | None = None,
) -> list[RematPlan]:
    """Meet ``budget`` (bytes at the peak, persistent state included) on every path at the
    least added recompute time (each key's cost counted once), offloading too when given the
    copy ``bandwidth``; one plan per path. Raises :class:`BudgetTooSmall` naming the smallest
    feasible budget."""
    t0 = time.perf_counter()
    bases = [remat_replay(p.g, p.order, []) for p in paths]
    if bound_of(paths, bases) <= budget:
        spent = time.perf_counter() - t0
        return [
            RematPlan(
                p.order, [], b.peak, b.peak, budget, 0.0, "none", spent, 0.0, [], *predict(p.g, p.order, [], []),
                b.segments,
            )
            for p, b in zip(paths, bases)
        ]  # fmt: skip
    per = _allowed_candidates(paths, set(banned))
    offs = _allowed_offloads(paths, bandwidth, set(banned))

    def lowest() -> tuple[int, set]:
        return min_feasible_budget_paths(paths, max(1.0, time_limit / 2), banned, bandwidth)

    def too_small(smallest: int) -> BudgetTooSmall:
        return BudgetTooSmall(budget, smallest, OFFLOAD_FLOOR_NOTE if bandwidth is not None else "")

    warm: set | None = set()
    for p, cands in zip(paths, per):
        found = _greedy(p.g, p.order, cands, budget)
        warm = None if found is None or warm is None else warm | {p.key(c.op) for c in found}
    if warm is not None and bound_of(paths, _replays(paths, per, offs, warm)) > budget:
        warm = None
    model = _Model(paths, per, offs)
    if not model.decisions or not model.fit(budget):
        raise too_small(lowest()[0])
    model.model.Minimize(sum(model.cost[k] * var for k, var in model.decisions.items()))
    solver, status, found = model.solve(time_limit - (time.perf_counter() - t0), warm)
    method, gap, chosen = "greedy", None, warm
    if found is not None:
        cost = lambda keys: sum(model.cost[k] for k in keys)  # noqa: E731
        if warm is None or cost(found) <= cost(warm):
            chosen = found
            method = "cp-sat" if status == model.cp.OPTIMAL else "cp-sat-timeout"
        obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
        gap = 0.0 if status == model.cp.OPTIMAL else (obj - bound) / obj if obj else 0.0
    elif status == model.cp.INFEASIBLE and model.chain_span is None:  # (a capped model proves less)
        raise too_small(lowest()[0])
    if chosen is None:
        # no plan found in time: the plan of the lowest peak serves if it fits (near the
        # smallest feasible budget it is the only kind there is)
        smallest, keys = lowest()
        if smallest > budget:
            raise too_small(smallest)
        method, chosen = "lowest-peak", keys
    plans = []
    spent = time.perf_counter() - t0
    reps = _replays(paths, per, offs, chosen)
    assert bound_of(paths, reps) <= budget, "a remat plan over its budget (planner bug)"
    for p, cands, os, base, rep in zip(paths, per, offs, bases, reps):
        dropped, offloaded = _chosen(p, cands, os, chosen)
        plans.append(
            RematPlan(
                p.order, dropped, rep.peak, base.peak, budget, rep.extra_seconds, method, spent, gap,
                offloaded, *predict(p.g, p.order, dropped, offloaded), rep.segments,
            )
        )  # fmt: skip
    return plans


def plan_remat(
    g: PlanningGraph,
    budget: int,
    order: list[int] | None = None,
    time_limit: float = 30.0,
    bandwidth: Bandwidth | None = None,
) -> RematPlan:
    """:func:`plan_remat_paths` for one graph."""
    path = RematPath(g, list(range(len(g))) if order is None else order)
    return plan_remat_paths([path], budget, time_limit, bandwidth=bandwidth)[0]


def exhaustive_remat(
    g: PlanningGraph, budget: int, order: list[int] | None = None, bandwidth: Bandwidth | None = None,
    placed: frozenset | None = None,
):
    """Every subset of the candidates and offloads (tests only: exponential). Returns (cost in
    the objective's units, peak, dropped ops, offloaded storages) of the cheapest plan within
    ``budget`` (with an arena of the ``placed`` storages: :func:`bound_of`), or None."""
    order = list(range(len(g))) if order is None else order
    path = RematPath(g, order, placed=placed)
    cands = candidates(g, order)
    offs = offload_candidates(g, order, bandwidth) if bandwidth is not None else []
    items = [*cands, *offs]
    best = None
    for k in range(len(items) + 1):
        for subset in itertools.combinations(items, k):
            dropped = [c for c in subset if isinstance(c, Candidate)]
            offloaded = [o for o in subset if isinstance(o, OffloadCandidate)]
            if not _channel_ok(g, order, offloaded):
                continue
            try:
                rep = remat_replay(g, order, dropped, offloaded)
            except ValueError:
                continue
            if bound_of([path], [rep]) <= budget:
                cost = sum(map(_cost, dropped)) + OFFLOAD_COST * len(offloaded)
                if best is None or cost < best[0]:
                    best = (cost, rep.peak, sorted(c.op for c in dropped), sorted(o.sid for o in offloaded))
    return best


def _channel_ok(g: PlanningGraph, order: list[int], offloaded: list[OffloadCandidate]) -> bool:
    """The model's channel rows: at every position the copies in flight need at most all of it."""
    return all(
        len(sh) < 2 or sum(sh.values()) <= 1 or sum(round(x * 1000) for x in sh.values()) <= 1000
        for sh in channel_shares(g, order, offloaded)
    )
