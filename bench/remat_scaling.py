"""How the flat recomputation model scales with the graph: planning time against size.

    python bench/remat_scaling.py [--depths 100,300,1000] [--time-limit 60]

Synthetic training steps (``tests.planner.test_remat.training_graph``: a forward chain of
``depth`` ops with skip edges, a loss, a backward chain reading every activation), planned on
one path: the smallest feasible budget (``min_feasible_budget``) and a plan halfway between
it and the unbudgeted peak (``plan_remat``). The time limit bounds CP-SAT's search, not the
building of the model, which grows with the length of the chains of dropped readers.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.remat import min_feasible_budget, plan_remat  # noqa: E402
from planner.simulate import replay  # noqa: E402
from tests.planner.test_remat import training_graph  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="100,300,1000")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    print("| ops | unbudgeted peak | smallest found | min_feasible s | budget | plan s | method |")
    print("|---|---|---|---|---|---|---|")
    for depth in map(int, args.depths.split(",")):
        g = training_graph(random.Random(0), depth=depth, skips=depth // 10)
        base = replay(g, list(range(len(g)))).peak
        t0 = time.perf_counter()
        floor, _ = min_feasible_budget(g, time_limit=args.time_limit)
        t1 = time.perf_counter()
        budget = (base + floor) // 2
        plan = plan_remat(g, budget, time_limit=args.time_limit)
        t2 = time.perf_counter()
        print(f"| {len(g)} | {base} | {floor} | {t1 - t0:.1f} | {budget} | {t2 - t1:.1f} | {plan.method} |", flush=True)


if __name__ == "__main__":
    main()
