"""Step time of coexec vs eager for the example programs, and where co-executed steps spend it.

    python bench/coexec_steps.py [--steps 20] [--programs static_mlp,resnet] [--backend native]
                                 [--out bench/out] [--processes N]

Per program, one eager instance and one coexec instance run side by side in one process,
alternating step by step after a warm-up (eager: 3 steps; coexec: until it co-executes, plus
2 steps); figures are medians over the measured steps. Columns:

* ``eager ms``, ``coexec ms``, ``ratio`` (coexec / eager): step wall time.
* ``eager us/op``: eager step time per ATen op (compute plus PyTorch's per-op overhead).
* ``skeleton us/op``: the time the Python skeleton was busy (step time minus its waits on the
  executor) per op: what running the user's Python costs under coexec, per op.
* ``gradient blocks``: the last step's ``backward()`` calls issued as gradient blocks, without the
  autograd engine (docs/coexec.md).
* the Terra Fig. 3.11 breakdown of co-executed steps, as shares of step wall time: skeleton
  busy, skeleton stalled on fetches (and the end-of-step sync), executor busy, executor idle
  (waiting for the skeleton to issue ops: Terra's "stalled on feed/select").

``--backend native`` times ``GradientTape(backend="native")`` (executor/capture.py: the ops
answered in C++, computed by a C++ worker; the executor columns are that worker's).

Writes ``coexec_steps.md`` (the table) and ``coexec_breakdown.png`` (Fig. 3.11-style bars) to
``--out``.

``--processes N`` (N > 1) runs the measurement in N fresh processes, one after another, and
prints per program the median of their ratios with the lowest and highest: on a small shared
machine the ratio of steps of a third of a millisecond moves by 10-20% from one process to the
next (allocator state, where the threads land), more than within one process, so a change to
such steps is judged on several processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import markdown_table, pyplot  # noqa: E402
from examples.programs import BY_NAME, PROGRAMS  # noqa: E402
from executor import native  # noqa: E402


def co_step(tape: coexec.GradientTape, program, i: int) -> float:
    """One co-executed step (one ``with`` statement for warm-up and measurement alike)."""
    t0 = time.perf_counter()
    with tape:
        program.step(i)
    return time.perf_counter() - t0


def measure(name: str, steps: int, backend: str = "interpret") -> dict:
    eager, co = BY_NAME[name](0), BY_NAME[name](0)
    tape = coexec.GradientTape(key=("bench", name), backend=backend)
    i = 0
    for _ in range(3):
        eager.step(i)
        i += 1
    j = 0
    while tape.stats.phase != "coexec" or tape.stats.coexec_steps < 2:
        co_step(tape, co, j)
        j += 1
        if j > 20:
            raise RuntimeError(f"{name} did not settle into co-execution: {tape.stats}")
    before = tape.stats
    e_times, c_times = [], []
    for k in range(steps):
        t0 = time.perf_counter()
        eager.step(i + k)
        e_times.append(time.perf_counter() - t0)
        c_times.append(co_step(tape, co, j + k))
    after = tape.stats
    ops = after.last_ops
    wall = sum(c_times)
    stall = after.stall_seconds - before.stall_seconds
    busy = after.executor_seconds - before.executor_seconds
    e, c = statistics.median(e_times), statistics.median(c_times)
    return {
        "program": name,
        "ops": ops,
        "eager ms": e * 1e3,
        "coexec ms": c * 1e3,
        "ratio": c / e,
        "eager us/op": e / ops * 1e6,
        "skeleton us/op": (wall - stall) / steps / ops * 1e6,
        "skeleton busy %": 100 * (wall - stall) / wall,
        "skeleton stalled %": 100 * stall / wall,
        "executor busy %": 100 * busy / wall,
        "executor idle %": 100 * max(0.0, wall - busy) / wall,
        "fallbacks": after.fallbacks - before.fallbacks,
        "gradient blocks": after.gradient_blocks,  # of the last step: backward() without the engine
    }


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [r["program"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    y = range(len(rows))
    sk_busy = [r["skeleton busy %"] for r in rows]
    axes[0].barh(y, sk_busy, color="#4477aa", label="busy")
    axes[0].barh(y, [r["skeleton stalled %"] for r in rows], left=sk_busy, color="#ee6677", label="stalled on fetch/sync")
    axes[0].set_title("skeleton (Python)")
    ex_busy = [r["executor busy %"] for r in rows]
    axes[1].barh(y, ex_busy, color="#228833", label="busy")
    axes[1].barh(y, [r["executor idle %"] for r in rows], left=ex_busy, color="#cccccc", label="waiting for ops")
    axes[1].set_title("executor (background thread)")
    for ax in axes:
        ax.set_xlim(0, 100)
        ax.set_xlabel("% of co-executed step time")
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_yticks(list(y), names)
    fig.suptitle(f"Where co-executed steps spend their time (torch {torch.__version__}, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def over_processes(args: argparse.Namespace) -> None:
    """The ratios of ``args.processes`` fresh processes: median, lowest, highest per program."""
    ratios: dict[str, list[float]] = {name: [] for name in args.programs.split(",")}
    for k in range(args.processes):
        cmd = [
            sys.executable, __file__, "--steps", str(args.steps), "--programs", args.programs,
            "--backend", args.backend, "--ratios-only",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"process {k + 1} failed:\n{done.stderr}")
        for name, ratio in json.loads(done.stdout.strip().splitlines()[-1]).items():
            ratios[name].append(ratio)
        print(f"process {k + 1}/{args.processes} done", file=sys.stderr, flush=True)
    rows = [
        {"program": name, "median ratio": statistics.median(r), "lowest": min(r), "highest": max(r)}
        for name, r in ratios.items()
    ]
    mean = statistics.geometric_mean([row["median ratio"] for row in rows])
    print(
        f"torch {torch.__version__}, backend {args.backend}, 1 intra-op thread, {args.steps} "
        f"measured steps per program, coexec/eager in {args.processes} processes\n\n"
        f"{markdown_table(rows)}\n\ngeometric mean of the medians: {mean:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--programs", default=",".join(p.name for p in PROGRAMS))
    ap.add_argument("--backend", default="interpret", choices=coexec.tape.BACKENDS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    ap.add_argument("--processes", type=int, default=1, help="fresh processes to measure in")
    ap.add_argument("--ratios-only", action="store_true", help=argparse.SUPPRESS)  # (a child's output)
    args = ap.parse_args()
    if args.processes > 1:
        over_processes(args)
        return
    torch.set_num_threads(1)
    if args.backend != "interpret":  # ("auto" runs native once the module is built)
        if native.wait() is None and args.backend == "native":
            raise SystemExit("the native module is not available")
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    rows = []
    for name in args.programs.split(","):
        rows.append(measure(name, args.steps, args.backend))
        print(f"measured {name}", file=sys.stderr, flush=True)
    if args.ratios_only:
        print(json.dumps({row["program"]: row["ratio"] for row in rows}))
        return
    text = (
        f"torch {torch.__version__}, backend {args.backend}, 1 intra-op thread, "
        f"{args.steps} measured steps per program, "
        f"medians\n\n{markdown_table(rows)}\n"
    )
    print(text)
    (out / "coexec_steps.md").write_text(text)
    plot(rows, out / "coexec_breakdown.png")
    print(f"wrote {out / 'coexec_steps.md'} and {out / 'coexec_breakdown.png'}")


if __name__ == "__main__":
    main()
