"""What the executor's own work costs per op, with the skeleton out of the way.

    python bench/executor_replay.py [--models gpt2-6l,mlp] [--batch 1] [--reps 25]

Per zoo model, one co-executed step's instructions are captured as the skeleton submits them
(the script wraps the executors' ``submit``: instrumentation, not part of coexec), once from a
tape with a plan (the default: blocks in the planned order, outputs into the arena) and once
from ``GradientTape(backend="interpret", arena=False)`` (ops run as issued, every output from
the allocator). The user's thread then submits a captured step again and waits for it, so the
executor runs it alone: no GIL to share, no skeleton issuing. The variants run interleaved,
``--reps`` times each, with an eager step of the same model between rounds; figures are medians:

* ``eager ms``: an eager step (Python dispatch and kernels: the work the replay also does);
* ``planned``: the planned step's instructions as captured, on the executor the step ran on
  (the native engine once it is built: executor/engine.py);
* ``planned, Python``: the same on the Python executor (one Python call per op);
* ``arena only``: the same runs, not deferred (no blocks: each op runs as it arrives);
* ``blocks only``: the same runs, deferred and run in the planned order, without the arena;
* ``unplanned``: the ``arena=False`` step's instructions;
* ``unplanned, Python beside``: the same, with a Python thread running pure Python (holding the
  GIL but for the interpreter's switch interval) from the last submission to the end: an engine
  that needs the GIL for any part of an op waits for it here (it did, until it stopped letting
  go of tensors Python holds on its own thread: docs/coexec.md, *The native engine*);
* ``us/op``: per ATen op of the step, for ``planned`` and ``unplanned``.

(Replaying a step applies its optimizer update again: the parameters move, the ops and their
shapes do not.) Where the planned step costs more than the unplanned one here, that cost is on
the step's critical path: the executor runs most of a block after the skeleton has issued it
(bench/executor_timeline.py, docs/coexec.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
import executor.engine as engine  # noqa: E402
import executor.stream as stream  # noqa: E402
from executor import native  # noqa: E402
from common import markdown_table  # noqa: E402
from examples.models import ZOO  # noqa: E402

_SUBMITS = {stream.Executor: stream.Executor.submit, engine.NativeExecutor: engine.NativeExecutor.submit}


class Capture:
    """Records what the skeleton submits while ``on`` (installed as the executors' ``submit``)."""

    def __init__(self) -> None:
        self.on = False
        self.seen: list = []
        self.executor = None

    def install(self) -> None:
        for kind, real in _SUBMITS.items():

            def submit(ex, ins, real=real):  # noqa: ANN001, ANN202
                if self.on:
                    self.seen.append(ins)
                    self.executor = ex
                return real(ex, ins)

            kind.submit = submit

    def remove(self) -> None:
        for kind, real in _SUBMITS.items():
            kind.submit = real


def capture_step(model, tape: coexec.GradientTape, capture: Capture) -> list:
    """Warm ``model`` up under ``tape`` until a step co-executes on the plan; that step's
    instructions."""
    for i in range(8):
        capture.on, capture.seen = i >= 4, []
        with tape:
            model.step()
        capture.on = False
        coexec.wait_for_plans()
        if i >= 4 and tape.stats.last_phase == "coexec" and any(type(x) is stream.Run for x in capture.seen):
            return capture.seen
    raise RuntimeError(f"no co-executed step to capture ({tape.stats.last_fallback})")


def variants(planned: list, unplanned: list) -> dict[str, list]:
    Run, Follow, Launch = stream.Run, stream.Follow, stream.Launch
    undeferred = [
        dataclasses.replace(x, deferred=False) if type(x) is Run else x
        for x in planned
        if type(x) not in (Follow, Launch)
    ]
    no_arena = [dataclasses.replace(x, arena_out=None) if type(x) is Run else x for x in planned]
    return {
        "planned": planned, "planned, Python": planned, "arena only": undeferred, "blocks only": no_arena,
        "unplanned": unplanned, "unplanned, Python beside": unplanned,
    }  # fmt: skip


class PythonBeside:
    """A thread running pure Python (no calls that release the GIL) while it is entered."""

    def __enter__(self) -> PythonBeside:
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()
        return self

    def _spin(self) -> None:
        while not self._stop:
            [{i: str(i)} for i in range(100)]

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def replay(ex, instructions: list, python_beside: bool = False) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for ins in instructions:
        ex.submit(ins)
    if python_beside:
        with PythonBeside():
            ex.drain(60.0)
    else:
        ex.drain(60.0)
    seconds = time.perf_counter() - t0
    ex.reset()  # (fetched results nobody takes here)
    return seconds


def measure(name: str, batch: int, reps: int) -> dict:
    capture = Capture()
    capture.install()
    try:
        tape = coexec.GradientTape(backend="interpret", key=("replay", name, batch))
        planned = capture_step(ZOO[name](batch), tape, capture)
        unplanned = capture_step(
            ZOO[name](batch),
            coexec.GradientTape(backend="interpret", key=("replay", name, batch, "u"), arena=False),
            capture,
        )
    finally:
        capture.remove()
    ex, python = capture.executor, stream.Executor("replay-python")
    runs = sum(type(x) is stream.Run for x in planned)
    eager = ZOO[name](batch)
    steps = variants(planned, unplanned)
    times: dict[str, list[float]] = {k: [] for k in steps}
    t_e = []
    for _ in range(reps):
        t0 = time.perf_counter()
        eager.step()
        t_e.append(time.perf_counter() - t0)
        for k, instructions in steps.items():
            times[k].append(
                replay(python if k == "planned, Python" else ex, instructions, k == "unplanned, Python beside")
            )
    python.close()
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    row = {"model": name, "batch": batch, "ops": runs, "eager ms": 1e3 * statistics.median(t_e)}
    row.update({f"{k} ms": v for k, v in ms.items()})
    row["planned us/op"] = 1e3 * ms["planned"] / runs
    row["unplanned us/op"] = 1e3 * ms["unplanned"] / runs
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-6l,mlp,resnet18,lstm-lm")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    if native.wait(600) is None:
        print("(the native engine is not built: every variant runs in Python)")
    rows = []
    for name in args.models.split(","):
        rows.append(measure(name, args.batch, args.reps))
        print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
