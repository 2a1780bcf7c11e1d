"""Memory planning of a step (DESIGN.md §2, §3): operator order, arena addresses, validation.

``PlanningGraph.from_trace`` lowers a recorded path; :func:`plan_graph` chooses the order and
the arena addresses and returns a validated :class:`Plan`; :func:`replay` (the simulator)
checks any plan and gives its exact peak.
"""

from .graph import ESCAPING, LOCAL, PERSISTENT, OpNode, PlanningGraph, Storage
from .plan import Plan, plan_graph
from .simulate import InvalidPlan, Replay, lifetimes, replay

__all__ = [
    "ESCAPING", "InvalidPlan", "LOCAL", "OpNode", "PERSISTENT", "Plan", "PlanningGraph",
    "Replay", "Storage", "lifetimes", "plan_graph", "replay",
]  # fmt: skip
