"""``python -m tracegraph show SCRIPT[:FUNCTION]``: record N steps of a step function defined
in a script, print what the TraceGraph looks like, and write it as a Graphviz DOT file."""

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
    show.add_argument("-n", "--steps", type=int, default=10, help="steps to record (default 10)")
    show.add_argument("-o", "--dot", help="DOT output path (default: SCRIPT's name + .dot)")
    show.add_argument("--seed", type=int, default=0, help="seed for torch and random (default 0)")
    args = parser.parse_args(argv)

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
    print(f"recording {args.steps} steps of {func_name} from {path}", flush=True)
    summary = summarize(fn, steps=args.steps)
    print(summary)
    dot_path = args.dot or os.path.splitext(os.path.basename(path))[0] + ".dot"
    with open(dot_path, "w") as f:
        f.write(summary.graph.to_dot())
    print(f"DOT written to {dot_path} (render: dot -Tsvg {dot_path} -o graph.svg)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
