"""Rematerialization: the simulator against the plain one, the solver against exhaustive search."""

from __future__ import annotations

import random

import pytest

from planner.remat import (
    BudgetTooSmall,
    cost as _cost,
    candidates,
    exhaustive_remat,
    min_feasible_budget,
    plan_remat,
)
from planner.simulate import replay

from tests.planner.helpers import chain_graph, random_graph


def training_graph(rng: random.Random, depth: int, skips: int = 0):
    """A forward chain of ``depth`` ops, a loss, and a backward chain in which backward op i
    reads forward activation i and the gradient before it (the shape of a training step);
    ``skips`` extra forward edges make it a DAG rather than a chain."""
    spec: list[tuple[list[int], int]] = [([], rng.choice([2, 4, 8]))]  # the input batch
    for i in range(1, depth + 1):
        inputs = [i - 1]
        if skips and i >= 3 and rng.random() < skips / depth:
            inputs.append(rng.randrange(1, i - 1))
        spec.append((inputs, rng.choice([1, 2, 3, 5, 8, 13])))
    loss = len(spec)
    spec.append(([depth], 1))
    grad = loss
    for i in range(depth, 0, -1):
        spec.append(([grad, i], rng.choice([1, 2, 3, 5])))
        grad = len(spec) - 1
    g = chain_graph(spec)
    for op in g.ops:
        op.seconds = rng.choice([1, 2, 5, 10]) * 1e-6
    return g


def test_replay_without_drops_is_the_plain_simulator():
    rng = random.Random(0)
    for _ in range(50):
        g = random_graph(rng, rng.randint(2, 12))
        order = list(range(len(g)))
        assert replay(g, order, dropped=[]).peak == replay(g, order).peak


def test_dropping_frees_the_gap_and_recomputes_before_the_next_use():
    # 0 -> 1 -> 2 -> loss 3 -> grads 4 (reads 3, 2), 5 (reads 4, 1), 6 (reads 5, 0)
    g = chain_graph([([], 4), ([0], 8), ([1], 8), ([2], 1), ([3, 2], 2), ([4, 1], 2), ([5, 0], 2)])
    for op in g.ops:
        op.seconds = 3e-6
    order = list(range(len(g)))
    (c1,) = [c for c in candidates(g, order) if c.op == 1]
    assert (c1.free_after, c1.recompute_at, c1.inputs) == (2, 5, (0,))
    rep = replay(g, order, dropped=[c1])
    assert rep.segments[1] == [(1, 2), (5, 5)]
    assert rep.extra_seconds == pytest.approx(3e-6)
    base = replay(g, order, dropped=[])
    assert [b - a for a, b in zip(rep.live, base.live)] == [0, 0, 0, 8, 8, 0, 0]


def ladder():
    """Forward 1, 2, 3, loss 4; backward 5 (reads 3), 6 (reads 2), 7 (reads 1), 8 (reads 0)."""
    return chain_graph(
        [([], 4), ([0], 8), ([1], 8), ([2], 8), ([3], 1), ([4, 3], 2), ([5, 2], 2), ([6, 1], 2), ([7, 0], 2)]
    )


def test_a_dropped_input_is_made_again_where_a_dropped_reader_needs_it():
    g = ladder()
    order = list(range(len(g)))
    by_op = {c.op: c for c in candidates(g, order)}
    assert sorted(by_op) == [0, 1, 2]  # 3 is used right after the loss: no gap to save
    # dropping 2 (recomputed at 6) needs 1 there: 1 is made again at 6, not kept until then
    rep = replay(g, order, dropped=[by_op[1], by_op[2]])
    assert rep.segments[1] == [(1, 2), (6, 7)]
    assert rep.segments[2] == [(2, 3), (6, 6)]
    # dropping only 2 keeps 1 resident through its gap, as it is anyway
    assert replay(g, order, dropped=[by_op[2]]).segments[1] == [(1, 7)]


def test_mutated_ops_are_never_dropped_random_ones_may_be():
    g = ladder()
    order = list(range(len(g)))
    g.ops[1].random = True  # the executor replays it with its RNG state
    assert sorted(c.op for c in candidates(g, order)) == [0, 1, 2]
    g = ladder()
    g.ops[4].writes = [1]  # an in-place update of op 1's output, which op 2 reads
    assert sorted(c.op for c in candidates(g, order)) == [0]
    g = ladder()
    g.ops[2].writes = [0]  # op 2 mutates op 0's output: 0 and 1 (which reads it) neither
    assert sorted(c.op for c in candidates(g, order)) == []
    g = ladder()
    g.storages[2].fetched = True  # Python read op 2's output: it holds it
    assert sorted(c.op for c in candidates(g, order)) == [0, 1]


def with_workspace(g, rng: random.Random):
    """Kernels' temporary bytes on some ops: counted where each runs, and again where a
    dropped one is made again (``planner.candidates.remake_points``)."""
    for op in g.ops:
        op.workspace = rng.choice([0, 0, 2, 5, 9])
    return g


@pytest.mark.parametrize("work", [False, True], ids=["no workspace", "workspace"])
@pytest.mark.parametrize("rows", ["dense", "running"])
@pytest.mark.parametrize("seed", range(12))
def test_plan_matches_exhaustive_search(seed, rows, work, monkeypatch):
    """Optimal against exhaustive search, with the memory rows in either form: every storage
    in play listed (small and mid graphs) or running sums (large ones, forced here), and with
    kernels' temporary bytes."""
    import planner.remat as remat

    if rows == "running":
        monkeypatch.setattr(remat.model, "MAX_DENSE_TERMS", 0)
    rng = random.Random(seed)
    g = training_graph(rng, depth=rng.randint(3, 7), skips=rng.randint(0, 2))
    if work:
        with_workspace(g, rng)
    order = list(range(len(g)))
    cands = candidates(g, order)
    assert 0 < len(cands) <= 12
    base = replay(g, order).peak
    floor = min_feasible_budget(g, order)[0]
    for budget in sorted({floor, (floor + base) // 2, base - 1, base}):
        best = exhaustive_remat(g, budget, order)
        if best is None:
            with pytest.raises(BudgetTooSmall):
                plan_remat(g, budget, order)
            continue
        plan = plan_remat(g, budget, order)
        assert plan.peak <= budget
        assert replay(g, order, dropped=plan.dropped).peak == plan.peak
        assert sum(map(_cost, plan.dropped)) == best[0], (budget, plan.dropped, best)
        assert plan.optimal


@pytest.mark.parametrize("work", [False, True], ids=["no workspace", "workspace"])
@pytest.mark.parametrize("rows", ["dense", "running"])
@pytest.mark.parametrize("seed", range(8))
def test_smallest_feasible_budget_is_exact_and_named(seed, rows, work, monkeypatch):
    import planner.remat as remat

    if rows == "running":
        monkeypatch.setattr(remat.model, "MAX_DENSE_TERMS", 0)
    rng = random.Random(100 + seed)
    g = training_graph(rng, depth=rng.randint(3, 7), skips=rng.randint(0, 2))
    if work:
        with_workspace(g, rng)
    order = list(range(len(g)))
    cands = candidates(g, order)
    brute = min(
        replay(g, order, dropped=[c for k, c in enumerate(cands) if mask >> k & 1]).peak
        for mask in range(1 << len(cands))
    )
    smallest, choice = min_feasible_budget(g, order)
    assert smallest == brute == replay(g, order, dropped=choice).peak
    assert plan_remat(g, smallest, order).peak <= smallest
    with pytest.raises(BudgetTooSmall, match=f"smallest feasible budget for this step is .*{smallest} bytes") as err:
        plan_remat(g, smallest - 1, order)
    assert err.value.smallest == smallest



def test_a_solver_that_finds_nothing_in_time_falls_back_to_the_lowest_peak_plan(monkeypatch):
    """Near the smallest feasible budget the greedy may fail and CP-SAT may time out before a
    first solution: the plan of the lowest peak is used if it fits, and an error names it only
    if it does not (never an error naming a "smallest" budget at or below the one asked)."""
    from ortools.sat.python import cp_model

    import planner.remat as remat

    g = training_graph(random.Random(3), depth=6)
    order = list(range(len(g)))
    smallest, _ = min_feasible_budget(g, order)
    assert smallest < replay(g, order).peak
    real_solve = remat.Model.solve

    def nothing_in_time(self, time_limit, hint, workers=8):
        if "peak" in {v.name for v in self.model.Proto().variables}:  # min_feasible_budget's model
            return real_solve(self, time_limit, hint, workers)
        return None, cp_model.UNKNOWN, None

    monkeypatch.setattr(remat, "greedy", lambda *args: None)
    monkeypatch.setattr(remat.Model, "solve", nothing_in_time)
    plan = plan_remat(g, smallest, order)
    assert plan.method == "lowest-peak" and plan.peak <= smallest
    assert replay(g, order, dropped=plan.dropped).peak == plan.peak
    with pytest.raises(BudgetTooSmall, match=f"\\({smallest} bytes\\)"):
        plan_remat(g, smallest - 1, order)


def test_long_chains_of_dropped_readers_build_without_recursion(monkeypatch):
    """A deep network's chain of dropped readers is as long as the network: the model's
    literals for it must not recurse (a 1000-layer chain overflowed Python's stack)."""
    import inspect
    import sys

    from ortools.sat.python import cp_model  # noqa: F401 - imported before the limit drops

    import planner.remat as remat
    from planner.remat import RematPath, _allowed_candidates
    from planner.remat.model import Model as _Model

    monkeypatch.setattr(remat.model, "MAX_CASCADE_PAIRS", 10**9)  # chains as long as the network

    g = training_graph(random.Random(0), depth=150)
    paths = [RematPath(g, list(range(len(g))))]
    per = _allowed_candidates(paths, set())
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 100)  # less than the chain is long
    try:
        model = _Model(paths, per, [[]])
    finally:
        sys.setrecursionlimit(limit)
    assert len(model.rows) > 150 and len(model.decisions) == len(per[0])
    assert model.chain_span is None and model.cascades[0].pairs() > 150 * 149 // 2 // 2


def test_the_simulator_follows_long_chains_of_dropped_readers_without_recursion():
    """The same chains in the simulator (replay): every forward activation dropped,
    under a recursion limit shorter than the chain."""
    import inspect
    import sys

    g = training_graph(random.Random(0), depth=150)
    order = list(range(len(g)))
    dropped = candidates(g, order)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 100)  # less than the chain is long
    try:
        rep = replay(g, order, dropped=dropped)
    finally:
        sys.setrecursionlimit(limit)
    assert rep.peak < replay(g, order).peak and rep.extra_seconds == sum(c.seconds for c in dropped)


def _reach_of_chains(cands, dropped: set[int]) -> dict[int, int]:
    """For each dropped candidate, the rank (in the order) of the last candidate on a chain
    of dropped readers from it: what the model's span cap bounds."""
    from planner.candidates import Cascade

    cascade = Cascade(cands)
    far: dict[int, int] = {}
    for c in sorted(cands, key=lambda c: -c.at):
        if c.op in dropped:
            far[c.op] = max([cascade.rank[c.op], *(far[d] for d in cascade.readers[c.op] if d in dropped)])
    return far


@pytest.mark.parametrize("seed", range(6))
def test_a_capped_model_is_optimal_among_plans_within_its_span(seed, monkeypatch):
    """Past MAX_CASCADE_PAIRS the model lets a chain of dropped readers reach only so many
    candidates ahead, so that it grows linearly with the graph. Forced onto small graphs (span
    2), the solver's plan must respect the cap and cost exactly the cheapest plan, by
    exhaustive search, among those that respect it; the smallest budget likewise. (The greedy
    warm start knows no cap: its plan, replayed exactly, is kept when it costs no more.)"""
    import itertools

    import planner.remat as remat

    monkeypatch.setattr(remat.model, "MAX_CASCADE_PAIRS", 1)
    monkeypatch.setattr(remat.model, "MIN_SPAN", 2)
    rng = random.Random(300 + seed)
    g = training_graph(rng, depth=rng.randint(6, 9), skips=rng.randint(0, 2))
    order = list(range(len(g)))
    cands = candidates(g, order)
    rank = {c.op: i for i, c in enumerate(cands)}

    def within(subset) -> bool:
        far = _reach_of_chains(cands, {c.op for c in subset})
        return all(far[c.op] - rank[c.op] <= 2 for c in subset)

    plans = [
        (replay(g, order, dropped=list(s)).peak, sum(map(_cost, s)))
        for k in range(len(cands) + 1)
        for s in itertools.combinations(cands, k)
        if within(s)
    ]
    smallest, choice = min_feasible_budget(g, order)
    assert smallest == min(peak for peak, _ in plans) and within(choice)
    base = replay(g, order).peak
    for budget in sorted({smallest, (smallest + base) // 2, base - 1}):
        plan = plan_remat(g, budget, order)
        assert plan.peak == replay(g, order, dropped=plan.dropped).peak <= budget
        cheapest = min(cost for peak, cost in plans if peak <= budget)
        if plan.method == "greedy":
            assert sum(map(_cost, plan.dropped)) <= cheapest
        else:
            assert plan.method == "cp-sat" and within(plan.dropped)
            assert sum(map(_cost, plan.dropped)) == cheapest


def test_a_large_graph_gets_a_model_linear_in_its_size_and_a_valid_plan(monkeypatch):
    """Past MAX_CASCADE_PAIRS the chains are capped and (past MAX_DENSE_TERMS, forced here)
    the rows are running sums: doubling the graph doubles the model's terms (dense rows and
    uncapped chains would quadruple them), and its plans are still within budget by the exact
    simulator, reaching well below the unbudgeted peak."""
    import planner.remat as remat
    from planner.remat import RematPath, _allowed_candidates
    from planner.remat.model import Model as _Model

    monkeypatch.setattr(remat.model, "MAX_DENSE_TERMS", 0)

    def model_terms(depth: int) -> tuple[int, _Model]:
        g = training_graph(random.Random(0), depth=depth, skips=depth // 10)
        paths = [RematPath(g, list(range(len(g))))]
        model = _Model(paths, _allowed_candidates(paths, set()), [[]])
        assert model.fit(replay(g, paths[0].order).peak // 2)
        return sum(len(c.linear.vars) for c in model.model.Proto().constraints), model

    small, _ = model_terms(300)
    large, model = model_terms(600)
    assert large < 2.3 * small
    assert model.chain_span == remat.model.MAX_CASCADE_PAIRS // 600 and model.cascades[0].pairs() <= remat.model.MAX_CASCADE_PAIRS
    g = training_graph(random.Random(0), depth=400, skips=40)
    order = list(range(len(g)))
    base = replay(g, order).peak
    smallest, dropped = min_feasible_budget(g, order, time_limit=10)
    assert smallest == replay(g, order, dropped=dropped).peak < base // 2
    plan = plan_remat(g, (smallest + base) // 2, order, time_limit=10)
    assert plan.peak == replay(g, order, dropped=plan.dropped).peak <= (smallest + base) // 2
