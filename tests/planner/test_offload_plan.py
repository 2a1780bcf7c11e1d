"""Offloading in the plan: windows from the bandwidth, exact residency, the combined
keep/drop/offload choice against exhaustive search, and the predicted step time."""

from __future__ import annotations

import random

import pytest

from planner.offload import Bandwidth, offload_candidates, predict_seconds
from planner.remat import (
    OFFLOAD_COST,
    BudgetTooSmall,
    cost as _cost,
    candidates,
    exhaustive_remat,
    min_feasible_budget,
    plan_remat,
)
from planner.simulate import replay
from tests.planner.test_remat import ladder, training_graph

BW = Bandwidth(8e6, 8e6)  # 8 bytes per microsecond each way


def timed_ladder():
    g = ladder()
    for op in g.ops:
        op.seconds = 1e-6
    return g, list(range(len(g)))


def test_windows_follow_the_bandwidth():
    g, order = timed_ladder()
    by_sid = {o.sid: o for o in offload_candidates(g, order, BW)}
    # storage 1 (8 bytes, 1 us each way): used at 1, 2 and 7; out during op 3, back during op 6
    o = by_sid[1]
    assert (o.start, o.released, o.prefetch, o.use) == (2, 3, 6, 7)
    assert list(o.off) == [4, 5]
    # storage 2 is idle from 3 to 6: no room for both copies, so it is no candidate
    assert 2 not in by_sid
    # at half the bandwidth each copy of storage 1 needs two ops: nothing is left between
    slow = {o.sid: o for o in offload_candidates(g, order, Bandwidth(4e6, 4e6))}
    assert 1 not in slow
    assert (slow[0].start, slow[0].released, slow[0].prefetch, slow[0].use) == (1, 2, 7, 8)


def test_an_offloaded_storage_is_off_the_device_between_its_windows():
    g, order = timed_ladder()
    o = {o.sid: o for o in offload_candidates(g, order, BW)}[1]
    rep = replay(g, order, dropped=[], offloaded=[o])
    assert rep.segments[1] == [(1, 3), (6, 7)]
    base = replay(g, order, dropped=[])
    assert [b - a for a, b in zip(rep.live, base.live)] == [0, 0, 0, 0, 8, 8, 0, 0, 0]


def test_an_offloaded_input_of_a_dropped_op_recomputed_while_parked_is_refused():
    g, order = timed_ladder()
    o0 = {o.sid: o for o in offload_candidates(g, order, BW)}[0]
    c1 = {c.op: c for c in candidates(g, order)}[1]  # reads storage 0, recomputed at 7
    assert c1.recompute_at in o0.off or c1.recompute_at == o0.use - 1
    if c1.recompute_at in o0.off:
        with pytest.raises(ValueError, match="needed while parked"):
            replay(g, order, dropped=[c1], offloaded=[o0])


@pytest.mark.parametrize("rows", ["dense", "running"])
@pytest.mark.parametrize("seed", range(10))
def test_combined_plan_matches_exhaustive_search(seed, rows, monkeypatch):
    import planner.remat as remat

    if rows == "running":  # the memory rows of large graphs, forced
        monkeypatch.setattr(remat.model, "MAX_DENSE_TERMS", 0)
    rng = random.Random(seed)
    g = training_graph(rng, depth=rng.randint(3, 6), skips=rng.randint(0, 2))
    order = list(range(len(g)))
    bw = Bandwidth(rng.choice([2e6, 4e6, 8e6]), rng.choice([2e6, 4e6, 8e6]))
    offs = offload_candidates(g, order, bw)
    assert len(candidates(g, order)) + len(offs) <= 14
    base = replay(g, order).peak
    floor = min_feasible_budget(g, order, bandwidth=bw)[0]
    assert floor <= min_feasible_budget(g, order)[0]
    for budget in sorted({floor, (floor + base) // 2, base - 1}):
        best = exhaustive_remat(g, budget, order, bw)
        if best is None:
            with pytest.raises(BudgetTooSmall):
                plan_remat(g, budget, order, bandwidth=bw)
            continue
        plan = plan_remat(g, budget, order, bandwidth=bw)
        assert plan.peak <= budget and plan.optimal
        assert replay(g, order, dropped=plan.dropped, offloaded=plan.offloaded).peak == plan.peak
        cost = sum(map(_cost, plan.dropped)) + OFFLOAD_COST * len(plan.offloaded)
        assert cost == best[0], (budget, plan.dropped, plan.offloaded, best)


def test_offloading_lowers_the_floor_where_recomputation_cannot_help():
    # op 2 reads storage 1, which op 4 writes later: 2 can never be recomputed, only parked
    g, order = timed_ladder()
    g.ops[4].writes = [1]
    remat_floor = min_feasible_budget(g, order)[0]
    floor = min_feasible_budget(g, order, bandwidth=BW)[0]
    assert floor < remat_floor


def test_offloading_never_names_a_floor_above_recomputation_s_even_when_its_solve_times_out(monkeypatch):
    """The model with offloads is larger and may run out of time before it finds the low
    plans (ResNet-50 once named 323 MB with offloading against 284 MB without): the
    recompute-only floor is found first and offloading starts from it."""
    from ortools.sat.python import cp_model

    import planner.remat as remat

    g = training_graph(random.Random(7), depth=7, skips=1)
    order = list(range(len(g)))
    remat_floor = min_feasible_budget(g, order)[0]
    assert remat_floor < replay(g, order).peak
    real_solve = remat.Model.solve

    def offloads_time_out(self, time_limit, hint, workers=8):
        if self.off:
            return None, cp_model.UNKNOWN, None
        return real_solve(self, time_limit, hint, workers)

    monkeypatch.setattr(remat.Model, "solve", offloads_time_out)
    assert offload_candidates(g, order, BW)
    assert min_feasible_budget(g, order, bandwidth=BW)[0] == remat_floor


def test_predicted_time_counts_recomputation_and_waits_for_slow_copies():
    g, order = timed_ladder()
    assert predict_seconds(g, order, {}, []) == (pytest.approx(9e-6), 0.0)
    assert predict_seconds(g, order, {7: 2e-6}, [])[0] == pytest.approx(11e-6)
    o = {o.sid: o for o in offload_candidates(g, order, BW)}[1]
    assert predict_seconds(g, order, {}, [o]) == (pytest.approx(9e-6), 0.0)  # copies overlap
    # the same windows on a channel four times slower: each copy makes the compute wait
    slow = offload_candidates(g, order, BW)[0].__class__(**{**o.__dict__, "out_seconds": 4e-6, "in_seconds": 4e-6})
    seconds, stalled = predict_seconds(g, order, {}, [slow])
    assert stalled == pytest.approx(6e-6) and seconds == pytest.approx(15e-6)


def test_a_budget_too_small_with_offloading_says_its_floor_rests_on_measured_times():
    g, order = timed_ladder()
    with pytest.raises(BudgetTooSmall, match="leave some headroom"):
        plan_remat(g, 1, order, bandwidth=BW)
    with pytest.raises(BudgetTooSmall) as err:
        plan_remat(g, 1, order)
    assert "headroom" not in str(err.value)
