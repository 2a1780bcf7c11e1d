"""A greedy plan under a budget: the warm start of the solver."""

from __future__ import annotations

from ..candidates import Candidate
from ..graph import PlanningGraph
from ..simulate import replay
from .paths import cost


def greedy(g: PlanningGraph, order: list[int], cands: list[Candidate], budget: int) -> list[Candidate] | None:
    """Drop, at the current peak, the candidate freeing the most bytes per recomputed second
    until the budget holds; then undo drops that turn out unnecessary (costliest first)."""
    dropped: list[Candidate] = []
    rest = list(cands)
    rep = replay(g, order, dropped=dropped, check_order=False)
    while rep.peak > budget:
        at = rep.peak_at
        useful = [c for c in rest if c.free_after < at < c.recompute_at]
        if not useful:
            return None
        best = max(useful, key=lambda c: (c.nbytes / cost(c), -c.op))
        rest.remove(best)
        trial = replay(g, order, dropped=dropped + [best], check_order=False)
        if trial.peak <= rep.peak and trial.live[at] < rep.live[at]:
            dropped.append(best)
            rep = trial
    for c in sorted(dropped, key=lambda c: -cost(c)):
        without = [d for d in dropped if d is not c]
        if replay(g, order, dropped=without, check_order=False).peak <= budget:
            dropped = without
    return dropped
