"""Small planning graphs built by hand, and exhaustive search to check the solvers against."""

from __future__ import annotations

import itertools
import random

from planner.graph import ESCAPING, LOCAL, OpNode, PlanningGraph, Storage
from planner.simulate import replay


def chain_graph(spec: list[tuple[list[int], int]]) -> PlanningGraph:
    """``spec[i] = (inputs, nbytes)``: op i reads the outputs of ops ``inputs`` and makes one
    local storage of ``nbytes`` (storage id = op index). The last op's output escapes."""
    ops = [OpNode(i, f"op{i}", 0.0) for i in range(len(spec))]
    storages = {}
    preds: list[set[int]] = [set() for _ in spec]
    for i, (inputs, nbytes) in enumerate(spec):
        kind = ESCAPING if i == len(spec) - 1 else LOCAL
        storages[i] = Storage(i, nbytes, kind, i, [i])
        ops[i].allocates = [i]
        ops[i].uses = sorted({i, *inputs})
        for u in inputs:
            preds[i].add(u)
            storages[u].uses.append(i)
    for s in storages.values():
        s.uses.sort()
    return PlanningGraph(ops, storages, preds)


def random_graph(rng: random.Random, n: int) -> PlanningGraph:
    spec = []
    for i in range(n):
        inputs = sorted(rng.sample(range(i), k=min(i, rng.randint(0 if i == 0 else 1, 2)))) if i else []
        spec.append((inputs, rng.choice([1, 2, 3, 5, 8, 13])))
    return chain_graph(spec)


def topological_orders(g: PlanningGraph):
    n = len(g.ops)
    for perm in itertools.permutations(range(n)):
        if g.is_order(list(perm)):
            yield list(perm)


def best_peak(g: PlanningGraph) -> int:
    return min(replay(g, o).peak for o in topological_orders(g))
