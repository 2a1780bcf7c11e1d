"""Capture (executor/capture.py, native/capture.cpp): steps whose ATen ops a C++ kernel answers
while a worker computes them train bit-equal to eager, answer from the cache once warm, read
values where Python reads them, and report failures with the op's line."""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from executor import native
from executor.capture import Capture, is_placeholder
from tests.coexec.helpers import tensors_of

pytestmark = pytest.mark.skipif(not native.enabled(), reason="capture runs on the native module")


class Classifier:
    """A classifier's step: a batch of ``shape`` with labels below ``classes``, drawn from a
    generator seeded by the step, cross-entropy, ``opt``."""

    shape: tuple[int, ...]
    classes: int

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def step(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.shape, generator=g)
        y = torch.randint(0, self.classes, self.shape[:1], generator=g)
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss


class Mlp(Classifier):
    shape, classes = (5, 8), 4

    def __init__(self) -> None:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


class Cnn(Classifier):
    """Convolutions, batch norm (running statistics written in place) and Adam (state made in
    the first step)."""

    shape, classes = (4, 3, 8, 8), 10

    def __init__(self) -> None:
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10),
        )  # fmt: skip
        super().__init__(model, torch.optim.Adam(model.parameters(), lr=1e-3))


class LstmLm:
    """An LSTM language model with dropout (the CPU generator, in the ops' order), gradient
    clipping (foreach ops) and AdamW."""

    def __init__(self) -> None:
        self.emb = torch.nn.Embedding(50, 16)
        self.lstm = torch.nn.LSTM(16, 16, num_layers=2, dropout=0.2)
        self.head = torch.nn.Linear(16, 50)
        params = [*self.emb.parameters(), *self.lstm.parameters(), *self.head.parameters()]
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=1e-3)

    def step(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 50, (7, 3), generator=g)
        self.opt.zero_grad()
        out, _ = self.lstm(F.dropout(self.emb(tokens[:-1]), 0.1))
        loss = F.cross_entropy(self.head(out).flatten(0, 1), tokens[1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 0.5)
        self.opt.step()
        return loss


class Branchy:
    """Python control flow on values: ``.item()`` per block."""

    def __init__(self) -> None:
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))
        self.opt = torch.optim.SGD(self.blocks.parameters(), lr=0.05)

    def step(self, i: int) -> torch.Tensor:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        self.opt.zero_grad()
        for block in self.blocks:
            y = block(x)
            x = torch.relu(y) if y.mean().item() > 0 else torch.tanh(y)
        loss = x.pow(2).mean()
        loss.backward()
        self.opt.step()
        return loss


MODELS = {"mlp": Mlp, "cnn": Cnn, "lstm-lm": LstmLm, "branchy": Branchy}


def train(
    make: Callable[[], Any], steps: int, capture: Capture | None
) -> tuple[list[float], list[torch.Tensor]]:
    """``steps`` steps of a model from one seed, captured or eager: losses and final state."""
    torch.manual_seed(0)
    state = make()
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        if capture is None:
            loss = state.step(i)
        else:
            with capture.step():
                loss = state.step(i)
        losses.append(loss.item())
    return losses, tensors_of(vars(state))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_captured_steps_are_bit_equal_to_eager(name: str) -> None:
    want_losses, want_state = train(MODELS[name], 4, None)
    got_losses, got_state = train(MODELS[name], 4, Capture())
    assert got_losses == want_losses
    assert len(got_state) == len(want_state) > 0
    for want, got in zip(want_state, got_state):
        assert not is_placeholder(got)
        assert torch.equal(want, got)


def test_replay_mode_tapes_every_op() -> None:
    """Nothing computed while the step runs; its tape, run before the step ends, gives eager's
    values: the kernel saw every op eager runs, in an order that gives them."""
    want_losses, want_state = train(Mlp, 3, None)
    capture = Capture("replay")
    torch.manual_seed(0)
    state = Mlp()
    losses = []
    for i in range(3):
        torch.manual_seed(100 + i)
        with capture.step():
            loss = state.step(i)
            assert capture.counters.taped > 0
            capture.replay()
        losses.append(loss.item())
    assert losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(want_state, tensors_of(vars(state))))


# (ahead: the MLP's momentum buffers of its two biases, 64 and 16 bytes, ``buf.mul_(momentum)``;
# the CNN's Adam step counts, ``step_t += 1`` and ``step_t.item()`` for each of 6 parameters,
# ``exp_avg_sq.mul_(beta2)`` for the 4 of at most 64 bytes, and batch norm's
# ``num_batches_tracked.add_(1)``)
@pytest.mark.parametrize(("name", "ahead"), [("mlp", 2), ("cnn", 17)])
def test_a_warm_step_is_answered_from_the_cache(name: str, ahead: int) -> None:
    """After the first steps (Adam's and momentum's state appear in them) no op misses, none
    waits (Adam's ``step_t += 1`` and ``step_t.item()`` per parameter, on a real 4-byte tensor
    no queued op touches, run ahead of the worker: they waited for the whole backward), and
    every warm step has as many ops: the tape holds its placeholders' slots,
    not the placeholders, so autograd steals each gradient into ``.grad`` as eager does (holding
    them made extra copies, as many as the worker was behind)."""
    torch.manual_seed(0)
    state, capture = MODELS[name](), Capture()
    for i in range(3):
        with capture.step():
            state.step(i)
    counts = [capture.counters]
    for i in range(3, 6):
        with capture.step():
            state.step(i)
        counts.append(capture.counters)
    assert {c.misses for c in counts} == {counts[0].misses}
    assert {b.run_now - a.run_now for a, b in itertools.pairwise(counts)} == {0}
    assert {b.ran_ahead - a.ran_ahead for a, b in itertools.pairwise(counts)} == {ahead}
    per_step = {b.ops - a.ops for a, b in itertools.pairwise(counts)}
    assert len(per_step) == 1 and per_step.pop() > 20


def _not_cached(capture: Capture) -> int:
    """Ops the cache did not answer: misses (run at once) and ops the shape oracle answered."""
    c = capture.counters
    return c.misses + c.shaped


def test_sizes_that_come_back_are_answered_from_the_cache() -> None:
    """A last batch of another size, lengths drawn from a range: each size is new once (the
    shape oracle answers it), then answered from the cache."""
    torch.manual_seed(0)
    lin, capture = torch.nn.Linear(4, 2), Capture()
    new = []
    for n in (3, 5, 7, 5, 3, 7, 3, 5):
        with capture.step():
            lin.zero_grad()
            lin(torch.ones(n, 4)).sum().backward()
        new.append(_not_cached(capture))
    assert new[2] > new[1] > new[0] > 0
    assert set(new[2:]) == {new[2]}


def test_arguments_that_are_not_tensors_tell_cached_ops_apart() -> None:
    """At one line and with the same input, a view's shape, a reduction's dims (a list, or None)
    and a dtype make other ops; each is new once, then answered from the cache, right."""
    x = torch.arange(24.0)
    capture = Capture()
    cases = [
        ((2, 12), [0], torch.float64),
        ((12, 2), [1], torch.float32),
        ((4, 6), None, torch.float64),
    ]
    cases += [((2, 12), [1], torch.float64), ((2, 12), [0], torch.float32)]
    new = []
    for shape, dims, dtype in cases * 3:
        with capture.step():
            y = x.view(shape).sum(dim=dims, dtype=dtype)
        assert y.dtype == dtype
        assert torch.equal(y, x.view(shape).sum(dim=dims, dtype=dtype))
        new.append(_not_cached(capture))
    first = len(cases)
    assert all(a < b for a, b in itertools.pairwise(new[:first]))
    assert set(new[first - 1 :]) == {new[first - 1]}


def test_item_runs_at_once_and_only_it() -> None:
    torch.manual_seed(0)
    state, capture = Branchy(), Capture()
    for i in range(2):
        with capture.step():
            state.step(i)
    before = capture.counters
    with capture.step():
        state.step(2)
    after = capture.counters
    assert after.misses == before.misses
    assert after.run_now - before.run_now == 3  # one _local_scalar_dense per block


def test_python_reads_values_inside_a_step() -> None:
    """numpy(), tolist(), printing a 1-D tensor and formatting a number wait for the value (of
    more than 64 bytes: ops on smaller real tensors run ahead, their values real at once)."""

    def work(x: torch.Tensor) -> tuple[Any, ...]:
        y = (x * 2).sin()
        return y.detach().numpy().copy(), y.tolist(), str(y), f"{y.sum():.4f}", repr(y[1:])

    x = torch.linspace(0, 1, 20)
    want = work(x)
    capture = Capture()
    for _ in range(2):  # (the second: every op answered from the cache)
        with capture.step():
            got = work(x)
        assert (got[0] == want[0]).all()
        assert got[1:] == want[1:]


def test_tensors_made_in_a_step_are_plain_after_it() -> None:
    torch.manual_seed(0)
    state, capture = Mlp(), Capture()
    for i in range(2):
        with capture.step():
            loss = state.step(i)
            kept = loss.detach()
            assert is_placeholder(loss)  # (the first step's too: the shape oracle answers new ops)
    grad = state.model[0].weight.grad
    assert not is_placeholder(loss) and not is_placeholder(kept) and not is_placeholder(grad)
    assert grad.numpy().shape == (16, 8)
    buffer = io.BytesIO()
    torch.save({"loss": loss, "grad": grad}, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer)["grad"], grad)
    assert (loss * 2).item() == loss.item() * 2  # (ops on it run as on any tensor)


def test_in_place_ops_that_change_shape_and_factories_of_new_sizes() -> None:
    capture = Capture()
    for n in (3, 3, 5, 3):
        with capture.step():
            t = torch.arange(n, dtype=torch.float32)
            t.unsqueeze_(0)
            shape = tuple(t.shape)
            u = torch.zeros(2, n).add_(1).t_()
        assert shape == (1, n)
        assert torch.equal(t, torch.arange(n, dtype=torch.float32).unsqueeze(0))
        assert torch.equal(u, torch.ones(n, 2))


def _select(w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.index_select(w, 0, index)


def test_a_failure_on_the_worker_is_eagers_error_with_the_ops_line() -> None:
    """The indices of the second step are out of range, which only running the op finds: the
    step raises at its end eager's IndexError with eager's message, its traceback going on to
    the op's line and a note naming it; the next step runs."""
    w = torch.randn(40, 3)  # (480 bytes: its ops are queued, not run ahead as ops on small tensors)
    with pytest.raises(IndexError) as eager:
        _select(w, torch.tensor([0, 99]))
    capture = Capture()
    with capture.step():
        _select(w, torch.tensor([0, 1])).sum()
    line = _select.__code__.co_firstlineno + 1
    with pytest.raises(IndexError) as captured, capture.step():
        _select(w, torch.tensor([0, 99])).sum()
    assert str(captured.value) == str(eager.value)
    (note,) = captured.value.__notes__
    assert re.search(rf"test_capture\.py:{line} in _select", note)
    assert traceback.extract_tb(captured.value.__traceback__)[-1][:3] == (__file__, line, "_select")
    with capture.step():
        total = _select(w, torch.tensor([2, 3])).sum()
    assert total.item() == w[2:4].sum().item()


def test_a_small_op_that_fails_raises_the_earlier_error_of_a_queued_op() -> None:
    """A queued op fails on the worker (indices out of range), then an op on small real tensors,
    run ahead, fails too: the error raised is the queued op's, the one eager raises, with no
    other error before it (the small op's, which eager never met). The indices are tensors the
    program keeps and sets between steps, so the steps meet the same ops (a new tensor made
    outside the dispatcher is a new constant: its op would run at once, after the worker)."""
    w, small = torch.randn(40, 3), torch.zeros(4)
    index, small_index = torch.tensor([0, 1]), torch.tensor([1])

    def step() -> torch.Tensor:
        _select(w, index).sum()
        return small[small_index]

    capture = Capture()
    for _ in range(2):
        before = capture.counters.ran_ahead
        with capture.step():
            step()
    assert capture.counters.ran_ahead > before  # (the small op runs ahead once warm)
    index[1], small_index[0] = 99, 7
    with pytest.raises(IndexError) as eager:
        step()
    before = capture.counters.ran_ahead
    with pytest.raises(IndexError) as captured, capture.step():
        step()
    assert capture.counters.ran_ahead > before  # (it failed ahead of the worker)
    assert str(captured.value) == str(eager.value)
    assert captured.value.__context__ is None
    index[1] = 3
    with capture.step():
        total = _select(w, index).sum()
    assert total.item() == w[[0, 3]].sum().item()


def _look_up(table: torch.nn.Module, index: torch.Tensor) -> torch.Tensor:
    return table(index).sum()


def test_a_failure_inside_torch_names_the_users_line_then_torchs() -> None:
    """The failing op is made inside torch (``nn.Embedding.forward`` calls ``F.embedding``):
    the error's note names the user's line that called the module first, then torch's line."""
    table = torch.nn.Embedding(4, 3)
    capture = Capture()
    with capture.step():
        _look_up(table, torch.tensor([0, 1]))
    line = _look_up.__code__.co_firstlineno + 1
    sep = re.escape(os.sep)
    with pytest.raises(IndexError, match="index out of range") as failed, capture.step():
        _look_up(table, torch.tensor([0, 9]))
    (note,) = failed.value.__notes__
    assert re.search(
        rf"called at \S*test_capture\.py:{line} in _look_up, in \S*torch{sep}nn{sep}functional\.py:\d+ in embedding;",
        note,
    )


def test_a_failure_on_the_worker_has_a_traceback_to_the_users_line() -> None:
    """Raised at the step's end, the error's traceback goes on to the user's line and torch's,
    with their source, as if the op had failed there."""
    table = torch.nn.Embedding(4, 3)
    capture = Capture()
    with capture.step():
        _look_up(table, torch.tensor([0, 1]))
    with pytest.raises(IndexError) as failed, capture.step():
        _look_up(table, torch.tensor([0, 9]))
    *_, user, lib = traceback.extract_tb(failed.value.__traceback__)
    assert (Path(user.filename).name, user.lineno, user.name) == (
        "test_capture.py",
        _look_up.__code__.co_firstlineno + 1,
        "_look_up",
    )
    assert user.line == "return table(index).sum()"
    assert (
        Path(lib.filename).parts[-3:] == ("torch", "nn", "functional.py")
        and lib.name == "embedding"
    )
    assert lib.line.startswith("return torch.embedding(")


def test_steps_after_the_worker_napped_or_slept() -> None:
    """Between steps the worker polls, then naps (a read wakes it), then sleeps (an op wakes
    it): steps that read values early (``.item()`` per block) after each pause are eager's."""
    torch.manual_seed(0)
    eager = Branchy()
    torch.manual_seed(0)
    captured, capture = Branchy(), Capture()
    for i, pause in enumerate((0.0, 0.0, 0.0005, 0.005, 0.02, 0.15, 0.005, 0.15)):
        time.sleep(pause)  # (after 1 ms the worker naps; after 100 ms more it sleeps)
        with capture.step():
            got = captured.step(i)
        assert torch.equal(got, eager.step(i))
    pairs = zip(tensors_of(captured), tensors_of(eager), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_step_with_more_ops_than_the_ring_holds() -> None:
    """The skeleton issues 9000 in-place adds far faster than the worker runs them: past 8192
    queued ops it waits for the worker (the ring is full), and every add is made, in order."""
    x = torch.zeros(100_000)
    eager = x.clone()
    for k in range(9000):
        eager.add_(k % 7)
    capture = Capture()
    for _ in range(2):  # (the second step is answered from the cache: every add queued)
        y = x.clone()
        with capture.step():
            for k in range(9000):
                y.add_(k % 7)
        assert torch.equal(y, eager)
    assert capture.counters.run_now < 9000 * 2


def test_an_op_that_fails_at_once_raises_where_eager_does() -> None:
    with pytest.raises(RuntimeError) as eager:
        torch.ones(2) @ torch.ones(3)
    capture = Capture()
    with pytest.raises(RuntimeError, match=re.escape(str(eager.value))), capture.step():
        torch.ones(2) @ torch.ones(3)
    with capture.step():
        y = torch.ones(2) @ torch.ones(2)
    assert y.item() == 2.0


def test_the_wrapped_methods_are_torchs_own_outside_a_step() -> None:
    """torch's ``__torch_function__`` handling and the recorder tell these methods apart by
    identity: the wrappers are in place only while a step runs."""
    names = ("numpy", "tolist", "__repr__", "__format__", "data_ptr")
    before = {name: getattr(torch.Tensor, name) for name in names}
    seeds = (torch.manual_seed, torch.random.manual_seed)
    capture = Capture()
    with capture.step():
        inside = {name: getattr(torch.Tensor, name) for name in names}
    assert all(inside[name] is not before[name] for name in names)
    assert {name: getattr(torch.Tensor, name) for name in names} == before
    assert (torch.manual_seed, torch.random.manual_seed) == seeds


def test_other_threads_see_torchs_own_methods_during_a_step() -> None:
    """The wrappers are the step's thread's only: a thread beside it reads torch's objects."""
    before = torch.Tensor.numpy
    capture = Capture()
    seen = {}
    with capture.step():
        reader = threading.Thread(target=lambda: seen.update(numpy=torch.Tensor.numpy))
        reader.start()
        reader.join()
        assert torch.Tensor.numpy is not before
    assert seen["numpy"] is before
    assert torch.Tensor.numpy is before


def test_reading_a_real_tensor_waits_for_its_writes() -> None:
    """``zeros`` makes a real tensor at once (its ``empty``) and queues the writes: a read of
    its memory waits for them."""
    capture = Capture()
    for _ in range(3):
        with capture.step():
            x = torch.zeros(2_000_000)
            for _ in range(4):
                x.add_(1)
            first, last = x.numpy()[0], x.tolist()[-1]
        assert (first, last) == (4.0, 4.0)


def test_random_numbers_follow_the_ops_order() -> None:
    """(``rand`` is an ``empty`` made at once, filled by the worker: reading it waits too.)"""

    def draws() -> list[float]:
        a = torch.rand(3)
        torch.manual_seed(7)
        b = torch.rand(3)
        state = torch.get_rng_state()
        c = torch.rand(2)
        torch.set_rng_state(state)
        return [*a.tolist(), *b.tolist(), *c.tolist(), *torch.rand(2).tolist()]

    torch.manual_seed(1)
    want = draws()
    capture = Capture()
    for _ in range(2):
        torch.manual_seed(1)
        with capture.step():
            got = draws()
        assert got == want


def test_bad_uses_say_what_is_wrong() -> None:
    with pytest.raises(
        RuntimeError, match="a capture's mode is 'async', 'replay' or 'tape', not 'fast'"
    ):
        Capture("fast")  # type: ignore[arg-type]
    first, second = Capture(), Capture()
    nested = second.step()
    with first.step(), pytest.raises(RuntimeError, match="a step is already being captured"):
        nested.__enter__()
    with pytest.raises(RuntimeError, match="replay\\(\\) is for a capture in 'replay' mode"):
        first.replay()


def test_a_copy_of_a_model_trained_under_capture_is_plain() -> None:
    torch.manual_seed(0)
    state, capture = Mlp(), Capture()
    for i in range(2):
        with capture.step():
            state.step(i)
    clone = copy.deepcopy(state.model)
    assert all(torch.equal(a, b) for a, b in zip(clone.parameters(), state.model.parameters()))


def test_the_cpu_byte_count_is_exact() -> None:
    """``count_cpu_bytes`` (bench/native_memory.py) wraps the process's CPU allocator for good, so
    it is checked in a process of its own: a tensor's bytes are live while it is, the peak holds
    the most, and kernels that allocate through ``raw_allocate`` (convolutions) work over it."""
    code = (
        "import torch\n"
        "from executor import native\n"
        "m = native.wait()\n"
        "m.count_cpu_bytes()\n"
        "live0, _ = m.cpu_bytes()\n"
        "m.reset_cpu_peak()\n"
        "a = torch.empty(1000)\n"
        "b = torch.empty(250, dtype=torch.float64)\n"
        "assert m.cpu_bytes()[0] - live0 == 4000 + 2000, m.cpu_bytes()\n"
        "del a\n"
        "live, peak = m.cpu_bytes()\n"
        "assert (live - live0, peak - live0) == (2000, 6000), (live - live0, peak - live0)\n"
        "y = torch.nn.functional.conv2d(torch.ones(1, 3, 8, 8), torch.ones(4, 3, 3, 3))\n"
        "assert y[0, 0, 0, 0].item() == 27.0\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_sparse_gradients_run_at_once_bit_equal_to_eager() -> None:
    """``nn.Embedding(sparse=True)``: the capture's key sent the sparse gradient's constructor to
    SparsePrivateUse3, which has no kernel (NotImplementedError); ops on sparse tensors now run
    at once on the values, and the backward with one runs the engine."""

    def train(capture: Capture | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        emb, lin = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1)
        opt = torch.optim.SGD([*emb.parameters(), *lin.parameters()], lr=0.1)
        for i in range(5):
            idx = torch.tensor([1, 2, i])
            with capture.step() if capture is not None else contextlib.nullcontext():
                opt.zero_grad()
                loss = lin(emb(idx)).pow(2).sum()
                loss.backward()
                opt.step()
            assert emb.weight.grad.is_sparse
        return [loss.detach(), emb.weight.detach().clone(), lin.weight.detach().clone()]

    capture = Capture()
    for a, b in zip(train(None), train(capture)):
        assert torch.equal(a, b)
    assert "sparse" in capture.backward_why


def test_an_op_on_a_small_tensor_a_queued_op_reads_waits_its_turn() -> None:
    """A small real tensor that a queued op reads (``big * scale`` behind matmuls the worker is
    still running) and that is then written in place: the write is queued too, not run ahead,
    so the read sees the value from before it, as in eager. A small tensor no queued op
    touches (a step count and its ``.item()``) runs ahead."""
    w = torch.randn(400, 400, generator=torch.Generator().manual_seed(0))

    def step(scale: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        big = (w @ w @ w @ w).sum()  # (the worker is busy here for milliseconds)
        y = big * scale
        scale.add_(1.0)  # (y's mul, queued, reads scale: this waits its turn)
        count.add_(1)  # (nothing queued touches count: it runs ahead)
        return y, y + scale, count.item()

    scale, count = torch.tensor(2.0), torch.tensor(0)
    want = [step(scale, count) for _ in range(4)]
    scale, count, capture = torch.tensor(2.0), torch.tensor(0), Capture()
    for i in range(4):
        before = capture.counters
        with capture.step():
            y, z, n = step(scale, count)
        assert torch.equal(y, want[i][0]) and torch.equal(z, want[i][1]) and n == want[i][2]
        ahead = capture.counters.ran_ahead - before.ran_ahead
    assert ahead == 2  # (count.add_ and count.item(): scale.add_ was queued)
