"""Terra Algorithm 1 (case assignment) on hand-built TraceGraphs."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracegraph import TraceGraph, select_cases

# Terra thesis, Figure 3.6(a)/3.7, as its text describes it: edge a enters node 1; node 1 has
# out-degree 3 (edges b, c, d to nodes 2, 4, 6); 2->3 and 4->5 are linear chains; 3 and 5 lead
# to node 7 (g, h); 6 leads to node 8 by edge i; 7 leads to 8 by edge j; then 8->9->end.
FIG_3_6 = {
    "a": ("start", 1), "b": (1, 2), "c": (1, 4), "d": (1, 6), "e": (2, 3), "f": (4, 5),
    "g": (3, 7), "h": (5, 7), "i": (6, 8), "j": (7, 8), "k": (8, 9), "l": (9, "end"),
}  # fmt: skip


def as_labels(graph: TraceGraph, switches) -> list[list[tuple[tuple, set]]]:
    """Switch-cases as [[(block labels, {control edge letters})]] for comparison."""
    name = {(graph.node_by_label(u) if u != "start" else graph.root.start,
             graph.node_by_label(v) if v != "end" else graph.root.end): k
            for k, (u, v) in FIG_3_6.items()}  # fmt: skip
    return [
        [(tuple(n.label for n in c.block), {name[e] for e in c.control_edges}) for c in sc.cases]
        for sc in switches
    ]


def test_figure_3_6_switch_cases_match_the_thesis():
    g = TraceGraph.from_edges(FIG_3_6.values())
    got = as_labels(g, g.switch_cases())
    assert got == [
        [((1,), {"a"})],
        [((2, 3), {"b"}), ((4, 5), {"c"}), ((6,), {"d"})],
        [((7,), {"g", "h"}), ((), {"i"})],
        [((8, 9), {"i", "j"})],
    ]
    assert [sc.is_switch for sc in g.switch_cases()] == [False, True, True, False]


def test_figure_3_6_each_trace_selects_the_documented_cases():
    g = TraceGraph.from_edges(FIG_3_6.values())
    S = g.switch_cases()
    n = g.node_by_label
    start, end = g.root.start, g.root.end
    # following edge c runs case 2 of the first Switch-Case operation (thesis text)
    assert select_cases(S, [start, n(1), n(4), n(5), n(7), n(8), n(9), end]) == [0, 1, 0, 0]
    assert select_cases(S, [start, n(1), n(6), n(8), n(9), end]) == [0, 2, 1, 0]


def test_linear_chain_is_one_block_and_no_switch():
    g = TraceGraph.from_edges([("start", "x"), ("x", "y"), ("y", "z"), ("z", "end")])
    (sc,) = g.switch_cases()
    assert not sc.is_switch
    assert [n.label for n in sc.cases[0].block] == ["x", "y", "z"]


def test_trace_that_ends_early_selects_only_the_switches_it_reaches():
    g = TraceGraph.from_edges([("start", 1), (1, "end"), (1, 2), (2, "end")])
    S = g.switch_cases()
    assert [[tuple(n.label for n in c.block) for c in sc.cases] for sc in S] == [[(1,)], [(2,)]]
    start, end, n = g.root.start, g.root.end, g.node_by_label
    assert select_cases(S, [start, n(1), end]) == [0]
    assert select_cases(S, [start, n(1), n(2), end]) == [0, 0]


def test_select_cases_rejects_a_path_the_graph_does_not_have():
    g = TraceGraph.from_edges([("start", 1), (1, 2), (2, "end")])
    with pytest.raises(ValueError, match="no case"):
        select_cases(g.switch_cases(), [g.root.start, g.node_by_label(2), g.root.end])


def test_from_edges_rejects_a_node_off_every_path():
    with pytest.raises(ValueError, match="not on a path"):
        TraceGraph.from_edges([("start", 1), (1, "end"), (2, 3), (3, "end")])


# -- property: Definition 5 for random TraceGraphs and random traces -----------------------


@st.composite
def dags_and_paths(draw):
    """A random DAG with unique start and end (Definition 1) and random start-end paths."""
    n = draw(st.integers(min_value=1, max_value=12))
    edges = set()
    for j in range(n):
        for i in range(j):
            if draw(st.booleans()) and draw(st.booleans()):
                edges.add((i, j))
    for v in range(n):
        if not any(b == v for _, b in edges):
            edges.add(("start", v))
        if not any(a == v for a, _ in edges):
            edges.add((v, "end"))
    for v in draw(st.sets(st.integers(0, n - 1), max_size=3)):
        edges.add(("start", v))
    for v in draw(st.sets(st.integers(0, n - 1), max_size=3)):
        edges.add((v, "end"))
    seed = draw(st.integers(0, 2**16))
    return sorted(edges, key=str), seed


def random_paths(g: TraceGraph, seed: int, count: int = 20):
    rng = random.Random(seed)
    r = g.root
    for _ in range(count):
        path = [r.start]
        while path[-1] is not r.end:
            path.append(rng.choice(r.succ[path[-1]]))
        yield path


@settings(max_examples=300, deadline=None)
@given(dags_and_paths())
def test_switch_cases_cover_every_trace_definition_5(case):
    edges, seed = case
    g = TraceGraph.from_edges(edges)
    S = g.switch_cases()
    region = g.root

    # every node lies in exactly one basic block
    placed = [n for sc in S for c in sc.cases for n in c.block]
    assert sorted(n.id for n in placed) == sorted(n.id for n in region.nodes)

    for sc in S:
        # Definition 2: each block is a linear chain
        for c in sc.cases:
            for u, v in c.in_chain_edges():
                assert region.succ[u] == [v] and region.pred[v] == [u]
            for e in c.control_edges:
                assert e[1] is c.block[0] if c.block else True
        # Definition 3: cases of one switch are mutually exclusive
        for i, c1 in enumerate(sc.cases):
            for c2 in sc.cases[i + 1 :]:
                assert not set(c1.block) & set(c2.block)
                assert not set(c1.control_edges) & set(c2.control_edges)

    for path in random_paths(g, seed):
        chosen = select_cases(S, path)  # raises if condition 1 fails or blocks mismatch
        path_edges = list(zip(path, path[1:]))
        # Definition 5, condition 2: Path(t) = U({d_i} ∪ I(L_ci)) ∪ {e_k}
        union = set()
        for sc, ci in zip(S, chosen):
            case = sc.cases[ci]
            (d,) = set(case.control_edges) & set(path_edges)  # a unique edge d_i
            union |= {d, *case.in_chain_edges()}
        union.add(path_edges[-1])
        assert union == set(path_edges)
