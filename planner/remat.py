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

What may be dropped (:func:`candidates`): ops that allocate only local storages, mutate nothing,
whose outputs nobody mutates later, whose inputs nobody mutates before the recompute point, and
that are not random (recomputing those needs the RNG state saved: not done yet).
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from .graph import ESCAPING, LOCAL, PERSISTENT, PlanningGraph

MICROSECOND = 1e-6  # cost unit of the CP-SAT objective; every recomputation costs at least one


class BudgetTooSmall(ValueError):
    """No plan fits the budget; ``smallest`` is the lowest peak (bytes) any plan reaches."""

    def __init__(self, budget: int, smallest: int, detail: str = "") -> None:
        self.budget = budget
        self.smallest = smallest
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
    """The ops that may be dropped in ``order``, each with its gap (see the module docstring)."""
    pos = {v: i for i, v in enumerate(order)}
    written_at: dict[int, list[int]] = {}
    for v, op in enumerate(g.ops):
        for sid in op.writes:
            written_at.setdefault(sid, []).append(pos[v])
    out = []
    for v in order:
        op = g.ops[v]
        if op.random or op.writes or not op.allocates:
            continue
        made = [g.storages[s] for s in op.allocates]
        if any(s.kind != LOCAL or s.nbytes <= 0 or written_at.get(s.sid) for s in made):
            continue
        uses = sorted({pos[u] for s in made for u in s.uses})
        if len(uses) < 2:
            continue
        a, b = max(zip(uses, uses[1:]), key=lambda ab: (ab[1] - ab[0], -ab[0]))
        if b - a < 2:
            continue
        reads = [s for s in op.uses if s not in op.allocates]
        if any(a_ <= p < b for s in reads for p in written_at.get(s, ()) for a_ in (pos[v],)):
            continue
        inputs = tuple(s for s in reads if g.storages[s].kind != PERSISTENT)
        out.append(
            Candidate(v, tuple(op.allocates), sum(s.nbytes for s in made), op.seconds, a, b, inputs)
        )
    return out


Term = tuple  # ("keep", c) | ("drop", d) | ("drop-keep", d, c): c, d are candidate op indices


def _holds(term: Term, dropped: set[int]) -> bool:
    if term[0] == "keep":
        return term[1] not in dropped
    if term[0] == "drop":
        return term[1] in dropped
    return term[1] in dropped and term[2] not in dropped


def _residency(g: PlanningGraph, order: list[int], cands: list[Candidate]):
    """For every planned storage, ``(sid, start, stop, terms)`` pieces covering positions
    ``[start, stop)``: resident throughout when ``terms`` is None, else resident iff one of the
    terms holds for the chosen drops. The one statement of the semantics, shared by the
    simulator and the solver so that they cannot disagree:

    a storage is resident at ``t`` when it exists (made at its producer, made again at the
    recompute point ``r`` if its op is dropped) and is needed at some ``p >= t`` by that same
    instance; needs are its uses and the recompute points of dropped ops that read it; a
    remade storage is resident at ``r`` even when nothing needs it (multi-output ops)."""
    n = len(order)
    pos = {v: i for i, v in enumerate(order)}
    owner = {s: c for c in cands for s in c.storages}
    extra: dict[int, list[tuple[int, int]]] = {}
    for c in cands:
        for s in c.inputs:
            extra.setdefault(s, []).append((c.recompute_at, c.op))
    for s in g.storages.values():
        if s.kind == PERSISTENT:
            continue
        first = pos[s.producer]
        base = sorted({pos[u] for u in s.uses} | {first})
        c = owner.get(s.sid)
        xs = extra.get(s.sid, [])
        if s.kind == ESCAPING or (c is None and not xs):
            yield s.sid, first, (n if s.kind == ESCAPING else base[-1] + 1), None
            continue
        r = c.recompute_at if c else None
        horizon = max([base[-1], *(p for p, _ in xs), *([r] if c else [])])
        cuts = {first, horizon + 1, *(p + 1 for p in base), *(p + 1 for p, _ in xs)}
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
                    terms = {("drop", d) for p, d in xs if a <= p < r}
                    if base[-1] >= r:
                        terms.add(("keep", c.op))
                    else:
                        terms |= {("drop-keep", d, c.op) for p, d in xs if p >= r}
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
    remade_at = {s: c.recompute_at for c in dropped for s in c.storages}
    delta = [0] * (n + 1)
    segments: dict[int, list[tuple[int, int]]] = {}
    for sid, a, b, terms in _residency(g, order, dropped):
        if terms is not None and not any(_holds(t, chosen) for t in terms):
            continue
        size = g.storages[sid].nbytes
        delta[a] += size
        delta[b] -= size
        segs = segments.setdefault(sid, [])
        if segs and segs[-1][1] == a - 1 and a != remade_at.get(sid):
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


class _Model:
    """The CP-SAT model: drop literals, memory constraints grouped by the decisions in play."""

    def __init__(self, g: PlanningGraph, order: list[int], cands: list[Candidate]) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.model = cp_model.CpModel()
        self.cands = cands
        self.drop = {c.op: self.model.NewBoolVar(f"drop{c.op}") for c in cands}
        n = len(order)
        fixed = [g.ops[order[i]].workspace for i in range(n)]
        delta = [0] * (n + 1)
        # terms[t]: {sid: terms} for storages whose residency at t depends on the decisions
        terms: list[dict[int, frozenset]] = [dict() for _ in range(n)]
        for sid, a, b, ts in _residency(g, order, cands):
            if ts is None:
                delta[a] += g.storages[sid].nbytes
                delta[b] -= g.storages[sid].nbytes
            else:
                for t in range(a, b):
                    terms[t][sid] = ts
        run = 0
        for i in range(n):
            run += delta[i]
            fixed[i] += run
        self.persistent = g.persistent_bytes
        self.sizes = {s.sid: s.nbytes for s in g.storages.values()}
        groups: dict[tuple, int] = {}
        for t in range(n):
            key = tuple(sorted((sid, tuple(sorted(ts))) for sid, ts in terms[t].items()))
            groups[key] = max(groups.get(key, 0), fixed[t])
        self.groups = groups
        self._live: dict[tuple, object] = {}

    def _resident(self, sid: int, ts: tuple):
        """A literal that is true when one of the terms holds (the solver keeps it false
        otherwise, as it only ever tightens the memory rows)."""
        if len(ts) == 1 and ts[0][0] != "drop-keep":
            kind, op = ts[0]
            return self.drop[op].Not() if kind == "keep" else self.drop[op]
        key = (sid, ts)
        if key not in self._live:
            var = self.model.NewBoolVar(f"live{sid}")
            for term in ts:
                if term[0] == "keep":
                    self.model.AddImplication(self.drop[term[1]].Not(), var)
                elif term[0] == "drop":
                    self.model.AddImplication(self.drop[term[1]], var)
                else:
                    self.model.Add(var >= self.drop[term[1]] - self.drop[term[2]])
            self._live[key] = var
        return self._live[key]

    def memory_rows(self):
        """(fixed bytes, [(bytes, literal)]) for each group of positions."""
        for key, base in self.groups.items():
            yield self.persistent + base, [(self.sizes[sid], self._resident(sid, ts)) for sid, ts in key]

    def solve(self, time_limit: float, hint: list[Candidate] | None, workers: int = 8):
        if hint is not None:
            chosen = {c.op for c in hint}
            for op, var in self.drop.items():
                self.model.AddHint(var, op in chosen)
        solver = self.cp.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.1, time_limit)
        solver.parameters.num_workers = workers
        status = solver.Solve(self.model)
        return solver, status


def _fit(model: _Model, budget: int) -> bool:
    """Add the budget rows; False when a row cannot hold whatever is dropped."""
    for base, terms in model.memory_rows():
        if base > budget:
            return False
        if base + sum(size for size, _ in terms) > budget:
            model.model.Add(sum(size * lit for size, lit in terms) <= budget - base)
    return True


def min_feasible_budget(
    g: PlanningGraph, order: list[int] | None = None, time_limit: float = 20.0
) -> tuple[int, list[Candidate]]:
    """The lowest peak reachable by dropping candidates, and a choice that reaches it (proven
    lowest unless the solver ran out of time: then an upper bound that is still achievable)."""
    order = list(range(len(g))) if order is None else order
    cands = candidates(g, order)
    everything = remat_replay(g, order, cands)
    if not cands:
        return everything.peak, []
    model = _Model(g, order, cands)
    peak = model.model.NewIntVar(0, everything.peak + remat_replay(g, order, []).peak, "peak")
    for base, terms in model.memory_rows():
        model.model.Add(base + sum(size * lit for size, lit in terms) <= peak)
    model.model.Minimize(peak)
    solver, status = model.solve(time_limit, None)
    best = cands if everything.peak <= remat_replay(g, order, []).peak else []
    best_peak = remat_replay(g, order, best).peak
    if status in (model.cp.OPTIMAL, model.cp.FEASIBLE):
        chosen = [c for c in cands if solver.Value(model.drop[c.op])]
        rep = remat_replay(g, order, chosen)
        if rep.peak <= best_peak:
            best, best_peak = chosen, rep.peak
    return best_peak, best


def plan_remat(
    g: PlanningGraph,
    budget: int,
    order: list[int] | None = None,
    time_limit: float = 30.0,
) -> RematPlan:
    """Meet ``budget`` (bytes at the peak, persistent state included) in ``order`` at the least
    added recompute time; raises :class:`BudgetTooSmall` naming the smallest feasible budget."""
    t0 = time.perf_counter()
    order = list(range(len(g))) if order is None else order
    base = remat_replay(g, order, [])
    if base.peak <= budget:
        return RematPlan(order, [], base.peak, base.peak, budget, 0.0, "none", time.perf_counter() - t0, 0.0)
    cands = candidates(g, order)
    warm = _greedy(g, order, cands, budget)
    model = _Model(g, order, cands) if cands else None
    if model is None or not _fit(model, budget):
        smallest, _ = min_feasible_budget(g, order, time_limit=max(1.0, time_limit / 2))
        raise BudgetTooSmall(budget, smallest)
    model.model.Minimize(sum(_cost(c) * model.drop[c.op] for c in cands))
    left = time_limit - (time.perf_counter() - t0)
    solver, status = model.solve(left, warm)
    method, gap, chosen = "greedy", None, warm
    if status in (model.cp.OPTIMAL, model.cp.FEASIBLE):
        found = [c for c in cands if solver.Value(model.drop[c.op])]
        if warm is None or sum(map(_cost, found)) <= sum(map(_cost, warm)):
            chosen = found
            method = "cp-sat" if status == model.cp.OPTIMAL else "cp-sat-timeout"
        obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
        gap = 0.0 if status == model.cp.OPTIMAL else (obj - bound) / obj if obj else 0.0
    elif status == model.cp.INFEASIBLE:
        smallest, _ = min_feasible_budget(g, order, time_limit=max(1.0, time_limit / 2))
        raise BudgetTooSmall(budget, smallest)
    if chosen is None:
        smallest, _ = min_feasible_budget(g, order, time_limit=max(1.0, time_limit / 2))
        raise BudgetTooSmall(budget, smallest, "the solver found no plan within its time limit")
    chosen = sorted(chosen, key=lambda c: (c.recompute_at, c.op))
    rep = remat_replay(g, order, chosen)
    assert rep.peak <= budget, "a remat plan over its budget (planner bug)"
    return RematPlan(
        order, chosen, rep.peak, base.peak, budget, rep.extra_seconds, method,
        time.perf_counter() - t0, gap,
    )  # fmt: skip


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
