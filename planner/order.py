"""Choosing the operator order that minimises the peak of live bytes (OLLA §3.2, §4).

* :func:`greedy_order`: list scheduling that runs, among the ready ops, the one that leaves the
  fewest live bytes (ties: the eager order). Fast, always valid; the fallback and warm start.
  It applies each weight update as soon as it can, since that frees a gradient (OLLA §4.3).
* :func:`optimal_order`: OLLA's lifetime problem (equations 1-5, peak of equation 13,
  objective 14) as a constraint program for OR-Tools CP-SAT: one op per timestep, each op's
  start within [ASAP, ALAP] = [#ancestors, n-1-#descendants] (§4.1), precedence (§4.2), each
  storage an interval from its producer to its last use (its maximum useful lifetime, forced
  resident in between: eqs. 11-12), a cumulative constraint whose capacity is the peak.
  Warm-started with the best known order, time-limited, never worse than it; reports its gap.

Why CP-SAT and not a MIP solver on OLLA's time-indexed ILP: measured on the zoo's MLP training
graph (90 ops), HiGHS (highspy) found no better order and kept a 99.8% gap after 30 s, and gave
no bound at all past ~300 ops; CP-SAT proved the optimum in 5 s and runs within its limit up to
ResNet-50's 1215 ops. (The two also cannot share a process: OR-Tools bundles its own HiGHS.)
"""

from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass

from collections.abc import Mapping, Sequence

from .graph import ESCAPING, LOCAL, PERSISTENT, OpNode, PlanningGraph, Storage
from .simulate import replay


# a block keeps the issue order (the executor then runs its ops as they are issued, beside the
# skeleton) unless a planned order saves more than this share of its peak: MobileNetV2 at batch
# 32 saves 0.28% and, reordered from its first op, ran 36% slower (bench/planned_memory.py)
STREAM_SLACK = 0.01


@dataclass
class OrderResult:
    order: list[int]
    peak: int  # exact peak of the order (simulator)
    method: str  # "eager", "greedy", "cp-sat" (proven optimal), "cp-sat-timeout"
    seconds: float = 0.0
    gap: float | None = None  # relative gap of the solver (0: proven optimal)
    bound: int | None = None  # the solver's lower bound on the peak


def _retire(g: PlanningGraph, v: int, remaining: dict, indeg: list[int]) -> list[int]:
    """Op ``v`` is scheduled: one use fewer left of each storage it reads; the ops it made
    ready."""
    storages = g.storages
    for x in g.ops[v].uses:
        if storages[x].producer != v and x in remaining:
            remaining[x] -= 1
    now = []
    for w in g.succs[v]:
        indeg[w] -= 1
        if indeg[w] == 0:
            now.append(w)
    return now


def greedy_order(g: PlanningGraph) -> list[int]:
    n = len(g.ops)
    indeg = [len(p) for p in g.preds]
    remaining = {sid: len(set(s.uses) - {s.producer}) for sid, s in g.storages.items()}
    ready = [v for v in range(n) if indeg[v] == 0]
    order: list[int] = []
    storages = g.storages

    def net(v: int, used: int = -1) -> int:
        """The live bytes op ``v`` adds (``used``: an op run just before it, which has read
        what they share)."""
        node = g.ops[v]
        alloc = sum(storages[s].nbytes for s in node.allocates)
        freed = 0
        shared = g.ops[used].uses if used >= 0 else ()
        for s in node.uses:
            st = storages[s]
            if st.kind == PERSISTENT or st.kind == ESCAPING or st.producer == v:
                continue
            if remaining[s] - (s in shared and st.producer != used) == 1:
                freed += st.nbytes
        # storages whose only use is the producer die at once
        freed += sum(storages[s].nbytes for s in node.allocates if remaining[s] == 0 and storages[s].kind != ESCAPING)
        return alloc - freed

    while ready:
        nets = {v: net(v) for v in ready}
        # an op that changes nothing (an in-place update of optimizer state) goes ahead of the
        # issue order only where it readies an op that frees bytes (a weight update after its
        # gradient): else it would run early for nothing, before the skeleton has issued it
        floor = min((x for x in nets.values() if x > 0), default=0)  # the cheapest op that adds
        for v, x in nets.items():
            if x == 0:
                gain = min((net(w, v) for w in g.succs[v] if indeg[w] == 1), default=0)
                nets[v] = gain if gain < 0 else floor
        best = min(ready, key=lambda v: (nets[v], v))
        ready.remove(best)
        order.append(best)
        ready.extend(_retire(g, best, remaining, indeg))
    if len(order) != n:
        raise ValueError("the planning graph has a cycle")
    return order


def topological(g: PlanningGraph) -> list[int]:
    """A topological order of ``g``: the issue order when every edge goes forward in it (a
    graph from a trace), else Kahn's."""
    n = len(g.ops)
    if all(u < v for v, ps in enumerate(g.preds) for u in ps):
        return list(range(n))
    indeg = [len(ps) for ps in g.preds]
    stack = [v for v in range(n) if indeg[v] == 0]
    topo = []
    while stack:
        v = stack.pop()
        topo.append(v)
        for w in g.succs[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                stack.append(w)
    if len(topo) != n:
        raise ValueError("the planning graph has a cycle")
    return topo


def issue_order_within(g: PlanningGraph, cap: int, prefix: int = 0) -> list[int]:
    """List scheduling that runs the earliest-issued ready op while the live bytes stay within
    ``cap`` (persistent state apart; the first ``prefix`` ops of the issue order always), and
    otherwise the ready op that leaves the fewest live bytes (:func:`greedy_order`'s choice).
    Orders of the same peak differ in how long they keep to the issue order, and the executor
    runs a block's ops ahead of its launch only where the plan has them in issue order. The
    caller checks the peak (the cap may be missed where the issue order ran into a corner)."""
    n = len(g.ops)
    storages = g.storages
    indeg = [len(p) for p in g.preds]
    remaining = {sid: len(set(st.uses) - {st.producer}) for sid, st in storages.items()}
    ready = [v for v in range(n) if indeg[v] == 0]
    heapq.heapify(ready)
    live = 0
    order: list[int] = []

    def effect(v: int) -> tuple[int, int]:
        node = g.ops[v]
        alloc = sum(storages[x].nbytes for x in node.allocates if storages[x].kind != PERSISTENT)
        freed = 0
        for x in node.uses:
            st = storages[x]
            if st.kind in (PERSISTENT, ESCAPING) or st.producer == v:
                continue
            if remaining[x] == 1:
                freed += st.nbytes
        freed += sum(
            storages[x].nbytes for x in node.allocates if remaining[x] == 0 and storages[x].kind == LOCAL
        )
        return alloc, freed

    while ready:
        v = ready[0]
        alloc, freed = effect(v)
        if v >= prefix and live + alloc > cap:  # the issue order would go over: free memory first
            best_key = None
            for u in ready:
                a, f = effect(u)
                if best_key is None or (a - f, u) < best_key:
                    v, best_key, alloc, freed = u, (a - f, u), a, f
            ready.remove(v)
            heapq.heapify(ready)
        else:
            heapq.heappop(ready)
        live += alloc - freed
        order.append(v)
        for w in _retire(g, v, remaining, indeg):
            heapq.heappush(ready, w)
    if len(order) != n:
        raise ValueError("the planning graph has a cycle")
    return order


def streamed(order: Sequence[int], window: int = 16) -> int:
    """How many ops of ``order`` the executor can run within ``window`` ops of their issue,
    that is, without waiting for the skeleton to issue far ahead."""
    reach, count = -1, 0
    for p, v in enumerate(order):
        reach = max(reach, v)
        count += reach - p < window
    return count


def lazy_order(g: PlanningGraph, peak: int, peak_of) -> list[int] | None:
    """An order of peak at most ``peak`` (``peak_of(order)``, persistent state included) that
    keeps to the issue order as long as it can: the issue order within that many live bytes,
    else the issue order for as long a prefix as leaves the greedy order to reach the peak
    (found by bisection); the one that streams more. None if neither reaches the peak."""
    cap = peak - g.persistent_bytes
    found = []
    within = issue_order_within(g, cap)
    if peak_of(within) <= peak:
        found.append(within)
    lo, hi, best = 0, len(g.ops), None  # the longest issue-order prefix that still reaches it
    while lo <= hi:
        mid = (lo + hi) // 2
        order = issue_order_within(g, cap, prefix=mid) if mid else greedy_order(g)
        if peak_of(order) <= peak:
            best, lo = order, mid + 1
        else:
            hi = mid - 1
    if best is not None:
        found.append(best)
    return max(found, key=streamed, default=None)


def _ancestor_counts(g: PlanningGraph) -> tuple[list[int], list[int]]:
    """Number of ancestors and of descendants of every op (bitsets as Python ints)."""
    n = len(g.ops)
    topo = topological(g)
    anc = [0] * n
    for v in topo:
        m = 0
        for u in g.preds[v]:
            m |= anc[u] | (1 << u)
        anc[v] = m
    desc = [0] * n
    for v in reversed(topo):
        m = 0
        for w in g.succs[v]:
            m |= desc[w] | (1 << w)
        desc[v] = m
    return [a.bit_count() for a in anc], [d.bit_count() for d in desc]


def optimal_order(
    g: PlanningGraph, time_limit: float = 30.0, warm: list[int] | None = None, workers: int = 2
) -> OrderResult:
    """The same problem for OR-Tools CP-SAT: a start time per op (one op per step, within
    [ASAP, ALAP]), precedence, each storage an interval from its producer to its last use, and
    a cumulative constraint whose capacity, the peak, is minimised. Warm-started by a hint."""
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    n = len(g.ops)
    if warm is None:
        warm = min((list(range(n)), greedy_order(g)), key=lambda o: replay(g, o).peak)
    warm_peak = replay(g, warm).peak
    n_anc, n_desc = _ancestor_counts(g)
    m = cp_model.CpModel()
    s = [m.NewIntVar(n_anc[v], n - 1 - n_desc[v], f"s{v}") for v in range(n)]
    m.AddAllDifferent(s)
    for v in range(n):
        for u in g.preds[v]:
            m.Add(s[u] < s[v])
    planned = [st for st in g.storages.values() if st.kind != PERSISTENT and st.nbytes > 0]
    intervals, demands = [], []
    dynamic = 0
    for st in planned:
        start = s[st.producer]
        users = sorted(set(st.uses) - {st.producer})
        if st.kind == ESCAPING:
            end = n
        elif not users:
            end = start + 1
        else:
            end_var = m.NewIntVar(0, n, f"e{st.sid}")
            m.AddMaxEquality(end_var, [s[w] + 1 for w in users])
            end = end_var
        size = m.NewIntVar(1, n, f"d{st.sid}")
        m.Add(size == end - start)
        intervals.append(m.NewIntervalVar(start, size, end, f"i{st.sid}"))
        demands.append(st.nbytes)
        dynamic += st.nbytes
    cap = m.NewIntVar(0, dynamic, "peak")
    m.AddCumulative(intervals, demands, cap)
    m.Minimize(cap)
    pos = {v: i for i, v in enumerate(warm)}
    for v in range(n):
        m.AddHint(s[v], pos[v])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = workers
    status = solver.Solve(m)
    seconds = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return OrderResult(warm, warm_peak, "greedy", seconds)
    order = sorted(range(n), key=lambda v: solver.Value(s[v]))
    found = replay(g, order).peak
    bound = int(solver.BestObjectiveBound()) + g.persistent_bytes
    obj = solver.ObjectiveValue()
    gap = (obj - solver.BestObjectiveBound()) / obj if obj else 0.0
    method = "cp-sat" if status == cp_model.OPTIMAL else "cp-sat-timeout"
    if found > warm_peak:
        return OrderResult(warm, warm_peak, method, seconds, gap, bound)
    return OrderResult(order, found, method, seconds, gap, bound)


def block_order(
    g: PlanningGraph,
    forced: Mapping[int, Sequence[int]] | None = None,
    time_limit: float = 0.0,
    max_solver_ops: int = 1500,
    lazy: bool = True,
) -> OrderResult:
    """The order that minimises the peak when the path runs block by block
    (``g.execution.blocks``): every block of ``g.block_starts`` stays contiguous, and a storage
    Python let go of in a later block than its last use is held until that block starts.
    ``forced``: block index -> the order of its ops (offsets in the block) to keep, decided on
    another path with the same block; it must be valid here (:func:`valid_block_order`).

    Solved on a copy of ``g`` with a *barrier* op between consecutive blocks (after every op of
    the block before it, before every op of the block after it; it uses the storages held until
    the next block starts), so :func:`greedy_order` and :func:`optimal_order` see the blocks
    without knowing of them; CP-SAT runs only with a ``time_limit`` and up to
    ``max_solver_ops`` ops. With ``lazy``, the issue order where no order saves more than
    :data:`STREAM_SLACK` of the peak, and among orders of the same peak one that keeps to the
    issue order longer (:func:`lazy_order`). Never worse than the forced blocks' orders with
    the issue order elsewhere."""
    t0 = time.perf_counter()
    forced = forced or {}
    n = len(g)
    # the baseline: the forced blocks in their orders, every other block in the issue order
    issue = [b.start + k for i, b in enumerate(g.blocks()) for k in forced.get(i, range(len(b)))]
    issue_peak = replay(g, issue, check_order=False).peak
    if n < 2:
        return OrderResult(issue, issue_peak, "eager", time.perf_counter() - t0)
    gb, real = _with_barriers(g, forced)

    def real_order(order: list[int]) -> list[int]:
        return [real[v] for v in order if real[v] is not None]

    def peak_of(order: list[int]) -> int:
        return replay(g, real_order(order), check_order=False).peak

    best = greedy_order(gb)
    method, gap = "greedy", None
    if time_limit > 0 and len(gb) <= max_solver_ops:
        found = optimal_order(gb, time_limit=time_limit, warm=best, workers=1)
        best, method, gap = found.order, found.method, found.gap
    # among the orders of that peak, one that keeps to the issue order longer (executed
    # ahead of its block's launch: docs/coexec.md, "Blocks")
    if lazy:
        if issue_peak <= (1 + STREAM_SLACK) * peak_of(best):  # not worth leaving the issue order
            return OrderResult(issue, issue_peak, "eager", time.perf_counter() - t0)
        kept = lazy_order(gb, peak_of(best), peak_of)
        if kept is not None and streamed(real_order(kept)) > streamed(real_order(best)):
            best, method = kept, f"{method}, lazy"
    order = real_order(best)
    peak = replay(g, order).peak
    if peak > issue_peak:
        return OrderResult(issue, issue_peak, "eager", time.perf_counter() - t0)
    return OrderResult(order, peak, method, time.perf_counter() - t0, gap)


def valid_block_order(g: PlanningGraph, block: range, order: Sequence[int]) -> bool:
    """Is ``order`` (offsets into ``block``) a permutation of the block's ops that respects
    every edge between them?"""
    if sorted(order) != list(range(len(block))):
        return False
    pos = {block.start + k: i for i, k in enumerate(order)}
    return all(pos[u] < pos[v] for v in block for u in g.preds[v] if u in pos)


def _with_barriers(g: PlanningGraph, forced: Mapping[int, Sequence[int]]) -> tuple[PlanningGraph, list]:
    """``g`` with a barrier op after each block but the last, renumbered so that the issue
    order stays topological; and, per new op, the op of ``g`` it is (None: a barrier)."""
    blocks = g.blocks()
    new_of = [0] * len(g)
    real: list[int | None] = []
    barrier_of: list[int] = []  # block index -> its barrier's new index (after it)
    for k, block in enumerate(blocks):
        for v in block:
            new_of[v] = len(real)
            real.append(v)
        if k < len(blocks) - 1:
            barrier_of.append(len(real))
            real.append(None)
    ops = [OpNode(i, g.ops[v].name if v is not None else "barrier", g.ops[v].seconds if v is not None else 0.0) for i, v in enumerate(real)]
    preds: list[set[int]] = [set() for _ in real]
    for v, ps in enumerate(g.preds):
        preds[new_of[v]] = {new_of[u] for u in ps}
    for k, block in enumerate(blocks):
        inside = set(block)
        if k < len(blocks) - 1:  # every op of the block before the barrier
            b = barrier_of[k]
            preds[b].update(new_of[v] for v in block if not (g.succs[v] & inside))
        if k > 0:  # the barrier before every op of the block
            for v in block:
                if not (g.preds[v] & inside):
                    preds[new_of[v]].add(barrier_of[k - 1])
        chain = forced.get(k)
        if chain is not None:
            for a, b in zip(chain, chain[1:]):
                preds[new_of[block.start + b]].add(new_of[block.start + a])
    starts = g.block_starts
    storages: dict[int, Storage] = {}
    for sid, s in g.storages.items():
        uses = [new_of[u] for u in s.uses]
        kind = s.kind
        if s.kind == LOCAL and s.release is not None and s.producer is not None:
            # freed when the block Python let go of it in starts, if that is after its uses
            k_release = bisect.bisect_right(starts, min(s.release, len(g) - 1)) - 1
            k_used = bisect.bisect_right(starts, max(s.uses, default=s.producer)) - 1
            if k_release > k_used:
                uses.append(barrier_of[k_release - 1])
        producer = new_of[s.producer] if s.producer is not None else None
        storages[sid] = Storage(sid, s.nbytes, kind, producer, sorted(set(uses)))
    for s in storages.values():
        for u in s.uses:
            ops[u].uses.append(s.sid)
        if s.producer is not None:
            ops[s.producer].allocates.append(s.sid)
    return PlanningGraph(ops, storages, preds), real
