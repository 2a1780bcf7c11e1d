"""Process-wide runtime state: the executor thread, the capture of native-backend steps, open
sessions, the optimizer hook."""

from __future__ import annotations

import atexit
import threading
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from executor import Executor, NativeExecutor, make_executor, native

from .placeholder import Placeholder

if TYPE_CHECKING:
    from executor.capture import Capture

    from .skeleton import Session, Skeleton

EXIT_TIMEOUT = 10.0  # seconds the interpreter's exit waits for the executor's last work
_lock = threading.Lock()
# the process's executors, by whether it is the Python one (memory budgets; every step until the
# native module is built, or where it cannot be) or the native one (steps without a budget)
_executors: dict[bool, Executor | NativeExecutor] = {}
_last: Executor | NativeExecutor | None = None  # the one the latest step ran on
_local = threading.local()  # .skeleton: the skeleton running in this thread, if any
open_sessions: list[tuple["Session", list, list]] = []  # sessions a lazy step left running
_capture: "Capture | None" = None  # GradientTape(backend="native")'s, made on first use
_capture_owner: int | None = None  # the thread whose native step holds it (claim_capture)


def executor(budget: bool = False) -> Executor | NativeExecutor:
    """The executor for a step with (``budget``) or without a memory budget, started on first
    use. A step that runs on another executor than the step before waits for that one first
    (the two would otherwise update parameters in no set order)."""
    global _last
    python = budget or native.ready() is None  # (once built, it stays so: make_executor agrees)
    with _lock:
        ex = _executors.get(python)
        if ex is None:
            _stop_at_exit_once()
            ex = _executors[python] = make_executor(budget=python)
        last, _last = _last, ex
    if last is not None and last is not ex and last.alive and last.error is None:
        last.drain(300.0)
    return ex


def capture() -> "Capture | None":
    """The capture native-backend steps run under, made on first use; None while the native
    module is not built (it starts building: those steps run eagerly meanwhile). Work the
    executor of an earlier step still has in flight finishes first."""
    global _capture, _last
    if native.ready() is None:
        return None
    if _last is not None or open_sessions:
        synchronize()
        _last = None
    with _lock:
        if _capture is None:
            from executor.capture import Capture

            _stop_at_exit_once()
            _capture = Capture()
    return _capture


def claim_capture() -> "Capture | None":
    """:func:`capture`, held by this thread's native-backend step until :func:`release_capture`;
    None while the native module is not built, or while another thread's step holds it: one
    step is captured at a time in a process (the capture's kernel, its placeholders and the
    wrapped Tensor methods serve one step), so a step beside it runs eagerly, as eager would,
    and counts so (``TapeStats.beside_steps``)."""
    global _capture_owner
    me = threading.get_ident()
    with _lock:
        if _capture_owner is not None and _capture_owner != me:
            return None
        _capture_owner = me  # (before capture(): no other thread's step starts in between)
    c = capture()
    if c is None:
        release_capture()
    return c


def release_capture() -> None:
    """This thread's step is done with the capture (:func:`claim_capture`)."""
    global _capture_owner
    with _lock:
        if _capture_owner == threading.get_ident():
            _capture_owner = None


def capture_held_elsewhere() -> bool:
    """Does another thread's native-backend step hold the capture now?"""
    owner = _capture_owner
    return owner is not None and owner != threading.get_ident()


def executors() -> list[Executor | NativeExecutor]:
    """The executors started so far."""
    return list(_executors.values())


_exit_registered = False


def _stop_at_exit_once() -> None:
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_stop_at_exit)


def _stop_at_exit() -> None:
    """Let the executors finish and stop before the interpreter tears down: a thread still in
    torch while C++ statics are destroyed aborts the process ("terminate called without an
    active exception", exit status 134; seen in about 4 of 10 exits after a budgeted step)."""
    global _capture
    for ex in executors():
        ex.close(timeout=EXIT_TIMEOUT)
    if _capture is not None:
        _capture.close()  # (its worker thread joins)
        _capture = None


def active_skeleton() -> "Skeleton | None":
    return getattr(_local, "skeleton", None)


def set_active_skeleton(sk: "Skeleton | None") -> None:
    _local.skeleton = sk


def _note_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    sk = active_skeleton()
    if sk is not None and optimizer not in sk.optimizers:
        sk.optimizers.append(optimizer)


_hooked = False


def hook_optimizer_steps() -> None:
    """Note each optimizer stepped inside an interpret step (its state is settled at the step's
    end); registered by the first such step, not at import."""
    global _hooked
    if not _hooked:
        _hooked = True
        register_optimizer_step_post_hook(_note_optimizer_step)


def unescape(leaves: list, optimizers: list) -> None:
    """Placeholders that escaped into persistent state become their real tensors: gradients
    of parameters and optimizer state, which outlive the step and are touched outside it."""
    for p in leaves:
        g = p.grad
        if isinstance(g, Placeholder) and g._real is not None:
            p.grad = g._real
    for opt in optimizers:
        for state in opt.state.values():
            for k, v in list(state.items()):
                if isinstance(v, Placeholder) and v._real is not None:
                    state[k] = v._real


def synchronize() -> None:
    """Wait for all work in flight and bind every placeholder of steps that ran lazily
    (``GradientTape(sync="none")``). With the default ``sync="step"`` every step already
    synchronizes when its ``with`` block exits."""
    while open_sessions:
        session, leaves, optimizers = open_sessions.pop(0)
        session.executor.drain(session.timeout)
        session.bind_all()
        unescape(leaves, optimizers)
        session.close()
    for ex in executors():
        ex.drain(300.0)
