"""Train one of the example programs, eagerly or with coexec.

    python examples/train.py --list
    python examples/train.py dcgan --steps 30            # plain PyTorch
    python examples/train.py dcgan --steps 30 --coexec   # the same script under coexec
    python examples/train.py dcgan --steps 30 --coexec --backend interpret   # traced, planned

With ``--coexec`` the training loop wraps each step in ``with tape:`` and prints the tape's
statistics at the end; ``--check`` also runs it eagerly from the same seed and compares losses
and final parameters bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import coexec  # noqa: E402
from examples.programs import BY_NAME  # noqa: E402


def train(
    name: str, steps: int, use_coexec: bool, seed: int = 0, quiet: bool = False, backend: str = "interpret"
):
    program = BY_NAME[name](seed)
    tape = coexec.GradientTape(key=(name, backend), backend=backend) if use_coexec else None
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        if tape is not None:
            with tape:
                loss = program.step(i)
        else:
            loss = program.step(i)
        losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))
        if not quiet and (i % 10 == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.6f}")
    seconds = time.perf_counter() - t0
    return program, losses, tape, seconds


def same_run(program, losses, other, other_losses) -> bool:
    """Bit-equal losses and final state."""
    return losses == other_losses and all(
        torch.equal(a, b) for a, b in zip(state_of(program), state_of(other))
    )


def state_of(program) -> list[torch.Tensor]:
    out = []
    for obj in vars(program).values():
        if isinstance(obj, torch.nn.Module):
            out.extend(obj.state_dict().values())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("program", nargs="?", help="program name (see --list)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--coexec", action="store_true", help="run the steps under coexec.GradientTape")
    ap.add_argument("--check", action="store_true", help="with --coexec: compare with eager")
    ap.add_argument(
        "--backend", default="auto", choices=coexec.tape.BACKENDS,
        help="with --coexec: GradientTape's backend (auto, the default: native on a CPU-only "
        "machine, where every op is answered in C++; interpret: traced into a TraceGraph)",
    )  # fmt: skip
    ap.add_argument("--list", action="store_true", help="list the programs")
    args = ap.parse_args()
    if args.list or not args.program:
        for name, cls in BY_NAME.items():
            print(f"{name:22s} {cls.description}")
        return 0
    if args.program not in BY_NAME:
        ap.error(f"unknown program {args.program!r}; one of: {', '.join(BY_NAME)}")
    if args.coexec and args.backend != "interpret":
        from executor import native

        native.wait()  # (its first build takes a minute; steps would run eagerly meanwhile)
    program, losses, tape, seconds = train(args.program, args.steps, args.coexec, args.seed, backend=args.backend)
    print(f"{args.steps} steps in {seconds:.2f} s ({f'coexec, {tape.backend}' if tape else 'eager'})")
    if tape is not None:
        print(tape.stats)
        if args.check:
            ref, ref_losses, _, _ = train(args.program, args.steps, False, args.seed, quiet=True)
            same = same_run(program, losses, ref, ref_losses)
            print("bit-equal to eager" if same else "DIFFERENT from eager")
            return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
