"""Why captured steps slowed the eager steps after them: page faults under glibc's malloc policy.

    python bench/malloc_faults.py [--programs zoo:resnet18,zoo:gpt2-6l] [--rounds 3] [--batch 16]

Per program and round, two fresh processes, alternated: ``default`` (glibc's dynamic malloc
thresholds) and ``kept`` (the thresholds a ``coexec.GradientTape()`` sets, coexec/host_memory.py,
here from the environment). Each runs 5 warm-up and 20 eager steps, 25 steps captured by
``executor.capture.Capture`` (the default backend's capture, without a tape, so the thresholds
stay as the process started), then 20 eager steps, and reports the median eager step before and
after and the process's minor page faults per eager step before and after (``getrusage``).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

POLICIES = ("default", "kept")


def child(program: str, batch: int) -> dict:
    from executor import native
    from executor.capture import Capture
    from fair_speed import _build

    native.wait()
    _, step = _build(program, batch)
    capture = Capture()

    def steps(n: int, captured: bool, i0: int) -> tuple[float, float]:
        times, f0 = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(i0, i0 + n):
            t0 = time.perf_counter()
            if captured:
                with capture.step():
                    loss = step(i)
            else:
                loss = step(i)
            float(loss)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n

    steps(5, False, 0)
    before, faults_before = steps(20, False, 5)
    steps(25, True, 25)
    after, faults_after = steps(20, False, 50)
    return {"before ms": before, "after ms": after, "faults before": faults_before, "faults after": faults_after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="zoo:resnet18,zoo:gpt2-6l")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch)))
        return
    from common import markdown_table
    from coexec.host_memory import ENVIRONMENT

    rows = []
    for program in args.programs.split(","):
        runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for r in range(args.rounds):
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
                env["PYTHONPATH"] = str(ROOT)
                if policy == "kept":
                    env.update(ENVIRONMENT)
                print(f"{program} round {r + 1}/{args.rounds}, {policy} ...", file=sys.stderr, flush=True)
                cmd = [sys.executable, __file__, "--child", program, "--batch", str(args.batch)]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                runs[policy].append(json.loads(done.stdout.strip().splitlines()[-1]))
        for policy, rs in runs.items():
            ratios = sorted(x["after ms"] / x["before ms"] for x in rs)
            rows.append({
                "program": program, "policy": policy,
                **{k: statistics.median(x[k] for x in rs) for k in rs[0]},
                "after/before": statistics.median(ratios), "range": f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
            })  # fmt: skip
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
