"""The native executor: the same instructions and contracts as :class:`executor.Executor`, run
by the native engine (``native/engine.h``) on a C++ thread that never takes the GIL.

The Python executor's thread needs the GIL for every instruction, so while the skeleton's
Python runs it gets it back only at the interpreter's switch interval, and ops ran 3-10x slower
than eagerly (docs/coexec.md, *Performance*). Here each instruction is converted to a boxed
dispatcher call on the skeleton's thread as it is submitted, and the engine runs it beside the
skeleton: the same kernels, in the same order, with the same intra-op thread count, so results
are bit-equal.

It takes the instructions of steps without a memory budget (``Run``, ``Free``, ``FreeRange``,
``Launch``, ``Follow``, ``ResetPeak``); recomputation and offloading stay with the Python
executor (:func:`make_executor`). An op the engine cannot call (arguments only Python's binding
converts) runs here, in Python, once everything before it is done, and its results go into the
engine's table.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from planner.schedule import Block

from . import native, stream
from .memory import ResetPeak
from .stream import (
    Executor, ExecutorDied, ExecutorError, ExecutorStats, ExecutorTimeout, Follow, Free, FreeRange,
    Instruction, Launch, Run, RunAhead, _flatten,
)  # fmt: skip

_DONE, _TIMED_OUT = 0, 1  # Engine.wait's answers (2: the thread stopped)
_INJECTED = 2  # Engine.error_kind (0: none, 1: an op raised, 3: an op run here raised: _error)
_PLANS_KEPT = 4096  # converted blocks kept (per executor), by the Block object


class _Release:
    """What ``inject_fault("hang")`` returns: ``.release.set()`` lets the stuck thread go."""

    def __init__(self, engine: Any) -> None:
        self.release = self
        self._engine = engine

    def set(self) -> None:
        self._engine.release_hang()


class NativeExecutor:
    """The executor the skeleton feeds, run by the native engine (replaced by a fresh one after
    a failure). The interface is :class:`executor.Executor`'s."""

    def __init__(self, module: ModuleType, name: str = "coexec-native") -> None:
        self.name = name
        self._mod = module
        self._e = module.Engine(torch.get_num_threads())
        self._submitted = 0
        self._open = 0  # position of the first deferred run not yet launched (0: none)
        self._where: dict[int, Any] = {}  # op index -> where the skeleton issued it (errors)
        self._plans: dict[int, tuple[Block, Any]] = {}  # id(Block) -> (it, the engine's copy)
        self._error: ExecutorError | None = None  # the engine's error, as raised
        self._results: dict[int, Any] = {}  # results of ops run here (data-dependent ones)

    # -- the interface of executor.Executor ---------------------------------------------------
    @property
    def error(self) -> ExecutorError | None:
        if self._error is None and self._e.error_kind:
            self._error = self._engine_error()
        return self._error

    submitted = property(lambda self: self._submitted)

    @property
    def alive(self) -> bool:
        return self._e.alive

    def value(self, vid: int) -> Any:
        """The tensor of value ``vid`` (None if it is not in the table); after a wait."""
        return self._e.value(vid)

    def take_result(self, op_index: int) -> Any:
        """The Python result of a data-dependent op (``keep_result``), after waiting for it."""
        if op_index in self._results:
            return self._results.pop(op_index)
        return self._e.take_result(op_index)

    def away(self, vid: int | None = None) -> bool:
        """Nothing is ever dropped or parked here (no memory budget)."""
        return False

    def stats(self) -> ExecutorStats:
        failed, wrote = self._e.take_out_reports()
        stream._NOT_IN_PLACE.update(failed)
        stream._IN_PLACE.update(wrote)
        done, busy, peak, hits, misses, blocks, ops, ahead = self._e.counters
        return ExecutorStats(
            submitted=self._submitted, done=done, busy_seconds=busy, peak_bytes=peak, arena_hits=hits,
            arena_misses=misses, blocks=blocks, native_ops=ops, run_ahead=RunAhead(*ahead), recomputed=0,
            offloaded=0, copy_wait_seconds=0.0,
        )  # fmt: skip

    def submit(self, ins: Instruction) -> int:
        """Queue an instruction; returns its position (wait for it with :meth:`wait`)."""
        e = self._e
        kind = type(ins)
        if kind is Run:
            self._where[ins.op_index] = ins.location
            if not e.run(ins, ins.deferred, stream._NOT_IN_PLACE):
                return self._run_here(ins)
            self._submitted += 1
            if ins.deferred and not self._open:
                self._open = self._submitted
            return self._submitted
        if kind is Free:
            e.free(ins.vids)
        elif kind is Launch:
            e.launch(self._plan(ins.block))
            self._open = 0
        elif kind is Follow:
            e.follow(self._plan(ins.block), ins.bound)
        elif kind is FreeRange:
            e.free_range(ins.lo, ins.hi)
            self._where.clear()
        elif kind is ResetPeak:
            e.reset_peak(ins.arena)
        else:
            raise TypeError(
                f"the native executor does not take {kind.__name__} (memory budgets run on the Python executor)"
            )
        self._submitted += 1
        return self._submitted

    def wait(self, position: int, timeout: float) -> None:
        """Block until the instruction at ``position`` (1-based) has run (the GIL released).

        Raises the executor's error, :class:`ExecutorDied`, or :class:`ExecutorTimeout`. A
        wait for deferred ops launches their block first (in submission order: the skeleton
        launches it with its plan before it waits)."""
        if self._open and position >= self._open:
            position = max(position, self.submit(Launch()))
        e = self._e
        if e.done < position:
            status = e.wait(position, timeout)
            if status == _TIMED_OUT:
                raise ExecutorTimeout(
                    f"the executor did not finish the pending ops within {timeout:g} s "
                    f"({e.done} of {position} instructions done)"
                )
            if status != _DONE:
                raise ExecutorDied(f"the executor thread stopped with {position - e.done} instructions pending")
        else:  # (a wait lets go of the tensors Python holds that the engine laid aside)
            e.exhume()
        err = self.error
        if err is not None:
            raise err

    def drain(self, timeout: float) -> None:
        """Wait for everything submitted so far."""
        self.wait(self._submitted, timeout)

    def clear_error(self) -> None:
        """Forget the error of the last op run, so the ops submitted next run (only once
        everything submitted is done: ops queued behind the failed one were skipped)."""
        if self._e.done < self._submitted:
            raise RuntimeError("clear_error() with instructions pending")
        self._e.clear_error()
        self._error = None

    def reset(self) -> None:
        """Forget values and errors; a dead or stuck engine is replaced by a fresh one."""
        self._open = 0
        self._error = None
        self._results.clear()
        self._where.clear()
        if self._e.done < self._submitted or not self._e.alive:
            self._e.signal("stop")  # a stuck thread exits when (if) it gets here
            self._e = self._mod.Engine(torch.get_num_threads())
            self._submitted = 0
        else:
            self._e.clear()

    def inject_fault(self, kind: str) -> _Release:
        """Test hook: the thread ``"die"`` s, ``"raise"`` s or ``"hang"`` s when it gets here."""
        self._e.signal(kind)
        self._submitted += 1
        return _Release(self._e)

    def close(self, timeout: float = 0.0) -> None:
        """Stop the thread after what it was given; wait up to ``timeout`` seconds for that."""
        self._e.signal("stop")
        if timeout > 0:
            self._e.join(timeout)

    # -- inside -----------------------------------------------------------------------------
    def _plan(self, block: Block | None) -> Any:
        """The engine's copy of a planned block (made once per Block object)."""
        if block is None:
            return None
        kept = self._plans.get(id(block))
        if kept is not None and kept[0] is block:
            return kept[1]
        if len(self._plans) >= _PLANS_KEPT:
            self._plans.clear()
        plan = self._mod.Plan(list(block.order), list(block.new_bytes))
        self._plans[id(block)] = (block, plan)
        return plan

    def _engine_error(self) -> ExecutorError:
        """The error of the engine's failed op, as the Python executor reports it (an op Python
        ran here that raised set ``_error`` itself)."""
        e = self._e
        if e.error_kind == _INJECTED:
            return ExecutorError("injected fault")
        try:
            e.raise_failure()
        except BaseException as exc:  # noqa: BLE001 - reported to the skeleton's thread
            cause = exc
        index = e.error_op_index
        err = ExecutorError(
            f"{e.error_func} failed on the executor: {type(cause).__name__}: {cause}", index, self._where.get(index)
        )
        err.__cause__ = cause
        return err

    def _run_here(self, ins: Run) -> int:
        """Run an op the engine cannot call, in Python, after everything submitted before it
        (its block launched first: it then runs as issued), and hand its results to the
        engine. Its position."""
        if self._open:
            self.submit(Launch())
        status = self._e.wait(self._submitted, 3600.0) if self._e.done < self._submitted else _DONE
        if status != _DONE or self.error is not None:
            # not run: the skeleton raises the error or the death when it waits (a Free of
            # nothing holds its position)
            self._e.free(())
            self._submitted += 1
            return self._submitted
        args, kwargs = list(ins.args), dict(ins.kwargs)
        for arg, item, vid in ins.refs:
            box = kwargs if isinstance(arg, str) else args
            t = self._e.value(vid)
            if item < 0:
                box[arg] = t
            else:
                box[arg] = list(box[arg])
                box[arg][item] = t
        try:
            with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.set_grad_enabled(ins.grad_mode):
                with torch._C._AutoDispatchBelowADInplaceOrView():
                    out = ins.func(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the skeleton's thread
            self._error = stream._failed(ins, exc)
            self._e.signal("fail")  # (the ops after it are skipped, as after an engine error)
            self._submitted += 1
            return self._submitted
        if ins.keep_result:
            self._results[ins.op_index] = out
        self._e.put(list(ins.outs), _flatten(out)[: len(ins.outs)], list(ins.moves), (*args, *kwargs.values()))
        self._submitted += 1
        return self._submitted


def make_executor(name: str = "coexec-executor", budget: bool = False) -> Executor | NativeExecutor:
    """The executor for steps with (``budget``) or without a memory budget: the native one where
    the native module is built and the step has no budget, else the Python one."""
    built = None if budget else native.ready()
    return NativeExecutor(built, name) if built is not None else Executor(name)


__all__ = ["NativeExecutor", "make_executor"]
