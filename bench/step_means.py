"""Mean step time of the zoo under coexec and eagerly: what a training loop's throughput sees.

    python bench/step_means.py [--models gpt2-6l,mobilenet_v2,resnet18] [--batch 1] [--steps 40]
                               [--threads 1]

``bench/zoo_steps.py`` reports medians of paired steps, which hide a slow step every ten or
twenty (a full garbage collection, docs/coexec.md "Garbage collection"); a loop's throughput
pays for it. Per zoo model: one copy trains under ``coexec.GradientTape(backend="interpret")``
until it co-executes on its plan, then ``--steps`` co-executed steps are timed back to back,
then as many eager steps of a second copy. Prints the mean, median and slowest step of each, and
``mean ratio`` (coexec mean over eager mean), and the time garbage collections took during the
co-executed steps (``gc.callbacks``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import markdown_table, measure_each, prepare  # noqa: E402
from examples.models import ZOO  # noqa: E402


class CollectionTimer:
    """Wall time Python's garbage collections take while it is installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds, self.count, self._t0 = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1


def timed_steps(step, n: int) -> tuple[list[float], CollectionTimer]:
    times, timer = [], CollectionTimer()
    gc.callbacks.append(timer)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(timer)
    return times, timer


def measure(name: str, batch: int, steps: int) -> dict:
    co, eager = ZOO[name](batch), ZOO[name](batch)
    tape = coexec.GradientTape(backend="interpret", key=("step-means", name, batch))

    def coexec_step() -> None:
        with tape:
            co.step()

    for _ in range(20):
        coexec_step()
        if tape.stats.phase == "coexec" and tape.stats.coexec_steps >= 2:
            break
    if tape.stats.phase != "coexec":
        raise RuntimeError(f"{name} did not settle into co-execution: {tape.stats}")
    coexec.wait_for_plans()
    for _ in range(3):  # on the plan
        coexec_step()
    for _ in range(3):
        eager.step()
    c, collected = timed_steps(coexec_step, steps)
    e, _ = timed_steps(eager.step, steps)
    return {
        "model": name,
        "batch": batch,
        "coexec mean ms": 1e3 * statistics.mean(c),
        "coexec median ms": 1e3 * statistics.median(c),
        "coexec slowest ms": 1e3 * max(c),
        "coexec gc ms/step": 1e3 * collected.seconds / steps,
        "collections/step": collected.count / steps,
        "eager mean ms": 1e3 * statistics.mean(e),
        "eager median ms": 1e3 * statistics.median(e),
        "eager slowest ms": 1e3 * max(e),
        "mean ratio": statistics.mean(c) / statistics.mean(e),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2-6l,mobilenet_v2,resnet18")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    args = ap.parse_args()
    prepare(args.threads)
    print(markdown_table(measure_each(args.models, lambda name: measure(name, args.batch, args.steps))))


if __name__ == "__main__":
    main()
