"""The interpret backend's smallest feasible memory budgets (its planner's floors), per model and
setting, as the budget tests find them.

    python bench/budget_floors.py

Each floor is what ``BudgetTooSmall`` names when a tape is run at a budget too small, raised
path by path until one plans (``tests/coexec/test_budget.py::smallest_budget``): the GPT-2-style
zoo model at batch 2 recomputing only and with offloading; the 6-layer MLP of
``tests/coexec/test_budget.py`` without and with the arena; the same MLP with dropout
(``make_random``: values recomputation cannot make again) recomputing only and with offloading.
With offloading the floor moves slightly between runs (copy windows come from measured
times). About two minutes on a 2-core CPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)

from examples.models import ZOO  # noqa: E402
from tests.coexec.test_budget import make, make_random, smallest_budget, step  # noqa: E402


def main() -> None:
    def gpt2():
        return ZOO["gpt2-6l"](2)

    def gpt2_step(z, i):
        return z.step()

    rows = [
        ("gpt2-6l, batch 2", "recomputing", lambda: smallest_budget(gpt2, gpt2_step, 5, ("floors", "g", 0), offload=False)),
        ("gpt2-6l, batch 2", "offloading", lambda: smallest_budget(gpt2, gpt2_step, 5, ("floors", "g", 1), offload=True)),
        ("MLP", "no arena", lambda: smallest_budget(make, step, 6, ("floors", "m", 0), arena=False)),
        ("MLP", "arena", lambda: smallest_budget(make, step, 6, ("floors", "m", 1), arena=True)),
        ("MLP with dropout", "recomputing", lambda: smallest_budget(make_random, step, 6, ("floors", "d", 0), offload=False)),
        ("MLP with dropout", "offloading", lambda: smallest_budget(make_random, step, 6, ("floors", "d", 1), offload=True)),
    ]
    print("| model | setting | smallest budget (bytes) |\n|---|---|---|")
    for model, setting, floor in rows:
        print(f"| {model} | {setting} | {floor()} |", flush=True)


if __name__ == "__main__":
    main()
