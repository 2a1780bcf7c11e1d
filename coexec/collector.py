"""Python's cyclic garbage collector, held back while a step is recorded.

A recorded step (traced or co-executed) keeps its trace growing as it goes: about ten
thousand container objects alive at once in a GPT-2 step. At CPython's default threshold (700
net allocations) that is a dozen young collections a step; each moves the trace recorded so
far to an older generation, and those moves make a full collection due every few steps: a walk
over the whole heap, which torch's modules make some 300 000 objects (about 0.15 s on a CPU
where the eager step takes 0.02 s). Refcounting frees the step's objects when it ends, so they
need no collection at all.

So while a step is recorded the youngest threshold is raised to :data:`STEP_THRESHOLD`: a step
that makes fewer new objects than that collects nothing, one that makes more (cycles in a
long Python loop) still collects. The thresholds are put back when the last recorded step
has ended and been let go of (``GradientTape.__exit__``), unless someone changed them in
between. Measured: docs/coexec.md, "Garbage collection".
"""

from __future__ import annotations

import gc
import threading

STEP_THRESHOLD = 100_000

_lock = threading.Lock()
_depth = 0  # recorded steps running now (each thread may have one)
_saved: tuple[int, ...] | None = None  # the thresholds before the first of them (None: kept)


def hold() -> None:
    """A recorded step starts."""
    global _depth, _saved
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        before = gc.get_threshold()
        if before[0] == 0 or before[0] >= STEP_THRESHOLD:
            _saved = None  # (collection off, or already rarer than ours)
            return
        _saved = before
        gc.set_threshold(*_ours(before))


def release() -> None:
    """A recorded step ended (returned or raised)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth or _saved is None:
            return
        if gc.get_threshold() == _ours(_saved):  # (not if the program set its own meanwhile)
            gc.set_threshold(*_saved)
        _saved = None


def _ours(saved: tuple[int, ...]) -> tuple[int, ...]:
    """The thresholds held steps run with, given the program's."""
    return (STEP_THRESHOLD, *saved[1:])
