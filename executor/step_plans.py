"""A described step and the memory plan made for it: what the native capture
(``executor/capture.py``) and the runtime's budget planning (``coexec/native_budget.py``)
exchange. Plain data, pickled to the planning process; nothing here needs the native module."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple


class DescribedOp(NamedTuple):
    """One op of a described step (:meth:`Capture.describe_next`), as the executor ran it."""

    place: int  # its place in the step (ops issued before it)
    name: str  # ``aten::mm``, with the overload after a dot
    op_id: int  # the operator, for :class:`DropPlan` (this process only)
    seconds: float
    at_once: bool  # run at once on the step's thread (Python read its result, or a new op)
    random: bool  # it draws from a generator
    reads: tuple[int, ...]  # storages, numbered in the order the step met them
    writes: tuple[int, ...]
    makes: tuple[int, ...]  # storages it allocated
    values: tuple[tuple[int, int], ...]  # per placeholder it made: (value number, storage)
    workspace: int = 0  # bytes its kernel allocated and freed again (when the CPU's are counted)
    backward: bool = False  # issued after the step's first ``backward()`` began (gradients, the update)
    # per storage it made (as ``makes``): the allocations of its bytes its kernel made before it
    made_after: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepDescription:
    """What a step's ops read, wrote and made, storage by storage: what a memory plan for its
    path is made from (``coexec/native_budget.py``). Values are the step's placeholders,
    numbered from 0 in the order made; the same path numbers them the same way."""

    ops: tuple[DescribedOp, ...]
    storage_bytes: tuple[int, ...]  # per storage
    existed: tuple[bool, ...]  # per storage: it existed before the step (a parameter, a batch)
    fetched: frozenset[int]  # values Python read (numpy, printing, a realized tensor)
    released: Mapping[int, int]  # value -> ops issued when the program let go of it
    alive: frozenset[int]  # values Python held at the step's end
    # per storage that existed before the step, a number naming it in other steps' descriptions
    # too (its address; 0: made in the step): the state several paths read, counted once
    state_ids: tuple[int, ...] = ()


class Park(NamedTuple):
    """Values (all those on one storage) parked in the host pool across their idle stretch: the
    worker copies their storage into ``[host_offset, host_offset + host_bytes)`` of the pool and
    releases it after the op at place ``out_after``, and copies it back into new memory after
    the op at place ``back_after``; a parked value read before that comes back where it is read."""

    values: tuple[int, ...]
    out_after: int
    back_after: int
    host_offset: int
    host_bytes: int


class Placed(NamedTuple):
    """A storage put in the plan's arena: the op at ``place`` makes it, and its kernel's
    allocation of exactly ``nbytes`` takes ``[offset, offset + nbytes)`` of the arena, unless
    those bytes are still held (a tensor kept longer than in the planned step): then it comes
    from the allocator, as unplanned. ``passed_over``: the allocations of ``nbytes`` the kernel
    makes before the storage's (a temporary of the output's size), which do not take it."""

    place: int
    nbytes: int
    offset: int
    passed_over: int = 0


@dataclass(frozen=True)
class DropPlan:
    """A memory plan the worker follows (``native/capture_worker.h``, ``Drops``): after the op
    at place ``p`` it frees the values ``after[p]``, and makes each again from its kept producer
    when it is next read; the values of ``parks`` it parks in the host pool and brings back. A step that meets another op than ``ops[place]``, or makes a value
    larger than ``value_bytes`` says, stops following it there (what it dropped is still made again when read), so a plan changes when memory is
    held, never a value."""

    ops: tuple[int, ...]  # per place: the op id expected there (0: an op run at once)
    keep: frozenset[int]  # values whose producers are kept (the values dropped, and their views)
    after: Mapping[int, tuple[int, ...]]  # place -> values dropped after the op there
    # per value number, its storage's bytes in the planned step (0 or absent: not known): a step
    # that makes a value larger than this has grown past the plan and stops following it there
    value_bytes: tuple[int, ...] = ()
    parks: tuple[Park, ...] = ()  # values parked in the host pool (offload=True)
    arena_bytes: int = 0  # the arena, allocated whole when the plan is taken (arena=True)
    placed: tuple[Placed, ...] = ()  # the storages put in it

    @property
    def host_bytes(self) -> int:
        """The host pool the parks need."""
        return max((p.host_offset + p.host_bytes for p in self.parks), default=0)
