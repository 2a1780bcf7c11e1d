"""The Python executor's guard (executor/guard.py): under a cap it keeps the ops it runs as
recipes and drops values to stay within the cap; values come back equal, what the program
lets go of is freed as eager frees it, and writes in place never change a value made again."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import Cap, Executor, Free, ResetPeak, Restore, Run

aten = torch.ops.aten
N = 128  # rows and columns of each activation: 64 KiB of float32


class V(int):
    """A value id among a Run's arguments."""


def run(func, *refs_or_args, outs, writes=()):
    """A Run of ``func`` (``V(id)`` arguments are the executor's values), with the bytes of
    its new output as the skeleton gives them under a budget."""
    args, refs = [], []
    for i, a in enumerate(refs_or_args):
        if isinstance(a, V):
            refs.append((i, -1, a))
            args.append(None)
        else:
            args.append(a)
    new = 0 if writes else N * N * 4 * len(outs)
    return Run(func, args, {}, tuple(refs), tuple(outs), new_bytes=new, writes=tuple(writes))


def forward_backward(ex, cap, weights, x, layers=8):
    """A chain of ``tanh(h @ w)`` layers whose outputs are held to the end, then read in
    reverse (as a backward reads saved activations), each let go of after its read. The
    values read back, and the executor's peak."""
    ex.submit(ResetPeak())
    ex.submit(Cap(cap))
    ex.submit(run(aten.clone.default, x, outs=[1]))
    for i in range(layers):
        ex.submit(run(aten.mm.default, V(10 * i + 1), weights[i], outs=[10 * i + 5]))
        ex.submit(run(aten.tanh.default, V(10 * i + 5), outs=[10 * i + 11]))
        ex.submit(Free((10 * i + 5,)))  # the pre-activation: let go of at once
    read = []
    for i in reversed(range(layers)):
        ex.submit(run(aten.mul.Tensor, V(10 * i + 11), V(10 * i + 11), outs=[1000 + i]))
        ex.submit(Free((10 * i + 11,)))
        ex.drain(30)
        read.append(ex._w.values[1000 + i].clone())
        ex.submit(Free((1000 + i,)))
    ex.drain(30)
    assert ex.error is None, ex.error
    return read, ex._w.memory.peak


def make_inputs(layers=8):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(N, N, generator=g) / N**0.5 for _ in range(layers)]
    return weights, torch.randn(N, N, generator=g)


def test_under_a_cap_a_chain_stays_within_it_and_reads_the_same_values(ex):
    weights, x = make_inputs()
    free, eager_peak = forward_backward(ex, None, weights, x)
    ex.reset()
    cap = eager_peak // 2
    held, peak = forward_backward(ex, cap, weights, x)
    assert all(torch.equal(a, b) for a, b in zip(free, held))
    assert peak <= cap < eager_peak
    assert ex._w.guard.evicted > 0 and ex._w.recipes.recomputed > 0


def test_a_cap_that_does_not_bind_drops_nothing_and_holds_what_eager_holds(ex):
    weights, x = make_inputs()
    _, eager_peak = forward_backward(ex, None, weights, x)
    ex.reset()
    _, peak = forward_backward(ex, 10 * eager_peak, weights, x)
    assert peak == eager_peak  # recipes pin their inputs weakly: nothing eager frees is kept
    assert ex._w.guard.evicted == 0 and ex._w.recipes.recomputed == 0


def test_a_value_only_recipes_read_is_dropped_when_the_program_lets_go_of_it(ex):
    x = torch.randn(N, N)
    ex.submit(ResetPeak())
    ex.submit(Cap(1 << 30))
    ex.submit(run(aten.clone.default, x, outs=[1]))
    ex.submit(run(aten.sin.default, V(1), outs=[2]))  # a recipe reading value 1
    ex.submit(Free((1,)))
    ex.drain(10)
    w = ex._w
    assert 1 not in w.values and 1 in w.recipes.dropped  # freed, its recipe kept for 2's
    assert w.memory.live == N * N * 4
    w.guard._drop(2)  # as an eviction would: 2 is then made again through 1
    ex.submit(run(aten.cos.default, V(2), outs=[3]))
    ex.drain(10)
    assert torch.equal(w.values[3], torch.cos(torch.sin(x)))
    assert 1 not in w.values  # the chain's link was dropped again once read
    assert w.memory.live == 2 * N * N * 4


def test_a_write_in_place_to_what_a_dropped_value_was_made_from_makes_it_first(ex):
    x, weight = torch.randn(N, N), torch.randn(N, N)
    expected, before = x @ weight, weight.clone()
    ex.submit(ResetPeak())
    ex.submit(Cap(1 << 30))
    ex.submit(run(aten.clone.default, x, outs=[1]))
    ex.submit(run(aten.mm.default, V(1), weight, outs=[2]))
    ex.drain(10)
    ex._w.guard._drop(2)
    ex.submit(run(aten.add_.Tensor, weight, weight, outs=[], writes=(0,)))  # an optimizer's update
    ex.submit(run(aten.neg.default, V(2), outs=[3]))
    ex.drain(10)
    assert ex.error is None, ex.error
    assert torch.equal(ex._w.values[3], -expected)  # made from the weight before the write
    assert torch.equal(weight, before + before)


def test_random_draws_and_writes_in_place_are_made_again_equal(ex):
    """A random op is made again with the generator's state it first ran with; a value written
    in place by the functional variant of the write from the value before it (``mul_`` ->
    ``mul``). Under a cap too small for anything both are dropped, and read back equal."""
    torch.manual_seed(0)
    drawn = torch.rand(N, N)
    after = torch.rand(1)  # what eager draws next
    torch.manual_seed(0)
    ex.submit(ResetPeak())
    ex.submit(Cap(1))
    r = run(aten.rand.default, [N, N], outs=[1])
    r.random = True
    ex.submit(r)
    ex.submit(run(aten.ones.default, [N, N], outs=[2]))
    written = run(aten.mul_.Scalar, V(2), 2.0, outs=[4], writes=(0,))
    written.moves = ((2, 4),)
    ex.submit(written)
    ex.submit(run(aten.zeros.default, [N, N], outs=[5]))  # each op drops what came before
    ex.submit(run(aten.add.Tensor, V(1), V(4), outs=[6]))
    ex.drain(10)
    w = ex._w
    assert ex.error is None, ex.error
    assert w.guard.evicted >= 2 and w.recipes.recomputed >= 2
    assert torch.equal(w.values[6], drawn + 2.0)
    assert torch.equal(torch.rand(1), after)  # the remake put the generator back


def test_a_dropout_mask_drawn_in_place_is_made_again_equal(ex):
    """Dropout's mask: ``bernoulli_`` on a new tensor with its input's strides (here not
    contiguous), then ``div_``. Made again by the same ops on copies of what they wrote (their
    functional variants lay results out otherwise: ``bernoulli.p`` would draw the same numbers
    into other places), with the generator's state it first drew with; dropped under a cap too
    small for anything, and read back equal."""
    torch.manual_seed(0)
    mask = torch.empty_strided((N, N), (1, N)).bernoulli_().div_(0.5)
    after = torch.rand(1)  # what eager draws next
    torch.manual_seed(0)
    ex.submit(ResetPeak())
    ex.submit(Cap(1))
    ex.submit(run(aten.empty_strided.default, [N, N], [1, N], outs=[1]))
    drawn = run(aten.bernoulli_.float, V(1), outs=[2], writes=(0,))
    drawn.moves, drawn.random = ((1, 2),), True
    ex.submit(drawn)
    scaled = run(aten.div_.Scalar, V(2), 0.5, outs=[3], writes=(0,))
    scaled.moves = ((2, 3),)
    ex.submit(scaled)
    ex.submit(run(aten.zeros.default, [N, N], outs=[4]))  # drops the mask
    ex.submit(run(aten.add.Tensor, V(3), V(4), outs=[5]))
    ex.drain(10)
    w = ex._w
    assert ex.error is None, ex.error
    assert w.guard.evicted >= 1 and w.recipes.recomputed >= 2
    assert torch.equal(w.values[5], mask)
    assert torch.equal(torch.rand(1), after)  # the remake put the generator back


def test_backward_ops_keep_no_recipe(ex):
    """A gradient's recipe would pin what it read (the forward's values, the gradients flowing
    back) past where eager frees them: under a cap only forward ops are kept."""
    ex.submit(ResetPeak())
    ex.submit(Cap(1 << 30))
    ex.submit(run(aten.clone.default, torch.ones(N, N), outs=[1]))
    ex.submit(run(aten.sin.default, V(1), outs=[2]))
    grad = run(aten.cos.default, V(1), outs=[3])
    grad.backward = True
    ex.submit(grad)
    ex.drain(10)
    w = ex._w
    assert ex.error is None, ex.error
    assert 2 in w.recipes.by_out and 3 not in w.recipes.by_out
    assert w.recipes.readers[1] == [w.recipes.by_out[2]]  # (only the forward op's recipe reads 1)


def test_data_dependent_results_are_never_dropped(ex):
    ex.submit(ResetPeak())
    ex.submit(Cap(1))
    nz = run(aten.nonzero.default, torch.ones(N, N), outs=[1])
    nz.keep_result = True
    ex.submit(nz)
    ex.submit(run(aten.neg.default, torch.ones(N, N), outs=[2]))
    ex.drain(10)
    w = ex._w
    assert 1 in w.values and 1 not in w.recipes.dropped and w.guard.overruns > 0


OPS = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(["sin", "tanh", "neg"]), st.integers(0, 99)),
    st.tuples(st.just("binary"), st.sampled_from(["add", "mul"]), st.integers(0, 99), st.integers(0, 99)),
    st.tuples(st.just("random"), st.integers(0, 99)),
    st.tuples(st.just("in place"), st.integers(0, 99)),
    st.tuples(st.just("state"), st.integers(0, 99)),  # reads the external weight
    st.tuples(st.just("write state")),  # an optimizer's update of the weight
    st.tuples(st.just("free"), st.integers(0, 99)),
    st.tuples(st.just("read"), st.integers(0, 99)),
)


def replay(ex, program, cap):
    """Run ``program`` (OPS) under ``cap``: the values read, and the peak."""
    torch.manual_seed(0)
    weight = torch.full((32, 32), 0.5)
    ex.submit(ResetPeak())
    ex.submit(Cap(cap))
    first = run(aten.rand.default, [32, 32], outs=[1])
    first.random = True  # (as the skeleton marks random ops under a budget)
    ex.submit(first)
    live, reads, vid = [1], [], 1

    def new():
        nonlocal vid
        vid += 1
        return vid

    def small(func, *args, outs, writes=()):
        r = run(func, *args, outs=outs, writes=writes)
        r.new_bytes = 0 if writes else 32 * 32 * 4
        return r

    for op in program:
        kind = op[0]
        if kind == "write state":
            ex.submit(small(aten.add_.Scalar, weight, 1.0, outs=[], writes=(0,)))
            continue
        if not live:
            continue
        pick = live[op[-1] % len(live)]
        if kind == "unary":
            ex.submit(small(getattr(aten, op[1]).default, V(pick), outs=[out := new()]))
            live.append(out)
        elif kind == "binary":
            other = live[op[2] % len(live)]
            ex.submit(small(getattr(aten, op[1]).Tensor, V(pick), V(other), outs=[out := new()]))
            live.append(out)
        elif kind == "random":
            r = small(aten.rand_like.default, V(pick), outs=[out := new()])
            r.random = True
            ex.submit(r)
            live.append(out)
        elif kind == "in place":
            w = small(aten.mul_.Scalar, V(pick), 0.5, outs=[out := new()], writes=(0,))
            w.moves = ((pick, out),)
            ex.submit(w)
            live[live.index(pick)] = out
        elif kind == "state":
            ex.submit(small(aten.add.Tensor, V(pick), weight, outs=[out := new()]))
            live.append(out)
        elif kind == "free":
            ex.submit(Free((pick,)))
            live.remove(pick)
        else:
            ex.submit(Restore((pick,)))
            ex.drain(30)
            assert ex.error is None, ex.error
            reads.append(ex._w.values[pick].clone())
    ex.drain(30)
    assert ex.error is None, ex.error
    return reads, ex._w.memory.peak


@settings(max_examples=200, deadline=None)
@given(program=st.lists(OPS, min_size=5, max_size=60), fraction=st.floats(0.1, 0.9))
def test_any_program_under_any_cap_reads_what_it_reads_uncapped(program, fraction):
    """Whatever the guard drops, and whatever it makes again through chains, random draws,
    writes in place and writes to state, the values the program reads are the uncapped ones."""
    ex = Executor("guard-fuzz")
    try:
        expected, peak = replay(ex, program, None)
        ex.reset()
        got, _ = replay(ex, program, int(fraction * peak))
    finally:
        ex.close()
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
