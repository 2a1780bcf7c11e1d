"""Planning a program: every observed path of a TraceGraph into one :class:`Schedule`.

:func:`plan_program` is a pure function (DESIGN.md §3: "Planning across paths lives in
``planner``"): it takes each observed path as a recorded trace with the :class:`Site` of each
op (where the TraceGraph placed it) and which ops may write their outputs into the arena, and
returns the Schedule the runtime carries out, or raises :class:`BudgetTooSmall`. It reads no
runtime state, so a graph captured anywhere can be planned.

Without a memory budget, each path runs **block by block in a planned order**: every distinct
block (the ops between two sync points) gets one order, the greedy order that minimises the
peak (optionally improved by CP-SAT within ``order_seconds``), kept by every path that has the
block; the arena then places, over every path in those orders, the storages that do not raise
the step's total (``planner.arena.select_placed``), each at one offset.

Under a budget (:func:`_plan_budget`), paths run in the issue order, each op as it is issued:
what to drop, recompute and offload is planned on every path jointly, one decision per op and
storage key, with the arena in the same plan when asked.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from tracegraph import Trace

from .arena import ArenaPlan, plan_arena, select_placed
from .errors import BudgetTooSmall, InvalidPlan, format_bytes
from .graph import LOCAL, Execution, PlanningGraph
from .offload import Bandwidth, predict_seconds
from .order import STREAM_SLACK, block_order, valid_block_order
from .remat import RematPath, RematPlan, offload_key, offload_window, plan_remat_paths, resident_split, split_peaks
from .schedule import (
    AfterOp, Block, BlockKey, Drop, Offload, PathPlan, Prefetch, Schedule, Site, StorageKey, WaitOffload,
)  # fmt: skip
from .simulate import replay

# plans with an arena under a budget: how often the budget the storages are planned to is
# lowered by what the arena's fragmentation and the storages outside it add, before the
# smallest plan is tried
ARENA_ROUNDS = 4


@dataclass(frozen=True)
class PathInput:
    """One observed path: its trace, the site of each of its ops (by op index), and the ops
    whose ``out=`` variant writes their outputs where they are planned (the runtime probes
    this; an op not listed allocates for itself)."""

    trace: Trace
    sites: tuple[Site, ...]
    writable: frozenset = frozenset()


@dataclass(frozen=True)
class Settings:
    """What to plan for: ``budget`` (device bytes at the peak, persistent state included;
    None: least memory without recomputation), ``bandwidth`` (the copy channel, to offload
    under a budget), ``arena`` (place storages in one arena), ``sweep_lag`` (ops after which the
    runtime learns that Python let go of a tensor, when it runs ops as they are issued),
    ``order_seconds`` (CP-SAT time for block orders beyond the greedy order), ``time_limit``
    (for the budget solver)."""

    budget: int | None = None
    bandwidth: Bandwidth | None = None
    arena: bool = True
    sweep_lag: int = 0
    order_seconds: float = 0.0
    time_limit: float = 30.0


def plan_program(paths: Sequence[PathInput], settings: Settings = Settings()) -> Schedule:
    """The Schedule for every path (see the module docstring). Raises
    :class:`BudgetTooSmall` when no plan meets the budget, :class:`InvalidPlan` if a plan
    fails the simulator's validation (a planner bug: never run)."""
    t0 = time.perf_counter()
    if settings.budget is not None:
        out = _plan_budget(paths, settings)
    else:
        out = _plan_orders(paths, settings)
    return _with_seconds(out, time.perf_counter() - t0)


# -- paths ---------------------------------------------------------------------------------
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trace -> _Prepared


@dataclass(eq=False)
class _Prepared:
    """A path's planning graph and keys, made once per path: a program plans again over every
    path after each new one."""

    sites: tuple
    g: PlanningGraph  # as recorded (eager execution)
    keys: dict[int, StorageKey]  # storage id -> key, for every storage the path allocates
    placeable: frozenset  # storage ids an op writes in place (arena candidates)
    cache: dict = field(default_factory=dict)


def _prepared(p: PathInput) -> _Prepared:
    got = _PREPARED.get(p.trace)
    if got is None or got.sites != p.sites:
        g = PlanningGraph.from_trace(p.trace)
        keys = {
            sid: StorageKey(p.sites[s.producer].node, s.out_index, p.sites[s.producer].iterations)
            for sid, s in g.storages.items()
            if s.producer is not None
        }
        got = _Prepared(p.sites, g, keys, _placeable(g, p.trace, p.writable))
        _PREPARED[p.trace] = got
    return got


def _placeable(g: PlanningGraph, trace: Trace, writable: frozenset) -> frozenset:
    """Local storages an op writes in place into the arena: every output of the op a fresh
    storage of its own, local to the step, and the op's ``out=`` variant writes as planned."""
    values = trace.values
    out: set[int] = set()
    for rec, op in zip(trace.ops, g.ops):
        if rec.index not in writable:
            continue
        made = [values[v].storage for v in rec.outputs]
        if not made or len(set(made)) != len(made) or not set(made) <= set(op.allocates):
            continue
        if all(g.storages[sid].kind == LOCAL for sid in made):
            out.update(made)
    return frozenset(out)


def _block_keys(g: PlanningGraph, sites: tuple) -> list[BlockKey]:
    return [tuple(sites[v] for v in block) for block in g.blocks()]


# -- without a budget: blocks in a planned order, one arena -----------------------------------
# the share of the peak a plan gives up so that the executor runs blocks ahead of their launch:
# freeing what Python holds until the step returns after its last use makes the executor wait
# for the step's end wherever the plan reuses those bytes (GPT-2-6l at batch 16: 2.6% of the
# peak, for steps 1.3x eager against 0.99x; bench/zoo_steps.py, docs/planner.md)
AHEAD_SLACK = 0.05


def _plan_orders(paths: Sequence[PathInput], settings: Settings) -> Schedule:
    """Each block in its least-memory order, the arena placed for those orders. Planned for an
    executor that runs blocks ahead of their launch (``Execution.ahead``: what Python holds
    until the step returns is held to the end), unless blocks that wait for their launch to
    free it earlier save more than ``AHEAD_SLACK`` of the peak, or as much with an arena."""
    preps = [_prepared(p) for p in paths]
    ahead = _plan_blocks(preps, settings, Execution(blocks=True, ahead=True))
    if not any(_held_to_end(pr.g) for pr in preps):  # (the two plans would be the same)
        return replace(ahead, methods=(*ahead.methods, "blocks: run ahead"))
    launched = _plan_blocks(preps, settings, Execution(blocks=True))
    if launched.arena_bytes and not ahead.arena_bytes and launched.peak >= (1 - STREAM_SLACK) * ahead.peak:
        best = launched  # as little memory, in one arena (fixed addresses, shared across paths)
    else:
        best = ahead if ahead.peak <= (1 + AHEAD_SLACK) * launched.peak else launched
    how = "blocks: run ahead" if best is ahead else "blocks: at their launch"
    return replace(best, methods=(*best.methods, how))


def _held_to_end(g: PlanningGraph) -> bool:
    """Does Python hold a storage of the step until it returns (``Execution.ahead`` holds it to
    the end)?"""
    n = len(g.ops)
    return any(s.kind == LOCAL and s.release is not None and s.release >= n for s in g.storages.values())


def _plan_blocks(preps: list[_Prepared], settings: Settings, execution: Execution) -> Schedule:
    """Planned twice: with orders that keep to the issue order as long as the peak allows, or
    entirely where reordering saves less than ``STREAM_SLACK`` (the executor runs those ops
    ahead, beside the skeleton), and with the plain greedy orders; the first unless its peak,
    arena included, is higher by more than that."""
    graphs = [pr.g.with_execution(execution) for pr in preps]
    sites = [pr.sites for pr in preps]
    lazy_orders = _block_orders(graphs, sites, settings.order_seconds, True)
    plain_orders = _block_orders(graphs, sites, settings.order_seconds, False)
    lazy = _orders_schedule(graphs, preps, lazy_orders, settings)
    plain = _orders_schedule(graphs, preps, plain_orders, settings)
    best, orders = (lazy, lazy_orders) if lazy.peak <= (1 + STREAM_SLACK) * plain.peak else (plain, plain_orders)
    if best.arena_bytes and _over_eager(best):
        # an arena held whole over a path's peak (64-byte alignment is enough on a small step)
        best = _orders_schedule(graphs, preps, orders, replace(settings, arena=False))
    return best


def _over_eager(schedule: Schedule) -> bool:
    """Does the plan hold more than eager PyTorch on some path? Without an arena it never does
    (every path's orders peak at most at its issue order, which frees no later than eager)."""
    return any(p.planned_peak > p.eager_peak for p in schedule.paths)


def _orders_schedule(graphs: list[PlanningGraph], preps: list[_Prepared], orders: "_Orders", settings: Settings) -> Schedule:
    path_orders = []
    for g, pr in zip(graphs, preps):
        order: list[int] = []
        for block, key in zip(g.blocks(), _block_keys(g, pr.sites)):
            order.extend(block.start + k for k in orders.get(key, range(len(block))))
        path_orders.append(order)
    replays = [replay(g, order) for g, order in zip(graphs, path_orders)]
    arena = None
    if settings.arena:
        arena = _place_arena(graphs, preps, path_orders, [r.segments for r in replays])
    arena_bytes = arena.arena_bytes if arena is not None else 0
    plans, blocks = [], {}
    for g, pr, order, rep in zip(graphs, preps, path_orders, replays):
        offsets = {}
        if arena is not None:
            offsets = {sid: arena.offsets[k] for sid, k in pr.keys.items() if k in arena.offsets}
        checked = replay(g, order, offsets, arena_bytes=arena.arena_bytes if arena else None, partial=True)
        placed = frozenset(offsets)
        # per position, the device bytes as the executor counts them: the whole arena, plus
        # the storages outside it that are resident (the step's own; persistent state apart)
        held = [arena_bytes + b for b in resident_split(g, len(order), rep.segments, placed)[1]]
        for block, key in zip(g.blocks(), _block_keys(g, pr.sites)):
            bound = max(held[p] for p in block)  # (positions of a block are the same in the order)
            known = blocks.get(key)
            if known is None:
                rel = orders.get(key, tuple(range(len(block))))
                new = tuple(
                    sum(g.storages[sid].nbytes for sid in g.ops[v].allocates if sid not in placed) for v in block
                )
                blocks[key] = Block(key, tuple(rel), bound, new)
            elif bound < known.bound:
                blocks[key] = replace(known, bound=bound)
        peak = rep.peak if arena is None else max(rep.peak, g.persistent_bytes + max(held, default=0))
        eager = replay(pr.g, list(range(len(g))), check_order=False).peak
        seconds, _stall = predict_seconds(g, order, {}, [])
        moved = sum(1 for key in _block_keys(g, pr.sites) if key in orders)
        plans.append(PathPlan(len(order), moved, eager, peak, checked.arena_end, seconds))
    return Schedule(
        blocks=blocks,
        offsets=dict(arena.offsets) if arena is not None else {},
        arena_bytes=arena_bytes,
        arena_live=arena.local_peak if arena is not None else 0,
        paths=tuple(plans),
        signatures={pr.sites: i for i, pr in enumerate(preps)},
        methods=tuple(sorted(set(_methods(orders)))),
    )


class _Orders(dict):
    """BlockKey -> planned order (offsets into the block); ``how`` records the method."""

    how: dict


def _block_orders(graphs: list[PlanningGraph], sites: list[tuple], seconds: float, lazy: bool) -> _Orders:
    """One order per distinct block over every path: solved on the first path that has the
    block and kept by the others (a block whose order is not valid on another path, where
    the same sites read other values, runs in the issue order everywhere). Blocks whose best
    order is the issue order are left out."""
    chosen: dict[BlockKey, tuple[int, ...]] = {}
    how: dict[BlockKey, str] = {}
    per_path = max(0.0, seconds) / max(1, len(graphs))
    for g, ss in zip(graphs, sites):
        blocks = g.blocks()
        keys = _block_keys(g, ss)
        forced = {}
        for k, (block, key) in enumerate(zip(blocks, keys)):
            if key in chosen:
                if not valid_block_order(g, block, chosen[key]):
                    chosen[key] = tuple(range(len(block)))
                    how[key] = "issue"
                forced[k] = chosen[key]
        if len(forced) == len(blocks):
            continue
        found = block_order(g, forced, time_limit=per_path, lazy=lazy)
        pos = {v: i for i, v in enumerate(found.order)}
        for block, key in zip(blocks, keys):
            if key not in chosen:
                chosen[key] = tuple(v - block.start for v in sorted(block, key=pos.__getitem__))
                how[key] = found.method
    _unshare_where_worse(graphs, sites, chosen, how)
    out = _Orders((k, o) for k, o in chosen.items() if o != tuple(range(len(o))))
    out.how = how
    return out


def _unshare_where_worse(graphs: list[PlanningGraph], sites: list[tuple], chosen: dict, how: dict) -> None:
    """A block's best order depends on what the rest of the path does with its storages, so an
    order solved on one path can be worse on another: where a path's orders peak above its issue
    order, the blocks it shares with other paths go back to the issue order (for every path:
    one order per block)."""
    keys = [_block_keys(g, ss) for g, ss in zip(graphs, sites)]
    paths_of: dict[BlockKey, int] = {}
    for ks in keys:
        for k in set(ks):
            paths_of[k] = paths_of.get(k, 0) + 1
    issue_peaks = [replay(g, list(range(len(g))), check_order=False).peak for g in graphs]
    for _round in range(len(graphs)):
        changed = False
        for g, ks, issue_peak in zip(graphs, keys, issue_peaks):
            order = [b.start + k for b, key in zip(g.blocks(), ks) for k in chosen[key]]
            if replay(g, order, check_order=False).peak <= issue_peak:
                continue
            for b, key in zip(g.blocks(), ks):
                if paths_of[key] > 1 and chosen[key] != tuple(range(len(b))):
                    chosen[key], how[key], changed = tuple(range(len(b))), "issue", True
            # its own blocks again, around the shared ones as they are now (never worse than
            # those with the issue order elsewhere)
            forced = {i: chosen[key] for i, key in enumerate(ks) if paths_of[key] > 1}
            found = block_order(g, forced)
            pos = {v: i for i, v in enumerate(found.order)}
            for i, (b, key) in enumerate(zip(g.blocks(), ks)):
                if i not in forced:
                    chosen[key] = tuple(v - b.start for v in sorted(b, key=pos.__getitem__))
                    how[key] = found.method
        if not changed:
            return


def _methods(orders: _Orders) -> list[str]:
    return [f"order: {m}" for m in set(orders.how.values())] or ["order: issue"]


def _place_arena(
    graphs: list[PlanningGraph], preps: list[_Prepared], orders: list[list[int]], segments: list[dict]
) -> ArenaPlan:
    """The arena over every path in its planned order: the placeable storages that do not
    raise the step's total (the arena is held whole), an op's outputs together."""
    keyed = [({sid: pr.keys[sid] for sid in pr.placeable}) for pr in preps]
    chosen = select_placed(
        [(g, keys, seg) for g, keys, seg in zip(graphs, keyed, segments)], unit=lambda k: k.site, orders=orders
    )
    keyed = [{sid: k for sid, k in keys.items() if k in chosen} for keys in keyed]
    return plan_arena(list(zip(graphs, keyed)), stretches=segments)


# -- under a budget: issue order, drops and moves per key, the arena jointly -------------------
def _plan_budget(paths: Sequence[PathInput], settings: Settings) -> Schedule:
    """Plan every path to the budget jointly (one decision per op key; offloading too, given
    the copy bandwidth); raises :class:`BudgetTooSmall` if no plan meets it. Where paths would
    free a dropped storage, or move an offloaded one, after different ops, that decision is
    banned and the paths are planned again. With an arena, the storages that ops can write in
    place get one offset each over every path, from their residency stretches (a recomputed or
    copied-back storage returns to its bytes), and the budget covers the whole arena plus the
    storages outside it: where fragmentation pushes that over, the storages are planned to a
    lower budget."""
    budget, bandwidth, arena = settings.budget, settings.bandwidth, settings.arena
    time_limit = settings.time_limit
    execution = Execution(blocks=False, lag=settings.sweep_lag)
    preps = [_prepared(p) for p in paths]
    rpaths = [RematPath(pr.g.with_execution(execution), list(range(len(pr.g))), list(pr.sites)) for pr in preps]
    storage_keys = [pr.keys for pr in preps]
    _fill_from_traced(rpaths, storage_keys, [p.trace for p in paths])
    placeable = None
    if arena:  # planned jointly: the solver sizes the arena (placed below)
        placeable = [pr.placeable for pr in preps]
        for rp, ok in zip(rpaths, placeable):
            rp.placed = frozenset(ok)
    # offloading may add to recomputation, never take away: where its plan lands higher (the
    # time limit, paths disagreeing on where copies land), recomputation alone is the plan
    options = [bandwidth] if bandwidth is None else [bandwidth, None]
    bans: dict = {bw: set() for bw in options}  # decisions paths disagree on, per option

    def fit(b: int, bw: Bandwidth | None) -> tuple:
        """Plans, with their arena and its bound, that meet budget ``b``, or BudgetTooSmall."""
        target = b
        for _ in range(ARENA_ROUNDS if arena else 1):
            agreed = _agreed_plans(rpaths, storage_keys, target, time_limit, bans[bw], bw)
            if not arena:
                return agreed, (None, None)
            arena_plan, bound = _place(rpaths, storage_keys, agreed[0], placeable)
            if bound <= b:
                return agreed, (arena_plan, bound)
            target -= 2 * (bound - b)  # what placement added (fragmentation): plan tighter, with room
        raise BudgetTooSmall(b, b + 1)

    def floor(bw: Bandwidth | None, e: BudgetTooSmall) -> tuple:
        """The smallest budget that plans with copy bandwidth ``bw``, its detail, and (with an
        arena) the plan reaching it with its arena: the solver sized the arena with the
        storages' smallest bound, and placing it (alignment, fragmentation) sets the budget."""
        smallest, lowest = _agreed_smallest(rpaths, storage_keys, e.smallest, time_limit, bans[bw], bw)
        if not arena or lowest is None:
            return smallest, e.detail, None
        placed = _place(rpaths, storage_keys, lowest[0], placeable)
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
    return _budget_schedule(budget, rpaths, preps, plans, drop_at, moved_at, arena_plan, bound)


def _budget_schedule(budget, rpaths, preps, plans, drop_at, moved_at, arena_plan, bound) -> Schedule:
    after: dict[Site, list[AfterOp]] = {}
    drops: dict[Site, list[AfterOp]] = {}
    parked, host_bytes = set(), 0
    for key, ((offload_at, wait_at, prefetch_at), nbytes) in ((k, next(iter(v))) for k, v in moved_at.items()):
        parked.add(key)
        size = -(-nbytes // 512) * 512  # slices aligned for fast copies
        after.setdefault(offload_at, []).append(Offload(key, host_bytes, size))
        after.setdefault(wait_at, []).append(WaitOffload(key))
        after.setdefault(prefetch_at, []).append(Prefetch(key))
        host_bytes += size
    for key, (site,) in drop_at.items():
        drops.setdefault(site, []).append(Drop(key))
    for site, ds in drops.items():  # moves first, then drops (as the executor expects them)
        after.setdefault(site, []).extend(ds)
    path_plans = []
    for i, (rp, pr, plan) in enumerate(zip(rpaths, preps, plans)):
        eager = replay(pr.g, list(range(len(pr.g))), check_order=False).peak
        path_plans.append(
            PathPlan(
                len(rp.order), 0, eager, bound if bound is not None else plan.peak,
                arena_plan.paths[i] if arena_plan is not None else 0, plan.predicted_seconds,
                len(plan.dropped), len(plan.offloaded), plan.extra_seconds, plan.stall_seconds,
            )
        )  # fmt: skip
    return Schedule(
        offsets=dict(arena_plan.offsets) if arena_plan is not None else {},
        arena_bytes=arena_plan.arena_bytes if arena_plan is not None else 0,
        arena_live=arena_plan.local_peak if arena_plan is not None else 0,
        paths=tuple(path_plans),
        signatures={pr.sites: i for i, pr in enumerate(preps)},
        budget=budget,
        recompute=frozenset(drop_at),
        after={site: tuple(ops) for site, ops in after.items()},
        parked=frozenset(parked),
        host_bytes=host_bytes,
        methods=tuple(sorted({p.method for p in plans})),
    )


def _place(paths: list[RematPath], storage_keys: list[dict], plans: list[RematPlan], placeable: list):
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
        drop_at: dict[Hashable, set] = {}  # storage key -> sites after which paths drop it
        owner: dict[Hashable, Hashable] = {}  # storage key -> key of the decision about it
        moved_at: dict[Hashable, set] = {}  # storage key -> (after which sites it moves, size)s
        for path, skeys, plan in zip(paths, storage_keys, plans):
            for c in plan.dropped:
                for sid in c.storages:
                    owner[skeys[sid]] = path.key(c.op)
            for sid, early_end in plan.freed_after().items():
                drop_at.setdefault(skeys[sid], set()).add(path.key(path.order[early_end]))
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
    path gets the same time for the same node. (The graphs are the prepared ones, shared
    between plans: filled again the same way each time.)"""
    seconds: dict = {}
    nbytes: dict = {}
    for p, skeys, t in zip(paths, storage_keys, traces):
        if t.computed:
            for op, site in zip(p.g.ops, p.keys):
                seconds.setdefault(site.node, op.seconds)
            for sid, key in skeys.items():
                k = (key.node, key.output)
                nbytes[k] = max(nbytes.get(k, 0), p.g.storages[sid].nbytes)
    for p, skeys, t in zip(paths, storage_keys, traces):
        # one time per op for every path (the first traced one), so that timing noise cannot
        # make paths disagree on where an offloaded storage's copies land
        for op, site in zip(p.g.ops, p.keys):
            op.seconds = seconds.get(site.node, 0.0)
        if not t.computed:
            for sid, key in skeys.items():
                s = p.g.storages[sid]
                s.nbytes = max(s.nbytes, nbytes.get((key.node, key.output), 0))


def _with_seconds(s: Schedule, seconds: float) -> Schedule:
    return replace(s, planning_seconds=seconds)


__all__ = ["InvalidPlan", "PathInput", "Settings", "plan_program"]
