"""Step time per mode, each mode in a fresh process of its own: the one fair speed comparison.

    python bench/fair_speed.py [--programs zoo,examples,dynamic | zoo:mlp,example:static_mlp,...]
                               [--modes eager,eager-malloc,coexec,compile,interpret] [--rounds 5]
                               [--steps 20] [--warmup 8] [--batch 16] [--threads 0]
                               [--out bench/out]

Every (program, mode) runs in its own ``python bench/fair_speed.py --child ...`` process: eager
with coexec never imported (the child checks ``sys.modules`` and says so in its result), coexec
(``GradientTape()``, the default backend), ``interpret`` (``GradientTape(backend="interpret")``)
``compile`` (each ``nn.Module`` attribute of the program ``torch.compile``d) and ``eager-malloc``
(eager, coexec not imported, with glibc's malloc thresholds set as a tape sets them, by the
environment: coexec/host_memory.py; how much of coexec's figure is that policy). In one process
the modes disturb each other: after captured steps, eager steps in the same process ran up to
2x slower (issue 52), so pairing in one process is for bit-equality only (DESIGN.md §6). The
modes are alternated: each round runs every mode once per program, in an order rotated from
round to round. A child takes ``--warmup`` steps (coexec: after its native module is loaded,
and until its steps co-execute), then times ``--steps`` steps, each from the ``with`` to its
end (the step's values computed), and reports their median.

Per program and mode the table gives the minimum and the median of the per-process medians
over the rounds, and their spread ((max - min) / min); ``coexec/eager`` (and the others) is the
ratio of the minima, the figure issue 52 states its targets in; the geometric mean over the
programs closes the table. For the default backend, from its fastest process: ``skeleton ms``
(the median step less the step thread's waits for the worker: the Python and the capture's own
cost) and ``worker ms`` (the worker's time running ops), and ``overlap bound``, the larger of
the two over eager's minimum: the ratio a step would reach if the two overlapped perfectly and
never waited for each other, the ceiling with today's per-op costs.

Programs: ``zoo:NAME`` (examples/models, ``ZOO[NAME](batch)``), ``example:NAME``
(examples/programs.py, the demo's 14 programs) and ``dynamic:NAME``
(examples/dynamic_programs.py: sizes drawn per step, the same sequence in every mode); ``zoo``,
``examples`` and ``dynamic`` mean all of each. Writes the table and the raw per-process
figures (JSON) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "eager-malloc", "coexec", "interpret", "compile")


class Child(NamedTuple):
    """What one child process measured."""

    program: str
    mode: str
    median_ms: float
    step_ms: list[float]
    coexec_imported: bool
    phase: str  # (coexec modes: the phase the last step ran in; "" for the others)
    # (coexec: medians per step of the skeleton's own time, the step less its waits for the
    # worker, and of the worker's time running ops; 0 for the other modes)
    skeleton_ms: float = 0.0
    worker_ms: float = 0.0


# -- the child: one program, one mode -------------------------------------------------------


def _build(program: str, batch: int) -> tuple[Any, Any]:
    """The program and its step function ``step(i)``."""
    sys.path.insert(0, str(ROOT))
    kind, _, name = program.partition(":")
    if kind == "zoo":
        from examples.models import ZOO

        z = ZOO[name](batch)
        return z, lambda i: z.step()
    if kind == "example":
        from examples.programs import BY_NAME

        p = BY_NAME[name](0)
        return p, p.step
    if kind == "dynamic":
        from examples.dynamic_programs import DYNAMIC_BY_NAME

        p = DYNAMIC_BY_NAME[name](0)
        return p, p.step
    raise SystemExit(f"fair_speed: unknown program {program!r} (zoo:NAME, example:NAME or dynamic:NAME)")


def _compile_modules(obj: Any) -> None:
    """Each ``nn.Module`` attribute of ``obj`` (the program's models) replaced by its compiled
    self; a ``ModuleList`` or ``ModuleDict``, which the program iterates or indexes, has its
    entries compiled instead (a compiled container is neither)."""
    import torch

    for key, value in list(vars(obj).items()):
        if isinstance(value, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for name, sub in list(value.named_children()):
                value[int(name) if isinstance(value, torch.nn.ModuleList) else name] = torch.compile(sub)
        elif isinstance(value, torch.nn.Module):
            setattr(obj, key, torch.compile(value))


def child(program: str, mode: str, steps: int, warmup: int, batch: int, threads: int) -> Child:
    import torch

    if threads:
        torch.set_num_threads(threads)
    obj, step = _build(program, batch)
    tape = None
    if mode in ("coexec", "interpret"):
        import warnings

        import coexec
        from executor import native

        warnings.simplefilter("ignore", RuntimeWarning)
        native.wait()  # (steps run eagerly until the module is loaded: not what is measured)
        tape = coexec.GradientTape() if mode == "coexec" else coexec.GradientTape(backend="interpret")
    elif mode == "compile":
        _compile_modules(obj)
    elif mode not in ("eager", "eager-malloc"):
        raise SystemExit(f"fair_speed: unknown mode {mode!r} (one of {', '.join(MODES)})")

    def run(i: int) -> float:
        t0 = time.perf_counter()
        with tape if tape is not None else contextlib.nullcontext():
            loss = step(i)
        float(loss)  # (the loss read, as a training loop logs it: every mode pays the same read)
        return time.perf_counter() - t0

    i = 0
    for _ in range(warmup):
        run(i)
        i += 1
    if tape is not None:  # (until its steps co-execute: traces and the first captures excluded)
        for _ in range(50):
            if tape.stats.last_phase == "coexec":
                break
            run(i)
            i += 1
    times, skeleton, worker = [], [], []
    last = tape.stats if mode == "coexec" else None
    for _ in range(steps):
        times.append(run(i) * 1e3)
        i += 1
        if last is not None:  # (read between steps, outside the timed part)
            now = tape.stats
            skeleton.append(times[-1] - (now.stall_seconds - last.stall_seconds) * 1e3)
            worker.append((now.executor_seconds - last.executor_seconds) * 1e3)
            last = now
    phase = tape.stats.last_phase if tape is not None else ""
    parts = (statistics.median(skeleton), statistics.median(worker)) if skeleton else (0.0, 0.0)
    return Child(program, mode, statistics.median(times), times, "coexec" in sys.modules, phase, *parts)


# -- the parent: rounds of fresh processes ------------------------------------------------


def run_child(program: str, mode: str, args: argparse.Namespace) -> Child:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child", program, mode,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
        "--threads", str(args.threads),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if mode == "eager-malloc":
        from coexec.host_memory import ENVIRONMENT  # (the parent's import)

        env.update(ENVIRONMENT)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"fair_speed: {program} {mode} failed:\n{done.stderr[-3000:]}")
    return Child(**json.loads(done.stdout.strip().splitlines()[-1]))


def expand(programs: str, batch: int) -> list[str]:
    sys.path.insert(0, str(ROOT))
    out: list[str] = []
    for p in programs.split(","):
        if p == "zoo":
            from examples.models import ZOO

            out += [f"zoo:{n}" for n in ZOO]
        elif p == "examples":
            from examples.programs import PROGRAMS

            out += [f"example:{c.name}" for c in PROGRAMS]
        elif p == "dynamic":
            from examples.dynamic_programs import DYNAMIC_PROGRAMS

            out += [f"dynamic:{c.name}" for c in DYNAMIC_PROGRAMS]
        else:
            kind, _, name = p.partition(":")
            if kind == "zoo":
                from examples.models import ZOO

                known = list(ZOO)
            elif kind == "example":
                from examples.programs import BY_NAME

                known = list(BY_NAME)
            elif kind == "dynamic":
                from examples.dynamic_programs import DYNAMIC_BY_NAME

                known = list(DYNAMIC_BY_NAME)
            else:
                raise SystemExit(
                    f"fair_speed: unknown program {p!r} (zoo, examples, dynamic, zoo:NAME, example:NAME or dynamic:NAME)"
                )
            if name not in known:
                raise SystemExit(f"fair_speed: no {kind} program {name!r} (one of {', '.join(known)})")
            out.append(p)
    return out


def summarize(children: list[Child], programs: list[str], modes: list[str]) -> tuple[list[dict], dict[str, float]]:
    """A row per program: per mode the min and median of the per-process medians and their
    spread, and each mode's ratio of minima to eager's; the geometric means of the ratios."""
    rows, ratios, bounds = [], {m: [] for m in modes if m != "eager"}, []
    for p in programs:
        row: dict[str, Any] = {"program": p}
        best = {}
        for m in modes:
            meds = [c.median_ms for c in children if c.program == p and c.mode == m]
            if not meds:
                continue
            best[m] = min(meds)
            row[f"{m} min ms"] = min(meds)
            row[f"{m} median ms"] = statistics.median(meds)
            row[f"{m} spread"] = (max(meds) - min(meds)) / min(meds)
        for m in ratios:
            if m in best and "eager" in best:
                row[f"{m}/eager"] = best[m] / best["eager"]
                ratios[m].append(best[m] / best["eager"])
        captured = [c for c in children if c.program == p and c.mode == "coexec" and c.worker_ms > 0]
        if captured and "eager" in best:
            fastest = min(captured, key=lambda c: c.median_ms)
            row["skeleton ms"], row["worker ms"] = fastest.skeleton_ms, fastest.worker_ms
            row["overlap bound"] = max(fastest.skeleton_ms, fastest.worker_ms) / best["eager"]
            bounds.append(row["overlap bound"])
        rows.append(row)
    geo = {m: math.exp(statistics.fmean(math.log(r) for r in rs)) for m, rs in ratios.items() if rs}
    if bounds:
        geo["overlap bound"] = math.exp(statistics.fmean(math.log(b) for b in bounds))
    return rows, geo


def table(rows: list[dict], geo: dict[str, float]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |")
    def mean(c: str) -> str:
        key = c[:-6] if c.endswith("/eager") else c
        return _cell(geo[key]) if key in geo and (c.endswith("/eager") or c == "overlap bound") else ""

    lines.append("| geometric mean | " + " | ".join(mean(c) for c in cols[1:]) + " |")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("PROGRAM", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--programs", default="zoo,examples")
    ap.add_argument("--modes", default="eager,coexec")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = ap.parse_args()
    if args.child:
        c = child(*args.child, args.steps, args.warmup, args.batch, args.threads)
        print(json.dumps(c._asdict()))
        return
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"fair_speed: unknown mode {m!r} (one of {', '.join(MODES)})")
    if "eager" not in modes:
        modes.insert(0, "eager")
    programs = expand(args.programs, args.batch)
    children: list[Child] = []
    total, n = args.rounds * len(programs) * len(modes), 0
    for r in range(args.rounds):
        for p in programs:
            order = modes[r % len(modes):] + modes[: r % len(modes)]  # (rotated each round)
            for m in order:
                n += 1
                c = run_child(p, m, args)
                if m.startswith("eager") and c.coexec_imported:
                    raise RuntimeError(f"fair_speed: the eager child of {p} imported coexec")
                if m in ("coexec", "interpret") and c.phase != "coexec":
                    print(f"  note: {p} {m} round {r}: its last step ran in phase {c.phase!r}", file=sys.stderr)
                children.append(c)
                print(f"[{n}/{total}] round {r + 1} {p} {m}: {c.median_ms:.2f} ms", file=sys.stderr, flush=True)
    rows, geo = summarize(children, programs, modes)
    text = table(rows, geo)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cmd = "python bench/fair_speed.py " + " ".join(sys.argv[1:])
    (out / f"fair_speed_{stamp}.md").write_text(f"`{cmd}`\n\n{text}\n")
    (out / f"fair_speed_{stamp}.json").write_text(json.dumps([c._asdict() for c in children], indent=1))


if __name__ == "__main__":
    main()
