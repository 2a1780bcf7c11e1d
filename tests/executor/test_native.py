"""The native block runner: the same values, frees and byte counts as the Python runner; its
count of live bytes agrees with executor/memory.py's; where it cannot be built, the executor
runs in Python after one warning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import Executor, ExecutorError, Free, Launch, LiveBytes, ResetPeak, native
from executor.memory import span_bytes
from tests.executor.test_block_runs import block, deferred
from tests.executor.test_recompute import V

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not native.enabled(), reason="COEXEC_NATIVE=0")


@pytest.fixture
def built():
    return native.wait(600)


def python_only(monkeypatch):
    """Executors made from here on run in Python (as before the native runner is built)."""
    monkeypatch.setattr(native, "ready", lambda: None)


def attention_like_block(ex, arena=None):
    """A block mixing plain ops, a tensor-list argument, an in-place op, a view, a Python
    number where a tensor is wanted and a data-dependent result; returns its launch order."""
    if arena is not None:
        ex.submit(ResetPeak(arena))
    torch.manual_seed(0)
    q, k = torch.randn(8, 16), torch.randn(8, 16)
    ex.submit(deferred(aten.mm.default, q, aten.t.default(k), outs=[1], index=0))
    ex.submit(deferred(aten.mul.Tensor, V(1), 0.25, outs=[2], index=1))
    ex.submit(deferred(aten._softmax.default, V(2), -1, False, outs=[3], index=2))
    ex.submit(deferred(aten.cat.default, [q, k], outs=[4], index=3))
    ex.submit(deferred(aten.view.default, V(3), [64], outs=[5], index=4))
    run = deferred(aten.add_.Tensor, V(5), 1.0, outs=[6], index=5)
    run.moves = ((5, 6),)
    ex.submit(run)
    ex.submit(deferred(aten.sum.default, V(4), outs=[7], index=6))
    last = deferred(aten.max.default, V(6), outs=[8], index=7)
    last.keep_result = True
    ex.submit(last)
    ex.submit(Free((1, 2)))
    return (3, 0, 1, 2, 4, 5, 6, 7)


def test_a_block_runs_natively_with_the_values_frees_and_bytes_of_the_python_runner(built, monkeypatch):
    fast = Executor("native")
    slow = None
    try:
        for ex in (fast, "python"):
            if ex == "python":
                python_only(monkeypatch)
                ex = slow = Executor("python")
            order = attention_like_block(ex)
            ex.submit(Launch(block(order)))
            ex.drain(10)
        assert fast.stats().native_runs == 1 and slow.stats().native_runs == 0
        assert sorted(fast._w.values) == sorted(slow._w.values) == [3, 4, 6, 7, 8]
        for vid in fast._w.values:
            assert torch.equal(fast._w.values[vid], slow._w.values[vid])
        assert fast.take_result(7).item() == slow.take_result(7).item()
        assert (fast._w.memory.live, fast._w.memory.peak) == (slow._w.memory.live, slow._w.memory.peak)
        assert not fast._w.pending and not fast._w.future and not fast._w.released
    finally:
        fast.close()
        if slow is not None:
            slow.close()


def test_arena_outputs_go_to_their_planned_offsets_natively(built, ex):
    arena = torch.zeros(4096, dtype=torch.uint8)
    ex.submit(ResetPeak(arena))
    shape, stride = (16, 16), (16, 1)
    n = span_bytes(shape, stride, torch.float32)
    a = deferred(aten.mm.default, torch.eye(16), torch.ones(16, 16), outs=[1], index=0)
    a.arena_out = (aten.mm.out, ("out",), ((1024, shape, stride, torch.float32, n),))
    ex.submit(a)
    ex.submit(Launch(block((0,))))
    ex.drain(10)
    t = ex._w.values[1]
    assert ex.stats().native_runs == 1 and ex.stats().arena_hits == 1
    assert ex._w.memory.offset_of(t) == 1024 and torch.equal(t, torch.ones(16, 16))
    assert ex._w.memory.peak == 4096 and not ex._w.memory.free(1024, n)


def test_an_op_failing_natively_reports_the_python_exception_and_frees_what_it_should(built, ex):
    ex.submit(deferred(aten.ones.default, [4], outs=[1], index=0))
    ex.submit(deferred(aten.index_select.default, V(1), 0, torch.tensor([9]), outs=[2], index=1))
    ex.submit(deferred(aten.neg.default, V(1), outs=[3], index=2))
    ex.submit(Free((1,)))
    ex.submit(Launch(block((0, 1, 2))))
    with pytest.raises(ExecutorError, match="IndexError: index out of range in self") as err:
        ex.drain(10)
    assert err.value.op_index == 1 and isinstance(err.value.__cause__, IndexError)
    assert ex.stats().native_runs == 1 and not ex._w.values  # 1 freed, 2 and 3 never made


def test_the_python_count_is_taken_over_when_the_runner_becomes_ready(built, monkeypatch):
    python_only(monkeypatch)
    ex = Executor("late")
    try:
        ex.submit(deferred(aten.ones.default, [256], outs=[1], index=0))
        ex.submit(Launch(None))
        ex.drain(10)
        assert type(ex._w.memory) is LiveBytes and ex.stats().native_runs == 0
        monkeypatch.setattr(native, "ready", lambda: built)
        ex.submit(ResetPeak(None))
        ex.submit(deferred(aten.neg.default, V(1), outs=[2], index=1))
        ex.submit(Launch(None))
        ex.submit(Free((1,)))
        ex.drain(10)
        assert type(ex._w.memory) is built.LiveBytes and ex.stats().native_runs == 1
        assert ex._w.recipes.memory is ex._w.memory is ex._w.offloads.memory
        assert ex._w.memory.live == 1024 and ex._w.memory.peak == 2048
    finally:
        ex.close()


events = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.integers(1, 4096)),  # a tensor of its own
        st.tuples(st.just("view"), st.integers(0, 50)),  # another value on a held storage
        st.tuples(st.just("region"), st.integers(0, 3000), st.integers(1, 1024)),  # in the arena
        st.tuples(st.just("drop"), st.integers(0, 50)),
        st.tuples(st.just("reset"),),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(events)
def test_the_native_count_of_live_bytes_is_the_python_count(evs):
    mod = native.wait(600)
    counts = [LiveBytes(), mod.LiveBytes()]
    arena = torch.zeros(4096, dtype=torch.uint8)
    for c in counts:
        c.attach(arena)
    held: list[list] = [[], []]
    for ev in evs:
        for c, mine in zip(counts, held):
            if ev[0] == "new":
                t = torch.empty(ev[1], dtype=torch.uint8)
                c.add(t, ())
                mine.append(t)
            elif ev[0] == "view" and mine:
                t = mine[ev[1] % len(mine)][:1]
                c.add(t, ())
                mine.append(t)
            elif ev[0] == "region" and c.free(ev[1], ev[2]):
                t = c.region(ev[1], ev[2])
                c.add(t, ())
                mine.append(t)
            elif ev[0] == "drop" and mine:
                c.remove(mine.pop(ev[1] % len(mine)))
            elif ev[0] == "reset":
                c.reset_peak()
        a, b = counts
        assert (a.live, a.peak) == (b.live, b.peak)
        assert all(a.free(o, 64) == b.free(o, 64) for o in range(0, 4096, 64))


def test_without_a_compiler_the_executor_runs_in_python_after_one_warning(tmp_path):
    program = textwrap.dedent(
        """
        import warnings
        import torch
        from executor import Executor, Launch, native
        from tests.executor.test_block_runs import deferred
        from tests.executor.test_recompute import V
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.wait(600) is None
            assert native.wait(1) is None and native.ready() is None
        ex = Executor()
        ex.submit(deferred(torch.ops.aten.ones.default, [3], outs=[1], index=0))
        ex.submit(deferred(torch.ops.aten.mul.Tensor, V(1), 2.0, outs=[2], index=1))
        ex.submit(Launch(None))
        ex.drain(10)
        assert ex._w.values[2].tolist() == [2.0, 2.0, 2.0] and ex.stats().native_runs == 0
        print(len(caught), caught[0].message)
        """
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("1 coexec: the native block runner could not be built")

