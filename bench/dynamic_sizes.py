"""Programs whose sizes change between steps (examples/dynamic_programs.py) under coexec.

    python bench/dynamic_sizes.py [--programs reinforce,detection_boxes] [--steps 60] [--backend native]
                                  [--memory-budget 100KB] [--out bench/out]

Per program, one instance trains eagerly and one under
``coexec.GradientTape(backend="interpret")`` from the same seed, for ``--steps`` steps, taking
turns step by step, each under its own torch RNG state (so each draws what it would alone, and
a coexec step's time is paired with the same step's eager time).
Columns, the figures issue 17 asks for:

* ``traces``, ``fallbacks``, ``coexec steps``: from the tape's stats after the run;
* ``warm-up``: the steps before the first co-executed one; ``co-executed after warm-up %``:
  of the steps after it, the share that co-executed (issue 17 asks for at least 90%, with at
  most 4 traces);
* ``phase``: the program's phase at the end (``eager``: it gave up after ``max_traces``);
* ``ops on the worker after warm-up %`` (native backend): of the ops of the steps after the
  first, the share the worker computed (the others ran at once on the step's thread: ops the
  capture could not answer, ``.item()``);
* ``ratio``: the coexec steps' time over the eager steps' (the whole run: tracing included);
  ``ratio after warm-up``: over the steps after the first co-executed one;
* ``bit-equal``: losses and final parameters and optimizer state;
* with ``--memory-budget``: steps over it, plans made, the planner's seconds, and the seconds
  steps waited for plans (``TapeStats``).

``--backend native`` (or ``auto``, native on a CPU) runs the coexec copy on the native backend
(no traces: an op at a new size has its output metadata computed by the capture and goes to the
worker; the sizes seen come back from its cache).

Prints a Markdown table and writes ``dynamic_sizes.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import markdown_table, measure_each, prepare  # noqa: E402
from examples.dynamic_programs import DYNAMIC_BY_NAME, DYNAMIC_PROGRAMS  # noqa: E402
from executor import native  # noqa: E402
from tests.coexec.helpers import as_float, tensors_of  # noqa: E402


class _OwnRNG:
    """A program copy's own torch RNG state: swapped in around each of its steps, so the eager
    and the coexec copy can take turns step by step and still draw what each would alone."""

    def __init__(self) -> None:
        self.state = torch.get_rng_state()

    def __enter__(self) -> None:
        self.outer = torch.get_rng_state()
        torch.set_rng_state(self.state)

    def __exit__(self, *exc: object) -> None:
        self.state = torch.get_rng_state()
        torch.set_rng_state(self.outer)


class Pair:
    """An eager copy and a coexec copy of a program from one seed that take turns step by step,
    each under its own RNG state; their losses and each step's time."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.eager, self.eager_rng = make(), _OwnRNG()
        self.co, self.co_rng = make(), _OwnRNG()
        self.eager_losses: list[float] = []
        self.co_losses: list[float] = []
        self.eager_t: list[float] = []
        self.co_t: list[float] = []

    def step(self, i: int, tape: coexec.GradientTape) -> None:
        with self.eager_rng:
            t0 = time.perf_counter()
            self.eager_losses.append(as_float(self.eager.step(i)))
            self.eager_t.append(time.perf_counter() - t0)
        with self.co_rng:
            t0 = time.perf_counter()
            with tape:
                loss = self.co.step(i)
            self.co_t.append(time.perf_counter() - t0)
        self.co_losses.append(as_float(loss))

    def same(self) -> bool:
        """Bit-equal losses, parameters and optimizer state."""
        return self.co_losses == self.eager_losses and all(
            torch.equal(a, b) for a, b in zip(tensors_of(vars(self.co)), tensors_of(vars(self.eager)))
        )

    def ratio(self, start: int, stop: int | None = None) -> float:
        """The coexec steps' time over the eager ones', from step ``start`` (to ``stop``)."""
        co, eager = self.co_t[start:stop], self.eager_t[start:stop]
        return sum(co) / sum(eager) if co else float("nan")


def measure(program: type, steps: int, backend: str = "interpret", budget: str | None = None) -> dict:
    pair = Pair(lambda: program(0))
    tape = coexec.GradientTape(key=("dynamic-sizes", program.name, backend), backend=backend, memory_budget=budget)
    first_coexec, worker_ops, ops = None, 0, 0
    for i in range(steps):
        before = tape.stats.coexec_steps
        pair.step(i, tape)
        if first_coexec is None and tape.stats.coexec_steps > before:
            first_coexec = i
        elif first_coexec is not None and tape.backend == "native":
            worker_ops += tape.stats.native_ops
            ops += tape.stats.last_ops
    s = tape.stats
    warm = first_coexec + 1 if first_coexec is not None else steps
    after = steps - first_coexec if first_coexec is not None else 0
    row = {
        "program": program.name,
        "steps": steps,
        "traces": s.traces,
        "fallbacks": s.fallbacks,
        "coexec steps": s.coexec_steps,
        "warm-up": first_coexec if first_coexec is not None else steps,
        "co-executed after warm-up %": 100.0 * s.coexec_steps / after if after else 0.0,
        "phase": s.phase,
    }
    if tape.backend == "native":
        row["ops on the worker after warm-up %"] = 100.0 * worker_ops / ops if ops else 0.0
    if budget is not None:
        row.update({
            "steps over budget": s.over_budget_steps,
            "plans": s.plans_made,
            "planning s": s.planning_seconds,
            "waited for plans s": s.plan_wait_seconds,
        })  # fmt: skip
    row.update({
        "eager s": sum(pair.eager_t),
        "coexec s": sum(pair.co_t),
        "ratio": pair.ratio(0),
        "ratio after warm-up": pair.ratio(warm),
        "bit-equal": pair.same(),
    })  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default=",".join(p.name for p in DYNAMIC_PROGRAMS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    ap.add_argument("--backend", default="interpret", choices=coexec.tape.BACKENDS)
    ap.add_argument("--memory-budget", help="the coexec copy's memory_budget (e.g. 100KB)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    prepare(args.threads)
    if args.backend != "interpret":  # ("auto" runs native once the module is built)
        if native.wait() is None and args.backend == "native":
            raise SystemExit("the native module is not available")
    table = markdown_table(
        measure_each(args.programs, lambda name: measure(DYNAMIC_BY_NAME[name], args.steps, args.backend, args.memory_budget))
    )
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dynamic_sizes.md").write_text(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s)\n\n"
        f"`python bench/dynamic_sizes.py --steps {args.steps} --backend {args.backend}"
        f"{' --memory-budget ' + args.memory_budget if args.memory_budget else ''}`\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
