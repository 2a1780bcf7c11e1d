"""Order planning: always valid, never worse than eager, optimal on small graphs."""

from __future__ import annotations

import random

import pytest

from planner import replay
from planner.order import greedy_order, optimal_order
from tests.planner.helpers import best_peak, chain_graph, random_graph


@pytest.mark.parametrize("seed", range(12))
def test_optimal_order_matches_exhaustive_search_on_small_graphs(seed):
    g = random_graph(random.Random(seed), random.Random(seed).randint(4, 8))
    result = optimal_order(g, time_limit=10)
    assert result.method == "cp-sat" and result.gap == 0.0  # proven optimal
    assert result.peak == best_peak(g)
    assert replay(g, result.order).peak == result.peak


@pytest.mark.parametrize("seed", range(12))
def test_greedy_order_is_valid_and_never_worse_than_eager(seed):
    g = random_graph(random.Random(100 + seed), 9)
    order = greedy_order(g)
    assert g.is_order(order)
    assert optimal_order(g, time_limit=5, warm=order).peak <= replay(g, order).peak


def test_reordering_lowers_the_peak_where_it_can():
    # two independent producer/consumer pairs: eager runs both producers first
    g = chain_graph([([], 100), ([], 100), ([0], 1), ([1], 1), ([2, 3], 1)])
    assert replay(g, list(range(5))).peak == 201
    assert optimal_order(g, time_limit=5).peak == 102  # 0, 2, 1, 3, 4


def test_greedy_keeps_an_update_that_frees_nothing_in_its_issue_place():
    """An in-place update of optimizer state (a momentum buffer's ``mul_``) changes no live
    bytes: moved to the front it gains nothing, and the executor, which runs ops as the
    skeleton issues them, would wait for it (on VGG-11 the greedy order once put 15 of them
    from the end of the step among the forward ops). Where it readies an update that frees a
    gradient it still goes first."""
    import torch

    from planner import PlanningGraph
    from tracegraph import record

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    buf = torch.zeros(64, 64)

    def step():
        h = (x * 2.0).exp()
        loss = h.sum()
        buf.mul_(0.9)  # frees nothing, readies nothing that frees
        return loss

    with record() as trace:
        step()
    g = PlanningGraph.from_trace(trace)
    assert greedy_order(g) == list(range(len(g.ops)))

    def update():
        grad = (x * 3.0).tanh()  # a gradient: let go of by the update
        other = (x * 4.0).exp()  # work the skeleton issued before the update
        buf.mul_(0.9)
        buf.add_(grad)
        return other.sum()

    with record() as trace:
        update()
    names = [op.name for op in trace.ops]
    g = PlanningGraph.from_trace(trace)
    order = [names[v] for v in greedy_order(g)]
    # the buffer's mul_ and the add_ that frees the gradient run as soon as it is complete
    assert order.index("aten::add_.Tensor") < order.index("aten::exp"), order
