"""Real training steps recorded for 12 steps: traces to convergence and graph shape."""

from __future__ import annotations

import pytest

from examples.programs import (
    DataDependentLoop,
    LossBranch,
    SDPoint,
    StaticMLP,
    VariableLengthRNN,
)
from tracegraph import TraceGraph, summarize
from tracegraph.graph import LOOP
from tracegraph.location import CODES

STEPS = 12


def top_level(graph: TraceGraph) -> list[int]:
    """Number of cases of each top-level switch-case."""
    return [len(sc.cases) for sc in graph.switch_cases()]


def model_loop(graph: TraceGraph, program, backward: bool):
    """The top-level loop node of the loop written in ``program.step`` (not the optimizer's)."""
    code = type(program).step.__code__
    (node,) = [
        n
        for n in graph.root.nodes
        if n.kind == LOOP
        and CODES.code(n.key[1]) is code
        and n.location.startswith("grad of") == backward
    ]
    return node


def all_covered(graph: TraceGraph, program, steps: int) -> bool:
    """Record more steps from the same recording site and check none adds to the graph.

    (Locations are relative to the frame that opens the recording, so the same site is used.)
    """
    more = summarize(program.step, steps, graph=graph)
    return all(s.covered for s in more.steps)


def converge(program, steps: int = STEPS):
    summary = summarize(program.step, steps)
    assert summary.traces <= 4, summary
    assert summary.converged_at is not None, summary
    assert all_covered(summary.graph, program, 4)  # and it stays converged
    return summary, summary.graph


def test_static_mlp_is_one_trace_and_one_block():
    summary, g = converge(StaticMLP(0))
    assert summary.traces == 1
    (sc,) = g.switch_cases()
    assert not sc.is_switch and len(sc.cases[0].block) == len(g.root.nodes)
    assert g.stats()["fetches"] == 0


def test_loss_branch_is_a_switch_in_forward_and_in_backward():
    summary, g = converge(LossBranch(0))
    assert summary.traces == 2  # both paths appear in the first two steps
    assert top_level(g) == [1, 2, 1, 2, 1]
    for sc in g.switch_cases():
        if sc.is_switch:  # the branch is optional work: one case runs it, one skips it
            assert sorted(len(c.block) > 0 for c in sc.cases) == [False, True]
    # the .item() of the condition is a fetch point
    assert any(k == "item" for n in g.nodes() for k, _ in n.fetches)


def test_data_dependent_trip_count_is_a_loop_node_forward_and_backward():
    program = DataDependentLoop(0)
    summary, g = converge(program)
    assert top_level(g) == [1]  # no switch at top level: the loop absorbs the variation
    fwd, bwd = model_loop(g, program, False), model_loop(g, program, True)
    trips = set(fwd.trips)
    assert len(trips) >= 2 and set(bwd.trips) == trips
    assert {n.name for n in fwd.body.nodes} >= {"aten::addmm", "aten::tanh", "aten::add.Tensor"}


def test_sdpoint_random_downsampling_point():
    program = SDPoint(0)
    summary, g = converge(program)
    assert top_level(g) == [1]
    for point in range(3):  # every downsampling point is a path of the graph
        program.force_point = point
        assert all_covered(g, program, 1)
    fwd = model_loop(g, program, False)
    assert set(fwd.trips) == {3}
    pools = [n for n in fwd.body.nodes if n.name == "aten::avg_pool2d"]
    assert len(pools) == 1  # one pool node, reached from the iteration that downsamples


def test_trip_count_varying_every_step_converges_forward_and_backward():
    program = VariableLengthRNN(0)
    summary, g = converge(program)
    assert top_level(g) == [1]
    lengths = [1 + (5 * i + 2) % program.max_len for i in range(STEPS)]
    assert all(a != b for a, b in zip(lengths, lengths[1:]))  # it really varies every step
    fwd, bwd = model_loop(g, program, False), model_loop(g, program, True)
    size = len(g.nodes())
    program.lengths = [6, 1, 4, 2, 5, 3, 3, 6, 2, 1]
    assert all_covered(g, program, 10)  # every length, in another order: nothing new
    assert len(g.nodes()) == size
    assert set(fwd.trips) == set(bwd.trips) == set(range(1, program.max_len + 1))


@pytest.mark.parametrize("program", [StaticMLP, LossBranch, DataDependentLoop, SDPoint, VariableLengthRNN])
def test_summary_counts_match_the_graph(program):
    summary = summarize(program(0).step, 4)
    st = summary.graph.stats()
    assert st["traces"] == 4  # every trace is merged; covered ones add only statistics
    assert summary.traces == sum(not s.covered for s in summary.steps) >= 1
    assert st["nodes"] == sum(1 for n in summary.graph.nodes() if n.kind != LOOP)
    assert f"new traces: {summary.traces} of 4 steps" in str(summary)
