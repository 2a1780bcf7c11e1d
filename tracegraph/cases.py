"""Case assignment: Terra Algorithm 1 (thesis §3.2.2, Definitions 1–5, Theorem 1).

The region is traversed in topological order; each basic block is a linear chain made as long
as possible, and the blocks reachable by the same frontier of edges form one switch-case. A
trace selects, at each switch-case, the one case whose control edges it takes, and runs that
case's block; a block may be empty, when the case only passes control on. A trace that reaches
``end`` stops: the switch-cases after that point do not concern it (edges into ``end`` are not
control edges, as in lines 2 and 20 of the algorithm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .graph import Node, Region

Edge = tuple["Node", "Node"]


@dataclass(frozen=True)
class Case:
    """A basic block (a linear chain, possibly empty) and the edges that select it."""

    block: tuple["Node", ...]
    control_edges: tuple[Edge, ...]

    def in_chain_edges(self) -> list[Edge]:
        return list(zip(self.block, self.block[1:]))


@dataclass(frozen=True)
class SwitchCase:
    cases: tuple[Case, ...]

    @property
    def is_switch(self) -> bool:
        """A switch-case with one case is not a switch: nothing to select."""
        return len(self.cases) > 1


def assign_cases(region: "Region") -> list[SwitchCase]:
    succ, pred, end = region.succ, region.pred, region.end
    result: list[SwitchCase] = []
    next_edges: list[Edge] = [(region.start, y) for y in succ[region.start] if y is not end]
    while next_edges:
        cases = []
        new_next: list[Edge] = []
        targets = list(dict.fromkeys(y for _, y in next_edges))
        for v in targets:
            control = tuple(e for e in next_edges if e[1] is v)
            block: list[Node] = []
            if len(pred[v]) == len(control):  # no incoming edge from E \ next_edges
                block.append(v)
                while len(succ[v]) == 1 and succ[v][0] is not end and len(pred[succ[v][0]]) == 1:
                    v = succ[v][0]
                    block.append(v)
                new_next.extend((v, y) for y in succ[v] if y is not end)
            else:
                new_next.extend(control)  # wait for the other edges into v
            cases.append(Case(tuple(block), control))
        result.append(SwitchCase(tuple(cases)))
        next_edges = new_next
    return result


def select_cases(switches: list[SwitchCase], path: list["Node"]) -> list[int]:
    """The case a path (``start``, nodes..., ``end``) selects at each switch-case it reaches.

    Raises ValueError if the switch-cases do not cover the path (Definition 5).
    """
    edges = set(zip(path, path[1:]))
    ops = path[1:-1]
    chosen: list[int] = []
    covered_ops: list[Node] = []
    for k, sc in enumerate(switches):
        hits = [i for i, c in enumerate(sc.cases) if edges.intersection(c.control_edges)]
        done = len(covered_ops) == len(ops)
        if not hits:
            if done:
                continue  # the path reached end before this switch-case
            raise ValueError(f"switch-case {k} has no case for the path")
        if done:
            raise ValueError(f"switch-case {k} selects a case after the path reached end")
        if len(hits) > 1:
            raise ValueError(f"switch-case {k}: cases {hits} are not mutually exclusive")
        chosen.append(hits[0])
        covered_ops.extend(sc.cases[hits[0]].block)
    if covered_ops != ops:
        raise ValueError("the selected blocks do not run the path's ops in order")
    return chosen
