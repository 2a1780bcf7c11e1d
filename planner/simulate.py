"""Replaying a plan: is it valid, and what is its exact peak? (DESIGN.md §3)

A plan for a :class:`PlanningGraph` is an op order and, optionally, an arena offset for every
local storage. The simulator runs the order: a storage is allocated when its producer runs and
freed after its last use (escaping storages stay to the end); it checks that every op's inputs
are resident, that the order respects every edge, that no two co-live storages overlap in the
arena, and that the arena and any budget are respected. It reports the exact peak of live bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .graph import ESCAPING, LOCAL, PERSISTENT, PlanningGraph


class InvalidPlan(ValueError):
    """A plan the executor must not run; the message says what is wrong."""


@dataclass
class Replay:
    peak: int  # persistent + max over time of live planned bytes (+ workspace)
    peak_local: int  # max over time of live bytes of local storages (what the arena holds)
    arena_end: int  # highest byte an arena offset reaches (0 without addresses)
    peak_at: int  # position in the order where the peak happens
    intervals: dict[int, tuple[int, int]] = field(default_factory=dict)  # sid -> [first, last]

    @property
    def fragmentation(self) -> float:
        """Arena bytes over the live-bytes peak of what it holds, minus 1."""
        return self.arena_end / self.peak_local - 1 if self.peak_local else 0.0


def lifetimes(g: PlanningGraph, order: list[int]) -> dict[int, tuple[int, int]]:
    """Position interval ``[allocated, last needed]`` of every planned storage in ``order``."""
    pos = {v: i for i, v in enumerate(order)}
    end = len(order) - 1
    out = {}
    for s in g.storages.values():
        if s.kind == PERSISTENT:
            continue
        first = pos[s.producer]
        last = end if s.kind == ESCAPING else max(pos[u] for u in s.uses)
        out[s.sid] = (first, last)
    return out


def replay(
    g: PlanningGraph,
    order: list[int],
    offsets: dict[int, int] | None = None,
    *,
    arena_bytes: int | None = None,
    budget: int | None = None,
    partial: bool = False,
) -> Replay:
    """Validate the plan and measure it; raises :class:`InvalidPlan` when it is not valid.
    ``partial``: ``offsets`` may leave some local storages to the ordinary allocator."""
    if not g.is_order(order):
        bad = _first_violation(g, order)
        raise InvalidPlan(f"the order is not a valid schedule: {bad}")
    spans = lifetimes(g, order)
    n = len(order)
    delta = [0] * (n + 1)
    delta_local = [0] * (n + 1)
    for sid, (a, b) in spans.items():
        size = g.storages[sid].nbytes
        delta[a] += size
        delta[b + 1] -= size
        if g.storages[sid].kind == LOCAL:
            delta_local[a] += size
            delta_local[b + 1] -= size
    live = live_local = 0
    peak = peak_local = 0
    peak_at = 0
    persistent = g.persistent_bytes
    for i in range(n):
        live += delta[i]
        live_local += delta_local[i]
        here = live + g.ops[order[i]].workspace
        if here > peak:
            peak, peak_at = here, i
        peak_local = max(peak_local, live_local)
    total_peak = persistent + peak
    arena_end = 0
    if offsets is not None:
        arena_end = _check_addresses(g, spans, offsets, arena_bytes, partial)
    if budget is not None and total_peak > budget:
        raise InvalidPlan(f"the plan needs {total_peak} bytes at its peak, over the budget of {budget}")
    return Replay(total_peak, peak_local, arena_end, peak_at, spans)


def _check_addresses(g, spans, offsets, arena_bytes, partial=False) -> int:
    local = [sid for sid, s in g.storages.items() if s.kind == LOCAL and s.nbytes > 0]
    missing = [sid for sid in local if sid not in offsets]
    if missing and not partial:
        raise InvalidPlan(f"{len(missing)} local storages have no arena offset (e.g. storage {missing[0]})")
    return check_stretches(g, {sid: [spans[sid]] for sid in local if sid in offsets}, offsets, arena_bytes)


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


def _first_violation(g: PlanningGraph, order: list[int]) -> str:
    if sorted(order) != list(range(len(g.ops))):
        return f"it has {len(order)} ops, not a permutation of the graph's {len(g.ops)}"
    pos = {v: i for i, v in enumerate(order)}
    for v, ps in enumerate(g.preds):
        for u in ps:
            if pos[u] > pos[v]:
                return f"op {v} ({g.ops[v].name}) runs before op {u} ({g.ops[u].name}) it depends on"
    return "?"
