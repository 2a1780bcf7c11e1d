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
made before, and queues the op for the worker. An op the cache has not met (first sight, new
sizes) has its output metadata computed from its own CPU code without its data
(``native/capture_shapes.h``) and is queued all the same; one whose result Python reads
(``.item()``) or whose shape depends on data waits for the worker and runs at once, as eager. So
autograd, modules and optimizers run unchanged over placeholders, and the values are eager's bit
for bit (the same kernels in the same order with the same thread count). At the step's end the
worker catches up and every placeholder still alive becomes its value in place.

A plain ``loss.backward()`` whose step ran the same ops as a step before does not run the autograd
engine: the ops the engine issued then (a gradient block, ``native/capture_blocks.h``) go to the
worker directly, and each leaf's ``.grad`` is bound as the engine bound it; hooks, Python
``autograd.Function`` s and checkpointing run the engine. ``torch.autograd.grad(loss, params)``
(and so ``GradientTape.gradient``) is answered the same way, its gradients placeholders of the
block's values.

Python code that reads a tensor's memory without an ATen op (``numpy()``, ``tolist()``,
``data_ptr()``, storages, DLPack, printing) waits for the value first: those methods of
``torch.Tensor`` are wrapped while a step runs, as are the functions that read or set the CPU
random generator, which the worker uses in the ops' order.

This is the base issue 16's skeleton is being built on; ``GradientTape(backend="native")``
runs its steps on it (coexec/tape.py).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Literal, NamedTuple

import torch

from executor import native
from executor.engine_watch import PythonWatch
from executor.step_log import CapturedStep, step_of
from executor.step_plans import DescribedOp, DropPlan, StepDescription
from executor.tracebacks import traceback_through
from executor.try_scopes import try_scopes

Mode = Literal["async", "replay", "tape"]

# Tensor methods that read memory around the dispatcher, and the CPU generator's functions
_DATA_ACCESS = (
    "numpy", "tolist", "__array__", "data_ptr", "untyped_storage", "_typed_storage", "storage",
    "__dlpack__", "__repr__", "__format__",
)  # fmt: skip
_RANDOM = ("manual_seed", "seed", "get_rng_state", "set_rng_state")
# Tensor methods whose bindings take the new tensor's device from ``self``'s backend dispatch key,
# which for a placeholder (PrivateUse3) names no device: they are called on a real stand-in
_STAND_IN = ("new_tensor", "new")
_REPLAYED, _ENGINE, _RECORD = 0, 1, 2  # (Capture::backward_begin)


class CaptureCounters(NamedTuple):
    """What a capture's kernel did since it was made (a NamedTuple: read twice a step)."""

    ops: int  # ATen ops that came to it
    misses: int  # ops the cache could not answer (run at once; in "tape" mode, meta kernels)
    run_now: int  # ops run at once (misses, ``.item()``-like ops, data-dependent shapes)
    kernel_seconds: float  # time in the kernel itself (one op in 8 timed, counted for all)
    taped: int  # ops on the tape ("replay" mode: not replayed yet)
    wait_seconds: float  # the step's thread waiting for the worker (reads, ops run at once, ends)
    worker_seconds: float  # the worker running ops
    gradient_blocks: int  # ``backward()`` calls a gradient block answered (no autograd engine)
    backward_calls: int  # plain ``loss.backward()`` calls in captured steps (a block may answer)
    dropped: int  # values a memory plan dropped (:meth:`Capture.follow`)
    remade: int  # dropped values made again (read after their drop)
    remade_seconds: float  # the time their ops took, on whichever thread read them
    shaped: int  # ops new at their line whose outputs the shape oracle computed (native/capture_shapes.h)
    evicted: int  # values a budget's guard dropped (:meth:`Capture.guard`)
    overruns: int  # ops before which it could not drop enough to stay within its cap
    eager_rests: int  # steps that called a ``torch.compile``d region: eager from it to their end
    ran_ahead: int  # ops on small real tensors run on the step's thread without waiting (Adam's step count)
    parked: int  # storages a memory plan parked in the host pool (offload=True)
    back_early: int  # of them, brought back before the plan's place (read early, or held at the step's end)
    placed: int  # storages put in a memory plan's arena (arena=True; native/arena.h)


class StepLines(NamedTuple):
    """The user lines (where a step's ops were called) traced steps had not met: a step that met
    one may have gone where the TraceGraph has not (coexec/native_traces.py)."""

    untraced: int  # lines of an untraced step that no traced step had met
    newly_traced: int  # lines a traced step met first


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
        self._c = built.Capture(
            mode, torch.get_num_threads(), _internal_dirs(), _library_dirs(), try_scopes, _with_place
        )
        self._following: tuple[DropPlan | None, tuple[DropPlan, ...]] = (None, ())

    def step(self) -> _CapturedStep:
        """Capture the ops this thread runs inside the ``with`` block."""
        return _CapturedStep(self._c)

    def replay(self) -> int:
        """("replay" mode, inside a step) Run the ops taped so far; their number."""
        return self._c.replay()

    @property
    def counters(self) -> CaptureCounters:
        return tuple.__new__(CaptureCounters, self._c.counters)

    def describe_next(self) -> None:
        """Describe the next step (it follows no memory plan): :meth:`description` after it."""
        self._c.describe_next()

    def description(self) -> StepDescription:
        """The last described step."""
        ops, nbytes, existed, fetched, released, alive, where = self._c.description()
        described = tuple(
            DescribedOp(
                p, name, op_id, ns * 1e-9, once, rnd, tuple(r), tuple(w), tuple(m), tuple(map(tuple, v)), ws, bwd,
                tuple(after),
            )
            for p, name, op_id, ns, once, rnd, r, w, m, v, ws, bwd, after in ops
        )
        return StepDescription(
            described, tuple(nbytes), tuple(existed), frozenset(fetched), dict(released), frozenset(alive),
            tuple(where),
        )  # fmt: skip

    def trace_next(self, on: bool = True) -> None:
        """Log the next step's ops for its trace: :meth:`take_trace` after it (``on=False``: not,
        after all)."""
        self._c.trace_next(on)

    def take_trace(self) -> CapturedStep:
        """The last traced step's log (``tracegraph.from_capture`` makes it a Trace)."""
        return step_of(self._c.take_trace())

    @property
    def lines(self) -> StepLines:
        """The last step's user lines (where its ops were called) that no traced step had met."""
        return StepLines(*self._c.lines)

    def follow(self, plan: DropPlan | None, other_paths: tuple[DropPlan, ...] = ()) -> None:
        """Follow ``plan`` from the next step on (None: no plan); a step whose ops leave its path
        where one of ``other_paths``' plans (the same ops before, this op here: another branch
        taken) goes on follows that one from there (:attr:`followed_path` says which). Plans
        with an arena take no other paths."""
        was, was_others = self._following
        if was is plan and len(was_others) == len(other_paths) and all(map(operator.is_, was_others, other_paths)):
            return  # (asked before every step: the same plans cost nothing)
        if other_paths and (plan is None or any(p.arena_bytes for p in (plan, *other_paths))):
            raise ValueError("plans of other paths go beside a plan, none with an arena (one arena per step)")
        self._following = (plan, other_paths)
        if plan is None:
            self._c.clear_drops()
            return
        self._c.set_drops(
            list(plan.ops), sorted(plan.keep), sorted(plan.after.items()), list(plan.value_bytes),
            [tuple(p) for p in plan.parks], plan.arena_bytes, [tuple(p) for p in plan.placed],
        )  # fmt: skip
        for p in other_paths:
            self._c.add_path(
                list(p.ops), sorted(p.keep), sorted(p.after.items()), list(p.value_bytes), [tuple(x) for x in p.parks]
            )

    def guard(self, cap: int) -> None:
        """Keep the next steps' ops within ``cap`` bytes of the blocks the CPU allocator handed
        out since ``native.reset_cpu_peak()`` and still holds (``native.cpu_bytes_made()``, a
        step's own bytes when reset as it begins; 0: no guard): before an op that would take them
        past the cap, the worker drops values it can make again (least modeled cost per byte,
        oldest first) and makes them again where they are read. A memory budget's backstop for
        steps its plan does not cover (coexec/native_plans.py)."""
        self._c.guard(int(cap))

    @property
    def followed(self) -> bool:
        """Did the last step follow its memory plan to its end?"""
        return self._c.followed

    @property
    def followed_path(self) -> int:
        """Which plan the last step followed to its end: 0 the one :meth:`follow` was given, i
        the i-th of its ``other_paths`` (-1: none)."""
        return self._c.followed_path

    @property
    def outgrew(self) -> bool:
        """Did the last step stop following its memory plan because it made a value larger than
        the planned step did (its sizes grew past the plan's)?"""
        return self._c.outgrew

    @property
    def backward_why(self) -> str:
        """Why the latest ``backward()`` in a step ran the autograd engine ("" if a gradient
        block answered it)."""
        return self._c.backward_why

    def close(self) -> None:
        """Stop the worker thread now (it also stops when the capture is collected)."""
        self._c = None


def _with_place(
    error: BaseException, index: int, frames: list[tuple[str, int, str]]
) -> BaseException:
    """An op's error raised after the program went on past the op (it ran on the worker): eager's
    exception, with a note saying where the op was called and a traceback that goes on to that
    line (``native/capture.cpp``, ``raise_failure``). Ops called inside a ``try`` that may catch
    their error run at once, so their errors are raised at their line, as in eager."""
    where = ", in ".join(f"{file}:{line} in {name}" for file, line, name in frames) or "an unknown place"
    note = (
        f"coexec: raised by op {index} of the captured step, called at {where}; the executor ran "
        "it after the step's Python had gone on past that line"
    )
    if hasattr(error, "add_note"):  # (Python 3.11+)
        error.add_note(note)
    with contextlib.suppress(Exception):  # (the op's error is never hidden behind this one)
        tb = traceback_through(frames)
        if tb is not None:
            error = error.with_traceback(tb)
    return error


class _CapturedStep:
    """The ``with`` block of ``Capture.step()`` (a class, not a generator: it runs every step)."""

    __slots__ = ("_c",)

    def __init__(self, c) -> None:
        self._c = c

    def __enter__(self) -> None:
        self._c.begin()
        _waiting().put(self._c)

    def try_enter(self) -> bool:
        """``__enter__``, or False (nothing done) where a step is being captured already, by this
        capture or another, in any thread (one at a time in a process)."""
        if not self._c.try_begin():
            return False
        _waiting().put(self._c)
        return True

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        _waiting().take()
        if ev is not None:
            with contextlib.suppress(Exception):  # (the step's own error is the one to see)
                self._c.end()
            return False
        self._c.end()  # (an op's error: raised as eager's, with its place: _with_place)
        return False


@functools.cache
def _internal_dirs() -> list[str]:
    """Where torch's and coexec's own Python files are (prefixes of their paths): an error on
    the worker names the innermost frame outside them (the user's line) before the op's own
    frame, and their try blocks are not looked at. The fuzzer's programs
    (``coexec/fuzz/interp.py``) are not among them: they are user code, as the recorder sees
    them (the fuzzer's harness, which catches what a step raises to compare it, is coexec's)."""
    root = Path(__file__).parents[1]
    dirs = [Path(torch.__file__).parent]
    dirs += [root / name for name in ("executor", "tracegraph", "planner")]
    files = [p for p in (root / "coexec").iterdir() if p.name != "fuzz"]
    files += [p for p in (root / "coexec" / "fuzz").iterdir() if p.name != "interp.py"]
    # (as imported and with links resolved: code objects name their file as it was imported)
    out = {str(p) + os.sep for d in dirs for p in (d, d.resolve())}
    out |= {str(p) + (os.sep if p.is_dir() else "") for f in files for p in (f, f.resolve())}
    return sorted(out)


@functools.cache
def _library_dirs() -> list[str]:
    """Where installed code is (site-packages, the standard library): its try blocks do not make
    ops run at once (a test runner's, a notebook's or a trainer's ``except BaseException:`` around
    the program would make every step eager); the program's own do (``executor/try_scopes.py``)."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    dirs.add(site.getusersitepackages())
    return sorted({str(p) + os.sep for d in dirs for p in (Path(d), Path(d).resolve())})


def is_placeholder(t: torch.Tensor) -> bool:
    """Is ``t`` a placeholder (a tensor of a step still being captured, without memory)?"""
    built = native.ready()
    return built is not None and built.is_placeholder(t)


class _Waiting:
    """The wrapped Tensor methods and generator functions (made once): in the thread whose step
    is captured they wait for the worker first and run with capture paused; elsewhere they are
    torch's own. Torch's own ``__torch_function__`` handling and the recorder tell these methods
    apart by identity (left in place as plain attributes, printing and ``numpy()`` broke for the
    default backend's placeholders and traces), so outside a step, and in other threads,
    ``torch.Tensor.numpy`` and the rest must be the originals:

    * the Tensor methods are :class:`_StepMethod` descriptors, put on ``torch.Tensor`` once,
      which give the wrapper or the original as the step's state says (swapping them per step
      cost 36 ``setattr``s on a class with many subclasses, each emptying method caches);
    * the generator functions are module attributes, swapped per step (a ``setattr`` on a
      module is a dict store)."""

    def __init__(self) -> None:
        self.capture = None  # the native capture whose step runs
        self.thread = 0
        self.stand_ins: dict[torch.dtype, torch.Tensor] = {}  # (stand_in_of)
        self.dynamo: tuple | None = None  # eval_frame, its original, the wrapper (_hook_dynamo)
        for name in _DATA_ACCESS:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _StepMethod(original, self._wrap(original, True), self))
        for name in _STAND_IN:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _StepMethod(original, self._stand_in(original), self))
        # per module, the swapped names' wrappers and originals: put in and taken back with one
        # dict update per module (11 setattrs twice a step cost ~2 us of a 0.15 ms step)
        wrappers: dict[object, dict[str, Callable]] = {torch: {}, torch.random: {}, torch.autograd: {}}
        for owner in (torch, torch.random):
            for name in _RANDOM:
                wrappers[owner][name] = self._wrap(getattr(owner, name), False)
        wrappers[torch.autograd]["backward"] = self._backward(torch.autograd.backward)
        wrappers[torch.autograd]["grad"] = self._grad(torch.autograd.grad)
        # (torch.compile called in a step imports Dynamo: hooked at once)
        wrappers[torch]["compile"] = self._compile(torch.compile)
        self.wrappers = [(vars(owner), w) for owner, w in wrappers.items()]
        self.originals = [(vars(owner), {n: getattr(owner, n) for n in w}) for owner, w in wrappers.items()]

    def _wrap(self, original: Callable, realize_first: bool) -> Callable:
        name = original.__name__  # (a traced step's fetch says which read it was)

        @functools.wraps(original)
        def waiting(*args, **kwargs):
            if (
                not self.stepping_here()
            ):  # (a method bound during a step, called later or elsewhere)
                return original(*args, **kwargs)
            c = self.capture
            if realize_first:
                c.realize(args[0], name)
            else:
                c.wait()
            c.pause()
            try:
                return original(*args, **kwargs)
            finally:
                c.resume()

        return waiting

    def _stand_in(self, original: Callable) -> Callable:
        """``Tensor.new_tensor`` / ``Tensor.new`` in a captured step: on a placeholder, called on
        an empty real tensor of its dtype (a placeholder's dispatch key names no device; the
        result depends only on the dtype and the device, the CPU). The new tensor's own ops
        still come to the capture, as ``torch.tensor`` does."""

        @functools.wraps(original)
        def stand_in(self_: torch.Tensor, *args, **kwargs):
            if (
                self.stepping_here()
                and is_placeholder(self_)
                and not torch._C._has_torch_function_unary(self_)
            ):
                self_ = self.stand_in_of(self_.dtype)
            return original(self_, *args, **kwargs)

        return stand_in

    def stand_in_of(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty real CPU tensor of ``dtype`` (made once per dtype, with capture paused)."""
        t = self.stand_ins.get(dtype)
        if t is None:
            self.capture.pause()
            try:
                t = self.stand_ins[dtype] = torch.empty(0, dtype=dtype)
            finally:
                self.capture.resume()
        return t

    def _backward(self, original: Callable) -> Callable:
        """``torch.autograd.backward`` (which ``Tensor.backward`` calls) in a captured step: a plain
        ``loss.backward()`` is answered by a gradient block where the capture has one for the
        step's path (``native/capture_blocks.h``), else runs the engine (and, the first time at a
        path, makes the block from the ops it issues, watched for Python inside the engine)."""

        @functools.wraps(original)
        def backward(
            tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
            inputs=None,
        ):  # fmt: skip
            plain = (
                grad_tensors is None and grad_variables is None and inputs is None
                and not retain_graph and not create_graph and isinstance(tensors, torch.Tensor)
                and self.stepping_here() and not torch._C._are_functorch_transforms_active()
            )  # fmt: skip
            if not plain:
                return original(
                    tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs
                )
            self._run(tensors, (), True, lambda: original(tensors))
            return None

        return backward

    def _grad(self, original: Callable) -> Callable:
        """``torch.autograd.grad`` in a captured step: a plain ``grad(loss, leaves)`` (one scalar
        output, leaves that require grad, no ``grad_outputs``, graph not kept) is answered by a
        gradient block as ``backward()`` is, returning placeholders of the block's values."""

        @functools.wraps(original)
        def grad(
            outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
            only_inputs=True, allow_unused=None, is_grads_batched=False, materialize_grads=False,
        ):  # fmt: skip
            loss = outputs
            if isinstance(outputs, (tuple, list)) and len(outputs) == 1:
                loss = outputs[0]
            plain = (
                isinstance(loss, torch.Tensor) and grad_outputs is None and not retain_graph
                and not create_graph and only_inputs and not is_grads_batched
                and not (materialize_grads and allow_unused is False)
                and self.stepping_here() and not torch._C._are_functorch_transforms_active()
            )  # fmt: skip
            if plain:
                inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
                if not isinstance(inputs, dict):  # (a dict's keys come back: the engine's way)
                    inputs = tuple(inputs)  # (once: an iterator such as model.parameters())
                    plain = bool(inputs) and all(
                        type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_leaf and t.requires_grad
                        for t in inputs
                    )
                else:
                    plain = False
            if not plain:
                return original(
                    outputs, inputs, grad_outputs, retain_graph, create_graph, only_inputs,
                    allow_unused, is_grads_batched, materialize_grads,
                )  # fmt: skip
            allow_unused = materialize_grads if allow_unused is None else allow_unused
            found = self._run(
                loss, inputs, allow_unused, lambda: original(loss, inputs, allow_unused=allow_unused)
            )
            if materialize_grads:  # (as torch does it, after the engine)
                found = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(found, inputs))
            return found

        return grad

    def _run(
        self,
        loss: torch.Tensor,
        inputs: tuple[torch.Tensor, ...],
        allow_unused: bool,
        engine: Callable[[], tuple[torch.Tensor | None, ...] | None],
    ) -> tuple[torch.Tensor | None, ...] | None:
        """A plain backward (no ``inputs``) or grad: replayed as a block, or ``engine()`` run
        (watched, its ops made a block, the first time at a path)."""
        c = self.capture
        how = c.backward_begin(loss, inputs, allow_unused)
        if how == _REPLAYED:
            return tuple(c.take_grads()) if inputs else None
        if how == _ENGINE:
            return engine()
        ok, watch, found = False, PythonWatch(), None
        try:
            with watch:
                found = engine()
            ok = True
        finally:  # (blind, under a profiler: no block now, the next step here tries again)
            c.backward_end(ok, watch.seen or "", watch.blind, found or ())
        return found

    def _compile(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def compile(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.stepping_here():
                self._hook_dynamo()
            return out

        return compile

    def _hook_dynamo(self) -> None:
        """Where Dynamo is imported (``torch.compile`` was used), a ``torch.compile``d region
        called in the step runs as eager from there to the step's end
        (``Capture::run_rest_eagerly``): Dynamo's compiling runs FakeTensor ops, its compiled code
        reads its inputs' memory outside the dispatcher, and its guards check the thread's
        dispatch keys, which would hold the capture's. A region's ``compile_wrapper`` (and a
        ``torch._dynamo.optimize`` context's ``__enter__``) calls ``set_skip_guard_eval_unsafe``
        before it saves the thread's keys and sets Dynamo's callback; ``torch._dynamo.disable``
        (which optimizers use) does not call it."""
        frames = sys.modules.get("torch._dynamo.eval_frame")
        if frames is None or not hasattr(frames, "set_skip_guard_eval_unsafe"):
            return
        if self.dynamo is None or self.dynamo[0] is not frames:
            original = frames.set_skip_guard_eval_unsafe

            @functools.wraps(original)
            def set_skip_guard_eval_unsafe(*args, **kwargs):
                if self.stepping_here():
                    self.capture.run_rest_eagerly()
                return original(*args, **kwargs)

            self.dynamo = (frames, original, set_skip_guard_eval_unsafe)
        frames.set_skip_guard_eval_unsafe = self.dynamo[2]

    def put(self, c) -> None:
        """The wrappers in place for a step of ``c`` in this thread."""
        self.capture, self.thread = c, threading.get_ident()
        for namespace, wrappers in self.wrappers:
            namespace.update(wrappers)
        self._hook_dynamo()

    def take(self) -> None:
        """The originals back (the step ended)."""
        for namespace, originals in self.originals:
            namespace.update(originals)
        if self.dynamo is not None:
            self.dynamo[0].set_skip_guard_eval_unsafe = self.dynamo[1]
        self.capture = None

    def stepping_here(self) -> bool:
        return self.capture is not None and threading.get_ident() == self.thread


class _StepMethod:
    """A ``torch.Tensor`` attribute that is ``original`` (torch's own function or method
    descriptor, the very object) except in the thread of a captured step, where it is
    ``wrapper``."""

    __slots__ = ("__wrapped__", "original", "waiting", "wrapper")

    def __init__(self, original: Callable, wrapper: Callable, waiting: _Waiting) -> None:
        self.original, self.wrapper, self.waiting = original, wrapper, waiting
        self.__wrapped__ = original

    def __get__(self, obj: object, owner: type | None = None) -> Callable:
        f = self.wrapper if self.waiting.stepping_here() else self.original
        return f if obj is None else f.__get__(obj, owner)


@functools.cache
def _waiting() -> _Waiting:
    return _Waiting()
