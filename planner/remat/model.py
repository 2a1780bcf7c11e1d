"""The CP-SAT model of memory budgets over every path of a step (see :mod:`planner.remat`).

One drop literal per op key and one offload literal per storage key; memory rows per path,
grouped by the set of decisions in play at each position (the residency pieces come from
:func:`planner.simulate.residency`, the simulator's own statement of the semantics, so the two
cannot disagree); the copy channel's capacity; chains of dropped readers capped when they grow
quadratically (exact within the cap).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ..candidates import Candidate, Cascade, remake_points
from ..offload import OffloadCandidate, channel_shares
from ..simulate import Term, residency, with_offloads
from .paths import OFFLOAD_COST, RematPath, cost, offload_key, sizer

# the model lists, per path, each pair (x, e) of a chain of dropped readers x <- ... <- e; the
# pairs grow with the square of the chains' reach. Past this many, a chain may reach at most
# MAX_CASCADE_PAIRS // candidates candidates ahead (at least MIN_SPAN), so the model grows
# linearly with the graph: a restriction (longer chains are forbidden), exact within it
MAX_CASCADE_PAIRS = 20_000
MIN_SPAN = 8
# memory rows list every storage in play at a position (the strongest form for the solver)
# while that takes at most this many terms in all; past it, a running sum per position
MAX_DENSE_TERMS = 300_000


class Model:
    """The CP-SAT model over all paths: one drop literal per op key and one offload literal per
    storage key, memory rows per path grouped by the decisions in play at each position, and
    the copy channel's capacity."""

    def __init__(self, paths: list[RematPath], per: list[list[Candidate]], offs: list[list[OffloadCandidate]] | None = None) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.model = cp_model.CpModel()
        offs = offs or [[] for _ in paths]
        self.drop: dict[Hashable, Any] = {}
        self.off: dict[Hashable, Any] = {}
        self.cost: dict[Hashable, int] = {}
        for p, cands, os in zip(paths, per, offs):
            for c in cands:
                k = p.key(c.op)
                if k not in self.drop:
                    self.drop[k] = self.model.NewBoolVar(f"drop{len(self.drop)}")
                self.cost[k] = max(self.cost.get(k, 0), cost(c))
            for o in os:
                k = offload_key(p, o)
                if k not in self.off:
                    self.off[k] = self.model.NewBoolVar(f"off{len(self.off)}")
                self.cost[k] = OFFLOAD_COST
        self._live: dict[tuple, Any] = {}
        self._reach: dict[tuple, Any] = {}  # (path, x, e) -> R: e's recomputation remakes x
        self._by: dict[tuple, Any] = {}  # (path, x, p) -> x is remade by position p (if dropped)
        self.cascades: list[Cascade] = []
        self.chain_span: int | None = None  # how far a chain of dropped readers may reach, if capped
        # (fixed bytes, the bytes decisions leave resident (a linear expression), their most,
        # and what they count: "all" storages, those "in" the arena, or those "out" of it)
        self.rows: list[tuple[int, Any, int, str]] = []
        self.arena: Any = None  # with an arena: its size, the most placed bytes at once
        self._channel: set = set()
        self._offs: list[dict[int, OffloadCandidate]] = []  # per path: sid -> candidate
        for i, (p, cands, os) in enumerate(zip(paths, per, offs)):
            self._add_path(i, p, cands, os)
        if any(kind == "in" for *_r, kind in self.rows):
            top = max(base + most for base, _l, most, kind in self.rows if kind == "in")
            self.arena = self.model.NewIntVar(0, top, "arena")

    def limit(self, limit: Any) -> None:
        """Every row within ``limit`` (bytes, or a variable): with an arena, the placed bytes
        within the arena's size and the rest beside the whole arena."""
        for base, level, most, kind in self.rows:
            if kind == "in":
                self.model.Add(base + level <= self.arena)
            elif kind == "out":
                self.model.Add(base + level + self.arena <= limit)
            elif not isinstance(limit, int) or base + most > limit:
                self.model.Add(base + level <= limit)

    @property
    def decisions(self) -> dict[Hashable, Any]:
        return {**self.drop, **self.off}

    def _add_path(self, i: int, p: RematPath, cands: list[Candidate], offs: list[OffloadCandidate]) -> None:
        g, order = p.g, p.order
        n = len(order)
        fixed = [g.ops[order[t]].workspace for t in range(n)]
        cascade = Cascade(cands, max(MIN_SPAN, MAX_CASCADE_PAIRS // max(1, len(cands))))
        self.cascades.append(cascade)
        if cascade.truncated:
            self._cap_chains(i, p, cands, cascade)
        self._offs.append({o.sid: o for o in offs})
        for o in offs:  # a parked storage is needed by nobody: not made again, not read
            off = self.off[offload_key(p, o)]
            if p.key(o.producer) in self.drop:
                self.model.AddBoolOr([off.Not(), self.drop[p.key(o.producer)].Not()])
            for c in cands:
                if o.sid not in c.inputs:
                    continue
                drop = self.drop[p.key(c.op)]
                if c.recompute_at in o.off:
                    self.model.AddBoolOr([off.Not(), drop.Not()])
                    continue
                for pe, e in cascade.points.get(c.op, ()):
                    if pe in o.off:  # c is made again there for a chain of dropped readers
                        self.model.Add(off + drop + self._reaches(i, p, c.op, e) <= 2)
        classes = {"all": (fixed, [], [0] * (n + 1))}
        if p.placed is not None:  # the arena's storages apart from the rest (workspace is out)
            classes = {"out": (fixed, [], [0] * (n + 1)), "in": ([0] * n, [], [0] * (n + 1))}
        size_of = sizer(g, p.placed)
        remaking: list[int] = []  # (a remake's temporary bytes, as pieces of negative ids: not storages)
        for c in cands:
            work = g.ops[c.op].workspace
            for at, term in remake_points(c, cascade) if work else ():
                remaking.append(work)
                piece = (-len(remaking), at, at + 1, self._lit(i, p, term))
                classes["all" if p.placed is None else "out"][1].append(piece)
        if remaking:
            size_of = _with_remaking(size_of, remaking)
        for sid, a, b, ts in with_offloads(residency(g, order, cands, cascade), offs):
            size = size_of(sid)
            _fixed, pieces, delta = classes["all" if p.placed is None else "in" if sid in p.placed else "out"]
            if ts is None:
                delta[a] += size
                delta[b] -= size
            else:
                pieces.append((sid, a, b, self._resident(i, p, sid, tuple(sorted(ts, key=repr)))))
        for kind, (base, pieces, delta) in classes.items():
            run = 0
            for t in range(n):
                run += delta[t]
                base[t] += run
            if kind != "in":
                base = [g.persistent_bytes + f for f in base]
            if sum(b - a for _, a, b, _ in pieces) <= MAX_DENSE_TERMS:
                self._dense_rows(size_of, n, base, pieces, kind)
            else:
                self._running_rows(size_of, n, base, pieces, kind)
        by_sid = {o.sid: o for o in offs}
        for shares in channel_shares(g, order, offs):
            if len(shares) > 1 and sum(shares.values()) > 1:
                row = tuple(sorted((offload_key(p, by_sid[sid]), round(x * 1000)) for sid, x in shares.items()))
                if row not in self._channel:
                    self._channel.add(row)
                    self.model.Add(sum(w * self.off[k] for k, w in row) <= 1000)

    def _dense_rows(self, size_of: Callable, n: int, fixed: list[int], pieces: list, kind: str) -> None:
        """A row per set of storages in play: every literal of every storage resident there
        (rows repeat rarely; the solver propagates them best)."""
        at: list[dict[int, Any]] = [dict() for _ in range(n)]
        for sid, a, b, lit in pieces:
            for t in range(a, b):
                at[t][sid] = lit
        groups: dict[tuple, int] = {}
        for t in range(n):
            key = tuple(sorted((sid, lit.Index()) for sid, lit in at[t].items()))
            if key not in groups or groups[key][0] < fixed[t]:
                groups[key] = (fixed[t], at[t])
        for base, lits in groups.values():
            sizes = [(size_of(sid), lit) for sid, lit in lits.items()]
            self.rows.append((base, sum(size * lit for size, lit in sizes), sum(size for size, _ in sizes), kind))

    def _running_rows(self, size_of: Callable, n: int, fixed: list[int], pieces: list, kind: str) -> None:
        """The bytes in play as a running sum: a variable per position that adds the pieces
        starting there and takes off those that stop (linear in the graph, where a row listing
        every storage in play grows with its square)."""
        steps: list[dict[int, list]] = [dict() for _ in range(n + 1)]  # t -> literal -> [lit, bytes]
        in_play = [0] * (n + 1)
        for sid, a, b, lit in pieces:
            size = size_of(sid)
            in_play[a] += size
            in_play[b] -= size
            for t, sign in ((a, size), (b, -size)):
                steps[t].setdefault(lit.Index(), [lit, 0])[1] += sign
        level, most = None, 0  # the running sum's variable, and the most it can hold
        for t in range(n):
            most += in_play[t]
            change = [(size, lit) for lit, size in steps[t].values() if size]
            if change or level is None:
                var = self.model.NewIntVar(0, most, f"mem{t}")
                self.model.Add(var == (level if level is not None else 0) + sum(size * lit for size, lit in change))
                level = var
                self.rows.append((fixed[t], level, most, kind))
            else:  # the same variable bytes: one row, at the most fixed bytes
                base, _, was, _kind = self.rows[-1]
                self.rows[-1] = (max(base, fixed[t]), level, max(was, most), kind)

    def _cap_chains(self, i: int, p: RematPath, cands: list[Candidate], cascade: Cascade) -> None:
        """No chain of dropped readers reaching further than the cascade's span: ``far[x]``
        bounds the rank of the last candidate on a chain of dropped readers from ``x`` (over
        every reader, a superset of the chains that remake: sound)."""
        self.chain_span = cascade.span if self.chain_span is None else min(self.chain_span, cascade.span)
        rank = cascade.rank
        far = {c.op: self.model.NewIntVar(0, rank[c.op] + cascade.span, f"far{c.op}") for c in cands}
        for c in cands:
            drop = self.drop[p.key(c.op)]
            self.model.Add(far[c.op] >= rank[c.op]).OnlyEnforceIf(drop)
            for d in cascade.readers[c.op]:
                self.model.Add(far[c.op] >= far[d]).OnlyEnforceIf(drop)

    def _resident(self, i: int, p: RematPath, sid: int, ts: tuple) -> Any:
        """A literal that is true when one of the terms holds (the solver keeps it false
        otherwise, as it only ever tightens the memory rows)."""
        if len(ts) == 1:
            return self._lit(i, p, ts[0])
        cache = (i, sid, ts)
        if cache not in self._live:
            var = self.model.NewBoolVar(f"live{sid}")
            for term in ts:
                self.model.AddImplication(self._lit(i, p, term), var)
            self._live[cache] = var
        return self._live[cache]

    def _lit(self, i: int, p: RematPath, term: Term) -> Any:
        """A literal at least as true as ``term`` (the rows only ever want it false)."""
        kind = term[0]
        if kind == "keep":
            return self.drop[p.key(term[1])].Not()
        if kind == "drop":
            return self.drop[p.key(term[1])]
        cache = (i, term)
        if cache not in self._live:
            var = self.model.NewBoolVar(kind)
            if kind == "drop-keep":
                self.model.Add(var >= self.drop[p.key(term[1])] - self.drop[p.key(term[2])])
            elif kind == "reach":
                self.model.Add(var >= self.drop[p.key(term[1])] + self._remade_by(i, p, term[1], term[2]) - 1)
            else:  # on
                off = self.off[offload_key(p, self._offs[i][term[1]])]
                if term[2] is None:
                    self.model.AddImplication(off.Not(), var)
                else:
                    self.model.Add(var >= self._lit(i, p, term[2]) - off)
            self._live[cache] = var
        return self._live[cache]

    def _remade_by(self, i: int, p: RematPath, x: int, at: int) -> Any:
        """A literal: a chain of dropped readers remakes ``x`` by position ``at`` (prefix ORs
        over the recompute points, so each position costs two constraints). Built forwards,
        without recursion: chains may be thousands of ops long."""
        key = (i, p.key(x), at)
        if key not in self._by:
            points = sorted(pe for pe in self.cascades[i].points[x] if pe[0] <= at)
            prev = None
            for pos in sorted({pe for pe, _ in points} | {at}):
                k = (i, p.key(x), pos)
                if k not in self._by:
                    var = self.model.NewBoolVar("by")
                    if prev is not None:
                        self.model.AddImplication(prev, var)
                    for pe, e in points:
                        if pe == pos:
                            self.model.AddImplication(self._reaches(i, p, x, e), var)
                    self._by[k] = var
                prev = self._by[k]
        return self._by[key]

    def _reaches(self, i: int, p: RematPath, x: int, e: int) -> Any:
        """A literal: recomputing ``e`` remakes ``x`` (a chain of dropped readers). Every
        literal of the chain is made first, then its constraints: no recursion."""
        key = (i, p.key(x), p.key(e))
        if key not in self._reach:
            made, stack = [], [x]
            while stack:
                y = stack.pop()
                k = (i, p.key(y), p.key(e))
                if k in self._reach:
                    continue
                self._reach[k] = self.model.NewBoolVar("reach")
                made.append(y)
                stack.extend(d for d in self.cascades[i].via[y][e] if d != e)
            for y in made:
                var = self._reach[(i, p.key(y), p.key(e))]
                for d in self.cascades[i].via[y][e]:
                    if d == e:
                        self.model.AddImplication(self.drop[p.key(d)], var)
                    else:
                        reach_d = self._reach[(i, p.key(d), p.key(e))]
                        self.model.Add(var >= self.drop[p.key(d)] + reach_d - 1)
        return self._reach[key]

    def fit(self, budget: int) -> bool:
        """Add the budget rows; False when a row cannot hold whatever is dropped."""
        if any(base > budget for base, *_r in self.rows):
            return False
        self.limit(budget)
        return True

    def solve(self, time_limit: float, hint: set | None, workers: int = 8):
        decisions = self.decisions
        if hint is not None:
            for k, var in decisions.items():
                self.model.AddHint(var, k in hint)
        solver = self.cp.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.1, time_limit)
        solver.parameters.num_workers = workers
        status = solver.Solve(self.model)
        chosen = None
        if status in (self.cp.OPTIMAL, self.cp.FEASIBLE):
            chosen = {k for k, var in decisions.items() if solver.Value(var)}
        return solver, status, chosen


def _with_remaking(size_of: Callable[[int], int], remaking: list[int]) -> Callable[[int], int]:
    """``size_of`` that also sizes the remakes' temporary bytes (piece ``-k``: ``remaking[k - 1]``)."""
    return lambda sid: remaking[-sid - 1] if sid < 0 else size_of(sid)
