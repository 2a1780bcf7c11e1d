"""Memory budgets: parsing, the error naming the smallest feasible budget, and co-executed
steps that drop and recompute activations yet stay bit-equal to eager and within budget."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coexec
import planner.program as budget_module
from coexec.budget import parse_budget
from planner import BudgetTooSmall, format_bytes
from tests.coexec.helpers import as_float, run, tensors_of


def make(dropout: bool = False):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(128, 128), nn.Tanh(), *([nn.Dropout(0.1)] if dropout else [])]
    model = nn.Sequential(*layers, nn.Linear(128, 1))
    return SimpleNamespace(
        model=model,
        opt=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        data=[(torch.randn(256, 128), torch.randn(256, 1)) for _ in range(3)],
    )


def step(s, i):
    x, y = s.data[i % 3]
    loss = F.mse_loss(s.model(x), y)
    loss.backward()
    s.opt.step()
    s.opt.zero_grad()
    return loss


def run_within(make, step, steps, budget, key, offload=None, arena=None):
    """Run under ``budget``; the measured peaks of the co-executed steps on planned paths
    (a step on a path no plan had seen may go over: it warns, and is counted in the stats)."""
    state = make()
    tape = coexec.GradientTape(
        backend="interpret", memory_budget=budget, key=key, offload=offload, arena=arena
    )
    losses, peaks = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            before, over = tape.stats.coexec_steps, tape.stats.over_budget_steps
            with tape:
                loss = step(state, i)
            losses.append(as_float(loss))
            if tape.stats.coexec_steps > before and tape.stats.over_budget_steps == over:
                peaks.append(tape.stats.peak_bytes)
    over_budget = [w for w in caught if "over its memory budget" in str(w.message)]
    assert len(over_budget) == tape.stats.over_budget_steps
    return losses, [t.detach().clone() for t in tensors_of(state)], tape, peaks


def run_at_floor(make, step, steps, budget, key, offload=None, arena=None):
    """``run_within`` at a smallest budget found by an earlier run: with offloading, copy
    windows come from the times each run measures, and so does the floor, which may move
    slightly (the error says so); recomputation alone must not move it. With the arena, how
    tightly a plan's storages pack moves it too. The error asks for some headroom: the floor
    may move by at most 1%, and the last try runs with that 1%. Returns the budget run at,
    then what ``run_within`` returns."""
    first = budget
    for attempt in range(3):
        try:
            return (budget, *run_within(make, step, steps, budget, (key, attempt), offload, arena))
        except BudgetTooSmall as e:
            assert (offload or arena) and "leave some headroom" in str(e) and e.smallest <= 1.01 * first, e
            budget = e.smallest if attempt == 0 else int(1.01 * first)
    raise AssertionError("the smallest budget kept moving")


def smallest_budget(make, step, steps, key, offload=None, arena=None):
    """The smallest feasible budget, as the error names it (raising it path by path)."""
    budget = 1
    for attempt in range(10):
        try:
            run_within(make, step, steps, budget, (key, attempt), offload, arena)
            return budget
        except BudgetTooSmall as e:
            assert e.smallest > budget
            budget = e.smallest
    raise AssertionError("the smallest feasible budget did not settle")


@pytest.mark.parametrize(
    "text, expected",
    [(1000, 1000), ("6GB", 6 * 10**9), ("512MiB", 512 << 20), ("1.5 GiB", 3 << 29), ("2048", 2048), (" 3kb ", 3000)],
)
def test_budgets_parse_from_bytes_and_units(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["6 gigs", "GB", "-1GB", 0, -5, 1.5e9, True])
def test_bad_budgets_are_refused_with_a_clear_error(bad):
    with pytest.raises((ValueError, TypeError), match="memory_budget"):
        coexec.GradientTape(backend="interpret", memory_budget=bad)


def test_a_budget_below_the_smallest_feasible_raises_naming_it():
    with pytest.raises(BudgetTooSmall, match=r"smallest feasible budget for this step is .*\(\d+ bytes\)") as err:
        run_within(make, step, 4, 100_000, "budget-too-small")
    assert err.value.budget == 100_000 and err.value.smallest > 100_000
    # the next step with the same budget refuses at once, before running anything
    tape = coexec.GradientTape(backend="interpret", memory_budget=100_000, key="budget-too-small")
    with pytest.raises(BudgetTooSmall):
        with tape:
            raise AssertionError("the step ran")


def test_at_the_smallest_feasible_budget_steps_recompute_stay_within_it_and_bit_equal():
    eager_losses, eager_state, _ = run(make, step, 6, False)
    _, _, free_tape = run(make, step, 6, True, key="budget-none", arena=False)  # as budgets run
    unbudgeted = free_tape.stats.peak_bytes
    budget = smallest_budget(make, step, 6, "budget-smallest")
    # the budget bites: recomputation saves real memory (here the gradients and momentum of
    # 6 layers, ~0.9 MB, stay whatever a plan does: 1912336 against 1975820 bytes; the
    # unbudgeted steps' 2106896 before a replayed gradient block let go of autograd's saved
    # tensors as the engine does, node by node)
    assert budget < 0.97 * unbudgeted
    losses, state, tape, peaks = run_within(make, step, 6, budget, "budget-run")
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert len(peaks) >= 2 and max(peaks) <= budget
    assert tape.stats.recomputed_ops > 0
    assert tape.stats.planned_peak_bytes <= budget


@pytest.fixture
def even_op_times(monkeypatch, plans_in_this_process):
    """Every op costs the same to the budget planner: which storages it recomputes then
    follows from their sizes, not from how busy the machine was while the steps were traced
    (with measured times a loaded machine made a plan recomputing 6 storages instead of 2,
    whose arena packs worse: 13% over the live peak instead of 0%)."""
    fill = budget_module._fill_from_traced

    def even(paths, storage_keys, traces):
        fill(paths, storage_keys, traces)
        for p in paths:
            for op in p.g.ops:
                op.seconds = 1e-4

    monkeypatch.setattr(budget_module, "_fill_from_traced", even)


def test_under_a_budget_the_arena_is_planned_with_it_and_the_peak_is_exact(even_op_times):
    """The arena is sized up front by the budget plan and counts whole: the measured device
    bytes (persistent state, the arena, the storages outside it) equal the plan's to the byte.
    Its cost: the arena is held whole while the first step's new optimizer state appears
    beside it, so the smallest budget is somewhat higher than without it (never over it)."""
    eager_losses, eager_state, _ = run(make, step, 6, False)
    budget = smallest_budget(make, step, 6, "budget-arena-floor", arena=True)
    budget, losses, state, tape, peaks = run_at_floor(make, step, 6, budget, "budget-arena", arena=True)
    program = tape._program
    plan = program.schedule
    assert plan.arena_bytes and program.arena.numel() == plan.arena_bytes > 0
    # best fit over residency stretches (0.15 here since values are freed at the next op under a
    # budget: the stretches are shorter, the arena smaller, the same waste a larger share of it)
    assert plan.fragmentation < 0.2
    assert len(peaks) >= 2 and all(p == plan.peak <= budget for p in peaks)
    assert tape.stats.recomputed_ops > 0
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    without = smallest_budget(make, step, 6, "budget-no-arena-floor", arena=False)
    assert without <= budget <= 1.10 * without  # here +7%: the arena placed over stretches fragments


def test_debug_logs_what_the_budget_plan_does(capsys):
    """With ``debug``, planning a budget says when it starts (in the background) and what the
    plan does when it arrives, as the stats later show it."""
    state = make()
    tape = coexec.GradientTape(
        backend="interpret", memory_budget=2_000_000, key="budget-debug", debug=True
    )
    for i in range(4):
        with tape:
            step(state, i)
    err = capsys.readouterr().err.splitlines()
    started = [x for x in err if "in the background (memory budget 1.91 MiB)" in x]
    assert [x.split(": ", 1)[1] for x in started] == [
        f"planning {n} path(s) in the background (memory budget 1.91 MiB)" for n in (1, 2)
    ]  # planned again for the second path
    lines = [x for x in err if "ready after" in x and "memory budget 1.91 MiB" in x]
    plan = tape._program.schedule
    assert len(plan.paths) == 2 and 1 <= len(lines) <= 2  # the first may be overtaken
    assert tape.stats.planned_paths == 2
    recomputed = len(plan.recompute)
    assert recomputed > 0 and tape.stats.recomputed_ops > 0
    assert (
        f"planned peak {format_bytes(plan.peak)} over 2 path(s); {recomputed} storages recomputed"
        in lines[-1]
    )
    assert "0 offloaded" in lines[-1] and "planned in" in lines[-1]


def test_a_generous_budget_recomputes_nothing():
    losses, _, tape, peaks = run_within(make, step, 5, "1GB", "budget-generous")
    assert tape.stats.recomputed_ops == 0 and max(peaks) <= 10**9
    assert losses == run(make, step, 5, False)[0]


def make_random():
    """``make``'s MLP with dropout after each layer: values drawn from the generator, which
    recomputation cannot make again, and offloading can park."""
    return make(dropout=True)


@pytest.fixture
def op_times_measured_once(monkeypatch):
    """Each op's time as the first tracing step of the test measured it, in every later run.
    With offloading the smallest budget follows the op times each run measures (copy windows
    span the ops whose times cover a copy; the error says so): on this VM one run's floor was
    10% above the last's (1.82 against 2.01 MiB, 2 in 8 runs), one copy window an op shorter.
    Sharing one measurement per op keeps what the test is about, the plans and their floors,
    apart from the machine's timing noise."""
    from tracegraph.recorder import Recorder

    measured: dict = {}
    execute = Recorder.execute

    def once(self, rec, func, args, kwargs, tensors):
        out = execute(self, rec, func, args, kwargs, tensors)
        rec.seconds = measured.setdefault(rec.key, rec.seconds)
        return out

    monkeypatch.setattr(Recorder, "execute", once)


def test_offloading_lowers_the_smallest_budget_and_parks_activations_bit_equal(op_times_measured_once):
    # (with dropout: where every value can be made again, as in ``make``'s MLP, recomputation
    # alone reaches the step's working set once dead values are freed at the next op, and
    # parking lowers nothing: coexec/arena.py, sweep_every)
    eager_losses, eager_state, _ = run(make_random, step, 6, False)
    remat_only = smallest_budget(make_random, step, 6, "budget-remat-only", offload=False)
    floor = smallest_budget(make_random, step, 6, "budget-offload", offload=True)
    assert floor < remat_only
    budget, losses, state, tape, peaks = run_at_floor(make_random, step, 6, floor, "budget-offload-run", offload=True)
    assert budget == floor  # (the op times shared: the floor found is the floor run at)
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert len(peaks) >= 2 and max(peaks) <= budget
    assert tape.stats.offloaded_storages > 0
    plan = tape._program.schedule
    assert plan.host_bytes > 0 and plan.parked
    assert tape.stats.planned_step_seconds > 0 and tape.stats.step_seconds > 0


def test_where_offloading_plans_higher_recomputation_alone_is_the_plan(
    monkeypatch, plans_in_this_process
):
    # the offloading solve can land above recomputation's floor (its time limit, paths that
    # disagree on where copies land): made to here, where it plans nothing below 1.2x that floor
    remat_only = smallest_budget(make, step, 6, "budget-fallback-remat", offload=False)
    agreed = budget_module._agreed_plans

    def offloading_plans_higher(paths, storage_keys, budget, time_limit, banned, bandwidth):
        if bandwidth is not None and budget < 1.2 * remat_only:
            raise BudgetTooSmall(budget, int(1.2 * remat_only))
        return agreed(paths, storage_keys, budget, time_limit, banned, bandwidth)

    monkeypatch.setattr(budget_module, "_agreed_plans", offloading_plans_higher)
    assert smallest_budget(make, step, 6, "budget-fallback-offload", offload=True) == remat_only
    losses, state, tape, peaks = run_within(make, step, 6, remat_only, "budget-fallback-run", offload=True)
    eager_losses, eager_state, _ = run(make, step, 6, False)
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert tape.stats.offloaded_storages == 0 and tape.stats.recomputed_ops > 0
    assert len(peaks) >= 2 and max(peaks) <= remat_only


def test_offload_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="offload must be True, False or None"):
        coexec.GradientTape(backend="interpret", memory_budget="1GB", offload="yes")
