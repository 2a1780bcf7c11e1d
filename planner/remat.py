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
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from .graph import ESCAPING, LOCAL, PERSISTENT, PlanningGraph

MICROSECOND = 1e-6  # cost unit of the CP-SAT objective; every recomputation costs at least one


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


@dataclass
class RematPlan:
    order: list[int]
    dropped: list[Candidate]  # sorted by recompute position
    peak: int
    base_peak: int  # the same order without recomputation
    budget: int | None
    extra_seconds: float
    method: str  # "none", "greedy", "cp-sat" (proven optimal), "cp-sat-timeout"
    seconds: float
    gap: float | None = None  # CP-SAT's relative gap on the added time (0: optimal)

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
        gap = _longest_gap(own) or _longest_gap(own | virtual)
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


def _longest_gap(points: set[int]) -> tuple[int, int] | None:
    ps = sorted(points)
    if len(ps) < 2:
        return None
    a, b = max(zip(ps, ps[1:]), key=lambda ab: (ab[1] - ab[0], -ab[0]))
    return (a, b) if b - a >= 2 else None


Term = tuple
# ("keep", c): c is kept; ("drop", d): d is dropped; ("drop-keep", d, c): d dropped, c kept;
# ("reach", c, p): c is dropped and made again by position p for a dropped reader (see _Cascade)


class _Cascade:
    """Who makes whom again on the executor. To recompute a dropped op at ``p`` the executor
    needs its inputs; an input dropped and not yet made again is recomputed first, and so on
    down the chain. So candidate ``x`` is made again at ``p_e`` (the recompute point of ``e``)
    when there is a chain ``x <- d <- ... <- e`` of dropped readers with ``p_e`` inside the gap
    of every op on it. ``points[x]``: the ``(p_e, e)`` that may reach ``x``, by ``p_e``;
    ``via[x][e]``: the readers of ``x`` that lead to ``e`` (``e`` itself when direct)."""

    def __init__(self, cands: list[Candidate]) -> None:
        readers: dict[int, list[Candidate]] = {}
        for c in cands:
            for s in c.inputs:
                readers.setdefault(s, []).append(c)
        self.via: dict[int, dict[int, list[int]]] = {}
        self.points: dict[int, list[tuple[int, int]]] = {}
        at: dict[int, int] = {}  # e -> p_e
        for x in sorted(cands, key=lambda c: -c.at):  # readers before what they read
            via: dict[int, list[int]] = {}
            for d in {d.op: d for s in x.storages for d in readers.get(s, ())}.values():
                at[d.op] = d.recompute_at
                if x.free_after < d.recompute_at < x.recompute_at:
                    via.setdefault(d.op, []).append(d.op)
                for e in self.via.get(d.op, ()):
                    if x.free_after < at[e] < x.recompute_at:
                        via.setdefault(e, []).append(d.op)
            self.via[x.op] = via
            self.points[x.op] = sorted((at[e], e) for e in via)

    def made_again(self, x: int, p: int, dropped: set[int], memo: dict) -> bool:
        """Is dropped ``x`` made again by position ``p``?"""
        return any(
            self.reaches(x, e, dropped, memo) for pe, e in self.points.get(x, ()) if pe <= p
        )

    def reaches(self, x: int, e: int, dropped: set[int], memo: dict) -> bool:
        key = (x, e)
        if key not in memo:
            memo[key] = any(
                d in dropped and (d == e or self.reaches(d, e, dropped, memo))
                for d in self.via[x].get(e, ())
            )
        return memo[key]


def _holds(term: Term, dropped: set[int], cascade: _Cascade, memo: dict) -> bool:
    kind = term[0]
    if kind == "keep":
        return term[1] not in dropped
    if kind == "drop":
        return term[1] in dropped
    if kind == "drop-keep":
        return term[1] in dropped and term[2] not in dropped
    return term[1] in dropped and cascade.made_again(term[1], term[2], dropped, memo)


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

    def held_until(s) -> set:
        # the program holds a storage until its tensors die, and the executor frees it then:
        # in the issue order that is a need as real as a use
        return {min(s.release, n - 1)} if s.release is not None and issue_order else set()

    issue_order = order == list(range(n))
    extra: dict[int, list[tuple[int, int]]] = {}
    for c in cands:
        for s in c.inputs:
            extra.setdefault(s, []).append((c.recompute_at, c.op))
    for s in g.storages.values():
        if s.kind == PERSISTENT:
            continue
        first = pos[s.producer]
        base = sorted({pos[u] for u in s.uses} | {first} | held_until(s))
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


def remat_replay(g: PlanningGraph, order: list[int], dropped: list[Candidate]) -> RematReplay:
    """Exact live bytes of ``order`` with the ``dropped`` ops freed and recomputed."""
    n = len(order)
    chosen = {c.op for c in dropped}
    delta = [0] * (n + 1)
    segments: dict[int, list[tuple[int, int]]] = {}
    cascade = _Cascade(dropped)
    memo: dict = {}
    for sid, a, b, terms in _residency(g, order, dropped, cascade):
        if terms is not None and not any(_holds(t, chosen, cascade, memo) for t in terms):
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
    return RematReplay(peak, peak_at, extra_seconds, live, segments)


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

    def key(self, op: int) -> Hashable:
        return op if self.keys is None else self.keys[op]


def _allowed_candidates(paths: list[RematPath], banned: set) -> list[list[Candidate]]:
    """Per path, its candidates whose key may be dropped: a candidate on every path that runs
    the op, and not banned."""
    per = [candidates(p.g, p.order) for p in paths]
    runs: dict[Hashable, int] = {}
    droppable: dict[Hashable, int] = {}
    for p, cs in zip(paths, per):
        for k in {p.key(op) for op in p.order}:
            runs[k] = runs.get(k, 0) + 1
        for c in cs:
            droppable[p.key(c.op)] = droppable.get(p.key(c.op), 0) + 1
    allowed = {k for k, n in droppable.items() if n == runs[k] and k not in banned}
    return [[c for c in cs if p.key(c.op) in allowed] for p, cs in zip(paths, per)]


class _Model:
    """The CP-SAT model over all paths: one drop literal per op key, memory rows per path,
    grouped by the decisions in play at each position."""

    def __init__(self, paths: list[RematPath], per: list[list[Candidate]]) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.model = cp_model.CpModel()
        self.drop: dict[Hashable, Any] = {}
        self.cost: dict[Hashable, int] = {}
        for p, cands in zip(paths, per):
            for c in cands:
                k = p.key(c.op)
                if k not in self.drop:
                    self.drop[k] = self.model.NewBoolVar(f"drop{len(self.drop)}")
                self.cost[k] = max(self.cost.get(k, 0), _cost(c))
        self._live: dict[tuple, Any] = {}
        self._reach: dict[tuple, Any] = {}  # (path, x, e) -> R: e's recomputation remakes x
        self._by: dict[tuple, Any] = {}  # (path, x, p) -> x is remade by position p (if dropped)
        self.cascades: list[_Cascade] = []
        self.rows: list[tuple[int, list[tuple[int, Any]]]] = []
        for i, (p, cands) in enumerate(zip(paths, per)):
            self._add_path(i, p, cands)

    def _add_path(self, i: int, p: RematPath, cands: list[Candidate]) -> None:
        g, order = p.g, p.order
        n = len(order)
        fixed = [g.ops[order[t]].workspace for t in range(n)]
        delta = [0] * (n + 1)
        # terms[t]: {sid: terms} for storages whose residency at t depends on the decisions
        terms: list[dict[int, frozenset]] = [dict() for _ in range(n)]
        cascade = _Cascade(cands)
        self.cascades.append(cascade)
        for sid, a, b, ts in _residency(g, order, cands, cascade):
            if ts is None:
                delta[a] += g.storages[sid].nbytes
                delta[b] -= g.storages[sid].nbytes
            else:
                for t in range(a, b):
                    terms[t][sid] = ts
        run = 0
        for t in range(n):
            run += delta[t]
            fixed[t] += run
        groups: dict[tuple, int] = {}
        for t in range(n):
            key = tuple(sorted((sid, tuple(sorted(ts))) for sid, ts in terms[t].items()))
            groups[key] = max(groups.get(key, 0), fixed[t])
        persistent = g.persistent_bytes
        for key, base in groups.items():
            lits = [(g.storages[sid].nbytes, self._resident(i, p, sid, ts)) for sid, ts in key]
            self.rows.append((persistent + base, lits))

    def _resident(self, i: int, p: RematPath, sid: int, ts: tuple) -> Any:
        """A literal that is true when one of the terms holds (the solver keeps it false
        otherwise, as it only ever tightens the memory rows)."""
        drop = self.drop
        if len(ts) == 1 and ts[0][0] in ("keep", "drop"):
            kind, op = ts[0]
            return drop[p.key(op)].Not() if kind == "keep" else drop[p.key(op)]
        cache = (i, sid, ts)
        if cache not in self._live:
            var = self.model.NewBoolVar(f"live{sid}")
            for term in ts:
                if term[0] == "keep":
                    self.model.AddImplication(drop[p.key(term[1])].Not(), var)
                elif term[0] == "drop":
                    self.model.AddImplication(drop[p.key(term[1])], var)
                elif term[0] == "drop-keep":
                    self.model.Add(var >= drop[p.key(term[1])] - drop[p.key(term[2])])
                else:  # reach
                    self.model.Add(var >= drop[p.key(term[1])] + self._remade_by(i, p, term[1], term[2]) - 1)
            self._live[cache] = var
        return self._live[cache]

    def _remade_by(self, i: int, p: RematPath, x: int, at: int) -> Any:
        """A literal: a chain of dropped readers remakes ``x`` by position ``at`` (prefix ORs
        over the recompute points, so each position costs two constraints)."""
        key = (i, p.key(x), at)
        if key not in self._by:
            points = [pe for pe in self.cascades[i].points[x] if pe[0] <= at]
            var = self.model.NewBoolVar("by")
            earlier = [pe for pe in points if pe[0] < at]
            if earlier:
                self.model.AddImplication(self._remade_by(i, p, x, earlier[-1][0]), var)
            for pe, e in points:
                if pe == at:
                    self.model.AddImplication(self._reaches(i, p, x, e), var)
            self._by[key] = var
        return self._by[key]

    def _reaches(self, i: int, p: RematPath, x: int, e: int) -> Any:
        """A literal: recomputing ``e`` remakes ``x`` (a chain of dropped readers)."""
        key = (i, p.key(x), p.key(e))
        if key not in self._reach:
            var = self.model.NewBoolVar("reach")
            self._reach[key] = var
            for d in self.cascades[i].via[x][e]:
                if d == e:
                    self.model.AddImplication(self.drop[p.key(d)], var)
                else:
                    self.model.Add(var >= self.drop[p.key(d)] + self._reaches(i, p, d, e) - 1)
        return self._reach[key]

    def fit(self, budget: int) -> bool:
        """Add the budget rows; False when a row cannot hold whatever is dropped."""
        for base, lits in self.rows:
            if base > budget:
                return False
            if base + sum(size for size, _ in lits) > budget:
                self.model.Add(sum(size * lit for size, lit in lits) <= budget - base)
        return True

    def solve(self, time_limit: float, hint: set | None, workers: int = 8):
        if hint is not None:
            for k, var in self.drop.items():
                self.model.AddHint(var, k in hint)
        solver = self.cp.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.1, time_limit)
        solver.parameters.num_workers = workers
        status = solver.Solve(self.model)
        chosen = None
        if status in (self.cp.OPTIMAL, self.cp.FEASIBLE):
            chosen = {k for k, var in self.drop.items() if solver.Value(var)}
        return solver, status, chosen


def _replays(paths: list[RematPath], per: list[list[Candidate]], chosen: set) -> list[RematReplay]:
    return [
        remat_replay(p.g, p.order, [c for c in cands if p.key(c.op) in chosen])
        for p, cands in zip(paths, per)
    ]


def min_feasible_budget_paths(
    paths: list[RematPath], time_limit: float = 20.0, banned: set = frozenset()
) -> tuple[int, set]:
    """The lowest peak (over all paths) reachable by dropping candidates, and the keys that
    reach it: proven lowest unless the solver ran out of time (then an achievable bound)."""
    per = _allowed_candidates(paths, set(banned))
    everything = {p.key(c.op) for p, cs in zip(paths, per) for c in cs}
    options = [set(), everything]
    if everything:
        model = _Model(paths, per)
        top = sum(max(r.peak for r in _replays(paths, per, o)) for o in options)
        peak = model.model.NewIntVar(0, top, "peak")
        for base, lits in model.rows:
            model.model.Add(base + sum(size * lit for size, lit in lits) <= peak)
        model.model.Minimize(peak)
        _solver, _status, chosen = model.solve(time_limit, None)
        if chosen is not None:
            options.append(chosen)
    best = min(options, key=lambda o: (max(r.peak for r in _replays(paths, per, o)), len(o)))
    return max(r.peak for r in _replays(paths, per, best)), best


def min_feasible_budget(
    g: PlanningGraph, order: list[int] | None = None, time_limit: float = 20.0
) -> tuple[int, list[Candidate]]:
    """:func:`min_feasible_budget_paths` for one graph: the peak and the candidates dropped."""
    path = RematPath(g, list(range(len(g))) if order is None else order)
    peak, chosen = min_feasible_budget_paths([path], time_limit)
    return peak, [c for c in candidates(g, path.order) if c.op in chosen]


def plan_remat_paths(
    paths: list[RematPath], budget: int, time_limit: float = 30.0, banned: set = frozenset()
) -> list[RematPlan]:
    """Meet ``budget`` (bytes at the peak, persistent state included) on every path at the
    least added recompute time (each key's cost counted once); one plan per path. Raises
    :class:`BudgetTooSmall` naming the smallest feasible budget."""
    t0 = time.perf_counter()
    bases = [remat_replay(p.g, p.order, []) for p in paths]
    if all(b.peak <= budget for b in bases):
        spent = time.perf_counter() - t0
        return [RematPlan(p.order, [], b.peak, b.peak, budget, 0.0, "none", spent, 0.0) for p, b in zip(paths, bases)]
    per = _allowed_candidates(paths, set(banned))

    def too_small(detail: str = "") -> BudgetTooSmall:
        smallest, _ = min_feasible_budget_paths(paths, max(1.0, time_limit / 2), banned)
        return BudgetTooSmall(budget, smallest, detail)

    warm: set | None = set()
    for p, cands in zip(paths, per):
        found = _greedy(p.g, p.order, cands, budget)
        warm = None if found is None or warm is None else warm | {p.key(c.op) for c in found}
    if warm is not None and any(r.peak > budget for r in _replays(paths, per, warm)):
        warm = None
    model = _Model(paths, per)
    if not model.drop or not model.fit(budget):
        raise too_small()
    model.model.Minimize(sum(model.cost[k] * var for k, var in model.drop.items()))
    solver, status, found = model.solve(time_limit - (time.perf_counter() - t0), warm)
    method, gap, chosen = "greedy", None, warm
    if found is not None:
        cost = lambda keys: sum(model.cost[k] for k in keys)  # noqa: E731
        if warm is None or cost(found) <= cost(warm):
            chosen = found
            method = "cp-sat" if status == model.cp.OPTIMAL else "cp-sat-timeout"
        obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
        gap = 0.0 if status == model.cp.OPTIMAL else (obj - bound) / obj if obj else 0.0
    elif status == model.cp.INFEASIBLE:
        raise too_small()
    if chosen is None:
        raise too_small("the solver found no plan within its time limit")
    plans = []
    spent = time.perf_counter() - t0
    for p, cands, base in zip(paths, per, bases):
        dropped = sorted((c for c in cands if p.key(c.op) in chosen), key=lambda c: (c.recompute_at, c.op))
        rep = remat_replay(p.g, p.order, dropped)
        assert rep.peak <= budget, "a remat plan over its budget (planner bug)"
        plans.append(RematPlan(p.order, dropped, rep.peak, base.peak, budget, rep.extra_seconds, method, spent, gap))
    return plans


def plan_remat(
    g: PlanningGraph, budget: int, order: list[int] | None = None, time_limit: float = 30.0
) -> RematPlan:
    """:func:`plan_remat_paths` for one graph."""
    path = RematPath(g, list(range(len(g))) if order is None else order)
    return plan_remat_paths([path], budget, time_limit)[0]


def exhaustive_remat(g: PlanningGraph, budget: int, order: list[int] | None = None):
    """Every subset of the candidates (tests only: exponential). Returns (added seconds in
    cost units, peak, dropped ops) of the cheapest plan within ``budget``, or None."""
    order = list(range(len(g))) if order is None else order
    cands = candidates(g, order)
    best = None
    for k in range(len(cands) + 1):
        for subset in itertools.combinations(cands, k):
            rep = remat_replay(g, order, list(subset))
            if rep.peak <= budget:
                cost = sum(map(_cost, subset))
                if best is None or cost < best[0]:
                    best = (cost, rep.peak, sorted(c.op for c in subset))
    return best
