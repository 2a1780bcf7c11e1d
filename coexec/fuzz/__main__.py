"""``python -m coexec.fuzz --programs N --steps S --seed K [--jobs J] [--features ...] [--backend B]``

Runs programs of seeds K..K+N-1, prints one line per program and a final table; exits 1 if any
program diverged or crashed under coexec only.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from functools import partial

from .runner import FuzzResult, run_program, run_quiet, shrink
from .spec import FEATURES


def results(
    seeds: Sequence[int],
    steps: int,
    features: tuple[str, ...] | None,
    jobs: int,
    backend: str = "interpret",
) -> Iterator[FuzzResult]:
    """Each seed's result, in seed order (in ``jobs`` spawned processes when ``jobs > 1``).
    Warnings are silenced: programs trip torch's (max_traces reached, scalar conversions)."""
    if jobs <= 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield from (run_program(s, steps, features, backend=backend) for s in seeds)
        return
    work = partial(run_quiet, steps=steps, features=features, backend=backend)
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        yield from pool.imap(work, seeds)


def line(n: int, total: int, r: FuzzResult) -> str:
    verdict = r.outcome if not r.failed else f"{r.outcome.upper()} at step {r.diverged_at}"
    return (
        f"[{n}/{total}] seed {r.seed}: {verdict}  traces {r.traces} fallbacks {r.fallbacks} "
        f"coexec {r.coexec_steps}/{r.steps}  eager {r.eager_seconds:.2f}s "
        f"coexec {r.coexec_seconds:.2f}s  {r.summary}"
    )


def table(done: list[FuzzResult], wall: float) -> str:
    """The final summary, then every failing seed with its step and error."""
    kinds = ("diverged", "coexec_crash", "both_crash")
    count = {k: sum(r.outcome == k for r in done) for k in kinds}
    rows = [
        ("programs", len(done)),
        ("steps", sum(r.steps for r in done)),
        ("divergences", count["diverged"]),
        ("crashes coexec-only", count["coexec_crash"]),
        ("crashes both (as eager)", count["both_crash"]),
        ("coexec steps", sum(r.coexec_steps for r in done)),
        ("fallbacks", sum(r.fallbacks for r in done)),
        ("eager seconds", f"{sum(r.eager_seconds for r in done):.1f}"),
        ("coexec seconds", f"{sum(r.coexec_seconds for r in done):.1f}"),
        ("wall seconds", f"{wall:.1f}"),
    ]
    out = [f"{name:<24} {value}" for name, value in rows]
    failed = [r for r in done if r.failed]
    if failed:
        out.append("")
        out.append("seed   outcome       step  what")
        for r in failed:
            out.append(f"{r.seed:<6} {r.outcome:<13} {r.diverged_at:<5} {r.detail}")
            out.append(f"{'':27}{r.summary}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coexec.fuzz", description=__doc__.split("\n")[2])
    ap.add_argument("--programs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="the first program's seed")
    ap.add_argument("--jobs", type=int, default=1, help="spawned worker processes")
    ap.add_argument(
        "--features", nargs="+", choices=FEATURES, metavar="F",
        help=f"use only these features (to shrink a failure): {' '.join(FEATURES)}",
    )  # fmt: skip
    ap.add_argument(
        "--shrink", action="store_true",
        help="for each failure, find a smallest --features set that still fails",
    )  # fmt: skip
    ap.add_argument(
        "--backend", choices=("auto", "interpret", "native"), default="auto",
        help="the GradientTape backend the coexec runs use (auto, the default, as GradientTape() "
        "picks it: native on a machine without a GPU unless the program's options need interpret)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    seeds = range(args.seed, args.seed + args.programs)
    features = tuple(args.features) if args.features else None
    start = time.perf_counter()
    done: list[FuzzResult] = []
    for r in results(seeds, args.steps, features, args.jobs, args.backend):
        done.append(r)
        print(line(len(done), len(seeds), r), flush=True)
    print()
    print(table(done, time.perf_counter() - start))
    if args.shrink:
        for r in (r for r in done if r.failed):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                feats, small = shrink(r.seed, args.steps, features, backend=args.backend)
            print(
                f"\nseed {r.seed} shrunk: {small.outcome} at step {small.diverged_at}: "
                f"{small.detail}\n  python -m coexec.fuzz --programs 1 --seed {r.seed} "
                f"--steps {args.steps} --backend {args.backend} --features {' '.join(sorted(feats))}"
            )
    return 1 if any(r.failed for r in done) else 0


if __name__ == "__main__":
    sys.exit(main())
