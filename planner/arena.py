"""One arena for every path of a step (DESIGN.md §3, "Addresses across the TraceGraph").

The runtime allocates a storage when the op that makes it runs, before it knows which way the
rest of the step goes; so a storage must have the same arena offset on every path, and two
storages may share bytes only if no path keeps both alive at once. :func:`plan_arena` takes the
observed paths, each a planning graph in issue order plus the *key* of each of its local
storages (what identifies a storage across steps: the node that makes it, the output, the loop
iterations it was made in), and places every key once: storages co-live on any path conflict,
storages only ever on exclusive branches may overlap. Each path is then replayed by the
simulator with its offsets: the plan is valid on every observed path.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from .address import ALIGNMENT, Placement, aligned, conflict_pairs, greedy_offsets, live_peak, refined
from .graph import LOCAL, PlanningGraph
from .simulate import check_stretches, replay

Stretches = dict[int, list[tuple[int, int]]]  # sid -> [first, last] positions it is resident

# an arena held whole may cost a little over the allocator's peak (its own peak and that of the
# storages outside it fall at different places); up to this share it is kept, for what it buys
# on a device with a caching allocator (one allocation, planned addresses); beyond, none is used
ARENA_SLACK = 0.01


@dataclass
class ArenaPlan:
    offsets: dict[Hashable, int]  # storage key -> arena offset
    sizes: dict[Hashable, int]  # storage key -> bytes (aligned)
    arena_bytes: int
    placement: Placement
    paths: list[int] = field(default_factory=list)  # each observed path's highest byte, validated
    local_peak: int = 0  # the largest live-bytes peak of local storages over the paths

    @property
    def fragmentation(self) -> float:
        return self.arena_bytes / self.local_peak - 1 if self.local_peak else 0.0


def plan_arena(
    paths: list[tuple[PlanningGraph, dict[int, Hashable]]],
    optimize_seconds: float = 0.0,
    stretches: list[Stretches] | None = None,
) -> ArenaPlan:
    """``paths``: (graph, storage id -> key) per observed path; ops run in issue order; only
    storages with a key are placed. ``stretches`` (per path): when each storage is resident, if
    not from its producer to its last use: a storage dropped and recomputed, or parked on the
    host and copied back, is resident in several stretches (a plan's ``segments``), always at
    its one offset, and its bytes are free for others in between."""
    sizes: dict[Hashable, int] = {}
    conflicts: dict[Hashable, set] = {}
    spans: dict[Hashable, tuple[int, int]] = {}  # a representative hull per key (for the solver)
    local_peak = 0
    per_path = []
    for i, (g, keys) in enumerate(paths):
        if stretches is None:
            life = replay(g, list(range(len(g)))).intervals
            resident = {sid: [life[sid]] for sid in life}
        else:
            resident = stretches[i]
        local = [
            sid for sid, s in g.storages.items()
            if s.kind == LOCAL and s.nbytes > 0 and sid in keys and resident.get(sid)
        ]  # fmt: skip
        stretch_spans = {}  # (key, j) -> the j-th stretch of the storage with that key
        for sid in local:
            k = keys[sid]
            sizes[k] = max(sizes.get(k, 0), aligned(g.storages[sid].nbytes))
            conflicts.setdefault(k, set())
            stretch_spans.update(((k, j), iv) for j, iv in enumerate(resident[sid]))
            spans.setdefault(k, (resident[sid][0][0], resident[sid][-1][1]))
        for (k, _j), others in conflict_pairs(stretch_spans).items():
            conflicts[k].update(o for o, _ in others if o != k)
        local_peak = max(local_peak, live_peak(stretch_spans, {item: sizes[item[0]] for item in stretch_spans}))
        per_path.append((g, keys, {sid: resident[sid] for sid in local}))
    placement = greedy_offsets(spans, sizes, conflicts, alignment=ALIGNMENT)
    if optimize_seconds > 0 and placement.arena_bytes > local_peak and len(paths) == 1 and stretches is None:
        placement = refined(placement, spans, sizes, conflicts, optimize_seconds)
    plan = ArenaPlan(placement.offsets, sizes, placement.arena_bytes, placement, local_peak=local_peak)
    for g, keys, resident in per_path:  # every path must replay without overlap
        offsets = {sid: placement.offsets[keys[sid]] for sid in resident}
        plan.paths.append(check_stretches(g, resident, offsets, plan.arena_bytes))
    return plan


def select_placed(
    paths: list[tuple[PlanningGraph, dict[int, Hashable], Stretches]],
    unit: Callable[[Hashable], Hashable] = lambda key: key,
    orders: list[list[int]] | None = None,
    ceiling: int | None = None,
) -> set[Hashable]:
    """Which keys to place in an arena that is held whole: the step then needs, on its worst
    path, the arena (the most placed bytes resident at once on any path) *plus* the most of
    everything else resident at once, so placing a storage that lives where the arena peaks but
    not where the rest does only adds. ``paths``: (graph, storage id -> key of the storages
    that may be placed, residency stretches of every storage) per path. Keys with the same
    ``unit`` go in or stay out together (the outputs of one op: it writes all of them into
    the arena or none). ``orders``: each path's op order, when not the issue order (stretches
    are positions in it).

    Leaving everything out always reaches the allocator's peak (the least possible), so the aim
    is that peak with as much in the arena as can be. A greedy: from all keys, take out of the
    arena the largest key resident where it peaks whose removal does not raise the step's total,
    until none can go; then put back, largest first and until none can, every key whose return
    does not raise it. A local optimum: no single key can go back in for free, but the
    allocator's peak is not always reached (197 of 200 random small steps,
    ``tests/planner/test_arena_select.py``). Where the search ends above it by more than
    :data:`ARENA_SLACK`, the arena starts empty instead and takes keys, largest first, while
    the total stays at the allocator's peak.

    ``ceiling``: the most the step may need (a memory budget's plan, whose peak is often near
    its budget at many places, so that an arena held whole rarely comes free): keys go back in
    while the total stays within it, and it replaces the slack above."""
    profiles = []  # per path: bytes of placed keys, of the rest; and per key, its stretches
    where: dict[Hashable, list[tuple[int, int, int, int]]] = {}  # key -> (path, a, b, bytes)
    for i, (g, keys, resident) in enumerate(paths):
        n = len(g)
        inside, outside = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
        order = orders[i] if orders is not None else range(n)
        outside[:n] += np.array([g.ops[v].workspace for v in order], dtype=np.int64)
        outside += g.persistent_bytes
        for sid, spans in resident.items():
            s = g.storages[sid]
            for a, b in spans:
                if sid in keys:
                    inside[a : b + 1] += aligned(s.nbytes)
                    where.setdefault(unit(keys[sid]), []).append((i, a, b, s.nbytes))
                else:
                    outside[a : b + 1] += s.nbytes
        profiles.append((inside, outside))

    def total() -> int:
        return max(int(p[0].max()) for p in profiles) + max(int(p[1].max()) for p in profiles)

    def move(key: Hashable, sign: int) -> None:  # sign 1: out of the arena; -1: back in
        for i, a, b, nbytes in where[key]:
            profiles[i][0][a : b + 1] -= sign * aligned(nbytes)
            profiles[i][1][a : b + 1] += sign * nbytes

    size = {k: max(n for *_r, n in spans) for k, spans in where.items()}
    keys_of = list(where)
    # per path, every stretch of a key as arrays (start, end, key number): which keys are
    # resident at a position is then one vectorised test, not a scan of every key
    spans_of = []
    for i in range(len(paths)):
        rows = [(a, b, n) for n, k in enumerate(keys_of) for j, a, b, _b in where[k] if j == i]
        spans_of.append(np.array(rows, dtype=np.int64).reshape(-1, 3))
    # nothing placed: the allocator's peak (what every choice is measured against)
    unplaced = max((int((p[0] + p[1]).max()) for p in profiles), default=0)
    placed, best = set(where), total()
    while True:  # out of the arena, while the total does not grow
        i = max(range(len(profiles)), key=lambda j: profiles[j][0].max())
        t = int(profiles[i][0].argmax())
        s = spans_of[i]
        live = {keys_of[n] for n in s[(s[:, 0] <= t) & (s[:, 1] >= t), 2].tolist()}
        there = [k for k in live if k in placed]
        for key in sorted(there, key=lambda k: (-size[k], str(k))):
            move(key, 1)
            now = total()
            if now <= best:  # (a tie may open the way to a lower total at another peak)
                best = now
                placed.discard(key)
                break
            move(key, -1)
        else:
            break
    def fill(allowed: int) -> None:
        """Back in where the total stays within ``allowed`` (the more the arena holds, the
        better), until none can: one that goes in may make room under the arena for another."""
        added = True
        while added:
            added = False
            for key in sorted(set(where) - placed, key=lambda k: (-size[k], str(k))):
                move(key, -1)
                if total() <= allowed:
                    placed.add(key)
                    added = True
                else:
                    move(key, 1)

    fill(best if ceiling is None else max(best, ceiling))
    most = (1 + ARENA_SLACK) * unplaced if ceiling is None else ceiling
    if total() > most:
        # a local optimum well above the allocator's peak: from an empty arena instead
        for key in list(placed):
            move(key, 1)
        placed.clear()
        fill(unplaced if ceiling is None else ceiling)
    return {k for _g, keys, _r in paths for k in keys.values() if unit(k) in placed}
