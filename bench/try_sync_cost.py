"""What an op inside the user's ``try`` costs under coexec (issue 14, item 6).

    python bench/try_sync_cost.py [--steps 30] [--width 256] [--layers 8]

An op issued inside a ``try`` whose ``except`` could catch its error runs synchronously: the
skeleton waits for it, so a failure is raised inside the ``try``. This script runs one MLP
training step three ways, side by side in one process, alternating step by step after warm-up:
eager; coexec with no ``try``; coexec with the forward pass inside ``try: ... except
IndexError:``. Prints median step times and the ratios (medians over the measured steps).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import markdown_table  # noqa: E402


def make(width: int, layers: int, seed: int = 0):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*mods)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(32, width)


def plain_step(model, opt, x):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def try_step(model, opt, x):
    opt.zero_grad()
    try:
        out = model(x)  # every forward op is inside the try: each runs synchronously
    except IndexError:
        out = model(x.clamp(-1, 1))
    loss = out.pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    tape = functools.partial(coexec.GradientTape, backend="interpret")
    runs = {
        "eager": (make(a.width, a.layers), plain_step, None),
        "coexec": (make(a.width, a.layers), plain_step, tape(key="bench-plain")),
        "coexec, forward in try": (make(a.width, a.layers), try_step, tape(key="bench-try")),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(a.steps + 5):
        for name, ((model, opt, x), step, tape) in runs.items():
            t0 = time.perf_counter()
            if tape is None:
                step(model, opt, x)
            else:
                with tape:
                    step(model, opt, x)
            if i >= 5:
                times[name].append(time.perf_counter() - t0)
    for name, (_m, _s, tape) in runs.items():
        if tape is not None and tape.stats.coexec_steps < a.steps:
            print(f"warning: {name} co-executed only {tape.stats.coexec_steps} steps", file=sys.stderr)
    eager = statistics.median(times["eager"])
    rows = [
        {"run": name, "median ms": statistics.median(t) * 1e3, "vs eager": statistics.median(t) / eager}
        for name, t in times.items()
    ]
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
