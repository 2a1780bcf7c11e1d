"""Measured against planned peak on the native backend under a memory budget, recomputing only
and with offloading, and with an arena (issue 53's acceptance: within 2%).

    python bench/native_planned_peak.py [--models mlp,lstm-lm,...] [--batches 1,16]
                                        [--programs all|none] [--steps 3] [--timeout 600]
                                        [--modes recompute,offload,arena]

``arena`` (``GradientTape(arena=True)``, no budget): the same programs trained with their
described step's storages placed in one arena; "budget MB" is empty, "arena MB" and "placed"
(storages the last step put in it) say what it held.

Per zoo model and batch (and per example program, at its own sizes), ``offload`` False and
True, each in its own fresh process: the smallest budget the plan meets is found with a
one-byte budget (``BudgetTooSmall`` names it); then the model trains at a budget halfway
between that and its unplanned peak as the planner counts it (or at the smallest, where the two
meet; with offloading, at the smallest the run's own plan names if that is higher: copy windows
follow the ops' measured times), beside an eager twin (the same
random draws), until ``--steps`` steps have followed the plan. Per run: the budget, the planned
peak, the measured peak (``tape.stats.peak_bytes``: the state the plan counts plus the bytes
the CPU allocator handed out beyond its count at the step's start, at their most), their
ratio (its least and largest over the planned steps), storages parked and ops recomputed in the last
step, whether every loss was bit-equal to eager's, and the median time of those steps (the
coexec step alone, its eager twin's step between two: a rough figure, one process per mode). A run that takes over ``--timeout``
seconds is reported as such.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_table

_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import coexec
from examples.models import ZOO
from examples.programs import PROGRAMS

kind, name, batch, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
offload, arena = mode == "offload", mode == "arena"

def make():
    if kind == "zoo":
        z = ZOO[name](batch)
        return lambda i: z.step()
    p = next(p for p in PROGRAMS if p.name == name)(0)
    return p.step

def train(budget, key, want_steps, twin=False):
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=key, offload=offload, arena=arena)
    captured = make()
    eager = make() if twin else None
    equal, ratios, times, last, deadline, i = True, [], [], None, time.monotonic() + 300, 0
    while len(ratios) < want_steps:
        if time.monotonic() > deadline:
            raise SystemExit("no plan within 300 s")
        rng = torch.get_rng_state()
        want = eager(i) if twin else None
        torch.set_rng_state(rng)
        t0 = time.perf_counter()
        with tape:
            got = captured(i)
        seconds = time.perf_counter() - t0
        if twin:
            equal = equal and torch.equal(torch.as_tensor(want), torch.as_tensor(got))
        s = tape.stats
        if s.planned_peak_bytes is not None:
            ratios.append(s.peak_bytes / s.planned_peak_bytes)
            times.append(seconds)
            last = s
        else:
            time.sleep(0.05)
        i += 1
    return tape, ratios, last, equal, times

if arena:
    smallest = budget = None
    tape, ratios, s, equal, times = train(None, "arena", steps, twin=True)
    unplanned = tape._program.native_budget.plan.eager_peak
else:
    try:
        train(1, "probe", 1)
        raise SystemExit("a one-byte budget was met")
    except coexec.BudgetTooSmall as e:
        smallest = e.smallest
    sizer = train(10**15, "sizer", 1)[0]
    unplanned = sizer._program.native_budget.plan.eager_peak
    from coexec.native_budget import UNSEEN_BYTES
    budget = max(smallest, (smallest + unplanned + UNSEEN_BYTES) // 2)
    try:
        tape, ratios, s, equal, times = train(budget, "run", steps, twin=True)
    except coexec.BudgetTooSmall as e:  # (with offloading the smallest moves with the ops' measured times)
        budget = e.smallest
        tape, ratios, s, equal, times = train(budget, "run again", steps, twin=True)
plan = tape._program.native_budget.plan
print(json.dumps({
    "smallest": smallest, "budget": budget, "unplanned": unplanned, "planned": plan.planned_peak,
    "measured": s.peak_bytes, "worst ratio": max(ratios), "least ratio": min(ratios),
    "within budget": budget is None or s.peak_bytes <= budget, "arena": plan.arena_bytes, "placed": s.arena_placed,
    "parked": s.offloaded_storages, "recomputed": s.recomputed_ops, "bit-equal": equal,
    "step ms": 1e3 * sorted(times)[len(times) // 2],
}))
"""


def run(kind: str, name: str, batch: int, mode: str, steps: int, timeout: float) -> dict:
    row = {"program": name if kind == "program" else f"{name}, batch {batch}", "mode": mode}
    args = [sys.executable, "-c", _CHILD, kind, name, str(batch), mode, str(steps)]
    t0 = time.monotonic()
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parents[1])
    except subprocess.TimeoutExpired:
        return {**row, "result": f"over {timeout:.0f} s"}
    if out.returncode != 0:
        return {**row, "result": "failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    MB = 1e6
    return {
        **row,
        "budget MB": None if r["budget"] is None else r["budget"] / MB,
        "planned MB": r["planned"] / MB,
        "measured MB": r["measured"] / MB,
        "measured / planned": f"{r['least ratio']:.4f}-{r['worst ratio']:.4f}",
        "within budget": r["within budget"],
        "arena MB": r["arena"] / MB,
        "placed": r["placed"],
        "parked": r["parked"],
        "recomputed": r["recomputed"],
        "bit-equal": r["bit-equal"],
        "step ms": r["step ms"],
        "seconds": time.monotonic() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,lstm-lm,gpt2-6l,mobilenet_v2,resnet18,resnet50,vgg11")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--programs", default="all", help="the example programs: all, none, or names")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--modes", default="recompute,offload", help="recompute, offload, arena")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"recompute", "offload", "arena"}
    if unknown:
        ap.error(f"unknown modes: {sorted(unknown)}")
    from examples.programs import PROGRAMS

    runs = [("zoo", m, int(b)) for m in args.models.split(",") if m for b in args.batches.split(",")]
    if args.programs == "all":
        runs += [("program", p.name, 0) for p in PROGRAMS]
    elif args.programs != "none":
        runs += [("program", n, 0) for n in args.programs.split(",")]
    rows = []
    for kind, name, batch in runs:
        for mode in modes:
            rows.append(run(kind, name, batch, mode, args.steps, args.timeout))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    write_table(rows, "native_planned_peak")


if __name__ == "__main__":
    main()
