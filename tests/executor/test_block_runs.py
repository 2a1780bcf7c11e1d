"""Blocks on the executor: deferred ops run at their block's launch in its planned order, a value
Python let go of is freed after its last use in that order, and a followed block runs ahead as
its ops arrive while the bytes held stay within its bound. Each test runs on both executors,
the Python one and the native engine."""

from __future__ import annotations

import time

import pytest
import torch

from executor import Executor, ExecutorError, Follow, Free, Launch, NativeExecutor, RunAhead, native
from planner import Block, Site
from tests.executor.test_recompute import V, run

aten = torch.ops.aten
N = 256 * 256 * 4  # bytes of a 256x256 float tensor


def deferred(func, *refs_or_args, outs, index):
    """A deferred Run of ``func``; ``V(id)`` arguments are values of the executor."""
    return run(func, *refs_or_args, outs=outs, op_index=index, deferred=True)


def block(order, bound=0, new=()):
    return Block(tuple(Site(k, ()) for k in range(len(order))), tuple(order), bound, tuple(new))


@pytest.fixture(params=["python", "native"])
def ex(request):
    """A fresh executor of each kind, closed after the test."""
    if request.param == "python":
        executor = Executor("test-executor")
    else:
        if not native.enabled():
            pytest.skip("COEXEC_NATIVE=0")
        executor = NativeExecutor(native.wait(600), "test-native")
    try:
        yield executor
    finally:
        executor.close()


class Ran:
    """The op indices the executor ran, in the order it ran them (a live view)."""

    def __init__(self, ex, monkeypatch) -> None:
        self.native = isinstance(ex, NativeExecutor)
        if self.native:
            self._engine = ex._e
            self._engine.record_order(True)
            return
        self._seen = seen = []
        real = type(ex._w).run

        def spy(worker, ins, values):
            seen.append(ins.op_index)
            return real(worker, ins, values)

        monkeypatch.setattr(type(ex._w), "run", spy)

    def _list(self) -> list:
        return list(self._engine.ran_order()) if self.native else list(self._seen)

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        return self._list() == list(other)

    def __repr__(self) -> str:
        return repr(self._list())


@pytest.fixture
def ran(ex, monkeypatch):
    return Ran(ex, monkeypatch)


def two_branches(ex):
    """0: x = ones; 1: a = x * 2 (a big temporary); 2: s = a.sum(); 3: b = x * 3; 4: t = b.sum()."""
    ex.submit(deferred(aten.ones.default, [256, 256], outs=[1], index=0))
    ex.submit(deferred(aten.mul.Tensor, V(1), 2.0, outs=[2], index=1))
    ex.submit(deferred(aten.sum.default, V(2), outs=[3], index=2))
    ex.submit(deferred(aten.mul.Tensor, V(1), 3.0, outs=[4], index=3))
    ex.submit(deferred(aten.sum.default, V(4), outs=[5], index=4))


def test_a_launched_block_runs_in_its_planned_order_with_the_same_values(ex, ran):
    two_branches(ex)
    ex.submit(Free((2, 4)))  # Python let go of both temporaries inside the block
    assert ran == []  # nothing runs before the block is launched
    ex.submit(Launch(block((0, 3, 4, 1, 2))))
    ex.drain(10)
    assert ran == [0, 3, 4, 1, 2]
    assert ex.value(3).item() == 2 * 256 * 256 and ex.value(5).item() == 3 * 256 * 256
    assert ex.value(2) is None and ex.value(4) is None  # freed after their last use
    # each temporary was freed before the other was made: x and one temporary at most
    assert ex.stats().peak_bytes == 2 * N + 8
    assert ex.stats().blocks == 1


def test_in_issue_order_the_same_block_holds_both_temporaries_until_python_lets_go(ex, ran):
    two_branches(ex)
    ex.submit(Launch(None))  # no plan for this block: as issued
    ex.submit(Free((2, 4)))
    ex.drain(10)
    assert ran == [0, 1, 2, 3, 4]
    assert ex.stats().peak_bytes == 3 * N + 8 and ex.stats().blocks == 0


def test_a_plan_for_other_ops_is_not_used(ex, ran):
    two_branches(ex)
    ex.submit(Launch(block((1, 0))))  # two ops planned, five deferred: issue order
    ex.drain(10)
    assert ran == [0, 1, 2, 3, 4]


def test_waiting_for_a_deferred_op_launches_its_block(ex, ran):
    two_branches(ex)
    position = ex.submit(deferred(aten.sum.default, V(5), outs=[6], index=5))
    ex.wait(position, 10)  # no launch was sent: the wait sends one (issue order)
    assert ran == [0, 1, 2, 3, 4, 5] and ex.value(6).item() == 3 * 256 * 256


def settled(ex, seen: list, count: int) -> list:
    """What ``seen`` holds once the executor ran ``count`` ops and then went idle."""
    deadline = time.monotonic() + 10
    while len(seen) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # (and nothing more came)
    return list(seen)


def test_a_followed_block_runs_ahead_within_its_bound_and_waits_for_frees(ex, ran):
    plan = block((0, 1, 2, 3, 4), new=(N, N, 4, N, 4))
    ex.submit(Follow(plan, 2 * N + 8))  # room for x, one temporary and its sum
    two_branches(ex)
    # x, a and s run as they arrive; b would hold x, a, s and b: over the bound, it waits
    assert settled(ex, ran, 3) == [0, 1, 2]
    ex.submit(Free((2,)))  # Python let go of a: b fits now, and then t
    assert settled(ex, ran, 5) == [0, 1, 2, 3, 4]
    ex.submit(Launch(plan))
    ex.drain(10)
    assert ran == [0, 1, 2, 3, 4] and ex.value(5).item() == 3 * 256 * 256
    assert ex.stats().peak_bytes == 2 * N + 4 + 4  # within the bound throughout


def test_the_stats_count_ops_run_ahead_and_where_running_ahead_waited(ex, ran):
    ex.submit(deferred(aten.ones.default, [256, 256], outs=[1], index=0))
    ex.submit(deferred(aten.mul.Tensor, V(1), 2.0, outs=[2], index=1))
    ex.submit(deferred(aten.sum.default, V(2), outs=[3], index=2))
    ex.submit(Follow(block((0, 1, 2, 3, 4), new=(N, N, 4, N, 4)), 2 * N + 8))
    assert settled(ex, ran, 3) == [0, 1, 2]  # then op 3 is not issued yet
    ex.submit(deferred(aten.mul.Tensor, V(1), 3.0, outs=[4], index=3))  # over the bound
    assert settled(ex, ran, 3) == [0, 1, 2]
    ex.submit(Free((2,)))  # op 3 fits; then op 4 is not issued yet
    assert settled(ex, ran, 4) == [0, 1, 2, 3]
    ex.submit(deferred(aten.sum.default, V(4), outs=[5], index=4))
    ex.submit(deferred(aten.neg.default, V(1), outs=[6], index=5))  # not that block's
    ex.submit(Launch(None))
    ex.drain(10)
    assert ran == [0, 1, 2, 3, 4, 5]
    assert ex.stats().run_ahead == RunAhead(
        ahead=5, at_launch=1, waited_for_issue=2, waited_for_bytes=1, waited_for_region=0
    )


def test_a_block_that_turns_out_another_finishes_in_issue_order(ex, ran):
    two_branches(ex)
    ex.submit(Follow(block((0, 3, 4, 1, 2), new=(N, N, 4, N, 4)), 10 * N))
    assert settled(ex, ran, 5) == [0, 3, 4, 1, 2]  # ahead, in the followed order
    ex.submit(deferred(aten.neg.default, V(1), outs=[6], index=5))  # a sixth op: not that block
    ex.submit(Launch(None))
    ex.drain(10)
    assert ran == [0, 3, 4, 1, 2, 5] and ex.value(3).item() == 2 * 256 * 256


def test_while_the_plans_next_op_is_not_issued_the_issued_ones_run_in_issue_order_within_the_bound(ex, ran):
    # the plan wants b (op 3) right after x; until it is issued, a and s run as issued
    ex.submit(Follow(block((0, 3, 4, 1, 2), new=(N, N, 4, N, 4)), 2 * N + 8))
    ex.submit(deferred(aten.ones.default, [256, 256], outs=[1], index=0))
    ex.submit(deferred(aten.mul.Tensor, V(1), 2.0, outs=[2], index=1))
    ex.submit(deferred(aten.sum.default, V(2), outs=[3], index=2))
    assert settled(ex, ran, 3) == [0, 1, 2]
    ex.submit(deferred(aten.mul.Tensor, V(1), 3.0, outs=[4], index=3))  # x, a, s, b: over the bound
    assert settled(ex, ran, 3) == [0, 1, 2]
    ex.submit(Free((2,)))  # Python let go of a: b fits
    assert settled(ex, ran, 4) == [0, 1, 2, 3]
    ex.submit(deferred(aten.sum.default, V(4), outs=[5], index=4))
    ex.submit(Launch(block((0, 3, 4, 1, 2))))
    ex.drain(10)
    assert ran == [0, 1, 2, 3, 4] and ex.value(5).item() == 3 * 256 * 256
    assert ex.stats().peak_bytes == 2 * N + 8  # within the bound throughout


def test_an_op_failing_in_a_block_stops_the_rest_of_it(ex, ran):
    ex.submit(deferred(aten.ones.default, [4], outs=[1], index=0))
    ex.submit(deferred(aten.index_select.default, V(1), 0, torch.tensor([7]), outs=[2], index=1))
    ex.submit(deferred(aten.neg.default, V(1), outs=[3], index=2))
    ex.submit(Launch(block((0, 1, 2))))
    with pytest.raises(ExecutorError, match="index_select") as err:
        ex.drain(10)
    assert err.value.op_index == 1 and ran == [0, 1] and ex.value(3) is None
