"""The executor thread: runs confirmed ops in order, off the Python skeleton's thread.

The skeleton submits :class:`Run` instructions (an ATen op with its arguments, placeholders
replaced by value ids) and :class:`Free` instructions (a value no one can use any more). The
executor runs them in submission order, so a fetch never waits for a feed that comes later
(DESIGN.md §4, "Deadlock"): every op it runs has been matched by the skeleton, so persistent
state is only mutated by confirmed ops.

Waiting is cheap on the executor side: after each instruction it compares its progress with
the one position someone waits for, and only then signals.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch


class ExecutorError(RuntimeError):
    """An op failed on the executor. ``op_index`` and ``location`` say which op and where the
    skeleton issued it; the original exception is the ``__cause__``."""

    def __init__(self, message: str, op_index: int | None = None, location: Any = None) -> None:
        super().__init__(message)
        self.op_index = op_index
        self.location = location


class ExecutorDied(RuntimeError):
    """The executor thread stopped while work was pending."""


class ExecutorTimeout(TimeoutError):
    """A wait on the executor exceeded its time limit."""


@dataclass(slots=True)
class Run:
    """Run ``func(*args, **kwargs)``; ``refs`` put values into the arguments first.

    ``refs``: ``(arg, item, vid)``: argument position (an int, or a kwarg name), index in a
    tensor-list argument or -1, and the value id to put there. ``outs``: value ids for the
    returned tensors, flattened. ``moves``: ``(old, new)`` value ids of arguments the op wrote
    in place: after it, the same tensor is value ``new`` and ``old`` is gone.
    """

    func: Any
    args: list
    kwargs: dict
    refs: tuple
    outs: tuple
    moves: tuple = ()
    op_index: int = -1
    location: Any = None
    keep_result: bool = False  # store the Python result (a fetch of a data-dependent op)


@dataclass(slots=True)
class Free:
    vids: tuple


@dataclass(slots=True)
class _Fault:
    """Test hook: make the thread die, raise or hang when it reaches this instruction."""

    kind: str
    release: threading.Event = field(default_factory=threading.Event)


_STOP = object()


def _flatten(out: Any) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        flat = []
        for x in out:
            if isinstance(x, torch.Tensor):
                flat.append(x)
            elif isinstance(x, (tuple, list)):
                flat.extend(y for y in x if isinstance(y, torch.Tensor))
        return flat
    return []


class _Worker:
    """One thread with its queue, value table and counters. A worker that is abandoned (dead,
    or stuck and replaced) keeps its own state, so it can never disturb its successor."""

    def __init__(self, name: str) -> None:
        self.values: dict[int, Any] = {}  # value id -> tensor
        self.results: dict[int, Any] = {}  # op index -> Python result (kept on request)
        self.submitted = 0
        self.done = 0
        self.error: ExecutorError | None = None
        self.busy_seconds = 0.0
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.want: int | None = None
        self.event = threading.Event()
        threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self.loop, args=(threads,), name=name, daemon=True)
        self.thread.start()

    def loop(self, threads: int) -> None:
        torch.set_num_threads(threads)  # intra-op threads are per thread: match the skeleton's
        torch.set_grad_enabled(False)
        # below autograd and ADInplaceOrView: the skeleton already did the autograd side of
        # every op (graph, views, version counters); bumping versions again here, at some
        # later moment, would break autograd's saved-tensor checks
        with torch._C._AutoDispatchBelowADInplaceOrView():
            self._serve(threads)

    def _serve(self, threads: int) -> None:
        q = self.q
        values = self.values
        while True:
            ins = q.get()
            if ins is _STOP:
                return
            t0 = time.perf_counter()
            if type(ins) is Run:
                if self.error is None:
                    self.run(ins, values)
            elif type(ins) is Free:
                for v in ins.vids:
                    values.pop(v, None)
            elif type(ins) is _Fault:
                if ins.kind == "die":
                    return  # the thread ends with work pending, as a crash would
                if ins.kind == "hang":
                    ins.release.wait(3600)
                elif ins.kind == "raise":
                    self.error = ExecutorError("injected fault")
            self.busy_seconds += time.perf_counter() - t0
            self.done += 1
            w = self.want
            if w is not None and self.done >= w:
                self.event.set()

    def run(self, ins: Run, values: dict) -> None:
        args = ins.args
        kwargs = ins.kwargs
        try:
            if ins.refs:
                args = list(args)
                kwargs = dict(kwargs)
                for arg, item, vid in ins.refs:
                    box = kwargs if isinstance(arg, str) else args
                    if item < 0:
                        box[arg] = values[vid]
                    else:
                        if not isinstance(box[arg], list):
                            box[arg] = list(box[arg])
                        box[arg][item] = values[vid]
            out = ins.func(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the skeleton's thread
            err = ExecutorError(
                f"{ins.func} failed on the executor: {type(e).__name__}: {e}",
                ins.op_index,
                ins.location,
            )
            err.__cause__ = e
            self.error = err
            return
        for old, new in ins.moves:
            values[new] = values.pop(old)
        if ins.outs:
            for vid, t in zip(ins.outs, _flatten(out)):
                values[vid] = t
        if ins.keep_result:
            self.results[ins.op_index] = out


class Executor:
    """The background thread the skeleton feeds (replaced by a fresh one after a failure)."""

    def __init__(self, name: str = "coexec-executor") -> None:
        self.name = name
        self._w = _Worker(name)

    # the current worker's state
    values = property(lambda self: self._w.values)
    results = property(lambda self: self._w.results)
    submitted = property(lambda self: self._w.submitted)
    done = property(lambda self: self._w.done)
    error = property(lambda self: self._w.error)
    busy_seconds = property(lambda self: self._w.busy_seconds)

    @property
    def alive(self) -> bool:
        return self._w.thread.is_alive()

    def submit(self, ins: Any) -> int:
        """Queue an instruction; returns its position (wait for it with :meth:`wait`)."""
        w = self._w
        w.q.put(ins)
        w.submitted += 1
        return w.submitted

    def wait(self, position: int, timeout: float) -> None:
        """Block until the instruction at ``position`` (1-based) has run.

        Raises the executor's error, :class:`ExecutorDied`, or :class:`ExecutorTimeout`."""
        w = self._w
        if w.done < position:
            deadline = time.monotonic() + timeout
            w.event.clear()
            w.want = position
            try:
                while w.done < position:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ExecutorTimeout(
                            f"the executor did not finish the pending ops within {timeout:g} s "
                            f"({w.done} of {position} instructions done)"
                        )
                    if w.event.wait(min(left, 0.5)):
                        w.event.clear()
                    elif not w.thread.is_alive():
                        raise ExecutorDied(
                            f"the executor thread stopped with {position - w.done} "
                            "instructions pending"
                        )
            finally:
                w.want = None
        if w.error is not None:
            raise w.error

    def drain(self, timeout: float) -> None:
        """Wait for everything submitted so far."""
        self.wait(self._w.submitted, timeout)

    def reset(self) -> None:
        """Forget values and errors; a dead or stuck worker is replaced by a fresh one."""
        w = self._w
        if w.done < w.submitted or not w.thread.is_alive():
            w.q.put(_STOP)  # a stuck thread exits when (if) it gets here
            self._w = _Worker(self.name)
        else:
            w.values.clear()
            w.results.clear()
            w.error = None

    def inject_fault(self, kind: str) -> _Fault:
        """Test hook: the thread ``"die"`` s, ``"raise"`` s or ``"hang"`` s when it gets here."""
        fault = _Fault(kind)
        self.submit(fault)
        return fault

    def close(self) -> None:
        self._w.q.put(_STOP)
