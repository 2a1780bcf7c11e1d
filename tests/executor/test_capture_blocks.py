"""Gradient blocks of the native capture (native/capture_blocks.h): a ``loss.backward()`` after
the same ops as a step before issues that step's gradient ops without the autograd engine, bit-equal
to eager, and runs the engine wherever Python or a hook runs in the backward, the graph or the
leaves' ``.grad`` differ, or the backward has arguments."""

from __future__ import annotations

import copy
import cProfile
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from executor import native
from executor.capture import Capture

pytestmark = pytest.mark.skipif(not native.enabled(), reason="capture runs on the native module")


class State:
    """A small MLP, its optimizer and four batches, the same for every seed-0 instance."""

    def __init__(self, opt: str = "sgd") -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
            torch.nn.Linear(16, 2),
        )  # fmt: skip
        params = self.model.parameters()
        self.opt = (
            torch.optim.Adam(params, lr=0.01) if opt == "adam" else torch.optim.SGD(params, lr=0.05)
        )
        self.data = [(torch.randn(6, 8), torch.randn(6, 2)) for _ in range(4)]
        self.log: list[Any] = []  # what hooks and Python backwards saw


def plain_step(
    s: State,
    i: int,
    predict: Callable[[torch.Tensor], torch.Tensor] | None = None,
    weight: float | None = None,
) -> torch.Tensor:
    """One step: the MSE of ``predict(x)`` (the model's output if None), times ``weight`` if one
    is given, its backward and the optimizer's step."""
    x, y = s.data[i % 4]
    s.opt.zero_grad()
    loss = F.mse_loss(s.model(x) if predict is None else predict(x), y)
    if weight is not None:
        loss = loss * weight
    loss.backward()  # (one line for every test's steps)
    s.opt.step()
    return loss.detach()


def run(
    step: Callable[[State, int], torch.Tensor], steps: int, opt: str = "sgd"
) -> tuple[list[int], list[str]]:
    """Run ``step`` eagerly and captured from equal states; assert losses, ``.grad`` after each
    step, parameters, optimizer state and what hooks saw bit-equal; return the gradient blocks
    per captured step and why each step's latest backward ran the engine."""
    eager, captured = State(opt), State(opt)
    capture = Capture()
    blocks, whys = [], []
    for i in range(steps):
        le = step(eager, i)
        before = capture.counters.gradient_blocks
        with capture.step():
            lc = step(captured, i)
        blocks.append(capture.counters.gradient_blocks - before)
        whys.append(capture.backward_why)
        assert torch.equal(le, lc), f"step {i}: loss {lc} against eager {le}"
        for (name, pe), pc in zip(eager.model.named_parameters(), captured.model.parameters()):
            assert (pe.grad is None) == (pc.grad is None), f"step {i}: {name}.grad"
            if pe.grad is not None:
                assert torch.equal(pe.grad, pc.grad), f"step {i}: {name}.grad differs"
                assert pe.grad._version == pc.grad._version, f"step {i}: {name}.grad's version"
            assert torch.equal(pe, pc), f"step {i}: {name} differs"
    for se, sc in zip(eager.opt.state.values(), captured.opt.state.values()):
        for k in se:
            assert torch.equal(torch.as_tensor(se[k]), torch.as_tensor(sc[k])), k
    assert len(eager.log) == len(captured.log)
    for a, b in zip(eager.log, captured.log):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    return blocks, whys


def test_a_path_seen_before_replays_its_block() -> None:
    """Step 0 meets its ops (answered without running them: capture_shapes.h) and makes the
    block, the others replay it."""
    blocks, whys = run(plain_step, 8)
    assert blocks == [0, 1, 1, 1, 1, 1, 1, 1]
    assert whys[1:] == [""] * 7


def test_adam_and_its_changing_step_size() -> None:
    blocks, _ = run(plain_step, 8, opt="adam")
    assert blocks[2:] == [1] * 6


def test_gradients_accumulate_into_the_grads_of_steps_before() -> None:
    """No zero_grad between steps: the block adds to the ``.grad`` the step found, in place
    (its version moves as eager's), and only where the leaves' grads are as when it was made."""

    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        loss = F.mse_loss(s.model(x), y)
        loss.backward()
        if i % 3 == 2:
            s.opt.step()
            s.opt.zero_grad(set_to_none=False)  # (zeroed in place: the grads stay real tensors)
        return loss.detach()

    blocks, _ = run(step, 12)
    assert sum(blocks) >= 6


def test_hooks_and_retain_grad_run_the_engine() -> None:
    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        s.opt.zero_grad()
        h = s.model[1](s.model[0](x))
        if i % 2:
            h.register_hook(lambda g: s.log.append(g.clone()))
        else:
            h.retain_grad()
        loss = F.mse_loss(s.model[2:](h), y)
        loss.backward()
        if not i % 2:
            s.log.append(h.grad.clone())
        s.opt.step()
        return loss.detach()

    blocks, whys = run(step, 6)
    assert blocks == [0] * 6
    assert all("hooks" in w for w in whys)


def test_a_python_backward_runs_every_step() -> None:
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        s.opt.zero_grad()
        loss = F.mse_loss(s.model(Scale.apply(x.requires_grad_())), y)
        loss.backward()
        s.log.append(x.grad.clone())
        x.grad = None
        x.requires_grad_(False)
        s.opt.step()
        return loss.detach()

    blocks, whys = run(step, 5)
    assert blocks == [0] * 5
    assert "Python node" in whys[-1]


def test_checkpointed_layers_run_the_engine() -> None:
    def step(s: State, i: int) -> torch.Tensor:
        return plain_step(
            s, i, lambda x: s.model[2:](checkpoint(s.model[:2], x, use_reentrant=False))
        )

    blocks, whys = run(step, 5)
    assert blocks == [0] * 5
    assert "saved-tensor hooks" in whys[-1]


def test_a_number_autograd_saves_is_part_of_the_path() -> None:
    """``leaky_relu``'s slope is a Scalar its backward reads: a step with another slope makes
    another block (one made for another slope would give other gradients)."""

    def step(s: State, i: int) -> torch.Tensor:
        return plain_step(s, i, lambda x: F.leaky_relu(s.model(x), 0.1 * (1 + i % 3)))

    blocks, _ = run(step, 12)
    assert blocks == [0, 0, 0] + [1] * 9


def test_a_number_wrapped_in_a_tensor_is_read_where_it_is() -> None:
    """``loss * w`` with a Python float: autograd saves the wrapped number, which the block
    reads from the step that replays it."""

    def step(s: State, i: int) -> torch.Tensor:
        return plain_step(s, i, weight=1.0 + i * 0.5)

    blocks, _ = run(step, 6)
    assert blocks[2:] == [1] * 4


def test_a_frozen_layer_changes_the_graph() -> None:
    """Freezing a layer leaves the forward's ops as they were; its graph is not, nor its block."""

    def step(s: State, i: int) -> torch.Tensor:
        if i == 4:
            s.model[0].requires_grad_(False)
        return plain_step(s, i)

    blocks, _ = run(step, 9)
    assert blocks[2:4] == [1, 1] and blocks[-1] == 1


def test_two_backwards_in_a_step() -> None:
    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        s.opt.zero_grad()
        out = s.model(x)
        F.mse_loss(out[:, :1], y[:, :1]).backward()
        loss = F.mse_loss(s.model(x)[:, 1:], y[:, 1:])
        loss.backward()
        s.opt.step()
        return loss.detach()

    blocks, _ = run(step, 6)
    assert blocks[2:] == [2] * 4


def test_an_input_that_requires_grad_gets_its_gradient() -> None:
    """The batch is a leaf too (a saliency map, an adversarial step): each step's own batch
    gets its ``.grad`` from the block, by its place in the graph."""

    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        x = x.clone().requires_grad_()
        s.opt.zero_grad()
        loss = F.mse_loss(s.model(x), y)
        loss.backward()
        s.log.append(x.grad)
        s.opt.step()
        return loss.detach()

    blocks, _ = run(step, 6)
    assert blocks[2:] == [1] * 4


def test_new_parameter_objects_get_the_gradients() -> None:
    """A layer replaced by a new one of the same shape between steps (the same ops, the same
    graph): the block binds the new parameters' ``.grad``."""

    def step(s: State, i: int) -> torch.Tensor:
        if i == 4:
            torch.manual_seed(1)
            s.model[2] = torch.nn.Linear(16, 16)
            s.opt = torch.optim.SGD(s.model.parameters(), lr=0.05)
        return plain_step(s, i)

    blocks, _ = run(step, 7)
    assert blocks[2:] == [1, 1, 0, 1, 1]  # (step 4 also initialised the layer: other ops)


def test_a_model_after_one_whose_paths_never_repeat_gets_blocks() -> None:
    """A sweep through one ``train()``: the first model's paths never repeat (its slope changes
    every step), so its blocks go unused and making them stops at that line, but for one every
    16 calls there (then 32, ...); the next model's paths repeat: the first block made for it is
    used, and the line makes blocks again."""

    def step(s: State, i: int, slope: float) -> torch.Tensor:
        return plain_step(s, i, lambda x: F.leaky_relu(s.model(x), slope))

    capture = Capture()
    first, second = State(), State()
    for i in range(20):
        with capture.step():
            step(first, i, 0.01 * (i + 1))
    assert "were not used" in capture.backward_why
    blocks = []
    for i in range(20):
        before = capture.counters.gradient_blocks
        with capture.step():
            step(second, i, 0.5)
        blocks.append(capture.counters.gradient_blocks - before)
    assert blocks[:6] == [0] * 6 and blocks[-3:] == [1, 1, 1]


def test_backward_with_arguments_runs_the_engine() -> None:
    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        s.opt.zero_grad()
        loss = F.mse_loss(s.model(x), y)
        loss.backward(retain_graph=True)
        loss.backward(torch.tensor(0.5))
        s.opt.step()
        return loss.detach()

    blocks, _ = run(step, 5)
    assert blocks == [0] * 5


@pytest.mark.parametrize(
    "backward",
    [
        lambda loss, model: loss.backward(),
        lambda loss, model: torch.autograd.grad(loss, list(model.parameters())),
    ],
    ids=["backward", "grad"],
)
def test_a_second_backward_through_a_replayed_graph_raises_as_eager(backward) -> None:
    """A replayed block lets go of the graph's saved tensors as the engine does."""
    s = State()
    capture = Capture()
    for i in range(4):
        with capture.step():
            x, y = s.data[i % 4]
            loss = F.mse_loss(s.model(x), y)
            backward(loss, s.model)
            if i == 3:
                assert capture.counters.gradient_blocks > 0
                with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                    backward(loss, s.model)


def test_a_profiler_running_leaves_the_engine_to_run() -> None:
    """cProfile's hook cannot be put back from Python (the watch for Python in the backward
    raised TypeError on leaving): while a profiler runs no block is made, and once it stops
    they are."""
    eager, captured = State(), State()
    capture = Capture()
    blocks = []
    profile = cProfile.Profile()
    for i in range(8):
        if i == 0:
            profile.enable()
        le = plain_step(eager, i)
        before = capture.counters.gradient_blocks
        with capture.step():
            lc = plain_step(captured, i)
        if i == 3:
            profile.disable()
            assert "a profiler is active" in capture.backward_why
        blocks.append(capture.counters.gradient_blocks - before)
        assert torch.equal(le, lc)
    assert blocks[:4] == [0] * 4 and blocks[-2:] == [1, 1]


def test_backward_outside_a_step_is_torchs_own() -> None:
    original = torch.autograd.backward
    capture = Capture()
    with capture.step():
        assert torch.autograd.backward is not original
    assert torch.autograd.backward is original


def test_the_blocks_gradients_are_plain_tensors_after_the_step() -> None:
    s = State()
    capture = Capture()
    for i in range(4):
        with capture.step():
            plain_step(s, i)
    grads = [copy.deepcopy(p.grad) for p in s.model.parameters()]
    assert all(g is not None and g.numpy() is not None for g in grads)


def test_a_model_deleted_after_its_steps_is_not_kept_alive() -> None:
    """The graph walk's leaves (the parameters) are let go of after each backward()."""
    capture = Capture()
    model = torch.nn.Linear(4, 1)
    weight = weakref.ref(model.weight)
    x = torch.randn(3, 4)
    for _ in range(4):
        with capture.step():
            model.zero_grad()
            model(x).sum().backward()
    del model
    gc.collect()
    assert weight() is None


# -- torch.autograd.grad --------------------------------------------------------------------


def grad_step(s: State, i: int, inputs: Callable[[State], list[torch.Tensor]] | None = None) -> torch.Tensor:
    """One step by ``torch.autograd.grad`` (the parameters' gradients set as ``.grad`` by hand,
    where the optimizer finds them); an input the loss does not reach gets None."""
    x, y = s.data[i % 4]
    loss = F.mse_loss(s.model(x), y)
    params = list(s.model.parameters()) if inputs is None else inputs(s)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    s.log.append([g is None for g in grads])
    for p, g in zip(params, grads):
        p.grad = g
    s.opt.step()
    return loss.detach()


def test_grad_of_the_parameters_replays_its_block() -> None:
    blocks, whys = run(grad_step, 6, opt="adam")
    assert blocks == [0, 1, 1, 1, 1, 1]
    assert whys[1:] == [""] * 5


def test_grad_of_some_parameters_replays_and_keeps_the_rest_of_the_graph() -> None:
    """``grad`` for the last layer runs only the nodes that lead to it (the engine's exec_info):
    the first layers' nodes keep what they saved, so a second loss through them still has its
    backward, as in eager; a parameter the loss does not reach gets None."""
    unused = torch.nn.Parameter(torch.ones(2))

    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        s.opt.zero_grad()
        h = s.model[:2](x)
        loss = F.mse_loss(s.model[2:](h), y)
        last = list(s.model[2:].parameters())
        grads = torch.autograd.grad(loss, [*last, unused], allow_unused=True)
        s.log.append(grads[-1] is None)
        # (through the first layers, which grad() did not run; an argument: the engine runs)
        h.pow(2).mean().backward(torch.tensor(1.0))
        for p, g in zip(last, grads):
            p.grad = g
        s.opt.step()
        return loss.detach()

    blocks, _ = run(step, 6)
    assert blocks[2:] == [1] * 4


def test_grad_materializes_unused_inputs_as_eager() -> None:
    unused = torch.nn.Parameter(torch.ones(3))

    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        loss = F.mse_loss(s.model(x), y)
        grads = torch.autograd.grad(loss, [*s.model.parameters(), unused], materialize_grads=True)
        s.log.append(grads[-1].clone())
        for p, g in zip(s.model.parameters(), grads):
            p.grad = g
        s.opt.step()
        return loss.detach()

    blocks, _ = run(step, 5)
    assert blocks[2:] == [1] * 3


def test_grad_of_an_unused_input_raises_as_eager_after_a_block() -> None:
    """A block made with ``allow_unused=True`` for an input it does not reach is not replayed for
    a call with ``allow_unused=False``: the engine runs and raises its error."""
    s = State()
    unused = torch.nn.Parameter(torch.ones(3))
    capture = Capture()
    for i in range(3):
        with capture.step():
            grad_step(s, i, lambda s: [*s.model.parameters(), unused])
    assert capture.counters.gradient_blocks == 2  # (steps 1 and 2)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        with capture.step():
            x, y = s.data[3]
            torch.autograd.grad(F.mse_loss(s.model(x), y), [*s.model.parameters(), unused])
    assert "allow_unused is False" in capture.backward_why


def test_grad_with_arguments_or_of_a_non_leaf_runs_the_engine() -> None:
    def step(s: State, i: int) -> torch.Tensor:
        x, y = s.data[i % 4]
        s.opt.zero_grad()
        h = s.model[:2](x)
        loss = F.mse_loss(s.model[2:](h), y)
        (gh,) = torch.autograd.grad(loss, h, retain_graph=True)  # (a non-leaf input)
        s.log.append(gh.clone())
        grads = torch.autograd.grad(loss, list(s.model.parameters()), torch.tensor(0.5))
        for p, g in zip(s.model.parameters(), grads):
            p.grad = g
        s.opt.step()
        return loss.detach()

    blocks, _ = run(step, 5)
    assert blocks == [0] * 5


def test_an_out_variant_that_resizes_is_met_again_and_its_path_repeats() -> None:
    """``torch.arange(n)`` resizes the empty ``out=`` its composite makes: it runs at once every
    step (Python sees the shape), yet is met again from the cache (its entry keeps the metadata
    that came in, not what went out: every step was a miss before, so no block followed), and the
    backward after it replays its block."""
    capture = Capture()
    w = torch.randn(5, requires_grad=True)
    misses, blocks = [], []
    for _ in range(5):
        c0 = capture.counters
        with capture.step():
            (w * torch.arange(5)).sum().backward()
        misses.append(capture.counters.misses - c0.misses)
        blocks.append(capture.counters.gradient_blocks - c0.gradient_blocks)
        w.grad = None
    assert misses[2:] == [0, 0, 0] and blocks[2:] == [1, 1, 1]
