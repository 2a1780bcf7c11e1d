"""Sized nodes: tensor sizes that vary between steps are bound per step, not new branches."""

from __future__ import annotations

import torch

from tracegraph import TraceGraph, record

W = torch.randn(6, 1, requires_grad=True)
PARAMS = [torch.randn(4, 3), torch.randn(5, 2), torch.randn(7)]


def step(n: int, loops: bool = False) -> None:
    x = torch.ones(n, 6)
    loss = (x @ W).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        W.sub_(W.grad * 0.1)
        if loops:
            for p in PARAMS:  # other tensors, of other sizes, in one step
                p.mul_(0.5)
    W.grad = None


def traced(n: int, loops: bool = False):
    with record() as t:
        step(n, loops)
    return t


def sized(g: TraceGraph) -> dict[str, bool]:
    return {f"{n.name}@{n.id}": n.sized for n in g.nodes() if n.kind == "op"}


def test_the_second_size_sizes_the_nodes_and_a_third_is_covered():
    g = TraceGraph()
    g.merge(traced(8))
    assert not any(sized(g).values())
    assert not g.covers(traced(5))
    assert not any(sized(g).values())  # (asking changes nothing)
    nodes = len(g.nodes())
    assert g.merge(traced(5))
    assert len(g.nodes()) == nodes  # no branch: the same nodes, sized
    made = {name for name, s in sized(g).items() if s}
    assert {"aten::ones", "aten::mm", "aten::pow.Tensor_Scalar", "aten::mean"} <= {m.split("@")[0] for m in made}
    assert not any(name.startswith("aten::sub_") for name in made)  # W's update: its size never varied
    assert g.covers(traced(11)) and g.covers(traced(1))
    assert not g.merge(traced(3))


def test_other_sizes_within_one_step_stay_other_nodes():
    """A loop over tensors of other sizes (parameters) is not a size that varies: each of its
    ops keeps its own node, as in a graph of one trace."""
    g = TraceGraph()
    g.merge(traced(8, loops=True))
    muls = [n for n in g.nodes() if n.name == "aten::mul_.Tensor"]
    assert len(muls) == 3 and not any(n.sized for n in muls)
    g.merge(traced(5, loops=True))
    muls = [n for n in g.nodes() if n.name == "aten::mul_.Tensor"]
    assert len(muls) == 3 and not any(n.sized for n in muls)
    assert g.covers(traced(9, loops=True))


V = torch.randn(3, requires_grad=True)


def episode(n: int) -> None:
    """A REINFORCE-like step: a loop of ``n`` iterations, their results stacked."""
    outs = []
    h = torch.ones(3)
    for _ in range(n):
        h = torch.tanh(h * V)
        outs.append(h.sum())
    (torch.stack(outs) * torch.arange(float(n))).sum().backward()
    V.grad = None


def recorded_episode(n: int):
    with record() as t:
        episode(n)
    return t


def test_a_list_gathered_from_a_loop_is_one_op_whatever_its_length():
    """``torch.stack`` of one value per iteration is one node (the list is GATHERED), sized by
    the second length,
    and its gradient's ops, one ``select`` per element, iterate a RUN pseudo-loop: an episode
    of another length is the same path. Before, each length was another op and another trace
    (REINFORCE ran eagerly after ``max_traces``)."""
    from tracegraph.location import RUN
    from tracegraph.schema import GATHERED

    g = TraceGraph()
    g.merge(recorded_episode(5))
    assert g.merge(recorded_episode(9))  # the second length sizes what it sizes
    nodes = len(g.nodes())
    for n in (2, 7, 12, 5):
        assert g.covers(recorded_episode(n)), n
        assert not g.merge(recorded_episode(n)), n
    assert len(g.nodes()) == nodes
    stacks = [n for n in g.nodes() if n.name == "aten::stack"]
    assert len(stacks) == 1 and stacks[0].sized and stacks[0].key.attrs[0] == ((GATHERED, 5),)
    runs = [n for n in g.nodes() if n.kind == "loop" and n.key[1] == RUN]
    assert len(runs) == 1
    assert {m.name for m in runs[0].body.nodes} == {"aten::select.int"}
    assert set(runs[0].trips) == {5, 9, 2, 7, 12}


def test_a_list_of_values_from_outside_a_loop_keeps_its_length():
    """Only a run made by one node of a loop is gathered: a list written out in the code
    (``torch.stack([a, b])``) is the op it was, and its gradient no loop."""
    from tracegraph.location import RUN

    def step(k: int) -> None:
        a, b, c = V * 2, V * 3, V * 4
        (torch.stack([a, b] if k == 2 else [a, b, c]).sum()).backward()
        V.grad = None

    g = TraceGraph()
    for k in (2, 3):
        with record() as t:
            step(k)
        g.merge(t)
    stacks = [n for n in g.nodes() if n.name == "aten::stack"]
    assert len(stacks) == 2 and not any(n.sized for n in stacks)
    assert not any(n.kind == "loop" and n.key[1] == RUN for n in g.nodes())
