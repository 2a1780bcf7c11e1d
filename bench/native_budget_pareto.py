"""The budgets of ``bench/budget_pareto.py`` on the native backend: held, and bit-equal to eager.

    python bench/native_budget_pareto.py [--models gpt2-6l,resnet50,resnet18,mlp] [--batch 16]
                                         [--steps 3] [--timeout 900]

Per zoo model, recomputing only (``offload=False``) and with offloading (``offload=True``),
each in its own fresh process, at ``budget_pareto.py``'s budgets: the unbudgeted peak less
25%, 50% and 75% of the activation memory (the bytes the step made before its backward began
and still held when it did), where a plan can meet them, and the smallest budget a plan meets
(``BudgetTooSmall`` names it). Both figures come from a described step without a budget as the
planner counts it (``coexec/native_budget.py``). At each budget the model trains beside an
eager twin (the same random draws) until ``--steps`` steps have followed the plan; per budget:
whether every step (planned or not) held within it and the most one held, every loss
bit-equal to eager's, the
measured against the planned peak, what the last step recomputed and parked, and the median
step time (a rough figure: the eager twin's step runs between two).
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
from coexec import runtime
from coexec.native_budget import planning_graph
from examples.models import ZOO
from planner import replay
from planner.graph import LOCAL

name, batch, offload, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])

def train(budget, key, want, twin=False):
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=key, offload=offload)
    captured = ZOO[name](batch)
    eager = ZOO[name](batch) if twin else None
    equal, held, worst, ratios, times, last, i = True, True, 0, [], [], None, 0
    deadline = time.monotonic() + 600
    while len(ratios) < want:
        if time.monotonic() > deadline:
            raise SystemExit("no plan within 600 s")
        rng = torch.get_rng_state()
        want_loss = eager.step() if twin else None
        torch.set_rng_state(rng)
        t0 = time.perf_counter()
        with tape:
            got = captured.step()
        seconds = time.perf_counter() - t0
        if twin:
            equal = equal and torch.equal(torch.as_tensor(want_loss), torch.as_tensor(got))
        s = tape.stats
        held = held and s.peak_bytes <= budget
        worst = max(worst, s.peak_bytes)
        if s.planned_peak_bytes is not None:
            ratios.append(s.peak_bytes / s.planned_peak_bytes)
            times.append(seconds)
            last = s
        else:
            time.sleep(0.05)
        i += 1
    if twin:
        equal = equal and all(torch.equal(a, b) for a, b in zip(eager.model.parameters(), captured.model.parameters()))
    return tape, ratios, last, equal, held, times, worst

# the unbudgeted step, described: its peak and activation memory as the planner counts them
from executor import native
native.wait()
free = coexec.GradientTape(backend="native", key="free")
z = ZOO[name](batch)
for _ in range(4):
    with free:
        z.step()
cap = runtime.capture()
cap.describe_next()
with free:
    z.step()
d = cap.description()
g = planning_graph(d)
peak = replay(g, list(range(len(g)))).peak
first_bwd = next(o.place for o in d.ops if o.backward)
act = sum(
    s.nbytes for s in g.storages.values()
    if s.kind == LOCAL and s.producer < first_bwd and max(s.uses[-1], s.release or 0) >= first_bwd
)
try:
    train(1, "probe", 1)
    raise SystemExit("a one-byte budget was met")
except coexec.BudgetTooSmall as e:
    smallest = e.smallest
budgets = [(f"act {int(f * 100)}%", int(peak - (1 - f) * act)) for f in (0.75, 0.5, 0.25)]
budgets = [(label, b) for label, b in budgets if b >= smallest] + [("smallest feasible", smallest)]
for label, budget in budgets:
    for attempt in range(3):
        try:
            tape, ratios, s, equal, held, times, worst = train(budget, (label, attempt), steps, twin=True)
            break
        except coexec.BudgetTooSmall as e:  # (with offloading the smallest moves with the ops' measured times)
            label, budget = label.split(" (")[0] + " (this run)", e.smallest
    plan = tape._program.native_budget.plan
    print(json.dumps({
        "setting": label, "budget": budget, "peak": peak, "activation": act, "planned": plan.planned_peak,
        "measured": s.peak_bytes, "least ratio": min(ratios), "worst ratio": max(ratios), "held": held,
        "worst step": worst,
        "bit-equal": equal, "parked": s.offloaded_storages, "recomputed": s.recomputed_ops,
        "step ms": 1e3 * sorted(times)[len(times) // 2],
    }), flush=True)
"""


def run(name: str, batch: int, offload: bool, steps: int, timeout: float) -> list[dict]:
    base = {"model": f"{name}, batch {batch}", "offload": offload}
    args = [sys.executable, "-c", _CHILD, name, str(batch), "1" if offload else "0", str(steps)]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parents[1])
    except subprocess.TimeoutExpired as e:
        lines = (e.stdout or b"").decode().splitlines() if isinstance(e.stdout, bytes) else (e.stdout or "").splitlines()
        return [*map(lambda l: _row(base, json.loads(l)), lines), {**base, "setting": f"over {timeout:.0f} s"}]
    rows = [_row(base, json.loads(line)) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0:
        rows.append({**base, "setting": "failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:120]})
    return rows


def _row(base: dict, r: dict) -> dict:
    MB = 1e6
    return {
        **base,
        "setting": r["setting"],
        "budget MB": r["budget"] / MB,
        "unbudgeted MB": r["peak"] / MB,
        "planned MB": r["planned"] / MB,
        "measured MB": r["measured"] / MB,
        "measured / planned": f"{r['least ratio']:.4f}-{r['worst ratio']:.4f}",
        "every step held": r["held"],
        "worst step MB": r["worst step"] / MB if "worst step" in r else None,
        "bit-equal": r["bit-equal"],
        "recomputed": r["recomputed"],
        "parked": r["parked"],
        "step ms": r["step ms"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-6l,resnet50,resnet18,mlp")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        for offload in (False, True):
            t0 = time.monotonic()
            got = run(name, args.batch, offload, args.steps, args.timeout)
            for r in got:
                print(json.dumps(r), file=sys.stderr, flush=True)
            print(f"{name}, offload={offload}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            rows += got
    write_table(rows, "native_budget_pareto")


if __name__ == "__main__":
    main()
