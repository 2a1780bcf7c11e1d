"""Rematerialization on the executor: dropping values and making them again on demand.

A :class:`Run` marked ``recipe`` is kept after it runs, and its tensor inputs are *pinned*: the
executor will not free them (a :class:`Free` of a pinned value waits) while the recipe may still
be needed. A :class:`Drop` then forgets the recipe's outputs to release their memory; the first
instruction that needs a dropped value runs the recipe again, recursively if an input was
dropped too, and retires it (its pins go; waiting frees happen). So a value is never lost:
the plan only says *when* to drop, and recomputation happens exactly where the planner put it
(just before the first use after the drop) whatever the step does.

Two guards keep recomputed values equal to the originals: an op about to write a pinned value
in place first recomputes the dropped outputs of the recipes that read it (and retires them),
and :class:`Restore` brings back dropped values the skeleton is about to read or bind.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class Drop:
    """Release these values' memory; they are recomputed from their recipes when needed."""

    vids: tuple


@dataclass(slots=True)
class Restore:
    """Recompute these dropped values now (``None``: every dropped value in ``[lo, hi)``)."""

    vids: tuple | None = None
    lo: int = 0
    hi: int = 0


class Recipes:
    """The recipes, pins and dropped values of one worker."""

    def __init__(
        self, values: dict, call: Callable[[Any], list], free: Callable[[int], None], memory: Any
    ) -> None:
        self.values = values
        self.memory = memory  # the worker's LiveBytes
        self.call = call  # run an instruction, return its flattened tensor outputs
        self.free = free  # release a value for good
        self.by_out: dict[int, Any] = {}  # output value id -> its recipe (a Run)
        self.pins: dict[int, int] = {}  # value id -> recipes reading it
        self.readers: dict[int, list] = {}  # value id -> the recipes that pin it
        self.waiting: set[int] = set()  # pinned values Python let go of: freed when unpinned
        self.dropped: set[int] = set()
        self.rng_states: dict[int, tuple] = {}  # id(recipe) -> RNG state it first ran with
        # recipes that stay after a remake, so their outputs can be dropped again (the guard's:
        # executor/guard.py), and the values they made again since the guard last looked
        self.lasting: Callable[[Any], bool] = lambda ins: False
        self.remade: list[int] = []
        self.again: Callable[[Any], None] = lambda ins: None  # before each remake
        self.ran_again: Callable[[Any], None] = lambda ins: None  # after each remake
        self.recomputed = 0  # recipes run again
        self.seconds = 0.0  # time spent running them

    def __bool__(self) -> bool:
        return bool(self.by_out)

    def keep(self, ins: Any) -> None:
        """``ins`` just ran: keep it and pin its inputs."""
        for vid in ins.outs:
            self.by_out[vid] = ins
        for _arg, _item, vid in ins.refs:
            self.pins[vid] = self.pins.get(vid, 0) + 1
            self.readers.setdefault(vid, []).append(ins)

    def drop(self, vids: tuple) -> None:
        for vid in vids:
            if vid in self.by_out and vid in self.values and vid not in self.dropped:
                self.memory.remove(self.values.pop(vid))
                self.dropped.add(vid)

    def holds(self, vid: int) -> bool:
        """A free of ``vid`` must wait (a recipe may still read it); remembered if so."""
        if self.pins.get(vid):
            self.waiting.add(vid)
            return True
        return False

    def forget(self, vid: int) -> None:
        """``vid`` is gone for good: a recipe none of whose outputs remain is retired."""
        self.dropped.discard(vid)
        ins = self.by_out.pop(vid, None)
        if ins is not None and not any(v in self.by_out for v in ins.outs):
            self.rng_states.pop(id(ins), None)
            self._unpin(ins)

    def get(self, vid: int) -> Any:
        """The value of ``vid``, recomputed first if it was dropped."""
        if vid in self.dropped:
            self.recompute(self.by_out[vid])
        return self.values[vid]

    def recompute(self, ins: Any) -> None:
        t0 = time.perf_counter()
        self.again(ins)
        outs = self.call(ins)
        self.ran_again(ins)
        lasting = self.lasting(ins)
        for vid, t in zip(ins.outs, outs):
            if vid in self.dropped:
                self.dropped.discard(vid)
                self.values[vid] = t
                self.memory.add(t)
                if lasting:
                    self.remade.append(vid)
        if not lasting:
            self.retire(ins)
        self.recomputed += 1
        self.seconds += time.perf_counter() - t0

    def before_write(self, vids: list[int]) -> None:
        """Values about to be written in place: recipes reading them must not run later."""
        for vid in vids:
            for ins in list(self.readers.get(vid, ())):
                if self.lasting(ins):
                    continue  # (the guard's: it looks at every write, executor/guard.py)
                if any(v in self.dropped for v in ins.outs):
                    self.recompute(ins)
                self.retire(ins)

    def restore(self, vids: Any) -> None:
        for vid in list(vids):
            if vid in self.dropped:
                self.recompute(self.by_out[vid])

    def clear_range(self, lo: int, hi: int) -> None:
        """A finished step: forget its recipes, pins and dropped values."""
        for vid in [v for v in self.by_out if lo <= v < hi]:
            self.by_out.pop(vid)
        for d in (self.pins, self.readers):
            for vid in [v for v in d if lo <= v < hi]:
                d.pop(vid)
        self.waiting = {v for v in self.waiting if not lo <= v < hi}
        self.dropped = {v for v in self.dropped if not lo <= v < hi}
        live = {id(ins) for ins in self.by_out.values()}
        self.rng_states = {k: v for k, v in self.rng_states.items() if k in live}

    def retire(self, ins: Any) -> None:
        for vid in ins.outs:
            if self.by_out.get(vid) is ins:
                del self.by_out[vid]
        self.rng_states.pop(id(ins), None)
        self._unpin(ins)

    def _unpin(self, ins: Any) -> None:
        for _arg, _item, vid in ins.refs:
            readers = self.readers.get(vid)
            at = next((i for i, r in enumerate(readers or ()) if r is ins), None)
            if at is None:
                continue
            del readers[at]
            left = self.pins[vid] - 1
            if left:
                self.pins[vid] = left
                continue
            del self.pins[vid], self.readers[vid]
            if vid in self.waiting:
                self.waiting.discard(vid)
                self.free(vid)


def _devices(args: Any, kwargs: Any) -> set:
    found = set()
    for x in (*args, *kwargs.values()):
        for t in x if isinstance(x, (list, tuple)) else (x,):
            if isinstance(t, torch.Tensor):
                found.add(t.device)
    return found


def rng_state(args: list, kwargs: dict) -> tuple:
    """The default generators' states a random op is about to draw from: the CPU one, and
    the CUDA one of each CUDA device among its arguments (an explicit ``generator=`` argument
    is not replayed: such ops stay eager-equal only if nothing else draws from it)."""
    cuda = sorted(d.index or 0 for d in _devices(args, kwargs) if d.type == "cuda")
    return torch.get_rng_state(), tuple((i, torch.cuda.get_rng_state(i)) for i in cuda)


@contextlib.contextmanager
def replayed_rng(state: tuple) -> Iterator[None]:
    """Run with the generators as they were in ``state``, then put them back."""
    cpu, cuda = state
    saved_cpu = torch.get_rng_state()
    saved_cuda = [(i, torch.cuda.get_rng_state(i)) for i, _ in cuda]
    torch.set_rng_state(cpu)
    for i, st in cuda:
        torch.cuda.set_rng_state(st, i)
    try:
        yield
    finally:
        torch.set_rng_state(saved_cpu)
        for i, st in saved_cuda:
            torch.cuda.set_rng_state(st, i)
