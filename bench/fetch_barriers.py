"""Cost of the fetch barriers of a planning graph: the former scan against the current one.

    python bench/fetch_barriers.py [--sizes 1000,5000,20000] [--steps 50,200] [--seed 0]

Every op issued after Python read a value must descend from the op that made it
(``planner.graph.fetch_barrier_edges``). The former code scanned, per read, every op after it
(``scan_barriers`` below); the current one looks only at the sources of each suffix. Two tables:

* synthetic trace-like graphs of n ops (1-2 preds each, mostly recent ones, 5% reading only
  external inputs) with n/10 reads, most of a value made just before: seconds to build the
  barriers, and the barrier edges each adds;
* recorded REINFORCE steps (a policy net, ``.item()`` twice per environment step, one update):
  seconds of ``PlanningGraph.from_trace`` with either.

Both check that the two give the same transitive closure.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from common import markdown_table  # noqa: E402
from planner import PlanningGraph  # noqa: E402
from planner.graph import fetch_barrier_edges, fetch_points  # noqa: E402
from tracegraph import record  # noqa: E402


def scan_barriers(preds: list[set[int]], points) -> list[set[int]]:
    """The former ``PlanningGraph._add_fetch_barriers`` on a copy of ``preds``: per read, an
    edge from the producer to every later op without a pred at or after the read."""
    preds = [set(p) for p in preds]
    n = len(preds)
    for after, producer in points:
        if producer is None or after >= n:
            continue
        for j in range(after, n):
            if not any(p >= after for p in preds[j]):
                preds[j].add(producer)
    return preds


def closure(preds: list[set[int]]) -> list[int]:
    anc = [0] * len(preds)
    for v, ps in enumerate(preds):
        for u in ps:
            anc[v] |= anc[u] | (1 << u)
    return anc


def trace_like(rng: random.Random, n: int):
    preds: list[set[int]] = []
    for v in range(n):
        if v == 0 or rng.random() < 0.05:
            preds.append(set())
            continue
        ps = {v - rng.randint(1, min(v, 8))}
        if rng.random() < 0.3:
            ps.add(rng.randrange(v))  # a value made long ago (a skip, a saved activation)
        preds.append(ps)
    points = []
    for after in sorted(rng.sample(range(1, n), n // 10)):
        old = rng.random() < 0.1
        points.append((after, rng.randrange(after) if old else after - 1))
    return preds, points


def synthetic_rows(sizes: list[int], seed: int) -> list[dict]:
    rows = []
    for n in sizes:
        preds, points = trace_like(random.Random(seed + n), n)
        t0 = time.perf_counter()
        old = scan_barriers(preds, points)
        t_old = time.perf_counter() - t0
        t0 = time.perf_counter()
        edges = fetch_barrier_edges(preds, points)
        t_new = time.perf_counter() - t0
        new = [set(p) for p in preds]
        for u, v in edges:
            new[v].add(u)
        assert closure(new) == closure(old), "the two barriers differ"
        base = sum(map(len, preds))
        rows.append(
            {"ops": n, "reads": len(points), "data edges": base, "scan s": f"{t_old:.3f}",
             "new s": f"{t_new:.4f}", "scan edges": sum(map(len, old)) - base,
             "new edges": sum(map(len, new)) - base}
        )
    return rows


def reinforce_step(steps: int):
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)

    def step() -> float:
        state, log_probs, rewards = torch.zeros(4), [], []
        for _ in range(steps):
            probs = torch.softmax(policy(state), -1)
            action = int(torch.multinomial(probs, 1).item())
            log_probs.append(torch.log(probs[action]))
            rewards.append(float(state.sum().item()) - action)
            state = torch.tanh(state + (0.5 if action else -0.5) + 0.1 * torch.randn(4))
        ret = torch.tensor(rewards).flip(0).cumsum(0).flip(0)
        loss = -(torch.stack(log_probs) * (ret - ret.mean())).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def reinforce_rows(step_counts: list[int]) -> list[dict]:
    rows = []
    current = PlanningGraph._add_fetch_barriers
    for steps in step_counts:
        step = reinforce_step(steps)
        step()
        with record() as trace:
            step()
        points = fetch_points(trace)

        def scan(self, trace) -> None:
            self.preds[:] = scan_barriers(self.preds, fetch_points(trace))
            self.succs = [set() for _ in self.preds]
            for v, ps in enumerate(self.preds):
                for u in ps:
                    self.succs[u].add(v)

        PlanningGraph._add_fetch_barriers = lambda self, trace: None
        base = sum(map(len, PlanningGraph.from_trace(trace).preds))
        timings, graphs = [], []
        for barriers in (scan, current):
            PlanningGraph._add_fetch_barriers = barriers
            t0 = time.perf_counter()
            graphs.append(PlanningGraph.from_trace(trace))
            timings.append(time.perf_counter() - t0)
        PlanningGraph._add_fetch_barriers = current
        assert closure(graphs[0].preds) == closure(graphs[1].preds), "the two barriers differ"
        rows.append(
            {"env steps": steps, "ops": len(trace.ops), "reads": len(points),
             "from_trace scan s": f"{timings[0]:.3f}",
             "from_trace new s": f"{timings[1]:.3f}",
             "scan edges": sum(map(len, graphs[0].preds)) - base,
             "new edges": sum(map(len, graphs[1].preds)) - base}
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,5000,20000")
    ap.add_argument("--steps", default="50,200")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    steps = [int(s) for s in args.steps.split(",") if s]
    print(markdown_table(synthetic_rows(sizes, args.seed)))
    print()
    print(markdown_table(reinforce_rows(steps)))


if __name__ == "__main__":
    main()
