"""Arena-backed co-execution: planned outputs live in one arena, results stay bit-equal, and
nothing that outlives a step keeps pointing into the arena."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from coexec import Placeholder, runtime
from coexec.arena import is_arena_backed
from examples.programs import LossBranch
from tests.coexec.helpers import assert_same_as_eager


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    return SimpleNamespace(
        model=model,
        opt=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        data=[(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(3)],
        kept=[],
        views=[],
    )


def step(s, i):
    x, y = s.data[i % 3]
    s.opt.zero_grad()
    h = s.model(x)
    loss = F.mse_loss(h, y)
    loss.backward()
    s.opt.step()
    s.kept.append(h)  # an intermediate that escapes the step
    s.views.append(h.detach().numpy())  # a numpy view of it, kept too
    return loss


def test_co_executed_steps_use_the_arena_and_stay_bit_equal():
    ex = runtime.executor()
    hits0 = ex.arena_hits
    tape = assert_same_as_eager(make, step, 8, key="arena-basic")
    assert tape.stats.coexec_steps >= 4
    assert ex.arena_hits - hits0 > 20  # many op results were written in place into the arena
    plan = tape._program.arena_plan
    assert plan.arena_bytes > 0 and plan.fragmentation <= 0.01


def test_values_that_outlive_the_step_do_not_point_into_the_arena():
    s = make()
    tape = coexec.GradientTape(key="arena-escape")
    for i in range(8):
        with tape:
            step(s, i)
    arena = tape._program.arena
    assert arena is not None and tape.stats.coexec_steps >= 4
    for h in s.kept:
        real = h._real if isinstance(h, Placeholder) else h
        assert not is_arena_backed(real, arena)
    ref = make()
    for i in range(8):
        step(ref, i)  # eager: the same values
    assert all(torch.equal(a, b) for a, b in zip(s.kept, ref.kept))
    assert all(np.array_equal(a, b) for a, b in zip(s.views, ref.views))  # later steps did not overwrite them


def test_a_tensor_kept_past_its_last_use_makes_the_allocator_step_in():
    def holding_step(s, i):
        x, y = s.data[i % 3]
        s.opt.zero_grad()
        first = s.model[0](x)
        held = first * 1.0  # planned to die at its last use below...
        h = s.model[2](s.model[1](held))
        loss = F.mse_loss(s.model[4](s.model[3](h)), y)
        if i >= 5:
            s.kept.append(held)  # ...but from step 5 on Python keeps it: its bytes stay taken
        loss.backward()
        s.opt.step()
        return loss

    ex = runtime.executor()
    misses0 = ex.arena_misses
    assert_same_as_eager(make, holding_step, 8, key="arena-held")
    assert ex.arena_misses > misses0  # the run-time check saw the region in use


def test_one_arena_serves_both_paths_of_a_branching_program():
    tape = assert_same_as_eager(lambda: LossBranch(0), lambda p, i: p.step(i), 12, key="arena-branch")
    program = tape._program
    assert len(program.paths) == 2 == len(program.arena_plan.paths)  # each path validated
    report = tape.report(optimize_seconds=2)
    assert len(report) == 2
    for row in report:
        assert row["planned peak"] <= row["issue-order peak"]
        assert row["planned fragmentation"] <= 0.01
        assert row["executed arena"] == program.arena_plan.arena_bytes


def test_a_plan_the_simulator_rejects_is_never_executed(monkeypatch):
    import planner.arena as planner_arena
    from planner.address import Placement

    def overlapping(spans, sizes, conflicts=None, alignment=64):  # everything at offset 0
        return Placement({k: 0 for k in spans}, max(sizes.values(), default=0), "planted")

    monkeypatch.setattr(planner_arena, "greedy_offsets", overlapping)
    ex = runtime.executor()
    hits0 = ex.arena_hits
    import pytest

    with pytest.warns(RuntimeWarning, match="failed validation.*overlap in the arena"):
        tape = assert_same_as_eager(make, step, 6, key="arena-planted")
    assert tape._program.arena_plan is None and tape._program.arena is None
    assert ex.arena_hits == hits0  # nothing was written to an arena
