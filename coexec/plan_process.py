"""Plans made in a child Python process, so planning does not share the GIL with the step.

A planner thread in the training process (``coexec.planning.Planner``) hands each request
here. Making a plan is Python-heavy (graphs, intervals, the simulator); in the same process it
took the GIL from the skeleton and the executor and made the steps around it up to 3x slower
(docs/coexec.md, *Plans are made in the background*). Here the thread only sends the
request and waits on a pipe, which releases the GIL; each new path was pickled by the step's
thread when it asked for the plan (:meth:`PlanProcess.encode`).

The child (:func:`child_command`) keeps every path's trace it was sent, so each
trace crosses the pipe once; a trace the program lets go of is forgotten in the child with the
next request. Ops are pickled by name (``aten::add.Tensor``), so
the child needs no state of the training process. Anything that goes wrong with the child
(it cannot start, dies, or a request cannot be pickled) raises :class:`PlanProcessError`; the
planner then makes its plans in its own thread.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

import torch

from .planning import PlanRequest, PlanResult, make_plan


class PlanProcessError(RuntimeError):
    """The child process could not make this plan (not the planner failing: a plan that
    fails comes back as a :class:`PlanResult` with its error)."""


@dataclass(frozen=True)
class Job:
    """One request as it crosses the pipe: traces by their id, only new ones in full."""

    request: PlanRequest  # with paths=()
    path_ids: tuple[int, ...]  # per path of the request, its trace's id
    new_paths: dict[int, bytes]  # id -> its PathInput pickled, new to the child
    forget: tuple[int, ...]  # ids of traces the training process let go of


def _op(qualified: str, overload: str) -> Any:
    ns, name = qualified.split("::")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def _reduce_op(op: Any) -> tuple:
    return _op, (op._schema.name, op._overloadname)


class _Pickler(pickle.Pickler):
    """Ops by name: ``torch._ops.OpOverload`` objects do not pickle. (A table by type, not
    ``reducer_override``, which calls Python for every object: twice as slow.)"""

    dispatch_table = {**copyreg.dispatch_table, torch._ops.OpOverload: _reduce_op}


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _write(stream: BinaryIO, payload: bytes) -> None:
    stream.write(len(payload).to_bytes(8, "little"))
    stream.write(payload)
    stream.flush()


def _read(stream: BinaryIO) -> bytes:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other end closed the pipe")
    n = int.from_bytes(head, "little")
    payload = stream.read(n)
    if len(payload) < n:
        raise EOFError("the other end closed the pipe")
    return payload


class PlanProcess:
    """The training process's side: starts the child on first use, sends jobs, reads plans.
    Used from one thread at a time (the planner thread)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._ids: dict[int, int] = {}  # id(trace) -> the id the child knows it by
        self._next_id = 0
        self._forget: list[int] = []  # appended by finalizers, on any thread
        self._lock = threading.Lock()
        self._encoded: dict[int, bytes] = {}  # id(trace) -> its path pickled: encode()

    def encode(self, path: Any) -> None:
        """Pickle a path for the child now, on the calling thread (the step's, which made the
        trace: ~4 us an op, a few percent of recording it). On the planner thread the same
        work took the GIL from whichever step ran next, often a co-executed one, and paths
        queued behind a plan went in one burst: up to 5x a REINFORCE program's median eager
        step (bench/planning_stall.py)."""
        trace = path.trace
        key = id(trace)
        with self._lock:
            if key in self._ids or key in self._encoded:
                return
        payload = dumps(path)
        with self._lock:
            self._encoded[key] = payload
        weakref.finalize(trace, self._unencode, key, payload)

    def _unencode(self, key: int, payload: bytes) -> None:
        with self._lock:
            if self._encoded.get(key) is payload:
                del self._encoded[key]

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def plan(self, req: PlanRequest) -> PlanResult:
        """``req`` planned in the child."""
        try:
            proc = self.start()
            job = self._job(req)
            _write(proc.stdin, dumps(job))
            answer = pickle.loads(_read(proc.stdout))
        except (OSError, EOFError, pickle.PickleError, TypeError, AttributeError) as e:
            self.close()
            raise PlanProcessError(f"{type(e).__name__}: {e}") from None
        if isinstance(answer, str):  # the child could not pickle its result: why
            raise PlanProcessError(answer)
        return replace(answer, request=req)

    def close(self) -> None:
        """Stop the child (it also stops by itself when this process's end of the pipe
        closes, at exit or if this process dies)."""
        proc, self._proc = self._proc, None
        self._ids.clear()
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            proc.kill()
            proc.wait()

    def start(self) -> subprocess.Popen:
        """The child, started now if it is not running (it imports torch: a second or two)."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            self.close()
        env = {**os.environ, "PYTHONPATH": _child_path()}
        self._proc = subprocess.Popen(child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self._proc

    def _job(self, req: PlanRequest) -> Job:
        with self._lock:
            forget, self._forget = tuple(self._forget), []
        ids, new = [], {}
        for path in req.paths:
            key = id(path.trace)
            if key not in self._ids:
                self._ids[key] = self._next_id
                with self._lock:
                    payload = self._encoded.pop(key, None)
                new[self._next_id] = payload if payload is not None else dumps(path)
                weakref.finalize(path.trace, self._gone, key, self._next_id)
                self._next_id += 1
            ids.append(self._ids[key])
        return Job(replace(req, paths=()), tuple(ids), new, forget)

    def _gone(self, key: int, tid: int) -> None:
        with self._lock:
            if self._ids.get(key) == tid:
                del self._ids[key]
            self._forget.append(tid)


def _child_path() -> str:
    """The child's ``PYTHONPATH``: where this coexec (and its sibling packages) was imported
    from, a source checkout or a worktree, before the caller's own. Not all of ``sys.path``:
    the training script's directory would come first there, and a module of the user's
    named like one the child imports (an ``nt.py``) stopped the child's ``import torch``."""
    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """The child's loop: a job in, its plan out, until the training process closes the pipe."""
    paths: dict[int, Any] = {}  # id -> PathInput
    while True:
        try:
            job: Job = pickle.loads(_read(inp))
        except EOFError:
            return
        for tid in job.forget:
            paths.pop(tid, None)
        paths.update((tid, pickle.loads(payload)) for tid, payload in job.new_paths.items())
        req = replace(job.request, paths=tuple(paths[t] for t in job.path_ids))
        result = replace(make_plan(req), request=None, pid=os.getpid())
        try:
            payload = dumps(result)
        except Exception as e:  # noqa: BLE001  (said to the training process, which plans itself)
            payload = dumps(f"the plan could not be sent back ({type(e).__name__}: {e})")
        _write(out, payload)


def child_command() -> list[str]:
    """The child's command line. Not ``python -m coexec.plan_process``: importing the package
    imports this module first (coexec.native_plans does), and runpy then warns on every start
    that it runs a module already imported ("may result in unpredictable behaviour")."""
    return [sys.executable, "-c", "from coexec.plan_process import main; main()"]


def main() -> None:
    # fd 1 is the pipe: anything printed (warnings, progress) goes to stderr instead
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    torch.set_num_threads(1)
    serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
