"""Shared by the benchmark scripts: the threads and warnings of a run, a row per model
measured, a Markdown table of them, pyplot if installed, and a random stream of its own per
copy of a model."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch


def prepare(threads: int) -> None:
    """``threads`` intra-op threads (0: torch's default); coexec's RuntimeWarnings (hints about
    traces and plans) kept out of the output."""
    if threads:
        torch.set_num_threads(threads)
    warnings.simplefilter("ignore", RuntimeWarning)


def measure_each(names: str, measure: Callable[[str], dict]) -> list[dict]:
    """``measure(name)`` for each of the comma-separated ``names``, saying on stderr which runs."""
    rows = []
    for name in names.split(","):
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(measure(name))
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table, a column per key any row has (blank where a row lacks it)."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = (r.get(c, "") for c in cols)
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells) + " |")
    return "\n".join(lines)


def write_table(rows: list[dict], name: str) -> str:
    """``rows`` as a markdown table, printed and written to ``bench/out/<name>.md``."""
    table = markdown_table(rows)
    print(table)
    out = Path(__file__).parent / "out" / f"{name}.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(table + "\n")
    return table


def pyplot():
    """``matplotlib.pyplot`` on a file backend, or None (with a hint) if it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return None
    return plt


class OwnRandomStream:
    """Each copy draws from its own copy of the default generators (CPU and, if any, the
    device's): copies trained side by side draw the same dropout masks."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.state = self._get()

    def _get(self) -> tuple:
        return torch.get_rng_state(), torch.cuda.get_rng_state() if self.cuda else None

    def _set(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1])

    def __call__(self, step):
        def run():
            outside = self._get()
            self._set(self.state)
            try:
                return step()
            finally:
                self.state = self._get()
                self._set(outside)

        return run
