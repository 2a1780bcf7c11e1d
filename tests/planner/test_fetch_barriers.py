"""Fetch barriers: every op issued after Python read a value descends from the op that made it.

:func:`planner.graph.fetch_barrier_edges` replaced a scan of every suffix per read (quadratic on
long traces with many reads). Checked against that scan, kept here as the reference: the same
transitive closure, with a subset of its edges, on random graphs and on recorded traces.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from planner import PlanningGraph
from planner.graph import _RangeMax, fetch_barrier_edges, fetch_points
from planner.order import greedy_order
from planner.simulate import replay
from tracegraph import record


def reference_barriers(preds: list[set[int]], points) -> list[set[int]]:
    """The former ``PlanningGraph._add_fetch_barriers``, on a copy of ``preds``: per point, an
    edge from the producer to every op from ``after`` on that has no pred at or after it."""
    preds = [set(p) for p in preds]
    n = len(preds)
    for after, producer in points:
        if producer is None or after >= n:
            continue
        for j in range(after, n):
            if not any(p >= after for p in preds[j]) and producer != j:
                preds[j].add(producer)
    return preds


def with_edges(preds: list[set[int]], edges) -> list[set[int]]:
    preds = [set(p) for p in preds]
    for u, v in edges:
        if u != v:
            preds[v].add(u)
    return preds


def closure(preds: list[set[int]]) -> list[int]:
    """Per op, its ancestors as a bitset (preds are forward: index order is topological)."""
    anc = [0] * len(preds)
    for v, ps in enumerate(preds):
        for u in ps:
            assert u < v, "an edge against the issue order"
            anc[v] |= anc[u] | (1 << u)
    return anc


def required(preds: list[set[int]], points) -> list[int]:
    """The closure the barriers must give: every op from ``after`` on descends from the
    producer of every read (besides ``preds``)."""
    n = len(preds)
    full = with_edges(
        preds, [(p, j) for a, p in points if p is not None and p < a for j in range(a, n)]
    )
    return closure(full)


def random_case(rng: random.Random, most: int = 40):
    n = rng.randint(1, most)
    density = rng.choice([0.0, 0.05, 0.15, 0.4])
    preds = [{u for u in range(v) if rng.random() < density} for v in range(n)]
    points = []
    for _ in range(rng.randint(0, max(1, n // rng.choice([1, 3, 10])))):
        after = rng.randint(1, n + 1)  # after == n or more: a read after the last op
        producer = None if rng.random() < 0.1 else rng.randrange(min(after, n))
        points.append((after, producer))
    if points and rng.random() < 0.3:
        points += rng.sample(points, k=len(points) // 2 + 1)  # reads of the same value again
    return preds, points


@pytest.mark.parametrize("seed", range(600))
def test_same_closure_and_a_subset_of_the_reference_edges_on_random_graphs(seed):
    preds, points = random_case(random.Random(seed))
    new = with_edges(preds, fetch_barrier_edges(preds, points))
    old = reference_barriers(preds, points)
    assert closure(new) == closure(old) == required(preds, points)
    assert all(new[v] <= old[v] for v in range(len(preds)))


@pytest.mark.parametrize("seed", range(30))
def test_same_closure_on_larger_random_graphs(seed):
    preds, points = random_case(random.Random(10_000 + seed), most=400)
    new = with_edges(preds, fetch_barrier_edges(preds, points))
    old = reference_barriers(preds, points)
    assert closure(new) == closure(old) == required(preds, points)
    assert all(new[v] <= old[v] for v in range(len(preds)))


def test_range_maximum_of_every_range():
    rng = random.Random(0)
    for size in (1, 2, 3, 7, 8, 9, 33):
        xs = [rng.randrange(100) for _ in range(size)]
        table = _RangeMax(xs)
        for lo in range(size):
            for hi in range(lo + 1, size + 1):
                assert table.query(lo, hi) == max(xs[lo:hi])


def test_many_reads_of_one_long_chain_cost_one_edge_per_source():
    # 0 -> 1 -> ... -> 99; op 100 + i reads nothing (a weight's transpose); a read after each
    n = 200
    preds = [{v - 1} if 0 < v < 100 else set() for v in range(n)]
    points = [(v + 1, v) for v in range(n - 1)]
    edges = fetch_barrier_edges(preds, points)
    assert sorted(edges) == [(v - 1, v) for v in range(100, n)]
    assert closure(with_edges(preds, edges)) == closure(reference_barriers(preds, points))


def test_reads_of_old_values_each_order_the_sources_after_them():
    # ops 0..4 independent; Python reads 0, 1, 2 after op 4; op 5 reads nothing
    preds = [set() for _ in range(6)]
    points = [(5, 0), (5, 1), (5, 2), (5, 1)]
    assert sorted(fetch_barrier_edges(preds, points)) == [(0, 5), (1, 5), (2, 5)]


def test_reads_of_external_values_and_after_the_last_op_are_no_barrier():
    preds = [set(), {0}, set()]
    assert fetch_barrier_edges(preds, [(1, None), (3, 0), (5, 1)]) == []


# recorded traces: programs with many reads


def reinforce(steps: int):
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(policy.parameters(), lr=0.01)

    def step():
        state, log_probs, rewards = torch.zeros(4), [], []
        for t in range(steps):
            probs = torch.softmax(policy(state), -1)
            action = int(torch.multinomial(probs, 1).item())
            log_probs.append(torch.log(probs[action]))
            rewards.append(float(state.sum().item()) - action)
            state = torch.tanh(state + (0.5 if action else -0.5) + 0.1 * torch.randn(4))
        ret = torch.tensor(rewards).flip(0).cumsum(0).flip(0)
        loss = -(torch.stack(log_probs) * (ret - ret.mean())).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def lbfgs():
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4, history_size=3)
    x, y = torch.randn(16, 6), torch.randn(16, 1)

    def closure_():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    def step():
        opt.step(closure_)

    return step


def early_stop():
    torch.manual_seed(0)
    w = torch.randn(8, 8) * 0.1
    x = torch.randn(8)

    def step():
        h = x
        for _ in range(30):
            h = torch.tanh(w @ h + x)
            if h.abs().max() < 0.01:  # a read per iteration (bool of a tensor)
                break
        return h.sum().item()

    return step


@pytest.mark.parametrize("make", [lambda: reinforce(25), lbfgs, early_stop])
def test_recorded_traces_same_closure_and_order_as_the_reference(make, monkeypatch):
    step = make()
    step()
    with record() as trace:
        step()
    g = PlanningGraph.from_trace(trace)
    points = fetch_points(trace)
    assert sum(p is not None for _, p in points) >= 4, "the program reads values"
    monkeypatch.setattr(PlanningGraph, "_add_fetch_barriers", lambda self, trace: None)
    base = PlanningGraph.from_trace(trace)
    old = reference_barriers(base.preds, points)
    assert closure(g.preds) == closure(old) == required(base.preds, points)
    assert all(g.preds[v] <= old[v] for v in range(len(g)))
    assert sum(map(len, g.preds)) <= sum(map(len, old))
    ref = PlanningGraph(base.ops, base.storages, old)
    assert greedy_order(g) == greedy_order(ref)
    assert replay(g, greedy_order(g)).peak == replay(ref, greedy_order(ref)).peak


def test_a_read_per_step_of_a_long_loop_adds_fewer_edges_than_ops(monkeypatch):
    step = reinforce(25)
    step()
    with record() as trace:
        step()
    monkeypatch.setattr(PlanningGraph, "_add_fetch_barriers", lambda self, trace: None)
    base = PlanningGraph.from_trace(trace)
    points = fetch_points(trace)
    added = fetch_barrier_edges(base.preds, points)
    old = sum(map(len, reference_barriers(base.preds, points))) - sum(map(len, base.preds))
    # 51 reads, 1244 ops: 251 edges (the scan added 4001)
    assert len(points) > 50 and len(added) < len(base) < old
