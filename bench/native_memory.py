"""Peak memory of a training step under ``GradientTape(backend="native")`` against eager, on the
CPU: the most bytes of tensor memory live at once during the measured steps, above what was live
before them (parameters, optimizer state, the batch).

    python bench/native_memory.py [--models mlp,resnet18,gpt2-6l,lstm-lm] [--batch 16] [--steps 3]

The bytes are counted by wrapping the CPU allocator (``count_cpu_bytes`` in the native module,
``executor/native/cpu_bytes.h``): what tensors asked for, not what the process's allocator keeps
(its resident set moves with glibc's caching). Each model and mode runs in a fresh process: 3
warm-up steps (after which the native backend answers every op from its cache), then the peak
is reset and ``--steps`` steps run. The native backend frees a dead placeholder's value one
taped op later than eager would (on the worker), and its skeleton can run up to 8192 ops ahead
of the worker: this is what that costs at the step's peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, measure_each

_CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
import coexec
from executor import native
from examples.models import ZOO

name, batch, steps, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tape = coexec.GradientTape(backend="native")

def step():
    if mode == "native":
        with tape:
            return zoo.step()
    return zoo.step()

built = native.wait()
if built is None:
    sys.exit("the native module is not available")
built.count_cpu_bytes()
zoo = ZOO[name](batch)
for _ in range(3):
    step()
live_before, _ = built.cpu_bytes()
built.reset_cpu_peak()
for _ in range(steps):
    loss = step()
_, peak = built.cpu_bytes()
print(json.dumps({"peak": peak - live_before, "loss": float(loss)}))
"""


def run(name: str, batch: int, steps: int, mode: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, name, str(batch), str(steps), mode],
        capture_output=True, text=True, cwd=root, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{name} ({mode}) failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(name: str, batch: int, steps: int) -> dict:
    """A model's row: its peak eager and native, each in a process of its own."""
    eager = run(name, batch, steps, "eager")
    native = run(name, batch, steps, "native")
    return {
        "model": name,
        "eager peak MB": f"{eager['peak'] / 2**20:.1f}",
        "native peak MB": f"{native['peak'] / 2**20:.1f}",
        "native/eager": f"{native['peak'] / max(eager['peak'], 1):.2f}",
        "same loss": eager["loss"] == native["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,resnet18,gpt2-6l,lstm-lm")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rows = measure_each(args.models, lambda name: compare(name, args.batch, args.steps))
    print(
        f"torch {__import__('torch').__version__}, batch {args.batch}, {args.steps} measured "
        "steps after 3, the most tensor bytes live at once above those live before them"
    )
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
