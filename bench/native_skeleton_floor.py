"""What a skeleton that intercepts ATen ops in C++ would cost: a probe for issue 16's
deliverable 2, not part of coexec.

    python bench/native_skeleton_floor.py [--models mlp,gpt2-6l,resnet18] [--batch 16] [--repeats 20]

``bench/native_placeholder.cpp`` (built here at first use with ``torch.utils.cpp_extension``,
about a minute) makes placeholders TensorImpls without storage under the PrivateUse1 dispatch
key, reporting the CPU as their device, and answers every op on them with one boxed C++ kernel:
output metadata from the op's meta kernel, or, once seen, from a cache keyed by the op and the
Python code location of the call; each op goes on a tape. Autograd, optimizers and modules run
above them unchanged, as over any backend. Nothing is computed: this is the skeleton alone,
what Python costs when every op is answered without Python.

Then each zoo model trains 3 steps under the probe, and after each step its tape runs on real
tensors below autograd (``replay``: an executor's job), against an eager copy from the same
seed: the largest difference in losses and parameters (0: the kernel saw every op eager runs,
in an order that gives eager's values).

Rows: the tiny MLP of ``bench/skeleton_floor.py`` (microseconds per ATen op) and zoo models at
``--batch`` (milliseconds per step), each as eager, the C++ placeholder skeleton with meta
kernels, and with the location cache, medians over ``--repeats`` blocks. Compare with the
co-executed step of ``bench/skeleton_floor.py`` and the ``skeleton ms`` of
``bench/zoo_steps.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skeleton_floor import make

from examples.models import ZOO

_SOURCE = Path(__file__).resolve().parent / "native_placeholder.cpp"


def build():
    print("building bench/native_placeholder.cpp (cached after the first time) ...", flush=True)
    return cpp_extension.load(
        "coexec_native_placeholder_probe", [str(_SOURCE)], extra_cflags=["-O2"]
    )


def per_block(fn, repeats: int, block: int = 10) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(block):
            fn()
        samples.append((time.perf_counter() - t0) / block)
    return statistics.median(samples)


def zoo_step(zoo, inputs):
    return lambda: _train_step(zoo, inputs)


def replay_check(native, name: str, batch: int, steps: int = 3) -> dict:
    """Train ``name`` eagerly and under the probe from one seed; after each probe step run its
    tape on real tensors (``replay``): same losses and parameters, bit for bit?"""
    eager, probed = ZOO[name](batch), ZOO[name](batch)
    native.reset(True, True)
    fed = tuple(native.placeholder_like(t) for t in probed.inputs)
    diff, ops = 0.0, 0
    for i in range(steps):
        torch.manual_seed(100 + i)
        want = eager.step()
        torch.manual_seed(100 + i)
        loss = _train_step(probed, fed)
        ops = native.replay()
        got = native.real_of(loss)
        diff = max(diff, (want - got).abs().max().item())
    for a, b in zip(eager.model.parameters(), probed.model.parameters()):
        diff = max(diff, (a - b).abs().max().item())
    native.reset(True, False)
    return {"model": name, "steps": steps, "ops replayed per step": ops, "max |diff|": diff}


def _train_step(zoo, inputs) -> torch.Tensor:
    out = zoo.model(inputs[0])
    loss = zoo.loss(out, inputs[1])
    loss.backward()
    zoo.optimizer.step()
    zoo.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="mlp,gpt2-6l,resnet18")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    native = build()
    print(f"the probe's kernel registered for {native.install()} ATen ops on PrivateUse1")
    ph = native.placeholder_like

    # the tiny MLP: per op
    step = make()
    native.reset(True, False)
    eager = per_block(step, args.repeats)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = ph(torch.randn(1, 8)), ph(torch.randn(1, 1))

    def probe() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        native.clear_tape()

    rows = []
    for use_cache in (False, True):
        native.reset(use_cache, False)
        probe()
        ops = native.counters()[0]
        t = per_block(probe, args.repeats)
        rows.append((use_cache, ops, t))
    ops = rows[0][1]
    print(f"\ntiny MLP step, {ops} ATen ops under the probe, torch {torch.__version__}, 1 thread\n")
    print("| step | us/op | x eager |\n|---|---|---|")
    print(f"| eager | {eager / ops * 1e6:.1f} | 1.0 |")
    for use_cache, _ops, t in rows:
        name = "C++ placeholders, location cache" if use_cache else "C++ placeholders, meta kernels"
        print(f"| {name} | {t / ops * 1e6:.1f} | {t / eager:.2f} |")

    # zoo models: per step
    table = []
    for name in args.models.split(","):
        zoo = ZOO[name](args.batch)
        eager_ms = per_block(zoo_step(zoo, zoo.inputs), max(3, args.repeats // 4), block=2) * 1e3
        fed = tuple(ph(t) for t in zoo.inputs)
        probe_step = zoo_step(ZOO[name](args.batch), fed)
        row = {"model": name, "batch": args.batch, "eager ms": eager_ms}
        for use_cache in (False, True):
            native.reset(use_cache, False)
            try:
                probe_step()
                native.clear_tape()
            except Exception as e:  # noqa: BLE001  (an op the probe cannot answer: say which)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                break
            n_ops = native.counters()[0]

            def run(s=probe_step) -> None:
                s()
                native.clear_tape()

            ms = per_block(run, max(3, args.repeats // 4), block=2) * 1e3
            tag = "cached" if use_cache else "meta"
            row["ops"] = n_ops
            if use_cache:  # a step after warm-up: every op answered from the cache?
                before = native.counters()[1]
                run()
                row["cache misses per step"] = native.counters()[1] - before
            row[f"skeleton ms ({tag})"] = ms
            row[f"skeleton/eager ({tag})"] = ms / eager_ms
        table.append(row)
    _print(table)
    checks = [replay_check(native, name, args.batch) for name in args.models.split(",")]
    print("\nreplaying each probe step's tape on real tensors, against eager from the same seed:")
    _print(checks)


def _print(table: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in table for k in r))
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in table:
        cells = [_cell(k, r.get(k, "")) for k in keys]
        print("| " + " | ".join(cells) + " |")


def _cell(key: str, v) -> str:
    if key == "max |diff|":
        return f"{v:g}"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
