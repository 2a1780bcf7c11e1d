"""The paths a budget plan covers, and how a plan counts their bytes and costs."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from ..address import aligned
from ..candidates import Candidate
from ..graph import PlanningGraph
from ..offload import OffloadCandidate, predict_seconds
from ..simulate import Replay

MICROSECOND = 1e-6  # cost unit of the CP-SAT objective; every recomputation costs at least one
# an offload costs no compute when its copies overlap (the channel rows see to that): one unit,
# so that storages are parked only when the budget needs it
OFFLOAD_COST = 1


@dataclass
class RematPlan:
    order: list[int]
    dropped: list[Candidate]  # sorted by recompute position
    peak: int
    base_peak: int  # the same order without recomputation
    budget: int | None
    extra_seconds: float
    # "none", "greedy", "cp-sat" (proven optimal), "cp-sat-timeout", "lowest-peak" (the
    # solver found nothing in time; the plan of the lowest peak, which fits)
    method: str
    seconds: float
    gap: float | None = None  # CP-SAT's relative gap on the added time (0: optimal)
    offloaded: list[OffloadCandidate] = field(default_factory=list)  # storages parked on the host
    predicted_seconds: float = 0.0  # the step with recomputation and copies (predict_seconds)
    stall_seconds: float = 0.0  # of which waiting for copies
    segments: dict = field(default_factory=dict)  # the replay's: sid -> its stretches on the device

    @property
    def optimal(self) -> bool:
        return self.method in ("none", "cp-sat")

    def freed_after(self) -> dict[int, int]:
        """Per storage of a dropped op, the position after which the executor frees it: the
        end of its first stretch on the device in the plan's replay (each after its own last
        need before its op runs again: an op's outputs may be needed to different points)."""
        return {sid: self.segments[sid][0][1] for c in self.dropped for sid in c.storages}


def predict(g: PlanningGraph, order: list[int], dropped: list[Candidate], offloaded: list[OffloadCandidate]) -> tuple[float, float]:
    """:func:`planner.offload.predict_seconds` of a plan: (step seconds, of which stalls).
    A dropped op is counted at its recompute point (chains made again earlier cost the same)."""
    at: dict[int, float] = {}
    for c in dropped:
        at[c.recompute_at] = at.get(c.recompute_at, 0.0) + c.seconds
    return predict_seconds(g, order, at, offloaded)


def cost(c: Candidate) -> int:
    return max(1, round(c.seconds / MICROSECOND))


@dataclass
class RematPath:
    """One path of a step to plan: its graph, its op order, and a key per op index that names
    the same op on every path (the TraceGraph node and loop iterations; default: the index).
    A drop decision is made per key, so all paths agree on it."""

    g: PlanningGraph
    order: list[int]
    keys: list[Hashable] | None = None
    # storages placed in one arena shared by all paths (None: no arena). The arena holds
    # whole, from the start: a plan needs persistent + arena + the rest at every moment, where
    # the arena is the largest sum of placed storages resident at once on any path
    placed: frozenset | None = None

    def key(self, op: int) -> Hashable:
        return op if self.keys is None else self.keys[op]


def sizer(g: PlanningGraph, placed: frozenset | None) -> Callable[[int], int]:
    """A storage's bytes as a plan counts them: placed ones as the arena holds them (aligned)."""
    if not placed:
        return lambda sid: g.storages[sid].nbytes
    return lambda sid: aligned(g.storages[sid].nbytes) if sid in placed else g.storages[sid].nbytes


def resident_split(g: PlanningGraph, n: int, segments: dict, placed: frozenset) -> tuple[list[int], list[int]]:
    """Per position of an order of ``n`` ops, the bytes resident of the ``placed`` storages
    (aligned as the arena holds them) and of the rest, given when each storage is resident (a
    replay's ``segments``)."""
    inside, outside = [0] * (n + 1), [0] * (n + 1)
    size_of = sizer(g, placed)
    for sid, spans in segments.items():
        delta = inside if sid in placed else outside
        for a, b in spans:
            delta[a] += size_of(sid)
            delta[b + 1] -= size_of(sid)
    for delta in (inside, outside):
        run = 0
        for t in range(n + 1):
            run += delta[t]
            delta[t] = run
        del delta[n]
    return inside, outside


def split_peaks(g: PlanningGraph, order: list[int], segments: dict, placed: frozenset) -> tuple[int, int]:
    """Peaks of the ``placed`` storages resident at once (aligned as the arena holds them) and
    of the rest (op workspace included)."""
    inside, outside = resident_split(g, len(order), segments, placed)
    i_peak = max(inside, default=0)
    o_peak = max((o + g.ops[v].workspace for o, v in zip(outside, order)), default=0)
    return i_peak, o_peak


def bound_of(paths: list[RematPath], replays: list[Replay]) -> int:
    """The device bytes plans need at their peak over all paths: with an arena, persistent
    state, the arena (the most placed bytes resident at once on any path) and the rest."""
    peak = max((r.peak for r in replays), default=0)
    if not paths or paths[0].placed is None:
        return peak
    split = [split_peaks(p.g, p.order, r.segments, p.placed) for p, r in zip(paths, replays)]
    arena = max(i for i, _o in split)
    return max(peak, *(p.g.persistent_bytes + arena + o for p, (_i, o) in zip(paths, split)))


def offload_key(p: RematPath, o: OffloadCandidate) -> Hashable:
    """The decision key of offloading ``o``'s storage: its producer's key and output slot."""
    return ("off", p.key(o.producer), o.index)
