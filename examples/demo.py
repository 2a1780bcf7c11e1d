"""Record the example programs for 12 steps each and show what their TraceGraphs look like.

    python examples/demo.py [--steps N] [--out DIR]

For each program: how many steps had a new trace (Terra's tracing phase), whether the graph
converged, and its size; the DOT files go to DIR (render with ``dot -Tsvg``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.programs import PROGRAMS  # noqa: E402
from tracegraph import summarize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="tracegraph_demo", help="folder for the DOT files")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cols = ["program", "ops/step", "new traces", "converged at", "op nodes", "loops", "blocks",
            "switches", "feeds", "fetches", "seconds"]  # fmt: skip
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for program_cls in PROGRAMS:
        t0 = time.perf_counter()
        summary = summarize(program_cls(0).step, args.steps)
        seconds = time.perf_counter() - t0
        st = summary.graph.stats()
        ops = max(s.ops for s in summary.steps)
        row = [program_cls.name, ops, summary.traces, summary.converged_at, st["nodes"], st["loops"],
               st["blocks"], st["switches"], st["feeds"], st["fetches"], f"{seconds:.2f}"]  # fmt: skip
        print("| " + " | ".join(map(str, row)) + " |")
        with open(os.path.join(args.out, f"{program_cls.name}.dot"), "w") as f:
            f.write(summary.graph.to_dot())
    print(f"\nDOT files in {args.out}/ (e.g. dot -Tsvg {args.out}/sdpoint.dot -o sdpoint.svg)")


if __name__ == "__main__":
    main()
