"""Run a training step eagerly and under coexec from the same seed, and compare."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

import coexec

_keys = itertools.count()


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every parameter, buffer and optimizer-state tensor reachable from ``state``'s modules and
    optimizers, in a fixed order."""
    out: list[torch.Tensor] = []
    objs = state.values() if isinstance(state, dict) else vars(state).values()
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            out.extend(obj.state_dict().values())
        elif isinstance(obj, torch.optim.Optimizer):
            for st in obj.state.values():
                out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def as_float(x: Any) -> float:
    return float(x.item() if isinstance(x, torch.Tensor) else x)


def run(
    make: Callable[[], Any],
    step: Callable[[Any, int], Any],
    steps: int,
    use_coexec: bool,
    **tape_options: Any,
) -> tuple[list[float], list[torch.Tensor], coexec.GradientTape | None]:
    """``make()`` builds the state (seeded); ``step(state, i)`` runs step i and returns the loss.
    Under coexec each step waits for the plans its trace asked for, so the next step runs on
    them whatever the machine's load (tests/coexec/test_planning.py tests steps that do not).
    The tape is the interpret backend's unless ``backend=`` says otherwise (its traces, phases
    and plans are what most tests check; the native backend has tests of its own)."""
    state = make()
    tape_options.setdefault("key", ("test", next(_keys)))
    tape_options.setdefault("backend", "interpret")
    tape = coexec.GradientTape(**tape_options) if use_coexec else None
    losses = []
    for i in range(steps):
        if tape is None:
            loss = step(state, i)
        else:
            with tape:
                loss = step(state, i)
            coexec.wait_for_plans()
        losses.append(as_float(loss))
    return losses, [t.detach().clone() for t in tensors_of(state)], tape


def assert_same_as_eager(make, step, steps: int, **tape_options: Any) -> coexec.GradientTape:
    """Bit-equal losses and final parameters/buffers/optimizer state; returns the tape."""
    el, ep, _ = run(make, step, steps, False)
    cl, cp, tape = run(make, step, steps, True, **tape_options)
    assert cl == el, f"losses differ:\ncoexec {cl}\neager  {el}"
    assert len(cp) == len(ep)
    for i, (a, b) in enumerate(zip(cp, ep)):
        assert torch.equal(a, b), f"state tensor {i} differs (max diff {(a - b).abs().max()})"
    return tape


def train_step(state: dict, i: int) -> torch.Tensor:
    """One plain training step on ``state`` (``model``, ``opt``, ``data``: a few batches)."""
    model, opt = state["model"], state["opt"]
    x, y = state["data"][i % len(state["data"])]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss
