"""Where a co-executed step's time goes: the skeleton issuing ops against the executor running them.

    python bench/executor_timeline.py [--models gpt2-6l,resnet50] [--batch 16] [--steps 7] [--threads 1]
                                      [--planned]

Per zoo model (one SGD step, no budget, no arena; with ``--planned``, the default tape: the
plan's order and arena, after its plan arrived), eager and co-executed steps alternate after
warm-up; per co-executed step the executor's ops are timed (the native engine records them
itself when asked; the Python executor's ``run`` is wrapped: instrumentation, not part of
coexec) and figures are medians over the steps:

* ``eager ms``: the eager step; ``ops``: ATen ops per step; ``traced op ms``: the sum of the
  ops' own times measured while tracing (what the planner's predictions add up);
* ``coexec ms``: the co-executed step, entry to drained exit;
* ``issued at``: when the skeleton had issued its last op (ms into the step), and ``done by
  then``: how many of the ops the executor had run at that moment;
* ``skeleton cpu ms``: CPU time of the user's thread over the step (the skeleton's Python), and
  its parts ``fwd``, ``bwd``, ``opt``: the forward and loss, ``loss.backward()``, the optimizer;
* ``executor op ms``: the executor's time inside ops, summed; split into the ops it ran while
  the skeleton was still issuing (``while issuing``, with the same ops' traced time beside it,
  ``traced, while``) and after (``after``, ``traced, after``);
* ``longest idle ms``: the longest time between two ops the executor ran, and ``idle before``
  the op it ran next (a plan the executor cannot run ahead in shows here).

What it showed on the 2-core CPU with the Python executor (docs/coexec.md, Performance): ops the
executor runs while the skeleton's Python holds the GIL and a core take several times their
traced time; once the skeleton waits, they run at 0.7-2.2x of it. ``while/traced`` is the ratio
of the two (issue 16 asks for at most 1.15).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
import executor.engine as engine  # noqa: E402
import executor.stream as stream  # noqa: E402
from coexec import runtime  # noqa: E402
from common import markdown_table, measure_each, prepare  # noqa: E402
from examples.models import ZOO  # noqa: E402

_RUNS: list[tuple[float, float, int]] = []  # (start, end, op index) per executed Run
_ISSUED: list[float] = []  # submission time of each Run


def _instrument() -> None:
    """Time each op the executor runs: the Python executor's by wrapping its ``run``, the
    native engine's from its own record (``record_order``: start and end on the clock of
    ``time.perf_counter``)."""
    run, submit = stream._Worker.run, stream.Executor.submit
    native_submit = engine.NativeExecutor.submit

    def timed_run(self, ins, values):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        run(self, ins, values)
        _RUNS.append((t0, time.perf_counter(), ins.op_index))

    def timed_submit(self, ins):  # noqa: ANN001, ANN202
        if type(ins) is stream.Run:
            _ISSUED.append(time.perf_counter())
        return submit(self, ins)

    def timed_native_submit(self, ins):  # noqa: ANN001, ANN202
        if type(ins) is stream.Run:
            _ISSUED.append(time.perf_counter())
        return native_submit(self, ins)

    stream._Worker.run = timed_run
    stream.Executor.submit = timed_submit
    engine.NativeExecutor.submit = timed_native_submit


def _native_runs(ex) -> None:  # noqa: ANN001
    """The native engine's record of the latest step's runs, into _RUNS."""
    if isinstance(ex, engine.NativeExecutor):
        _RUNS.extend((a, b, i) for (a, b), i in zip(ex._e.ran_times(), ex._e.ran_order()))
        ex._e.record_order(True)  # (and empty it for the next step)


def measure(name: str, batch: int, steps: int, planned: bool = False) -> dict:
    eager, co = ZOO[name](batch), ZOO[name](batch)
    tape = coexec.GradientTape(
        backend="interpret", arena=None if planned else False, key=("timeline", name, planned)
    )

    parts: dict[str, float] = {}

    def co_step() -> None:
        # ZooModel.step (less the loss it returns detached), with the user's thread's CPU time
        # taken between its parts
        with tape:
            t0 = time.thread_time()
            loss = co.loss(co.model(co.inputs[0]), co.inputs[1])
            t1 = time.thread_time()
            loss.backward()
            t2 = time.thread_time()
            co.optimizer.step()
            co.optimizer.zero_grad(set_to_none=True)
            t3 = time.thread_time()
        parts.update(fwd=t1 - t0, bwd=t2 - t1, opt=t3 - t2)

    for _ in range(5):  # trace, trace (momentum buffers appear), covered, co-executed
        eager.step()
        co_step()
    if tape.stats.phase != "coexec":
        raise RuntimeError(f"{name} did not settle into co-execution: {tape.stats}")
    coexec.wait_for_plans()
    co_step()
    trace = tape._program.paths[-1].trace
    traced = {op.index: op.seconds for op in trace.ops}
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eager.step()
        e = time.perf_counter() - t0
        _RUNS.clear()
        _ISSUED.clear()
        ex = runtime.executor()
        if isinstance(ex, engine.NativeExecutor):
            ex._e.record_order(True)
        c0, t0 = time.thread_time(), time.perf_counter()
        co_step()
        c, cpu = time.perf_counter() - t0, time.thread_time() - c0
        _native_runs(ex)
        issued = _ISSUED[-1]
        runs = sorted(_RUNS)
        idle, idle_before = max(((c - b, k) for (_a, b, _i), (c, _d, k) in zip(runs, runs[1:])), default=(0.0, None))
        before = [(b - a, traced.get(i, 0.0)) for a, b, i in _RUNS if b <= issued]
        after = [(b - a, traced.get(i, 0.0)) for a, b, i in _RUNS if b > issued]
        rows.append({
            "eager ms": 1e3 * e,
            "coexec ms": 1e3 * c,
            "issued at": 1e3 * (issued - t0),
            "done by then": len(before),
            "skeleton cpu ms": 1e3 * cpu,
            "fwd": 1e3 * parts["fwd"],
            "bwd": 1e3 * parts["bwd"],
            "opt": 1e3 * parts["opt"],
            "executor op ms": 1e3 * sum(x for x, _ in before + after),
            "while issuing": 1e3 * sum(x for x, _ in before),
            "traced, while": 1e3 * sum(y for _, y in before),
            "after": 1e3 * sum(x for x, _ in after),
            "traced, after": 1e3 * sum(y for _, y in after),
            "longest idle ms": 1e3 * idle,
            "idle before": idle_before,
        })  # fmt: skip
    out = {"model": name, "ops": len(traced), "traced op ms": 1e3 * sum(traced.values())}
    for k in rows[0]:
        if k != "idle before":
            out[k] = statistics.median(r[k] for r in rows)
    longest = max(rows, key=lambda r: r["longest idle ms"])["idle before"]
    out["idle before"] = trace.ops[longest].name if longest is not None and longest < len(trace.ops) else "-"
    out["done by then"] = f"{int(out['done by then'])}/{len(traced)}"
    out["while/traced"] = out["while issuing"] / out["traced, while"] if out["traced, while"] else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2-6l,resnet50")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--planned", action="store_true", help="the default tape (plan and arena), not arena=False")
    args = ap.parse_args()
    prepare(args.threads)
    _instrument()
    print(markdown_table(measure_each(args.models, lambda name: measure(name, args.batch, args.steps, args.planned))))


if __name__ == "__main__":
    main()
