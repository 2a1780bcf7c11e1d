"""A native-backend program under a memory budget: which step is described, its plan made in
the background, the plan the capture follows, and what each step measured.

The first steps run unplanned (the capture meets their ops); the third is described
(``Capture.describe_next``) and planned in a child process (``coexec/native_budget.py``; a plan
takes the planner's Python, which would share the GIL with the steps here; with ``offload=True``
it may park storages in the host pool too, at the copy bandwidth measured once per process); the steps after the
plan arrives follow it (``Capture.follow``). A step that leaves the plan's path (another op
where the plan expects one) is counted; after two such steps in a row, one is described again
and planned anew, at most every 16 steps. Under a budget without an arena a program keeps a plan
per path (up to PATHS): once a path has a plan, a step that leaves it has a later one described
(every NEW_PATH_EVERY steps at most while paths are found), and the described steps of every
path are planned together (``plan_native_paths``: they agree where the paths share ops); the
capture follows the plan in use with the others beside it, and a step takes over the plan of
the branch it went down where its ops part from the plan's. A path no plan can hold warns once,
and its steps have the guard alone. Where sizes change (a length drawn per step) a plan
made at one size is followed at the others (its path is its ops): a step that makes a value
larger than the planned step's (the capture stops following the plan there) or follows it and
holds more than 5% above its planned peak has outgrown it, and the next step is described; the
steps after it follow no plan until the larger step's arrives (a plan made at smaller sizes,
followed beside the guard at larger ones, left the guard values it could not drop: steps 7-9%
over the budget); a plan made for a smaller step than the one in use (by their unplanned peaks)
is left unused, so the plan in use is that of the largest step described. From the first step
on, the capture's guard (``Capture.guard``, ``native/capture_worker.h``) holds every step within
the budget (less the state the plan counts, or the last described step found and left: the
allocator counts the bytes the step makes; steps without a plan are described for their state,
and the first step, whose state nothing tells, counts everything alive as it begins: the
allocator's count, or the storages of Python's tensors where more) where the plan does not:
before the plan arrives, and on a step larger than the one planned, by dropping values on the
worker where an op would go over and making them again where read (a larger step's plan that
cannot meet the budget leaves the steps to the guard alone from then on, with a warning). A
budget no plan can meet raises :class:`planner.BudgetTooSmall` at the next step's ``with``,
before that step runs. A step that ran ops at once because they were new at their line and could
not be answered without running them (a shape that follows data) is not described: where sizes
change at every step none is, and after 8 such steps without a plan a ``RuntimeWarning`` says
so; another says when 8 steps in a row did not follow the plan (their ops differ from the
planned step's).
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import subprocess
import sys
import threading
import warnings
from concurrent.futures import Future, wait
from typing import Any

import torch

from executor.step_plans import StepDescription
from planner import Bandwidth, BudgetTooSmall, format_bytes

from .native_budget import NativeBudgetPlan, PathsToPlan, path_ops, plan_native, plan_native_paths
from .plan_process import _child_path, _read, _write

WARM_UP = 2  # unplanned steps before one is described (the capture meets the ops, then the backward)
UNFOLLOWED = 2  # steps off the plan's path in a row before the path is planned again
REPLAN_EVERY = 16  # steps at least between two descriptions
OUTGROWN = 1.05  # a followed step that held this much more than its plan: sizes grew, describe again
UNPLANNABLE = 8  # steps in a row not described (ops ran at once) or off the plan, before a warning
PATHS = 8  # plans of a program's paths kept at once (budgets without an arena; the oldest goes)
NEW_PATH_EVERY = 4  # steps at least between two descriptions while fewer paths than PATHS are planned


class _PlanChild:
    """``python -m coexec.native_plan_child``: plans made in a child process (started when a
    program first has a budget or an arena, :meth:`start`; it takes a second or two to import
    torch), one at a time; it ends when this process closes the pipe. Not multiprocessing's
    spawn: that runs the user's script again in the child where it has no ``if __name__ ==
    "__main__"`` guard."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child now, if it is not running: a program's first plan is asked for two
        steps later, and the child's start (importing torch) is then behind it. (Started with
        the first plan, it held that plan back by a second or two, steps run under the guard
        alone, which holds less well than a plan.) A child that cannot start is the first
        plan's to report."""
        with self._lock:
            try:
                self._start()
            except OSError:
                pass

    def _start(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "PYTHONPATH": _child_path()}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "coexec.native_plan_child"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            )  # fmt: skip

    def plan(
        self, d: StepDescription | PathsToPlan, budget: int | None, bandwidth: Bandwidth | None, arena: bool
    ) -> NativeBudgetPlan | list[NativeBudgetPlan | BudgetTooSmall]:
        """The plan of ``d`` (paths: theirs, :func:`plan_native_paths`)."""
        with self._lock:
            self._start()
            _write(self._proc.stdin, pickle.dumps((d, budget, bandwidth, arena), protocol=pickle.HIGHEST_PROTOCOL))
            ok, value = pickle.loads(_read(self._proc.stdout))
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the child (at exit): its pipe closed, it returns."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                stream.close()
            proc.wait()


_child = _PlanChild()
atexit.register(_child.close)


def _state_bytes(d: StepDescription) -> int:
    """The bytes of the storages a described step found existing: its state (parameters,
    optimizer state, inputs)."""
    return sum(n for n, existed in zip(d.storage_bytes, d.existed) if existed)


def _python_tensor_bytes() -> int:
    """The bytes of the CPU storages Python's tensors hold now (each storage once): the state a
    program's first budgeted step may find. (The capture's allocator counts only what it
    handed out, and a model and its optimizer state are made before it is installed: with
    that count alone, a first step after an eager one went 11% over its budget.) Once per
    program: a walk of every object the garbage collector tracks. Tensors without a Python
    object are not seen: gradients the autograd engine made that Python never read (an eager
    step's, where ``zero_grad()`` did not let go of them), saved tensors of a graph kept alive."""
    seen: set[int] = set()
    total = 0
    for o in gc.get_objects():
        if not issubclass(type(o), torch.Tensor) or o.device.type != "cpu" or o.layout != torch.strided:
            continue
        try:
            storage = o.untyped_storage()
            if storage.device.type != "cpu":  # (a fake tensor's: meta, no memory)
                continue
            where = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # (no memory: a placeholder, a functional tensor)
            continue
        if where != 0 and where not in seen:
            seen.add(where)
            total += storage.nbytes()
    return total


_pending: set[Future] = set()  # plans asked for and not yet made (wait_for_native_plans)
_pending_lock = threading.Lock()


def wait_for_native_plans(timeout: float | None = None) -> bool:
    """Wait until the memory plans asked for so far are made; False if ``timeout`` ran out."""
    with _pending_lock:
        pending = list(_pending)
    done, not_done = wait(pending, timeout)
    return not not_done


def _submit(d: StepDescription | PathsToPlan, budget: int | None, bandwidth: Bandwidth | None, arena: bool) -> Future:
    """The plan (of a program's paths: theirs, :func:`plan_native_paths`), made in the child
    process (here, in a thread, if the child cannot run)."""
    f: Future = Future()
    with _pending_lock:
        _pending.add(f)

    def made(done: Future) -> None:
        with _pending_lock:
            _pending.discard(done)

    f.add_done_callback(made)

    def plan() -> None:
        try:
            try:
                result = _child.plan(d, budget, bandwidth, arena)
            except (OSError, EOFError, pickle.PickleError):
                result = (
                    plan_native_paths(d.planned, budget, bandwidth=bandwidth, state_of=d.state_only)
                    if isinstance(d, PathsToPlan) else plan_native(d, budget, bandwidth, arena)
                )  # fmt: skip
            f.set_result(result)
        except BaseException as e:  # noqa: BLE001 (handed to the step that takes the plan)
            f.set_exception(e)

    threading.Thread(target=plan, name="coexec-native-plan", daemon=True).start()
    return f


def _host_bandwidth() -> Bandwidth:
    """The host pool's copy bandwidth on this machine, measured once per process (a few copies
    of 32 MiB, between steps)."""
    from executor.offload import measure_bandwidth

    return measure_bandwidth("cpu")


class NativeBudget:
    """One program's memory plans on the native backend: a budget, or an arena (``budget``
    None, ``arena`` True: the same described steps and plans, no guard; module docstring)."""

    def __init__(self, budget: int | None, where: str, offload: bool = False, arena: bool = False) -> None:
        if budget is None and not arena:
            raise ValueError("a native memory plan needs a memory budget or arena=True")
        _child.start()
        self.budget = budget
        self.arena = arena
        self.offload = offload  # plans may park values in the host pool (bandwidth measured at the first plan)
        self.where = where  # the ``with`` statement (for the warning below)
        self.unplannable = 0  # steps in a row that ran at once ops to be described, or off the plan
        self.warned = False  # (the warning on unplanned steps: once)
        self.plan: NativeBudgetPlan | None = None
        # the plans of the program's other paths (another branch taken: other ops than the
        # plan's), by their ops; a step follows the plan, and another path's from where its ops
        # leave the plan's for that one's (Capture.follow); not with an arena (one per step)
        self.other_paths: dict[tuple[int, ...], NativeBudgetPlan] = {}
        self.path_ids: dict[tuple[int, ...], int] = {}  # (tape.stats.planned_path)
        # paths no plan within the budget can hold, by their ops: a described step of each (their
        # state counts in the other paths' plans)
        self.unmeetable_paths: dict[tuple[int, ...], StepDescription] = {}
        self.future: Future | None = None
        # the program's paths are planned together (plan_native_paths), a budget without an
        # arena: the described step of each path planned, and of the plans being made
        self.joint = budget is not None and not arena
        self.described_paths: dict[tuple[int, ...], StepDescription] = {}
        # the described steps the plans being made are for (the step just described last) and
        # whether they are planned together
        self.future_ds: list[StepDescription] = []
        self.future_joint = False
        self.nothing_new = False  # the last plan taught nothing (a smaller step's, a path known unmeetable)
        self.error: BudgetTooSmall | None = None
        self.steps = 0
        self.described_at = -REPLAN_EVERY
        self.unfollowed = 0
        self.outgrown = False  # a step that followed the plan held more than it planned (sizes grew)
        self.growing = False  # steps outgrew the plan: _followed
        self.describing = False  # the step is described to be planned
        self.described = False  # the step is described: to be planned, or for its state alone
        self.plans = 0  # plans taken into use
        self.plans_made = 0  # plans that arrived, taken or left unused (a smaller step's)
        self.planning_seconds = 0.0  # the planner's time on them
        self.persistent: int | None = None  # the state the last described step found and left
        self.remade0 = self.misses0 = self.parked0 = self.placed0 = 0
        self.remade_seconds0 = 0.0

    def before(self, capture: Any, cpu: Any) -> list[str]:
        """Before a step: the plan taken if it arrived, the step described if it is its turn,
        the plan in use given to the capture, the memory counter started. Lines for a debug log."""
        lines = []
        if self.future is not None and self.future.done():
            lines.append(self._take())
        if self.error is not None:
            raise self.error
        # (a path not planned yet: described sooner while there is room for its plan and the
        # last description found one; with two paths planned, a step that grew past the plan may
        # have taken a path not planned yet, or one no plan can hold, and waits its turn too)
        paths = self.joint and self._paths() < PATHS and not self.nothing_new
        every = NEW_PATH_EVERY if paths else REPLAN_EVERY
        off = self.unfollowed >= UNFOLLOWED or (self.outgrown and len(self.path_ids) >= 2)
        due = (
            self.plan is None
            or (self.outgrown and len(self.path_ids) < 2)
            or (off and self.steps - self.described_at >= every)
        )
        self.describing = self.future is None and self.steps >= WARM_UP and due
        # (steps without a plan are described too, for the state they find: their bytes, and
        # the guard of the step after them)
        self.described = self.describing or self.plan is None
        if self.described:
            capture.describe_next()
        followed = self._followed()
        others = tuple(p.drops for p in self.other_paths.values()) if followed is not None else ()
        capture.follow(None if followed is None else followed.drops, others)
        cpu.reset_cpu_peak()
        # (the guard: the step's own bytes kept within what the budget leaves beside its state;
        # the first step's state is not known: everything alive as it begins is counted)
        # (an arena the plan holds is allocated whole before the step, beside its state: the
        # bytes the step makes in it are not counted again)
        state = self._state()
        if self.budget is None:
            capture.guard(0)
        elif state is None:
            capture.guard(max(1, self.budget - max(cpu.cpu_bytes()[0], _python_tensor_bytes())))
        else:
            capture.guard(max(1, self.budget - state - self._arena_held()))
        c = capture.counters
        self.remade0, self.remade_seconds0, self.misses0 = c.remade, c.remade_seconds, c.misses
        self.parked0, self.placed0 = c.parked, c.placed
        return lines

    def after(self, capture: Any, cpu: Any, stats: Any) -> None:
        """After a step: its description sent to be planned, whether it followed the plan, what
        it held at its peak (the state it found, or as the plan or the last described step
        counted it, and the bytes it made at their most)."""
        self.steps += 1
        d = capture.description() if self.described else None
        found = None if d is None else _state_bytes(d)  # (the state this step found)
        made_alive, made_peak = cpu.cpu_bytes_made()
        if found is not None:
            # (the state of the unplanned step after it: what it found, and what it made and
            # left alive, an optimizer's state made in a first step (counted as found, the
            # second step's guard left it 3% too much room), and gradients, which the next step
            # may let go of before its peak: too much, rather than too little)
            self.persistent = found + made_alive
        if self.describing and capture.counters.misses > self.misses0:
            # (ops new at their line ran at once: not the path's settled ops; the next step is described)
            self.unplannable += 1
        elif self.describing:
            self.unplannable = 0
            # (with a path planned, the paths are planned again together, the new one with them)
            self.future_joint = self.joint and self.plan is not None
            self.future_ds = [*self.described_paths.values(), d] if self.future_joint else [d]
            paths = PathsToPlan(self.future_ds, list(self.unmeetable_paths.values())) if self.future_joint else d
            bandwidth = _host_bandwidth() if self.offload else None
            self.future = _submit(paths, self.budget, bandwidth, self.arena)
            self.described_at = self.steps
            self.unfollowed = 0
            # (a program with more than one path planned: a step that grew past the plan may as
            # well have taken a path not planned yet, with the same ops as the plan's up to a
            # larger value; the plans keep being followed, each up to such a value)
            self.growing = self.outgrown and len(self.path_ids) < 2
            self.outgrown = False
        elif self._followed() is not None:
            # (a step off the plan's path: other ops than the step planned; one that grew past
            # its sizes stopped following it too, and is outgrown below)
            on_path = capture.followed or capture.outgrew
            self.unfollowed = 0 if on_path else self.unfollowed + 1
            self.unplannable = 0 if on_path else self.unplannable + 1
        if self.unplannable >= UNPLANNABLE and not self.warned:
            self.warned = True
            self._warn_unplanned()
        # (one definition of a step's bytes, the planner's: the state it found, and at their
        # most the bytes it made; the smallest budget BudgetTooSmall names counts the same)
        # (a step that followed another path's plan: the state that path's steps find)
        followed = self._followed_to_the_end(capture)
        persistent = found if found is not None else self._state() if followed is None else followed.persistent_bytes
        # (the arena of the plan the capture holds, allocated whole, beside the bytes made)
        stats.peak_bytes = (persistent or 0) + self._arena_held() + made_peak
        stats.planned_peak_bytes = followed.planned_peak if followed is not None else None
        stats.planned_path = self.path_ids.get(followed.drops.ops) if followed is not None else None
        stats.planned_paths = (self.plan is not None) + len(self.other_paths)
        stats.plans_made, stats.planning_seconds = self.plans_made, self.planning_seconds
        c = capture.counters
        stats.recomputed_ops = c.remade - self.remade0
        stats.recompute_seconds = c.remade_seconds - self.remade_seconds0
        stats.offloaded_storages = c.parked - self.parked0
        stats.arena_placed = c.placed - self.placed0
        if persistent is not None and self.budget is not None and stats.peak_bytes > self.budget:
            stats.over_budget_steps += 1
        if self._followed() is not None and not self.describing:
            # (it grew past the plan, a value larger than planned or more held: the next step is
            # described, a plan for larger sizes may be due)
            grew = capture.outgrew or (followed is not None and stats.peak_bytes > followed.planned_peak * OUTGROWN)
            self.outgrown = self.outgrown or grew

    def _followed(self) -> NativeBudgetPlan | None:
        """The plan steps follow: the plan in use, unless steps outgrew it (``growing``: the
        guard alone holds them until a larger step's plan arrives, or for good where none can
        meet the budget)."""
        return None if self.growing else self.plan

    def _followed_to_the_end(self, capture: Any) -> NativeBudgetPlan | None:
        """The plan the last step followed to its end: the plan in use, or another path's it
        took from where its ops left the plan's (None: it followed none)."""
        followed = self._followed()
        at = capture.followed_path if followed is not None else -1
        if at < 0:
            return None
        return followed if at == 0 else list(self.other_paths.values())[at - 1]

    def _paths(self) -> int:
        """Paths planned (the plan in use's and the others'), and those no plan can hold."""
        return (self.plan is not None) + len(self.other_paths) + len(self.unmeetable_paths)

    def _arena_held(self) -> int:
        """The bytes of the arena the plan in use holds whole (0: none)."""
        followed = self._followed()
        return followed.arena_bytes if followed is not None else 0

    def _state(self) -> int | None:
        """The bytes of the state a step finds (parameters, optimizer state, inputs): as the plan
        in use counted them, or the last described step found and left them; None before a
        step is described."""
        return self.plan.persistent_bytes if self.plan is not None else self.persistent

    def _warn_unplanned(self) -> None:
        if self.plan is None:
            why = (
                "has no plan yet: the last {n} steps to be planned each ran ops at once that were "
                "new at their lines (a shape that follows data, such as a masked selection, at sizes "
                "not seen there before), and such a step cannot be planned; steps run unplanned, at "
                "eager's peak, until one repeats sizes met before"
            )
        else:
            why = (
                "has a plan that the last {n} steps did not follow: their ops differ from the step "
                "planned (a loop whose count changes from step to step), so they ran unplanned, at "
                "eager's peak"
            )
        warnings.warn(
            f"coexec: the memory {'budget' if self.budget is not None else 'plan (arena=True)'} of the step at "
            f"{self.where} " + why.format(n=self.unplannable)
            + " (planning for sizes that vary is issue 17)",
            RuntimeWarning,
            stacklevel=1,
        )

    def _take(self) -> str:
        f, self.future = self.future, None
        self.growing = False
        self.nothing_new = False
        if self.future_joint:
            return self._take_paths(f, self.future_ds)
        try:
            plan = f.result()
            self.plans_made += 1
            self.planning_seconds += plan.planning_seconds
            if self.plan is not None and plan.eager_peak < self.plan.eager_peak and self.plan.drops.ops == plan.drops.ops:
                # (a smaller step than the one planned: the plan for the larger sizes covers it)
                return f"memory plan for a smaller step than plan {self.plans}'s left unused"
            self.plan = plan
            self.path_ids.setdefault(plan.drops.ops, len(self.path_ids))
            if self.joint:
                self.described_paths = {plan.drops.ops: self.future_ds[-1]}
        except BudgetTooSmall as e:
            if self.plan is not None:
                return self._outgrown_for_good(e)
            self.error = BudgetTooSmall(
                e.budget, e.smallest, "this step has not run (the steps before it ran unplanned while it was planned)"
            )
            return f"the memory budget {format_bytes(self.budget)} cannot be met"
        self.plans += 1
        return self._ready(plan)

    def _take_paths(self, f: Future, ds: list[StepDescription]) -> str:
        """Take the plans of the program's paths made together (the last of ``ds`` the step just
        described; of two with the same ops, the larger step's plan is kept): each path's
        replaces its plan, the plan in use stays the same path's."""
        results = f.result()
        self.plans_made += 1
        best: dict[tuple[int, ...], tuple[NativeBudgetPlan, StepDescription]] = {}
        for d, r in zip(ds, results):
            if isinstance(r, BudgetTooSmall):
                continue
            if r.drops.ops not in best or r.eager_peak > best[r.drops.ops][0].eager_peak:
                best[r.drops.ops] = (r, d)
        self.planning_seconds += max((p.planning_seconds for p, _ in best.values()), default=0.0)
        last = results[-1]
        new = path_ops(ds[-1]) if isinstance(last, BudgetTooSmall) else last.drops.ops
        planned = {p.drops.ops for p in (self.plan, *self.other_paths.values()) if p is not None}
        if isinstance(last, BudgetTooSmall) and new in planned:
            return self._outgrown_for_good(last)  # (a larger step of a path planned)
        if isinstance(last, BudgetTooSmall):  # (a path no plan can hold: its steps have the guard alone)
            self.nothing_new = new in self.unmeetable_paths
            if self.nothing_new:
                return "no plan for another path, known: the guard alone on it"
            self.unmeetable_paths[new] = ds[-1]
            warnings.warn(
                f"coexec: the memory budget {format_bytes(self.budget)} of the step at {self.where} "
                f"cannot be met on one of its paths (another branch taken, other ops than the steps "
                f"planned; the planner's smallest for it: {format_bytes(last.smallest)}); its steps run "
                "on the capture's guard alone, which holds them within the budget where it can "
                "(tape.stats.over_budget_steps counts those it could not)",
                RuntimeWarning,
                stacklevel=1,
            )
            return f"no plan for another path within {format_bytes(self.budget)}: the guard alone on it"
        if best[new][1] is not ds[-1]:  # (a smaller step of a path planned: its plan covers it)
            self.nothing_new = True
            return f"memory plan for a smaller step than plan {self.plans}'s left unused"
        in_use = self.plan.drops.ops if self.plan is not None and self.plan.drops.ops in best else new
        self.plan = best[in_use][0]
        self.other_paths = {path: p for path, (p, _) in best.items() if path != in_use}
        while 1 + len(self.other_paths) > PATHS:  # (the oldest other goes)
            del self.other_paths[next(iter(self.other_paths))]
        kept = {in_use, *self.other_paths}
        for path in best:
            self.unmeetable_paths.pop(path, None)
        self.described_paths = {path: d for path, (_, d) in best.items() if path in kept}
        for path in kept:
            self.path_ids.setdefault(path, len(self.path_ids))
        self.plans += 1
        return self._ready(self.plan, f" with {len(self.other_paths)} other path(s) planned with it")

    def _outgrown_for_good(self, e: BudgetTooSmall) -> str:
        """A step larger than the planned one that no plan can hold: the guard alone holds steps
        from now on, for good (following no plan, none outgrows it, none is described again)."""
        self.growing = True
        warnings.warn(
            f"coexec: the memory budget {format_bytes(self.budget)} of the step at {self.where} "
            f"cannot be met by a plan at the sizes of a step larger than the one planned (the "
            f"planner's smallest for it: {format_bytes(e.smallest)}); steps run on the capture's "
            "guard alone from now on, which holds them within the budget where it can "
            "(tape.stats.over_budget_steps counts those it could not)",
            RuntimeWarning,
            stacklevel=1,
        )
        return f"no plan for a larger step within {format_bytes(self.budget)}: the guard alone from now on"

    def _ready(self, p: NativeBudgetPlan, where: str = "") -> str:
        """The debug line of plan ``p`` taken."""
        arena = f"an arena of {format_bytes(p.arena_bytes)} for {p.placed} storage(s)"
        peak = f"peak {format_bytes(p.eager_peak)} -> {format_bytes(p.planned_peak)}"
        if p.budget is None:
            return f"memory plan {self.plans} ready: {arena}, {peak}, planned in {p.planning_seconds:.2f} s"
        return (
            f"memory plan {self.plans} ready{where}: {peak} (budget {format_bytes(p.budget)}), {p.recomputed} op(s) "
            f"recomputed (+{1e3 * p.extra_seconds:.1f} ms){', ' + arena if p.placed else ''}, planned in "
            f"{p.planning_seconds:.2f} s ({p.method})"
        )

