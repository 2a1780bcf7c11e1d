"""Process-wide runtime state: the executor thread, open sessions, the optimizer hook."""

from __future__ import annotations

import atexit
import threading
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from executor import Executor

from .placeholder import Placeholder

if TYPE_CHECKING:
    from .skeleton import Session, Skeleton

EXIT_TIMEOUT = 10.0  # seconds the interpreter's exit waits for the executor's last work
_lock = threading.Lock()
_executor: Executor | None = None
_local = threading.local()  # .skeleton: the skeleton running in this thread, if any
open_sessions: list[tuple["Session", list, list]] = []  # sessions a lazy step left running


def executor() -> Executor:
    """The executor thread (started on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = Executor()
            atexit.register(_stop_at_exit)
        return _executor


def _stop_at_exit() -> None:
    """Let the executor finish and stop before the interpreter tears down: a thread still in
    torch while C++ statics are destroyed aborts the process ("terminate called without an
    active exception", exit status 134; seen in about 4 of 10 exits after a budgeted step)."""
    if _executor is not None:
        _executor.close(timeout=EXIT_TIMEOUT)


def active_skeleton() -> "Skeleton | None":
    return getattr(_local, "skeleton", None)


def set_active_skeleton(sk: "Skeleton | None") -> None:
    _local.skeleton = sk


def _note_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    sk = active_skeleton()
    if sk is not None and optimizer not in sk.optimizers:
        sk.optimizers.append(optimizer)


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
    ex = _executor
    if ex is None:
        return
    while open_sessions:
        session, leaves, optimizers = open_sessions.pop(0)
        ex.drain(session.timeout)
        session.bind_all()
        unescape(leaves, optimizers)
        session.close()
    ex.drain(300.0)
