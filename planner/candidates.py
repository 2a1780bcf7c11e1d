"""What a memory plan may drop and recompute, and who makes whom again.

For a fixed op order, each *candidate* op may be **dropped**: the storages it allocates are
freed after the last use before their longest idle stretch (the *gap*, typically forward to
backward) and the op is run again just before the first use after it. Re-running needs the
op's inputs, so a drop extends their lifetimes to the recompute point (possibly through their
own gap, when an input is dropped too): :class:`Cascade` says which dropped ops a
recomputation makes again on the way.

What may be dropped (:func:`candidates`): ops that allocate only local storages, mutate nothing,
whose outputs nobody mutates later or reads from Python, and whose inputs nobody mutates before
the recompute point. Random ops qualify: the executor replays them with the RNG state they
first ran with.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graph import LOCAL, PERSISTENT, PlanningGraph, longest_gap
from .offload import OffloadCandidate


@dataclass(frozen=True)
class Candidate:
    """An op that may be dropped: its storages freed after position ``free_after`` and the op
    run again just before position ``recompute_at`` (positions in the plan's order)."""

    op: int
    storages: tuple[int, ...]
    nbytes: int
    seconds: float
    free_after: int
    recompute_at: int
    inputs: tuple[int, ...]  # non-persistent storages the op reads
    at: int = -1  # the op's position in the order


def candidates(g: PlanningGraph, order: list[int]) -> list[Candidate]:
    """The ops that may be dropped in ``order``, each with its gap: the longest stretch between
    two of its uses; for an op with none, the longest stretch up to the recompute point of a
    candidate that reads it (so a chain ``a -> b`` whose ``b`` is recomputed late can be
    recomputed as a whole: ``a`` just before ``b``)."""
    pos = {v: i for i, v in enumerate(order)}
    written_at: dict[int, list[int]] = {}
    for v, op in enumerate(g.ops):
        for sid in op.writes:
            written_at.setdefault(sid, []).append(pos[v])
    found: dict[int, Candidate] = {}
    for v in reversed(order):  # readers first: their recompute points are needs too
        op = g.ops[v]
        if op.writes or not op.allocates:
            continue
        made = [g.storages[s] for s in op.allocates]
        if any(s.kind != LOCAL or s.nbytes <= 0 or s.fetched or written_at.get(s.sid) for s in made):
            continue
        own = {pos[u] for s in made for u in s.uses}
        virtual = {
            found[u].recompute_at
            for s in made
            for u in s.uses
            if u in found and found[u].recompute_at > pos[v]
        }
        gap = longest_gap(own) or longest_gap(own | virtual)
        if gap is None:
            continue
        a, b = gap
        reads = [s for s in op.uses if s not in op.allocates]
        if any(pos[v] <= p < b for s in reads for p in written_at.get(s, ())):
            continue
        inputs = tuple(s for s in reads if g.storages[s].kind != PERSISTENT)
        found[v] = Candidate(
            v, tuple(op.allocates), sum(s.nbytes for s in made), op.seconds, a, b, inputs, pos[v]
        )
    return [found[v] for v in order if v in found]


class Cascade:
    """Who makes whom again on the executor. To recompute a dropped op at ``p`` the executor
    needs its inputs; an input dropped and not yet made again is recomputed first, and so on
    down the chain. So candidate ``x`` is made again at ``p_e`` (the recompute point of ``e``)
    when there is a chain ``x <- d <- ... <- e`` of dropped readers with ``p_e`` inside the gap
    of every op on it. ``points[x]``: the ``(p_e, e)`` that may reach ``x``, by ``p_e``;
    ``via[x][e]``: the readers of ``x`` that lead to ``e`` (``e`` itself when direct).

    With ``span``, only chains whose end ``e`` is at most that many candidates after ``x`` are
    listed: the pairs grow with the square of the chains' reach, the span keeps them linear. That
    is exact for drops without a longer chain of dropped readers (``_Model`` forbids longer ones
    when the span cuts one off: ``truncated``)."""

    def __init__(self, cands: list[Candidate], span: int | None = None) -> None:
        readers: dict[int, list[Candidate]] = {}
        for c in cands:
            for s in c.inputs:
                readers.setdefault(s, []).append(c)
        self.span = span if span is not None else len(cands)
        self.rank = {c.op: i for i, c in enumerate(sorted(cands, key=lambda c: c.at))}
        self.via: dict[int, dict[int, list[int]]] = {}
        self.points: dict[int, list[tuple[int, int]]] = {}
        self.readers: dict[int, list[int]] = {}  # x -> the candidates that read x's storages
        self.truncated = False  # a longer chain was left out (the span mattered)
        at: dict[int, int] = {}  # e -> p_e
        for x in sorted(cands, key=lambda c: -c.at):  # readers before what they read
            via: dict[int, list[int]] = {}
            ds = {d.op: d for s in x.storages for d in readers.get(s, ())}
            self.readers[x.op] = sorted(ds)
            reach = self.rank[x.op] + self.span
            for d in ds.values():
                at[d.op] = d.recompute_at
                for e in (d.op, *self.via[d.op]):
                    if not x.free_after < at[e] < x.recompute_at:
                        continue
                    if self.rank[e] > reach:
                        self.truncated = True
                        continue
                    via.setdefault(e, []).append(d.op)
            self.via[x.op] = via
            self.points[x.op] = sorted((at[e], e) for e in via)

    def pairs(self) -> int:
        return sum(len(v) for v in self.via.values())

    def made_again(self, x: int, p: int, dropped: set[int], memo: dict) -> bool:
        """Is dropped ``x`` made again by position ``p``?"""
        return any(
            self.reaches(x, e, dropped, memo) for pe, e in self.points.get(x, ()) if pe <= p
        )

    def reaches(self, x: int, e: int, dropped: set[int], memo: dict) -> bool:
        """Is there a chain of dropped readers from ``x`` to ``e``? A search, not a recursion:
        chains may be thousands of ops long."""
        if (x, e) in memo:
            return memo[x, e]
        seen, stack, found = {x}, [x], False
        while stack and not found:
            for d in self.via[stack.pop()].get(e, ()):
                if d not in dropped or d in seen or memo.get((d, e)) is False:
                    continue
                if d == e or memo.get((d, e)):
                    found = True
                    break
                seen.add(d)
                stack.append(d)
        if found:
            memo[x, e] = True
        else:  # nothing reachable from x reaches e either
            memo.update(((y, e), False) for y in seen)
        return found


def offload_conflicts(o: OffloadCandidate, cands: list[Candidate], cascade: Cascade) -> list[int]:
    """The candidates that cannot be dropped if ``o`` is offloaded: readers of its storage
    that may be recomputed (or made again for a chain) while it is off the device."""
    off = o.off
    return [
        c.op
        for c in cands
        if o.sid in c.inputs
        and (c.recompute_at in off or any(p in off for p, _e in cascade.points.get(c.op, ())))
    ]


def remake_points(c: Candidate, cascade: Cascade) -> list[tuple[int, tuple]]:
    """Where a dropped candidate's op may run again, each with the term under which its
    kernel's temporary bytes (``OpNode.workspace``: a convolution's columns) are counted there,
    beside what is resident: its recompute point (``("drop", op)``) and each point of a chain
    of dropped readers that may reach it (``("reach", op, point)``: made again by then). The
    op runs once, at the first of them that holds; counting it at every one that holds is an
    upper bound the simulator and the solver share (``planner.simulate.holds``)."""
    points = {p: ("reach", c.op, p) for p, _ in cascade.points.get(c.op, ())}
    points[c.recompute_at] = ("drop", c.op)
    return sorted(points.items())
