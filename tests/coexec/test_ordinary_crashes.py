"""Ordinary training programs that crashed on the default backend (the native capture) train
exactly as eager: checkpointing inside the step, ``torch.sparse.mm``, an evaluation under
``torch.inference_mode()``, two threads training at once, a ``torch.compile``d model.

Each program runs eagerly and under ``coexec.GradientTape()`` from the same seed; the losses,
what it returns, the parameters, their gradients and the optimizer's state must be equal bit
for bit."""

from __future__ import annotations

import contextlib
import io
import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import coexec
from executor import native
from executor.capture import is_placeholder

pytestmark = pytest.mark.skipif(
    not native.enabled(), reason="the native backend needs the native module"
)

_keys = itertools.count()


def _state_of(state: dict) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state of ``state``'s modules and
    optimizers, in a fixed order (copies; a gradient that is None is left out, counted)."""
    out: list[torch.Tensor] = []
    for obj in state.values():
        if isinstance(obj, nn.Module):
            out.extend(t.detach().clone() for t in obj.state_dict().values())
            for p in obj.parameters():
                out.append(torch.tensor(p.grad is None) if p.grad is None else p.grad.detach().clone())
        elif isinstance(obj, torch.optim.Optimizer):
            for st in obj.state.values():
                out.extend(v.detach().clone() for v in st.values() if isinstance(v, torch.Tensor))
    return out


def _run(
    make: Callable[[], dict], step: Callable[[dict, int], Any], steps: int, captured: bool
) -> tuple[list[Any], list[torch.Tensor], coexec.GradientTape | None]:
    """``step(state, i)`` ``steps`` times on ``make()``'s state, eagerly or under a default
    tape; (what each step returned, the final state, the tape)."""
    native.wait()  # (else the steps run eagerly while the module builds)
    state = make()
    tape = coexec.GradientTape(key=("crashes", next(_keys))) if captured else None
    returned = []
    for i in range(steps):
        if tape is None:
            returned.append(step(state, i))
        else:
            with tape:
                returned.append(step(state, i))
    return returned, _state_of(state), tape


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and a.requires_grad == b.requires_grad and a.is_inference() == b.is_inference()
            and not is_placeholder(a) and torch.equal(a, b)
        )  # fmt: skip
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _assert_as_eager(make: Callable[[], dict], step: Callable[[dict, int], Any], steps: int) -> coexec.GradientTape:
    """Bit-equal results and final state, every step captured; returns the tape."""
    want, want_state = _run(make, step, steps, False)[:2]
    got, got_state, tape = _run(make, step, steps, True)
    assert tape is not None and tape.backend == "native"
    assert _same(got, want), f"results differ:\ncaptured {got}\neager    {want}"
    assert len(got_state) == len(want_state)
    for i, (a, b) in enumerate(zip(got_state, want_state)):
        assert not is_placeholder(a)
        assert _same(a, b), f"state tensor {i} differs"
    assert tape.stats.coexec_steps == steps
    return tape


def _mlp_state(seed: int = 0, adam: bool = True) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2) if adam else torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    return {"model": model, "opt": opt, "x": x, "y": y}


# -- 1. checkpointing inside the step (fast-neural-style) ------------------------------------


def _checkpointing_step(state: dict, i: int) -> tuple:
    """fast-neural-style's loop: ``new_tensor`` on the model's output (normalize_batch), and a
    checkpoint every other step after the optimizer's: ``eval().cpu()``, ``torch.save``,
    ``to('cpu').train()`` (Module._apply sets ``p.grad.data = p.grad``)."""
    model, opt = state["model"], state["opt"]
    x = state["x"] + i
    y = model(x)
    mean = y.new_tensor([0.25, 0.5, 0.75]).view(1, -1)
    legacy = y.new([1.0, 2.0, 3.0])
    loss = ((y - mean) ** 2).mean() + (y * legacy).mean() * 1e-3
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    saved = b""
    if i % 2 == 1:
        model.eval().cpu()
        f = io.BytesIO()
        torch.save(model.state_dict(), f)
        saved = f.getvalue()
        model.to("cpu").train()
    return loss.detach(), mean, len(saved) > 0, [p.grad.clone() for p in model.parameters()]


def test_checkpointing_inside_the_step_is_eager() -> None:
    _assert_as_eager(_mlp_state, _checkpointing_step, 5)


def test_a_gradient_set_to_itself_keeps_its_value() -> None:
    """``p.grad.data = p.grad`` on a gradient of the step: after the step it is a plain tensor
    with eager's value (its placeholder had let go of its value, and stayed without one)."""

    def step(state: dict, i: int) -> torch.Tensor:
        model = state["model"]
        model.zero_grad()
        loss = model(state["x"]).sum()
        loss.backward()
        for p in model.parameters():
            p.grad.data = p.grad
        return loss.detach()

    _assert_as_eager(_mlp_state, step, 3)


# -- 2. torch.sparse.mm ---------------------------------------------------------------------


def _sparse_state() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    i = torch.tensor([[0, 1, 2, 3, 3], [1, 0, 2, 4, 0]])
    adjacency = torch.sparse_coo_tensor(i, torch.rand(5), (4, 5)).coalesce()
    return {"model": model, "opt": opt, "i": i, "adjacency": adjacency, "x": torch.randn(5, 5)}


def _sparse_step(state: dict, i: int) -> tuple:
    """A graph convolution: ``torch.sparse.mm`` of a sparse COO matrix made outside the step and
    one made inside it, with dense operands that require grad; then backward."""
    model, opt = state["model"], state["opt"]
    inside = torch.sparse_coo_tensor(state["i"], torch.arange(5.0) + i, (4, 5))
    h = model(state["x"])
    out = torch.sparse.mm(state["adjacency"], h) + torch.sparse.mm(inside, torch.tanh(h))
    csr = state["adjacency"].to_sparse_csr()
    out = out + torch.sparse.mm(csr, h)
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach(), out.detach()


def test_sparse_mm_in_the_step_is_eager() -> None:
    _assert_as_eager(_sparse_state, _sparse_step, 4)


# -- 3. torch.inference_mode() inside the step ----------------------------------------------


def _evaluating_step(state: dict, i: int) -> tuple:
    """A training step, and every other step an evaluation under ``torch.inference_mode()``
    (accuracy read with ``.item()``; views of parameters, ``split``, new tensors)."""
    model, opt, x, y = state["model"], state["opt"], state["x"], state["y"]
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i % 2 == 0:
        return loss.detach(), None
    with torch.inference_mode():
        logits = model(x)
        accuracy = (logits.argmax(1) == y).float().mean().item()
        weight_t = model[0].weight.t()  # (a view of a normal tensor: normal, as eager's)
        halves = logits.split(8)  # (views of an inference tensor: inference tensors)
        kinds = (logits.is_inference(), weight_t.is_inference(), [h.is_inference() for h in halves])
        scaled = logits * 2
    return loss.detach(), accuracy, kinds, scaled.is_inference(), scaled, weight_t.clone()


def test_inference_mode_inside_the_step_is_eager() -> None:
    _assert_as_eager(lambda: _mlp_state(adam=False), _evaluating_step, 4)


def _inference_then_backward(captured: bool) -> BaseException:
    """An inference tensor used in autograd after the ``with``: eager raises."""
    native.wait()
    state = _mlp_state()
    tape = coexec.GradientTape(key=("crashes", next(_keys)))
    for _ in range(2):
        try:
            with tape if captured else contextlib.nullcontext():
                with torch.inference_mode():
                    scale = state["x"].mean(0) + 1
                loss = (state["model"][0](state["x"]) * scale[0]).sum()
                loss.backward()
        except RuntimeError as e:
            error = e
    return error


def test_an_inference_tensor_in_autograd_raises_as_eager() -> None:
    want, got = _inference_then_backward(False), _inference_then_backward(True)
    assert type(got) is type(want) and str(got) == str(want)


# -- 4. two threads training at once ----------------------------------------------------------


def _thread_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-2), "x": torch.randn(32, 4)}


def _thread_step(state: dict, i: int) -> torch.Tensor:
    model, opt = state["model"], state["opt"]
    loss = model(state["x"] * (1 + i)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _train_in_threads(steps: int, hold_first: bool) -> tuple[list, list, list[coexec.GradientTape]]:
    """Two threads, each training its own model (made here, in turn) under its own default tape
    at the same time; with ``hold_first``, the first thread's first step waits inside the step
    until the second thread has run all its steps. (losses, final states, tapes) per thread."""
    native.wait()
    states = [_thread_state(1), _thread_state(2)]
    losses: list[list] = [[], []]
    tapes: list = [None, None]
    errors: list[BaseException] = []
    first_in, second_done = threading.Event(), threading.Event()
    go = threading.Barrier(2)
    key = ("crashes", next(_keys))  # (both threads' tapes: one program, as at one `with` line)

    def train(k: int) -> None:
        try:
            tape = tapes[k] = coexec.GradientTape(key=key)
            go.wait()
            if hold_first and k == 1:
                assert first_in.wait(60)
            for i in range(steps):
                with tape:
                    losses[k].append(_thread_step(states[k], i))
                    if hold_first and k == 0 and i == 0:
                        first_in.set()
                        assert second_done.wait(60)
            if k == 1:
                second_done.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            first_in.set()
            second_done.set()

    threads = [threading.Thread(target=train, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return losses, [_state_of(s) for s in states], tapes


def _eager_threads(steps: int) -> tuple[list, list]:
    states = [_thread_state(1), _thread_state(2)]
    losses = [[_thread_step(s, i) for i in range(steps)] for s in states]
    return losses, [_state_of(s) for s in states]


def test_a_step_beside_another_threads_captured_step_runs_as_eager() -> None:
    """The first thread's step is captured and held open while the second thread trains: the
    second's steps run eagerly (no error), each thread's training is eager's, and the stats
    count the steps that ran beside another thread's."""
    steps = 4
    want_losses, want_states = _eager_threads(steps)
    losses, states, tapes = _train_in_threads(steps, hold_first=True)
    assert _same(losses, want_losses)
    assert _same(states, want_states)
    s = tapes[0].stats
    assert (s.steps, s.coexec_steps, s.beside_steps) == (2 * steps, steps, steps)


def test_two_threads_training_at_once_are_eager() -> None:
    steps = 12
    want_losses, want_states = _eager_threads(steps)
    losses, states, tapes = _train_in_threads(steps, hold_first=False)
    assert _same(losses, want_losses)
    assert _same(states, want_states)
    s = tapes[0].stats
    assert s.steps == 2 * steps and s.coexec_steps + s.beside_steps == 2 * steps


# -- 5. a torch.compile'd model in the step ----------------------------------------------------


def _compiled_state(backend: str) -> dict:
    state = _mlp_state(5)
    # (in a tuple: _state_of reads the model once, through "model")
    state["compiled"] = (torch.compile(state["model"], backend=backend),)
    return state


def _compiled_step(state: dict, i: int) -> torch.Tensor:
    """The step of a compiled model: its input made in the step (a placeholder up to the
    region), the compiled forward, its backward (AOTAutograd's) and Adam's step."""
    (compiled,), opt = state["compiled"], state["opt"]
    opt.zero_grad()
    x = state["x"] * (1 + i)
    loss = nn.functional.cross_entropy(compiled(x), state["y"])
    loss.backward()
    opt.step()
    return loss.detach()


def _compiles(
    backend: str, steps: int, captured: bool
) -> tuple[list, list, coexec.GradientTape | None, dict]:
    """The compiled model trained from a fresh Dynamo; (results, state, tape, Dynamo's counts)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, state, tape = _run(lambda: _compiled_state(backend), _compiled_step, steps, captured)
    counters = torch._dynamo.utils.counters
    counted = {k: dict(v) for k, v in counters.items() if k in ("stats", "frames")}
    return got, state, tape, counted


def _assert_compiled_as_eager(backend: str, steps: int) -> None:
    want, want_state, _, want_counted = _compiles(backend, steps, False)
    got, got_state, tape, counted = _compiles(backend, steps, True)
    assert _same(got, want), f"losses differ:\ncaptured {got}\neager    {want}"
    assert len(got_state) == len(want_state)
    for i, (a, b) in enumerate(zip(got_state, want_state)):
        assert not is_placeholder(a)
        assert _same(a, b), f"state tensor {i} differs"
    # (compiled once, as without coexec: not once more per step, nor for the capture's keys)
    assert counted == want_counted, (counted, want_counted)
    assert counted["stats"]["unique_graphs"] >= 1
    s = tape.stats
    assert s.coexec_steps == steps and s.compiled_steps == steps, s


def test_a_compiled_model_in_the_step_is_eager_from_its_call() -> None:
    _assert_compiled_as_eager("aot_eager", 4)


def test_an_inductor_compiled_model_in_the_step_is_eager_from_its_call() -> None:
    _assert_compiled_as_eager("inductor", 4)


def test_meta_and_fake_tensors_in_the_step_are_theirs() -> None:
    """An op on meta tensors, or under a FakeTensorMode, runs below the capture (the capture's
    key is the highest backend's: it took them from the Meta kernels, answered with CPU
    placeholders without storage, and Dynamo read one's storage and crashed)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    native.wait()
    tape = coexec.GradientTape(key=("crashes", next(_keys)))
    w = torch.ones(3, requires_grad=True)
    for _ in range(2):
        with tape:
            m = torch.empty(2, 3, device="meta") + 1
            with FakeTensorMode() as mode:
                f = mode.from_tensor(torch.zeros(4, 3)) @ torch.ones(3, 5)
                size = f.untyped_storage().nbytes()
            loss = (w * 2).sum()
            loss.backward()
        assert m.is_meta and m.shape == (2, 3) and not is_placeholder(m)
        assert isinstance(f, FakeTensor) and f.shape == (4, 5) and size == 80
    assert torch.equal(w.grad, torch.full((3,), 4.0)) and tape.stats.coexec_steps == 2
