"""Recording overhead per op vs eager, for an MLP and a small CNN training step.

    python bench/recording_overhead.py            # prints a Markdown table

Eager and recorded steps run side by side in one process, alternating in blocks of 5 steps,
warm-up excluded; each figure is the median over the repeats of the per-step mean of a block. ``per-op overhead`` = (recorded - eager) / ops.
Also timed: merging a trace into a graph that already covers it, and ``covers``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table  # noqa: E402
from tracegraph import TraceGraph, record  # noqa: E402


def mlp_step_factory(batch: int = 32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def cnn_step_factory(batch: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


BLOCK = 5  # steps per timed sample: sub-millisecond steps are too noisy one by one


def measure(name: str, step, repeats: int) -> dict:
    for _ in range(3):  # warm-up: allocator, optimizer state, code caches
        step()
        with record():
            step()
    eager, recorded, merge_t, covers_t = [], [], [], []
    graph = TraceGraph()
    for i in range(repeats):
        t0 = time.perf_counter()
        for _ in range(BLOCK):
            step()
        eager.append((time.perf_counter() - t0) / BLOCK)
        t0 = time.perf_counter()
        for _ in range(BLOCK):
            with record() as trace:
                step()
        recorded.append((time.perf_counter() - t0) / BLOCK)
        t0 = time.perf_counter()
        graph.merge(trace)  # the first merge builds the graph, later ones find it covered
        if i:
            merge_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        graph.covers(trace)
        covers_t.append(time.perf_counter() - t0)
    n_ops = len(trace.ops)
    e, r = statistics.median(eager), statistics.median(recorded)
    return {
        "model": name,
        "ops": n_ops,
        "eager ms": e * 1e3,
        "recorded ms": r * 1e3,
        "ratio": r / e,
        "eager us/op": e / n_ops * 1e6,
        "overhead us/op": (r - e) / n_ops * 1e6,
        "merge us/op": statistics.median(merge_t) / n_ops * 1e6,
        "covers us/op": statistics.median(covers_t) / n_ops * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [
        measure("MLP (3 Linear, batch 32)", mlp_step_factory(), args.repeats),
        measure("CNN (2 conv+BN, batch 8, 32x32)", cnn_step_factory(), args.repeats),
    ]
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats} repeats\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
