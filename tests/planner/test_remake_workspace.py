"""A dropped op made again runs its kernel again, with its temporary bytes (a convolution's
columns): the simulator and the solver count them at the remake, beside what is resident then.
Without them a ResNet-50 plan at its smallest feasible budget went 2 MB over on the native
backend (bench/native_budget.py, batch 16)."""

from __future__ import annotations

import pytest

from planner import BudgetTooSmall, plan_remat, replay
from planner.candidates import candidates
from planner.graph import Access, PlanningGraph, StorageFacts

WORK = 60  # the first op's temporary bytes


def chain() -> PlanningGraph:
    """``a = conv(x)`` (with ``WORK`` temporary bytes), ``b = f(a)``, ``c = g(b)``, ``d = h(c, a)``:
    ``a`` may be dropped after ``f`` and made again before ``h``."""
    ops = [
        Access("conv", 1.0, (0,), (), (1,), workspace=WORK),
        Access("f", 1.0, (1,), (), (2,)),
        Access("g", 1.0, (2,), (), (3,)),
        Access("h", 1.0, (3, 1), (), (4,)),
    ]
    storages = [
        StorageFacts(10, True),
        StorageFacts(100, False, released=3),
        StorageFacts(100, False, released=2),
        StorageFacts(100, False, released=3),
        StorageFacts(10, False, alive_at_end=True),
    ]
    return PlanningGraph.from_accesses(ops, storages)


def test_the_simulator_counts_a_remakes_temporary_bytes_at_its_recompute_point() -> None:
    """Kept: a, b and c at g (300, plus x's 10). Dropped: a freed after f and made again before
    h, where c, a and h's d are 210 and the remake's kernel needs 60 more: 280, not 220."""
    g = chain()
    order = list(range(len(g)))
    conv = next(c for c in candidates(g, order) if c.op == 0)
    assert conv.recompute_at == 3
    assert replay(g, order).peak == 310
    dropped = replay(g, order, dropped=[conv])
    assert dropped.live == [100, 200, 200, 210]
    assert (dropped.peak, dropped.peak_at) == (10 + 210 + WORK, 3)


def test_the_solver_counts_them_too() -> None:
    """The solver's floor is the simulator's: 280 is met by dropping a, 279 is too small."""
    g = chain()
    plan = plan_remat(g, 280)
    assert [c.op for c in plan.dropped] == [0] and plan.peak == 280
    with pytest.raises(BudgetTooSmall) as small:
        plan_remat(g, 279)
    assert small.value.smallest == 280
