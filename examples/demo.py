"""coexec on the example programs: each trains 12 steps eagerly, 12 under the interpret backend
(traced into a TraceGraph, co-executed with plans) and 12 under ``GradientTape()``'s default
backend (on a machine without a GPU: native, every op answered in C++), from the same seed; the
table says how coexec ran them and whether the results are bit-equal to eager.

    python examples/demo.py [--steps N] [--out DIR]

The TraceGraph of each program goes to DIR as a Graphviz file (``dot -Tsvg DIR/sdpoint.dot``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import coexec  # noqa: E402
from examples.programs import PROGRAMS  # noqa: E402
from examples.train import same_run, train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="tracegraph_demo", help="folder for the DOT files")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from executor import native

    native.wait()  # (built once, cached; the first build takes a minute, steps run eagerly meanwhile)
    default = coexec.GradientTape().backend
    cols = ["program", "ops/step", "traces", "co-executed", "fallbacks", "bit-equal to eager",
            "graph op nodes", "loops", "switches", f"default ({default}): co-executed, bit-equal",
            "seconds"]  # fmt: skip
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    all_equal = True
    for program_cls in PROGRAMS:
        t0 = time.perf_counter()
        eager, eager_losses, _, _ = train(program_cls.name, args.steps, False, quiet=True)
        co, co_losses, tape, _ = train(
            program_cls.name, args.steps, True, quiet=True, backend="interpret"
        )
        same = same_run(co, co_losses, eager, eager_losses)
        by_default, default_losses, default_tape, _ = train(
            program_cls.name, args.steps, True, quiet=True, backend="auto"
        )
        same_by_default = same_run(by_default, default_losses, eager, eager_losses)
        all_equal &= same and same_by_default
        s, g, d = tape.stats, tape.graph.stats(), default_tape.stats
        row = [program_cls.name, s.last_ops, s.traces, f"{s.coexec_steps}/{s.steps}", s.fallbacks,
               "yes" if same else "NO", g["nodes"], g["loops"], g["switches"],
               f"{d.coexec_steps}/{d.steps}, {'yes' if same_by_default else 'NO'}",
               f"{time.perf_counter() - t0:.2f}"]  # fmt: skip
        print("| " + " | ".join(map(str, row)) + " |", flush=True)
        with open(os.path.join(args.out, f"{program_cls.name}.dot"), "w") as f:
            f.write(tape.graph.to_dot())
    print(f"\nall programs bit-equal to eager: {'yes' if all_equal else 'NO'}")
    print(f"TraceGraphs in {args.out}/ (e.g. dot -Tsvg {args.out}/sdpoint.dot -o sdpoint.svg)")
    sys.exit(0 if all_equal else 1)


if __name__ == "__main__":
    main()
