"""Planning a path: order, arena addresses, validation (DESIGN.md §3).

:func:`plan_graph` picks the best of the eager order, the greedy order and CP-SAT's order
(:func:`planner.order.block_order`: blocks stay whole)
(time-limited), places the local storages in one arena (best fit, then CP-SAT when best fit
leaves any fragmentation), and replays the result in the simulator: a :class:`Plan` is always
valid, and says how good it is (peaks, arena, fragmentation, solve times, gaps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .address import ALIGNMENT, Placement, aligned, conflict_pairs, greedy_offsets, live_peak, refined
from .graph import EAGER, LOCAL, Execution, PlanningGraph
from .order import OrderResult, block_order
from .simulate import replay



@dataclass
class Plan:
    order: list[int]
    offsets: dict[int, int]  # local storage id -> arena offset
    arena_bytes: int
    peak: int  # exact peak of live bytes in this order, persistent state included
    eager_order_peak: int  # the same measure for the order the program issued the ops in
    persistent_bytes: int
    order_result: OrderResult
    placement: Placement
    seconds: float
    stats: dict = field(default_factory=dict)

    @property
    def fragmentation(self) -> float:
        local = self.stats.get("local_peak", 0)
        return self.arena_bytes / local - 1 if local else 0.0

    def summary(self) -> dict:
        return {
            "ops": len(self.order),
            "eager order peak": self.eager_order_peak,
            "planned peak": self.peak,
            "arena bytes": self.arena_bytes,
            "fragmentation": self.fragmentation,
            "order": self.order_result.method,
            "order seconds": self.order_result.seconds,
            "order gap": self.order_result.gap,
            "addresses": self.placement.method,
            "address seconds": self.placement.seconds,
            "address gap": self.placement.gap,
            "plan seconds": self.seconds,
        }


def plan_graph(g: PlanningGraph, time_limit: float = 30.0, optimize: bool = True) -> Plan:
    """Plan ``g`` within about ``time_limit`` seconds (split between order and addresses),
    for block-by-block execution in the planned order (``Execution(blocks=True)``, what the
    runtime does); ``eager_order_peak`` is eager PyTorch's (the issue order, freed when Python
    let go)."""
    t0 = time.perf_counter()
    eager = list(range(len(g)))
    eager_peak = replay(g.with_execution(EAGER), eager).peak
    g = g.with_execution(Execution(blocks=True))
    best = block_order(g, time_limit=0.7 * time_limit if optimize else 0.0)
    spans = {
        sid: iv
        for sid, iv in replay(g, best.order).intervals.items()
        if g.storages[sid].kind == LOCAL and g.storages[sid].nbytes > 0
    }
    sizes = {sid: aligned(g.storages[sid].nbytes) for sid in spans}
    conflicts = conflict_pairs(spans)
    placement = greedy_offsets(spans, sizes, conflicts, alignment=ALIGNMENT)
    local_peak = live_peak(spans, sizes)
    if optimize and placement.arena_bytes > local_peak:
        placement = refined(placement, spans, sizes, conflicts, 0.3 * time_limit)
    result = replay(g, best.order, placement.offsets, arena_bytes=placement.arena_bytes)
    return Plan(
        order=best.order,
        offsets=placement.offsets,
        arena_bytes=placement.arena_bytes,
        peak=result.peak,
        eager_order_peak=eager_peak,
        persistent_bytes=g.persistent_bytes,
        order_result=best,
        placement=placement,
        seconds=time.perf_counter() - t0,
        stats={"local_peak": local_peak},
    )
