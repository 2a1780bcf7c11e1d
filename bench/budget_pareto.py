"""Time against peak memory under memory budgets, side by side in one run.

    python bench/budget_pareto.py [--models gpt2-6l,resnet50] [--batch 16] [--steps 5] [--device cpu]

Per zoo model, one SGD training step measured as

* ``eager``: PyTorch as is;
* ``checkpoint k``: ``torch.utils.checkpoint.checkpoint_sequential`` over the model's chain of
  modules cut into ``k`` segments, for every ``k`` (non-reentrant);
* ``coexec``: co-executed without a budget (without the arena, as budgets run by default, and
  with it), then with ``memory_budget`` set so that the
  activation memory (bytes made in the forward pass and still held when the backward starts,
  from the step's planning graph) is 75%, 50%, 25% of the unbudgeted one, and at the smallest
  feasible budget (the figure ``BudgetTooSmall`` names); recomputation only
  (``offload=False``), then recomputation and offloading (``offload=True``), then
  ``coexec+arena``: recomputation with the arena planned jointly (``arena=True``; at 50% and
  at its smallest budget only, as it plans slowly);
* on ``--device cuda`` also ``torch.compile`` with
  ``torch._functorch.config.activation_memory_budget`` at 1.0, 0.5, 0.25 and
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (on a CPU there is no device memory to
  save: both are left out there).

Peaks are resident bytes, persistent state included. On a CPU: for eager and checkpointing the
largest sum of live storages seen by a dispatch-mode tracker (``planner.tracker``), for coexec
the executor's count of its live storages plus the persistent state (``TapeStats.peak_bytes``;
the arena counts whole, "arena MB", and values in it are not counted again), next to the
plan's prediction. On CUDA: ``torch.cuda.max_memory_allocated`` for every method
(coexec's own count beside it). Step times are medians over ``--steps`` steps after warm-up
(synchronised on CUDA); "predicted ms" is the plan's step time (op times, recomputation and
waits for copies, ``planner.offload.predict_seconds``) next to coexec's measured one and to the
time the executor was busy per step (mean; it runs the planned work, the skeleton's Python
overhead is not in the plan); "planned +%": what the plan itself adds, in % of the same path's
op times (the overhead the planner optimises, free of the runtime's own costs). "vs no
budget": the median, over ``--steps`` pairs, of a budgeted step's time over an unbudgeted
one's, the two runs' steps alternating (so that drift between runs minutes apart does not
enter the ratio). "plan s": the time to plan the budget (all
paths, every round).

Writes ``budget_pareto_<device>.md`` (the table) and ``.png`` (time against peak).
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
from common import markdown_table, pyplot  # noqa: E402
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
        return list(m)
    if name == "lstm-lm":
        return [m.embed, lambda x: m.lstm(x)[0], m.decoder]
    raise KeyError(f"no chain for {name}")


def build(name: str, batch: int, device: str) -> ZooModel:
    z = ZOO[name](batch)
    z.model.to(device)  # the optimizer keeps the same Parameter objects
    z.inputs = tuple(t.to(device) for t in z.inputs)
    return z


def peak_of(step, device: str) -> int:
    """Peak resident bytes of one call of ``step``, persistent state included."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return eager_peak(step)


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
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def activation_bytes(trace) -> int:
    first_bwd = next(i for i, op in enumerate(trace.ops) if op.is_backward)
    return held_across(PlanningGraph.from_trace(trace), first_bwd)


def held_across(g: PlanningGraph, first_bwd: int) -> int:
    """The activation memory: bytes the step made before op ``first_bwd`` (the backward's first)
    and still held when it runs."""
    return sum(
        s.nbytes
        for s in g.storages.values()
        if s.kind == LOCAL and s.producer < first_bwd and max(s.uses[-1], s.release or 0) >= first_bwd
    )


class CoexecRun:
    """A zoo model training under one tape, warmed up to co-execution."""

    def __init__(self, name: str, batch: int, budget, key, device: str, offload: bool = False, arena: bool | None = None):
        self.z = build(name, batch, device)
        self.tape = coexec.GradientTape(
            backend="interpret", memory_budget=budget, key=key, offload=offload, arena=arena
        )
        self.device = device
        for _ in range(4):  # trace, trace (momentum appears), covered, first co-executed
            self.step()

    def step(self) -> None:
        with self.tape:
            self.z.step()

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def result(self, times: list[float], busy: float) -> dict:
        cuda_peak = peak_of(self.step, self.device) if self.device == "cuda" else None
        s = self.tape.stats
        plan = self.tape._program.schedule
        return {
            "seconds": statistics.median(times),
            "busy": busy / len(times),
            "peak": cuda_peak if cuda_peak is not None else s.peak_bytes,
            "own count": s.peak_bytes,
            "planned": s.planned_peak_bytes,
            "recomputed": s.recomputed_ops,
            "offloaded": s.offloaded_storages,
            "predicted": plan.predicted_seconds if plan else None,
            "planned +%": planned_overhead(plan) if plan else None,
            "plan s": plan.planning_seconds if plan else None,
            "arena": self.tape._program.arena.numel() if self.tape._program.arena is not None else 0,
            "trace": self.tape._program.paths[-1].trace,
        }


def planned_overhead(plan) -> float:
    """The plan's own added time, in % of the same path's ops without a budget (its slowest
    path): recomputation and waits for copies as the planner predicts them, measured op times."""
    worst = max(plan.paths, key=lambda p: p.predicted_seconds)
    base = worst.predicted_seconds - worst.extra_seconds - worst.stall_seconds
    return 100 * (worst.predicted_seconds / base - 1) if base > 0 else 0.0


def coexec_run(
    name: str, batch: int, steps: int, budget, key, device: str, offload: bool = False, arena: bool | None = None,
    against: CoexecRun | None = None,
) -> dict:
    """Median step time and stats under ``budget``; with ``against`` (the unbudgeted run), its
    steps alternate with this one's and ``"vs free"`` is the median of the paired ratios: the
    overhead measured without the drift between two runs taken minutes apart."""
    run = CoexecRun(name, batch, budget, key, device, offload, arena)
    busy0 = run.tape.stats.executor_seconds
    times, ratios = [], []
    for _ in range(steps):
        free = against.timed_step() if against is not None else None
        times.append(run.timed_step())
        if free is not None:
            ratios.append(times[-1] / free)
    out = run.result(times, run.tape.stats.executor_seconds - busy0)
    out["vs free"] = statistics.median(ratios) if ratios else None
    return out


def smallest_budget(name: str, batch: int, device: str, offload: bool, arena: bool | None = None) -> int:
    budget = 1
    for attempt in range(5):
        try:
            coexec_run(name, batch, 1, budget, ("pareto-min", name, offload, arena, attempt), device, offload, arena)
            return budget
        except coexec.BudgetTooSmall as e:
            budget = e.smallest
    return budget


def compiled_rows(name: str, batch: int, steps: int, device: str) -> list[dict]:
    """``torch.compile`` at activation memory budgets (CUDA only); a failure is a row too."""
    import torch._functorch.config as fconfig

    rows = []
    for frac in (1.0, 0.5, 0.25):
        row = {"model": name, "method": "torch.compile", "setting": f"activation_memory_budget={frac}"}
        try:
            torch._dynamo.reset()
            with fconfig.patch(activation_memory_budget=frac):
                z = build(name, batch, device)
                z.model = torch.compile(z.model)
                for _ in range(3):
                    z.step()
                row["peak MB"] = peak_of(z.step, device) / MB
                row["step ms"] = 1e3 * median_seconds(z.step, steps)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row["setting"] += f" (failed: {type(e).__name__}: {str(e)[:80]})"
        rows.append(row)
    return rows


def measure(name: str, batch: int, steps: int, device: str) -> list[dict]:
    rows = []
    z = build(name, batch, device)
    for _ in range(2):
        z.step()
    e_peak = peak_of(z.step, device)
    e_sec = median_seconds(z.step, steps)
    rows.append({"model": name, "method": "eager", "setting": "-", "peak MB": e_peak / MB, "step ms": 1e3 * e_sec})
    try:
        n = len(chain(z))
    except KeyError:
        n = 0
    for k in range(1, n + 1):
        zc = build(name, batch, device)
        step = checkpointed_step(zc, k)
        try:
            for _ in range(2):
                step()
        except RuntimeError as e:  # e.g. an in-place op right after a segment boundary (vgg11)
            print(f"  checkpoint_sequential, {k} segments: fails ({str(e).split(':')[0]})", flush=True)
            rows.append({"model": name, "method": "checkpoint_sequential", "setting": f"{k} segments: fails"})
            continue
        rows.append({"model": name, "method": "checkpoint_sequential", "setting": f"{k} segments",
                     "peak MB": peak_of(step, device) / MB, "step ms": 1e3 * median_seconds(step, steps)})  # fmt: skip
    if device == "cuda":
        zs = build(name, batch, device)

        def offloaded_step():
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return zs.step()

        offloaded_step()
        rows.append({"model": name, "method": "save_on_cpu", "setting": "pin_memory",
                     "peak MB": peak_of(offloaded_step, device) / MB,
                     "step ms": 1e3 * median_seconds(offloaded_step, steps)})  # fmt: skip
        rows.extend(compiled_rows(name, batch, steps, device))
    # budgets run without the arena by default: they are compared with the run without one
    free_run = CoexecRun(name, batch, None, ("pareto", name, "free"), device, arena=False)
    free = free_run.result([free_run.timed_step() for _ in range(steps)], 0.0)
    arena = coexec_run(name, batch, steps, None, ("pareto", name, "arena"), device)
    act = activation_bytes(free["trace"])
    for setting, r in (("no budget", free), ("no budget, arena", arena)):
        rows.append({"model": name, "method": "coexec", "setting": setting, "peak MB": r["peak"] / MB,
                     "own MB": r["own count"] / MB, "arena MB": r["arena"] / MB, "step ms": 1e3 * r["seconds"]})  # fmt: skip
    for offload, with_arena in ((False, None), (True, None), (False, True)):
        method = "coexec+offload" if offload else "coexec+arena" if with_arena else "coexec"
        low = smallest_budget(name, batch, device, offload, with_arena)
        budgets = [(f"act {int(f * 100)}%", int(free["own count"] - (1 - f) * act)) for f in (0.75, 0.5, 0.25)]
        budgets = [(label, b) for label, b in budgets if b >= low] + [("smallest feasible", low)]
        if with_arena:  # the joint plan is slow: its middle point and its floor
            budgets = [(label, b) for label, b in budgets if label in ("act 50%", "smallest feasible")]
        for label, b in budgets:
            print(f"  {method} at {label} ({b / MB:.2f} MB)", file=sys.stderr, flush=True)
            for attempt in range(3):
                try:
                    r = coexec_run(name, batch, steps, b, ("pareto", name, label, offload, with_arena, attempt), device,
                                   offload, with_arena, against=free_run)  # fmt: skip
                    break
                except coexec.BudgetTooSmall as e:
                    # with offloading the floor moves with the op and copy times this run measured
                    print(f"    not feasible on this run: {e.smallest / MB:.2f} MB is", file=sys.stderr, flush=True)
                    label = label if label.endswith("(this run)") else f"{label} (this run)"
                    b = e.smallest
            else:
                raise RuntimeError(f"{name}: no feasible budget settled near {b}")
            rows.append({"model": name, "method": method, "setting": f"{label}: {b / MB:.2f} MB",
                         "peak MB": r["peak"] / MB, "own MB": r["own count"] / MB, "planned MB": r["planned"] / MB,
                         "arena MB": r["arena"] / MB,
                         "step ms": 1e3 * r["seconds"], "predicted ms": 1e3 * r["predicted"],
                         "planned +%": r["planned +%"],
                         "executor ms": 1e3 * r["busy"], "plan s": r["plan s"],
                         "vs no budget": r["vs free"], "recomputed ops": r["recomputed"],
                         "offloaded": r["offloaded"], "within": r["own count"] <= b})  # fmt: skip
    for r in rows:
        if "peak MB" in r:
            r["peak vs eager"] = r["peak MB"] * MB / e_peak
            r["time vs eager"] = r["step ms"] / (1e3 * e_sec)
    return rows


COLUMNS = ["model", "method", "setting", "peak MB", "own MB", "planned MB", "arena MB", "peak vs eager", "step ms",
           "predicted ms", "executor ms", "time vs eager", "planned +%", "vs no budget", "recomputed ops", "offloaded", "within", "plan s"]  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method, style in (("eager", "ks"), ("checkpoint_sequential", "o--"), ("coexec", "^-"),
                              ("coexec+offload", "v-"), ("coexec+arena", "x-"), ("torch.compile", "D:"),
                              ("save_on_cpu", "P")):  # fmt: skip
            sel = sorted(
                (r for r in rows if r["model"] == model and r["method"] == method and "peak MB" in r),
                key=lambda r: r["peak MB"],
            )
            if not sel:
                continue
            ax.plot([r["peak MB"] for r in sel], [r["time vs eager"] for r in sel], style, label=method)
        ax.set_xlabel("peak resident MB (persistent state included)")
        ax.set_ylabel("step time / eager")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2-6l,resnet50,resnet18,mlp")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = ap.parse_args()
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    warnings.simplefilter("ignore", RuntimeWarning)
    rows = []
    for name in args.models.split(","):
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.extend(measure(name, args.batch, args.steps, args.device))
    table = [{c: r.get(c, "") for c in COLUMNS} for r in rows]
    text = (
        f"torch {torch.__version__}, {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f", {torch.get_num_threads()} threads")
        + f", batch {args.batch}, "
        f"medians of {args.steps} steps\n\n" + markdown_table(table) + "\n"
    )
    print(text)
    stem = f"budget_pareto_{args.device}"
    (out / f"{stem}.md").write_text(text)
    plot(rows, out / f"{stem}.png")
    print(f"wrote {out / stem}.md and .png")


if __name__ == "__main__":
    main()
