"""The Schedule: the one boundary type between the planner and the runtime (DESIGN.md §3).

A program's plan over every observed path of its TraceGraph. Ops and storages are named by
what holds across steps and paths, not by positions in one trace:

* a :class:`Site` is an op: the TraceGraph node that matched it and the loop iterations it ran
  in (the same node runs once per iteration);
* a :class:`StorageKey` is a storage an op allocates: its site and the output slot.

A **block** is what the runtime executes between two sync points (a fetch, an op whose Python
result or shape the program waits for, an op inside a user's ``try``, the end of the step):
the executor runs its ops in the block's planned ``order`` (a permutation of the block's ops,
which keeps every dependency of the planning graph), ahead of the block's end where the memory
plan allows. A block the schedule does not list runs in issue order. Blocks are keyed by their
:class:`BlockKey`, the sites of their ops in issue order (coexec indexes them op by op).

Storages placed in the arena have one offset each, valid on every observed path: two storages
share bytes only where no path keeps both resident. Under a memory budget, the ops after which
storages are dropped (to be recomputed) or moved to and from the host are listed per site.

Everything here is frozen and pickles (plans are made in another process): the mappings are
plain dicts that nobody mutates after :func:`planner.plan_program` returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Union


class Site(NamedTuple):
    """An op as every step and path of a program knows it."""

    node: int  # the TraceGraph node
    iterations: tuple  # ((loop id, iteration), ...) of the loops it ran in


class StorageKey(NamedTuple):
    """A storage as every step and path knows it: the ``output``-th result of a site."""

    node: int
    output: int
    iterations: tuple

    @property
    def site(self) -> Site:
        return Site(self.node, self.iterations)


BlockKey = tuple  # tuple[Site, ...]: a block's ops in issue order


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second of the copy channel, each way, and the fixed cost of one copy (the
    executor measures it, the planner plans offloading with it)."""

    to_host: float
    to_device: float
    latency: float = 0.0

    def out_seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.to_host

    def in_seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.to_device




@dataclass(frozen=True)
class Drop:
    """Free the storage now; the executor recomputes it from its kept producer when next
    needed (its site is in :attr:`Schedule.recompute`)."""

    storage: StorageKey


@dataclass(frozen=True)
class Offload:
    """Start copying the storage into its slice of the host pool."""

    storage: StorageKey
    host_offset: int
    host_bytes: int  # the slice's size


@dataclass(frozen=True)
class WaitOffload:
    """The copy out has finished: release the storage's device memory."""

    storage: StorageKey


@dataclass(frozen=True)
class Prefetch:
    """Start copying the storage back to the device, into the bytes it left."""

    storage: StorageKey


# what a budget plan issues after an op, in this order
AfterOp = Union[Drop, Offload, WaitOffload, Prefetch]


@dataclass(frozen=True, eq=False)
class Block:
    """The ops between two sync points and the order the executor runs them in.

    ``bound``: the most device bytes the block holds at once in the plan, as the executor
    counts them (the whole arena, plus every storage outside it), on the path where that is
    least; ``new_bytes``: per op (by issue position in the block), the bytes of the storages
    it allocates outside the arena. The executor may run a block's ops before the block is
    complete, in ``order``, as long as it holds no more than ``bound``. Blocks are compared
    by identity (their ``sites`` can be thousands long; the Schedule has one per key)."""

    sites: BlockKey
    order: tuple[int, ...]  # indices into ``sites``: the planned order (a topological order)
    bound: int = 0
    new_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PathPlan:
    """What the plan does on one observed path (the simulator's figures, bytes and seconds).

    ``eager_peak``: issue order, each storage freed when the traced program let go of it (what
    eager PyTorch holds); ``planned_peak``: what the executor holds with this plan, persistent
    state and the whole arena included."""

    ops: int
    blocks: int  # blocks with a planned order other than the issue order
    eager_peak: int
    planned_peak: int
    arena_end: int  # the highest arena byte this path uses
    predicted_seconds: float
    recomputed: int = 0  # ops dropped and run again
    offloaded: int = 0  # storages parked on the host
    extra_seconds: float = 0.0  # recomputation the plan adds
    stall_seconds: float = 0.0  # waiting for copies the plan predicts


@dataclass(frozen=True)
class Schedule:
    """A program's plan for every observed path (see the module docstring)."""

    blocks: Mapping[BlockKey, Block] = field(default_factory=dict)
    offsets: Mapping[StorageKey, int] = field(default_factory=dict)  # arena offset per storage
    arena_bytes: int = 0
    arena_live: int = 0  # the most bytes placed storages hold at once, over the paths
    paths: tuple[PathPlan, ...] = ()
    # each planned path's sites in issue order -> its index in ``paths``
    signatures: Mapping[tuple, int] = field(default_factory=dict)
    budget: int | None = None  # bytes, under a memory budget
    recompute: frozenset = frozenset()  # StorageKeys whose producers the executor keeps
    after: Mapping[Site, tuple[AfterOp, ...]] = field(default_factory=dict)
    parked: frozenset = frozenset()  # StorageKeys offloaded to the host
    host_bytes: int = 0  # the host pool: every offloaded storage has its own slice
    planning_seconds: float = 0.0
    methods: tuple[str, ...] = ()  # how the plan was found (solvers, per stage)

    @property
    def peak(self) -> int:
        """The predicted device bytes at the worst path's peak."""
        return max((p.planned_peak for p in self.paths), default=0)

    @property
    def predicted_seconds(self) -> float:
        return max((p.predicted_seconds for p in self.paths), default=0.0)

    @property
    def fragmentation(self) -> float:
        """Arena bytes over the most its storages hold at once on any path, minus 1."""
        return self.arena_bytes / self.arena_live - 1 if self.arena_live else 0.0

    def summary(self) -> str:
        """One line for a debug log: what the plan does, and what it cost to find."""
        from .errors import format_bytes

        parts = [f"planned peak {format_bytes(self.peak)} over {len(self.paths)} path(s)"]
        if self.budget is not None:
            extra = max((p.extra_seconds for p in self.paths), default=0.0)
            parts[0] = f"memory budget {format_bytes(self.budget)}: {parts[0]}"
            parts.append(
                f"{len(self.recompute)} storages recomputed (+{1e3 * extra:.1f} ms), "
                f"{len(self.parked)} offloaded"
            )
        else:
            moved = sum(b.order != tuple(range(len(b.order))) for b in self.blocks.values())
            parts.append(f"{moved} of {len(self.blocks)} block(s) reordered")
        if self.arena_bytes:
            parts.append(
                f"arena {format_bytes(self.arena_bytes)} ({100 * self.fragmentation:.1f}% fragmentation)"
            )
        parts.append(f"predicted step {1e3 * self.predicted_seconds:.1f} ms")
        parts.append(f"planned in {self.planning_seconds:.1f} s ({', '.join(self.methods)})")
        return "; ".join(parts)
