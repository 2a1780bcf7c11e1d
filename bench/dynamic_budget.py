"""A memory budget on the native backend where sizes change between steps (issue 17).

    python bench/dynamic_budget.py [--steps 60] [--fraction 0.9] [--threads 1] [--per-step]

The random-length transformer of ``examples/dynamic_programs.py`` (a length drawn per step in
[16, 128]), twice: as it is, and with every length the largest (``fixed 128``, the baseline
issue 17 compares planning time against). Per run, one copy trains under
``GradientTape(backend="native")`` with a budget too large to bind, to measure each step's peak
(``tape.stats.peak_bytes``: the bytes held at the step's peak, persistent state included), then a
copy from the same seed trains under ``memory_budget`` = ``--fraction`` of the largest peak
measured, stepping in turn with an eager copy (each under its own RNG state), for ``--steps``
steps. Columns:

* ``budget``, ``peaks unbudgeted``: the budget and the range of the unbudgeted steps' peaks;
* ``unguarded steps (over budget)``: the steps before the guard knows the step's state (the
  first: guarded on everything alive as it begins, an upper bound), and how many went over;
* ``guarded steps over budget``, ``largest guarded peak / budget``: the steps after it, held
  within the budget by the plan once it arrived and by the capture's guard before and beyond it
  (``Capture.guard``: values dropped where an op would go over, made again where read); issue 17
  asks for none over, at any length;
* ``first planned step``: the first step that ran with a plan (made in a child process);
* ``plans made``, ``planning s``: descriptions planned (taken or left unused) and the planner's
  time on them, summed (issue 17: at most 2x the fixed-length run's; each run is a process of
  its own, so each pays for the planning child's first plan alike);
* ``vs eager, guarded before the plan``, ``vs eager, planned``: the budgeted steps' time over
  the eager copy's, from the first guarded step to the first planned one (the guard's drops
  only), and from the first planned step on;
* ``bit-equal``: losses and final parameters and optimizer state against the eager copy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, prepare
from dynamic_sizes import Pair, _OwnRNG

import coexec
from examples.dynamic_programs import TransformerRandomLength
from executor import native

MB = 1e6


class _Longest:
    """The program's random source, with every sequence length the largest."""

    def __init__(self, rng) -> None:
        self.rng = rng

    def randint(self, a: int, b: int) -> int:
        return 128 if (a, b) == (16, 128) else self.rng.randint(a, b)


def _program(fixed: bool) -> TransformerRandomLength:
    p = TransformerRandomLength(0)
    if fixed:
        p.rng = _Longest(p.rng)
    return p


def _peaks(fixed: bool, steps: int) -> list[int]:
    """Each step's peak under a budget that does not bind (the budget's counting on)."""
    p, rng = _program(fixed), _OwnRNG()
    tape = coexec.GradientTape(backend="native", memory_budget="100GB", key=("dynamic budget", "probe", fixed))
    peaks = []
    for i in range(steps):
        with rng, tape:
            p.step(i)
        peaks.append(tape.stats.peak_bytes)
    return peaks


def measure(fixed: bool, steps: int, fraction: float, per_step: bool = False) -> dict:
    peaks = _peaks(fixed, steps)
    budget = int(fraction * max(peaks))
    lengths = "fixed 128" if fixed else "drawn in [16, 128]"
    pair = Pair(lambda: _program(fixed))
    tape = coexec.GradientTape(backend="native", memory_budget=budget, key=("dynamic budget", fixed, fraction))
    first, unguarded, over_unguarded, over_guarded, largest = None, 0, 0, 0, 0.0
    held = []  # per step: its peak over the budget (P: it followed a plan)
    for i in range(steps):
        b = tape._program.native_budget if tape._program is not None else None  # (coexec/native_plans.py)
        guarded = b is not None and b._persistent() is not None  # (a step has been described)
        try:
            pair.step(i, tape)
        except coexec.BudgetTooSmall as e:  # (at the step after the plan was asked for)
            return {"lengths": lengths, "budget MB": budget / MB, "first planned step": f"none: {e}"}
        s = tape.stats
        held.append(f"{s.peak_bytes / budget:.3f}{'P' if s.planned_peak_bytes is not None else ''}")
        if guarded:
            over_guarded += s.peak_bytes > budget
            largest = max(largest, s.peak_bytes / budget)
        else:
            unguarded += 1
            over_unguarded += s.peak_bytes > budget
        if s.planned_peak_bytes is None:
            time.sleep(0.02)  # (the planning process starting, as in a loop with data loading)
        elif first is None:
            first = i
    b = tape._program.native_budget
    if per_step:
        print(f"{lengths}: per step, peak / budget (P: followed a plan): {' '.join(held)}", file=sys.stderr)
    return {
        "lengths": lengths,
        "steps": steps,
        "budget MB": budget / MB,
        "peaks unbudgeted MB": f"{min(peaks) / MB:.2f}-{max(peaks) / MB:.2f}",
        "unguarded steps (over budget)": f"{unguarded} ({over_unguarded})",
        "guarded steps over budget": over_guarded,
        "largest guarded peak / budget": largest,
        "first planned step": first,
        "plans made": b.plans_made,
        "planning s": b.planning_seconds,
        "vs eager, guarded before the plan": pair.ratio(unguarded, first),
        "vs eager, planned": pair.ratio(first if first is not None else steps),
        "bit-equal": pair.same(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fraction", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    ap.add_argument("--only", choices=("drawn", "fixed"), help="one run, its row as JSON (each run is a process)")
    ap.add_argument("--per-step", action="store_true", help="also print each step's peak over the budget (stderr)")
    args = ap.parse_args()
    if args.only is None:
        # (each run in a process of its own: the planning child's first plan pays for loading the
        # solver, 0.2-0.4 s, which the run that went second did not)
        rows = []
        for only in ("drawn", "fixed"):
            cmd = [sys.executable, __file__, "--only", only, *sys.argv[1:]]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        print(markdown_table(rows))
        return
    prepare(args.threads)
    if native.wait() is None:
        raise SystemExit("the native module is not available")
    print(json.dumps(measure(args.only == "fixed", args.steps, args.fraction, args.per_step)))


if __name__ == "__main__":
    main()
