"""A memory budget's guard on the native capture (``Capture.guard``, ``native/capture_worker.h``):
where an op would take the CPU allocator past its cap, the worker drops values it can make again
and makes them again where they are read. Steps stay bit-equal to eager; a cap that binds is held
(the peak measured by the counting allocator); a cap that does not bind costs no memory and no
recomputation."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from executor import native
from executor.capture import Capture

pytestmark = pytest.mark.skipif(not native.enabled(), reason="capture runs on the native module")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread (the peaks compared are then the same from run to run), restored
    after: later tests compare eager with captures made at the process's count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mlp(seed: int, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Dropout(dropout)) for _ in range(12)]
    return nn.Sequential(*layers)


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss


def captured_peaks(model: nn.Module, xs: list[torch.Tensor], cap: int | None) -> tuple[list[int], list[torch.Tensor], Capture]:
    """Each step's own peak (the bytes the allocator handed out in it, at their most), the guard's
    cap that many bytes (None: no guard), and the losses."""
    cpu = native.wait()
    capture = Capture()
    peaks, losses = [], []
    for x in xs:
        cpu.reset_cpu_peak()
        capture.guard(0 if cap is None else cap)
        with capture.step():
            loss = train_step(model, x)
        peaks.append(cpu.cpu_bytes_made()[1])
        losses.append(loss)
    capture.guard(0)
    return peaks, losses, capture


def remade() -> int:
    """Values made again so far in this process (the count is the process's)."""
    return Capture().counters.remade


def eager_losses(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [train_step(model, x) for x in xs]


def same_grads(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


def test_a_cap_that_binds_is_held_and_the_step_is_bit_equal() -> None:
    model, reference = mlp(0), mlp(0)
    xs = [torch.randn(512, 256, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    free, _, _ = captured_peaks(copy.deepcopy(model), xs, None)
    # (of the bytes the step makes, its gradients too: 3/4 of them, where the live bytes it was
    # counted by before left out the gradients of the step before, 2/3 then meant 4/5 of these)
    cap = free[-1] * 3 // 4
    remade0 = remade()
    peaks, losses, capture = captured_peaks(model, xs, cap)
    print(free, cap, peaks, capture.counters)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses(reference, xs)))
    assert same_grads(model, reference)
    c = capture.counters
    assert c.evicted > 0 and c.remade > remade0
    # (the first step meets each op's workspace as it runs it: the later ones are held)
    assert max(peaks[1:]) <= cap < min(free[1:])


@contextlib.contextmanager
def cpu_hogs(n: int):
    """``n`` processes spinning beside the test (kernels then run at other speeds)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.2)
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def guarded_runs_idle_and_beside_hogs() -> set:
    """What the same guarded steps dropped, made again and peaked at, run idle and beside CPU
    hogs (one element where they agree). Run in a fresh process by the test below."""
    torch.set_num_threads(1)
    xs = [torch.randn(512, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    free, _, _ = captured_peaks(mlp(0), xs, None)
    cap = free[-1] // 2

    def run() -> tuple:
        before = Capture().counters
        peaks, _, capture = captured_peaks(mlp(0), xs, cap)
        c = capture.counters
        return tuple(peaks), c.evicted - before.evicted, c.remade - before.remade, c.overruns - before.overruns

    seen = {run()}
    for _ in range(3):
        seen.add(run())
        with cpu_hogs(2):
            seen.add(run())
    return seen


def test_what_the_guard_drops_does_not_follow_how_fast_kernels_run() -> None:
    """The guard's choice among values of equal size follows a cost modeled from their ops'
    sizes, not measured kernel times: on an idle machine and beside CPU hogs the same steps drop
    and make again the same values and peak at the same bytes (with measured times, 1 in 4 runs
    of a budget test beside a hog chose a chain of dropped values that a backward op needed at
    once, over its budget; this test failed 4 of 4 runs then). In a fresh process. Inside the
    full suite it saw two outcomes (once on 2026-12-02; 2 of 2 clean-clone runs on 2026-12-07,
    and 1 of 11 runs alone) while the guard scored a value by whether Python still held it, a
    read of how far the step's thread had got; that term is gone (544cae9)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_capture_guard as t; "
        "seen = t.guarded_runs_idle_and_beside_hogs(); print(len(seen), sorted(seen))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    n, _, outcomes = done.stdout.strip().splitlines()[-1].partition(" ")
    assert n == "1", outcomes


def test_a_cap_that_does_not_bind_costs_no_memory_and_no_recomputation() -> None:
    model = mlp(1)
    xs = [torch.randn(256, 256, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    free, _, _ = captured_peaks(copy.deepcopy(model), xs, None)
    remade0 = remade()
    peaks, _, capture = captured_peaks(model, xs, 10 * max(free))
    assert peaks[1:] == free[1:]  # (what the program lets go of goes when eager frees it)
    assert capture.counters.evicted == 0 and capture.counters.remade == remade0


def test_random_ops_are_not_made_again_and_the_step_is_bit_equal() -> None:
    """Dropout's values cannot be made again (they would draw anew): the guard drops the others
    around them, and the masks are eager's."""
    model, reference = mlp(2, dropout=0.2), mlp(2, dropout=0.2)
    xs = [torch.randn(256, 256, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    free, _, _ = captured_peaks(copy.deepcopy(model), xs, None)
    torch.manual_seed(7)
    _, losses, capture = captured_peaks(model, xs, free[-1] * 3 // 4)
    torch.manual_seed(7)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses(reference, xs)))
    assert same_grads(model, reference)
    assert capture.counters.evicted > 0


def test_a_value_written_in_place_after_its_drop_is_made_from_its_inputs_before_the_write() -> None:
    """An input of a dropped value changed in place (an optimizer's update of a weight, here
    before the backward reads the value) makes the value first, from the weight as it was."""
    torch.manual_seed(3)
    w0 = torch.randn(256, 256) / 16
    x = torch.randn(512, 256)

    def step(w: torch.Tensor) -> torch.Tensor:
        hs, h = [], x
        for _ in range(8):
            h = torch.tanh(h @ w)
            hs.append(h)
        loss = h.square().mean()
        (g,) = torch.autograd.grad(loss, w, retain_graph=True)
        with torch.no_grad():
            w.mul_(0.5)  # (every dropped tanh's recipe reads w)
        return loss + hs[3].sum() + g.sum()

    w_eager = w0.clone().requires_grad_()
    expected = step(w_eager)
    cpu = native.wait()
    capture = Capture()
    w = w0.clone().requires_grad_()
    for cap in (None, 1):  # (a first step meets the ops; the second is held to 1 MB)
        cpu.reset_cpu_peak()
        capture.guard(0 if cap is None else 1_000_000)
        w.data.copy_(w0)
        with capture.step():
            got = step(w)
    capture.guard(0)
    assert capture.counters.evicted > 0
    assert torch.equal(got, expected) and torch.equal(w.detach(), w_eager.detach())


def test_a_described_step_under_a_guard_finds_the_state_an_unguarded_one_does() -> None:
    """Values the guard made again in a described step are the storages they were dropped from
    to its description: read again, a new storage counted as existing before the step (its
    state), and a plan made from it counted the remade activations as persistent."""

    def described(cap: int | None):
        model = mlp(2)
        x = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
        cpu, capture = native.wait(), Capture()
        for describe in (False, True):
            if describe:
                capture.describe_next()
            cpu.reset_cpu_peak()
            capture.guard(0 if cap is None else cap)
            with capture.step():
                train_step(model, x)
        capture.guard(0)
        return capture.description(), capture.counters

    free, _ = described(None)
    free_peak = captured_peaks(mlp(2), [torch.randn(512, 256)] * 2, None)[0][-1]
    guarded, counters = described(free_peak * 2 // 3)
    assert counters.remade > 0
    state = [sum(n for n, e in zip(d.storage_bytes, d.existed) if e) for d in (free, guarded)]
    assert state[0] == state[1], state
    assert len(guarded.ops) == len(free.ops) and len(guarded.storage_bytes) == len(free.storage_bytes)


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(RuntimeError, match="a guard's cap is a byte count"):
        Capture().guard(-1)
