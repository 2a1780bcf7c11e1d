"""The executor's rematerialization: dropped values come back equal, pins hold inputs, the
live-bytes count follows what the value table holds."""

from __future__ import annotations

import torch

from executor import Drop, Free, FreeRange, Restore, Run

aten = torch.ops.aten
MB = 1 << 20


class V(int):
    """A value id among a Run's arguments."""


def run(func, *refs_or_args, outs, recipe=False, **fields):
    """A Run of ``func``; ``V(id)`` arguments are values of the executor; ``fields``: other
    fields of the Run (``op_index``, ``deferred``)."""
    args, refs = [], []
    for i, a in enumerate(refs_or_args):
        if isinstance(a, V):
            refs.append((i, -1, a))
            args.append(None)
        else:
            args.append(a)
    return Run(func, args, {}, tuple(refs), tuple(outs), recipe=recipe, **fields)


def test_a_dropped_value_is_recomputed_before_its_next_use_and_equals_the_original(ex):
    x = torch.randn(256, 256)
    ex.submit(run(aten.clone.default, x, outs=[1]))  # value 1: a copy of x (1/4 MB)
    ex.submit(run(aten.sin.default, V(1), outs=[2], recipe=True))  # value 2 = sin(1)
    ex.drain(10)
    kept = ex._w.values[2].clone()
    assert ex._w.memory.live == 2 * 256 * 256 * 4
    ex.submit(Drop((2,)))
    ex.drain(10)
    assert 2 not in ex._w.values and ex._w.memory.live == 256 * 256 * 4
    ex.submit(run(aten.cos.default, V(2), outs=[3]))  # needs 2: recomputed first
    ex.drain(10)
    assert torch.equal(ex._w.values[2], kept)
    assert torch.equal(ex._w.values[3], torch.cos(kept))
    assert ex._w.recipes.recomputed == 1
    assert ex._w.memory.peak == 3 * 256 * 256 * 4


def test_a_pinned_input_outlives_its_free_until_the_recipe_retires(ex):
    ex.submit(run(aten.ones.default, [MB // 4], outs=[1]))
    ex.submit(run(aten.mul.Scalar, V(1), 3.0, outs=[2], recipe=True))
    ex.submit(Free((1,)))  # Python let go of 1, but the recipe of 2 reads it
    ex.submit(Drop((2,)))
    ex.drain(10)
    assert 1 in ex._w.values and 2 not in ex._w.values
    ex.submit(Restore((2,)))
    ex.drain(10)
    assert 1 not in ex._w.values  # the recipe ran and retired: the waiting free happened
    assert torch.equal(ex._w.values[2], torch.full((MB // 4,), 3.0))


def test_recomputation_is_recursive_through_dropped_inputs(ex):
    ex.submit(run(aten.arange.default, 1000, outs=[1]))
    ex.submit(run(aten.mul.Scalar, V(1), 2, outs=[2], recipe=True))
    ex.submit(run(aten.add.Scalar, V(2), 1, outs=[3], recipe=True))
    ex.submit(Drop((2, 3)))
    ex.submit(run(aten.neg.default, V(3), outs=[4]))
    ex.drain(10)
    assert torch.equal(ex._w.values[4], -(torch.arange(1000) * 2 + 1))
    assert ex._w.recipes.recomputed == 2


def test_an_in_place_write_to_a_pinned_input_restores_its_dependents_first(ex):
    ex.submit(run(aten.zeros.default, [10], outs=[1]))
    ex.submit(run(aten.add.Scalar, V(1), 5, outs=[2], recipe=True))
    ex.submit(Drop((2,)))
    w = run(aten.add_.Scalar, V(1), 100, outs=[])
    w.moves = ((1, 11),)
    ex.submit(w)  # writes value 1 in place: value 2 must be made from the old contents
    ex.drain(10)
    assert torch.equal(ex._w.values[2], torch.full((10,), 5.0))
    assert torch.equal(ex._w.values[11], torch.full((10,), 100.0))


def test_a_free_of_a_dropped_value_retires_its_recipe_and_a_step_end_forgets_everything(ex):
    ex.submit(run(aten.ones.default, [100], outs=[1]))
    ex.submit(run(aten.mul.Scalar, V(1), 2, outs=[2], recipe=True))
    ex.submit(Drop((2,)))
    ex.submit(Free((2,)))
    ex.submit(Free((1,)))
    ex.drain(10)
    assert not ex._w.values and not ex._w.recipes.pins and not ex._w.recipes.dropped
    assert ex._w.memory.live == 0
    ex.submit(run(aten.ones.default, [100], outs=[5]))
    ex.submit(run(aten.mul.Scalar, V(5), 2, outs=[6], recipe=True))
    ex.submit(Drop((6,)))
    ex.submit(FreeRange(0, 10))
    ex.drain(10)
    assert not ex._w.values and not ex._w.recipes.by_out and ex._w.memory.live == 0


def test_a_random_recipe_replays_its_random_numbers_and_the_stream_goes_on(ex):
    torch.manual_seed(7)
    ex.submit(run(aten.ones.default, [1000], outs=[1]))
    r = run(aten.bernoulli.p, V(1), 0.5, outs=[2], recipe=True)
    r.random = True
    ex.submit(r)
    ex.submit(Drop((2,)))
    ex.submit(run(aten.rand.default, [5], outs=[3]))  # the stream moves on
    ex.submit(Restore((2,)))  # replayed with the state the first run saw
    ex.submit(run(aten.rand.default, [5], outs=[4]))
    ex.drain(10)
    torch.manual_seed(7)
    first = torch.bernoulli(torch.ones(1000), 0.5)
    assert torch.equal(ex._w.values[2], first)
    assert torch.equal(ex._w.values[3], torch.rand(5))
    assert torch.equal(ex._w.values[4], torch.rand(5))  # the replay did not consume the stream
