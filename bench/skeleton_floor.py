"""Per-op cost of the co-execution skeleton against eager PyTorch and against the floor of the
mechanism it is built on, on a tiny MLP training step (batch 1, width 8: compute ~ 0).

    python bench/skeleton_floor.py [--repeats 30]

Rows (microseconds per ATen op of the step, median over repeats of 10-step blocks):

* eager: plain PyTorch, i.e. its own per-op overhead (Python binding, dispatcher, autograd).
* interception: the same step under a TorchFunctionMode and a TorchDispatchMode that only pass
  each call on: what it costs just to see every op from Python, before any bookkeeping. Any
  skeleton built on Python modes pays at least this (plus placeholders and autograd on them).
* record: eager plus tracegraph recording (the tracing phase).
* coexec: a co-executed step (skeleton plus the executor thread, which shares the GIL).
* native backend: a step of ``GradientTape(backend="native")`` (executor/capture.py: every op
  answered by a C++ kernel, computed by a C++ worker).

A second table times one kind of call alone: 200 ``p.add_(g, alpha=-0.01)`` under ``no_grad``
(an optimizer's update, issued from a call template under coexec: coexec/calls.py), per call,
eager against co-executed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import coexec  # noqa: E402
from executor import native  # noqa: E402
from tracegraph import record  # noqa: E402


class _FloorDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


class _FloorFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


def make():
    """The tiny MLP's training step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(1, 8), torch.randn(1, 1)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    return step


def per_call(fn, repeats: int, block: int = 10) -> float:
    """Seconds per call of ``fn``: the median over ``repeats`` blocks of ``block`` calls, after 3."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(block):
            fn()
        samples.append((time.perf_counter() - t0) / block)
    return statistics.median(samples)


def per_op(fn, ops: int, repeats: int, block: int = 10) -> float:
    """Microseconds per op of ``fn``, a call of which runs ``ops`` ops."""
    return per_call(fn, repeats, block) / ops * 1e6


def make_updates(n: int = 200):
    torch.manual_seed(0)
    params = [torch.randn(16) for _ in range(n)]
    grads = [torch.randn(16) for _ in range(n)]

    def step() -> None:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g, alpha=-0.01)

    return step, n


def under(tape: coexec.GradientTape, step):
    """``step`` run in ``tape``'s ``with`` block."""

    def run() -> None:
        with tape:
            step()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native.wait() is None:
        raise SystemExit("the native module is not available (the native backend's rows need it)")
    step = make()
    with record() as trace:
        step()
    ops = len(trace.ops)

    def floor() -> None:
        with _FloorFunction(), _FloorDispatch():
            step()

    def recorded() -> None:
        with record():
            step()

    tape = coexec.GradientTape(backend="interpret", key="skeleton-floor")
    native_tape = coexec.GradientTape(key="skeleton-floor-native", backend="native")
    rows = [
        ("eager", per_op(step, ops, args.repeats)),
        ("interception (pass-through modes)", per_op(floor, ops, args.repeats)),
        ("record (tracing phase)", per_op(recorded, ops, args.repeats)),
        ("coexec (co-executed step)", per_op(under(tape, step), ops, args.repeats)),
        ("native backend (co-executed step)", per_op(under(native_tape, step), ops, args.repeats)),
    ]
    assert tape.stats.phase == "coexec" and tape.stats.fallbacks == 0, tape.stats
    print(f"tiny MLP step, {ops} ATen ops, torch {torch.__version__}, 1 thread\n")
    print("| step | us/op | x eager |\n|---|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.1f} | {v / rows[0][1]:.1f} |")

    update, calls = make_updates()
    up_tape = coexec.GradientTape(backend="interpret", key="skeleton-floor-updates")
    native_up_tape = coexec.GradientTape(key="skeleton-floor-updates-native", backend="native")
    rows = [
        ("eager", per_op(update, calls, args.repeats)),
        ("coexec", per_op(under(up_tape, update), calls, args.repeats)),
        ("native backend", per_op(under(native_up_tape, update), calls, args.repeats)),
    ]
    assert up_tape.stats.templated_calls == calls, up_tape.stats
    print(f"\n{calls} no-grad p.add_(g, alpha=-0.01) calls, one step\n")
    print("| step | us/call | x eager |\n|---|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.1f} | {v / rows[0][1]:.1f} |")


if __name__ == "__main__":
    main()
