"""Grouping a trace's ops into loops (Terra §3.2.2, "ops executed in the same loop").

Terra rewrites the program to keep a stack of loop ids and iteration counters. Here loops are
read from the bytecode (:meth:`CodeTable.loops_at`) and iterations from the order of offsets:
within one invocation of a frame, execution moves forward except through a loop's back edge. So
when an op's location is *not after* the previous op's location, a back edge was taken, and the
innermost loop containing both ops starts a new iteration.

In the backward region the forward location is mirrored (offsets negated), so the gradient ops
of a loop body, which autograd runs in reverse, form a loop of their own. A ``RUN`` pseudo-frame
is a loop with no bytecode: the gradient of a list gathered from a loop's iterations (one run of
ops per element, ``recorder.py``) iterates it.

The rule sees only consecutive pairs of ops, so it runs the same way online (op by op, as the
co-execution skeleton will) and offline. What it cannot see: a loop iterated by C code
(``map``), and which of two nested loops iterated when only the inner body has ops; both give a
coarser but still exact grouping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from .location import ACC, BWD, CODES, RUN, Location
from .trace import Fetch

if TYPE_CHECKING:
    from .trace import Item, Trace

LoopKey = tuple  # (location prefix, code id, header offset)


@dataclass(eq=False)
class Loop:
    """One execution of a loop: the items of each iteration."""

    key: LoopKey
    iterations: list[list["Item"]] = field(default_factory=list)

    @property
    def trips(self) -> int:
        return len(self.iterations)

    def __repr__(self) -> str:
        prefix, cid, header = self.key
        where = CODES.describe(prefix + ((cid, header),))
        return f"<Loop at {where}: {self.trips} iterations>"


def _is_base(loc: Location, depth: int) -> bool:
    """Is frame ``depth`` the recording's own frame (first frame, or first after BWD)?"""
    return depth == 0 or loc[depth - 1][0] == BWD


_ENCLOSING: dict[tuple, list] = {}


def enclosing_loops(loc: Location, outside: frozenset = frozenset()) -> list[tuple[LoopKey, int]]:
    """Every static loop the location is inside, outermost first, as ``(key, depth)``.

    ``outside`` holds ``(code id, header)`` of the loops around the recording itself (the
    training loop around the ``with`` block): in the recording's own frame they are left out.
    Locations repeat every step, so the answer is cached.
    """
    cache_key = (loc, outside)
    found = _ENCLOSING.get(cache_key)
    if found is None:
        found = _ENCLOSING[cache_key] = _enclosing_loops(loc, outside)
    return found


def _enclosing_loops(loc: Location, outside: frozenset) -> list[tuple[LoopKey, int]]:
    out = []
    for depth, (cid, off) in enumerate(loc):
        if cid == RUN:
            out.append(((loc[:depth], RUN, off), depth))
            continue
        if cid <= 0:
            continue
        for header, _last in CODES.loops_at(cid, abs(off)):
            if outside and (cid, header) in outside and _is_base(loc, depth):
                continue
            out.append(((loc[:depth], cid, header), depth))
    return out


def _restart_from(a: Location, b: Location) -> tuple[int, int | None, int | None] | None:
    """Where ``b`` went back relative to ``a``: ``(depth, offset_a, offset_b)``, or None if
    ``b`` is after ``a`` (no back edge needed)."""
    n = min(len(a), len(b))
    for d in range(n):
        ca, oa = a[d]
        cb, ob = b[d]
        if ca != cb:
            if ca < 0 or cb < 0:
                return None  # a different region of the same call: forward
            return (d - 1, None, None)  # another function called from the same site: re-call
        if oa != ob:
            if ca == ACC:
                return None  # leaves of one op accumulate in the engine's order, not ours
            return None if ob > oa else (d, oa, ob)
    if len(a) == len(b):
        return (n - 1, a[-1][1], b[-1][1])  # the very same site ran again
    return None


def _restart_loop(
    a: Location, start: tuple[int, int | None, int | None], outside: frozenset
) -> LoopKey | None:
    """The innermost loop at or above ``depth`` that contains both positions."""
    depth, oa, ob = start
    for j in range(depth, -1, -1):
        cid, off = a[j]
        if cid == RUN:
            return (a[:j], RUN, off)
        if cid <= 0:
            continue
        if j == depth and oa is not None:
            lo, hi = sorted((abs(oa), abs(ob)))
            loops = [lp for lp in CODES.loops_at(cid, lo) if lp[0] <= hi <= lp[1]]
        else:
            loops = CODES.loops_at(cid, abs(off))
        for header, _last in reversed(loops):
            if not (outside and (cid, header) in outside and _is_base(a, j)):
                return (a[:j], cid, header)
    return None


_RESTART: dict[tuple, LoopKey | None] = {}  # (previous loc, loc, outside) -> loop restarted
_MISSING = object()


class LoopEvent(NamedTuple):
    """How placing one op changed the open loops: the first ``keep`` stay open (the others
    closed), the last kept one starts a new iteration if ``restart``, then ``opened`` open."""

    keep: int
    restart: bool
    opened: tuple[LoopKey, ...]


class LoopTracker:
    """Places items one at a time into a tree of :class:`Loop` s.

    ``outside``: keys of loops that enclose the whole recording (the training loop around the
    ``with`` block); they are not part of the step.
    """

    def __init__(self, outside: frozenset = frozenset()) -> None:
        self.outside = outside
        self.root: list[Item] = []
        self._open: list[Loop] = []
        self._prev: Location | None = None

    def _current(self) -> list["Item"]:
        return self._open[-1].iterations[-1] if self._open else self.root

    def add_op(self, index: int, loc: Location) -> LoopEvent:
        loops = enclosing_loops(loc, self.outside)
        keep = 0
        while keep < len(self._open) and keep < len(loops) and self._open[keep].key == loops[keep][0]:
            keep += 1
        restart = None
        if self._prev is not None:
            pair = (self._prev, loc, self.outside)
            restart = _RESTART.get(pair, _MISSING)
            if restart is _MISSING:
                where = _restart_from(self._prev, loc)
                restart = _restart_loop(self._prev, where, self.outside) if where else None
                _RESTART[pair] = restart
        new_iteration = None
        if restart is not None:
            for i in range(keep):
                if self._open[i].key == restart:
                    keep, new_iteration = i + 1, self._open[i]
                    break
        del self._open[keep:]
        if new_iteration is not None:
            new_iteration.iterations.append([])
        opened = tuple(key for key, _depth in loops[keep:]) if len(loops) > keep else ()
        for key in opened:
            loop = Loop(key, [[]])
            self._current().append(loop)
            self._open.append(loop)
        self._current().append(index)
        self._prev = loc
        return LoopEvent(keep, new_iteration is not None, opened)

    def add_fetch(self, fetch: "Fetch") -> int:
        """A fetch goes where Python is: it closes loops it is not in, opens none. Returns the
        number of loops still open."""
        inside = {key for key, _ in enclosing_loops(fetch.loc, self.outside)}
        while self._open and self._open[-1].key not in inside:
            self._open.pop()
        self._current().append(fetch)
        return len(self._open)


def in_order(trace: "Trace"):
    """The trace's ops and fetches in the order they happened."""
    fetches = sorted(trace.fetches, key=lambda f: f.after)
    fi = 0
    for op in trace.ops:
        while fi < len(fetches) and fetches[fi].after <= op.index:
            yield fetches[fi]
            fi += 1
        yield op
    yield from fetches[fi:]


def build_items(trace: "Trace") -> list["Item"]:
    tracker = LoopTracker(trace.outside_loops)
    for x in in_order(trace):
        if isinstance(x, Fetch):
            tracker.add_fetch(x)
        else:
            tracker.add_op(x.index, x.key.loc)
    return tracker.root
