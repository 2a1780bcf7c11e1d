"""Why a trace is new: ``why_new`` and the reasons a non-mutating cursor raises (issue 14)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracegraph import FallbackReason, NotCovered, TraceGraph, record, why_new
from tracegraph.graph import Cursor

SOURCE = Path(__file__).read_text().splitlines()


def at(mark: str) -> str:
    """``test_reasons.py:N``: the line of this file that carries the comment ``# mark``."""
    (n,) = [i + 1 for i, line in enumerate(SOURCE) if line.endswith(f"# {mark}")]
    return f"test_reasons.py:{n}"


w = torch.randn(8, 8)


def step(x: torch.Tensor, lr: float = 0.1, n: int = 4, branch: bool = False, loops: int = 0,
         stop: bool = False) -> None:  # fmt: skip
    noise = torch.randn(n, 8)  # noise
    h = (x.mean(0) + noise).relu()  # relu
    if branch:
        h = h * 2  # mul
    for _ in range(loops):  # loop
        h = h.tanh()  # tanh
    s = h.sum()  # sum
    if stop:
        return
    w.add_(s, alpha=-lr)  # update


def rec(*args, **kwargs):
    with record() as tr:
        step(*args, **kwargs)
    return tr


def graph_of(*traces) -> TraceGraph:
    g = TraceGraph()
    for t in traces:
        g.merge(t)
    return g


x4 = torch.randn(4, 8)


def test_first_and_covered():
    g = TraceGraph()
    first = FallbackReason("first", "the first trace: the graph was empty", "")
    assert why_new(g, rec(x4)) == first
    g.merge(rec(x4))
    assert why_new(g, rec(x4)) is None


def test_a_python_scalar_that_varies():
    g = graph_of(rec(x4, lr=0.1))
    before = (g._next_id, len(g.root.nodes))
    why = why_new(g, rec(x4, lr=0.2))
    assert why == FallbackReason(
        "scalar",
        f"argument 2 (alpha) of aten::add_ at {at('update')} was -0.2, the graph has -0.1 "
        "(a Python scalar that varies)",
        at("update"),
    )
    assert (g._next_id, len(g.root.nodes)) == before  # the graph is not changed


def test_a_size_that_varies_as_an_argument_and_as_an_input():
    g = graph_of(rec(x4, n=4), rec(x4, n=4))
    assert why_new(g, rec(torch.randn(5, 8), n=5)) == FallbackReason(
        "shape",
        f"argument 0 (size) of aten::randn at {at('noise')} was [5, 8], the graph has [4, 8] "
        "(a size that varies)",
        at("noise"),
    )
    g.merge(rec(torch.randn(12, 8), n=12))
    # from the second size on, the ops are sized: any batch, any size of randn
    assert why_new(g, rec(torch.randn(5, 8), n=12)) is None
    assert why_new(g, rec(torch.randn(5, 8), n=5)) is None
    # a rank that varies is not a size
    assert why_new(g, rec(torch.randn(2, 5, 8), n=5)) == FallbackReason(
        "shape",
        f"tensor input 0 of aten::mean at {at('relu')}, a tensor from outside the step, has shape "
        "[2, 5, 8], the graph has [4, 8] (a rank that varies)",
        at("relu"),
    )


def test_a_new_op_then_a_new_branch():
    g = graph_of(rec(x4))
    assert why_new(g, rec(x4, branch=True)) == FallbackReason(
        "new op",
        f"a new op at {at('mul')}: aten::mul after aten::relu at {at('relu')}; the graph goes on "
        f"to aten::sum at {at('sum')} (code not run before)",
        at("mul"),
    )
    g = graph_of(rec(x4, branch=True))
    assert why_new(g, rec(x4)) == FallbackReason(
        "control flow",
        f"a new branch at {at('sum')}: aten::sum after aten::relu at {at('relu')}; the graph goes "
        f"on to aten::mul at {at('mul')} (control flow)",
        at("sum"),
    )


def test_a_new_loop_and_an_iteration_that_ends_elsewhere():
    g = graph_of(rec(x4))
    assert why_new(g, rec(x4, loops=2)) == FallbackReason(
        "loop",
        f"a new loop at {at('loop')} after aten::relu at {at('relu')}; the graph goes on to "
        f"aten::sum at {at('sum')} (a loop)",
        at("loop"),
    )
    g.merge(rec(x4, loops=2))
    assert why_new(g, rec(x4, loops=5)) is None  # more iterations of a known body


def test_the_step_ends_early():
    g = graph_of(rec(x4))
    assert why_new(g, rec(x4, stop=True)) == FallbackReason(
        "control flow",
        f"the step ended after aten::sum at {at('sum')}; the graph goes on to aten::add_ at "
        f"{at('update')} (control flow)",
        at("sum"),
    )


def test_another_value_flows_in():
    def two(x, swap):
        a, b = x.sin(), x.cos()  # sources
        return (b if swap else a) * 2  # reads

    traces = []
    for swap in (False, True):
        with record() as tr:
            two(x4, swap)
        traces.append(tr)
    why = why_new(graph_of(traces[0]), traces[1])
    assert why == FallbackReason(
        "dataflow",
        f"tensor input 0 of aten::mul at {at('reads')} is the result of aten::cos at "
        f"{at('sources')}, the graph has the result of aten::sin at {at('sources')} "
        "(another value flows in)",
        at("reads"),
    )


def test_not_covered_keeps_its_message_as_str():
    g = graph_of(rec(x4))
    with pytest.raises(NotCovered) as info:
        Cursor(g, rec(x4, lr=0.5), mutate=False).run()
    assert str(info.value) == info.value.reason.message and info.value.reason.category == "scalar"
    assert str(NotCovered("plain")) == "plain" and NotCovered("plain").reason.category == "other"


def test_a_reason_that_cannot_be_built_does_not_break_the_step():
    from tracegraph.reasons import end_reason

    why = end_reason(None, None)  # a bug while explaining: a plain reason, not an exception
    assert why.category == "other" and why.message.startswith("the step left the graph (end_reason")


def test_a_tensor_made_in_the_step_with_a_size_that_varies():
    def pick(x):
        idx = x.nonzero()  # made
        return idx.sum()  # reads made

    traces = []
    for x in (torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 3.0, 2.0])):
        with record() as tr:
            pick(x)
        traces.append(tr)
    assert why_new(graph_of(traces[0]), traces[1]) == FallbackReason(
        "shape",
        f"tensor input 0 of aten::sum at {at('reads made')}, made by aten::nonzero at "
        f"{at('made')}, has shape [3, 1], the graph has [2, 1] (a size that varies)",
        at("reads made"),
    )


def stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(rows).sum()  # stack


def test_a_list_of_tensors_whose_length_varies_is_a_size_said_by_its_length():
    """REINFORCE's ``torch.stack(log_probs)`` over an episode: the reason names the lists'
    lengths (it printed each of their tensors) and counts as a size one graph does not follow."""
    def rec_stacked(n: int):
        rows = [torch.randn(4) for _ in range(n)]
        with record() as tr:
            stacked(rows)
        return tr

    g = graph_of(rec_stacked(5), rec_stacked(9), rec_stacked(3), rec_stacked(12))
    assert why_new(g, rec_stacked(7)) == FallbackReason(
        "shape",
        f"argument 0 (tensors) of aten::stack at {at('stack')} was a list of 7 tensors, the graph has "
        "a list of 9 tensors, a list of 3 tensors, a list of 12 tensors and 1 more "
        "(the length of a list of tensors that varies)",
        at("stack"),
    )
