"""Arena-backed co-execution: planned outputs live in one arena, results stay bit-equal, and
nothing that outlives a step keeps pointing into the arena."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from coexec import Placeholder, runtime
from coexec.arena import is_arena_backed
from examples.programs import LossBranch
from tests.coexec.helpers import assert_same_as_eager


@pytest.fixture(autouse=True)
def arena_in_use(monkeypatch, plans_in_this_process):
    """These tests are about the runtime's arena: every storage an op can write in place goes
    into it, even where the plan would hold a little more than eager with it (64-byte
    alignment on these small steps) and so would do without one."""
    import planner.program

    monkeypatch.setattr(planner.program, "_over_eager", lambda schedule: False)
    monkeypatch.setattr(
        planner.program, "select_placed", lambda paths, **kw: {k for _g, ks, _s in paths for k in ks.values()}
    )


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
    hits0 = ex.stats().arena_hits
    tape = assert_same_as_eager(make, step, 8, key="arena-basic")
    assert tape.stats.coexec_steps >= 4
    assert ex.stats().arena_hits - hits0 > 20  # many op results were written in place into the arena
    plan = tape._program.schedule
    assert plan.arena_bytes > 0 and plan.fragmentation <= 0.01


def test_values_that_outlive_the_step_do_not_point_into_the_arena():
    s = make()
    tape = coexec.GradientTape(backend="interpret", key="arena-escape")
    for i in range(8):
        with tape:
            step(s, i)
        coexec.wait_for_plans()  # the next step runs on the plan this one asked for
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
    # (every storage goes in: the kept tensor's bytes are planned for another)
    def holding_step(s, i):
        x, y = s.data[i % 3]
        s.opt.zero_grad()
        first = s.model[0](x)
        held = first * 1.0  # planned to die when Python lets go of it, right below...
        h = s.model[2](s.model[1](held))
        if i >= 5:
            s.kept.append(held)  # ...but from step 5 on Python keeps it: its bytes stay taken
        del held
        loss = F.mse_loss(s.model[4](s.model[3](h)), y)
        loss.backward()
        s.opt.step()
        return loss

    ex = runtime.executor()
    misses0 = ex.stats().arena_misses
    assert_same_as_eager(make, holding_step, 8, key="arena-held")
    assert ex.stats().arena_misses > misses0  # the run-time check saw the region in use


def test_one_arena_serves_both_paths_of_a_branching_program():
    tape = assert_same_as_eager(lambda: LossBranch(0), lambda p, i: p.step(i), 12, key="arena-branch")
    program = tape._program
    assert len(program.paths) == 2 == len(program.schedule.paths)  # each path validated
    report = tape.report()
    assert len(report) == 2
    for row in report:  # (the plan's choice of what to place: tests/coexec/test_branch_arena.py)
        assert row["arena used by this path"] > 0 and row["fragmentation"] <= 0.01
        assert row["arena"] == program.schedule.arena_bytes


def test_a_plan_the_simulator_rejects_is_never_executed(
    monkeypatch, plans_in_this_process
):
    import planner.arena as planner_arena
    from planner.address import Placement

    def overlapping(spans, sizes, conflicts=None, alignment=64):  # everything at offset 0
        return Placement({k: 0 for k in spans}, max(sizes.values(), default=0), "planted")

    monkeypatch.setattr(planner_arena, "greedy_offsets", overlapping)
    ex = runtime.executor()
    hits0 = ex.stats().arena_hits
    with pytest.warns(RuntimeWarning, match="failed validation.*overlap in the arena"):
        tape = assert_same_as_eager(make, step, 6, key="arena-planted")
    assert tape._program.schedule is None and tape._program.arena is None
    assert ex.stats().arena_hits == hits0  # nothing was written to an arena


def _probe(fn, *inputs):
    """probe_out_variant's answer for the one op ``fn`` records."""
    from coexec.arena import probe_out_variant
    from tracegraph import record

    with record() as trace:
        fn(*inputs)
    (rec,) = trace.ops
    outs = tuple(trace.values[v].meta for v in rec.outputs)
    return probe_out_variant(rec.func, rec.key.attrs, rec.key.metas, outs)


def test_an_op_whose_out_variant_reshapes_its_output_on_the_way_stays_out_of_the_arena():
    # mse_loss.out writes the elementwise loss into its output, then reduces it: a region of
    # the planned bytes cannot hold that (batch 4) or is resized with a warning (batch 1)
    for n in (1, 4):
        assert not _probe(F.mse_loss, torch.randn(n, 1), torch.randn(n, 1))
    assert _probe(torch.mm, torch.randn(3, 4), torch.randn(4, 5))
    assert _probe(torch.max, torch.randn(3, 4), 1)  # two outputs, through the Python binding
    assert _probe(torch.add, torch.randn(3, 4), torch.randn(3, 4))


def test_co_executed_steps_of_a_one_element_loss_print_no_resize_warning(capfd):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x, y = torch.randn(1, 8), torch.randn(1, 1)
    tape = coexec.GradientTape(backend="interpret", key="arena-one-element-loss")
    for _ in range(5):
        with tape:
            F.mse_loss(model(x), y).backward()
    assert tape.stats.coexec_steps >= 2
    assert "resized" not in capfd.readouterr().err
