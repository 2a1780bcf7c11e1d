"""Objects a training step leaves in reference cycles (freed only by Python's cycle collector).

    python bench/step_cycles.py [--models gpt2-6l,lstm-lm,resnet18] [--steps 4]

Per zoo model, eager and under coexec: 8 warm-up steps, then with the collector disabled, per
step ``gc.collect()`` returns how many objects the step left in cycles. Eager leaves none.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import coexec  # noqa: E402
from examples.models import ZOO  # noqa: E402


def per_step(name: str, use_coexec: bool, steps: int) -> list[int]:
    z = ZOO[name](1)
    key = ("step_cycles", name)
    tape = coexec.GradientTape(backend="interpret", key=key) if use_coexec else None

    def one() -> None:
        if tape is None:
            z.step().item()
        else:
            with tape:
                loss = z.step()
            loss.item()

    for _ in range(8):
        one()
    gc.collect()
    gc.disable()
    try:
        found = []
        for _ in range(steps):
            one()
            found.append(gc.collect())
    finally:
        gc.enable()
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-6l,lstm-lm,resnet18")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    print(f"{'model':<12} {'eager':<24} coexec")
    for name in args.models.split(","):
        eager, co = per_step(name, False, args.steps), per_step(name, True, args.steps)
        print(f"{name:<12} {str(eager):<24} {co}")


if __name__ == "__main__":
    main()
