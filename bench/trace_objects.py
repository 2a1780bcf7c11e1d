"""What traces cost Python's garbage collector, and what sending one to the planning process costs.

    python bench/trace_objects.py [--episodes 10]

Runs the REINFORCE program of bench/planning_stall.py under
``coexec.GradientTape(backend="interpret")`` (every episode length a new trace, 10 traces) in a
fresh process per row, then counts the objects the cycle collector tracks, times one full
``gc.collect()``, and times pickling the longest path for the planning process
(coexec/plan_process.py ``dumps``: each trace as columns, tracegraph/wire.py), best of 5. Rows:
as coexec runs (equal op keys and tensor metadata interned: ``OpKey.of``, ``TensorMeta.of``),
and with interning off (intern tables of size 0), and the same trace pickled object by object
(``Trace`` without its columns ``__reduce__``).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import markdown_table  # noqa: E402


def _best(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(episodes: int, intern: bool) -> dict:
    """In this process: run the program, then count and time (see the module docstring)."""
    import coexec
    import planning_stall
    from coexec.plan_process import dumps
    from tracegraph import schema, trace

    if not intern:
        schema._METAS_MAX = trace._KEYS_MAX = 0  # each new one clears the table: nothing shared
    gc.collect()
    before = len(gc.get_objects())
    _, _, tape = planning_stall.reinforce(episodes, {})
    coexec.wait_for_plans()
    gc.collect()
    tracked = len(gc.get_objects()) - before
    collect = _best(gc.collect, 3)
    program = tape._program
    longest = max(range(len(program.paths)), key=lambda i: len(program.paths[i].trace.ops))
    path = program.paths[longest]
    columns = _best(lambda: dumps(path))
    reduce = trace.Trace.__reduce__
    del trace.Trace.__reduce__
    try:
        objects = _best(lambda: dumps(path))
    finally:
        trace.Trace.__reduce__ = reduce
    return {
        "traces": program.stats.traces,
        "ops in all paths": sum(len(p.trace.ops) for p in program.paths),
        "objects tracked by gc": tracked,
        "full gc.collect() (s)": f"{collect:.3f}",
        "ops in the longest path": len(path.trace.ops),
        "pickle it as columns (ms)": f"{1e3 * columns:.0f}",
        "pickle it object by object (ms)": f"{1e3 * objects:.0f}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--one", choices=["interned", "not interned"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a row, in a fresh process (the collector's state depends on history)
        print(json.dumps(measure(args.episodes, args.one == "interned")))
        return
    rows = []
    for mode in ("interned", "not interned"):
        out = subprocess.run(
            [sys.executable, __file__, "--episodes", str(args.episodes), "--one", mode],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        rows.append({"keys and metadata": mode, **json.loads(out.stdout.strip().splitlines()[-1])})
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
