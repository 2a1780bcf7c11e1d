"""The unbudgeted arena against the allocator: peak bytes of co-executed steps, side by side in
one run.

    python bench/arena_peak.py [--models gpt2-6l,resnet50] [--batch 16] [--steps 3]

Per zoo model, one SGD training step co-executed without a budget, first with
``arena=False`` (every output from the allocator), then with the arena (the default). Peaks are
the executor's count of its live storages plus the persistent state (``TapeStats.peak_bytes``;
the arena counts whole from the start of the step). "in arena" / "allocator" count the planned
outputs the executor wrote into the arena and those whose planned bytes were still taken, so
they went to the allocator on top of the arena (a plan is a hint: that is safe, but it costs
memory). Step times are medians over ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_pareto import MB, coexec_run  # noqa: E402
from common import markdown_table  # noqa: E402

from coexec import runtime  # noqa: E402
from examples.models import ZOO  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        if name not in ZOO:
            raise SystemExit(f"unknown model {name!r}; the zoo has {', '.join(ZOO)}")
        peaks = {}
        for arena in (False, True):
            ex = runtime.executor()
            hits, misses = ex.stats().arena_hits, ex.stats().arena_misses
            r = coexec_run(name, args.batch, args.steps, None, ("arena-peak", name, arena), "cpu", arena=arena)
            peaks[arena] = r["peak"]
            rows.append({
                "model": name,
                "outputs from": "arena" if arena else "allocator",
                "peak MB": r["peak"] / MB,
                "arena MB": r["arena"] / MB,
                "vs allocator": r["peak"] / peaks[False],
                "in arena": ex.stats().arena_hits - hits,
                "allocator": ex.stats().arena_misses - misses,
                "step ms": 1e3 * r["seconds"],
            })  # fmt: skip
            print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
