"""Every program of the suite and every zoo model at its smallest feasible memory budget:
bit-equal to eager (dropout included), and every co-executed step on a planned path within the
budget (a loop running more iterations than any traced step is a path no plan has seen: that
first step may go over, with a warning; it is planned for the next time). A program whose
tensor sizes depend on its data may go over on any step, never without a warning."""

from __future__ import annotations

import pytest
import torch

from examples.models import ZOO
from examples.programs import PROGRAMS
from tests.coexec.helpers import run
from tracegraph.schema import schema_of
from tests.coexec.test_budget import run_at_floor, smallest_budget


def has_dynamic_shapes(tape) -> bool:
    return any(schema_of(op.key.func).dynamic_shape for p in tape._program.paths for op in p.trace.ops)


def check_at_smallest_budget(make, step, steps, key, offload=None, arena=None):
    eager_losses, eager_state, _ = run(make, step, steps, False)
    budget = smallest_budget(make, step, steps, key, offload, arena)
    budget, losses, state, tape, peaks = run_at_floor(make, step, steps, budget, (key, "final"), offload, arena)
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state))
    if has_dynamic_shapes(tape):
        return tape  # (run_within checked that every step over the budget warned)
    s = tape.stats
    assert peaks and max(peaks) <= budget, (
        peaks, budget, tape._program.schedule.summary(), s.coexec_steps, s.fallbacks, s.over_budget_steps,
        s.fallback_reasons,
    )
    assert tape.stats.over_budget_steps <= steps // 2
    return tape


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_program_at_its_smallest_budget(program):
    check_at_smallest_budget(lambda: program(0), lambda p, i: p.step(i), 12, ("budget", program.name))


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_at_its_smallest_budget(name):
    tape = check_at_smallest_budget(lambda: ZOO[name](2), lambda z, i: z.step(), 5, ("budget-zoo", name))
    assert tape.stats.coexec_steps == 2


@pytest.mark.parametrize("name", ["gpt2-6l", "resnet18", "lstm-lm", "mlp"])
def test_zoo_model_offloading_at_its_smallest_budget(name):
    """Offloading never raises the smallest budget, and the step stays bit-equal and within it.
    (It lowered the GPT-2-style model's, an activation idle across the backward parked on the
    host, while dead values were freed 4 ops late under a budget; freed at the next op,
    recomputation alone reaches below what offloading reached then, 15.98 MB against 16.02,
    and parking lowers nothing more: test_budget.py's MLP with dropout is where it does.)"""
    make, step = lambda: ZOO[name](2), lambda z, i: z.step()
    remat_only = smallest_budget(make, step, 5, ("budget-zoo-remat", name), offload=False)
    tape = check_at_smallest_budget(make, step, 5, ("budget-zoo-offload", name), offload=True)
    assert tape.memory_budget <= remat_only


@pytest.mark.parametrize(
    "name, offload",
    [("resnet18", False), ("lstm-lm", True), pytest.param("gpt2-6l", True, marks=pytest.mark.slow)],
)
def test_zoo_model_with_the_arena_at_its_smallest_budget(name, offload):
    """The arena planned with the budget: bit-equal, and every co-executed step holds at most
    the planned bytes (persistent state, the whole arena, the storages outside it), and nearly
    all of them (the plan counts the skeleton's sweep lag; values often go sooner)."""
    make, step = lambda: ZOO[name](2), lambda z, i: z.step()
    tape = check_at_smallest_budget(make, step, 5, ("budget-zoo-arena", name), offload, arena=True)
    plan = tape._program.schedule
    assert plan.arena_bytes and tape._program.arena.numel() == plan.arena_bytes
    assert 0.99 * tape.stats.planned_peak_bytes <= tape.stats.peak_bytes <= tape.stats.planned_peak_bytes
