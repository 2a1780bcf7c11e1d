"""``GradientTape``: the context manager a training step runs in.

A *program* (TraceGraph, phase, statistics, plans) is kept per code location of the ``with``
statement and per model: ``with coexec.GradientTape() as tape:`` written inside the loop (a new
tape each step, as with ``tf.GradientTape``) and a tape created once and reused share it, and
one ``with`` running several models (a sweep through one ``train()`` helper) keeps one
program per model, told apart by the parameters its steps read (``coexec/programs.py``).

Which backend runs a tape: ``GradientTape``'s docstring, docs/coexec.md *Two backends*. The
native backend's steps: ``_NativeStep`` (``executor/capture.py``). The interpret backend's
phases (DESIGN.md §1): **tracing** runs the step eagerly while recording it, until a step's
trace is already covered by the graph; **coexec** runs the step as a skeleton with the
executor; a step that leaves the graph falls back to eager for its rest, and its trace is
merged. After ``max_traces`` new traces a program stays **eager** and says why, once.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from executor import ExecutorDied, ExecutorError, ExecutorTimeout, RunAhead, native
from planner import BudgetTooSmall, PathInput, Schedule, format_bytes, plan_program
from tracegraph import Cursor, Recorder, TraceGraph
from tracegraph.location import CODES
from tracegraph.reasons import UNTRACED, FallbackReason, why_new
from tracegraph.recorder import loops_around

from . import collector, observe, programs, runtime
from .arena import iterations, sites, writable_ops
from .blocks import BlockIndex
from .causes import max_traces_message
from .errors import CoexecUsageError
from .gradients import GradientBlocks, SavedTensors
from .host_memory import keep_freed_host_memory
from .native_plans import NativeBudget
from .native_traces import NativeTraces
from .placeholder import install_for_placeholders
from .planning import PLANNER, PlanRequest, PlanResult
from .skeleton import Session, Skeleton, raise_executor_error

PHASES = ("tracing", "coexec", "eager")
REASONS = 10  # fallback / new-trace reasons kept per program (TapeStats.fallback_reasons)
SYNC_POLICIES = ("step", "none")
BACKENDS = ("auto", "interpret", "native")


@dataclass
class TapeStats:
    """What a program has done so far (shared by every tape of one ``with`` statement)."""

    steps: int = 0
    # traces that added to the TraceGraph (interpret: tracing phase and fallbacks; native: its
    # traced steps, coexec/native_traces.py)
    traces: int = 0
    fallbacks: int = 0  # co-executed steps that left the graph and finished eagerly
    coexec_steps: int = 0  # steps co-executed from start to end
    phase: str = "tracing"  # the phase the NEXT step runs in
    # the phase the step that just ran ran in ("" before any): "tracing", "coexec" (also when
    # it fell back to eager part way: see fallbacks), or "eager" (after max_traces)
    last_phase: str = ""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    last_fallback: str | None = None  # why the latest fallback happened
    # the latest 10 reasons, oldest first, as "step 7: ..." (steps counted from 0): why a
    # co-executed step fell back, why a tracing step's trace was new (tracegraph.reasons)
    fallback_reasons: tuple[str, ...] = ()
    # where co-executed steps spent their time (Terra Fig. 3.11): the skeleton waiting on the
    # executor (fetches, the end of the step), and the executor computing
    stall_seconds: float = 0.0
    executor_seconds: float = 0.0
    last_ops: int = 0  # ATen ops in the latest step
    # device memory of the latest co-executed step: persistent state plus the executor's
    # peak of live bytes, the arena counted whole (measured; native backend, under a budget: the
    # state the step found and the bytes it made at their most, 0 without a budget), and the
    # plan's prediction for the path it took (None: no plan, or a path no plan has seen yet)
    peak_bytes: int = 0
    planned_peak_bytes: int | None = None
    planned_blocks: int = 0  # blocks of the latest co-executed step run in a planned order
    # of the latest co-executed step: its ops computed on a thread without the GIL (interpret
    # backend: by the native engine; native backend: by the capture's worker, which is every op
    # but those run at once on the step's thread: reads, misses, ops inside a catching try)
    native_ops: int = 0
    # native backend: steps that ran eagerly, exactly as eager, because another thread's step was
    # being captured as they began (one step is captured at a time in a process)
    beside_steps: int = 0
    # native backend: steps that called a ``torch.compile``d region, captured up to it and eager,
    # exactly as eager, from it to their end (its compiling and compiled code run as without coexec)
    compiled_steps: int = 0
    # of the latest co-executed step: its backward() calls issued as known gradient blocks,
    # without the autograd engine (coexec/gradients.py; native: native/capture_blocks.h)
    gradient_blocks: int = 0
    # of the latest co-executed step: its torch-level calls issued from call templates,
    # without going through the dispatcher (coexec/calls.py)
    templated_calls: int = 0
    # of the latest co-executed step: its fetches answered by the skeleton without waiting
    # (tiny CPU tensors it computed too, such as an optimizer's step counter: coexec/mirrors.py)
    mirrored_fetches: int = 0
    # of the latest co-executed step: its deferred ops run ahead of their block's launch or
    # at it, and where running ahead had to wait (docs/coexec.md, *Blocks*)
    run_ahead: RunAhead = RunAhead()
    # which planned path it took (tape.report()'s row; native backend: the plan it followed to
    # its end, numbered as paths were first planned), if one
    planned_path: int | None = None
    # the step whose trace that path's plan was made from: the sizes it covers (a step of the
    # path that allocates more, where sizes vary, is planned again: _check_plan)
    planned_for_step: int | None = None
    recomputed_ops: int = 0  # ops the executor ran again in the latest step (memory budget)
    recompute_seconds: float = 0.0  # their time (native backend: the plan expected its extra_seconds)
    offloaded_storages: int = 0  # storages parked on the host in the latest step
    arena_placed: int = 0  # native backend, arena=True: storages the latest step put in the arena
    copy_wait_seconds: float = 0.0  # of the latest step: the executor waiting for copies
    # the latest co-executed step from entry to its end (drained), and the plan's prediction
    step_seconds: float = 0.0
    planned_step_seconds: float | None = None
    over_budget_steps: int = 0  # co-executed steps over the budget (paths not yet planned, larger steps)
    # interpret backend: steps the executor's guard held within the budget (executor/guard.py:
    # steps larger than their plan, from their first op larger than planned; steps without a
    # plan), and the values it dropped in the latest step
    guarded_steps: int = 0
    guard_drops: int = 0
    # plans are made in the background (coexec/planning.py): the observed paths the plan in
    # use has seen (native backend: the paths with a plan), and the time steps spent asking for
    # plans, taking them, or waiting for one (only under a memory budget)
    planned_paths: int = 0
    plan_wait_seconds: float = 0.0
    # CPU seconds this process spent on the plans made, garbage collections left out: pickling
    # new paths for the planning process (on the step's thread, as it asks) and sending
    # requests and reading plans (on the planner thread, beside the steps)
    plan_local_seconds: float = 0.0
    # plans made (also those never used) and the planner's wall time on them, in the planning
    # process or here (issue 17 compares it between sizes that vary and fixed ones)
    plans_made: int = 0
    planning_seconds: float = 0.0


class Program:
    """Everything kept for one model's steps at one ``with`` statement."""

    def __init__(self, code: Any, where: str, index: int = 1) -> None:
        self.code = code  # keeps the code object (and so the registry key) alive
        self.where = where
        self.index = index  # the n-th program made at this ``with`` (one per model)
        self.family_key: Any = None  # its ``with`` location (or key) in coexec.programs
        self.params: dict[int, Any] = {}  # id -> weak reference: the parameters it claimed
        self.graph = TraceGraph()
        self.stats = TapeStats()
        self.capped = False
        self.paths: list[PathInput] = []  # the observed paths, as the planner takes them
        self.shapes: dict[tuple, list[int]] = {}  # loop_shape() -> the paths of that shape
        self.path_steps: list[int] = []  # per path: the step its trace came from
        self.plan: PlanRequest = PlanRequest(0, (), None, None, False)  # what the plan in use was made of
        self.needed = 0  # the number of the plan request a budgeted step waits for (plan_current)
        # plans asked for because a path's step allocated more (grow_path): steps do not wait
        # for them, and one that cannot meet the budget leaves the plan in use
        self.grow_requests: set[int] = set()
        self.unplannable: dict[int, int] = {}  # path -> bytes of a step no plan met the budget for
        self.schedule: Schedule | None = None  # the plan in use (None: unplanned, issue order)
        self.arena: torch.Tensor | None = None  # its arena, allocated whole
        self.block_index: BlockIndex | None = None  # its blocks, for the skeleton (coexec/blocks.py)
        self.arena_outs: dict = {}  # its arena placements per op (Session.arena_outs)
        self.gradient_blocks = GradientBlocks()  # its backward calls' blocks
        self.native_budget: NativeBudget | None = None  # under a budget on the native backend
        self.native_traces = NativeTraces()  # which native steps are traced (coexec/native_traces.py)
        self.budget: int | None = None
        self.state_bytes = 0  # the state its latest step found: a budgeted step's guard counts it
        self.site_bytes: dict = {}  # under a budget, per site the most its op made in the planned steps
        self.budget_error: tuple | None = None  # BudgetTooSmall's arguments
        self.plan_failure: str | None = None  # planning to the budget failed (a bug): why
        self.offload: bool | None = None  # the tape's offload setting the plans are made with
        self.use_arena: bool | None = None  # the tape's arena setting the plans are made with
        self.requested = 0  # plans asked for (coexec/planning.py), numbered
        self.installed = 0  # the number of the plan in use
        self.latest: Future | None = None  # the latest plan asked for, until it is used
        self.futures: list[Future] = []  # plans asked for and not yet used or dropped
        self.released = False
        self.plan_pid: int | None = None  # the process that made the plan in use (None: this)
        self.reasons: list[tuple[int, FallbackReason]] = []  # the latest REASONS, with steps

    # -- plans (made in the background: coexec/planning.py) ------------------------------
    def add_path(self, trace: Any, path_sites: tuple, step: int) -> None:
        """A path observed at ``step``: its trace, the site of each op, and which ops can write
        into the arena (probed now, on the step's thread)."""
        self.paths.append(PathInput(trace, path_sites, writable_ops(trace)))
        self.path_steps.append(step)
        self.shapes.setdefault(loop_shape(path_sites), []).append(len(self.paths) - 1)

    def grow_path(self, path: int, trace: Any, size: int, step: int, sites: tuple) -> bool:
        """A covered step of planned ``path`` (or of its loop shape, with ``sites`` of its own)
        that allocated ``size`` bytes, more than the trace the path was planned from: it
        replaces that trace (plans are made for the largest sizes seen, which cover the smaller
        ones), unless a plan for steps as large could not meet the budget. Did it?"""
        if size >= self.unplannable.get(path, size + 1):
            return False
        self.paths[path] = PathInput(trace, sites, writable_ops(trace))
        self.path_steps[path] = step
        return True

    def request_plan(
        self, budget: int | None, offload: bool | None, arena: bool, grown: bool = False
    ) -> str | None:
        """Ask for plans over every observed path: to the budget if there is one, with
        ``offload`` (park storages on the host too; None: when the step runs on a GPU), and
        the arena if ``arena`` (under a budget the budget plan places it, on a CPU). Plans of
        other settings stop counting at once; plans of the same settings are used until the
        new ones arrive (:meth:`collect`). ``grown``: asked for because a planned path's step
        allocated more (no step waits for it). Returns a line for the debug log."""
        settings = (budget, offload, arena)
        if settings != (self.budget, self.offload, self.use_arena):
            self.budget, self.offload, self.use_arena = settings
            self.budget_error, self.plan_failure = None, None
            self.stats.planned_paths = 0
            self._use_schedule(None)
        self.requested += 1
        if grown and self.plan_current:
            self.grow_requests.add(self.requested)
        else:
            self.needed = self.requested
        if self.latest is not None:
            self.latest.cancel()  # still queued: never made (its paths are in this request)
        req = PlanRequest(self.requested, tuple(self.paths), *settings, steps=tuple(self.path_steps))
        if not self.paths or (budget is None and not arena):
            self.latest = None
            self._install(PlanResult(req))
            return None
        self.latest = PLANNER.submit(req)
        self.latest.add_done_callback(self._count_local_seconds)
        self.futures.append(self.latest)
        what = f"memory budget {format_bytes(budget)}" if budget is not None else "arena"
        return f"planning {len(self.paths)} path(s) in the background ({what})"

    def stop_planning(self) -> None:
        """The program stays eager: drop the plan in use (its arena's memory) and those asked
        for but not begun."""
        for f in self.futures:
            f.cancel()
        self.futures, self.latest = [], None
        self._use_schedule(None)

    def _count_local_seconds(self, done: Future) -> None:
        # on the planner thread, as each plan is made (also those never used)
        if not done.cancelled() and done.exception() is None:
            result = done.result()
            self.stats.plan_local_seconds += result.local_seconds
            self.stats.plans_made += 1
            self.stats.planning_seconds += result.seconds

    @property
    def plan_current(self) -> bool:
        """Do the plans in use cover every observed path, with the latest settings? (A plan
        asked for because a path's step was larger need not have arrived.)"""
        return self.installed >= self.needed

    def collect(self, wait: bool) -> list[str]:
        """Use the newest plan that has arrived (between steps, on the step's thread); with
        ``wait``, first wait for the latest one asked for. Returns lines for the debug log."""
        if self.released:
            return []
        lines = []
        if wait and self.latest is not None and not self.plan_current:
            lines.append(
                f"waiting for the plan of {len(self.paths)} path(s): under a memory budget a "
                "step co-executes only on a plan that has seen every observed path"
            )
            self.latest.result()
        done = [f for f in self.futures if f.done() and not f.cancelled()]
        self.futures = [f for f in self.futures if not f.done()]
        settings = (self.budget, self.offload, self.use_arena)
        results = [f.result() for f in done]
        fresh = [
            r for r in results
            if r.request.number > self.installed
            and (r.request.budget, r.request.offload, r.request.arena) == settings
        ]  # fmt: skip
        if fresh:
            result = max(fresh, key=lambda r: r.request.number)
            lines.append(self._install(result))
        return lines

    def _install(self, result: PlanResult) -> str:
        """Use ``result``'s plans from the next step on; a plan that failed is said, never
        used: without a budget the steps run without an arena, under one they cannot run."""
        req = result.request
        if result.budget_error is not None and req.number in self.grow_requests:
            return self._keep_smaller_plan(result)
        self.installed, self.stats.planned_paths = req.number, len(req.paths)
        self.plan = req
        self.plan_pid = result.pid
        self.budget_error = result.budget_error
        self.plan_failure = None
        where = f"the step at {self.where}"
        if result.invalid is not None:
            warnings.warn(
                f"coexec: the plan for {where} failed validation ({result.invalid}); "
                "its steps run unplanned",
                RuntimeWarning,
                stacklevel=5,
            )
        if result.error is not None:
            e = result.error
            if req.budget is not None:
                self.plan_failure = f"{type(e).__name__}: {e}"
            else:
                warnings.warn(
                    f"coexec: planning the step at {where} failed ({type(e).__name__}: {e}); "
                    "its steps run unplanned",
                    RuntimeWarning,
                    stacklevel=5,
                )
        self._use_schedule(result.schedule)
        line = f"plan of {len(req.paths)} path(s) ready after {result.seconds:.2f} s"
        if result.schedule is not None:
            line += f": {result.schedule.summary()}"
        elif result.budget_error is not None:
            line += f": {BudgetTooSmall(*result.budget_error)}"
        return line

    def _keep_smaller_plan(self, result: PlanResult) -> str:
        """A plan asked for because a path's step allocated more cannot meet the budget: the
        plan in use stays (steps that large may go over the budget, and are counted), the paths
        go back to the traces it was made from, and steps as large ask for no plan again."""
        used = self.plan
        for i, (new, old) in enumerate(zip(result.request.paths, used.paths)):
            if new is old:
                continue
            self.unplannable[i] = min(self.unplannable.get(i, 1 << 62), _allocated_bytes(new.trace))
            if self.paths[i] is new:
                self.paths[i], self.path_steps[i] = old, used.steps[i]
        error = BudgetTooSmall(*result.budget_error)
        warnings.warn(
            f"coexec: a step at {self.where} allocated more than the steps its plan was made for "
            f"(sizes that vary), and no plan for its sizes meets the memory budget ({error}); "
            "the plan in use stays, and steps that large may go over the budget (counted in "
            "tape.stats.over_budget_steps)",
            RuntimeWarning,
            stacklevel=5,
        )
        return f"the plan for larger steps cannot meet the budget: {error}"

    def release(self) -> None:
        """Dropped (coexec.programs): let go of the graph, the plans and the arena, and of
        plans still being made (they never attach). The statistics stay, for a tape that ran
        the program to report."""
        self.released = True
        for f in self.futures:
            f.cancel()
        self.futures, self.latest = [], None
        self.graph = TraceGraph()
        self.native_traces = NativeTraces()
        self.paths, self.path_steps = [], []
        self.plan = PlanRequest(0, (), None, None, False)
        self.schedule, self.arena, self.block_index = None, None, None
        self.params = {}

    def _use_schedule(self, schedule: Schedule | None) -> None:
        """The plan from the next step on, with its arena, allocated once up front at exactly
        the planned size (it counts whole)."""
        self.schedule = schedule
        budgeted = schedule is not None and schedule.budget is not None
        self.site_bytes = _site_bytes(self.plan.paths) if budgeted else {}
        self.block_index = BlockIndex(schedule.blocks) if schedule is not None and schedule.blocks else None
        self.arena_outs = {}
        if schedule is None or schedule.arena_bytes == 0:
            self.arena = None
        elif self.arena is None or self.arena.numel() != schedule.arena_bytes:
            self.arena = torch.empty(schedule.arena_bytes, dtype=torch.uint8)


_programs = programs._families  # ``with`` location (or ("key", key)) -> its programs
_local = threading.local()  # .tape: the tape whose block is running in this thread


class GradientTape:
    """Run a training step with coexec; drop-in for a ``tf.GradientTape``-style block.

    >>> tape = coexec.GradientTape()
    >>> for x, y in loader:
    ...     with tape:
    ...         loss = loss_fn(model(x), y)
    ...         tape.gradient(loss, model.parameters())   # or loss.backward()
    ...         optimizer.step()
    ...     print(loss.item())

    Options: ``max_traces`` (new traces after which the program stays eager), ``sync``
    (``"step"``: wait for the step's work when the block exits, the default; ``"none"``: let it
    run on, call :func:`coexec.synchronize` before reading model state outside a step; a native
    step ends with its values computed either way),
    ``backend`` (``"auto"``, the default: ``"native"`` on a machine without a GPU where the
    native module builds and no option below needs ``"interpret"``, else ``"interpret"``;
    ``tape.backend`` says which runs; ``"native"``: every step's ATen ops answered by a C++
    kernel and computed by a C++ worker, ``executor/capture.py``: CPU steps only, a
    TraceGraph from its traced steps; a ``memory_budget`` is met by
    recomputation, and with ``offload=True`` by parking storages in a host pool; ``arena=True``
    puts a described step's storages in one arena, ops as issued (under a budget, those the
    budget's plan does not drop, the arena counted whole in it; with offloading too, the
    interpret backend's); steps run eagerly until the native module is built, and while another
    thread's step is being captured (one at a time in a process: ``stats.beside_steps``), and
    from a ``torch.compile``d region's call to the step's end (``stats.compiled_steps``);
    docs/coexec.md, *Capture*; ``"interpret"``: traced into a TraceGraph, co-executed by the Python skeleton
    with plans: the GPU path, arenas, offloading), ``timeout`` (seconds any wait on the
    executor may take before it becomes an error), ``debug`` (print phase changes, fallbacks
    and budget plans to stderr), ``key`` (a hashable naming the program explicitly; by default
    a program is the code location of the ``with`` statement, so a generic training function
    used for two models can give each its own key), ``arena`` (without a budget: co-executed steps run in the planned
    order, block by block, and write planned outputs into one preallocated arena (the native
    backend: in the issue order); False: ops
    run as issued, every output from the allocator; under a budget: the arena is planned with
    it; ``None``, the default: on without a budget on the interpret backend, off under one, where planning the arena
    jointly takes several times longer: docs/planner.md, and off on the native backend), ``memory_budget`` (bytes, or a
    string like ``"6GB"`` or ``"512MiB"``: the device memory a co-executed step may use at its
    peak, persistent state included; activations are dropped and recomputed to stay within it,
    and a budget no plan can meet raises :class:`planner.BudgetTooSmall` naming the
    smallest feasible one. Tracing steps run eagerly, at eager's peak. With ``arena=True``
    under a budget on a CPU, the arena is planned with the budget and counts whole in it; on a
    GPU budgeted steps allocate without it for now), ``offload`` (under a budget, also park activations
    in a host pool across their idle stretch, planned at the copy bandwidth measured on the
    machine and copied on a stream or thread beside the compute (the native backend: on its
    worker, between ops); ``None``, the default: when the step runs on a GPU).
    """

    def __init__(
        self,
        *,
        max_traces: int = 10,
        sync: str = "step",
        backend: str = "auto",
        timeout: float = 300.0,
        debug: bool = False,
        key: Any = None,
        arena: bool | None = None,
        memory_budget: int | str | None = None,
        offload: bool | None = None,
    ) -> None:
        if not isinstance(max_traces, int) or isinstance(max_traces, bool):
            raise TypeError(f"max_traces must be an int (new traces before staying eager), got {max_traces!r}")
        if max_traces < 1:
            raise ValueError(f"max_traces must be at least 1, got {max_traces!r}")
        if sync not in SYNC_POLICIES:
            raise ValueError(f"sync must be one of {SYNC_POLICIES}, got {sync!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} (inductor is planned), got {backend!r}")
        from .budget import parse_budget

        budget = None if memory_budget is None else parse_budget(memory_budget)
        if backend == "auto":
            backend = _auto_backend()
            # (chosen while the native module may still be building: each step checks, until
            # the build has ended, that it did not fail)
            self._build_pending = backend == "native"
        else:
            self._build_pending = False
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
            raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if not isinstance(debug, bool):
            raise TypeError(f"debug must be True or False, got {debug!r}")
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                f"key must be hashable (it names the program, like a dict key), got {key!r}; "
                "use a tuple or a string"
            ) from None
        self.max_traces = max_traces
        self.sync = sync
        self.backend = backend
        self.timeout = float(timeout)
        self.debug = debug
        self.key = key
        self.memory_budget = budget
        if offload is not None and not isinstance(offload, bool):
            raise TypeError(f"offload must be True, False or None (automatic), got {offload!r}")
        self.offload = offload
        if arena is not None and not isinstance(arena, bool):
            raise TypeError(f"arena must be True, False or None (on without a budget), got {arena!r}")
        self._arena_asked = arena
        self.arena = self._arena()
        self._thread = threading.get_ident()
        self._program: Program | None = None
        self._step: _Step | _NativeStep | None = None
        self._native_last: tuple[Any, Program] | None = None  # (key, program) of the last native step
        keep_freed_host_memory()  # (freed CPU memory stays for the next step: coexec/host_memory.py)

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> "GradientTape":
        self._check_thread("enter")
        if getattr(_local, "tape", None) is not None:
            raise CoexecUsageError(
                "GradientTape blocks do not nest: a tape is already active in this thread "
                f"(entered at {_local.tape._program.where})"
            )
        frame = sys._getframe(1)
        named = self.key is not None
        key = ("key", self.key) if named else (id(frame.f_code), frame.f_lasti)
        if self.backend == "native" and (self.memory_budget is not None or self.arena) and not native.settled():
            # (a budget is held, and an arena placed, by the capture's worker: a step run
            # eagerly meanwhile would hold what eager holds, unmeasured)
            native.wait()
        if self._build_pending and native.settled():
            self._build_pending = False
            if native.unavailable():
                self._leave_native()
        if self.backend == "native":
            self._step = _NativeStep(
                self._native_program(key, frame), frame, self.max_traces, self.debug, self.memory_budget,
                bool(self.offload),  # (None: on a GPU; the native backend's steps are on the CPU)
                self.arena,
            )  # fmt: skip
            _local.tape = self
            return self
        fam = programs.family(key, named, frame.f_code, lambda: _describe(frame))
        program = fam.choose()
        if program is None:
            program = _new_program(fam)
            if self.arena or self.memory_budget is not None:
                PLANNER.prepare()  # the planning process starts while the first step is traced
        else:
            programs.touch(program)
        self._program = program
        self._plan(program)
        self._step = _Step(self, program, frame, fam)
        _local.tape = self
        return self

    def _arena(self) -> bool:
        """``arena`` as asked, or its default: on without a budget, on the interpret backend."""
        if self._arena_asked is not None:
            return self._arena_asked
        return self.memory_budget is None and self.backend != "native"

    def _leave_native(self) -> None:
        """``backend="auto"`` chose the native backend, whose module then failed to build (its
        warning said why): the interpret backend runs the tape from now on (its executor in
        Python)."""
        self.backend = "interpret"
        self.arena = self._arena()
        self._native_last = None
        if self.debug and self._program is not None:
            _log(
                self._program, "the native module is not available: backend 'interpret' from this step on"
            )
        self._program = None

    def _native_program(self, key: Any, frame: Any) -> Program:
        """The program a native-backend step counts its statistics in: one per ``with`` line
        or key (no traces choose among several), looked up once per tape and line."""
        last = self._native_last
        if last is not None and last[0] == key:
            return last[1]
        fam = programs.family(key, self.key is not None, frame.f_code, lambda: _describe(frame))
        program = fam.choose() or _new_program(fam)
        programs.touch(program)
        self._native_last = (key, program)
        self._program = program
        return program

    def _plan(self, program: Program) -> None:
        """Before a step: plans for this tape's settings, the newest that has arrived (under a
        budget a co-executed step waits for a plan of every observed path); a budget no plan
        meets raises here, before the step changes anything."""
        if program.stats.phase == "eager":
            return  # (it stays eager: no plan is asked for or used)
        t0 = time.perf_counter()
        lines = []
        settings = (self.memory_budget, self.offload, self.arena)
        if (program.budget, program.offload, program.use_arena) != settings:
            lines.append(program.request_plan(*settings))
        wait = program.budget is not None and program.stats.phase == "coexec"
        lines += program.collect(wait)
        if program.budget_error is not None and not program.plan_current:
            # a plan of fewer paths found the budget too small: so will the plan of them all;
            # its figure is the one that holds for every observed path
            lines += program.collect(wait=True)
        program.stats.plan_wait_seconds += time.perf_counter() - t0
        if self.debug:
            for line in lines:
                if line:
                    _log(program, line)
        if program.budget_error is not None:
            budget, smallest, detail = program.budget_error
            ran = "this step has not run (the steps before it ran eagerly while it was planned)"
            raise BudgetTooSmall(budget, smallest, f"{detail}; {ran}" if detail else ran)
        if program.plan_failure is not None:
            raise RuntimeError(
                f"coexec: planning the memory budget of the step at {program.where} failed "
                f"({program.plan_failure}); a co-executed step cannot keep to the budget without "
                "a plan. Please report this with the step's code; memory_budget=None runs it."
            )

    def __exit__(self, et, ev, tb) -> bool:  # noqa: ANN001
        step, self._step = self._step, None
        _local.tape = None
        assert step is not None
        if isinstance(step, _NativeStep):
            step.end(ev)
            if observe.observers:
                _notify(step)
            return False
        try:
            try:
                step.end(ev)
            finally:
                self._program = step.program  # it may have switched program (another model)
                step.family.ran(step.program)
            if observe.observers:  # python -m tracegraph show --record
                _notify(step)
        finally:
            # the collector's thresholds back once the step's objects are gone: the collection
            # then due finds them freed, not alive to be moved to an older generation
            held = step.rec is not None
            del step
            if held:
                collector.release()
        return False

    # -- API ------------------------------------------------------------------------------
    def gradient(
        self,
        target: torch.Tensor,
        sources: torch.Tensor | Iterable[torch.Tensor],
        output_gradients: torch.Tensor | None = None,
        *,
        retain_graph: bool | None = None,
    ) -> Any:
        """Gradients of ``target`` with respect to ``sources`` (a tensor or an iterable, like
        ``model.parameters()``), as ``tf.GradientTape.gradient``: a list (or one tensor),
        None for a source the target does not depend on. Leaf sources also get the gradient
        accumulated into ``.grad``, so a PyTorch optimizer can step next (where ``.grad`` was
        empty it is the returned tensor itself, as ``backward()`` would store it)."""
        self._check_thread("gradient")
        single = isinstance(sources, torch.Tensor)
        srcs = [sources] if single else list(sources)
        if not isinstance(target, torch.Tensor):
            raise TypeError(f"gradient(): target must be a tensor, got {type(target).__name__}")
        if not srcs:
            raise CoexecUsageError("gradient(): sources is empty")
        if output_gradients is None and target.numel() != 1:
            raise CoexecUsageError(
                f"gradient(): the target has shape {tuple(target.shape)}; a non-scalar target "
                "needs output_gradients (the gradient flowing into it, like grad_outputs of "
                "torch.autograd.grad)"
            )
        idx = [i for i, s in enumerate(srcs) if s.requires_grad]
        grads: list[Any] = [None] * len(srcs)
        if idx:
            found = torch.autograd.grad(
                target, [srcs[i] for i in idx], grad_outputs=output_gradients,
                retain_graph=retain_graph, allow_unused=True,
            )  # fmt: skip
            for i, g in zip(idx, found):
                grads[i] = g
        with torch.no_grad():  # accumulate out of place: returned gradients never change later
            for s, g in zip(srcs, grads):
                if g is not None and s.is_leaf:
                    s.grad = g if s.grad is None else s.grad + g
        return grads[0] if single else grads

    @property
    def stats(self) -> TapeStats:
        """A snapshot of the statistics of the program this tape ran last (every step of
        that model at this ``with`` statement, whichever tape ran it)."""
        if self._program is None:
            return TapeStats()
        s = self._program.stats
        return replace(s, seconds=dict(s.seconds))

    def report(self) -> list[dict]:
        """Memory of the program's observed paths, one dict per path (DESIGN.md §6), as the
        simulator measures the plan in use: eager PyTorch's peak (issue order, each storage
        freed when the program let go of it), the planned peak (the planned order, persistent
        state and the whole arena included), the arena and its fragmentation, the blocks run
        in a planned order, the predicted step time. Without a plan in use (``arena=False``, or
        before the first one arrives), the paths are planned now, without a budget. On the native
        backend: the described path's memory plan under a ``memory_budget`` or with
        ``arena=True`` (no blocks: that key is None), once it arrived; nothing without one."""
        program = self._program
        if program is not None and program.native_budget is not None:
            plan = program.native_budget.plan  # (coexec.native_budget: no blocks)
            if plan is None:
                return []
            arena = plan.arena_bytes if plan.placed else None
            return [
                _report_row(
                    0, len(plan.drops.ops), plan.eager_peak, plan.planned_peak, plan.predicted_seconds,
                    plan.recomputed, plan.offloaded, arena, arena,
                )
            ]  # fmt: skip
        if program is None or not program.paths:
            return []
        schedule, steps = program.schedule, program.plan.steps
        if schedule is None or len(schedule.paths) != len(program.paths):
            schedule, steps = plan_program(program.paths), tuple(program.path_steps)
        return [
            _report_row(
                i, p.ops, p.eager_peak, p.planned_peak, p.predicted_seconds, p.recomputed, p.offloaded,
                schedule.arena_bytes, p.arena_end, schedule.fragmentation, p.blocks, steps[i],
            )
            for i, p in enumerate(schedule.paths)
        ]  # fmt: skip

    @property
    def graph(self) -> TraceGraph | None:
        """The program's TraceGraph (for inspection: ``tape.graph.to_dot()``); on the native
        backend made of its traced steps (coexec/native_traces.py)."""
        return self._program.graph if self._program is not None else None

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            raise CoexecUsageError(
                f"this GradientTape was created in another thread; {what} it in the thread that "
                "created it (use one tape per thread)"
            )


UNTRACED_LINES = FallbackReason(
    UNTRACED,
    "it called ops from a line no traced step had (a branch not traced yet), and it was not traced: the "
    "steps after it are, until one meets such a line",
    "",
)


def _describe(frame: Any) -> str:
    cid = CODES.code_id(frame.f_code)
    return CODES.describe_frame((cid, frame.f_lasti)) if cid > 0 else frame.f_code.co_name


def _notify(step: Any) -> None:
    """Tell ``python -m tracegraph show --record`` how the step ran."""
    stats = step.program.stats
    coexecuted = step.phase == "coexec"
    covered = coexecuted and step.why is None
    fell_back = coexecuted and isinstance(step.rec, Skeleton) and step.rec.eager
    observe.notify(observe.StepReport(
        step.program.where, step.program.index, stats.steps - 1, step.phase, covered, fell_back,
        step.why,
    ))  # fmt: skip


def _new_program(fam: Any) -> Program:
    fam.made += 1
    return programs.add(fam, Program(fam.code, fam.where, fam.made))


def _meet(t: torch.Tensor) -> None:
    """A recorder met ``t`` from outside the step: a parameter may say which model runs."""
    # (isinstance(t, Parameter) as its metaclass answers it, without its Python __instancecheck__)
    if issubclass(type(t), torch.nn.Parameter) or getattr(t, "_is_param", False):
        tape = getattr(_local, "tape", None)
        step = tape._step if tape is not None else None
        if step is not None:
            step.meet_parameter(t)


class _TracingRecorder(Recorder):
    """Records a traced step with the skeleton's saved-tensor hooks (the same ops recorded)."""

    on_external = staticmethod(_meet)

    def __init__(self, saved_hooks: bool) -> None:
        super().__init__()
        self.saved = SavedTensors(None, self.unrecorded, self.same_value) if saved_hooks else None

    def start(self, base: Any) -> None:
        super().start(base)
        if self.saved is not None:
            self.saved.install()

    def stop(self, error: BaseException | None = None) -> None:
        if self.saved is not None:
            self.saved.remove()
            self.saved = None  # (its hooks refer to this recorder)
        super().stop(error)


class _ProgramSkeleton(Skeleton):
    def on_external(self, t: torch.Tensor) -> None:
        _meet(t)
        super().on_external(t)


def _report_row(
    path: int, ops: int, eager_peak: int, planned_peak: int, predicted_seconds: float, recomputed: int,
    offloaded: int = 0, arena: int | None = None, arena_used: int | None = None,
    fragmentation: float | None = None, blocks: int | None = None, step: int | None = None,
) -> dict:
    """One path's row of ``report()`` (the native backend's has no arena, no blocks, and no
    step: ``planned for step``, the step whose sizes the path was planned for)."""
    return {
        "path": path,
        "planned for step": step,
        "ops": ops,
        "eager peak": eager_peak,
        "planned peak": planned_peak,
        "arena": arena,
        "arena used by this path": arena_used,
        "fragmentation": fragmentation,
        "planned blocks": blocks,
        "predicted seconds": predicted_seconds,
        "recomputed": recomputed,
        "offloaded": offloaded,
    }


def _auto_backend() -> str:
    """What ``backend="auto"`` runs: the native backend where it can serve the tape (no GPU or
    other accelerator on the machine: it captures CPU steps only; its module not known to be
    unbuildable), else the interpret backend."""
    return "interpret" if native.unavailable() or torch.accelerator.is_available() else "native"


class _NativeStep:
    """One run of a ``with`` block of a native-backend tape: captured (``executor/capture.py``),
    or eagerly while the native module is being built."""

    why = None  # (it never falls back: an op the capture cannot answer runs at once)
    rec = None

    def __init__(
        self,
        program: Program,
        frame: Any,
        max_traces: int,
        debug: bool = False,
        budget: int | None = None,
        offload: bool = False,
        arena: bool = False,
    ) -> None:
        self.program = program
        self.debug = debug
        # (one step is captured at a time in a process: one beside another thread's runs eagerly)
        self.capture = runtime.claim_capture()
        self.beside = self.capture is None and runtime.capture_held_elsewhere()
        self.phase = "eager" if self.capture is None else "coexec"
        self.t0 = time.perf_counter()
        self.c0 = None
        self.scope = None
        self.budget: NativeBudget | None = None
        self.traced = False
        self.outside_loops: frozenset = frozenset()
        if self.capture is None:
            return
        try:
            if budget is not None or arena:  # (raises BudgetTooSmall before the step runs)
                b = program.native_budget
                if b is None or (b.budget, b.offload, b.arena) != (budget, offload, arena):
                    program.native_budget = NativeBudget(budget, program.where, offload, arena)
                self.budget = program.native_budget
                for line in self.budget.before(self.capture, native.wait()):
                    if debug and line:
                        _log(program, line)
            else:
                self.capture.follow(None)
            self.c0 = self.capture.counters
            if program.native_traces.wants_trace(max_traces):
                self.traced = True
                self.outside_loops = loops_around(frame)
                self.capture.trace_next()
            self.scope = self.capture.step()
            if not self.scope.try_enter():  # (a Capture of executor.capture's own in another thread)
                if self.traced:
                    self.capture.trace_next(False)
                    self.traced = False
                self.capture, self.scope, self.budget = None, None, None
                self.phase, self.beside = "eager", True
                runtime.release_capture()
        except BaseException:
            runtime.release_capture()
            raise

    def end(self, error: BaseException | None) -> None:
        """The step's end: its values computed, a failure on the worker raised (unless the step
        raised already), the program's statistics updated."""
        failed = error is not None
        try:
            if self.scope is not None:
                if error is None:
                    try:
                        self.scope.__exit__(None, None, None)
                    except BaseException:
                        failed = True
                        raise
                else:
                    self.scope.__exit__(type(error), error, error.__traceback__)
        finally:
            try:
                self._count()
                if self.scope is not None:
                    self._trace(failed)
                if self.budget is not None and error is None:
                    self.budget.after(self.capture, native.wait(), self.program.stats)
            finally:
                if self.capture is not None:
                    runtime.release_capture()

    def _trace(self, failed: bool) -> None:
        """A traced step's trace into the program's graph; an untraced one's new lines noted."""
        program, traces = self.program, self.program.native_traces
        if not self.traced:
            if traces.untraced(self.capture):
                self.why = UNTRACED_LINES
            return
        changed, why, not_merged = traces.traced_step(
            self.capture, program.graph, self.outside_loops, failed, self.debug or bool(observe.observers)
        )
        program.stats.traces += changed
        if changed:
            self.why = why  # (python -m tracegraph show --record: a new trace, and why)
        if self.debug:
            step = program.stats.steps - 1
            if not_merged:
                _log(program, f"step {step} was traced, its trace not merged: {not_merged}")
            elif why is not None:
                _log(program, f"step {step}: new trace: {why.message}")

    def _count(self) -> None:
        s = self.program.stats
        seconds = time.perf_counter() - self.t0
        s.steps += 1
        s.last_phase = self.phase
        # (the next step is captured once the native module is loaded; until then it runs eagerly)
        s.phase = "coexec" if native.ready() is not None else "eager"
        s.seconds[self.phase] += seconds
        if self.beside:
            s.beside_steps += 1
            if self.debug:
                _log(
                    self.program,
                    f"step {s.steps - 1} ran eagerly: another thread's step was being captured "
                    "(one step is captured at a time in a process)",
                )
        if self.capture is None:
            return
        c0, c = self.c0, self.capture.counters
        s.coexec_steps += 1
        s.step_seconds = seconds
        s.last_ops = c.ops - c0.ops
        s.native_ops = s.last_ops - (c.run_now - c0.run_now)
        s.stall_seconds += c.wait_seconds - c0.wait_seconds
        s.executor_seconds += c.worker_seconds - c0.worker_seconds
        s.gradient_blocks = c.gradient_blocks - c0.gradient_blocks
        if c.eager_rests > c0.eager_rests:
            s.compiled_steps += 1
            if self.debug:
                _log(
                    self.program,
                    f"step {s.steps - 1} called a torch.compile'd region: its ops from there "
                    "to its end ran eagerly, as eager",
                )
        misses, shaped = c.misses - c0.misses, c.shaped - c0.shaped
        if self.debug and (misses or shaped):
            _log(
                self.program,
                f"step {s.steps - 1}: {misses + shaped} of its {s.last_ops} ops were new at their line "
                "(first sight, or sizes or arguments not seen there among the last 16): "
                f"{shaped} had their outputs' shapes computed and went to the worker, {misses} ran at "
                "once, as eager (their result is read, or their shape follows their data)",
            )
        engine = (c.backward_calls - c0.backward_calls) - s.gradient_blocks
        if self.debug and engine:
            _log(
                self.program,
                f"step {s.steps - 1}: {engine} backward() call(s) ran the autograd engine, not a "
                f"gradient block (the latest: {self.capture.backward_why})",
            )


class _Step:
    """One run of a ``with`` block in the program's current phase."""

    def __init__(self, tape: GradientTape, program: Program, frame: Any, family: Any) -> None:
        self.tape = tape
        self.program = program
        self.family = family
        self.decided = False  # which program the step belongs to is settled
        self.quiet = False  # switched program before anything ran: a plain traced step
        self.phase = program.stats.phase
        self.t0 = time.perf_counter()
        self.with_line = (frame.f_code.co_filename, frame.f_lineno)  # the user's ``with``
        self.why: FallbackReason | None = None  # why it fell back, or why its trace is new
        self.rec: Recorder | None = None
        self.session: Session | None = None
        if self.phase == "tracing":
            self.rec = _TracingRecorder(saved_hooks=tape.memory_budget is None)
            self.rec.start(frame)
        elif self.phase == "coexec":
            install_for_placeholders()
            runtime.hook_optimizer_steps()
            ex = self.ex = runtime.executor(budget=tape.memory_budget is not None)
            if ex.error is not None or not ex.alive:
                ex.reset()
            self.session = self._new_session(program)
            self.ex0 = ex.stats()
            # (under a memory budget, steps keep autograd's own saved tensors: its plans and
            # their recipes are made on those traces)
            blocks = program.gradient_blocks if tape.memory_budget is None else None
            self.rec = _ProgramSkeleton(program.graph, self.session, blocks)
            self.rec.start(frame, mirrors=not runtime.open_sessions)
            runtime.set_active_skeleton(self.rec)
        if self.rec is not None:
            collector.hold()  # (released by GradientTape.__exit__, once the step is let go of)

    def _new_session(self, program: Program) -> Session:
        return Session(
            self.ex, self.tape.timeout, program.schedule, program.arena, program.block_index, program.arena_outs,
            budget=self.tape.memory_budget, state_bytes=program.state_bytes, site_bytes=program.site_bytes,
        )

    # -- which program (coexec/programs.py) -------------------------------------------------
    def meet_parameter(self, t: torch.Tensor) -> None:
        """The step read parameter ``t``. The first one a step reads says which program it
        belongs to: the program that has it, or, when no program here has seen it while the
        current one has parameters of its own, a new program (a new model)."""
        fam = self.family
        if fam.named:
            return
        if self.decided:
            fam.claim(t, self.program)
            return
        self.decided = True
        owner = fam.owner_of(t)
        if owner is self.program:
            return
        if owner is None and not self.program.params:
            fam.claim(t, self.program)
            return
        if owner is None:
            owner = _new_program(fam)
            fam.claim(t, owner)
            why = f"a parameter of shape {list(t.shape)} that no model run here before had"
        else:
            why = f"a parameter of the model of program {owner.index} here"
        self._switch(owner, why)

    def _switch(self, target: Program, why: str) -> None:
        """Go on as a step of ``target``: a tracing step just records for it; a co-executing
        step that has issued nothing starts over on its graph; else it falls back to eager,
        exactly like any fallback, and its trace is merged into ``target`` at the end."""
        self._log(f"the step reads {why}: it belongs to program {target.index}")
        self.program = target
        programs.touch(target)
        sk = self.rec
        if self.phase != "coexec" or not isinstance(sk, Skeleton) or sk.eager:
            return
        tape = self.tape
        fresh = not sk.trace.ops and not sk.trace.fetches
        planned_alike = (
            target.budget_error is None
            and target.plan_failure is None
            and (target.budget is None or target.plan_current)
            and (target.budget, target.offload, target.use_arena) == (tape.memory_budget, tape.offload, tape.arena)
        )
        if fresh and target.stats.phase == "coexec" and planned_alike:
            old, self.session = self.session, self._new_session(target)
            sk.session, sk.graph = self.session, target.graph
            if sk.backwards.blocks is not None:
                sk.backwards.blocks = target.gradient_blocks
            sk.backwards.saved.session = self.session
            sk.cursor = Cursor(target.graph, sk.trace, mutate=False)
            old.close()
            return
        self.quiet = fresh and target.stats.phase == "tracing"
        sk.fall_back(
            f"the step reads {why}, so it belongs to program {target.index} at this `with`"
        )

    def end(self, error: BaseException | None) -> None:
        stats = self.program.stats
        stats.steps += 1
        if self.rec is not None:
            stats.last_ops = len(self.rec.trace.ops)
            if self.tape.memory_budget is not None:
                self.program.state_bytes = _persistent_bytes(self.rec.trace)
        try:
            if self.phase == "tracing":
                self.rec.stop(error)
                if error is None and stats.phase != "eager":
                    self._merge(self.rec.trace, fell_back=False)
            elif self.phase == "coexec":
                self._end_coexec(error)
        finally:
            stats.seconds[self.phase] += time.perf_counter() - self.t0
            stats.last_phase = self.phase

    def _end_coexec(self, error: BaseException | None) -> None:
        sk = self.rec
        assert isinstance(sk, Skeleton) and self.session is not None
        runtime.set_active_skeleton(None)
        covered = sk.finish() if error is None else False
        leaves = sk.leaves()
        sk.stop(error)
        session = self.session
        if error is not None:
            # eager would have run every op issued before the exception: so does the executor
            broken = False
            try:
                session.drain()
            except (ExecutorError, ExecutorDied, ExecutorTimeout) as e:
                error.__context__ = e
                broken = not isinstance(e, ExecutorError)
            self._settle(session, leaves, sk.optimizers, broken)
            return
        if self.tape.sync == "step" or sk.eager:
            try:
                session.drain()
            except ExecutorError as e:
                self._settle(session, leaves, sk.optimizers)
                raise_executor_error(e)
            except (ExecutorDied, ExecutorTimeout):
                self._settle(session, leaves, sk.optimizers, broken=True)
                raise
            self._settle(session, leaves, sk.optimizers)
        else:
            session.close_block()  # the executor runs on past the step
            runtime.open_sessions.append((session, leaves, sk.optimizers))
        stats = self.program.stats
        if sk.eager and (self.quiet or stats.phase == "eager"):
            # switched, before anything ran, to a program still tracing (or staying eager)
            self.phase = "tracing" if stats.phase != "eager" else "eager"
            if self.phase == "tracing":
                self._merge(sk.trace, fell_back=False)
        elif sk.eager:
            stats.fallbacks += 1
            stats.last_fallback = sk.fallback_reason
            self._log(f"fell back to eager: {sk.fallback_reason}")
            self._merge(sk.trace, fell_back=True, why=sk.fallback_why)
        else:
            stats.coexec_steps += 1
            if not covered:
                self._merge(sk.trace, fell_back=False, why=sk.end_reason)
            elif self.session.schedule is not None:
                self._check_plan(sk)

    def _check_plan(self, sk: Skeleton) -> None:
        """A covered step may still take a path no plan has seen (a loop running more
        iterations than any traced step), or make tensors of other sizes than the traced
        steps did (sizes that vary, data-dependent shapes): under a budget, say so if it went
        over; plan a new path, or, under a budget, a path again for a step that allocated more
        than the one it was planned for (in the background: no step waits for that plan)."""
        program, stats = self.program, self.program.stats
        signature = self.signature
        path = self.session.schedule.signatures.get(signature)
        planned = path is not None
        larger = grew = False
        # a loop that ran another number of times than on LOOP_PATHS observed paths (an
        # episode's length): no new path; under a budget, the largest of them is planned again
        # for a step that allocated more (plans are made for the largest, as for sizes)
        same_shape = () if planned else program.shapes.get(loop_shape(signature), ())
        full = len(same_shape) >= LOOP_PATHS
        if full and program.budget is not None:
            path = max(same_shape, key=lambda p: _allocated_bytes(program.paths[p].trace))
        # (only a budget's decisions change with sizes: the arena leaves sized ops' outputs to
        # the allocator, so an arena alone gains nothing from a plan for larger steps)
        if path is not None and program.budget is not None:
            size = _allocated_bytes(sk.trace)
            larger = size > _allocated_bytes(program.paths[path].trace)
            grew = larger and program.grow_path(path, sk.trace, size, stats.steps - 1, signature)
        if program.budget is not None and stats.peak_bytes > program.budget:
            stats.over_budget_steps += 1
            if full:
                then = "the largest of them is planned again for it" if grew else "planned for the largest of them"
                why = (
                    f"ran a loop another number of times than on the {LOOP_PATHS} paths its plan "
                    f"was made for (an episode's length): {then}"
                )
            elif not planned:
                why = "took a path no plan had seen yet (it is planned now)"
            elif larger:
                then = "it is planned again for these sizes" if grew else "no plan for steps this large meets the budget"
                why = f"allocated more than step {program.plan.steps[path]}, which its plan was made for (sizes that vary): {then}"
            else:
                why = "made tensors of other sizes than its traced steps (data-dependent shapes)"
            warnings.warn_explicit(  # (at the user's ``with`` line, as max_traces' warning)
                f"coexec: a step at {program.where} used {stats.peak_bytes} bytes, over its "
                f"memory budget of {program.budget}: it {why}",
                RuntimeWarning,
                *self.with_line,
            )
        new_path = not planned and not full
        if new_path:
            program.add_path(sk.trace, signature, stats.steps - 1)
        if new_path or grew:
            self._log(program.request_plan(program.budget, program.offload, program.use_arena, grown=not new_path))

    @functools.cached_property
    def signature(self) -> tuple:
        """The sites of the co-executed step's ops, in order (a planned path's, if it took one)."""
        from .budget import path_signature

        sk = self.rec
        if len(sk.sites) == len(sk.cursor.placed):  # (every op placed was issued, in order)
            return tuple(sk.sites)
        return path_signature(sk.cursor.placed, iterations)

    def _settle(self, session: Session, leaves: list, optimizers: list, broken: bool = False) -> None:
        """Bind the step's placeholders, give persistent state its real tensors, and let the
        executor forget the step; a broken executor (dead, stuck, failed) is replaced."""
        stats = self.program.stats
        stats.stall_seconds += session.stall_seconds
        session.bind_all()
        ex = session.executor
        now, before = ex.stats(), self.ex0
        stats.executor_seconds += max(0.0, now.busy_seconds - before.busy_seconds)
        stats.peak_bytes = now.peak_bytes + _persistent_bytes(self.rec.trace)
        stats.recomputed_ops = now.recomputed - before.recomputed
        stats.guard_drops = now.guard_drops - before.guard_drops
        if session.guarded:
            stats.guarded_steps += 1
        stats.offloaded_storages = now.offloaded - before.offloaded
        stats.copy_wait_seconds = now.copy_wait_seconds - before.copy_wait_seconds
        stats.planned_blocks = now.blocks - before.blocks
        stats.native_ops = now.native_ops - before.native_ops
        stats.gradient_blocks = self.rec.backwards.replayed
        stats.templated_calls = self.rec.templated
        stats.mirrored_fetches = self.rec.mirrored_fetches
        stats.run_ahead = now.run_ahead - before.run_ahead
        stats.step_seconds = time.perf_counter() - self.t0
        path = session.schedule.signatures.get(self.signature) if session.schedule is not None else None
        plan = session.schedule.paths[path] if path is not None else None
        stats.planned_path = path
        stats.planned_for_step = self.program.plan.steps[path] if path is not None else None
        stats.planned_peak_bytes = plan.planned_peak if plan is not None else None
        stats.planned_step_seconds = plan.predicted_seconds if plan is not None else None
        runtime.unescape(leaves, optimizers)
        ex = session.executor
        if broken or ex.error is not None or not ex.alive:
            ex.reset()
        else:
            session.close()

    def _merge(self, trace: Any, fell_back: bool, why: FallbackReason | None = None) -> None:
        program, stats = self.program, self.program.stats
        if why is None and not fell_back:  # a traced step: why is its trace new, if it is?
            why = why_new(program.graph, trace)
        if why is not None:
            if not fell_back:
                self._log(f"new trace: {why.message}")
            self._note(why)
        merged = program.graph.merge_placed(trace)
        added = merged.changed
        if added:  # its blocks name the graph's nodes as they were
            program.gradient_blocks.clear()
        stats.traces += added
        tape = self.tape
        if added:
            program.add_path(trace, sites(merged.places), stats.steps - 1)
        if stats.phase == "tracing" and not added:
            stats.phase = "coexec"
            self._log(f"trace covered after {stats.traces} traces: co-executing from now on")
        elif added and stats.traces < tape.max_traces:
            self._log(program.request_plan(tape.memory_budget, tape.offload, tape.arena))
        elif added:
            stats.phase = "eager"
            program.stop_planning()  # plans would take the cores from its steps
            if not program.capped:
                program.capped = True
                msg = max_traces_message(program.where, stats.traces, tape.max_traces, program.reasons)
                warnings.warn_explicit(msg, RuntimeWarning, *self.with_line)

    def _note(self, why: FallbackReason) -> None:
        """Keep ``why`` among the program's latest reasons (TapeStats.fallback_reasons)."""
        program, stats = self.program, self.program.stats
        self.why = why
        program.reasons = [*program.reasons, (stats.steps - 1, why)][-REASONS:]
        stats.fallback_reasons = tuple(f"step {k}: {r.message}" for k, r in program.reasons)

    def _log(self, msg: str | None) -> None:
        if self.tape.debug and msg:
            _log(self.program, msg)


def _log(program: Program, msg: str) -> None:
    n = f" program {program.index}" if program.index > 1 else ""
    print(f"coexec [{program.where}{n}]: {msg}", file=sys.stderr)


LOOP_PATHS = 4  # paths planned per loop shape (loop_shape): more are not planned as paths


def loop_shape(signature: tuple) -> tuple:
    """A path's nodes in the order first run: equal for paths that differ only in how many
    times their loops ran."""
    return tuple(dict.fromkeys(site.node for site in signature))


def _allocated_bytes(trace: Any) -> int:
    """Bytes of every storage a step's trace holds (what grows with its sizes)."""
    return sum(trace.storage_bytes.values())


def _site_bytes(paths: Any) -> dict:
    """Per site, the bytes of new tensors its op made in the step a plan was made for (a
    step's op that makes more has outgrown the plan: its guard takes over). Of a site on
    several paths, the least: a step's path is known only at its end, and the plan holds each
    path only at the sizes of that path's own step."""
    found: dict = {}
    for path in paths:
        values = path.trace.values
        for op, site in zip(path.trace.ops, path.sites):
            alias = op.out_alias
            n = sum(
                values[v].meta.nbytes for k, v in enumerate(op.outputs[: op.n_returned])
                if k >= len(alias) or alias[k] is None
            )  # fmt: skip
            if n < found.get(site, n + 1):
                found[site] = n
    return found


def _persistent_bytes(trace: Any) -> int:
    """Bytes of the storages a step found in place (parameters, optimizer state, inputs)."""
    values = trace.values
    sids = {values[v].storage for v in trace.externals}
    return sum(trace.storage_bytes.get(sid, 0) for sid in sids)
