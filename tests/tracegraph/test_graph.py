"""Merging traces into a TraceGraph, coverage, generalisation and bad input."""

from __future__ import annotations

import pytest
import torch

from tracegraph import IncompleteTraceError, TraceGraph, record
from tracegraph.graph import EXT, LOOP, Cursor


def rec(fn, *args):
    with record() as tr:
        fn(*args)
    return tr


def fingerprint(g: TraceGraph):
    """Everything a merge may change, for before/after comparisons."""
    out = [g._next_id, g.traces, sorted(g._by_id)]
    for r in g.regions():
        for n in [r.start, *r.nodes, r.end]:
            out.append((n.id, n.kind, n.key, n.sources, n.promoted, n.out_metas, n.visits,
                        dict(n.trips), sorted(map(str, n.fetches)),
                        {k: sorted(map(str, v)) for k, v in n.enter_sources.items()},
                        [v.id for v in r.succ[n]], [u.id for u in r.pred[n]]))  # fmt: skip
        out.append(sorted((str(k), [n.id for n in v]) for k, v in r.index.items()))
    return out


x0 = torch.randn(4)


def figure_3_2(rval: bool, n: int):
    """The program of Terra Figure 3.2(a): a branch that merges back, then a loop."""
    if rval:
        x1 = x0.sin()  # Op1
        x2 = x1.cos()  # Op2
    else:
        x2 = x0.cos()  # Op2, another location
    x3 = x2.exp()  # Op3: both branches merge back here
    for _ in range(n):
        x3 = x3.tanh()  # Op4, in a loop
    return x3


def test_merging_the_same_trace_twice_adds_nothing():
    g = TraceGraph()
    t = rec(figure_3_2, True, 2)
    assert g.merge(t) is True
    assert g.covers(t)
    assert g.merge(rec(figure_3_2, True, 2)) is False
    assert g.traces == 2


def test_branch_and_merge_back_as_in_figure_3_2():
    g = TraceGraph()
    g.merge(rec(figure_3_2, True, 2))
    t2 = rec(figure_3_2, False, 3)
    assert not g.covers(t2)
    assert g.merge(t2) is True
    names = [n.name for n in g.root.nodes]
    # sin, cos (true branch), cos (false branch), one exp, one loop: merged back at Op3
    assert sorted(names) == ["aten::cos", "aten::cos", "aten::exp", "aten::sin", "loop"]
    exp = next(n for n in g.root.nodes if n.name == "aten::exp")
    assert len(exp.sources[0]) == 2  # a phi: x2 from either branch
    loop = next(n for n in g.root.nodes if n.kind == LOOP)
    assert dict(loop.trips) == {2: 1, 3: 1}
    assert [n.name for n in loop.body.nodes] == ["aten::tanh"]
    for rval, n in [(True, 1), (False, 7), (True, 4)]:
        assert g.covers(rec(figure_3_2, rval, n))
    sc = g.switch_cases()
    assert [len(s.cases) for s in sc] == [2, 1]  # (sin, cos) or (cos); then (exp, loop)


def test_same_op_reading_another_value_is_another_node():
    x = torch.randn(3)

    def prog(flag):
        y = x.sin()
        z = x.cos()
        return (y if flag else z).exp()  # both producers run on both paths

    g = TraceGraph()
    g.merge(rec(prog, True))
    assert g.merge(rec(prog, False)) is True
    exps = [n for n in g.root.nodes if n.name == "aten::exp"]
    assert len(exps) == 2  # a phi could not tell them apart, so no merge
    assert g.covers(rec(prog, True)) and g.covers(rec(prog, False))


def test_a_trace_of_another_program_branches_at_start():
    a = torch.randn(3)

    def program_a():
        return a.sin().sum()

    def program_b():
        return (a * 2).exp()

    g = TraceGraph()
    g.merge(rec(program_a))
    other = rec(program_b)
    assert not g.covers(other)
    assert g.merge(other) is True
    assert len(g.root.succ[g.root.start]) == 2
    assert g.covers(rec(program_b)) and g.covers(rec(program_a))
    (sc, *_) = g.switch_cases()
    assert sc.is_switch


def test_a_failed_step_cannot_be_merged_and_leaves_the_graph_alone():
    g = TraceGraph()
    g.merge(rec(figure_3_2, True, 1))
    before = fingerprint(g)
    with pytest.raises(RuntimeError):
        with record() as bad:
            x0.sin()
            torch.ones(2) @ torch.ones(3)  # shape error mid-step
    with pytest.raises(IncompleteTraceError, match="raised RuntimeError"):
        g.merge(bad)
    with pytest.raises(IncompleteTraceError):
        g.covers(bad)
    assert fingerprint(g) == before


def test_merge_is_all_or_nothing(monkeypatch):
    g = TraceGraph()
    g.merge(rec(figure_3_2, True, 2))
    before = fingerprint(g)
    calls = {"n": 0}
    original = Cursor.match_op

    def failing_op(self, *args):
        calls["n"] += 1
        if calls["n"] == 4:  # after the new branch's nodes and a generalisation
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(Cursor, "match_op", failing_op)
    with pytest.raises(KeyboardInterrupt):
        g.merge(rec(figure_3_2, False, 5))
    assert fingerprint(g) == before
    monkeypatch.undo()
    assert g.merge(rec(figure_3_2, False, 5)) is True  # and it still works afterwards


def test_bad_input():
    g = TraceGraph()
    with pytest.raises(TypeError, match="expected a tracegraph.Trace"):
        g.merge([1, 2, 3])
    r = record()
    with r as live:
        with pytest.raises(IncompleteTraceError, match="still being recorded"):
            g.merge(live)


def test_a_varying_python_scalar_becomes_a_fed_input():
    w = torch.randn(5)

    def step(lr):
        return (w * lr).sum()

    g = TraceGraph()
    assert g.merge(rec(step, 0.1))
    assert g.merge(rec(step, 0.05)) is True  # generalised once...
    mul = next(n for n in g.root.nodes if n.name == "aten::mul.Tensor")
    assert mul.promoted == {1}
    for lr in (0.01, 0.3, 1e-5):
        assert g.covers(rec(step, lr))  # ...then every value is covered
    assert len(g.root.nodes) == 2


def test_another_op_with_fewer_arguments_where_a_promoted_op_was_is_a_new_branch():
    """Found by the fuzzer (seed 93): an op with a promoted argument was compared with an op of
    fewer arguments by filling in the promoted one first, and the merge raised IndexError."""
    w = torch.randn(3, 3)

    def step(scale, transpose):
        y = w.exp()
        z = y.t() if transpose else y * scale
        return z.sum()

    g = TraceGraph()
    g.merge(rec(step, 0.5, False))
    assert g.merge(rec(step, 0.7, False)) is True  # aten::mul's scalar is promoted
    assert next(n for n in g.root.nodes if n.name == "aten::mul.Tensor").promoted == {1}
    branch = rec(step, 0.5, True)
    assert not g.covers(branch)
    assert g.merge(branch) is True  # a new branch: aten::t beside aten::mul
    assert g.covers(rec(step, 0.9, False)) and g.covers(rec(step, 0.1, True))


def test_a_scalar_that_changes_shapes_is_not_promoted():
    x = torch.randn(3, 4)
    g = TraceGraph()
    g.merge(rec(lambda d: x.sum(d), 0))
    assert g.merge(rec(lambda d: x.sum(d), 1)) is True
    sums = [n for n in g.root.nodes if n.name.startswith("aten::sum")]
    assert len(sums) == 2 and not any(n.promoted for n in sums)


def test_fetches_annotate_nodes_but_do_not_change_coverage():
    x = torch.randn(3)

    def step(show):
        y = x.exp()
        if show:
            y.sum().item()
        return y

    g = TraceGraph()
    g.merge(rec(step, False))
    g.merge(rec(step, True))
    s = next(n for n in g.root.nodes if n.name == "aten::sum")
    assert {k for k, _ in s.fetches} == {"item"}
    assert g.stats()["fetches"] == 1


def test_feeds_are_counted_per_node():
    w = torch.randn(3)
    g = TraceGraph()
    g.merge(rec(lambda: (w + w).exp()))
    add = next(n for n in g.root.nodes if n.name == "aten::add.Tensor")
    assert add.sources == ((EXT,), (EXT,)) and add.feeds == 2
