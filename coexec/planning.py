"""Planning off the step's critical path (issue 14: "Planning must never stall a step").

After a new trace a program's plans (its arena and, under a memory budget, what to drop,
recompute and offload) are made again over every observed path. That takes from milliseconds to
seconds, so it runs here, on one background thread, while the program's steps go on: a step
uses the newest plan that has arrived when it starts (:meth:`coexec.tape.Program.collect`),
or none (the allocator, in issue order). Under a memory budget a co-executed step never runs
on a plan that has not seen every observed path: it waits for the plan (``debug`` says so).

:func:`make_plan` is a pure function from a :class:`PlanRequest` to a :class:`PlanResult`:
requests carry the paths (``planner.PathInput``: each trace with the site of each op and the
ops the executor can write into the arena, found when the path was observed, on the step's
thread: the TraceGraph is never read here, so steps may merge into it meanwhile).
"""

from __future__ import annotations

import atexit
import gc
import queue
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from planner import BudgetTooSmall, InvalidPlan, PathInput, Schedule, Settings, plan_program

from .arena import sweep_every

if TYPE_CHECKING:
    from .plan_process import PlanProcess


SWITCH_INTERVAL = 2e-4


@dataclass(frozen=True)
class PlanRequest:
    """Plan these paths with these settings (a tape's ``memory_budget``, ``offload`` and
    ``arena``); ``number`` orders a program's requests (a newer plan replaces an older one)."""

    number: int
    paths: tuple[PathInput, ...]
    budget: int | None
    offload: bool | None
    arena: bool
    bandwidth: Any = None  # planner.Bandwidth when offloading (None: measured here)
    steps: tuple[int, ...] = ()  # per path: the step its trace came from (TapeStats.planned_for_step)


@dataclass(frozen=True)
class PlanResult:
    """What planning a :class:`PlanRequest` gave: the plan, or why there is none."""

    request: PlanRequest
    schedule: Schedule | None = None  # None: steps run unplanned (the allocator, issue order)
    budget_error: tuple | None = None  # BudgetTooSmall's arguments: no plan meets the budget
    invalid: str | None = None  # the plan failed the simulator's validation: why
    error: BaseException | None = None  # planning itself failed (a bug: said, never hidden)
    seconds: float = 0.0
    pid: int | None = None  # the process that made it (coexec/plan_process.py), if not this one
    # CPU seconds the training process spent on it, garbage collections left out: the step's
    # thread pickling new paths as it asked, the planner thread sending the request and
    # reading the plan (holding the GIL beside the steps; all of planning when made here)
    local_seconds: float = 0.0


def make_plan(req: PlanRequest) -> PlanResult:
    """The plan for ``req`` (``planner.plan_program``). Errors are results, not exceptions:
    they reach the step's thread with the plan."""
    from executor import measure_bandwidth

    from .budget import step_device

    t0 = time.perf_counter()
    try:
        traces = [p.trace for p in req.paths]
        device = step_device(traces)
        bandwidth = None
        if req.budget is not None:
            offload = device.type == "cuda" if req.offload is None else req.offload
            bandwidth = (req.bandwidth or measure_bandwidth(device)) if offload else None
        settings = Settings(
            budget=req.budget,
            bandwidth=bandwidth,
            # the arena on a GPU: not yet under a budget (docs/planner.md, Known limits)
            arena=req.arena and (req.budget is None or device.type == "cpu"),
            sweep_lag=sweep_every(req.budget),
        )
        try:
            schedule = plan_program(req.paths, settings)
        except BudgetTooSmall as e:
            # kept as its arguments: the exception's traceback would keep frames alive
            error = (e.budget, e.smallest, e.detail)
            return PlanResult(req, budget_error=error, seconds=time.perf_counter() - t0)
        except InvalidPlan as e:
            return PlanResult(req, invalid=str(e), seconds=time.perf_counter() - t0)
        return PlanResult(req, schedule=schedule, seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  (handed to the step's thread, which says so)
        return PlanResult(req, error=e, seconds=time.perf_counter() - t0)


_GC = threading.local()  # per thread: CPU seconds spent in garbage collections so far


def _time_collections(phase: str, info: dict) -> None:
    now = time.thread_time()
    if phase == "start":
        _GC.started = now
    else:
        _GC.seconds = getattr(_GC, "seconds", 0.0) + now - getattr(_GC, "started", now)


gc.callbacks.append(_time_collections)


def _cpu_seconds() -> float:
    """This thread's CPU time without its garbage collections: a full collection (0.2-0.3 s
    with a few REINFORCE traces alive) runs in whichever thread allocates when it is due, and
    the objects it walks are the traces, there with or without plans (docs/coexec.md)."""
    return time.thread_time() - getattr(_GC, "seconds", 0.0)


class Planner:
    """One daemon thread making plans in the order they were asked for. A request that is
    still queued when its program asks again is dropped (:meth:`Future.cancel`)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._unfinished: set[Future] = set()
        self._closed = False
        self._process: PlanProcess | None = None  # its child started by prepare() or a plan
        self._in_process = False  # the planning process failed: plans are made here

    def submit(self, req: PlanRequest) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.cancel()
                return future
            self._unfinished.add(future)
            future.add_done_callback(self._unfinished.discard)
            self._ensure_thread()
        t0 = _cpu_seconds()
        if not self._in_process:
            child = self._child()
            for path in req.paths:
                try:
                    child.encode(path)
                except Exception:  # noqa: BLE001  (the planner thread tries again and says why)
                    break
        self._queue.put((future, req, _cpu_seconds() - t0))
        return future

    def prepare(self) -> None:
        """Start the planning process now, before the first plan is asked for: it takes a
        second or two to import torch, on another core, and the first step (traced) runs
        meanwhile; started with the first plan instead, the step after it ran up to ~0.1 s
        slower and its plan came that much later."""
        with self._lock:
            if self._closed or self._in_process or (self._process and self._process.pid):
                return
            self._ensure_thread()
        self._queue.put((None, None, 0.0))

    def _child(self) -> PlanProcess:
        from .plan_process import PlanProcess

        with self._lock:
            if self._process is None:
                self._process = PlanProcess()
            return self._process

    def _ensure_thread(self) -> None:  # under self._lock
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="coexec-planner", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every plan asked for so far is made; False if ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [f for f in self._unfinished if not f.done()]
            if not pending:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                pending[0].result(left)
            except Exception:  # noqa: BLE001  (the step that collects it says what went wrong)
                pass

    def close(self) -> None:
        """At exit: make no more plans (one being made is abandoned with its daemon thread),
        and stop the planning process."""
        with self._lock:
            self._closed = True
            for f in list(self._unfinished):
                f.cancel()
        if self._process is not None:
            self._process.close()

    def _run(self) -> None:
        while True:
            self._serve(*self._queue.get())

    def _serve(self, future: Future | None, req: PlanRequest | None, encoded: float) -> None:
        """One item of the queue; ``encoded``: CPU seconds :meth:`submit` spent on it. Its
        request is let go of on return: kept while this thread waited for the next one, a
        dropped program's traces (the request held the last references) were freed here
        later, ~50 ms beside a step of another program."""
        if future is None:  # prepare(): start the planning process
            self._start_process()
            return
        if not future.set_running_or_notify_cancel():
            return
        try:
            t0 = _cpu_seconds()
            result = self._make(req)
            future.set_result(replace(result, local_seconds=encoded + _cpu_seconds() - t0))
        except BaseException as e:  # noqa: BLE001  (never leave a step waiting)
            future.set_exception(e)

    def _start_process(self) -> None:
        if self._in_process or self._closed:
            return
        try:
            self._child().start()
        except OSError:
            pass  # the first plan tries again, and says so if it cannot

    def _make(self, req: PlanRequest) -> PlanResult:
        """In the planning process if it works, else here (sharing the GIL with the steps:
        the switch interval is shortened so a step waits less for it)."""
        from .plan_process import PlanProcessError

        if not self._in_process:
            try:
                return self._child().plan(_measured(req))
            except PlanProcessError as e:
                self._in_process = True
                if self._closed:  # at exit: the process was stopped under this plan
                    return PlanResult(req, error=e)
                warnings.warn(
                    f"coexec: the planning process failed ({e}); plans are made in this process "
                    "from now on, and steps run slower while a plan is made",
                    RuntimeWarning,
                    stacklevel=1,
                )
        before = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        try:
            return make_plan(req)
        finally:
            sys.setswitchinterval(before)


def _measured(req: PlanRequest) -> PlanRequest:
    """``req`` with the copy bandwidth measured here, where the step's device is (the
    planning process never touches a device)."""
    from executor import measure_bandwidth

    from .budget import step_device

    if req.budget is None or req.bandwidth is not None or not req.paths:
        return req
    device = step_device([p.trace for p in req.paths])
    offload = device.type == "cuda" if req.offload is None else req.offload
    return replace(req, bandwidth=measure_bandwidth(device)) if offload else req


PLANNER = Planner()
atexit.register(PLANNER.close)


def wait_for_plans(timeout: float | None = None) -> bool:
    """Wait until the plans asked for so far are made (every program, every ``with``); the
    next step of each program then runs on its newest plan. Steps never need this: it is for
    measurements and tests that want the planned steps from a known step on. Returns False if
    ``timeout`` (seconds) ran out first. On the native backend: the memory plans its budgets
    asked for (``coexec/native_plans.py``)."""
    from .native_plans import wait_for_native_plans

    deadline = None if timeout is None else time.monotonic() + timeout
    if not PLANNER.wait(timeout):
        return False
    return wait_for_native_plans(None if deadline is None else max(0.0, deadline - time.monotonic()))
