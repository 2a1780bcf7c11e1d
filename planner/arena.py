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

from .address import Placement, greedy_offsets, live_peak, optimal_offsets
from .graph import LOCAL, PlanningGraph
from .simulate import Replay, replay

ALIGNMENT = 64


@dataclass
class ArenaPlan:
    offsets: dict[Hashable, int]  # storage key -> arena offset
    sizes: dict[Hashable, int]  # storage key -> bytes (aligned)
    arena_bytes: int
    placement: Placement
    paths: list[Replay] = field(default_factory=list)  # each observed path, replayed
    local_peak: int = 0  # the largest live-bytes peak of local storages over the paths

    @property
    def fragmentation(self) -> float:
        return self.arena_bytes / self.local_peak - 1 if self.local_peak else 0.0


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_arena(
    paths: list[tuple[PlanningGraph, dict[int, Hashable]]], optimize_seconds: float = 0.0
) -> ArenaPlan:
    """``paths``: (graph, storage id -> key) per observed path; ops run in issue order."""
    spans: dict[Hashable, tuple[int, int]] = {}
    sizes: dict[Hashable, int] = {}
    conflicts: dict[Hashable, set] = {}
    local_peak = 0
    per_path = []
    for g, keys in paths:
        order = list(range(len(g)))
        life = replay(g, order).intervals
        local = [sid for sid, s in g.storages.items() if s.kind == LOCAL and s.nbytes > 0 and sid in keys]
        path_spans = {keys[sid]: life[sid] for sid in local}
        for sid in local:
            k = keys[sid]
            sizes[k] = max(sizes.get(k, 0), _aligned(g.storages[sid].nbytes))
            conflicts.setdefault(k, set())
        items = sorted(path_spans.items(), key=lambda kv: kv[1])
        active: list[tuple[int, Hashable]] = []
        for k, (a, b) in items:
            active = [(last, o) for last, o in active if last >= a]
            for _last, o in active:
                if o != k:
                    conflicts[k].add(o)
                    conflicts[o].add(k)
            active.append((b, k))
        local_peak = max(local_peak, live_peak(path_spans, {k: sizes[k] for k in path_spans}))
        per_path.append((g, keys, local))
        for k, iv in path_spans.items():  # a representative interval per key (for the solver)
            spans.setdefault(k, iv)
    placement = greedy_offsets(spans, sizes, conflicts, alignment=ALIGNMENT)
    if optimize_seconds > 0 and placement.arena_bytes > local_peak and len(paths) == 1:
        units = {k: n // ALIGNMENT for k, n in sizes.items()}
        better = optimal_offsets(spans, units, time_limit=optimize_seconds, conflicts=conflicts)
        if better.arena_bytes * ALIGNMENT < placement.arena_bytes:
            better.offsets = {k: o * ALIGNMENT for k, o in better.offsets.items()}
            better.arena_bytes *= ALIGNMENT
            placement = better
    plan = ArenaPlan(placement.offsets, sizes, placement.arena_bytes, placement, local_peak=local_peak)
    for g, keys, local in per_path:  # every path must replay without overlap
        offsets = {sid: placement.offsets[keys[sid]] for sid in local}
        plan.paths.append(replay(g, list(range(len(g))), offsets, arena_bytes=plan.arena_bytes, partial=True))
    return plan
