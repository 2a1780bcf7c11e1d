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
