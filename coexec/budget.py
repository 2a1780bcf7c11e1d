"""Memory budgets as the user gives them, and the facts of a step the budget plan needs.

The plan itself is the planner's (``planner.plan_program`` with a budget: what to drop,
recompute and offload on every observed path, in keys that hold across steps); the skeleton
carries it out (coexec/skeleton.py) and the executor drops, recomputes and moves storages
(``executor/remat.py``, ``executor/offload.py``). A budget below what any plan reaches raises
``planner.BudgetTooSmall``, naming the smallest feasible budget."""

from __future__ import annotations

import re

import torch

from planner import Site
from tracegraph import Trace

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip


def parse_budget(budget: int | str) -> int:
    """Bytes from an int or a string such as ``"6GB"``, ``"512 MiB"``, ``"1.5GiB"`` (GB is
    10^9 bytes, GiB 2^30)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise TypeError(f"memory_budget must be bytes (an int) or a string like '6GB', got {budget!r}")
    if isinstance(budget, int):
        n = budget
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        unit = m and m.group(2).lower()
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"memory_budget {budget!r} is not a size: write bytes, or a number with one of "
                "the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"memory_budget must be positive, got {budget!r}")
    return n


def step_device(traces: list[Trace]) -> torch.device:
    """Where a step's tensors live: the first CUDA device among its values, else the CPU."""
    for t in traces:
        for v in t.values:
            if v.meta.device.type == "cuda":
                return v.meta.device
    return torch.device("cpu")


def path_signature(cursor_placed: dict, iterations) -> tuple[Site, ...]:
    """The sites of a co-executed step's ops, in order: equal to a planned path's iff the
    step took that path."""
    return tuple(Site(node.id, iterations(ctx)) for _i, (node, ctx) in sorted(cursor_placed.items()))
