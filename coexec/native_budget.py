"""Memory plans on the native backend: a described step (``executor/capture.py``,
:class:`~executor.step_plans.StepDescription`) planned into a
:class:`~executor.step_plans.DropPlan` the capture's worker follows on the steps after it: under
a budget by the planner's recomputation and offloading (:func:`planner.plan_remat`); with
``arena=True`` by placing its storages in one arena (:func:`planner.plan_arena`), under a budget
those the budget's plan neither drops nor parks, the arena counted whole in the budget.

The worker drops a value after the op the plan names and makes it again from its kept producer
when it is next read (``native/capture_worker.h``), and puts a planned storage in the arena only
where its bytes are free (``native/arena.h``), so a plan decides when and where memory is held,
never a value: a step on another path stops following it, and a value read early is made early.
Planned in issue order: the native backend runs ops as the skeleton issues them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

from executor.step_plans import DropPlan, Park, Placed, StepDescription
from planner import (
    Access,
    Bandwidth,
    BudgetTooSmall,
    PlanningGraph,
    RematPlan,
    StorageFacts,
    plan_remat,
    replay,
)
from planner.arena import plan_arena, select_placed
from planner.graph import LOCAL
from planner.remat import RematPath, plan_remat_paths
from planner.remat.paths import split_peaks


@dataclass(frozen=True)
class NativeBudgetPlan:
    """A described step's memory plan and what the planner predicts of it."""

    drops: DropPlan
    budget: int | None  # (None: an arena alone)
    eager_peak: int  # bytes the described step held at its peak (the issue order, nothing dropped)
    planned_peak: int  # with the plan
    persistent_bytes: int  # of both: the storages that existed before the step
    recomputed: int  # ops made again
    extra_seconds: float  # their time
    predicted_seconds: float  # the step's ops as the described step timed them, with the recomputation
    method: str  # how the plan was found (planner.RematPlan.method)
    planning_seconds: float
    offloaded: int = 0  # storages parked in the host pool (offload=True)
    arena_bytes: int = 0  # the arena (arena=True), held whole: in planned_peak
    placed: int = 0  # storages planned in it


class NotPlannable(ValueError):
    """A described step the planner cannot take (it says why)."""


def planning_graph(d: StepDescription, other_state: int = 0) -> PlanningGraph:
    """The described step as the planner sees it: ops in issue order, storages with their bytes
    and how long the program held them (a value with no placeholder, an intermediate gradient of
    a gradient block, is held to its last use); ``other_state``: bytes of the program's state
    that this path's ops do not touch (other branches' parameters: :func:`other_states`), one
    persistent storage more.

    A value the program let go of with ``at`` ops issued is gone before op ``at`` runs in the
    steps a plan is for: under a plan or a guard the step's thread lets go of its slot at once
    (``t_shared_slots`` in native/capture.cpp), so it is freed then, or after its last queued
    reader (an op before ``at``). (Only a step with neither hands it to the worker with the op
    issued next. Planned as held through op ``at``, GPT-2's budgeted steps at batch 16 measured
    4-8% under their plans, and a convolution net's arena was two activations larger than its
    steps needed: its planned steps held 29% more than unplanned ones.)"""
    if [o.place for o in d.ops] != list(range(len(d.ops))):
        raise NotPlannable("the description misses ops (a step captured in another mode)")
    held: dict[int, int] = {}  # storage -> the last place the program held a value of it
    alive: set[int] = set()
    fetched: set[int] = set()
    for o in d.ops:
        for value, sid in o.values:
            if value in d.alive:
                alive.add(sid)
            if value in d.fetched:
                fetched.add(sid)
            # (let go of with `at` ops issued: gone before op `at` runs, see above; -1: at its
            # last use, a gradient block's)
            at = d.released.get(value, -1)
            if at >= 0:
                held[sid] = max(held.get(sid, -1), at - 1)
        if o.at_once:  # (its tensors are Python's, not placeholders: none may be dropped)
            fetched.update(o.reads)
            alive.update(o.makes)
    accesses = [
        Access(o.name, o.seconds, o.reads, o.writes, o.makes, o.random, o.at_once, o.workspace) for o in d.ops
    ]
    facts = [
        StorageFacts(nbytes, existed, held.get(sid), sid in alive, sid in fetched)
        for sid, (nbytes, existed) in enumerate(zip(d.storage_bytes, d.existed))
    ]
    if other_state > 0:
        facts.append(StorageFacts(other_state, True))
    return PlanningGraph.from_accesses(accesses, facts)


def other_states(ds: list[StepDescription]) -> list[int]:
    """Per described path, the bytes of the program's state that its ops do not touch but another
    path's write (by their storages' ids): the parameters, gradients and optimizer state of the
    branches it does not take, in memory all the same. (State no path writes, a frozen layer, or
    a batch made before the step, is not told apart from a batch: not counted.)"""
    state: dict[int, int] = {}
    touched: list[set[int]] = []
    for d in ds:
        ids = d.state_ids or (0,) * len(d.storage_bytes)
        for o in d.ops:
            for sid in o.writes:
                if ids[sid]:
                    state[ids[sid]] = d.storage_bytes[sid]
        touched.append({i for i in ids if i})
    return [sum(n for i, n in state.items() if i not in mine) for mine in touched]


def drop_places(plan: RematPlan) -> dict[int, list[int]]:
    """Per op (its place in the step), the storages of dropped ops to free right after it, as
    the default backend frees them (:meth:`planner.RematPlan.freed_after`: a convolution's
    weight gradient once detached into ``.grad``, its input gradient after the next add;
    freeing both after the later held the first 2 MB past a ResNet-50 plan, over its budget)."""
    places: dict[int, list[int]] = {}
    for sid, at in plan.freed_after().items():
        places.setdefault(plan.order[at], []).append(sid)
    return places


# Room a plan leaves below the budget for bytes the description does not see (small tensors
# made outside the ops it logs: 16 B a step for the MLP of tests/coexec/test_native_budget.py,
# 176 B for the zoo's resnet18, 944 B for its mobilenet_v2), so that the guard beside a plan
# whose peak is the budget has nothing to drop (it dropped values the plan kept, whose remakes
# took that MLP's step 6% over: 820808 B for a budget of 771128 B).
UNSEEN_BYTES = 4096


def parks(plan: RematPlan, values_of: dict[int, list[int]]) -> tuple[Park, ...]:
    """The plan's offloaded storages as the worker parks them, by place: each copied out and
    released after the op at its ``released`` position, copied back before the op at its
    ``prefetch`` (so its device bytes are the plan's), each in its own slice of the host pool.
    The worker copies on its own thread, so the copies' time is not hidden behind the compute
    as the planner's prediction assumes."""
    out, offset = [], 0
    for o in sorted(plan.offloaded, key=lambda o: (o.released, o.sid)):
        values = tuple(values_of.get(o.sid, ()))
        if not values:
            continue  # (no placeholder holds it: nothing the worker could park)
        out.append(Park(values, plan.order[o.released], plan.order[o.prefetch - 1], offset, o.nbytes))
        offset += o.nbytes
    return tuple(out)


def plan_native_budget(
    d: StepDescription,
    budget: int,
    time_limit: float = 10.0,
    bandwidth: Bandwidth | None = None,
    arena: bool = False,
    other_state: int = 0,
) -> NativeBudgetPlan:
    """The plan that keeps the described step's path within ``budget`` bytes (persistent state
    included, UNSEEN_BYTES left free) at the least recomputation; with ``bandwidth`` (the host
    copy channel's, offload=True), storages may be parked in the host pool instead of
    recomputed; with ``arena``, the storages it neither drops nor parks are placed in one arena
    (:func:`arena_placements`), the arena counted whole in the budget. Raises
    :class:`planner.BudgetTooSmall` naming the smallest budget a plan meets. ``other_state``: as
    :func:`planning_graph`'s (counted in the plan's state and peaks)."""
    t0 = time.perf_counter()
    g = planning_graph(d, other_state)
    random = {j for j, o in enumerate(d.ops) if o.random}  # (the worker does not replay generators)
    limit = budget - UNSEEN_BYTES
    try:
        plan: RematPlan = plan_remat(g, limit, time_limit=time_limit, banned=random, bandwidth=bandwidth)
    except BudgetTooSmall as e:
        raise BudgetTooSmall(budget, e.smallest + UNSEEN_BYTES, e.detail) from None
    placed, arena_bytes, planned_peak = (), 0, plan.peak
    if arena:
        plan, found = _with_arena(d, g, plan, limit, time_limit, random, bandwidth)
        placed, arena_bytes, planned_peak = found.placed, found.arena_bytes, found.planned_peak
    return _native_plan(d, g, plan, budget, planned_peak, time.perf_counter() - t0, arena_bytes, placed)


def _native_plan(
    d: StepDescription,
    g: PlanningGraph,
    plan: RematPlan,
    budget: int,
    planned_peak: int,
    planning_seconds: float,
    arena_bytes: int = 0,
    placed: tuple[Placed, ...] = (),
) -> NativeBudgetPlan:
    """``plan`` for the described step as the worker follows it (its values, by number)."""
    values_of: dict[int, list[int]] = {}
    value_bytes: dict[int, int] = {}  # (the plan's sizes: a step that makes a larger value stops following it)
    for o in d.ops:
        for value, sid in o.values:
            values_of.setdefault(sid, []).append(value)
            value_bytes[value] = d.storage_bytes[sid]
    keep: set[int] = set()
    after: dict[int, list[int]] = {}
    for place, sids in drop_places(plan).items():
        values = [v for sid in sids for v in values_of.get(sid, ())]
        keep.update(values)
        after.setdefault(place, []).extend(values)
    drops = DropPlan(
        path_ops(d),
        frozenset(keep),
        {place: tuple(vs) for place, vs in after.items()},
        tuple(value_bytes.get(v, 0) for v in range(1 + max(value_bytes, default=-1))),
        parks(plan, values_of),
        arena_bytes,
        placed,
    )
    base = replay(g, plan.order, check_order=False)
    return NativeBudgetPlan(
        drops, budget, base.peak, planned_peak, g.persistent_bytes, len(plan.dropped),
        plan.extra_seconds, plan.predicted_seconds, plan.method, planning_seconds, len(drops.parks),
        arena_bytes, len(placed),
    )  # fmt: skip


def path_ops(d: StepDescription) -> tuple[int, ...]:
    """The described step's path as a plan names it: per place the op id the worker expects
    there (0: an op that ran at once on the step's thread)."""
    return tuple(0 if o.at_once else o.op_id for o in d.ops)


def path_keys(ds: list[StepDescription]) -> list[list[int]]:
    """Per described step (a path), per op, a key that names the same op on every path: ops
    with the same ops before them, each making storages of the same bytes, share it (the paths'
    common prefix, up to where a branch sends them apart). A plan's decision on a key holds on
    every path that has it (:func:`planner.plan_remat_paths`), so a step that leaves one path's
    plan for another's at a branch has done what the other planned before it."""
    interned: dict[tuple, int] = {}
    out = []
    for d in ds:
        keys, at = [], -1
        for o in d.ops:
            made = tuple(d.storage_bytes[sid] for sid in o.makes)
            at = interned.setdefault((at, 0 if o.at_once else o.op_id, made), len(interned))
            keys.append(at)
        out.append(keys)
    return out


@dataclass(frozen=True)
class PathsToPlan:
    """A program's paths to plan together (their described steps, :func:`plan_native_paths`),
    and those of its paths no plan can hold, whose state counts beside the others'."""

    planned: list[StepDescription]
    state_only: list[StepDescription]


def plan_native_paths(
    ds: list[StepDescription],
    budget: int,
    time_limit: float = 10.0,
    bandwidth: Bandwidth | None = None,
    state_of: list[StepDescription] | tuple[StepDescription, ...] = (),
) -> list[NativeBudgetPlan | BudgetTooSmall]:
    """Plans for the described steps of a program's paths (one per path, by their ops), made
    together so that they agree where the paths share ops (:func:`path_keys`): per path its plan,
    or the :class:`planner.BudgetTooSmall` of a path no plan can hold alone (the others are then
    planned together without it; where even they cannot be, each alone, agreeing with none).
    Each path's plan counts the state the other paths write beside its own (:func:`other_states`;
    ``state_of``: more paths whose state counts, not planned)."""
    t0 = time.perf_counter()
    others = other_states([*ds, *state_of])[: len(ds)]
    graphs = [planning_graph(d, other) for d, other in zip(ds, others)]
    try:
        plans = _plan_together(ds, graphs, budget, time_limit, bandwidth)
    except BudgetTooSmall:
        alone: list[NativeBudgetPlan | BudgetTooSmall] = []
        for d, other in zip(ds, others):
            try:
                alone.append(plan_native_budget(d, budget, time_limit / len(ds), bandwidth, other_state=other))
            except BudgetTooSmall as e:
                alone.append(e)
        held = [j for j, r in enumerate(alone) if not isinstance(r, BudgetTooSmall)]
        if len(held) < 2 or len(held) == len(ds):
            return alone
        try:
            together = _plan_together([ds[j] for j in held], [graphs[j] for j in held], budget, time_limit, bandwidth)
        except BudgetTooSmall:
            return alone
        spent = time.perf_counter() - t0
        for j, p in zip(held, together):
            alone[j] = _native_plan(ds[j], graphs[j], p, budget, p.peak, spent)
        return alone
    spent = time.perf_counter() - t0
    return [_native_plan(d, g, p, budget, p.peak, spent) for d, g, p in zip(ds, graphs, plans)]


def _plan_together(
    ds: list[StepDescription], graphs: list[PlanningGraph], budget: int, time_limit: float, bandwidth: Bandwidth | None
) -> list:
    """:func:`planner.plan_remat_paths` over the described paths, keyed by :func:`path_keys`."""
    keys = path_keys(ds)
    banned = {k[j] for d, k in zip(ds, keys) for j, o in enumerate(d.ops) if o.random}
    paths = [RematPath(g, list(range(len(g))), k) for g, k in zip(graphs, keys)]
    return plan_remat_paths(paths, budget - UNSEEN_BYTES, time_limit, banned, bandwidth)


class ArenaPlacements(NamedTuple):
    """Where a described step's storages go in one arena (:func:`arena_placements`)."""

    placed: tuple[Placed, ...]  # the storages given a region, by the op that allocates them
    arena_bytes: int
    planned_peak: int  # the step's peak with the arena held whole


# Plans made again at a lower budget when the arena, held whole, takes a budget's plan over it
# (what placement adds, twice, taken off each time); after these, the plan has no arena.
ARENA_ROUNDS = 3


def _with_arena(
    d: StepDescription,
    g: PlanningGraph,
    plan: RematPlan,
    limit: int,
    time_limit: float,
    banned: set[int],
    bandwidth: Bandwidth | None,
) -> tuple[RematPlan, ArenaPlacements]:
    """``plan`` (or one made to a lower budget) with its arena, whose planned peak is within
    ``limit``: the arena is held whole beside the storages outside it, so placing may add to
    the plan's peak (two peaks at different places); where no plan's does fit, the first plan
    without an arena (the budget comes first)."""
    target = limit
    candidate = plan
    for _ in range(ARENA_ROUNDS):
        found = arena_placements(d, g, candidate, limit=limit)
        if found.planned_peak <= limit:
            return candidate, found
        target -= 2 * (found.planned_peak - limit)
        try:
            candidate = plan_remat(g, target, time_limit=time_limit, banned=banned, bandwidth=bandwidth)
        except BudgetTooSmall:
            break
    return plan, ArenaPlacements((), 0, plan.peak)


def arena_placements(
    d: StepDescription,
    g: PlanningGraph,
    plan: RematPlan | None = None,
    optimize_seconds: float = 0.0,
    limit: int | None = None,
) -> ArenaPlacements:
    """The described step's storages placed in one arena over their lifetimes in issue order
    (under ``plan``, a budget's: as it frees them): the placements, the arena's bytes, and the
    step's planned peak with the arena held whole (persistent state, the arena, and at their
    most the storages outside it with the ops' workspace). Placed: local storages (made and let
    go of within the step) that an op on the worker allocated, resident in one stretch (not made
    again or parked: the worker places an op's own allocations, not a remake's or a copy's),
    where holding the arena whole does not raise the step's peak
    (:func:`planner.arena.select_placed`), or (``limit``: a budget's) where it stays within
    ``limit``; every placement is checked by the simulator (:func:`planner.arena.plan_arena`)."""
    order = list(range(len(g)))
    segments = replay(g, order).segments if plan is None else plan.segments
    persistent = g.persistent_bytes
    maker: dict[int, int] = {}  # storage -> the place of the op that allocated it (on the worker)
    passed_over: dict[int, int] = {}  # storage -> allocations of its bytes its op made before it
    for o in d.ops:
        if o.at_once:
            continue
        sizes = [d.storage_bytes[sid] for sid in o.makes]
        passed_over.update(zip(o.makes, o.made_after))
        for sid in o.makes:
            # (an allocation is matched to its region by its bytes alone: of two storages of one
            # op with the same bytes, either may take the other's region, and one that lives
            # longer than planned there keeps every region over it from being used)
            if sizes.count(d.storage_bytes[sid]) == 1:
                maker.setdefault(sid, o.place)
    keys = {
        sid: sid for sid, s in g.storages.items()
        if s.kind == LOCAL and s.nbytes > 0 and sid in maker and len(segments.get(sid, ())) == 1
    }  # fmt: skip
    chosen = select_placed([(g, keys, segments)], ceiling=limit)
    _inside, outside = split_peaks(g, order, segments, frozenset(chosen))
    if not chosen:
        return ArenaPlacements((), 0, persistent + outside)
    # (under a plan, each storage's stretch as the plan frees it; else from its op to its last use)
    stretches = None if plan is None else [{sid: segments[sid] for sid in chosen}]
    arena = plan_arena([(g, {sid: sid for sid in chosen})], optimize_seconds=optimize_seconds, stretches=stretches)
    placed = tuple(sorted(
        Placed(maker[sid], g.storages[sid].nbytes, arena.offsets[sid], passed_over.get(sid, 0)) for sid in chosen
    ))  # fmt: skip
    return ArenaPlacements(placed, arena.arena_bytes, persistent + arena.arena_bytes + outside)


def plan_native_arena(d: StepDescription, optimize_seconds: float = 5.0) -> NativeBudgetPlan:
    """The plan that puts the described step's storages in one arena (``arena=True`` without a
    memory budget): nothing dropped or parked; the worker runs the ops as issued and each
    placed storage's allocation takes its bytes of the arena (``native/arena.h``)."""
    t0 = time.perf_counter()
    g = planning_graph(d)
    base = replay(g, list(range(len(g))))
    found = arena_placements(d, g, optimize_seconds=optimize_seconds)
    placed, arena_bytes, planned_peak = found.placed, found.arena_bytes, found.planned_peak
    drops = DropPlan(
        path_ops(d), frozenset(), {}, arena_bytes=arena_bytes, placed=placed
    )
    seconds = sum(o.seconds for o in d.ops)
    return NativeBudgetPlan(
        drops, None, base.peak, planned_peak, g.persistent_bytes, 0, 0.0, seconds, "arena",
        time.perf_counter() - t0, 0, arena_bytes, len(placed),
    )  # fmt: skip


def plan_native(
    d: StepDescription, budget: int | None, bandwidth: Bandwidth | None = None, arena: bool = False
) -> NativeBudgetPlan:
    """The described step's plan: under ``budget`` (:func:`plan_native_budget`, with an arena
    if ``arena``), else its arena alone (:func:`plan_native_arena`; ``arena`` must then be set)."""
    if budget is not None:
        return plan_native_budget(d, budget, bandwidth=bandwidth, arena=arena)
    if not arena:
        raise ValueError("a native memory plan needs a memory budget or arena=True")
    return plan_native_arena(d)
