"""Blocks: where the runtime syncs, orders that keep each block whole, lifetimes when blocks run
complete, and a program's Schedule over several paths."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from planner import PathInput, Settings, Site, StorageKey, plan_program
from planner.graph import EAGER, Execution, PlanningGraph
from planner.order import block_order, greedy_order, lazy_order, streamed, valid_block_order
from planner.simulate import needed_at, replay
from tests.planner.helpers import random_graph
from tracegraph import record

BLOCKS = Execution(blocks=True)


def with_blocks(g: PlanningGraph, starts: list[int]) -> PlanningGraph:
    g = g.with_execution(BLOCKS)
    g.block_starts = tuple(starts)
    return g


def positions_of_blocks(g: PlanningGraph, order: list[int]) -> bool:
    pos = {v: i for i, v in enumerate(order)}
    return all(sorted(pos[v] for v in block) == list(block) for block in g.blocks())


@pytest.mark.parametrize("seed", range(40))
def test_block_orders_keep_every_block_whole_and_never_beat_by_the_issue_order(seed):
    rng = random.Random(seed)
    n = rng.randint(4, 30)
    g = with_blocks(random_graph(rng, n), [0, *sorted(rng.sample(range(1, n), k=rng.randint(0, 3)))])
    found = block_order(g)
    assert g.is_order(found.order) and positions_of_blocks(g, found.order)
    assert found.peak == replay(g, found.order).peak <= replay(g, list(range(n))).peak


@pytest.mark.parametrize("seed", range(20))
def test_a_forced_block_order_is_kept(seed):
    rng = random.Random(seed)
    n = rng.randint(6, 20)
    g = with_blocks(random_graph(rng, n), [0, n // 2])
    first = g.blocks()[0]
    forced = tuple(v - first.start for v in greedy_order_of_block(g, first))
    assert valid_block_order(g, first, forced)
    found = block_order(g, {0: forced})
    assert tuple(found.order[: len(first)]) == tuple(first.start + k for k in forced)


def greedy_order_of_block(g: PlanningGraph, block: range) -> list[int]:
    """A valid order of ``block``'s ops other than the issue order, when there is one: the
    reverse of the issue order wherever dependencies allow."""
    order, done = [], set()
    while len(order) < len(block):
        ready = [v for v in block if v not in done and all(u in done or u not in block for u in g.preds[v])]
        v = max(ready)
        order.append(v)
        done.add(v)
    return order


@pytest.mark.parametrize("seed", range(30))
def test_a_lazy_order_reaches_the_greedy_peak_and_streams_at_least_as_much(seed):
    rng = random.Random(seed)
    g = random_graph(rng, rng.randint(5, 40))
    greedy = greedy_order(g)
    peak = replay(g, greedy).peak
    lazy = lazy_order(g, peak, lambda o: replay(g, o).peak)
    assert lazy is not None and g.is_order(lazy)
    assert replay(g, lazy).peak <= peak and streamed(lazy) >= streamed(greedy)


def test_a_storage_python_lets_go_of_in_a_later_block_is_held_until_that_block_starts():
    """0 makes a (held by Python until op 3), 1 reads it; block 2 starts at op 2."""
    rng = random.Random(0)
    g = with_blocks(random_graph(rng, 5), [0, 2])
    g.storages[0].uses = [0, 1]
    g.storages[0].release = 3  # Python let go of it after op 3 was issued: in the second block
    for v in (2, 3, 4):
        g.preds[v].discard(0)
    assert needed_at(g, list(range(5)))[0][-1] == 1  # freed before the second block runs
    g.storages[0].release = 1  # let go of in its own block: freed after its last use
    assert needed_at(g, list(range(5)))[0][-1] == 1
    g.block_starts = (0, 4)
    g.storages[0].release = 4  # let go of in the second block (which starts at 4): held to op 3
    assert needed_at(g, list(range(5)))[0][-1] == 3
    g = g.with_execution(Execution(blocks=False, lag=2))  # as issued: two ops after Python let go
    assert needed_at(g, list(range(5)))[0][-1] == 4


def traced_paths():
    """Two paths of a step with a fetch: a branch on the loss's value after it, and a wide
    temporary of its own on each branch."""
    torch.manual_seed(0)
    lin, head = torch.nn.Linear(8, 256), torch.nn.Linear(256, 1)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    paths = []
    for branch in (0, 1):
        with record() as tr:
            h = lin(x)
            loss = F.mse_loss(head(h), y)
            if loss.item() > -1 and branch:  # a fetch, then a branch
                t = torch.sin(h) * 2.0
            else:
                t = torch.cos(h) + 1.0
            (loss + t.mean()).backward()
            for p in (*lin.parameters(), *head.parameters()):
                p.grad = None
        paths.append(tr)
    return paths


def sites_of(paths):
    """Sites as a TraceGraph would number them: ops the two paths share keep one node (same
    position up to the branch), the rest get nodes of their own per path."""
    (a, b) = paths
    shared = next(i for i, (x, y) in enumerate(zip(a.ops, b.ops)) if x.key != y.key)
    out = []
    for p, tr in enumerate(paths):
        out.append(tuple(Site(i if i < shared else 1000 * (p + 1) + i, ()) for i in range(len(tr.ops))))
    return out


def test_a_program_schedule_runs_every_path_in_valid_block_orders_and_shares_branch_bytes():
    paths = traced_paths()
    inputs = [PathInput(tr, s, frozenset(range(len(tr.ops)))) for tr, s in zip(paths, sites_of(paths))]
    schedule = plan_program(inputs, Settings())
    assert len(schedule.paths) == 2 and set(schedule.signatures.values()) == {0, 1}
    for p in inputs:
        g = PlanningGraph.from_trace(p.trace, BLOCKS)
        assert len(g.block_starts) == 2  # the fetch
        for block in g.blocks():
            planned = schedule.blocks[tuple(p.sites[v] for v in block)]
            assert valid_block_order(g, block, planned.order)
            assert planned.bound > 0 and len(planned.new_bytes) == len(block)
    for i, plan in enumerate(schedule.paths):
        g = PlanningGraph.from_trace(paths[i])
        assert plan.planned_peak <= plan.eager_peak == replay(g.with_execution(EAGER), list(range(len(g)))).peak
    # the wide temporaries of the two branches (sin's and cos's outputs) share arena bytes
    wide = 16 * 256 * 4
    spans = []
    for p in inputs:
        for op in p.trace.ops:
            if op.name in ("aten::sin", "aten::cos") and not op.is_backward:
                key = StorageKey(p.sites[op.index].node, 0, ())
                assert key in schedule.offsets
                spans.append((schedule.offsets[key], schedule.offsets[key] + wide))
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1


def test_a_plan_says_whether_its_blocks_run_ahead_of_their_launch():
    """The plan is for an executor that runs blocks as they are issued unless waiting for the
    launch saves memory (planner.program.AHEAD_SLACK): a step whose savings need nothing Python
    holds to its end runs ahead; the branch program above keeps its arena at the launch."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 64)
    x = torch.randn(16, 8)
    with record() as tr:
        loss = F.mse_loss(lin(x).tanh(), torch.zeros(16, 64))
        loss.backward()  # (the gradients escape)
        del loss
        with torch.no_grad():
            for p in lin.parameters():
                p.sub_(0.1 * p.grad)
            lin.weight.mul_(0.5)
    ahead = plan_program([PathInput(tr, tuple(Site(i, ()) for i in range(len(tr.ops))), frozenset())])
    assert "blocks: run ahead" in ahead.methods
    paths = traced_paths()
    inputs = [PathInput(t, s, frozenset(range(len(t.ops)))) for t, s in zip(paths, sites_of(paths))]
    assert "blocks: at their launch" in plan_program(inputs, Settings()).methods
