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
