"""Arena addresses under recomputation and offloading: a storage resident in several stretches
keeps one offset, its bytes are free for others between its stretches, and the simulator
rejects an arena where storages resident at the same time overlap."""

from __future__ import annotations

import random

import pytest

from planner.arena import plan_arena
from planner.graph import LOCAL
from planner.remat import (
    RematPath,
    cost as _cost,
    bound_of,
    candidates,
    exhaustive_remat,
    min_feasible_budget_paths,
    plan_remat_paths,
)
from planner.simulate import InvalidPlan, check_stretches, replay
from tests.planner.helpers import chain_graph
from tests.planner.test_remat import training_graph

# 0 -> 1 -> 2 -> loss 3 -> grads 4 (reads 3, 2), 5 (reads 4, 1), 6 (reads 5, 0)
SPEC = [([], 64), ([0], 512), ([1], 512), ([2], 64), ([3, 2], 128), ([4, 1], 128), ([5, 0], 128)]


def test_a_dropped_storage_leaves_its_bytes_to_others_until_it_is_made_again():
    g = chain_graph(SPEC)
    order = list(range(len(g)))
    keys = {sid: sid for sid in g.storages}
    (c1,) = [c for c in candidates(g, order) if c.op == 1]
    rep = replay(g, order, dropped=[c1])
    assert rep.segments[1] == [(1, 2), (5, 5)]
    plain = plan_arena([(g, keys)])
    dropped = plan_arena([(g, keys)], stretches=[rep.segments])
    # without the drop, 1 (512 B) is co-resident with everything but 6; with it, the loss 3
    # (resident at 3..4 only, inside 1's gap) may take its bytes
    assert plain.arena_bytes == 64 + 512 + 512 + 64 + 128
    assert dropped.offsets[1] <= dropped.offsets[3] < dropped.offsets[1] + 512
    assert dropped.local_peak <= dropped.arena_bytes < plain.arena_bytes
    # the recomputed stretch of 1 comes back to the same bytes, after 4 is gone
    local = {s: spans for s, spans in rep.segments.items() if s in dropped.offsets}  # 6 escapes
    assert check_stretches(g, local, dropped.offsets) <= dropped.arena_bytes


def test_storages_resident_at_once_in_the_same_bytes_are_rejected():
    g = chain_graph(SPEC)
    stretches = {1: [(1, 2), (5, 5)], 5: [(5, 6)]}
    with pytest.raises(InvalidPlan, match="storages 1 and 5 are live at the same time"):
        check_stretches(g, stretches, {1: 0, 5: 256})
    assert check_stretches(g, stretches, {1: 0, 5: 512}) == 640
    with pytest.raises(InvalidPlan, match="reach byte 640 of an arena of 600"):
        check_stretches(g, stretches, {1: 0, 5: 512}, arena_bytes=600)


@pytest.mark.parametrize("seed", range(20))
def test_an_arena_over_any_drops_is_valid_and_no_smaller_than_what_it_holds(seed):
    rng = random.Random(seed)
    g = training_graph(rng, depth=rng.randint(3, 8), skips=rng.randint(0, 2))
    for s in g.storages.values():
        s.nbytes *= 64  # whole alignment units: the arena's lower bound is exact
    order = list(range(len(g)))
    cands = candidates(g, order)
    dropped = [c for c in cands if rng.random() < 0.5]
    rep = replay(g, order, dropped=dropped)
    keys = {sid: sid for sid in g.storages}
    plan = plan_arena([(g, keys)], stretches=[rep.segments])
    local = {sid: spans for sid, spans in rep.segments.items() if sid in plan.offsets}
    check_stretches(g, local, {sid: plan.offsets[sid] for sid in local}, plan.arena_bytes)
    assert plan.local_peak <= plan.arena_bytes <= sum(plan.sizes.values())
    escaping = sum(g.storages[s].nbytes for s in rep.segments if s not in plan.offsets)
    assert plan.local_peak <= max(rep.live) and max(rep.live) <= plan.local_peak + escaping


def _bound(path, plan) -> int:
    return bound_of([path], [replay(path.g, path.order, dropped=plan.dropped, offloaded=plan.offloaded)])


@pytest.mark.parametrize("rows", ["dense", "running"])
@pytest.mark.parametrize("seed", range(12))
def test_a_plan_with_an_arena_matches_exhaustive_search(seed, rows, monkeypatch):
    """With an arena, a plan needs persistent state + the whole arena (the most placed bytes
    at once) + the rest at every moment; the solver's cheapest plan within a budget, and its
    smallest budget, equal exhaustive search's under that bound (memory rows in either form)."""
    import planner.remat as remat

    if rows == "running":
        monkeypatch.setattr(remat.model, "MAX_DENSE_TERMS", 0)
    rng = random.Random(100 + seed)
    g = training_graph(rng, depth=rng.randint(3, 6), skips=rng.randint(0, 2))
    order = list(range(len(g)))
    local = [sid for sid, s in g.storages.items() if s.kind == LOCAL]
    placed = frozenset(sid for sid in local if rng.random() < 0.7)
    path = RematPath(g, order, placed=placed)
    base = bound_of([path], [replay(g, order, dropped=[])])
    assert base >= replay(g, order, dropped=[]).peak
    floor = min_feasible_budget_paths([path])[0]
    assert exhaustive_remat(g, floor, order, placed=placed) is not None
    assert exhaustive_remat(g, floor - 1, order, placed=placed) is None
    for budget in sorted({floor, (floor + base) // 2, base - 1, base}):
        best = exhaustive_remat(g, budget, order, placed=placed)
        plan = plan_remat_paths([path], budget)[0]
        assert _bound(path, plan) <= budget
        assert sum(map(_cost, plan.dropped)) == best[0], (budget, plan.dropped, best)
