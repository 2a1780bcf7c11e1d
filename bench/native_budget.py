"""Memory budgets on the native backend against checkpointing, side by side in one run (issue
16's re-measure of Planner II's targets).

    python bench/native_budget.py [--models gpt2-6l,resnet50] [--batch 8] [--steps 6]
                                  [--fractions 0.75,0.5,0.25] [--threads 1]

Per zoo model, one SGD step measured as

* ``eager``: PyTorch as is;
* ``checkpoint k``: ``torch.utils.checkpoint.checkpoint_sequential`` over the model's chain of
  modules (``bench/budget_pareto.py``'s), ``k`` segments, for every ``k``;
* ``native``: ``GradientTape(backend="native")`` without a budget, then with ``memory_budget``
  set so that the activation memory is ``f`` of the unbudgeted step's, for each fraction ``f``
  (Planner II's targets, as ``bench/budget_pareto.py`` sets them: the step's peak as the
  planner simulates the described step, less ``1 - f`` of the activations, the bytes made before
  the backward starts and still held when it does; the backward starts at the first op whose
  name says ``backward``, the loss's), at the lowest peak ``checkpoint_sequential`` reaches, and
  at the smallest budget a plan meets (the figure ``BudgetTooSmall`` names).

Peaks, for every method alike: the bytes the CPU allocator holds at the step's peak beyond what
it held as the step began (counted by the native module's allocator, installed before any model
is built), plus the persistent state (parameters, optimizer state, the batch). Step times are
medians over ``--steps`` steps; "vs native": the median of a budgeted step's time over an
unbudgeted native step's, the two alternating; "predicted ms": the plan's step time (the
described step's op times on the worker, with the recomputation); "predicted vs native": that
over the described step's own op times (what the plan expects its recomputation to cost, free of
the machine's drift between the described step and the timed ones); "planned recompute ms"
against "recompute ms": the time the plan expects its recomputation to take (the ops' described
times) and what it took in the timed steps (median). "best checkpoint at equal
peak": of the three fastest ``checkpoint_sequential`` splits in the sweep whose peak is at most
the budget (which the budgeted step keeps to), the one fastest against the budgeted step when
each is timed in turn with it: the median of its time over the budgeted step's (paired, as the
sweep's separate medians drift with the machine by up to a fifth).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_pareto import build, chain, checkpointed_step, held_across
from common import markdown_table, prepare

import coexec
from coexec import runtime
from coexec.native_budget import planning_graph
from executor import native

MB = 1e6


def persistent_bytes(z) -> int:
    """Parameters, optimizer state and the batch."""
    ts = [*z.model.parameters(), *z.model.buffers(), *z.inputs]
    ts += [v for s in z.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in ts}.values())


def peak_of(step, persistent: int) -> int:
    """The state and, at their most, the bytes ``step`` made (tape.stats.peak_bytes's definition)."""
    cpu = native.wait()
    cpu.reset_cpu_peak()
    step()
    return persistent + cpu.cpu_bytes_made()[1]


def timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def paired_ratio(step, base, steps: int) -> float:
    """The median of ``step``'s time over ``base``'s, the two in turn (drift cancels)."""
    return statistics.median(timed(step) / timed(base) for _ in range(steps))


class Native:
    """A zoo model under a native tape, warmed up (under a budget: until its plan is in use)."""

    def __init__(self, name: str, batch: int, budget: int | None, key) -> None:
        self.z = build(name, batch, "cpu")
        self.tape = coexec.GradientTape(backend="native", memory_budget=budget, key=key)
        for _ in range(4):
            self.step()
        deadline = time.monotonic() + 300
        while budget is not None and self.tape.stats.planned_peak_bytes is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no plan within 300 s")
            self.step()
            time.sleep(0.05)
        self.step()

    def step(self) -> None:
        with self.tape:
            self.z.step()

    @property
    def plan(self):
        nb = self.tape._program.native_budget
        return None if nb is None else nb.plan


def activation_bytes(run: Native) -> int:
    """The bytes a described step of ``run`` made before its backward started and still held
    when it did (``bench/budget_pareto.py``'s ``activation_bytes``, over the description)."""
    capture = runtime.capture()
    capture.describe_next()
    run.step()
    d = capture.description()
    return held_across(planning_graph(d), next(o.place for o in d.ops if "backward" in o.name))


def smallest_budget(name: str, batch: int) -> int:
    try:
        Native(name, batch, 1, ("native budget", name, "probe"))
    except coexec.BudgetTooSmall as e:
        return e.smallest
    raise RuntimeError("a one-byte budget was met")


def measure(name: str, batch: int, steps: int, fractions: list[float]) -> list[dict]:
    rows = []
    z = build(name, batch, "cpu")
    for _ in range(2):
        z.step()
    persistent = persistent_bytes(z)
    e_peak = peak_of(z.step, persistent)
    e_sec = statistics.median(timed(z.step) for _ in range(steps))
    rows.append({"model": name, "method": "eager", "setting": "-", "peak MB": e_peak / MB, "step ms": 1e3 * e_sec})
    checkpoints, checkpointed = [], {}
    for k in range(1, len(chain(z)) + 1):
        zc = build(name, batch, "cpu")
        step = checkpointed_step(zc, k)
        try:
            step()
            step()
        except RuntimeError as e:
            print(f"  checkpoint_sequential, {k} segments: fails ({str(e).split(':')[0]})", file=sys.stderr)
            continue
        row = {"model": name, "method": "checkpoint_sequential", "setting": f"{k} segments",
               "peak MB": peak_of(step, persistent_bytes(zc)) / MB,
               "step ms": 1e3 * statistics.median(timed(step) for _ in range(steps))}  # fmt: skip
        checkpoints.append(row)
        checkpointed[row["setting"]] = step
        rows.append(row)
    free = Native(name, batch, None, ("native budget", name, "free"))
    rows.append({"model": name, "method": "native", "setting": "no budget",
                 "peak MB": peak_of(free.step, persistent_bytes(free.z)) / MB,
                 "step ms": 1e3 * statistics.median(timed(free.step) for _ in range(steps))})  # fmt: skip
    sizer = Native(name, batch, 10**15, ("native budget", name, "sizer"))  # (a plan that drops nothing)
    eager_planned, act = sizer.plan.eager_peak, activation_bytes(free)
    low = smallest_budget(name, batch)
    budgets = [(f"act {int(100 * f)}%", int(eager_planned - (1 - f) * act)) for f in fractions]
    if checkpoints:  # (and the lowest peak checkpointing reaches: the two at equal peak)
        lowest = min(c["peak MB"] for c in checkpoints if c["setting"] != "1 segments") * MB
        budgets.append(("checkpointing's lowest peak", int(lowest)))
    budgets = [(label, b) for label, b in budgets if b >= low] + [("smallest feasible", low)]
    for label, budget in budgets:
        print(f"  native at {label} ({budget / MB:.2f} MB)", file=sys.stderr, flush=True)
        run = Native(name, batch, budget, ("native budget", name, label))
        times, ratios, recompute = [], [], []
        for _ in range(steps):
            base = timed(free.step)
            times.append(timed(run.step))
            ratios.append(times[-1] / base)
            recompute.append(run.tape.stats.recompute_seconds)
        peak = peak_of(run.step, persistent_bytes(run.z))
        p, s = run.plan, run.tape.stats
        row = {"model": name, "method": "native", "setting": f"{label}: {budget / MB:.2f} MB", "peak MB": peak / MB,
               "planned MB": p.planned_peak / MB, "step ms": 1e3 * statistics.median(times),
               "predicted ms": 1e3 * p.predicted_seconds, "vs native": statistics.median(ratios),
               "predicted vs native": p.predicted_seconds / (p.predicted_seconds - p.extra_seconds),
               "recomputed": s.recomputed_ops, "planned recompute ms": 1e3 * p.extra_seconds,
               "recompute ms": 1e3 * statistics.median(recompute), "within": s.peak_bytes <= budget, "plan s": p.planning_seconds}  # fmt: skip
        fits = sorted((c for c in checkpoints if c["peak MB"] <= budget / MB), key=lambda c: c["step ms"])
        if fits:  # (the sweep's fastest three, each timed again in turn with the budgeted step)
            paired = {c["setting"]: paired_ratio(checkpointed[c["setting"]], run.step, steps) for c in fits[:3]}
            best = min(paired, key=paired.get)
            row["best checkpoint at equal peak"] = f"{best}: {paired[best]:.2f}x slower"
        rows.append(row)
    for r in rows:
        r["peak vs eager"] = r["peak MB"] * MB / e_peak
        r["time vs eager"] = r["step ms"] / (1e3 * e_sec)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-6l,resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fractions", default="0.75,0.5,0.25")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    prepare(args.threads)
    cpu = native.wait()
    if cpu is None:
        sys.exit("the native module is not available")
    cpu.count_cpu_bytes()  # (before any model: every tensor counted)
    rows = []
    for name in args.models.split(","):
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows += measure(name, args.batch, args.steps, [float(f) for f in args.fractions.split(",")])
    table = markdown_table(rows)
    print(table)
    out = Path(__file__).parent / "out" / "native_budget.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(table + "\n")


if __name__ == "__main__":
    main()
