"""Shared by the benchmark scripts: a Markdown table of result rows, and pyplot if installed."""

from __future__ import annotations


def markdown_table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(lines)


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
