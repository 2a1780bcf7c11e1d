"""Watching every ``GradientTape`` step of a process from outside the script: what phase each
step ran in, and why it fell back or made a new trace (``python -m tracegraph show --record``).

Costs one list check per step when nobody watches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tracegraph.reasons import FallbackReason


@dataclass(frozen=True)
class StepReport:
    """One step of one program, as it ended."""

    where: str  # the ``with`` statement (file:line (function))
    program: int  # the n-th program (model) at that ``with``
    step: int  # the program's step, counted from 0 (as in TapeStats.fallback_reasons)
    phase: str  # the phase the step ran in: "tracing", "coexec" or "eager"
    covered: bool  # co-executed from start to end on the graph: no fallback, nothing new
    fell_back: bool  # co-executed, then left the graph and finished eagerly
    reason: FallbackReason | None  # why it fell back, or why its trace was new


observers: list[Callable[[StepReport], None]] = []


@contextmanager
def observe(callback: Callable[[StepReport], None]) -> Iterator[None]:
    """Call ``callback`` with a :class:`StepReport` after every step of every tape, in the
    step's thread, until the block ends. An exception it raises leaves the user's ``with``."""
    observers.append(callback)
    try:
        yield
    finally:
        observers.remove(callback)


def notify(report: StepReport) -> None:
    for callback in list(observers):
        callback(report)
