"""Plans are made in the background (coexec/planning.py): steps never wait for them without a
budget, run on the newest plan that has arrived, wait for a complete plan under a budget, and
a failed or dropped plan is said, never used."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from coexec import planning, programs, runtime
from planner import BudgetTooSmall
from tests.coexec.helpers import as_float, run, tensors_of


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    return SimpleNamespace(
        model=model,
        opt=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        data=[(torch.randn(16, 32), torch.randn(16, 1)) for _ in range(3)],
    )


def step(s, i):
    x, y = s.data[i % 3]
    loss = F.mse_loss(s.model(x), y)
    loss.backward()
    s.opt.step()
    s.opt.zero_grad()
    return loss


@pytest.fixture
def held_plans(monkeypatch, plans_in_this_process):
    """Plans are made only once the test lets them: ``gate.set()``."""
    gate = threading.Event()
    make_plan = planning.make_plan

    def held(req):
        gate.wait(60)
        return make_plan(req)

    monkeypatch.setattr(planning, "make_plan", held)
    yield gate
    gate.set()
    coexec.wait_for_plans(60)


def run_steps(s, tape, steps, first=0):
    losses = []
    for i in range(first, first + steps):
        with tape:
            losses.append(as_float(step(s, i)))
    return losses


def test_steps_co_execute_without_waiting_while_the_plan_is_made_then_use_it(held_plans, capsys):
    eager_losses, eager_state, _ = run(make, step, 8, False)
    s = make()
    tape = coexec.GradientTape(backend="interpret", key="planning-held", debug=True)
    ex = runtime.executor()
    losses = run_steps(s, tape, 5)
    # the plans asked for after the new traces are still being made: the steps co-executed
    # anyway, every output from the allocator (issue order)
    program = tape._program
    assert tape.stats.coexec_steps >= 2 and tape.stats.planned_paths == 0
    assert program.schedule is None and program.arena is None
    held_plans.set()
    assert coexec.wait_for_plans(60)
    blocks0 = ex.stats().blocks
    losses += run_steps(s, tape, 3, first=5)
    assert tape.stats.planned_paths == tape.stats.traces == len(program.paths)
    # the plan arrived, and the steps ran on it
    assert program.schedule is not None and tape.stats.planned_path is not None
    assert ex.stats().blocks - blocks0 >= 3
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(s), eager_state))
    err = capsys.readouterr().err
    assert f"planning {len(program.paths)} path(s) in the background (arena)" in err
    assert f"plan of {len(program.paths)} path(s) ready after" in err


def test_a_program_that_stays_eager_asks_for_no_more_plans_and_lets_go_of_its_plan():
    """After ``max_traces`` traces the program stays eager, so the plan the last trace would
    ask for, and any plan after it, would only take the cores from its steps."""

    def sized(s, n):
        loss = s.model(torch.randn(n, 32)).square().mean()
        loss.backward()
        s.opt.step()
        s.opt.zero_grad()
        return loss

    s = make()
    tape = coexec.GradientTape(backend="interpret", key="planning-eager", max_traces=4)
    for n in (4, 4, 4, 4, 5):  # traced, traced (momentum appears), covered, co-executed; new
        with tape:
            sized(s, n)
        assert coexec.wait_for_plans(60)
    program = tape._program
    asked = program.requested
    assert tape.stats.traces == 3 and tape.stats.coexec_steps == 1
    assert program.schedule is not None  # (taken at entry)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on"):
        with tape:  # the fourth trace: eager from now on
            sized(s, 6)
    assert tape.stats.phase == "eager" and tape.stats.traces == 4
    assert program.requested == asked and program.futures == [] and program.latest is None
    assert program.schedule is None and program.arena is None and program.block_index is None
    for n in (7, 4):
        with tape:
            sized(s, n)
    assert program.requested == asked and program.schedule is None and tape.stats.steps == 8


def test_under_a_budget_a_co_executed_step_waits_for_the_plan_and_keeps_to_it(capsys):
    eager_losses, eager_state, _ = run(make, step, 6, False)
    s = make()
    tape = coexec.GradientTape(
        backend="interpret", key="planning-budget-wait", memory_budget="10MB", debug=True
    )
    peaks, losses = [], []
    for i in range(6):
        before = tape.stats.coexec_steps
        with tape:
            losses.append(as_float(step(s, i)))
        if tape.stats.coexec_steps > before:
            assert tape.stats.planned_paths == len(tape._program.paths)  # it ran on a plan
            peaks.append(tape.stats.peak_bytes)
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(s), eager_state))
    assert peaks and max(peaks) <= 10**7 and tape.stats.over_budget_steps == 0
    err = capsys.readouterr().err
    assert "waiting for the plan of" in err or "ready after" in err


def test_a_plan_that_fails_is_said_and_steps_run_without_it(
    monkeypatch, plans_in_this_process
):
    def broken(*args):
        raise ZeroDivisionError("a planner bug")

    monkeypatch.setattr(coexec.planning, "plan_program", broken)
    eager_losses, eager_state, _ = run(make, step, 6, False)
    with pytest.warns(RuntimeWarning, match=r"planning the step at .* failed \(ZeroDivisionError: a"):
        losses, state, tape = run(make, step, 6, True, key="planning-broken")
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert tape.stats.coexec_steps >= 2 and tape._program.schedule is None


def test_under_a_budget_a_plan_that_fails_stops_the_step_before_it_runs(
    monkeypatch, plans_in_this_process
):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a planner bug")

    monkeypatch.setattr(coexec.planning, "plan_program", broken)
    s = make()
    key = "planning-budget-broken"
    tape = coexec.GradientTape(backend="interpret", key=key, memory_budget="10MB")
    ran = []
    with pytest.raises(RuntimeError, match=r"planning the memory budget .* failed \(ZeroDivisionError"):
        for i in range(6):
            with tape:
                ran.append(i)
                step(s, i)
            coexec.wait_for_plans(60)
    assert ran == [0]  # the first step traced (eagerly); the second stopped before running


def test_a_dropped_program_never_takes_a_plan_that_arrives_late(held_plans):
    s = make()
    tape = coexec.GradientTape(backend="interpret", key="planning-dropped")
    run_steps(s, tape, 2)
    program = tape._program
    assert program.futures  # a plan is being made
    programs.drop(program)
    held_plans.set()
    assert coexec.wait_for_plans(60)
    assert program.collect(wait=False) == []
    assert program.schedule is None and program.arena is None and not program.paths


def test_the_smallest_budget_named_is_raised_before_the_step_runs_and_then_suffices():
    """BudgetTooSmall comes at the start of a step, before it changes anything; the budget it
    names runs the next steps of the same program within it."""
    s = make()
    tape = coexec.GradientTape(backend="interpret", key="planning-smallest", memory_budget=10_000)
    ran = []
    with pytest.raises(BudgetTooSmall) as err:
        for i in range(6):
            before = [t.clone() for t in tensors_of(s)]
            with tape:
                ran.append(i)
                step(s, i)
    # the step that raised did not run: the state is what the steps before it left
    assert ran == list(range(len(ran))) and len(ran) < 6
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(s), before))
    smallest = err.value.smallest
    assert smallest > 10_000
    # continue the same run at the named budget: it plans and co-executes within it
    eager = make()
    for i in range(len(ran) + 4):
        step(eager, i)
    tape = coexec.GradientTape(backend="interpret", key="planning-smallest", memory_budget=smallest)
    for i in range(len(ran), len(ran) + 4):
        before = tape.stats.coexec_steps
        with tape:
            step(s, i)
        if tape.stats.coexec_steps > before:
            assert tape.stats.peak_bytes <= smallest
    assert tape.stats.coexec_steps >= 2 and tape.stats.over_budget_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(s), tensors_of(eager)))
