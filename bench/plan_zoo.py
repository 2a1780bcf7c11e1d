"""OLLA-style memory planning of the model zoo's training steps (batch 1 and 32).

    python bench/plan_zoo.py [--time-limit 45] [--models resnet18,mlp] [--out bench/out]

Per model and batch size: one SGD training step (gradients released after the update) is
recorded after two warm-up steps, then

* ``eager peak``: eager PyTorch's resident peak for the step, measured by the live-storage
  tracker (persistent state included);
* ``eager-order peak``: the planner's exact peak for the order the program issued the ops in
  (each storage freed after its last use);
* ``planned peak``: the same for the planned order (best of greedy and CP-SAT);
* ``reduction``: planned peak vs eager peak;
* ``arena``, ``frag``: the arena holding the step's local storages, and its fragmentation
  (arena bytes over the planned order's peak of local live bytes, minus 1);
* solve times and the order solver's gap (0 = proven optimal).

Writes ``plan_zoo.md`` (the table) and ``plan_zoo.png`` (peaks per model) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, pyplot  # noqa: E402
from examples.models import ZOO  # noqa: E402
from planner import PlanningGraph, plan_graph  # noqa: E402
from planner.tracker import eager_peak  # noqa: E402
from tracegraph import record  # noqa: E402

MB = 1e6


def measure(name: str, batch: int, time_limit: float) -> dict:
    z = ZOO[name](batch)
    z.step()
    z.step()
    eager = eager_peak(z.step)
    with record() as trace:
        z.step()
    t0 = time.perf_counter()
    g = PlanningGraph.from_trace(trace)
    plan = plan_graph(g, time_limit=time_limit)
    seconds = time.perf_counter() - t0
    gap = plan.order_result.gap
    return {
        "model": name,
        "batch": batch,
        "ops": len(g),
        "eager peak MB": eager / MB,
        "eager-order peak MB": plan.eager_order_peak / MB,
        "planned peak MB": plan.peak / MB,
        "reduction %": 100 * (1 - plan.peak / eager),
        "arena MB": plan.arena_bytes / MB,
        "frag %": 100 * plan.fragmentation,
        "order": plan.order_result.method,
        "order gap %": "-" if gap is None else f"{100 * gap:.1f}",
        "addresses": plan.placement.method,
        "plan s": seconds,
    }


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, batch in zip(axes, (1, 32)):
        sel = [r for r in rows if r["batch"] == batch]
        x = range(len(sel))
        w = 0.27
        ax.bar([i - w for i in x], [r["eager peak MB"] for r in sel], w, label="eager (tracker)", color="#bbbbbb")
        ax.bar(list(x), [r["eager-order peak MB"] for r in sel], w, label="planned, eager order", color="#66ccee")
        ax.bar([i + w for i in x], [r["planned peak MB"] for r in sel], w, label="planned, optimised order", color="#4477aa")
        ax.set_xticks(list(x), [r["model"] for r in sel], rotation=30, ha="right")
        ax.set_ylabel("peak resident MB")
        ax.set_title(f"batch {batch}")
        ax.legend(fontsize=8)
    fig.suptitle("Peak memory of one training step (CPU, persistent state included)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=45.0, help="planning time per model (s)")
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = ap.parse_args()
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            rows.append(measure(name, batch, args.time_limit))
            r = rows[-1]
            print(f"{name} batch {batch}: {r['reduction %']:.1f}% in {r['plan s']:.1f} s", file=sys.stderr, flush=True)
    lines = [
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, planning time limit "
        f"{args.time_limit:g} s\n",
        markdown_table(rows),
    ]
    for batch in sorted({r["batch"] for r in rows}):
        red = [r["reduction %"] for r in rows if r["batch"] == batch]
        worst = max(r["frag %"] for r in rows if r["batch"] == batch)
        lines.append(
            f"\nbatch {batch}: mean reduction {statistics.mean(red):.1f}% (min {min(red):.1f}%, "
            f"max {max(red):.1f}%), worst fragmentation {worst:.3f}%"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "plan_zoo.md").write_text(text)
    plot(rows, out / "plan_zoo.png")
    print(f"wrote {out / 'plan_zoo.md'} and {out / 'plan_zoo.png'}")


if __name__ == "__main__":
    main()
