"""One ``with`` line, many models: a program per model (coexec/programs.py)."""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from coexec import programs

# per run: two new traces (Adam makes its state in the first step), one covered, then co-executed
STEPS = 6


def make(width: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, list]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(STEPS)]
    return model, opt, data


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def train(width: int, use_coexec: bool, keep: list) -> tuple[list, list, Any]:
    """The helper of a sweep: every run goes through the same ``with`` line."""
    model, opt, data = make(width, seed=width)
    keep.append(model)
    tape = coexec.GradientTape(backend="interpret") if use_coexec else None
    losses = []
    for x, y in data:
        if tape is None:
            loss = step(model, opt, x, y)
        else:
            with tape:
                loss = step(model, opt, x, y)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], tape.stats if tape else None


def sweep(widths: list[int], keep_models: bool) -> None:
    eager = [train(w, False, [])[:2] for w in widths]
    kept: list = []
    for w, (e_losses, e_params) in zip(widths, eager):
        keep = kept if keep_models else []
        losses, params, stats = train(w, True, keep)
        assert losses == e_losses, f"width {w}: losses differ"
        assert all(torch.equal(a, b) for a, b in zip(params, e_params)), f"width {w}: params differ"
        # each run is its own program: its own warm-up (as the model alone would: two new
        # traces, one covered), then co-executed to the end
        got = (stats.steps, stats.traces, stats.coexec_steps, stats.fallbacks)
        assert got == (STEPS, 2, STEPS - 3, 0), (w, stats)
        assert stats.phase == "coexec"


def test_a_sweep_of_twelve_widths_through_one_helper_co_executes_every_run():
    sweep([2 + 3 * i for i in range(12)], keep_models=True)  # the models, so the programs, stay


def test_a_sweep_whose_models_die_between_runs():
    sweep([4, 7, 9], keep_models=False)  # each run's program is dropped with its model


def two_models(seed: int = 0) -> list:
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 1))
    b = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    return [(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)) for m in (a, b)]


def test_two_models_alternating_through_one_with():
    data = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(8)]

    def run(use_coexec: bool) -> tuple[list, list, list]:
        pairs = two_models()
        losses, stats = [], [None, None]
        for i in range(16):
            model, opt = pairs[i % 2]
            x, y = data[i // 2]
            if use_coexec:
                with coexec.GradientTape(backend="interpret") as tape:
                    loss = step(model, opt, x, y)
                stats[i % 2] = tape.stats
            else:
                loss = step(model, opt, x, y)
            losses.append(loss.item())
        return losses, [p.detach().clone() for m, _ in pairs for p in m.parameters()], stats

    e_losses, e_params, _ = run(False)
    losses, params, stats = run(True)
    assert losses == e_losses
    assert all(torch.equal(a, b) for a, b in zip(params, e_params))
    # each model its own program: 8 steps, its warm-up (two new traces: the first step makes
    # the momentum buffers; one covered), then co-executed, with no fallback
    for s in stats:
        assert (s.steps, s.traces, s.coexec_steps, s.fallbacks) == (8, 2, 5, 0), s


def test_two_models_of_the_same_shapes_are_two_programs():
    def run(use_coexec: bool) -> tuple[list, list]:
        torch.manual_seed(0)
        models = [nn.Linear(5, 3) for _ in range(2)]
        x = torch.randn(4, 5)
        steps = []
        for i in range(6):
            if use_coexec:
                with coexec.GradientTape(backend="interpret") as tape:
                    models[i % 2](x).sum().backward()
                steps.append(tape.stats.steps)
            else:
                models[i % 2](x).sum().backward()
        return steps, [p.grad for m in models for p in m.parameters()]

    steps, grads = run(True)
    _, e_grads = run(False)
    assert steps == [1, 1, 2, 2, 3, 3]  # each model counts its own steps
    assert all(torch.equal(a, b) for a, b in zip(grads, e_grads))


def test_the_least_recently_used_program_is_dropped_with_its_arena():
    old = coexec.set_max_programs(2)
    try:
        kept, tapes = [], []
        for w in (3, 4, 5):
            model, opt, data = make(w, seed=w)
            kept.append(model)
            tape = coexec.GradientTape(backend="interpret")
            for x, y in data[:4]:
                with tape:
                    step(model, opt, x, y)
                coexec.wait_for_plans(60)  # the arena is planned in the background
            assert tape.stats.coexec_steps == 1
            tapes.append(tape)
            if w == 3:
                first = tape._program
                plan = weakref.ref(first.schedule)  # the plan its co-executed steps used
                assert first.schedule is not None and first.graph.nodes()
        gc.collect()
        assert plan() is None  # it went with the program (its arena too, if it had one)
        assert not first.graph.nodes() and first.schedule is None and not first.paths
        assert programs.live_programs() == 2
        assert tapes[0].stats.steps == 4  # a tape still reports what its program did
        # the first model is new again: its program starts over, and co-executes once warm
        model, opt, data = make(3, seed=3)
        tape = coexec.GradientTape(backend="interpret")
        for x, y in data[:4]:
            with tape:
                step(model, opt, x, y)
        assert (tape.stats.steps, tape.stats.coexec_steps) == (4, 1)
    finally:
        coexec.set_max_programs(old)


def test_set_max_programs_rejects_bad_values():
    with pytest.raises(ValueError, match="positive int"):
        coexec.set_max_programs(0)
    with pytest.raises(ValueError, match="positive int"):
        coexec.set_max_programs(True)


def test_key_names_one_program_for_every_model():
    tapes = []
    for w in (3, 4):
        model, opt, data = make(w, seed=w)
        tape = coexec.GradientTape(backend="interpret", key="programs-named")
        for x, y in data[:4]:
            with tape:
                step(model, opt, x, y)
        tapes.append(tape)
    # one program: the second model's steps are new traces of it, counted together (its
    # sizes are the first's but for the width: one trace more, whose nodes are sized)
    assert tapes[0]._program is tapes[1]._program
    assert tapes[1].stats.steps == 8 and tapes[1].stats.traces == 3 and tapes[1].stats.fallbacks == 1


def interleaved(order: list[int], use_coexec: bool) -> tuple[list, list, list]:
    """Two models stepped in ``order`` through one ``with``; each step does an op (x * 0.5)
    before it reads a parameter."""
    gens = [torch.Generator().manual_seed(i) for i in range(len(order))]
    data = [(torch.randn(8, 6, generator=g), torch.ones(8, 1)) for g in gens]
    pairs = two_models()
    losses, stats = [], [None, None]
    for i, m in enumerate(order):
        model, opt = pairs[m]
        x, y = data[i]
        if use_coexec:
            with coexec.GradientTape(backend="interpret") as tape:
                loss = step(model, opt, x * 0.5, y)
            stats[m] = tape.stats
        else:
            loss = step(model, opt, x * 0.5, y)
        losses.append(loss.item())
    return losses, [p.detach().clone() for m, _ in pairs for p in m.parameters()], stats


def test_a_repeating_pattern_of_models_is_guessed():
    order = [0, 0, 1] * 8  # A A B: each step's program is guessed from the ones before it
    e_losses, e_params, _ = interleaved(order, False)
    losses, params, stats = interleaved(order, True)
    assert losses == e_losses
    assert all(torch.equal(a, b) for a, b in zip(params, e_params))
    # no fallback: every co-executed step ran on the program it belongs to. Of A's 16 steps,
    # 4 traced (2 new traces, 1 covered, 1 guessed as B while both were warming up)
    assert [(s.steps, s.traces, s.fallbacks) for s in stats] == [(16, 2, 0), (8, 2, 0)]
    assert [s.coexec_steps for s in stats] == [12, 5]


def test_a_wrong_guess_after_ops_were_issued_falls_back_and_stays_exact():
    """In a random order the guess is sometimes wrong; the co-executing step has issued an op
    already, so it falls back at the first parameter, like any fallback, and goes on as a
    step of the right model."""
    rng = random.Random(0)
    order = [rng.randrange(2) for _ in range(30)]
    e_losses, e_params, _ = interleaved(order, False)
    losses, params, stats = interleaved(order, True)
    assert losses == e_losses
    assert all(torch.equal(a, b) for a, b in zip(params, e_params))
    assert [s.steps for s in stats] == [order.count(0), order.count(1)]  # each its own steps
    assert all(s.coexec_steps > 0 for s in stats)
    switched = [s for s in stats if s.fallbacks]
    assert switched and all("belongs to program" in s.last_fallback for s in switched)


def test_a_program_whose_model_died_is_dropped():
    def run(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> coexec.GradientTape:
        tape = coexec.GradientTape(backend="interpret")
        for x, y in data[:4]:
            with tape:  # one ``with`` line for both models
                step(model, opt, x, y)
            coexec.wait_for_plans(60)  # the arena is planned in the background
        return tape

    model, opt, data = make(6, seed=6)
    first = run(model, opt, data)._program
    plan = weakref.ref(first.schedule)
    assert first.graph.nodes() and first.stats.coexec_steps == 1
    # the executor lets go of the step's values (the parameters, as in-place results among
    # them) as it reaches the step's end: after that, a collection frees the model's cycles
    coexec.synchronize()
    del model, opt
    gc.collect()
    run(*make(7, seed=7))  # the next step here finds the first program's parameters dead
    gc.collect()
    assert plan() is None and not first.graph.nodes() and not first.paths
