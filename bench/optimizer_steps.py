"""Co-executed training steps by optimizer: what reading an optimizer's step counters costs.

    python bench/optimizer_steps.py [--optimizers sgd,adam,adamw] [--batch 64] [--width 512]
                                    [--steps 15] [--threads 1]

An 8-layer MLP (``--width`` units, GELU) trains on one batch, a copy eagerly and a copy under
``coexec.GradientTape(backend="interpret")``, from the same seed, taking steps in turn after
warm-up (until the plan arrived). Adam and AdamW on a CPU read each parameter's
``state["step"]`` with ``.item()`` once per step, a fetch; the skeleton answers those itself
where it computed the counter too (coexec/mirrors.py). Columns (medians over the steps):

* ``eager ms``; ``coexec/eager``: the median of the paired ratios;
* ``stall ms``: per co-executed step, the skeleton waiting on the executor (fetches and the end
  of the step: ``TapeStats.stall_seconds``);
* ``mirrored fetches``: of the latest co-executed step, fetches answered without waiting;
* ``max |diff|``: between the two copies' parameters after the run (0: bit-equal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import markdown_table, measure_each, prepare  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def make(name: str, batch: int, width: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(width, width), nn.GELU())])
    opt = OPTIMIZERS[name](model.parameters())
    x = torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return model, step


def measure(name: str, batch: int, width: int, steps: int) -> dict:
    eager_model, eager = make(name, batch, width)
    co_model, co = make(name, batch, width)
    tape = coexec.GradientTape(backend="interpret", key=("optimizer-steps", name))

    def coexec_step() -> None:
        with tape:
            co()

    for _ in range(12):
        eager()
        coexec_step()
    if tape.stats.phase != "coexec":
        raise RuntimeError(f"{name} did not settle into co-execution: {tape.stats}")
    coexec.wait_for_plans()
    eager()
    coexec_step()
    ratios, times, stalls = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        eager()
        e = time.perf_counter() - t0
        stall = tape.stats.stall_seconds
        t0 = time.perf_counter()
        coexec_step()
        c = time.perf_counter() - t0
        times.append(e)
        ratios.append(c / e)
        stalls.append(tape.stats.stall_seconds - stall)
    diff = max((a - b).abs().max().item() for a, b in zip(eager_model.parameters(), co_model.parameters()))
    return {
        "optimizer": name,
        "eager ms": 1e3 * statistics.median(times),
        "coexec/eager": statistics.median(ratios),
        "stall ms": 1e3 * statistics.median(stalls),
        # (getattr: the bench also runs on checkouts from before mirrors, to compare)
        "mirrored fetches": getattr(tape.stats, "mirrored_fetches", 0),
        "max |diff|": diff,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    args = ap.parse_args()
    prepare(args.threads)
    rows = measure_each(args.optimizers, lambda n: measure(n, args.batch, args.width, args.steps))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
