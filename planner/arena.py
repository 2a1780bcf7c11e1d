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

from collections.abc import Hashable
from dataclasses import dataclass, field

from .address import ALIGNMENT, Placement, aligned, conflict_pairs, greedy_offsets, live_peak, optimal_offsets
from .graph import LOCAL, PlanningGraph
from .simulate import check_stretches, replay

Stretches = dict[int, list[tuple[int, int]]]  # sid -> [first, last] positions it is resident


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
        units = {k: n // ALIGNMENT for k, n in sizes.items()}
        better = optimal_offsets(spans, units, time_limit=optimize_seconds, conflicts=conflicts)
        if better.arena_bytes * ALIGNMENT < placement.arena_bytes:
            better.offsets = {k: o * ALIGNMENT for k, o in better.offsets.items()}
            better.arena_bytes *= ALIGNMENT
            placement = better
    plan = ArenaPlan(placement.offsets, sizes, placement.arena_bytes, placement, local_peak=local_peak)
    for g, keys, resident in per_path:  # every path must replay without overlap
        offsets = {sid: placement.offsets[keys[sid]] for sid in resident}
        plan.paths.append(check_stretches(g, resident, offsets, plan.arena_bytes))
    return plan
