"""Exhaustive search over every plan (tests only: exponential)."""

from __future__ import annotations

import itertools

from ..candidates import Candidate, candidates
from ..errors import InvalidPlan
from ..graph import PlanningGraph
from ..offload import Bandwidth, OffloadCandidate, channel_shares, offload_candidates
from ..simulate import replay
from .paths import OFFLOAD_COST, RematPath, bound_of, cost


def exhaustive_remat(
    g: PlanningGraph, budget: int, order: list[int] | None = None, bandwidth: Bandwidth | None = None,
    placed: frozenset | None = None,
):
    """Every subset of the candidates and offloads (tests only: exponential). Returns (cost in
    the objective's units, peak, dropped ops, offloaded storages) of the cheapest plan within
    ``budget`` (with an arena of the ``placed`` storages: :func:`bound_of`), or None."""
    order = list(range(len(g))) if order is None else order
    path = RematPath(g, order, placed=placed)
    cands = candidates(g, order)
    offs = offload_candidates(g, order, bandwidth) if bandwidth is not None else []
    items = [*cands, *offs]
    best = None
    for k in range(len(items) + 1):
        for subset in itertools.combinations(items, k):
            dropped = [c for c in subset if isinstance(c, Candidate)]
            offloaded = [o for o in subset if isinstance(o, OffloadCandidate)]
            if not _channel_ok(g, order, offloaded):
                continue
            try:
                rep = replay(g, order, dropped=dropped, offloaded=offloaded, check_order=False)
            except InvalidPlan:
                continue
            if bound_of([path], [rep]) <= budget:
                spent = sum(map(cost, dropped)) + OFFLOAD_COST * len(offloaded)
                if best is None or spent < best[0]:
                    best = (spent, rep.peak, sorted(c.op for c in dropped), sorted(o.sid for o in offloaded))
    return best


def _channel_ok(g: PlanningGraph, order: list[int], offloaded: list[OffloadCandidate]) -> bool:
    """The model's channel rows: at every position the copies in flight need at most all of it."""
    return all(
        len(sh) < 2 or sum(sh.values()) <= 1 or sum(round(x * 1000) for x in sh.values()) <= 1000
        for sh in channel_shares(g, order, offloaded)
    )
