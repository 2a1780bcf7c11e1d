"""Time against peak memory under memory budgets, side by side in one run.

    python bench/budget_pareto.py [--models gpt2-6l,mlp] [--batch 16] [--steps 5] [--out bench/out]

Per zoo model, one SGD training step measured as

* ``eager``: PyTorch as is;
* ``checkpoint k``: ``torch.utils.checkpoint.checkpoint_sequential`` over the model's chain of
  modules cut into ``k`` segments, for every ``k`` (non-reentrant);
* ``coexec``: co-executed without a budget, then with ``memory_budget`` set so that the
  activation memory (bytes made in the forward pass and still held when the backward starts,
  from the step's planning graph) is 75%, 50%, 25% of the unbudgeted one, and at the smallest
  feasible budget (the figure ``BudgetTooSmall`` names).

Peaks are resident bytes, persistent state included: for eager and checkpointing the largest
sum of live storages seen by a dispatch-mode tracker (``planner.tracker``), for coexec the
executor's count of its live storages plus the persistent state (``TapeStats.peak_bytes``),
next to the plan's prediction. Step times are medians over ``--steps`` steps after warm-up.
``torch.compile`` with ``activation_memory_budget`` and ``save_on_cpu`` are not measured yet:
the first allocates inside compiled kernels the tracker cannot see, and on a CPU-only machine
"offloading to the CPU" moves nothing off the device.

Writes ``budget_pareto.md`` (the table) and ``budget_pareto.png`` (time against peak).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import markdown_table  # noqa: E402
from examples.models import ZOO, ZooModel  # noqa: E402
from planner import LOCAL, PlanningGraph  # noqa: E402
from planner.tracker import eager_peak  # noqa: E402

MB = 1e6


def chain(z: ZooModel) -> list[nn.Module | object]:
    """The model as a chain of callables, for ``checkpoint_sequential``."""
    m = z.model
    name = z.name
    if name == "mlp":
        return list(m)
    if name == "gpt2-6l":
        def embed(idx):
            return m.tok(idx) + m.pos(torch.arange(idx.shape[1], device=idx.device))

        def head(x):
            return m.ln(x) @ m.tok.weight.t()

        return [embed, *m.blocks, head]
    if name.startswith("resnet"):
        def head(x):
            return m.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

        return [m.stem, *[b for stage in m.stages for b in stage], head]
    if name == "mobilenet_v2":
        def head(x):
            return m.classifier(x.mean(dim=(2, 3)))

        return [*m.features, head]
    if name == "vgg11":
        return [*m.features, lambda x: m.classifier(torch.flatten(x, 1))]
    raise KeyError(f"no chain for {name}")


def checkpointed_step(z: ZooModel, segments: int):
    funcs = chain(z)

    def step():
        out = checkpoint_sequential(funcs, segments, z.inputs[0], use_reentrant=False)
        loss = z.loss(out, z.inputs[1])
        loss.backward()
        z.optimizer.step()
        z.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def median_seconds(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def activation_bytes(trace) -> int:
    g = PlanningGraph.from_trace(trace)
    first_bwd = next(i for i, op in enumerate(trace.ops) if op.is_backward)
    return sum(
        s.nbytes
        for s in g.storages.values()
        if s.kind == LOCAL and s.producer < first_bwd and max(s.uses[-1], s.release or 0) >= first_bwd
    )


def coexec_run(name: str, batch: int, steps: int, budget, key) -> dict:
    z = ZOO[name](batch)
    tape = coexec.GradientTape(memory_budget=budget, key=key)

    def step():
        with tape:
            z.step()

    for _ in range(4):  # trace, trace (momentum appears), covered, first co-executed
        step()
    seconds = median_seconds(step, steps)
    s = tape.stats
    plan = tape._program.budget_plan
    return {
        "seconds": seconds,
        "peak": s.peak_bytes,
        "planned": s.planned_peak_bytes,
        "recomputed": s.recomputed_ops,
        "predicted extra ms": 1e3 * plan.recompute_seconds if plan else 0.0,
        "trace": tape._program.paths[-1],
        "coexec steps": s.coexec_steps,
    }


def smallest_budget(name: str, batch: int) -> int:
    budget = 1
    for attempt in range(5):
        try:
            coexec_run(name, batch, 1, budget, ("pareto-min", name, attempt))
            return budget
        except coexec.BudgetTooSmall as e:
            budget = e.smallest
    return budget


def measure(name: str, batch: int, steps: int) -> list[dict]:
    rows = []
    z = ZOO[name](batch)
    for _ in range(2):
        z.step()
    e_peak = eager_peak(z.step)
    e_sec = median_seconds(z.step, steps)
    rows.append({"model": name, "method": "eager", "setting": "-", "peak MB": e_peak / MB, "step ms": 1e3 * e_sec})
    try:
        n = len(chain(z))
    except KeyError:
        n = 0
    for k in range(1, n + 1):
        zc = ZOO[name](batch)
        step = checkpointed_step(zc, k)
        for _ in range(2):
            step()
        peak = eager_peak(step)
        rows.append({"model": name, "method": "checkpoint_sequential", "setting": f"{k} segments",
                     "peak MB": peak / MB, "step ms": 1e3 * median_seconds(step, steps)})  # fmt: skip
    free = coexec_run(name, batch, steps, None, ("pareto", name, "free"))
    act = activation_bytes(free["trace"])
    rows.append({"model": name, "method": "coexec", "setting": "no budget", "peak MB": free["peak"] / MB,
                 "step ms": 1e3 * free["seconds"]})  # fmt: skip
    low = smallest_budget(name, batch)
    budgets = [(f"act {int(f * 100)}%", int(free["peak"] - (1 - f) * act)) for f in (0.75, 0.5, 0.25)]
    budgets = [(label, b) for label, b in budgets if b >= low] + [("smallest feasible", low)]
    for label, b in budgets:
        r = coexec_run(name, batch, steps, b, ("pareto", name, label))
        rows.append({"model": name, "method": "coexec", "setting": f"{label}: {b / MB:.2f} MB",
                     "peak MB": r["peak"] / MB, "planned MB": r["planned"] / MB, "step ms": 1e3 * r["seconds"],
                     "vs no budget": r["seconds"] / free["seconds"], "recomputed ops": r["recomputed"],
                     "predicted extra ms": r["predicted extra ms"], "within": r["peak"] <= b})  # fmt: skip
    for r in rows:
        r["peak vs eager"] = r["peak MB"] * MB / e_peak
        r["time vs eager"] = r["step ms"] / (1e3 * e_sec)
    return rows


COLUMNS = ["model", "method", "setting", "peak MB", "planned MB", "peak vs eager", "step ms", "time vs eager",
           "vs no budget", "recomputed ops", "predicted extra ms", "within"]  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method, style in (("eager", "ks"), ("checkpoint_sequential", "o--"), ("coexec", "^-")):
            sel = [r for r in rows if r["model"] == model and r["method"] == method]
            ax.plot([r["peak MB"] for r in sel], [r["time vs eager"] for r in sel], style, label=method)
        ax.set_xlabel("peak resident MB (persistent state included)")
        ax.set_ylabel("step time / eager")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2-6l,mlp,resnet18")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = ap.parse_args()
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    warnings.simplefilter("ignore", RuntimeWarning)
    rows = []
    for name in args.models.split(","):
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.extend(measure(name, args.batch, args.steps))
    table = [{c: r.get(c, "") for c in COLUMNS} for r in rows]
    text = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
        f"medians of {args.steps} steps\n\n" + markdown_table(table) + "\n"
    )
    print(text)
    (out / "budget_pareto.md").write_text(text)
    plot(rows, out / "budget_pareto.png")
    print(f"wrote {out / 'budget_pareto.md'} and {out / 'budget_pareto.png'}")


if __name__ == "__main__":
    main()
