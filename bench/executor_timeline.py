"""Where a co-executed step's time goes: the skeleton issuing ops against the executor running them.

    python bench/executor_timeline.py [--models gpt2-6l,resnet50] [--batch 16] [--steps 7]

Per zoo model (one SGD step, no budget, no arena), eager and co-executed steps alternate after
warm-up; per co-executed step the executor's instructions are timed (the script wraps the
worker's ``run``: instrumentation, not part of coexec) and figures are medians over the steps:

* ``eager ms``: the eager step; ``ops``: ATen ops per step; ``traced op ms``: the sum of the
  ops' own times measured while tracing (what the planner's predictions add up);
* ``coexec ms``: the co-executed step, entry to drained exit;
* ``issued at``: when the skeleton had issued its last op (ms into the step), and ``done by
  then``: how many of the ops the executor had run at that moment;
* ``skeleton cpu ms``: CPU time of the user's thread over the step (the skeleton's Python), and
  its parts ``fwd``, ``bwd``, ``opt``: the forward and loss, ``loss.backward()``, the optimizer;
* ``executor op ms``: the executor's time inside ops, summed; split into the ops it ran while
  the skeleton was still issuing (``while issuing``, with the same ops' traced time beside it,
  ``traced, while``) and after (``after``, ``traced, after``).

What it shows on the 2-core CPU (docs/coexec.md, Performance): ops the executor runs while the
skeleton's Python holds the GIL and a core take several times their traced time; once the
skeleton waits, they run at 0.7-2.2x of it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
import executor.stream as stream  # noqa: E402
from common import markdown_table  # noqa: E402
from examples.models import ZOO  # noqa: E402

_RUNS: list[tuple[float, float, int]] = []  # (start, end, op index) per executed Run
_ISSUED: list[float] = []  # submission time of each Run


def _instrument() -> None:
    run, submit = stream._Worker.run, stream.Executor.submit

    def timed_run(self, ins, values):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        run(self, ins, values)
        _RUNS.append((t0, time.perf_counter(), ins.op_index))

    def timed_submit(self, ins):  # noqa: ANN001, ANN202
        if type(ins) is stream.Run:
            _ISSUED.append(time.perf_counter())
        return submit(self, ins)

    stream._Worker.run = timed_run
    stream.Executor.submit = timed_submit


def measure(name: str, batch: int, steps: int) -> dict:
    eager, co = ZOO[name](batch), ZOO[name](batch)
    tape = coexec.GradientTape(arena=False, key=("timeline", name))

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
    traced = {op.index: op.seconds for op in tape._program.paths[-1].trace.ops}
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eager.step()
        e = time.perf_counter() - t0
        _RUNS.clear()
        _ISSUED.clear()
        c0, t0 = time.thread_time(), time.perf_counter()
        co_step()
        c, cpu = time.perf_counter() - t0, time.thread_time() - c0
        issued = _ISSUED[-1]
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
        })  # fmt: skip
    out = {"model": name, "ops": len(traced), "traced op ms": 1e3 * sum(traced.values())}
    for k in rows[0]:
        out[k] = statistics.median(r[k] for r in rows)
    out["done by then"] = f"{int(out['done by then'])}/{len(traced)}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2-6l,resnet50")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)
    _instrument()
    rows = []
    for name in args.models.split(","):
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(measure(name, args.batch, args.steps))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
