"""The executor's offloading: parked storages come back bit-equal with their views still
aliased, device bytes follow Offload/Wait/Prefetch exactly, and nothing is lost when the
plan is not followed (a read before the prefetch, a write during the copy out)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import Executor, Free, FreeRange, HostPool, Offload, Prefetch, Restore, Wait, measure_bandwidth
from tests.executor.test_recompute import V, run

aten = torch.ops.aten
N = 256 * 256 * 4  # bytes of a 256x256 float tensor


def test_an_offloaded_storage_leaves_the_device_and_comes_back_equal_with_its_views(ex):
    ex.submit(HostPool(N))
    ex.submit(run(aten.randn.default, [256, 256], outs=[1]))
    ex.submit(run(aten.t.default, V(1), outs=[2]))  # a view of 1: same storage
    ex.drain(10)
    kept = ex._w.values[1].clone()
    ex.submit(Offload((1, 2), 0, N))
    ex.submit(Wait((1, 2)))
    ex.drain(10)
    assert 1 not in ex._w.values and 2 not in ex._w.values and ex._w.memory.live == 0
    ex.submit(Prefetch((1, 2)))
    ex.drain(10)
    assert ex._w.memory.live == N  # allocated at the prefetch, before any use
    ex.submit(run(aten.mul_.Tensor, V(2), 2.0, outs=[]))  # writes through the view
    ex.submit(run(aten.clone.default, V(1), outs=[3]))
    ex.drain(10)
    assert torch.equal(ex._w.values[3], kept * 2)  # the view still aliases its base
    assert ex._w.values[1].untyped_storage().data_ptr() == ex._w.values[2].untyped_storage().data_ptr()
    assert ex._w.memory.peak == 2 * N
    assert (ex._w.offloads.offloaded, ex._w.offloads.fetched_late) == (1, 0)


def test_a_parked_value_read_before_its_prefetch_is_copied_back_on_the_spot(ex):
    ex.submit(HostPool(N))
    ex.submit(run(aten.randn.default, [256, 256], outs=[1]))
    ex.submit(Offload((1,), 0, N))
    ex.submit(Wait((1,)))
    ex.submit(run(aten.neg.default, V(1), outs=[2]))
    ex.drain(10)
    assert torch.equal(ex._w.values[2], -ex._w.values[1])
    assert ex._w.offloads.fetched_late == 1


def test_a_write_during_the_copy_out_keeps_the_value_on_the_device(ex):
    ex.submit(HostPool(N))
    ex.submit(run(aten.ones.default, [256, 256], outs=[1]))
    ex.submit(Offload((1,), 0, N))
    # an in-place write renames value 1 to 2 (the skeleton's "move"): the copy is stale
    ex.submit(Run_move(aten.add_.Tensor, 1, 2, 1.0))
    ex.submit(Wait((1,)))
    ex.drain(10)
    assert torch.equal(ex._w.values[2], torch.full((256, 256), 2.0))
    assert not ex._w.offloads.parcels and ex._w.memory.live == N


def Run_move(func, old, new, other):
    from executor import Run

    return Run(func, [None, other], {}, ((0, -1, old),), (new,), ((old, new),))


def test_a_view_python_let_go_of_during_its_copy_out_is_not_brought_back(ex):
    """A storage and its view go out; Python lets go of the view while the copy is in flight.
    Brought back, the storage is the base's alone: the view is not made again (it stayed in
    the executor's table, holding the storage after the base was freed: 64 KiB over a GPT-2
    budget plan)."""
    ex.submit(HostPool(N))
    ex.submit(run(aten.randn.default, [256, 256], outs=[1]))
    ex.submit(run(aten.t.default, V(1), outs=[2]))  # a view of 1
    ex.submit(Offload((1, 2), 0, N))
    ex.submit(Free((2,)))  # the copy out has not been waited for yet
    ex.submit(Wait((1, 2)))
    ex.submit(Prefetch((1, 2)))
    ex.submit(run(aten.neg.default, V(1), outs=[3]))
    ex.drain(10)
    assert 2 not in ex._w.values and 1 in ex._w.values
    ex.submit(Free((1, 3)))
    ex.drain(10)
    assert ex._w.memory.live == 0 and not ex._w.values


def test_freeing_and_restoring_parked_values(ex):
    ex.submit(HostPool(2 * N))
    ex.submit(run(aten.randn.default, [256, 256], outs=[1]))
    ex.submit(run(aten.randn.default, [256, 256], outs=[2]))
    ex.submit(Offload((1,), 0, N))
    ex.submit(Offload((2,), N, N))
    ex.submit(Wait((1,)))
    ex.submit(Wait((2,)))
    ex.submit(Free((1,)))  # Python let go of a parked value: nothing to bring back
    ex.submit(Restore(None, 0, 10))  # the skeleton is about to read what is left
    ex.drain(10)
    assert 1 not in ex._w.values and 2 in ex._w.values and ex._w.memory.live == N
    ex.submit(Prefetch((2,)))
    ex.submit(FreeRange(0, 10))
    ex.drain(10)
    assert ex._w.memory.live == 0 and not ex._w.offloads.parcels


def test_bandwidth_is_measured_once_and_positive():
    bw = measure_bandwidth("cpu", nbytes=1 << 20)
    assert bw.to_host > 0 and bw.to_device > 0 and bw.latency >= 0
    assert measure_bandwidth("cpu") is bw


EVENTS = ("offload", "wait", "prefetch", "read", "write", "free")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(EVENTS), st.integers(0, 3)), max_size=40))
def test_any_interleaving_of_moves_reads_writes_and_frees_keeps_values_and_counts_bytes(events):
    """Four values, each on its own storage, and a random stream of events on them: the moves
    in plan order (offload, then wait, then prefetch), and reads, in-place writes and frees at
    any point, also while a value is parked or its copy is in flight. Every read sees the value
    eager would have, and afterwards the device holds exactly the values not parked."""
    n = 64 * 64 * 4
    ex = Executor("test-offload-property")
    try:
        ex.submit(HostPool(4 * n))
        vid = {k: k + 1 for k in range(4)}  # current value id of each slot (writes rename)
        state = {}  # slot -> "device" | "out" (copy in flight) | "parked" | "freed"
        expected = {}
        for k in range(4):
            expected[k] = torch.full((64, 64), float(k))
            ex.submit(run(aten.full.default, [64, 64], float(k), outs=[vid[k]]))
            state[k] = "device"
        fresh = 100
        stale: dict[int, int] = {}  # slot -> its id before a write during the copy out
        for event, k in events:
            v, s = vid[k], state[k]
            if s == "freed":
                continue
            if event == "offload" and s == "device":
                ex.submit(Offload((v,), k * n, n))
                state[k] = "out"
            elif event == "wait" and s == "out":
                ex.submit(Wait((v,)))
                state[k] = "parked"
            elif event == "wait" and k in stale:  # the plan's wait, after a write renamed it
                ex.submit(Wait((stale.pop(k),)))
            elif event == "prefetch" and s == "parked":
                ex.submit(Prefetch((v,)))
                state[k] = "device"
            elif event == "read":
                fresh += 1
                ex.submit(run(aten.neg.default, V(v), outs=[fresh]))
                ex.drain(10)
                assert torch.equal(ex._w.values[fresh], -expected[k]), (event, k, s)
                ex.submit(Free((fresh,)))
                state[k] = "out" if s == "out" else "device"  # a parked value read comes back
            elif event == "write":
                if s == "out":
                    stale[k] = v
                fresh += 1
                ex.submit(Run_move(aten.add_.Tensor, v, fresh, 1.0))
                expected[k] = expected[k] + 1
                vid[k], state[k] = fresh, "device"  # a write cancels a copy in flight
            elif event == "free":
                ex.submit(Free((v,)))
                state[k] = "freed"
        ex.drain(10)
        assert ex._w.memory.live == n * sum(s in ("device", "out") for s in state.values())
        for k in range(4):  # read through the executor: prefetched and parked values come back
            if state[k] != "freed":
                fresh += 1
                ex.submit(run(aten.clone.default, V(vid[k]), outs=[fresh]))
                ex.drain(10)
                assert torch.equal(ex._w.values[fresh], expected[k])
    finally:
        ex.close()


def test_a_storage_larger_than_its_slice_of_the_pool_stays_on_the_device(ex):
    """(A path may make a storage larger than the plan's: copied into its slice it would
    overwrite the next one.)"""
    ex.submit(HostPool(2 * N))
    ex.submit(run(aten.randn.default, [256, 256], outs=[1]))
    ex.submit(run(aten.randn.default, [256, 256], outs=[2]))
    ex.submit(Offload((1,), 0, N // 2))  # a slice of half its size
    ex.submit(Offload((2,), N // 2, N))
    ex.submit(Wait((1,)))
    ex.submit(Wait((2,)))
    ex.drain(10)
    assert 1 in ex._w.values and 2 not in ex._w.values
    assert ex.stats().offloaded == 1 and ex._w.memory.live == N
