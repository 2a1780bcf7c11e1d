"""Sizes drawn per step on the interpret backend, on any device (issue 17; a GPU question too,
since the interpret backend is the one a GPU machine runs):

    python bench/sized_steps.py [--device cuda] [--steps 40] [--models mlp,transformer,detection] [--planning]

Each model is built twice from one seed, an eager copy and a ``GradientTape(backend=
"interpret")`` copy, and stepped in turn on the same data: a batch drawn per step in [16, 256]
(MLP, Adam), a sequence length drawn per step in [16, 128] with a padding mask (a one-layer
transformer LM, AdamW, dropout 0.1), a number of boxes that follows the data (``nonzero``).
Printed per model: traces, fallbacks, co-executed steps after the first three, sized graph
nodes and those whose meta kernel proved wrong (their results are waited for), whether the
losses and final parameters are bit-equal, and the median step time against eager's after
the first three steps (each step synchronized). Then the transformer under a memory budget of
``--fraction`` of its largest unbudgeted peak (or the planner's floor for the first planned
step, where that is higher): steps over it, the largest peak over it, and which step's sizes
the plan in use covered at the end. With ``--planning``: the transformer with ``arena=True``
(plans asked for from its first traces on, a path planned again when a step allocates more),
lengths drawn per step against every length 128: plans made and the planner's seconds
(issue 17 asks for at most 2x). Deterministic kernels on CUDA (else
eager itself is not bit-equal run to run).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

import coexec
from planner import BudgetTooSmall


class Model:
    """A model, its optimizer, and ``step(i)`` returning the loss; inputs drawn by step index
    from a seeded generator, so both copies see the same data."""

    def __init__(self, name: str, device: torch.device, fixed: int | None = None) -> None:
        torch.manual_seed(0)
        self.name, self.device, self.fixed = name, device, fixed
        if name == "mlp":
            self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
            self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        elif name == "transformer":
            vocab, d = 60, 32
            self.embed = nn.Embedding(vocab, d, padding_idx=0).to(device)
            layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).to(device)
            self.head = nn.Linear(d, vocab).to(device)
            params = [*self.embed.parameters(), *self.encoder.parameters(), *self.head.parameters()]
            self.opt = torch.optim.AdamW(params, lr=1e-3)
            self.corpus = torch.randint(1, vocab, (4, 129)).to(device)
        elif name == "detection":
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5)).to(device)
            self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05)
        else:
            raise SystemExit(f"unknown model {name!r}: mlp, transformer or detection")

    def modules(self) -> list[nn.Module]:
        return [m for m in (getattr(self, k, None) for k in ("net", "embed", "encoder", "head")) if m is not None]

    def step(self, i: int) -> torch.Tensor:
        rng, dev = random.Random(i), self.device
        g = torch.Generator().manual_seed(i)
        self.opt.zero_grad()
        if self.name == "mlp":
            n = rng.randint(16, 256)
            x, y = torch.randn(n, 32, generator=g).to(dev), torch.randn(n, 1, generator=g).to(dev)
            loss = F.mse_loss(self.net(x), y)
        elif self.name == "transformer":
            length = rng.randint(16, 128) if self.fixed is None else self.fixed
            ends = torch.tensor([rng.randint(length // 2, length) for _ in range(4)], device=dev)
            pad = torch.arange(length + 1, device=dev)[None, :] >= ends[:, None]
            tokens = self.corpus[:, : length + 1].masked_fill(pad, 0)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            h = self.encoder(self.embed(inputs), src_key_padding_mask=pad[:, :-1])
            loss = F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten(), ignore_index=0)
        else:
            x = torch.randn(64, 8, generator=g).to(dev)
            out = self.net(x)
            boxes = out[out[:, 0] > 0.2]  # as many as the data says
            loss = boxes[:, 1:].pow(2).mean() if len(boxes) else out.sum() * 0
        loss.backward()
        self.opt.step()
        return loss.detach()


def timed(fn, device: torch.device) -> tuple[float, float]:
    t = time.perf_counter()
    loss = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, float(loss)


def run(
    name: str, device: torch.device, steps: int, budget: int | None = None, arena: bool = False, fixed: int | None = None
) -> dict:
    eager, co = Model(name, device, fixed), Model(name, device, fixed)
    tape = coexec.GradientTape(
        backend="interpret", memory_budget=budget, arena=arena, key=("sized_steps", name, budget, arena, fixed)
    )
    te, tc, le, lc, peaks = [], [], [], [], []

    def step_co(i: int) -> torch.Tensor:
        with tape:
            loss = co.step(i)
        return loss

    for i in range(steps):
        torch.manual_seed(1000 + i)
        d, loss = timed(lambda: eager.step(i), device)
        te.append(d), le.append(loss)
        torch.manual_seed(1000 + i)
        d, loss = timed(lambda: step_co(i), device)
        tc.append(d), lc.append(loss)
        peaks.append(tape.stats.peak_bytes if tape.stats.last_phase == "coexec" else 0)
    coexec.synchronize()
    s = tape.stats
    same = le == lc and all(
        torch.equal(a, b)
        for ma, mb in zip(eager.modules(), co.modules())
        for a, b in zip(ma.state_dict().values(), mb.state_dict().values())
    )
    nodes = [n for n in tape.graph.nodes() if n.kind == "op"]
    return {
        "model": name, "steps": steps, "traces": s.traces, "fallbacks": s.fallbacks,
        "coexec steps": s.coexec_steps, "sized nodes": f"{sum(n.sized for n in nodes)} of {len(nodes)}",
        "wrong meta kernels": ", ".join(sorted({n.name for n in nodes if n.inferred is False})) or "-",
        "bit-equal": same,
        "coexec/eager (median after 3)": round(statistics.median(tc[3:]) / statistics.median(te[3:]), 2),
        "peaks": peaks, "over budget steps": s.over_budget_steps, "planned for step": s.planned_for_step,
        "phase": s.phase, "plans made": s.plans_made, "planning s": s.planning_seconds,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--models", default="mlp,transformer,detection")
    ap.add_argument("--fraction", type=float, default=0.9, help="the transformer's budget: this of its largest peak")
    ap.add_argument("--planning", action="store_true", help="also the transformer's planning time with an arena, lengths drawn against fixed")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.use_deterministic_algorithms(True)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch {torch.__version__}")
    keys = ["model", "traces", "fallbacks", "coexec steps", "phase", "sized nodes", "wrong meta kernels", "bit-equal",
            "coexec/eager (median after 3)"]  # fmt: skip
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    largest = {}
    for name in args.models.split(","):
        row = run(name, device, args.steps)
        largest[name] = max(row["peaks"])
        print("| " + " | ".join(str(row[k]) for k in keys) + " |", flush=True)
    if "transformer" in largest and largest["transformer"]:
        budget, why = int(args.fraction * largest["transformer"]), f"{args.fraction} of its largest unbudgeted peak"
        try:
            row = run("transformer", device, args.steps, budget)
        except BudgetTooSmall as e:  # (the planner's floor for the first planned step is above it)
            budget, why = e.smallest, f"the planner's floor for its first planned step; {args.fraction} of its largest peak: {e}"
            row = run("transformer", device, args.steps, budget)
        print(
            f"\ntransformer under a budget of {budget} bytes ({why}; largest unbudgeted peak "
            f"{largest['transformer']}): {row['coexec steps']} steps co-executed, {row['over budget steps']} over the "
            f"budget, largest peak / budget {max(row['peaks']) / budget:.2f}, bit-equal {row['bit-equal']}, plan in use "
            f"made for step {row['planned for step']}, {row['traces']} traces"
        )
    if "transformer" in largest and args.planning:
        # planning over the run with plans asked for (an arena): lengths drawn per step, whose
        # larger steps are planned again, against every step at the largest length
        rows = {what: run("transformer", device, args.steps, arena=True, fixed=fixed)
                for what, fixed in (("drawn", None), ("fixed 128", 128))}  # fmt: skip
        print("\n| transformer, arena | traces | plans made | planning s | bit-equal |\n|---|---|---|---|---|")
        for what, row in rows.items():
            print(f"| {what} | {row['traces']} | {row['plans made']} | {row['planning s']:.2f} | {row['bit-equal']} |")


if __name__ == "__main__":
    main()
