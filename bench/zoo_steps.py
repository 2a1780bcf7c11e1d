"""Step time of the zoo under coexec against eager, on any device, paired in one process.

    python bench/zoo_steps.py [--models resnet50,gpt2-6l] [--batch 16] [--device cuda] [--pairs 10]
                              [--threads 1] [--deterministic] [--compile] [--native] [--out bench/out]

Per zoo model, copies from the same seed train side by side, each on its own random stream: one
eagerly, one under ``coexec.GradientTape(backend="interpret")`` (planned blocks
and, on a CPU, the arena), one under ``GradientTape(backend="interpret", arena=False)`` (no
plan: ops run as issued) and, with ``--compile``, one whose model is ``torch.compile``d (the
baseline users would pick instead), and with ``--native`` one under
``GradientTape(backend="native")`` (executor/capture.py; CPU only). After warm-up (coexec: until
it co-executes and its plan arrived) they take ``--pairs`` steps in turn; on a GPU every step
ends with ``torch.cuda.synchronize()``, so a step's time includes its kernels. Columns (medians
over the pairs):

* ``eager ms``; ``coexec/eager``, ``unplanned/eager``, ``compile/eager``: medians of the paired
  ratios;
* ``skeleton ms``: the co-executed step's time less the skeleton's waits on the executor (what
  running the user's Python costs under coexec); ``skeleton/eager``: that over the eager step
  (issue 16 asks for at most 0.5);
* ``stall ms``: the skeleton waiting on the executor (fetches and the end of the step); and
  both for the copy without a plan (``unplanned skeleton ms``, ``unplanned stall ms``);
* ``native/eager``, ``native skeleton/eager``, ``native max |diff|`` (with ``--native``): the
  same for the native backend; ``eager faults``, ``native faults``: minor page faults a step
  (medians; the worker's included);
* ``native ops``, ``gradient blocks``, ``templated calls``: of the latest co-executed step;
* ``max |diff|``: the largest difference between the eager and coexec copies' parameters and
  losses after the run (0: bit-equal).

Prints a Markdown table and the geometric means, and writes ``zoo_steps_<device>_b<batch>.md``
to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coexec  # noqa: E402
from common import OwnRandomStream, markdown_table  # noqa: E402
from examples.models import ZOO, ZooModel  # noqa: E402


def on_device(zoo: ZooModel, device: torch.device) -> ZooModel:
    """The zoo model on ``device``: its parameters move in place (the optimizer keeps them)."""
    zoo.model.to(device)
    zoo.inputs = tuple(t.to(device) for t in zoo.inputs)
    return zoo


def synchronized(step, device: torch.device):
    if device.type != "cuda":
        return step

    def run():
        out = step()
        torch.cuda.synchronize(device)
        return out

    return run


def minor_faults() -> int:
    """The process's minor page faults so far (every thread's: the native worker's too)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(step) -> tuple[float, torch.Tensor, int]:
    """A step's time, its result and the page faults taken while it ran."""
    f0, t0 = minor_faults(), time.perf_counter()
    out = step()
    return time.perf_counter() - t0, out, minor_faults() - f0


def measure(
    name: str, batch: int, device: torch.device, pairs: int, compile_too: bool, native_too: bool = False
) -> dict:
    eager, co, loose = (on_device(ZOO[name](batch), device) for _ in range(3))
    tape = coexec.GradientTape(backend="interpret", key=("zoo-steps", name, batch, str(device)))
    loose_tape = coexec.GradientTape(
        backend="interpret", key=("zoo-steps", name, batch, str(device), "unplanned"), arena=False
    )

    def coexec_step() -> torch.Tensor:
        with tape:
            return co.step()

    def unplanned_step() -> torch.Tensor:
        with loose_tape:
            return loose.step()

    steps = {
        "eager": eager.step,
        "coexec": coexec_step,
        "unplanned": unplanned_step,
    }
    if native_too:
        captured = on_device(ZOO[name](batch), device)
        native_tape = coexec.GradientTape(key=("zoo-steps", name, batch, str(device), "native"), backend="native")

        def native_step() -> torch.Tensor:
            with native_tape:
                return captured.step()

        steps["native"] = native_step
    if compile_too:
        compiled = on_device(ZOO[name](batch), device)
        compiled.model = torch.compile(compiled.model)
        steps["compile"] = compiled.step
    steps = {k: synchronized(OwnRandomStream(device)(f), device) for k, f in steps.items()}
    losses: dict[str, list] = {k: [] for k in steps}
    for _ in range(3):  # traced, traced (momentum appears), covered
        for k, f in steps.items():
            losses[k].append(f())
    for _ in range(20):
        if tape.stats.phase == "coexec" and tape.stats.coexec_steps >= 2:
            break
        for k, f in steps.items():
            losses[k].append(f())
    if tape.stats.phase != "coexec":
        raise RuntimeError(f"{name} did not settle into co-execution: {tape.stats}")
    coexec.wait_for_plans()
    for k, f in steps.items():  # the first step on the plan
        losses[k].append(f())
    times: dict[str, list[float]] = {k: [] for k in steps}
    faults: dict[str, list[int]] = {k: [] for k in steps}
    busy, loose_busy, native_busy = [], [], []
    for _ in range(pairs):
        for k, f in steps.items():
            stall, loose_stall = tape.stats.stall_seconds, loose_tape.stats.stall_seconds
            native_stall = native_tape.stats.stall_seconds if native_too else 0.0
            t, loss, f_ = timed(f)
            times[k].append(t)
            faults[k].append(f_)
            losses[k].append(loss)
            if k == "coexec":
                busy.append(t - (tape.stats.stall_seconds - stall))
            elif k == "unplanned":
                loose_busy.append(t - (loose_tape.stats.stall_seconds - loose_stall))
            elif k == "native":
                native_busy.append(t - (native_tape.stats.stall_seconds - native_stall))
    e = times["eager"]
    s = tape.stats

    def diff(copy: str, model: torch.nn.Module) -> float:
        return max(
            max((a.float() - b.float()).abs().max().item() for a, b in zip(losses["eager"], losses[copy])),
            max(
                (a.float() - b.float()).abs().max().item() if a.is_floating_point() else float(not torch.equal(a, b))
                for a, b in zip(eager.model.state_dict().values(), model.state_dict().values())
            ),
        )

    row = {
        "model": name,
        "batch": batch,
        "ops": s.last_ops,
        "eager ms": 1e3 * statistics.median(e),
        "coexec/eager": statistics.median(c / x for c, x in zip(times["coexec"], e)),
        "unplanned/eager": statistics.median(u / x for u, x in zip(times["unplanned"], e)),
    }
    why = getattr(tape._program.gradient_blocks, "why_not", None)
    if why:
        print(f"{name}: backward() ran the autograd engine: {'; '.join(why.values())}", file=sys.stderr)
    if compile_too:
        row["compile/eager"] = statistics.median(c / x for c, x in zip(times["compile"], e))
    if native_too:
        row["native/eager"] = statistics.median(c / x for c, x in zip(times["native"], e))
        row["native skeleton/eager"] = statistics.median(b / x for b, x in zip(native_busy, e))
        row["native max |diff|"] = diff("native", captured.model)
        row["eager faults"] = statistics.median(faults["eager"])
        row["native faults"] = statistics.median(faults["native"])
    row.update({
        "skeleton ms": 1e3 * statistics.median(busy),
        "skeleton/eager": statistics.median(b / x for b, x in zip(busy, e)),
        "stall ms": 1e3 * statistics.median(c - b for c, b in zip(times["coexec"], busy)),
        "unplanned skeleton ms": 1e3 * statistics.median(loose_busy),
        "unplanned stall ms": 1e3 * statistics.median(u - b for u, b in zip(times["unplanned"], loose_busy)),
        "native ops": getattr(s, "native_ops", 0),  # (older checkouts: not counted)
        "gradient blocks": s.gradient_blocks,
        "templated calls": s.templated_calls,
        "max |diff|": diff("coexec", co.model),
    })  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pairs", type=int, default=10, help="steps of each copy, in turn")
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd copy")
    ap.add_argument("--native", action="store_true", help='also time GradientTape(backend="native")')
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument(
        "--deterministic", action="store_true",
        help="deterministic kernels (cuDNN, cuBLAS): on a GPU, eager runs twice alike only so",
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible to torch here")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    warnings.simplefilter("ignore", RuntimeWarning)
    from executor import native

    if native.enabled() and native.wait(600) is None:
        print("the native block runner is not built: the executor runs in Python", file=sys.stderr)
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", {torch.get_num_threads()} intra-op threads", flush=True)  # fmt: skip
    rows = []
    for name in args.models.split(","):
        if name not in ZOO:
            raise SystemExit(f"unknown model {name!r}; the zoo has {', '.join(ZOO)}")
        try:
            rows.append(measure(name, args.batch, device, args.pairs, args.compile, args.native))
        except Exception as e:  # noqa: BLE001 - one model's failure must not lose the others' rows
            traceback.print_exc(limit=-30)
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    if not rows:
        raise SystemExit("no model ran")
    lines = [markdown_table(rows), ""]
    for col in ("coexec/eager", "unplanned/eager", "compile/eager", "native/eager", "skeleton/eager",
                "native skeleton/eager"):  # fmt: skip
        if col in rows[0]:
            lines.append(f"{col}: geometric mean {statistics.geometric_mean([r[col] for r in rows]):.2f}")
    text = "\n".join(lines)
    print()
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"zoo_steps_{device.type}_b{args.batch}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
