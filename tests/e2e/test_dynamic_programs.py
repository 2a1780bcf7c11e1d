"""The programs whose sizes change between steps (examples/dynamic_programs.py, issue 17)
under coexec: bit-equal to eager from the same seed. On the interpret backend the second
distinct size of an op makes its node sized (tracegraph/graph.py), so a length drawn per step
or a number of boxes is one path from then on; so is an episode's length (REINFORCE): the
``torch.stack`` of one log-probability per iteration is one gathered op, its gradient a loop.
The native backend computes the ops at new sizes on its worker (``python bench/dynamic_sizes.py``
measures both)."""

from __future__ import annotations

import pytest
import torch

import coexec
from examples.dynamic_programs import DYNAMIC_PROGRAMS, MORE_DYNAMIC_PROGRAMS, Reinforce
from executor import native
from tests.coexec.helpers import as_float, assert_same_as_eager, run, tensors_of

STEPS = 20
REPEATING = {"word_lm_last_chunk", "classifier_last_batch"}
# sizes drawn per step: one path
SIZED = {"transformer_random_length", "detection_boxes", "reinforce_short", "reinforce"}


class ShortReinforce(Reinforce):
    """Episodes of 12-20 steps: each step here waits for its plans (tests/coexec/helpers.py),
    and planning the 200-step episodes' traces makes the full program take minutes (the slow
    case below)."""

    name = "reinforce_short"
    max_steps = 20


CASES = [
    *(p for p in DYNAMIC_PROGRAMS if p is not Reinforce),
    ShortReinforce,
    pytest.param(Reinforce, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("program", CASES, ids=[*(p.name for p in CASES[:-1]), "reinforce"])
def test_program_with_changing_sizes_is_bit_equal_to_eager(program):
    tape = assert_same_as_eager(lambda: program(0), lambda p, i: p.step(i), STEPS)
    s = tape.stats
    assert s.steps == STEPS
    if program.name in REPEATING:
        assert s.traces <= 4 and s.phase == "coexec", s
        assert s.coexec_steps >= STEPS - 6, s
    if program.name in SIZED:  # traced twice (two sizes), then co-executed but for a fallback or so
        assert s.traces <= 3 and s.phase == "coexec", s
        assert s.coexec_steps >= STEPS - 4 and s.fallbacks <= 1, s


@pytest.mark.skipif(not native.enabled(), reason="the native backend needs the native module")
@pytest.mark.parametrize(
    "program", DYNAMIC_PROGRAMS + MORE_DYNAMIC_PROGRAMS, ids=[p.name for p in DYNAMIC_PROGRAMS + MORE_DYNAMIC_PROGRAMS]
)
def test_on_the_native_backend_ops_at_new_sizes_run_on_the_worker(program):
    """Every step captured, bit-equal, and after the first step at least 90% of the ops of the
    steps computed by the worker, sizes new at their lines or not (the rest ran at once on the
    step's thread: ``.item()``s, ``nonzero``); issue 17 asks for 90% of the steps."""
    assert native.wait() is not None
    make, step = (lambda: program(0)), (lambda p, i: p.step(i))
    el, ep, _ = run(make, step, STEPS, False)
    state, tape = make(), coexec.GradientTape(backend="native", key=("test", "native sizes", program.name))
    losses, ops, worker_ops = [], 0, 0
    for i in range(STEPS):
        with tape:
            losses.append(as_float(step(state, i)))
        if i > 0:
            ops, worker_ops = ops + tape.stats.last_ops, worker_ops + tape.stats.native_ops
    assert losses == el
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(state), ep))
    assert tape.stats.coexec_steps == STEPS
    assert worker_ops >= 0.9 * ops, f"{worker_ops} of {ops} ops on the worker"


@pytest.mark.skipif(not native.enabled(), reason="the native backend needs the native module")
def test_under_a_memory_budget_no_step_of_the_random_length_transformer_goes_over():
    """Issue 17: the transformer whose length is drawn per step in [16, 128], under a budget of
    90% of the largest unbudgeted step's peak, holds every step within it at every length, bit-equal
    to eager. Most steps meet lengths new at their lines, whose ops the shape oracle answers on
    the step's thread, some by running their kernel on stand-ins (``_safe_softmax``, 0.5-1 MB at
    the longest lengths, beside a 3 MB budget); until the capture's guard kept room for them
    (``Worker::reserve_for_stand_ins``) about one step in 30 went up to 6% over."""
    from examples.dynamic_programs import TransformerRandomLength

    assert native.wait() is not None
    steps = 40
    make, step = (lambda: TransformerRandomLength(0)), (lambda p, i: p.step(i))
    probe_state = make()
    probe = coexec.GradientTape(backend="native", memory_budget="100GB", key=("test", "random length", "probe"))
    peaks = []
    for i in range(steps):
        with probe:
            step(probe_state, i)
        peaks.append(probe.stats.peak_bytes)
    budget = int(0.9 * max(peaks))
    el, ep, _ = run(make, step, steps, False)
    state = make()
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("test", "random length", "budget"))
    losses, held = [], []
    for i in range(steps):
        with tape:
            losses.append(as_float(step(state, i)))
        held.append(tape.stats.peak_bytes / budget)
    assert losses == el
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(state), ep))
    said = " ".join(f"{h:.3f}" for h in held)  # (in step order: a failure says which steps)
    assert max(held) <= 1.0 and tape.stats.over_budget_steps == 0, said
    assert max(held) > 0.9, said  # (the budget binds at the longest lengths)


def test_on_the_interpret_backend_under_a_budget_no_step_of_the_random_length_transformer_goes_over():
    """Issue 17 on the interpret backend (what a GPU machine runs): plans are made for the
    largest lengths seen, and a step longer than its plan follows it up to its first op that
    makes more than planned, then the executor's guard holds it (executor/guard.py). Budget:
    3.21 MB, about 92% of the largest unbudgeted peak (3.39-3.57 MB here), just above the
    planner's floor (3.20 MB); without the guard (a1f5109) the step that first met a longer
    length went 1.018 over it."""
    from examples.dynamic_programs import TransformerRandomLength

    steps, budget = 40, 3_210_000
    make, step = (lambda: TransformerRandomLength(0)), (lambda p, i: p.step(i))
    el, ep, _ = run(make, step, steps, False)
    state = make()
    tape = coexec.GradientTape(backend="interpret", memory_budget=budget, key=("test", "interpret length", "budget"))
    losses, held = [], []
    for i in range(steps):
        with tape:
            losses.append(as_float(step(state, i)))
        coexec.wait_for_plans()  # (which plan a step runs on does not depend on the machine's load)
        if tape.stats.last_phase == "coexec":
            held.append(tape.stats.peak_bytes / budget)
    assert losses == el
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(state), ep))
    said = " ".join(f"{h:.3f}" for h in held)  # (in step order: a failure says which steps)
    assert len(held) >= steps - 4 and tape.stats.over_budget_steps == 0 and max(held) <= 1.0, said
    assert tape.stats.guarded_steps >= 1 and max(held) > 0.9, said  # (the guard had work to do)
