"""Rematerialization under a memory budget: which activations to free and recompute.

The model (a Checkmate/Rockmate-style choice, restricted so that it stays exact and linear):
for a fixed op order, each *candidate* op may be **dropped**: the storages it allocates are
freed after the last use before their longest idle stretch (the *gap*, typically forward to
backward) and the op is run again just before the first use after it. Re-running needs the op's
inputs, so a drop extends their lifetimes to the recompute point (possibly through their own
gap, when an input is dropped too). Each op is kept or dropped, nothing else, and everything
follows from that choice:

* :func:`planner.simulate.replay`, the simulator, gives a plan's exact live bytes at every
  position (the recomputations before an op count together with it), the peak, the added
  seconds;
* :func:`plan_remat` meets a budget at the least added time: a greedy (best bytes per
  recomputed second at the current peak, then undo what is not needed) warm-starts a CP-SAT
  model whose memory constraints are grouped by the set of decisions that matter at each
  position; the result is replayed, so it is always valid. CP-SAT proves optimality within this
  model on small and mid-sized graphs (``tests/planner/test_remat.py`` checks it against
  exhaustive search); when it runs out of time the best plan found is returned with its gap;
* :func:`min_feasible_budget` is the lowest peak any choice reaches: the number a
  :class:`BudgetTooSmall` error names.

Lifetimes are the simulator's (a storage is held until the executor knows Python let go of
it: budget plans run in the issue order, hearing of it the sweep lag late), and what may be
dropped is :func:`planner.candidates.candidates`. The module layout: ``paths`` (what a plan
covers and costs), ``greedy`` (the warm start), ``model`` (CP-SAT), ``oracle`` (exhaustive
search, for tests), and here the planning itself.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

from ..candidates import Candidate, candidates
from ..errors import OFFLOAD_FLOOR_NOTE, BudgetTooSmall
from ..graph import PlanningGraph
from ..offload import Bandwidth, OffloadCandidate, offload_candidates
from ..simulate import Replay, replay
from .greedy import greedy
from .model import Model
from .oracle import exhaustive_remat
from .paths import (
    OFFLOAD_COST, RematPath, RematPlan, bound_of, cost, offload_key, predict, resident_split, split_peaks,
)  # fmt: skip

__all__ = [
    "BudgetTooSmall", "Candidate", "OFFLOAD_COST", "RematPath", "RematPlan", "bound_of",
    "candidates", "cost", "exhaustive_remat", "min_feasible_budget", "min_feasible_budget_paths",
    "offload_key", "offload_window", "plan_remat", "plan_remat_paths", "resident_split", "split_peaks",
]  # fmt: skip


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


def _chosen(p: RematPath, cands: list[Candidate], offs: list[OffloadCandidate], chosen: set):
    dropped = sorted((c for c in cands if p.key(c.op) in chosen), key=lambda c: (c.recompute_at, c.op))
    return dropped, [o for o in offs if offload_key(p, o) in chosen]


def _replays(paths: list[RematPath], per, offs, chosen: set) -> list[Replay]:
    out = []
    for p, cands, os in zip(paths, per, offs):
        dropped, offloaded = _chosen(p, cands, os, chosen)
        out.append(replay(p.g, p.order, dropped=dropped, offloaded=offloaded, check_order=False))
    return out


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
    model = Model(paths, per, offs) if everything or any(offs) else None
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
    bases = [replay(p.g, p.order, check_order=False) for p in paths]
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
        found = greedy(p.g, p.order, cands, budget)
        warm = None if found is None or warm is None else warm | {p.key(c.op) for c in found}
    if warm is not None and bound_of(paths, _replays(paths, per, offs, warm)) > budget:
        warm = None
    model = Model(paths, per, offs)
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
    banned: set = frozenset(),
) -> RematPlan:
    """:func:`plan_remat_paths` for one graph (``banned``: ops by index that may not be dropped)."""
    path = RematPath(g, list(range(len(g))) if order is None else order)
    return plan_remat_paths([path], budget, time_limit, banned, bandwidth)[0]
