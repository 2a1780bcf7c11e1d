"""Memory budgets: what a co-executed step drops, recomputes and offloads to stay within its
budget.

After each new trace the program plans all observed paths together with
:func:`planner.remat.plan_remat_paths` (issue order, the lifetimes the executor really gives values:
until Python lets go of them, plus the skeleton's sweep lag). A path's plan is a set of ops to
*drop*: the skeleton marks their runs as recipes and, after the op where the plan frees their
storages, sends a ``Drop``; the executor recomputes them when next needed
(``executor/remat.py``). With a copy bandwidth the plan also *offloads* storages: after given
ops the skeleton sends ``Offload``, ``Wait`` and ``Prefetch`` for them, each storage with its
slice of one host pool sized here (``executor/offload.py``). Plans are expressed in keys that
hold across steps (TraceGraph node, loop iterations), like the arena's, and every decision must
take effect after the same ops on every path. A budget below what any plan reaches raises
:class:`planner.remat.BudgetTooSmall`, naming the smallest feasible budget."""

from __future__ import annotations

import re
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from executor import Offload, Prefetch, Wait
from planner import PlanningGraph
from planner.arena import ArenaPlan, plan_arena
from planner.offload import Bandwidth
from planner.remat import (
    BudgetTooSmall,
    RematPath,
    RematPlan,
    format_bytes,
    offload_key,
    offload_window,
    plan_remat_paths,
    split_peaks,
)
from tracegraph import Trace

from .arena import lagged, placeable_storages
from .arena import storage_keys as path_storage_keys

# plans with an arena: how often the budget the storages are planned to is lowered by what the
# arena's fragmentation and the storages outside it add, before the smallest plan is tried
ARENA_ROUNDS = 4

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


@dataclass
class PathBudget:
    """One observed path under the budget."""

    plan: RematPlan
    persistent_bytes: int


@dataclass
class BudgetPlan:
    budget: int
    recipe_keys: set = field(default_factory=set)  # storage keys whose producers are recipes
    drop_after: dict = field(default_factory=dict)  # op key -> storage keys to drop after it
    paths: list[PathBudget] = field(default_factory=list)
    signatures: set = field(default_factory=set)  # path_signature of every planned path
    # op key -> (output slot, storage key) of its outputs parked on the host
    parked_outputs: dict = field(default_factory=dict)
    # op key -> (Offload | Wait | Prefetch, storage key, host pool offset) to send after it
    moves_after: dict = field(default_factory=dict)
    host_bytes: int = 0  # the host pool: every offloaded storage has its own slice
    seconds: float = 0.0  # planning time, every path and every round of bans included
    # the arena every path's planned storages are placed in (None: all from the allocator),
    # and the device bytes the plan then holds at its peak on the worst path: persistent
    # state, the whole arena, and the storages outside it
    arena: ArenaPlan | None = None
    arena_bound: int | None = None

    @property
    def offload_keys(self) -> set:
        """Storage keys parked on the host."""
        return {key for outs in self.parked_outputs.values() for _k, key in outs}

    @property
    def predicted_seconds(self) -> float:
        return max((p.plan.predicted_seconds for p in self.paths), default=0.0)

    @property
    def planned_peak(self) -> int:
        if self.arena_bound is not None:
            return self.arena_bound
        return max((p.plan.peak for p in self.paths), default=0)

    @property
    def recompute_seconds(self) -> float:
        return max((p.plan.extra_seconds for p in self.paths), default=0.0)

    def summary(self) -> str:
        """One line for the debug log: what the plan does and what it cost to find."""
        methods = sorted({p.plan.method for p in self.paths})
        return (
            f"memory budget {format_bytes(self.budget)}: planned peak {format_bytes(self.planned_peak)} "
            f"over {len(self.paths)} path(s), {len(self.recipe_keys)} "
            f"storages recomputed (+{1e3 * self.recompute_seconds:.1f} ms), {len(self.offload_keys)} "
            f"offloaded; {self._arena_words()}predicted step {1e3 * self.predicted_seconds:.1f} ms; planned in "
            f"{self.seconds:.1f} s ({', '.join(methods)})"
        )

    def _arena_words(self) -> str:
        if self.arena is None:
            return ""
        return f"arena {format_bytes(self.arena.arena_bytes)} ({100 * self.arena.fragmentation:.1f}% fragmentation); "


def plan_program_budget(
    traces: Sequence[Trace],
    keys: Sequence[tuple],
    budget: int,
    time_limit: float = 30.0,
    bandwidth: Bandwidth | None = None,
    arena: bool = False,
) -> BudgetPlan:
    """Plan every path to ``budget`` jointly (one decision per op key; offloading too, given
    the copy ``bandwidth``); raises :class:`BudgetTooSmall` if no plan meets it. Where paths
    would free a dropped storage, or move an offloaded one, after different ops, that decision
    is banned and the paths are planned again. With ``arena``, the storages that ops can write
    in place get one offset each in an arena over every path, from their residency stretches
    (a recomputed or copied-back storage returns to its bytes), and the budget covers the
    whole arena plus the storages outside it: where fragmentation pushes that over, the
    storages are planned to a lower budget."""
    t0 = time.perf_counter()
    paths, storage_keys = [], []
    for trace, op_keys in zip(traces, keys):
        g = lagged(PlanningGraph.from_trace(trace))
        paths.append(RematPath(g, list(range(len(g))), list(op_keys)))
        storage_keys.append(path_storage_keys(trace, g, op_keys))
    _fill_from_traced(paths, storage_keys, traces)
    placeable = None
    if arena:  # planned jointly: the solver sizes the arena (coexec/arena.py places it)
        placeable = [placeable_storages(p.g, t) for p, t in zip(paths, traces)]
        for p, ok in zip(paths, placeable):
            p.placed = frozenset(ok)
    # offloading may add to recomputation, never take away: where its plan lands higher (the
    # time limit, paths disagreeing on where copies land), recomputation alone is the plan
    options = [bandwidth] if bandwidth is None else [bandwidth, None]
    bans: dict = {bw: set() for bw in options}  # decisions paths disagree on, per option

    def fit(b: int, bw: Bandwidth | None) -> tuple:
        """Plans, with their arena and its bound, that meet budget ``b``, or BudgetTooSmall."""
        target = b
        for _ in range(ARENA_ROUNDS if arena else 1):
            agreed = _agreed_plans(paths, storage_keys, target, time_limit, bans[bw], bw)
            if not arena:
                return agreed, (None, None)
            arena_plan, bound = _place(paths, storage_keys, agreed[0], placeable)
            if bound <= b:
                return agreed, (arena_plan, bound)
            target -= 2 * (bound - b)  # what placement added (fragmentation): plan tighter, with room
        raise BudgetTooSmall(b, b + 1)

    def floor(bw: Bandwidth | None, e: BudgetTooSmall) -> tuple:
        """The smallest budget that plans with copy bandwidth ``bw``, its detail, and (with an
        arena) the plan reaching it with its arena: the solver sized the arena with the
        storages' smallest bound, and placing it (alignment, fragmentation) sets the budget."""
        smallest, lowest = _agreed_smallest(paths, storage_keys, e.smallest, time_limit, bans[bw], bw)
        if not arena or lowest is None:
            return smallest, e.detail, None
        placed = _place(paths, storage_keys, lowest[0], placeable)
        detail = (
            f"with the arena ({format_bytes(placed[0].arena_bytes)}, "
            f"{100 * placed[0].fragmentation:.1f}% fragmentation) and the storages outside it; "
            "how tightly the arena packs varies a little between plans: leave some headroom"
        )
        return placed[1], f"{e.detail}; {detail}" if e.detail else detail, (lowest, placed)

    failures = []
    for bw in options:
        try:
            (plans, drop_at, moved_at), (arena_plan, bound) = fit(budget, bw)
            break
        except BudgetTooSmall as e:
            failures.append((bw, e))
    else:
        smallest, detail, lowest = min((floor(bw, e) for bw, e in failures), key=lambda f: f[0])
        if lowest is None or smallest > budget:
            raise BudgetTooSmall(budget, smallest, detail) from None
        (plans, drop_at, moved_at), (arena_plan, bound) = lowest
    out = BudgetPlan(budget, seconds=time.perf_counter() - t0, arena=arena_plan, arena_bound=bound)
    out.signatures = {tuple(p.keys) for p in paths}
    for path, plan in zip(paths, plans):
        out.paths.append(PathBudget(plan, path.g.persistent_bytes))
    for key, (op_key,) in drop_at.items():
        out.recipe_keys.add(key)
        out.drop_after.setdefault(op_key, []).append(key)
    for key, ((after, nbytes),) in moved_at.items():
        node, k, its = key
        out.parked_outputs.setdefault((node, its), []).append((k, key))
        for kind, op_key in zip((Offload, Wait, Prefetch), after):
            out.moves_after.setdefault(op_key, []).append((kind, key, out.host_bytes))
        out.host_bytes += -(-nbytes // 512) * 512  # slices aligned for fast copies
    return out


def _place(paths: list[RematPath], storage_keys: list[dict], plans: list[RematPlan], placeable: list[set]):
    """The arena for ``plans`` (placeable storages at one offset each, over their residency
    stretches on every path) and the device bytes at the worst path's peak: persistent state,
    the whole arena, and what lies outside it (other storages, op workspace)."""
    keyed = [{sid: k for sid, k in skeys.items() if sid in ok} for skeys, ok in zip(storage_keys, placeable)]
    arena = plan_arena([(p.g, keys) for p, keys in zip(paths, keyed)], stretches=[pl.segments for pl in plans])
    bound = 0
    for p, keys, plan in zip(paths, keyed, plans):
        _inside, outside = split_peaks(p.g, p.order, plan.segments, frozenset(keys))
        bound = max(bound, plan.peak, p.g.persistent_bytes + arena.arena_bytes + outside)
    return arena, bound


def _agreed_plans(paths, storage_keys, budget, time_limit, banned, bandwidth):
    """Plans for every path that agree where each shared decision takes effect: a decision
    that paths would carry out after different ops is added to ``banned`` and the paths are
    planned again. Returns the plans and, per storage key, where it is dropped and moved."""
    while True:
        plans = plan_remat_paths(paths, budget, time_limit, banned, bandwidth)
        drop_at: dict[Hashable, set] = {}  # storage key -> op keys after which paths drop it
        owner: dict[Hashable, Hashable] = {}  # storage key -> key of the decision about it
        moved_at: dict[Hashable, set] = {}  # storage key -> (after which ops it moves, size)s
        for path, skeys, plan in zip(paths, storage_keys, plans):
            for c in plan.dropped:
                for sid in c.storages:
                    early_end = plan.segments[sid][0][1]
                    drop_at.setdefault(skeys[sid], set()).add(path.key(path.order[early_end]))
                    owner[skeys[sid]] = path.key(c.op)
            for o in plan.offloaded:
                moved_at.setdefault(skeys[o.sid], set()).add(offload_window(path, o))
                owner[skeys[o.sid]] = offload_key(path, o)
        conflicts = {owner[k] for k, ops in (*drop_at.items(), *moved_at.items()) if len(ops) > 1}
        if not conflicts:
            return plans, drop_at, moved_at
        banned |= conflicts


def _agreed_smallest(paths, storage_keys, smallest, time_limit, banned, bandwidth) -> tuple[int, tuple | None]:
    """The smallest budget for which :func:`_agreed_plans` succeeds, and what it returns
    there: the solver's smallest peak, raised while the decisions reaching it disagree between
    paths (each round bans more), so that the budget an error names is one that really plans."""
    for _ in range(20):
        try:
            return smallest, _agreed_plans(paths, storage_keys, smallest, time_limit, banned, bandwidth)
        except BudgetTooSmall as e:
            smallest = e.smallest
    return smallest, None


def _fill_from_traced(paths: list[RematPath], storage_keys: list[dict], traces: list[Trace]) -> None:
    """Paths recorded while co-executing have no op times (the skeleton computes nothing) and
    only layout sizes for storages: take both from traced paths, per TraceGraph node; every
    path gets the same time for the same node."""
    seconds: dict = {}
    nbytes: dict = {}
    for p, skeys, t in zip(paths, storage_keys, traces):
        if t.computed:
            for op, key in zip(p.g.ops, p.keys):
                seconds.setdefault(key[0], op.seconds)
            for sid, (node, k, _its) in skeys.items():
                nbytes[node, k] = max(nbytes.get((node, k), 0), p.g.storages[sid].nbytes)
    for p, skeys, t in zip(paths, storage_keys, traces):
        # one time per op for every path (the first traced one), so that timing noise cannot
        # make paths disagree on where an offloaded storage's copies land
        for op, key in zip(p.g.ops, p.keys):
            op.seconds = seconds.get(key[0], 0.0)
        if not t.computed:
            for sid, (node, k, _its) in skeys.items():
                s = p.g.storages[sid]
                s.nbytes = max(s.nbytes, nbytes.get((node, k), 0))


def step_device(traces: list[Trace]) -> "torch.device":
    """Where a step's tensors live: the first CUDA device among its values, else the CPU."""
    for t in traces:
        for v in t.values:
            if v.meta.device.type == "cuda":
                return v.meta.device
    return torch.device("cpu")


def path_signature(cursor_placed: dict, iterations) -> tuple:
    """The op keys of a co-executed step, in order: equal to a planned path's iff the step
    took that path."""
    return tuple((node.id, iterations(ctx)) for _i, (node, ctx) in sorted(cursor_placed.items()))
