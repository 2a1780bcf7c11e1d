"""The arena under recomputation and offloading: a dropped or parked storage comes back into
the arena bytes it left when they are free (and to the allocator when they are not), bit-equal;
the arena counts once, as a whole, in the live bytes."""

from __future__ import annotations

import torch

from executor import Drop, Free, HostPool, Offload, Prefetch, ResetPeak, Run, Wait
from tests.executor.test_recompute import V, run

aten = torch.ops.aten
N = 256 * 256 * 4  # bytes of a 256x256 float tensor


def into(arena: torch.Tensor, func, out_func, *args, outs, offset: int, recipe: bool = False) -> Run:
    """``run(func, ...)`` with its output planned at ``offset`` of ``arena`` (through ``out_func``)."""
    ins = run(func, *args, outs=outs, recipe=recipe)
    ins.arena_out = (out_func, ("out",), ((offset, (256, 256), (256, 1), torch.float32, N),))
    return ins


def warm(ex, arena: torch.Tensor, func, out_func) -> None:
    """A step begins with ``arena`` attached (as the skeleton's session does), and the first
    use of an out= overload in a process is tried once (the result, wherever it went, is
    freed)."""
    ex.submit(ResetPeak(arena))
    ex.submit(into(arena, func, out_func, torch.ones(256, 256), outs=[99], offset=0))
    ex.submit(Free((99,)))
    ex.drain(10)


def base(arena: torch.Tensor) -> int:
    return arena.data_ptr()


def test_a_recomputed_value_comes_back_into_its_arena_region(ex):
    arena = torch.empty(2 * N, dtype=torch.uint8)
    warm(ex, arena, aten.sin.default, aten.sin.out)
    ex.submit(run(aten.randn.default, [256, 256], outs=[1]))  # from the allocator
    ex.submit(into(arena, aten.sin.default, aten.sin.out, V(1), outs=[2], offset=N, recipe=True))
    ex.drain(10)
    assert ex._w.values[2].data_ptr() == base(arena) + N
    kept = ex._w.values[2].clone()
    assert ex._w.memory.live == 2 * N + N  # the arena whole and value 1; value 2 is in the arena
    ex.submit(Drop((2,)))
    ex.drain(10)
    assert ex._w.memory.free(N, N) and ex._w.memory.live == 3 * N  # the region is free, the arena stays
    ex.submit(run(aten.cos.default, V(2), outs=[3]))  # needs 2: recomputed into its region
    ex.drain(10)
    assert ex._w.values[2].data_ptr() == base(arena) + N
    assert torch.equal(ex._w.values[2], kept) and torch.equal(ex._w.values[3], torch.cos(kept))
    assert not ex._w.memory.free(N, 1)
    assert ex._w.memory.peak == 4 * N  # arena 2N, value 1, value 3: value 2 is never counted again


def test_a_recomputed_value_whose_region_is_taken_uses_the_allocator(ex):
    arena = torch.empty(N, dtype=torch.uint8)
    warm(ex, arena, aten.sin.default, aten.sin.out)
    ex.submit(run(aten.randn.default, [256, 256], outs=[1]))
    ex.submit(into(arena, aten.sin.default, aten.sin.out, V(1), outs=[2], offset=0, recipe=True))
    ex.submit(Drop((2,)))
    ex.submit(into(arena, aten.sin.default, aten.sin.out, V(1), outs=[3], offset=0))  # takes it
    ex.drain(10)
    assert ex._w.values[3].data_ptr() == base(arena)
    misses = ex.stats().arena_misses
    ex.submit(run(aten.cos.default, V(2), outs=[4]))
    ex.drain(10)
    assert ex.stats().arena_misses == misses + 1 and not ex._w.memory.in_arena(ex._w.values[2])
    assert torch.equal(ex._w.values[2], ex._w.values[3])  # sin(1) both times


def test_a_prefetched_storage_comes_back_to_the_arena_bytes_it_left(ex):
    arena = torch.empty(N, dtype=torch.uint8)
    warm(ex, arena, aten.clone.default, aten.clone.out)
    ex.submit(HostPool(2 * N))
    ex.submit(into(arena, aten.clone.default, aten.clone.out, torch.randn(256, 256), outs=[1], offset=0))
    ex.submit(run(aten.t.default, V(1), outs=[2]))  # a view of 1
    ex.drain(10)
    kept = ex._w.values[1].clone()
    live = ex._w.memory.live
    ex.submit(Offload((1, 2), 0, N))
    ex.submit(Wait((1, 2)))
    ex.drain(10)
    assert ex._w.memory.free(0, N) and ex._w.memory.live == live  # the arena's bytes are not returned
    ex.submit(Prefetch((1, 2)))
    ex.submit(run(aten.clone.default, V(2), outs=[3]))
    ex.drain(10)
    assert ex._w.values[1].data_ptr() == base(arena) and ex._w.values[2].data_ptr() == base(arena)
    assert torch.equal(ex._w.values[1], kept) and torch.equal(ex._w.values[3], kept.t())
    assert ex._w.memory.live == live + N  # only the clone is new


def test_a_prefetch_whose_arena_bytes_are_taken_uses_the_allocator(ex):
    arena = torch.empty(N, dtype=torch.uint8)
    warm(ex, arena, aten.clone.default, aten.clone.out)
    ex.submit(HostPool(N))
    ex.submit(into(arena, aten.clone.default, aten.clone.out, torch.randn(256, 256), outs=[1], offset=0))
    ex.drain(10)
    kept = ex._w.values[1].clone()
    ex.submit(Offload((1,), 0, N))
    ex.submit(Wait((1,)))
    ex.submit(into(arena, aten.clone.default, aten.clone.out, torch.zeros(256, 256), outs=[2], offset=0))
    ex.submit(Prefetch((1,)))
    ex.drain(10)
    assert ex._w.values[2].data_ptr() == base(arena)
    ex.submit(run(aten.clone.default, V(1), outs=[3]))
    ex.drain(10)
    assert not ex._w.memory.in_arena(ex._w.values[1]) and torch.equal(ex._w.values[1], kept)
    assert torch.equal(ex._w.values[2], torch.zeros(256, 256))
