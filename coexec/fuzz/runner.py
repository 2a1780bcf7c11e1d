"""Train one generated program eagerly and under coexec, and compare them bit for bit.

Each run starts from ``torch.manual_seed(seed)`` and fresh state. After every step the runner
keeps a record of what the step showed (loss bits, printed text, the checkpoint it saved) and a
digest of the whole persistent state (parameters, buffers, gradients, optimizer state, learning
rates); the first step whose record differs is where the runs diverged. An exception ends a
run; coexec must raise the same type at the same step as eager.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

import coexec

from .interp import Env, State, build, step
from .spec import Spec, generate

# tamper(state, i): called before step i of the coexec run only (the harness's own tests plant
# divergences with it)
Tamper = Callable[[State, int], None]

_runs = itertools.count()


@dataclass(frozen=True)
class StepRecord:
    """What one step showed, in a form compared with ``==``."""

    loss: str  # the float's bits (float.hex), so -0.0 and NaN compare exactly
    text: str
    saved: str  # digest of the tensors loaded back from the step's checkpoint
    state: str  # digest of the persistent state after the step


@dataclass(frozen=True)
class RunResult:
    """One run (eager or coexec): a record per completed step, the exception that ended it,
    its time and the tape's statistics (coexec only)."""

    records: tuple[StepRecord, ...]
    error: tuple[int, str, str] | None  # (step, exception type, message)
    seconds: float
    stats: coexec.TapeStats | None


@dataclass(frozen=True)
class FuzzResult:
    """One program's verdict. ``diverged_at``: the first step whose loss, printed text,
    checkpoint or state differs, or where only one run raised (or they raised different types);
    ``detail`` says what differed."""

    seed: int
    summary: str
    steps: int
    eager_error: str | None
    coexec_error: str | None
    diverged_at: int | None
    detail: str
    traces: int
    fallbacks: int
    coexec_steps: int
    eager_seconds: float
    coexec_seconds: float

    @property
    def outcome(self) -> str:
        """``ok``, ``diverged``, ``coexec_crash`` (only coexec raised, or another type) or
        ``both_crash`` (the same exception type at the same step: as eager, so not a bug)."""
        if self.diverged_at is None:
            return "both_crash" if self.eager_error else "ok"
        if self.coexec_error and self.detail.startswith("coexec raised"):
            return "coexec_crash"
        return "diverged"

    @property
    def failed(self) -> bool:
        return self.outcome in ("diverged", "coexec_crash")


def _digest(tensors: Iterable[torch.Tensor | None]) -> str:
    h = hashlib.sha1()
    for t in tensors:
        if t is None:
            h.update(b"None;")
            continue
        t = t.detach()
        h.update(f"{t.dtype}{tuple(t.shape)}{t.layout}{t.requires_grad};".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def state_tensors(state: State) -> list[torch.Tensor | None]:
    """Parameters, buffers, gradients, optimizer state and learning rates, in a fixed order."""
    out: list[torch.Tensor | None] = list(state.net.state_dict().values())
    params = list(state.net.parameters())
    out += [p.grad for p in params]
    for p in params:
        st = state.opt.state.get(p, {})
        out += [v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in st.values()]
    out += [torch.tensor(float(g["lr"]), dtype=torch.float64) for g in state.opt.param_groups]
    return out


def _loss_bits(loss: torch.Tensor) -> str:
    value = float(loss.item())
    return struct.pack(">d", value).hex()


def run_once(
    spec: Spec,
    steps: int,
    use_coexec: bool,
    tamper: Tamper | None = None,
    backend: str = "interpret",
) -> RunResult:
    """Train ``spec`` for ``steps`` steps from ``torch.manual_seed(spec.seed)`` (under coexec
    with ``backend``; ``"native"`` is given none of the program's tape options, ``"auto"``
    and ``"interpret"`` all of them, as ``GradientTape()`` would be)."""
    torch.manual_seed(spec.seed)
    state = build(spec)
    tape = None
    if use_coexec:
        options = {}
        if backend != "native":
            options = {
                "max_traces": 2 if "max_traces_2" in spec.extra else 10,
                "arena": False if "no_arena" in spec.extra else None,
                "sync": "none" if "sync_none" in spec.extra else "step",
            }
        key = ("fuzz", spec.seed, next(_runs))
        tape = coexec.GradientTape(key=key, timeout=60.0, backend=backend, **options)
    records: list[StepRecord] = []
    error = None
    start = time.perf_counter()
    for i in range(steps):
        env = Env()
        try:
            if tape is None:
                loss = step(state, i, env)
            else:
                if tamper is not None:
                    tamper(state, i)
                env.tape = tape
                env.within = lambda: tape
                loss = step(state, i, env)
                if tape.sync == "none":
                    coexec.synchronize()  # the run-ahead executor: before reading state
            rec = StepRecord(
                _loss_bits(loss), env.text.getvalue(), _digest(env.saved),
                _digest(state_tensors(state)),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - any exception is a result to compare
            error = (i, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            break
        records.append(rec)
    seconds = time.perf_counter() - start
    wait = getattr(coexec, "wait_for_plans", None)
    if tape is not None and wait is not None:
        wait()
    return RunResult(tuple(records), error, seconds, tape.stats if tape is not None else None)


def _loss_value(bits: str) -> float:
    return struct.unpack(">d", bytes.fromhex(bits))[0]


def _field_diff(a: StepRecord, b: StepRecord) -> str:
    for name in ("loss", "text", "saved", "state"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            if name == "loss":
                x, y = _loss_value(x), _loss_value(y)
            return f"{name}: eager {x!r} coexec {y!r}"
    return ""


def compare(eager: RunResult, co: RunResult) -> tuple[int | None, str]:
    """The first step where the runs differ and what differed, or (None, "")."""
    for i, (a, b) in enumerate(zip(eager.records, co.records)):
        if a != b:
            return i, _field_diff(a, b)
    ee, ce = eager.error, co.error
    if ee is None and ce is None:
        return None, ""
    if ee is not None and ce is not None and ee[:2] == ce[:2]:
        return None, ""
    if ce is not None and (ee is None or ce[0] <= ee[0]):
        return ce[0], f"coexec raised {ce[1]}: {ce[2]} (eager: {_err(ee)})"
    assert ee is not None
    return ee[0], f"eager raised {ee[1]}: {ee[2]} (coexec: {_err(ce)})"


def _err(e: tuple[int, str, str] | None) -> str:
    return "no error" if e is None else f"{e[1]} at step {e[0]}: {e[2]}"


def run_spec(
    spec: Spec, steps: int, tamper: Tamper | None = None, backend: str = "interpret"
) -> FuzzResult:
    """Run ``spec`` eagerly then under coexec (``backend``) and compare."""
    eager = run_once(spec, steps, False)
    co = run_once(spec, steps, True, tamper, backend)
    at, detail = compare(eager, co)
    stats = co.stats
    return FuzzResult(
        seed=spec.seed,
        summary=spec.summary(),
        steps=steps,
        eager_error=_err(eager.error) if eager.error else None,
        coexec_error=_err(co.error) if co.error else None,
        diverged_at=at,
        detail=detail,
        traces=stats.traces if stats else 0,
        fallbacks=stats.fallbacks if stats else 0,
        coexec_steps=stats.coexec_steps if stats else 0,
        eager_seconds=eager.seconds,
        coexec_seconds=co.seconds,
    )


def run_program(
    seed: int,
    steps: int,
    features: Iterable[str] | None = None,
    tamper: Tamper | None = None,
    backend: str = "interpret",
) -> FuzzResult:
    """Generate the program of ``seed`` (restricted to ``features``) and compare it."""
    return run_spec(generate(seed, features), steps, tamper, backend)


def run_quiet(
    seed: int, steps: int, features: Iterable[str] | None = None, backend: str = "interpret"
) -> FuzzResult:
    """:func:`run_program` with warnings silenced (a worker process's entry point)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_program(seed, steps, features, backend=backend)


def shrink(
    seed: int,
    steps: int,
    features: Iterable[str] | None = None,
    tamper: Tamper | None = None,
    backend: str = "interpret",
) -> tuple[frozenset[str], FuzzResult]:
    """The smallest feature set (greedily, one feature dropped at a time) with which the
    program of ``seed`` still fails the same way (same outcome); and its result. Returns the
    program's own features and result if it does not fail."""
    feats = generate(seed, features).features()
    best = run_program(seed, steps, feats, tamper, backend)
    if not best.failed:
        return feats, best
    dropped = True
    while dropped:
        dropped = False
        for f in sorted(feats):
            r = run_program(seed, steps, feats - {f}, tamper, backend)
            if r.outcome == best.outcome:
                feats, best, dropped = feats - {f}, r, True
    return generate(seed, feats).features(), best  # what the program has (an optimizer)
