"""What a skeleton that intercepts ATen ops in C++ would cost, and what running its ops on a C++
worker thread would give: a probe for issue 16's deliverable 2, not part of coexec.

    python bench/native_skeleton_floor.py [--models mlp,gpt2-6l,resnet18] [--batch 16] [--repeats 20]
                                          [--steps 8] [--programs] [--dynamic]

``bench/native_placeholder.cpp`` (built here at first use with ``torch.utils.cpp_extension``,
about a minute) makes placeholders TensorImpls without storage under the PrivateUse3 dispatch
key, reporting the CPU as their device, and answers every op on them with one boxed C++ kernel:
output metadata from the op's meta kernel, or, once seen, from a cache keyed by the op and the
Python code location of the call; each op goes on a tape. Autograd, optimizers and modules run
above them unchanged, as over any backend. Three parts:

1. the skeleton alone (nothing computed): the tiny MLP of ``bench/skeleton_floor.py``
   (microseconds per ATen op) and the zoo models at ``--batch`` (milliseconds per step), with
   meta kernels and with the location cache, medians over ``--repeats`` blocks. Compare with
   the co-executed step of ``bench/skeleton_floor.py`` and the ``skeleton ms`` of
   ``bench/zoo_steps.py``;
2. the replay check: each zoo model trains 3 steps under the probe, and after each step its
   tape runs on real tensors below autograd, against an eager copy from the same seed: the
   largest difference in losses and parameters (0: the kernel saw every op eager runs, in an
   order that gives eager's values);
3. async: the probe captures every op of the step (its key in the thread's included dispatch
   keys, so ops on real tensors come to it too), a C++ worker without the GIL runs each op as
   it is taped, and an op the cache cannot answer runs at once on real tensors, as eager would;
   zoo models (and with ``--programs`` the 14 example programs, with ``--dynamic`` the 5
   programs of ``examples/dynamic_programs.py`` whose sizes change, for at least 30 steps)
   train ``--steps`` steps after 3 of warm-up, in turn with an eager copy: median step times, the median of the paired
   ratios, and the largest difference in losses, parameters and optimizer state. Compare with
   ``bench/zoo_steps.py`` and ``bench/coexec_steps.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import markdown_table
from skeleton_floor import make, per_call

from examples.dynamic_programs import DYNAMIC_PROGRAMS
from examples.models import ZOO
from examples.programs import PROGRAMS
from tests.coexec.helpers import tensors_of

_SOURCE = Path(__file__).resolve().parent / "native_placeholder.cpp"


def build():
    print("building bench/native_placeholder.cpp (cached after the first time) ...", flush=True)
    return cpp_extension.load(
        "coexec_native_placeholder_probe", [str(_SOURCE)], extra_cflags=["-O2"]
    )


def fed(native, name: str, batch: int):
    """The zoo model ``name`` whose batch is placeholders (its ``step()`` then runs on them)."""
    zoo = ZOO[name](batch)
    zoo.inputs = tuple(native.placeholder_like(t) for t in zoo.inputs)
    return zoo


def kernel_us(before: dict, after: dict) -> float:
    """Microseconds per op spent in the probe's kernel between two ``counters()``."""
    return (after["kernel_ns"] - before["kernel_ns"]) / 1e3 / (after["ops"] - before["ops"])


def replay_check(native, name: str, batch: int, steps: int = 3) -> dict:
    """Train ``name`` eagerly and under the probe from one seed; after each probe step run its
    tape on real tensors (``replay``): same losses and parameters, bit for bit?"""
    eager = ZOO[name](batch)
    native.reset(True, "replay")
    probed = fed(native, name, batch)
    diff, ops = 0.0, 0
    for i in range(steps):
        torch.manual_seed(100 + i)
        want = eager.step()
        torch.manual_seed(100 + i)
        loss = probed.step()
        ops = native.replay()
        native.end_step()
        diff = max(diff, _diff(want, loss, native))
    for a, b in zip(eager.model.parameters(), probed.model.parameters()):
        diff = max(diff, _diff(a, b, native))
    native.reset(True, "tape")
    return {"model": name, "steps": steps, "ops replayed per step": ops, "max |diff|": f"{diff:g}"}


def async_run(native, name: str, make, step, steps: int, warm: int = 3) -> dict:
    """Train ``make()`` eagerly and in the probe's async mode, capturing every op of the step
    (a C++ worker runs each op as the kernel tapes it; an op the cache cannot answer runs at
    once), a step of each in turn from the same seeds, every async step ending with a wait for
    its worker: step times after ``warm`` steps, and whether losses, parameters and optimizer
    state are bit-equal. ``step(state, i)`` runs step ``i`` and returns its loss."""
    eager, lazy = make(), make()
    native.reset(True, "async")
    diff, ratios, te, ta = 0.0, [], [], []
    row = {"program": name}
    try:
        for i in range(warm + steps):
            torch.manual_seed(100 + i)
            t0 = time.perf_counter()
            want = step(eager, i)
            t1 = time.perf_counter()
            torch.manual_seed(100 + i)
            run_now = native.counters()["run_now"]
            t2 = time.perf_counter()
            native.begin_step()
            try:
                with DataAccess(native):
                    loss = step(lazy, i)
            finally:
                native.end_step()
            t3 = time.perf_counter()
            diff = max(diff, _diff(want, loss, native))
            if i >= warm:
                te.append(t1 - t0)
                ta.append(t3 - t2)
                ratios.append((t3 - t2) / (t1 - t0))
    except Exception as e:  # noqa: BLE001  (what the probe cannot run yet: say what)
        native.end_step()
        native.reset(True, "tape")
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        return row
    run_now = native.counters()["run_now"] - run_now
    for a, b in zip(tensors_of(eager), tensors_of(lazy)):
        diff = max(diff, _diff(a, b, native))
    native.reset(True, "tape")
    row.update({
        "eager ms": statistics.median(te) * 1e3,
        "async ms": statistics.median(ta) * 1e3,
        "async/eager": statistics.median(ratios),
        "ops run at once, last step": run_now,
        "max |diff|": f"{diff:g}",
    })  # fmt: skip
    return row


class DataAccess:
    """What reads a tensor's memory without the dispatcher (``.numpy()``, ``.tolist()``,
    ``__array__``) reads a placeholder's value, while a step is captured: coexec keeps such a
    table of entry points (``_DATA_ACCESS``); without it they fail on a placeholder."""

    METHODS = ("numpy", "tolist", "__array__")

    def __init__(self, native) -> None:
        self.native = native
        self.saved = {}

    def __enter__(self) -> None:
        native = self.native
        for name in self.METHODS:
            original = self.saved[name] = getattr(torch.Tensor, name)

            def read(t, *args, _original=original, **kwargs):
                real = native.value(t) if native.is_placeholder(t) else t
                native.pause()  # (the method's own ops, a detach, run on the real tensor)
                try:
                    return _original(real, *args, **kwargs)
                finally:
                    native.resume()

            setattr(torch.Tensor, name, read)

    def __exit__(self, *exc) -> None:
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def _diff(a, b, native) -> float:
    a, b = (native.real_of(x) if isinstance(x, torch.Tensor) else torch.tensor(x) for x in (a, b))
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="mlp,gpt2-6l,resnet18")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8, help="measured steps of the async runs")
    ap.add_argument("--programs", action="store_true", help="also the 14 example programs, async")
    ap.add_argument(
        "--dynamic", action="store_true", help="also the 5 programs whose sizes change, async"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    native = build()
    print(f"the probe's kernel registered for {native.install()} ATen ops on PrivateUse3")
    models = args.models.split(",")

    # the tiny MLP: per op
    native.reset(True, "tape")
    eager = per_call(make(), args.repeats)
    step = make(native.placeholder_like)

    def probe() -> None:
        step()
        native.end_step()

    rows = []
    for use_cache in (False, True):
        native.reset(use_cache, "tape")
        probe()
        ops = native.counters()["ops"]
        before = native.counters()
        t = per_call(probe, args.repeats)
        name = "C++ placeholders, location cache" if use_cache else "C++ placeholders, meta kernels"
        rows.append({
            "step": name, "us/op": t / ops * 1e6, "x eager": t / eager,
            "of which in the kernel, us/op": kernel_us(before, native.counters()),
        })  # fmt: skip
    print(f"\ntiny MLP step, {ops} ATen ops under the probe, torch {torch.__version__}, 1 thread\n")
    print(markdown_table([{"step": "eager", "us/op": eager / ops * 1e6, "x eager": 1.0}, *rows]))

    # zoo models: per step
    table = []
    for name in models:
        eager_ms = per_call(ZOO[name](args.batch).step, max(3, args.repeats // 4), block=2) * 1e3
        row = {"model": name, "batch": args.batch, "eager ms": eager_ms}
        for use_cache in (False, True):
            native.reset(use_cache, "tape")
            probed = fed(native, name, args.batch)

            def run(s=probed.step) -> None:
                s()
                native.end_step()

            try:
                run()
            except Exception as e:  # noqa: BLE001  (an op the probe cannot answer: say which)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                break
            row["ops"] = native.counters()["ops"]
            ms = per_call(run, max(3, args.repeats // 4), block=2) * 1e3
            tag = "cached" if use_cache else "meta"
            if use_cache:  # a step after warm-up: every op answered from the cache? at what cost?
                before = native.counters()
                run()
                after = native.counters()
                row["cache misses per step"] = after["misses"] - before["misses"]
                row["kernel us/op"] = kernel_us(before, after)
            row[f"skeleton ms ({tag})"] = ms
            row[f"skeleton/eager ({tag})"] = ms / eager_ms
        table.append(row)
    print("\n" + markdown_table(table))
    checks = [replay_check(native, name, args.batch) for name in models]
    print("\nreplaying each probe step's tape on real tensors, against eager from the same seed:\n")
    print(markdown_table(checks))

    print(
        f"\nasync: a C++ worker runs the ops as they are taped; {args.steps} steps each, in turn with eager:\n"
    )
    runs = [
        async_run(native, n, lambda n=n: ZOO[n](args.batch), lambda z, i: z.step(), args.steps)
        for n in models
    ]
    programs = [(p, args.steps) for p in PROGRAMS] if args.programs else []
    if args.dynamic:  # sizes change from step to step (issue 17): each new size a miss at first
        programs += [(p, max(args.steps, 30)) for p in DYNAMIC_PROGRAMS]
    runs += [
        async_run(native, p.name, lambda p=p: p(0), lambda s, i: s.step(i), n) for p, n in programs
    ]
    print(markdown_table(runs))
    ratios = [r["async/eager"] for r in runs if "async/eager" in r]
    print(
        f"\nasync/eager: geometric mean {statistics.geometric_mean(ratios):.2f} over {len(ratios)} runs"
    )


if __name__ == "__main__":
    main()
