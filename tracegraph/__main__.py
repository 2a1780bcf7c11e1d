"""``python -m tracegraph show SCRIPT[:FUNCTION]``: record N steps of a step function defined
in a script, print why each trace was new and what the TraceGraph looks like, and write it as
a Graphviz DOT file. ``python -m tracegraph show --record SCRIPT [--steps N] [-- ARGS]``: run a
training script as ``__main__`` and report, per ``coexec.GradientTape`` block and step, the
phase and why it fell back or made a new trace."""

from __future__ import annotations

import argparse
import os
import random
import runpy
import sys

from .summary import summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracegraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="record N steps of a step function and summarise them")
    show.add_argument("target", help="SCRIPT.py[:FUNCTION]; FUNCTION defaults to train_step")
    show.add_argument(
        "-n", "--steps", type=int, default=None,
        help="steps to record (default 10); with --record: stop the script after N steps",
    )  # fmt: skip
    show.add_argument(
        "--record", action="store_true",
        help="run SCRIPT as __main__ (arguments after --) and watch its coexec.GradientTape "
        "blocks: per with statement and step, the phase and why it fell back or was new",
    )  # fmt: skip
    show.add_argument("-o", "--dot", help="DOT output path (default: SCRIPT's name + .dot)")
    show.add_argument("--seed", type=int, default=0, help="seed for torch and random (default 0)")
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(script_args) - bool(script_args)])
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.record:
        return _record(parser, args.target, script_args, args.steps, args.seed)

    path, _, func_name = args.target.partition(":")
    func_name = func_name or "train_step"
    if not os.path.isfile(path):
        parser.error(f"no such script: {path}")
    import torch

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    namespace = runpy.run_path(path, run_name="__tracegraph__")
    fn = namespace.get(func_name)
    if not callable(fn):
        found = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_"))
        parser.error(f"{path} defines no function {func_name!r}; callables found: {', '.join(found)}")
    steps = args.steps or 10
    print(f"recording {steps} steps of {func_name} from {path}", flush=True)
    summary = summarize(fn, steps=steps)
    print(summary)
    dot_path = args.dot or os.path.splitext(os.path.basename(path))[0] + ".dot"
    with open(dot_path, "w") as f:
        f.write(summary.graph.to_dot())
    print(f"DOT written to {dot_path} (render: dot -Tsvg {dot_path} -o graph.svg)")
    return 0


def _record(
    parser: argparse.ArgumentParser, path: str, args: list[str], steps: int | None, seed: int
) -> int:
    from .watch import run_script

    if not os.path.isfile(path):
        parser.error(f"no such script: {path}")
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    limit = f", stopping after {steps} steps" if steps else ""
    print(f"running {path} as __main__, watching its coexec.GradientTape blocks{limit}", flush=True)
    watch = run_script(path, args, steps)
    print(watch.report())
    code = watch.exit_code
    return code if isinstance(code, int) else 0 if code is None else 1


if __name__ == "__main__":
    sys.exit(main())
