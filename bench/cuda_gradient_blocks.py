"""Probe: do gradient blocks replay bit-equal to eager on this device? (a GPU question)

    python bench/cuda_gradient_blocks.py [--device cuda] [--steps 6] [--model mlp|gpt2-6l|resnet18] [--node-hook]

On an H200, backwards replayed as gradient blocks on CUDA once gave other values than eager
(``reached_leaves`` lost leaves whose autograd wrappers were re-made at a freed address; fixed,
and bit-equal on an H100 since). Blocks run on CUDA where ``coexec.gradients.BLOCK_DEVICES``
allows it (Python 3.12+, where the watch for Python inside the backward sees the engine's
device thread). Per step: whether a block was replayed, the loss, each parameter's gradient
right after ``backward()`` (fetched inside the step) and each parameter after the optimizer
step, against an eager copy from the same seed. ``--node-hook`` registers a hook on the loss's
autograd node every step: no block may be made and the hook must run every step. Run it under
``CUDA_LAUNCH_BLOCKING=1`` and ``COEXEC_NATIVE=0`` as well (bench/device_check.sh does): a
difference that goes away there is a race between threads or streams, not a wrong op.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

import coexec
import coexec.gradients


def mlp(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    x, y = torch.randn(32, 64, device=device), torch.randn(32, 1, device=device)
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), lambda: F.mse_loss(m(x), y)


def zoo(name: str, device: torch.device):
    from examples.models import ZOO

    z = ZOO[name](4)
    z.model.to(device)
    x, y = (t.to(device) for t in z.inputs)
    return z.model, z.optimizer, lambda: z.loss(z.model(x), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--node-hook", action="store_true", help="a hook on the loss's autograd node every step: no block may be made, the hook runs every step")  # fmt: skip
    args = ap.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    print("blocks allowed on", sorted(coexec.gradients.BLOCK_DEVICES), flush=True)
    from executor import native

    print(f"torch {torch.__version__}, device {device}, native engine: "
          f"{native.enabled() and native.wait(600) is not None}, "
          f"CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', '0')}", flush=True)  # fmt: skip
    make = mlp if args.model == "mlp" else (lambda d: zoo(args.model, d))
    me, oe, loss_e = make(device)
    mc, oc, loss_c = make(device)
    names = [n for n, _ in me.named_parameters()]
    tape = coexec.GradientTape(backend="interpret", arena=False)

    hooks = {"eager": 0, "coexec": 0}

    def step(model, opt, loss_fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One step; the loss and the gradients right after ``backward()``."""
        loss = loss_fn()
        if args.node_hook:
            who = "coexec" if model is mc else "eager"
            loss.grad_fn.register_prehook(lambda g: hooks.__setitem__(who, hooks[who] + 1))
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        return loss.detach(), grads

    for i in range(args.steps):
        le, ge = step(me, oe, loss_e)
        with tape:
            lc, gc = step(mc, oc, loss_c)
        s = tape.stats
        bad_g = [(n, (a.double() - b.double()).abs().max().item()) for n, a, b in zip(names, ge, gc) if not torch.equal(a, b)]
        bad_p = [
            (n, (a.double() - b.double()).abs().max().item())
            for (n, a), b in zip(me.named_parameters(), mc.parameters()) if not torch.equal(a, b)
        ]  # fmt: skip
        print(
            f"step {i}: {s.last_phase}, gradient blocks {s.gradient_blocks}, native ops {s.native_ops}, "
            f"loss equal {torch.equal(le, lc)} ({le.item():.6g} / {lc.item():.6g}); "
            f"gradients differing {len(bad_g)}/{len(names)} {bad_g[:3]}; parameters differing {len(bad_p)} {bad_p[:3]}",
            flush=True,
        )
    program = getattr(tape, "_program", None)
    print("why no block:", dict(program.gradient_blocks.why_not) if program is not None else "-")
    if args.node_hook:
        print(f"node hook runs: eager {hooks['eager']}, coexec {hooks['coexec']} of {args.steps} steps")


if __name__ == "__main__":
    main()
