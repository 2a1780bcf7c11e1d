"""Does a captured step slow the process down? Eager steps before and after captured ones, in one process.

    python bench/omp_slowdown.py [--programs zoo:lstm-lm,zoo:mlp,...|zoo] [--batch 16] [--eager 30]
                                 [--captured 20] [--rounds 3] [--threads 0]

Per program, in this one process: ``--eager`` eager steps, ``--captured`` steps under
``coexec.GradientTape()`` (the default backend), then ``--eager`` eager steps again. Issue 52
found eager steps after captured ones up to 2x slower (the LSTM LM: 24-38 ms before, 52-66 ms
after): libgomp throttles the spinning of every OpenMP team once the process manages more
OpenMP threads than it has cores, and the capture's worker owned a second team; a second cause
was glibc's malloc handing freed memory back to the OS by rules whose outcome depends on the
heap's layout, which captured steps change: eager steps after them faulted in up to twice the
pages (ResNet-18: 7.4k minor faults a step before, 13.5k after: bench/malloc_faults.py), until a
tape fixed the thresholds (coexec/host_memory.py; the tape here is made before the first step). Columns: ``before ms`` and
``after ms`` (medians of the eager steps), ``after/before`` (issue 52 asks for at most 1.05),
``faults before`` and ``faults after`` (the process's minor page faults per eager step),
``captured ms`` (median captured step) and ``worker ms`` (the worker's busy time
per captured step: its kernels, to set beside ``before ms``, eager's kernels and dispatch),
and the process's threads after the run (``/proc/self/task``). Each program runs in
``--rounds`` fresh processes of its own (its eager steps before any captured step in it); a row
gives the median over the rounds and, for ``after/before``, their range, because this machine's
step times drift by more than 5% between processes. Each round also runs a control process
whose middle steps are eager too (``control after/before``): how far eager steps drift within a
process with no captured step at all.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import coexec  # noqa: E402
from common import markdown_table  # noqa: E402
from executor import native  # noqa: E402
from fair_speed import _build, expand  # noqa: E402


def faults() -> int:
    """The process's minor page faults so far (every thread's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(step, i: int, tape=None) -> float:
    t0 = time.perf_counter()
    if tape is None:
        loss = step(i)
    else:
        with tape:
            loss = step(i)
    float(loss)
    return (time.perf_counter() - t0) * 1e3


def measure(program: str, args: argparse.Namespace) -> dict:
    _, step = _build(program, args.batch)
    tape = coexec.GradientTape()
    i = 0
    for _ in range(5):  # (warm-up, eager)
        timed(step, i)
        i += 1
    before, f0 = [], faults()
    for _ in range(args.eager):
        before.append(timed(step, i))
        i += 1
    faults_before = (faults() - f0) / args.eager
    middle = tape if args.middle == "captured" else None
    for _ in range(5):  # (the capture meets the ops)
        timed(step, i, middle)
        i += 1
    w0 = tape.stats.executor_seconds
    captured = []
    for _ in range(args.captured):
        captured.append(timed(step, i, middle))
        i += 1
    worker_ms = (tape.stats.executor_seconds - w0) * 1e3 / args.captured
    after, f0 = [], faults()
    for _ in range(args.eager):
        after.append(timed(step, i))
        i += 1
    faults_after = (faults() - f0) / args.eager
    b, a = statistics.median(before), statistics.median(after)
    return {
        "program": program,
        "before ms": b,
        "after ms": a,
        "after/before": a / b,
        "faults before": faults_before,
        "faults after": faults_after,
        "captured ms": statistics.median(captured),
        "worker ms": worker_ms,
        "threads": len(os.listdir("/proc/self/task")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="zoo:lstm-lm,zoo:mlp,zoo:gpt2-6l,zoo:resnet18")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eager", type=int, default=30)
    ap.add_argument("--captured", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--middle", choices=("captured", "eager"), default="captured", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", RuntimeWarning)
    programs = expand(args.programs, args.batch)
    if len(programs) == 1:  # (the child: one program, its eager steps before any capture)
        native.wait()
        print(json.dumps(measure(programs[0], args)))
        return
    rows = []
    argv = _without(_without(sys.argv[1:], "--programs"), "--middle")
    for p in programs:  # (each in fresh processes: "before" is before any captured step)
        runs: dict[str, list[dict]] = {"captured": [], "eager": []}
        for r in range(args.rounds):
            # (the control, eager steps in the middle too, alternated with the captured run: how
            # much a process's eager steps drift on their own on this machine)
            for middle in ("captured", "eager") if r % 2 == 0 else ("eager", "captured"):
                print(f"{p} round {r + 1}/{args.rounds}, {middle} ...", file=sys.stderr, flush=True)
                cmd = [sys.executable, __file__, *argv, "--programs", p, "--middle", middle]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs[middle].append(json.loads(done.stdout.strip().splitlines()[-1]))
        rows.append(_summary(p, runs["captured"], runs["eager"]))
    print(markdown_table(rows))


def _summary(program: str, runs: list[dict], control: list[dict]) -> dict:
    """One row: the median of each column over the rounds, the range of after/before, and the
    control's after/before (eager steps in the middle too)."""
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "program"}
    ratios = sorted(r["after/before"] for r in runs)
    controls = sorted(r["after/before"] for r in control)
    return {
        "program": program,
        **{k: med[k] for k in ("before ms", "after ms", "after/before")},
        "after/before range": f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
        "control after/before": statistics.median(controls),
        "control range": f"{controls[0]:.2f}-{controls[-1]:.2f}",
        **{k: med[k] for k in ("faults before", "faults after", "captured ms", "worker ms", "threads")},
    }


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
