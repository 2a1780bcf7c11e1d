"""The simulator validates plans and measures their exact peak; bad plans are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner import InvalidPlan, PlanningGraph, plan_graph, replay
from planner.graph import ESCAPING, LOCAL, PERSISTENT
from planner.tracker import eager_peak
from tests.planner.helpers import chain_graph
from tracegraph import record


def mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def step():
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def test_eager_order_peak_matches_the_eager_tracker():
    step = mlp_step()
    step()
    step()
    measured = eager_peak(step)
    with record() as trace:
        step()
    g = PlanningGraph.from_trace(trace)
    assert abs(replay(g, list(range(len(g)))).peak - measured) <= 64


def test_storage_kinds_and_exact_sizes():
    step = mlp_step()
    step()
    with record() as trace:
        step()
    g = PlanningGraph.from_trace(trace)
    kinds = {s.kind for s in g.storages.values()}
    assert kinds == {PERSISTENT, LOCAL}  # gradients are released in the step: none escapes
    # parameters (4 tensors), momentum buffers (4), the batch (2): all persistent
    assert sum(s.kind == PERSISTENT for s in g.storages.values()) == 10
    assert g.persistent_bytes == 2 * 4 * (16 * 32 + 32 + 32 * 4 + 4) + 8 * 16 * 4 + 8 * 8


def test_mutations_and_random_ops_order_the_graph():
    w = torch.randn(4)
    with record() as trace:
        a = w * 2  # reads w
        w.add_(1.0)  # writes w: after the read
        b = w * 3  # reads the new w: after the write
        r1 = torch.rand(4)
        r2 = torch.rand(4)  # random ops keep their order
        (a + b + r1 + r2).sum().item()  # a fetch...
        c = torch.ones(2)  # ...orders the ops issued after it
    g = PlanningGraph.from_trace(trace)
    names = [op.name for op in g.ops]
    read, write, reread = names.index("aten::mul.Tensor"), names.index("aten::add_.Tensor"), 2
    assert read in g.preds[write] and write in g.preds[reread]
    r = [i for i, n in enumerate(names) if n == "aten::rand"]
    assert r[0] in g.preds[r[1]]
    ones = names.index("aten::ones")
    assert g.preds[ones], "the op after the fetch waits for the fetched value"
    del a, b, c


def test_plans_are_validated_and_bad_ones_refused():
    #  0 -> 1 -> 3, 0 -> 2 -> 3: two branches, both needed by op 3
    g = chain_graph([([], 4), ([0], 8), ([0], 8), ([1, 2], 4)])
    plan = plan_graph(g, time_limit=5)
    assert replay(g, plan.order, plan.offsets, arena_bytes=plan.arena_bytes).peak == plan.peak
    with pytest.raises(InvalidPlan, match="runs before op"):
        replay(g, [1, 0, 2, 3])
    with pytest.raises(InvalidPlan, match="not a permutation"):
        replay(g, [0, 1, 3])
    overlapping = dict(plan.offsets)
    overlapping[1] = overlapping[2] = 0  # co-live storages 1 and 2 at the same bytes
    with pytest.raises(InvalidPlan, match="overlap in the arena"):
        replay(g, [0, 1, 2, 3], overlapping)
    with pytest.raises(InvalidPlan, match="arena of 8 bytes"):
        replay(g, plan.order, plan.offsets, arena_bytes=8)
    with pytest.raises(InvalidPlan, match="no arena offset"):
        replay(g, plan.order, {})
    with pytest.raises(InvalidPlan, match="over the budget"):
        replay(g, plan.order, budget=plan.peak - 1)


def test_escaping_storages_stay_to_the_end():
    g = chain_graph([([], 4), ([0], 8), ([1], 2)])
    spans = replay(g, [0, 1, 2]).intervals
    assert spans[0] == (0, 1) and spans[1] == (1, 2)
    assert g.storages[2].kind == ESCAPING and spans[2] == (2, 2)


def test_a_value_held_until_the_step_returns_is_held_to_the_end_by_an_executor_running_ahead():
    """Blocks that run once complete free it after its last use; blocks run ahead of their
    launch learn of its release only at the end (planner.graph.Execution.ahead)."""
    from planner.graph import Execution
    from planner.simulate import lifetimes

    x = torch.randn(64, 64)

    def step():
        held = x * 2.0  # let go of only as the step returns
        return (held.exp() + 1.0).sum()  # exp's result: let go of right after its use

    with record() as trace:
        step()
    n = len(trace.ops)
    made = {op.name: trace.values[op.outputs[0]].storage for op in trace.ops}
    held, temp = made["aten::mul.Tensor"], made["aten::exp"]
    g = PlanningGraph.from_trace(trace)
    assert g.storages[held].release >= n and g.storages[temp].release < n
    launched = lifetimes(g.with_execution(Execution(blocks=True)), list(range(n)))
    ahead = lifetimes(g.with_execution(Execution(blocks=True, ahead=True)), list(range(n)))
    assert launched[held] == (0, 1) and ahead[held] == (0, n - 1)
    assert launched[temp] == ahead[temp] == (1, 2)
