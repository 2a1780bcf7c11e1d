"""Programs whose sizes change between steps (examples/dynamic_programs.py) under coexec.

    python bench/dynamic_sizes.py [--programs reinforce,detection_boxes] [--steps 60] [--backend native]
                                  [--out bench/out]

Per program, one instance trains eagerly and one under
``coexec.GradientTape(backend="interpret")`` from the same seed, each for ``--steps`` steps (the
eager run first, then the coexec run, each built just before it runs and timed as a whole).
Columns, the figures issue 17 asks for:

* ``traces``, ``fallbacks``, ``coexec steps``: from the tape's stats after the run;
* ``warm-up``: the steps before the first co-executed one; ``co-executed after warm-up %``:
  of the steps after it, the share that co-executed (issue 17 asks for at least 90%, with at
  most 4 traces);
* ``phase``: the program's phase at the end (``eager``: it gave up after ``max_traces``);
* ``ratio``: the coexec run's time over the eager run's (the whole run: tracing included);
* ``bit-equal``: losses and final parameters and optimizer state.

``--backend native`` runs the coexec copy under ``GradientTape(backend="native")`` (no traces:
a new size is a miss that runs at once, and the sizes seen come back from its cache).

Prints a Markdown table and writes ``dynamic_sizes.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import markdown_table, measure_each, prepare  # noqa: E402
from examples.dynamic_programs import DYNAMIC_BY_NAME, DYNAMIC_PROGRAMS  # noqa: E402
from executor import native  # noqa: E402
from tests.coexec.helpers import as_float, tensors_of  # noqa: E402


def measure(program: type, steps: int, backend: str = "interpret") -> dict:
    eager = program(0)  # (each built just before it runs: both start from the seed's RNG state)
    t0 = time.perf_counter()
    eager_losses = [as_float(eager.step(i)) for i in range(steps)]
    eager_s = time.perf_counter() - t0
    co = program(0)
    tape = coexec.GradientTape(key=("dynamic-sizes", program.name, backend), backend=backend)
    co_losses, first_coexec = [], None
    t0 = time.perf_counter()
    for i in range(steps):
        before = tape.stats.coexec_steps
        with tape:
            loss = co.step(i)
        co_losses.append(as_float(loss))
        if first_coexec is None and tape.stats.coexec_steps > before:
            first_coexec = i
    co_s = time.perf_counter() - t0
    s = tape.stats
    after = steps - first_coexec if first_coexec is not None else 0
    same = co_losses == eager_losses and all(
        torch.equal(a, b) for a, b in zip(tensors_of(vars(co)), tensors_of(vars(eager)))
    )
    return {
        "program": program.name,
        "steps": steps,
        "traces": s.traces,
        "fallbacks": s.fallbacks,
        "coexec steps": s.coexec_steps,
        "warm-up": first_coexec if first_coexec is not None else steps,
        "co-executed after warm-up %": 100.0 * s.coexec_steps / after if after else 0.0,
        "phase": s.phase,
        "eager s": eager_s,
        "coexec s": co_s,
        "ratio": co_s / eager_s,
        "bit-equal": same,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default=",".join(p.name for p in DYNAMIC_PROGRAMS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    ap.add_argument("--backend", default="interpret", choices=coexec.tape.BACKENDS)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    prepare(args.threads)
    if args.backend != "interpret":  # ("auto" runs native once the module is built)
        if native.wait() is None and args.backend == "native":
            raise SystemExit("the native module is not available")
    table = markdown_table(
        measure_each(args.programs, lambda name: measure(DYNAMIC_BY_NAME[name], args.steps, args.backend))
    )
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dynamic_sizes.md").write_text(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s)\n\n"
        f"`python bench/dynamic_sizes.py --steps {args.steps} --backend {args.backend}`\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
