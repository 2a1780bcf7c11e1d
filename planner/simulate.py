"""The simulator: the one definition of when a storage is on the device (DESIGN.md §3).

A plan for a :class:`PlanningGraph` is an op order and optionally ops dropped and recomputed,
storages parked on the host, and arena offsets. :func:`replay` runs it and reports the exact
live bytes at every position, the peak, and each storage's stretches on the device; it checks
that the order respects every edge, that no two co-live storages overlap in the arena, and
that the arena and any budget hold. Planners, ``report()`` and tests all read it.

When a storage is freed (:func:`needed_at`): after its last use, but never before the executor
knows that Python let go of its last tensor (``Storage.release``, recorded when the step was
traced); escaping storages stay to the end. When the executor learns it depends on how it runs
the path (:class:`planner.graph.Execution`): ``lag`` ops later when ops run as issued (eager
PyTorch: at once), or, when blocks run complete in a planned order, at the start of the block
in which Python let go of it (and, where the executor runs a block ahead of its launch, at the
end for a value let go of as the step returns). A dropped op's storages are also freed in their idle stretch and
made again for their next use; a parked storage is off the device in its window
(:func:`residency`, shared with the budget solver so that the two cannot disagree).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .candidates import Candidate, Cascade, offload_conflicts, remake_points
from .errors import InvalidPlan
from .graph import ESCAPING, LOCAL, PERSISTENT, PlanningGraph
from .offload import OffloadCandidate

__all__ = ["InvalidPlan", "Replay", "check_stretches", "lifetimes", "needed_at", "replay", "residency"]


@dataclass
class Replay:
    peak: int  # persistent + max over positions of live planned bytes (+ workspace)
    peak_local: int  # max over positions of live bytes of local storages (what an arena holds)
    arena_end: int  # highest byte an arena offset reaches (0 without addresses)
    peak_at: int  # position in the order where the peak happens
    intervals: dict[int, tuple[int, int]] = field(default_factory=dict)  # sid -> [first, last] hull
    live: list[int] = field(default_factory=list)  # live planned bytes per position
    segments: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # sid -> [first, last]s
    extra_seconds: float = 0.0  # recomputation
    offloaded: list[OffloadCandidate] = field(default_factory=list)

    @property
    def fragmentation(self) -> float:
        """Arena bytes over the live-bytes peak of what it holds, minus 1."""
        return self.arena_end / self.peak_local - 1 if self.peak_local else 0.0


def needed_at(g: PlanningGraph, order: list[int]) -> dict[int, list[int]]:
    """Per storage the step makes (local or escaping), the positions in ``order`` where it
    must be on the device whatever a plan drops: its allocation, its uses and the position
    through which the executor holds it after Python let go of it (see the module docstring),
    ascending. Escaping storages are held to the end by their callers."""
    n = len(order)
    pos = {v: i for i, v in enumerate(order)}
    ex = g.execution
    if ex.blocks:
        starts = g.block_starts
    else:
        issue_order = order == list(range(n))
    out = {}
    for s in g.storages.values():
        if s.kind == PERSISTENT:
            continue
        ps = {pos[s.producer]} | {pos[u] for u in s.uses}
        r = s.release
        if r is not None and s.kind == LOCAL:
            if ex.ahead and r >= n:
                ps.add(n - 1)  # let go of as the step returns (Execution.ahead)
            elif ex.blocks:
                # freed when the block in which Python let go of it starts (blocks keep their
                # positions in a planned order): held through the end of the block before
                held = starts[bisect.bisect_right(starts, min(r, n - 1)) - 1] - 1
                if held >= 0:
                    ps.add(held)
            elif issue_order:
                ps.add(min(r + ex.lag, n - 1))
        out[s.sid] = sorted(ps)
    return out


def lifetimes(g: PlanningGraph, order: list[int]) -> dict[int, tuple[int, int]]:
    """Position interval ``[allocated, last needed]`` of every planned storage in ``order``,
    without drops or offloads."""
    end = len(order) - 1
    return {
        sid: (ps[0], end if g.storages[sid].kind == ESCAPING else ps[-1])
        for sid, ps in needed_at(g, order).items()
    }


def replay(
    g: PlanningGraph,
    order: list[int],
    offsets: dict[int, int] | None = None,
    *,
    dropped: list[Candidate] = (),
    offloaded: list[OffloadCandidate] = (),
    arena_bytes: int | None = None,
    budget: int | None = None,
    partial: bool = False,
    check_order: bool = True,
) -> Replay:
    """Run the plan: ``order`` with the ``dropped`` ops freed and recomputed, the ``offloaded``
    storages parked on the host in their windows, and local storages at ``offsets`` in an
    arena of ``arena_bytes``. Raises :class:`InvalidPlan` when it is not valid; ``partial``:
    ``offsets`` may leave some local storages to the ordinary allocator."""
    if check_order and not g.is_order(order):
        raise InvalidPlan(f"the order is not a valid schedule: {_first_violation(g, order)}")
    n = len(order)
    chosen = {c.op for c in dropped}
    cascade = Cascade(list(dropped))
    clash = [(o.sid, d) for o in offloaded for d in offload_conflicts(o, list(dropped), cascade)]
    if clash or any(o.producer in chosen for o in offloaded):
        raise InvalidPlan(f"offloaded storages needed while parked (storage, dropped op): {clash}")
    parked = {o.sid for o in offloaded}
    delta = [0] * (n + 1)
    delta_local = [0] * (n + 1)
    segments: dict[int, list[tuple[int, int]]] = {}
    memo: dict = {}
    for sid, a, b, terms in with_offloads(residency(g, order, list(dropped), cascade), list(offloaded)):
        if terms is not None and not any(holds(t, chosen, parked, cascade, memo) for t in terms):
            continue
        s = g.storages[sid]
        delta[a] += s.nbytes
        delta[b] -= s.nbytes
        if s.kind == LOCAL:
            delta_local[a] += s.nbytes
            delta_local[b] -= s.nbytes
        segs = segments.setdefault(sid, [])
        if segs and segs[-1][1] == a - 1:
            segs[-1] = (segs[-1][0], b - 1)
        else:
            segs.append((a, b - 1))
    live, run, run_local, peak_local = [], 0, 0, 0
    for i in range(n):
        run += delta[i]
        run_local += delta_local[i]
        live.append(run)
        peak_local = max(peak_local, run_local)
    remaking = [0] * (n + 1)  # the temporary bytes of the kernels that make dropped values again
    for c in dropped:
        for at, term in remake_points(c, cascade) if g.ops[c.op].workspace else ():
            if holds(term, chosen, parked, cascade, memo):
                remaking[at] += g.ops[c.op].workspace
    work = [live[i] + g.ops[order[i]].workspace + remaking[i] for i in range(n)]
    peak_at = max(range(n), key=work.__getitem__) if n else 0
    peak = g.persistent_bytes + (work[peak_at] if n else 0)
    arena_end = 0
    if offsets is not None:
        local = [sid for sid, s in g.storages.items() if s.kind == LOCAL and s.nbytes > 0 and sid in segments]
        missing = [sid for sid in local if sid not in offsets]
        if missing and not partial:
            raise InvalidPlan(f"{len(missing)} local storages have no arena offset (e.g. storage {missing[0]})")
        placed = {sid: segments[sid] for sid in local if sid in offsets}
        arena_end = check_stretches(g, placed, offsets, arena_bytes)
    if budget is not None and peak > budget:
        raise InvalidPlan(f"the plan needs {peak} bytes at its peak, over the budget of {budget}")
    intervals = {sid: (segs[0][0], segs[-1][1]) for sid, segs in segments.items()}
    return Replay(
        peak, peak_local, arena_end, peak_at, intervals, live, segments,
        sum(c.seconds for c in dropped), list(offloaded),
    )  # fmt: skip


def check_stretches(
    g: PlanningGraph,
    stretches: dict[int, list[tuple[int, int]]],
    offsets: dict[int, int],
    arena_bytes: int | None = None,
) -> int:
    """Addresses of storages resident in ``stretches`` (sid -> ``[first, last]`` positions; a
    storage freed and made again, by recomputation or a copy back, has several, all at its
    one offset): raises :class:`InvalidPlan` if two storages resident at the same time
    overlap in the arena or one reaches past ``arena_bytes``; returns the highest byte used."""
    end = 0
    items = []
    for sid, spans in stretches.items():
        off = offsets[sid]
        size = g.storages[sid].nbytes
        if off < 0:
            raise InvalidPlan(f"storage {sid} has a negative offset {off}")
        end = max(end, off + size)
        items.extend((first, last, off, off + size, sid) for first, last in spans)
    if arena_bytes is not None and end > arena_bytes:
        raise InvalidPlan(f"storages reach byte {end} of an arena of {arena_bytes} bytes")
    # sweep over time: storages live at the same time must not overlap in the arena
    items.sort()
    active: list[tuple[int, int, int, int]] = []  # (last, lo, hi, sid)
    for first, last, lo, hi, sid in items:
        active = [a for a in active if a[0] >= first]
        for a_last, a_lo, a_hi, a_sid in active:
            if lo < a_hi and a_lo < hi and a_sid != sid:
                raise InvalidPlan(
                    f"storages {a_sid} and {sid} are live at the same time and overlap in the "
                    f"arena ([{a_lo}, {a_hi}) and [{lo}, {hi}))"
                )
        active.append((last, lo, hi, sid))
    return end


Term = tuple
# ("keep", c): c is kept; ("drop", d): d is dropped; ("drop-keep", d, c): d dropped, c kept;
# ("reach", c, p): c is dropped and made again by position p for a dropped reader (see Cascade)


def holds(term: Term, dropped: set[int], offloaded: set[int], cascade: Cascade, memo: dict) -> bool:
    kind = term[0]
    if kind == "keep":
        return term[1] not in dropped
    if kind == "drop":
        return term[1] in dropped
    if kind == "drop-keep":
        return term[1] in dropped and term[2] not in dropped
    if kind == "on":  # ("on", sid, inner): the storage is not offloaded, and inner holds
        return term[1] not in offloaded and (term[2] is None or holds(term[2], dropped, offloaded, cascade, memo))
    return term[1] in dropped and cascade.made_again(term[1], term[2], dropped, memo)


def with_offloads(pieces, offs: list[OffloadCandidate]):
    """Residency pieces with each offload candidate's off-device stretch made conditional on
    the storage staying (term ``("on", sid, inner)``)."""
    by_sid = {o.sid: o for o in offs}
    for sid, a, b, terms in pieces:
        o = by_sid.get(sid)
        if o is None:
            yield sid, a, b, terms
            continue
        lo, hi = o.released + 1, o.prefetch
        for x, y in ((a, min(b, lo)), (max(a, lo), min(b, hi)), (max(a, hi), b)):
            if x >= y:
                continue
            if lo <= x and y <= hi:
                on = frozenset({("on", sid, None)}) if terms is None else frozenset(("on", sid, t) for t in terms)
                yield sid, x, y, on
            else:
                yield sid, x, y, terms


def residency(g: PlanningGraph, order: list[int], cands: list[Candidate], cascade: Cascade):
    """For every planned storage, ``(sid, start, stop, terms)`` pieces covering positions
    ``[start, stop)``: resident throughout when ``terms`` is None, else resident iff one of the
    terms holds for the chosen drops. The one statement of the semantics, shared by the
    simulator and the solver so that they cannot disagree:

    a storage is resident at ``t`` when it exists and is needed at some ``p >= t`` by the same
    instance; needs are its uses and the recompute points of dropped ops that read it. A
    dropped op's storages are freed after the last use before its gap and made again at its
    first need after that: its recompute point ``r``, or earlier, where a chain of dropped
    readers is recomputed inside the gap (:class:`Cascade`); a storage made again early is
    counted resident from then on through the gap (an upper bound when it has no use after the
    gap), and a remade storage is resident at ``r`` even if nothing needs it there."""
    n = len(order)
    pos = {v: i for i, v in enumerate(order)}
    owner = {s: c for c in cands for s in c.storages}
    needs = needed_at(g, order)
    extra: dict[int, list[tuple[int, int]]] = {}
    for c in cands:
        for s in c.inputs:
            extra.setdefault(s, []).append((c.recompute_at, c.op))
    for s in g.storages.values():
        if s.kind == PERSISTENT:
            continue
        first = pos[s.producer]
        base = needs[s.sid]
        c = owner.get(s.sid)
        xs = extra.get(s.sid, [])
        if s.kind == ESCAPING or (c is None and not xs):
            yield s.sid, first, (n if s.kind == ESCAPING else base[-1] + 1), None
            continue
        r = c.recompute_at if c else None
        remade_at = [p for p, _ in cascade.points.get(c.op, ())] if c else []
        horizon = max([base[-1], *(p for p, _ in xs), *([r] if c else [])])
        cuts = {first, horizon + 1, *(p + 1 for p in base), *(p + 1 for p, _ in xs), *remade_at}
        if c:
            cuts |= {r, r + 1}
        cuts = sorted(x for x in cuts if first <= x <= horizon + 1)
        for a, b in zip(cuts, cuts[1:]):
            terms: set | None
            if c and a < r:
                i = bisect.bisect_left(base, a)
                if i < len(base) and base[i] < r:
                    terms = None
                else:
                    if base[-1] >= r:  # needed after the gap: resident if kept
                        terms = {("keep", c.op)}
                    else:  # only readers need it: resident if kept until the last of them
                        terms = {("drop-keep", d, c.op) for p, d in xs if p >= a}
                    if remade_at and remade_at[0] <= a:  # or if made again by now
                        terms.add(("reach", c.op, max(p for p in remade_at if p <= a)))
            elif base[-1] >= a:
                terms = None
            else:
                terms = {("drop", d) for p, d in xs if p >= a}
                if c and a == r:
                    terms.add(("drop", c.op))
            if terms is None or terms:
                yield s.sid, a, b, (None if terms is None else frozenset(terms))




def _first_violation(g: PlanningGraph, order: list[int]) -> str:
    if sorted(order) != list(range(len(g.ops))):
        return f"it has {len(order)} ops, not a permutation of the graph's {len(g.ops)}"
    pos = {v: i for i, v in enumerate(order)}
    for v, ps in enumerate(g.preds):
        for u in ps:
            if pos[u] > pos[v]:
                return f"op {v} ({g.ops[v].name}) runs before op {u} ({g.ops[u].name}) it depends on"
    return "?"
