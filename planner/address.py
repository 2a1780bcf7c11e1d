"""Placing local storages in one arena (OLLA §3.3, §4.5).

Given an order, each local storage has a lifetime interval; two storages may share bytes only
if their intervals are disjoint. The arena must hold every storage at its offset, and its size
is the highest byte used; fragmentation is that size over the peak of live bytes, minus 1.

* :func:`greedy_offsets`: best fit by decreasing size (the static planners of TFLite and
  XNNPACK): each storage takes the lowest offset that does not overlap a co-live storage
  already placed.
* :func:`optimal_offsets`: OLLA's address problem (equations 6-8, objective 15) for OR-Tools
  CP-SAT: storages are rectangles (lifetime x bytes) that must not overlap (``NoOverlap2D``),
  the arena's end is minimised. The pyramid pre-placement of Function 5 fixes the longest-lived
  nested storages first (§4.5) when it fits under the greedy arena. Hinted with the greedy
  placement, time-limited, never worse than it; reports its gap.

``conflicts`` may add pairs that must not overlap beyond one order's lifetimes: storages that
are co-live on some path of a TraceGraph (DESIGN.md §3).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

Interval = tuple[int, int]


@dataclass
class Placement:
    offsets: dict[int, int]
    arena_bytes: int
    method: str
    seconds: float = 0.0
    gap: float | None = None


def _overlap(a: Interval, b: Interval) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def conflict_pairs(
    spans: dict[int, Interval], extra: set[frozenset] | None = None
) -> dict[int, set[int]]:
    """For every storage, the storages it must not share bytes with."""
    items = sorted(spans.items(), key=lambda kv: kv[1])
    out: dict[int, set[int]] = {sid: set() for sid in spans}
    active: list[tuple[int, int]] = []  # (last, sid)
    for sid, (first, last) in items:
        active = [(l, s) for l, s in active if l >= first]
        for _l, other in active:
            out[sid].add(other)
            out[other].add(sid)
        active.append((last, sid))
    for pair in extra or ():
        a, b = tuple(pair)
        if a in out and b in out:
            out[a].add(b)
            out[b].add(a)
    return out


def live_peak(spans: dict[int, Interval], sizes: dict[int, int]) -> int:
    """Peak of live bytes over time (the lower bound on the arena for this order)."""
    events: dict[int, int] = {}
    for sid, (a, b) in spans.items():
        events[a] = events.get(a, 0) + sizes[sid]
        events[b + 1] = events.get(b + 1, 0) - sizes[sid]
    live = peak = 0
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak


def greedy_offsets(
    spans: dict[int, Interval], sizes: dict[int, int], conflicts: dict[int, set[int]] | None = None,
    alignment: int = 64,
) -> Placement:
    t0 = time.perf_counter()
    conflicts = conflicts if conflicts is not None else conflict_pairs(spans)
    offsets: dict[int, int] = {}
    for sid in sorted(spans, key=lambda s: (-sizes[s], spans[s][0], s)):
        size = aligned(sizes[sid], alignment)
        taken = sorted(
            (offsets[o], offsets[o] + aligned(sizes[o], alignment))
            for o in conflicts[sid] if o in offsets
        )
        off = 0
        for lo, hi in taken:
            if off + size <= lo:
                break  # fits in the gap before this block
            off = max(off, hi)
        offsets[sid] = off
    end = max((offsets[s] + sizes[s] for s in offsets), default=0)
    return Placement(offsets, end, "greedy", time.perf_counter() - t0)


ALIGNMENT = 64  # bytes: every arena offset is a multiple (what vectorised kernels expect)


def aligned(n: int, a: int = ALIGNMENT) -> int:
    """``n`` bytes rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def refined(
    placement: Placement, spans: dict, sizes: dict, conflicts: dict, time_limit: float
) -> Placement:
    """``placement``, or the one :func:`optimal_offsets` finds within ``time_limit`` if it ends
    lower. Solved in units of :data:`ALIGNMENT` (``sizes`` are multiples of it), so every offset
    stays aligned."""
    units = {k: n // ALIGNMENT for k, n in sizes.items()}
    better = optimal_offsets(spans, units, time_limit=time_limit, conflicts=conflicts)
    if better.arena_bytes * ALIGNMENT >= placement.arena_bytes:
        return placement
    better.offsets = {k: o * ALIGNMENT for k, o in better.offsets.items()}
    better.arena_bytes *= ALIGNMENT
    return better


def pyramid(spans: dict[int, Interval], sizes: dict[int, int]) -> dict[int, int]:
    """OLLA Function 5: nested lifetimes (the activations a backward frees in reverse) placed
    at increasing addresses, longest first."""
    placed: dict[int, int] = {}
    lo_start, hi_end, base = -1, float("inf"), 0
    while True:
        best, best_len = None, -1
        for sid, (a, b) in spans.items():
            if sid in placed or a < lo_start or b > hi_end:
                continue
            if b - a > best_len:
                best, best_len = sid, b - a
        if best is None:
            return placed
        placed[best] = base
        base += sizes[best]
        lo_start, hi_end = spans[best]


def optimal_offsets(
    spans: dict[int, Interval], sizes: dict[int, int], time_limit: float = 20.0,
    conflicts: dict[int, set[int]] | None = None, workers: int = 2,
) -> Placement:
    """The address problem for CP-SAT: rectangles (lifetime x bytes) that must not overlap,
    lifetimes fixed, offsets free, the arena's end minimised; hinted with the greedy placement.
    Pairs that ``conflicts`` adds beyond co-liveness get explicit disjunctions. The free model
    runs first; if it does not prove the optimum, a second run fixes OLLA's pyramid (§4.5),
    which shrinks the search on large instances. The best placement found wins."""
    t0 = time.perf_counter()
    conflicts = conflicts if conflicts is not None else conflict_pairs(spans)
    best = greedy_offsets(spans, sizes, conflicts, alignment=1)
    lower = live_peak(spans, sizes)
    if best.arena_bytes <= lower:
        best.method, best.gap = "greedy (optimal)", 0.0
        return best
    for fixed in (False, True):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.5 or best.gap == 0.0:
            break
        pre = pyramid(spans, sizes) if fixed else {}
        if fixed and (not pre or max(pre[s] + sizes[s] for s in pre) > best.arena_bytes):
            break
        found = _solve_offsets(spans, sizes, conflicts, best, lower, pre, left if fixed else left / 2, workers)
        if found is not None and (found.arena_bytes < best.arena_bytes or found.gap == 0.0):
            best = found
    best.seconds = time.perf_counter() - t0
    return best


def _solve_offsets(spans, sizes, conflicts, greedy, lower, pre, time_limit, workers):
    from ortools.sat.python import cp_model

    top = greedy.arena_bytes
    m = cp_model.CpModel()
    off, xs, ys = {}, [], []
    for sid, (a, b) in spans.items():
        if sid in pre:
            off[sid] = m.NewConstant(pre[sid])
        else:
            off[sid] = m.NewIntVar(0, top - sizes[sid], f"a{sid}")
            m.AddHint(off[sid], greedy.offsets[sid])
        xs.append(m.NewFixedSizeIntervalVar(a, b - a + 1, f"x{sid}"))
        ys.append(m.NewFixedSizeIntervalVar(off[sid], sizes[sid], f"y{sid}"))
    m.AddNoOverlap2D(xs, ys)
    for sid in spans:  # co-live on another path: disjoint in bytes too
        for other in conflicts[sid]:
            if other > sid and not _overlap(spans[sid], spans[other]):
                below = m.NewBoolVar("")
                m.Add(off[sid] + sizes[sid] <= off[other]).OnlyEnforceIf(below)
                m.Add(off[other] + sizes[other] <= off[sid]).OnlyEnforceIf(below.Not())
    end = m.NewIntVar(lower, top, "end")
    for sid in spans:
        m.Add(off[sid] + sizes[sid] <= end)
    m.Minimize(end)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = workers
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    offsets = {sid: solver.Value(v) for sid, v in off.items()}
    arena = max(offsets[s] + sizes[s] for s in spans)
    gap = (arena - solver.BestObjectiveBound()) / arena if arena else 0.0
    if status == cp_model.OPTIMAL and not pre:
        gap = 0.0
    method = ("cp-sat" if status == cp_model.OPTIMAL else "cp-sat-timeout") + (" + pyramid" if pre else "")
    return Placement(offsets, arena, method, 0.0, gap)
