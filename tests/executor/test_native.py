"""The native engine: the same values, frees, results and byte counts as the Python executor;
its count of live bytes agrees with executor/memory.py's; an op it cannot call runs in Python in
its place; where it cannot be built, the Python executor runs after one warning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import (
    Executor, ExecutorError, Free, Launch, LiveBytes, NativeExecutor, ResetPeak, make_executor, native,
)  # fmt: skip
from executor.memory import span_bytes
from tests.executor.test_block_runs import block, deferred
from tests.executor.test_recompute import V, run

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not native.enabled(), reason="COEXEC_NATIVE=0")


@pytest.fixture
def built():
    return native.wait(600)


@pytest.fixture
def nex(built):
    ex = NativeExecutor(built, "test-native")
    try:
        yield ex
    finally:
        ex.close()


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
    r = deferred(aten.add_.Tensor, V(5), 1.0, outs=[6], index=5)
    r.moves = ((5, 6),)
    ex.submit(r)
    ex.submit(deferred(aten.sum.default, V(4), outs=[7], index=6))
    last = deferred(aten.max.default, V(6), outs=[8], index=7)
    last.keep_result = True
    ex.submit(last)
    ex.submit(Free((1, 2)))
    return (3, 0, 1, 2, 4, 5, 6, 7)


def test_the_engine_makes_the_values_frees_results_and_bytes_of_the_python_executor(nex):
    slow = Executor("python")
    try:
        for ex in (nex, slow):
            order = attention_like_block(ex)
            ex.submit(Launch(block(order)))
            ex.drain(10)
        assert nex.stats().native_ops == 8 and slow.stats().native_ops == 0
        for vid in range(1, 9):
            a, b = nex.value(vid), slow.value(vid)
            assert (a is None) == (b is None), vid
            assert a is None or torch.equal(a, b)
        assert [v for v in range(1, 9) if nex.value(v) is not None] == [3, 4, 6, 7, 8]
        assert nex.take_result(7).item() == slow.take_result(7).item()
        assert nex.stats().peak_bytes == slow.stats().peak_bytes
        assert nex._e.live == slow._w.memory.live
    finally:
        slow.close()


def test_arena_outputs_go_to_their_planned_offsets(nex):
    arena = torch.zeros(4096, dtype=torch.uint8)
    nex.submit(ResetPeak(arena))
    shape, stride = (16, 16), (16, 1)
    n = span_bytes(shape, stride, torch.float32)
    a = deferred(aten.mm.default, torch.eye(16), torch.ones(16, 16), outs=[1], index=0)
    a.arena_out = (aten.mm.out, ("out",), ((1024, shape, stride, torch.float32, n),))
    nex.submit(a)
    nex.submit(Launch(block((0,))))
    nex.drain(10)
    t = nex.value(1)
    assert nex.stats().arena_hits == 1 and nex.stats().peak_bytes == 4096  # the arena, whole
    assert t.data_ptr() - arena.data_ptr() == 1024 and torch.equal(t, torch.ones(16, 16))


def test_an_op_failing_on_the_engine_reports_the_python_exception_and_frees_what_it_should(nex):
    nex.submit(deferred(aten.ones.default, [4], outs=[1], index=0))
    nex.submit(deferred(aten.index_select.default, V(1), 0, torch.tensor([9]), outs=[2], index=1))
    nex.submit(deferred(aten.neg.default, V(1), outs=[3], index=2))
    nex.submit(Free((1,)))
    nex.submit(Launch(block((0, 1, 2))))
    with pytest.raises(ExecutorError, match="IndexError: index out of range in self") as err:
        nex.drain(10)
    assert err.value.op_index == 1 and isinstance(err.value.__cause__, IndexError)
    assert str(err.value).startswith("aten.index_select.default failed on the executor")
    assert all(nex.value(v) is None for v in (1, 2, 3))  # 1 freed, 2 and 3 never made
    assert nex._e.live == 0
    nex.reset()  # then it runs again
    nex.submit(run(aten.ones.default, [2], outs=[4]))
    nex.drain(10)
    assert nex.error is None and nex.value(4).tolist() == [1.0, 1.0]


def test_a_value_missing_from_the_table_fails_its_op_with_a_key_error_on_both_executors(nex):
    slow = Executor("python")
    try:
        for ex in (nex, slow):
            ex.submit(run(aten.neg.default, V(7), outs=[8], op_index=3))
            with pytest.raises(ExecutorError, match="aten.neg.default failed on the executor: KeyError") as err:
                ex.drain(10)
            assert err.value.op_index == 3 and isinstance(err.value.__cause__, KeyError)
    finally:
        slow.close()


def twice(x):
    """Not an ATen overload: the engine cannot call it, so it runs in Python."""
    return aten.mul.Tensor(x, 2)


def test_an_op_the_engine_cannot_call_runs_in_python_after_what_came_before(nex):
    nex.submit(deferred(aten.ones.default, [256], outs=[1], index=0))
    nex.submit(deferred(aten.add.Tensor, V(1), 1.0, outs=[2], index=1))
    position = nex.submit(deferred(twice, V(2), outs=[3], index=2))  # the block is launched first
    nex.submit(deferred(aten.sum.default, V(3), outs=[4], index=3))
    nex.submit(Free((1, 2, 3)))
    nex.submit(Launch(None))
    nex.wait(position, 10)
    nex.drain(10)
    assert nex.value(4).item() == 4.0 * 256
    assert all(nex.value(v) is None for v in (1, 2, 3))
    assert nex._e.live == 4 and nex.stats().peak_bytes == 3 * 1024  # 1, 2, 3 at once
    assert nex.stats().native_ops == 3  # ones, add, sum


def test_a_stuck_engine_is_replaced_and_the_new_one_runs(nex):
    fault = nex.inject_fault("hang")
    nex.submit(run(aten.ones.default, [2], outs=[1]))
    with pytest.raises(TimeoutError):
        nex.drain(0.2)
    nex.reset()
    fault.release.set()
    nex.submit(run(aten.ones.default, [3], outs=[2]))
    nex.drain(10)
    assert nex.value(2).tolist() == [1.0, 1.0, 1.0] and nex.alive


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


def test_the_engine_lets_go_of_tensors_python_holds_without_waiting_for_the_gil(nex):
    """Letting go of a tensor Python also holds decrefs its Python object (torch >= 2.10), which
    takes the GIL: the engine leaves that to the skeleton's next call instead, so it runs ops on
    parameters while Python keeps the GIL (here: a thread that never gives it up, switch
    interval 1000 s), and the tensors' Python references come back once Python calls in."""
    params = [torch.randn(32) for _ in range(8)]
    before = [sys.getrefcount(p) for p in params]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        for k in range(len(params)):  # reads two Python tensors, writes one, makes one value
            nex.submit(run(aten.add.Tensor, params[k], params[k - 1], outs=[100 + k], op_index=k))
            nex.submit(run(aten.mul_.Tensor, params[k], 0.5, outs=[200 + k], op_index=100 + k))
            nex.submit(Free((100 + k, 200 + k)))
        n = nex.submitted
        deadline = time.monotonic() + 20.0  # (never reached unless the engine waits for the GIL)
        while nex._e.counters[0] < n and time.monotonic() < deadline:
            pass
        done = nex._e.counters[0]
    finally:
        sys.setswitchinterval(old)
    assert done == n
    nex.drain(10)
    assert [sys.getrefcount(p) for p in params] == before


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


def test_without_a_compiler_the_python_executor_runs_after_one_warning(tmp_path):
    program = textwrap.dedent(
        """
        import warnings
        import torch
        from executor import Executor, Launch, make_executor, native
        from tests.executor.test_block_runs import deferred
        from tests.executor.test_recompute import V
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.wait(600) is None
            assert native.wait(1) is None and native.ready() is None
        ex = make_executor()
        assert type(ex) is Executor
        ex.submit(deferred(torch.ops.aten.ones.default, [3], outs=[1], index=0))
        ex.submit(deferred(torch.ops.aten.mul.Tensor, V(1), 2.0, outs=[2], index=1))
        ex.submit(Launch(None))
        ex.drain(10)
        assert ex.value(2).tolist() == [2.0, 2.0, 2.0] and ex.stats().native_ops == 0
        print(len(caught), caught[0].message)
        """
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("1 coexec: the native engine could not be built")


def test_a_built_module_is_ready_at_the_first_ask_and_the_first_step_is_captured(built):
    """Loading a module built before takes about 0.1 s: it loads in the first call, so a
    program's first step is captured rather than run eagerly beside a background load."""
    program = textwrap.dedent(
        """
        import torch
        import coexec
        from executor import native
        assert native.ready() is not None
        tape = coexec.GradientTape(backend="native", key="first")
        with tape:
            y = (torch.ones(3) * 2).sum()
        print(tape.stats.last_phase, y.item())
        """
    )
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["coexec", "6.0"]


def test_a_step_with_a_memory_budget_runs_on_the_python_executor(built):
    budget, plain = make_executor(budget=True), make_executor()
    try:
        assert type(budget) is Executor and type(plain) is NativeExecutor
    finally:
        budget.close()
        plain.close()
