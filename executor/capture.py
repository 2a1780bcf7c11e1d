"""A training step's ATen ops answered in C++ while a worker thread computes them
(``native/capture.cpp``; docs/coexec.md, *Capture*).

    capture = Capture()            # mode "async": the worker computes as ops come
    for batch in data:
        with capture.step():
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()
        print(loss.item())         # after the step: plain tensors

Inside ``step()`` every op the thread calls comes to one C++ kernel, which answers with
placeholders (tensors without memory) from a cache of what the same op at the same Python line
made before, and queues the op for the worker; an op it cannot answer (first sight, new sizes,
``.item()``, a shape that depends on data) waits for the worker and runs at once, as eager. So
autograd, modules and optimizers run unchanged over placeholders, and the values are eager's bit
for bit (the same kernels in the same order with the same thread count). At the step's end the
worker catches up and every placeholder still alive becomes its value in place.

Python code that reads a tensor's memory without an ATen op (``numpy()``, ``tolist()``,
``data_ptr()``, storages, DLPack, printing) waits for the value first: those methods of
``torch.Tensor`` are wrapped while a step runs, as are the functions that read or set the CPU
random generator, which the worker uses in the ops' order.

This is the base issue 16's skeleton is being built on; coexec's ``GradientTape`` does not use
it yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Literal

import torch

from executor import native

Mode = Literal["async", "replay", "tape"]

# Tensor methods that read memory around the dispatcher, and the CPU generator's functions
_DATA_ACCESS = (
    "numpy", "tolist", "__array__", "data_ptr", "untyped_storage", "_typed_storage", "storage",
    "__dlpack__", "__repr__", "__format__",
)  # fmt: skip
_RANDOM = ("manual_seed", "seed", "get_rng_state", "set_rng_state")


@dataclasses.dataclass(frozen=True)
class CaptureCounters:
    """What a capture's kernel did since it was made."""

    ops: int  # ATen ops that came to it
    misses: int  # ops the cache could not answer (run at once; in "tape" mode, meta kernels)
    run_now: int  # ops run at once (misses, ``.item()``-like ops, data-dependent shapes)
    kernel_seconds: float  # time in the kernel itself
    taped: int  # ops on the tape ("replay" mode: not replayed yet)


class Capture:
    """Steps whose ops a C++ kernel answers while a worker computes them (module docstring).

    ``mode``: "async" (the default), "replay" (nothing computed during the step; ``replay()``
    runs its tape before the step ends: the check that the tape holds every op) or "tape"
    (nothing computed at all: what answering costs alone). One step is captured at a time in a
    process.
    """

    def __init__(self, mode: Mode = "async") -> None:
        built = native.wait()
        if built is None:
            raise RuntimeError(
                "coexec: capture needs the native module, which is not available "
                "(switched off by COEXEC_NATIVE=0, or it could not be built: see the warning)"
            )
        self._native = built
        self._c = built.Capture(mode, torch.get_num_threads())

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Capture the ops this thread runs inside the ``with`` block."""
        self._c.begin()
        try:
            with _waiting_on(self._c):
                yield
        except BaseException:
            with contextlib.suppress(Exception):  # (the step's own error is the one to see)
                self._c.end()
            raise
        self._c.end()

    def replay(self) -> int:
        """("replay" mode, inside a step) Run the ops taped so far; their number."""
        return self._c.replay()

    @property
    def counters(self) -> CaptureCounters:
        ops, misses, run_now, kernel_ns, taped = self._c.counters
        return CaptureCounters(ops, misses, run_now, kernel_ns * 1e-9, taped)

    def close(self) -> None:
        """Stop the worker thread now (it also stops when the capture is collected)."""
        self._c = None


def is_placeholder(t: torch.Tensor) -> bool:
    """Is ``t`` a placeholder (a tensor of a step still being captured, without memory)?"""
    built = native.ready()
    return built is not None and built.is_placeholder(t)


@contextlib.contextmanager
def _waiting_on(c) -> Iterator[None]:
    """Wrap what reads memory or the CPU generator outside the dispatcher so that it waits for
    the worker first (and runs with capture paused)."""
    saved: list[tuple[object, str, object]] = []

    def wrap(owner: object, name: str, wait: Callable[[tuple], None]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def waiting(*args, **kwargs):
            wait(args)
            c.pause()
            try:
                return original(*args, **kwargs)
            finally:
                c.resume()

        saved.append((owner, name, original))
        setattr(owner, name, waiting)

    def realize_self(args: tuple) -> None:
        c.realize(args[0])

    def drain(_args: tuple) -> None:
        c.wait()

    for name in _DATA_ACCESS:
        wrap(torch.Tensor, name, realize_self)
    for name in _RANDOM:
        wrap(torch, name, drain)
        wrap(torch.random, name, drain)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
