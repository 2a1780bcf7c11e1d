"""What working out a sized op's outputs costs the interpret skeleton (issue 17):

    python bench/meta_inference.py [--steps 12] [--repeats 20]

Runs the random-length transformer of ``examples/dynamic_programs.py`` under
``GradientTape(backend="interpret")``, keeps every call the skeleton made to work out an op's
outputs on the meta device (``Skeleton.output_metas``, for sized nodes and fed sizes), then
times each call again both ways: through the native module's C++ meta functions of structured
kernels where the op has one, else the Meta key (``coexec.skeleton._on_meta``, what runs), and
through the Meta key alone (torch's Python meta kernels: what ran before). Prints the totals
per step and the ten ops that cost most.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import coexec
from coexec import skeleton
from examples.dynamic_programs import TransformerRandomLength
from executor import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native.wait() is None:
        raise SystemExit("the native module is not available: both ways are the Meta key")
    calls = []
    original = skeleton._on_meta

    def keep(func, a, kw):
        calls.append((func, list(a), dict(kw)))
        return original(func, a, kw)

    skeleton._on_meta = keep
    try:
        p, tape = TransformerRandomLength(0), coexec.GradientTape(backend="interpret", key=("meta_inference",))
        for i in range(args.steps):
            with tape:
                p.step(i)
    finally:
        skeleton._on_meta = original
    ways = {"structured C++ where it can": original, "Meta key only": lambda f, a, kw: f(*a, **kw)}
    per_op: dict[str, collections.Counter] = {w: collections.Counter() for w in ways}
    for name, way in ways.items():
        for func, a, kw in calls:
            t = time.perf_counter()
            with torch.no_grad():
                for _ in range(args.repeats):
                    way(func, a, kw)
            per_op[name][str(func)] += (time.perf_counter() - t) / args.repeats
    steps = args.steps
    print(f"{len(calls)} calls over {steps} steps ({tape.stats.coexec_steps} co-executed)")
    for name in ways:
        print(f"  {name}: {1e3 * sum(per_op[name].values()) / steps:.2f} ms per step")
    print("\n| op | calls | structured C++ where it can, us | Meta key only, us |\n|---|---|---|---|")
    count = collections.Counter(str(f) for f, _a, _k in calls)
    first, second = ways
    for op, _ in per_op[second].most_common(10):
        n = count[op]
        print(f"| {op} | {n} | {1e6 * per_op[first][op] / n:.0f} | {1e6 * per_op[second][op] / n:.0f} |")


if __name__ == "__main__":
    main()
