"""A memory budget on the native backend for a program with data-dependent branches.

    python bench/branch_budget.py [--steps 120] [--fractions 0.9,0.95] [--threads 1]

The program: a trunk, then one of three heads (3, 5 or 7 layers of 256 wide) picked by the
trunk's output (``.item()``: a data-dependent 3-way branch), run once or twice (a loop whose trip
count varies with the step), and an output layer; SGD, batch 128: six paths, whose peaks differ.
Each fraction runs in a process of its own: one copy trains under a budget too large to bind to
measure each step's peak, then a copy from the same seed trains under ``memory_budget`` =
fraction x the largest of those peaks (the program's whole state, every head's parameters, and
the bytes the step made at their most), stepping in turn with an eager copy. Columns:

* ``over budget``: steps whose peak (the program's state and the bytes the step made at their
  most, as above) is over the budget, of all (those before a path's plan arrives, and those of
  paths no plan can hold, run on the capture's guard alone, which holds them where it can);
* ``followed``: steps that followed a plan to their end (the capture's ``followed``), and
  ``largest followed peak / planned``: their measured peak over the plan's
  (``tape.stats.planned_peak_bytes``, where the code reports it for the plan followed);
* ``plans made``, ``bit-equal``: losses each step, and the parameters at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from common import markdown_table, prepare

import coexec
from coexec import runtime
from executor import native


def _state() -> dict:
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh())
    heads = torch.nn.ModuleList(
        torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())])
        for depth in (3, 5, 7)
    )
    model = torch.nn.ModuleDict({"trunk": trunk, "heads": heads, "out": torch.nn.Linear(256, 1)})
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01), "rng": torch.Generator().manual_seed(1)}


def _step(state: dict, i: int) -> torch.Tensor:
    model, opt = state["model"], state["opt"]
    x, y = torch.randn(128, 64, generator=state["rng"]), torch.randn(128, 1, generator=state["rng"])
    opt.zero_grad()
    h = model["trunk"](x)
    k = int(h.sum().item() * 1000) % 3
    for _ in range(1 + i % 2):
        h = model["heads"][k](h)
    loss = F.mse_loss(model["out"](h), y)
    loss.backward()
    opt.step()
    return loss.detach()


def measure(fraction: float, steps: int) -> dict:
    cpu = native.wait()
    probe = _state()
    tape = coexec.GradientTape(backend="native", memory_budget=10**11, key=("branch budget", "probe"))
    # (a step's peak: the program's whole state, every head's parameters, and the bytes the step
    # made at their most; the state a budget counts, coexec/native_budget.py other_states)
    state = sum(p.untyped_storage().nbytes() for p in probe["model"].parameters())
    peaks = []
    for i in range(steps):
        with tape:
            _step(probe, i)
        peaks.append(state + cpu.cpu_bytes_made()[1])
    budget = int(fraction * max(peaks))
    eager, captured = _state(), _state()
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("branch budget", fraction))
    over = followed = 0
    largest, equal = 0.0, True
    for i in range(steps):
        want = _step(eager, i)
        try:
            with tape:
                got = _step(captured, i)
        except coexec.BudgetTooSmall as e:
            return {"fraction": fraction, "budget MB": budget / 1e6, "over budget": f"none: {e}"}
        equal = equal and torch.equal(want, got)
        s = tape.stats
        over += state + cpu.cpu_bytes_made()[1] > budget
        if runtime.capture().followed:
            followed += 1
            if s.planned_peak_bytes:
                largest = max(largest, s.peak_bytes / s.planned_peak_bytes)
    equal = equal and all(torch.equal(a, b) for a, b in zip(eager["model"].parameters(), captured["model"].parameters()))
    return {
        "fraction": fraction,
        "budget MB": budget / 1e6,
        "peaks unbudgeted MB": f"{min(peaks) / 1e6:.2f}-{max(peaks) / 1e6:.2f}",
        "steps": steps,
        "over budget": over,
        "followed": followed,
        "largest followed peak / planned": largest,
        "plans made": tape.stats.plans_made,
        "bit-equal": equal,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--fractions", default="0.9,0.95")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    ap.add_argument("--only", type=float, help="one fraction, its row as JSON (each runs in a process)")
    args = ap.parse_args()
    prepare(args.threads)
    if args.only is not None:
        print(json.dumps(measure(args.only, args.steps)))
        return
    rows = []
    for f in args.fractions.split(","):
        print(f"fraction {f} ...", file=sys.stderr, flush=True)
        out = subprocess.run(
            [sys.executable, __file__, "--only", f, "--steps", str(args.steps), "--threads", str(args.threads)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
