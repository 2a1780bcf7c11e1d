"""Memory planning of training steps (DESIGN.md §2, §3): op order, arena addresses,
recomputation and offloading under a budget, across every observed path of a TraceGraph.

* :func:`plan_program` plans a program's observed paths (:class:`PathInput`) into the one
  boundary type, a :class:`Schedule` (``planner.schedule``), which the runtime carries out;
* ``PlanningGraph.from_trace`` lowers one recorded path; :func:`plan_graph` chooses its order
  and arena addresses; :func:`replay`, the simulator, checks any plan and gives its exact peak.

The public API is what this module exports; the submodules are the planner's own.
"""

from .errors import BudgetTooSmall, InvalidPlan, format_bytes
from .graph import (
    EAGER, ESCAPING, LOCAL, PERSISTENT, Access, Execution, OpNode, PlanningGraph, Storage, StorageFacts,
)  # fmt: skip
from .schedule import Bandwidth
from .plan import Plan, plan_graph
from .program import PathInput, Settings, plan_program
from .schedule import (
    AfterOp, Block, BlockKey, Drop, Offload, PathPlan, Prefetch, Schedule, Site, StorageKey, WaitOffload,
)  # fmt: skip
from .remat import RematPlan, plan_remat
from .simulate import Replay, lifetimes, replay

__all__ = [
    "Access", "StorageFacts", "AfterOp", "Bandwidth", "Block", "BlockKey", "BudgetTooSmall", "Drop", "EAGER", "ESCAPING",
    "Execution", "InvalidPlan", "LOCAL", "Offload", "OpNode", "PERSISTENT", "PathInput", "PathPlan",
    "Plan", "PlanningGraph", "RematPlan", "plan_remat", "Prefetch", "Replay", "Schedule", "Settings", "Site", "Storage",
    "StorageKey", "WaitOffload", "format_bytes", "lifetimes", "plan_graph", "plan_program", "replay",
]  # fmt: skip
