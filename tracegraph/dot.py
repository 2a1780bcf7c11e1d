"""Graphviz export of a TraceGraph, for debugging: ``dot -Tsvg graph.dot -o graph.svg``.

Nodes are coloured by basic block; loop bodies are drawn as clusters beside their loop node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .graph import Node, Region, TraceGraph

_PALETTE = ("#e8f1fb", "#fdf0e0", "#e9f7ea", "#f6e8f7", "#fbf8dc", "#e6f5f5", "#f7e6e6")


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _label(n: "Node") -> str:
    if n.kind in ("start", "end"):
        return n.kind
    if n.kind == "loop":
        trips = ", ".join(f"{k}x{v}" if v > 1 else str(k) for k, v in sorted(n.trips.items()))
        return f"loop #{n.id}\\n{_esc(n.location)}\\ntrips: {trips or '-'}"
    if n.kind == "label":
        return _esc(str(n.label))
    extra = []
    if n.promoted:
        extra.append(f"fed args {sorted(n.promoted)}")
    if n.fetches:
        extra.append("fetch: " + ",".join(sorted(k for k, _ in n.fetches)))
    tail = ("\\n" + _esc("; ".join(extra))) if extra else ""
    return f"#{n.id} {_esc(n.name)}\\n{_esc(n.location)}{tail}"


def _region(r: "Region", lines: list[str], indent: str) -> None:
    block_of: dict[int, int] = {}
    for i, sc in enumerate(r.switch_cases()):
        for j, c in enumerate(sc.cases):
            for n in c.block:
                block_of[n.id] = (i * 3 + j) % len(_PALETTE)
    for n in [r.start, *r.nodes, r.end]:
        if n.kind in ("start", "end"):
            attrs = 'shape=circle, style=filled, fillcolor="#444444", fontcolor=white, fontsize=9'
        elif n.kind == "loop":
            attrs = "shape=box3d"
        else:
            attrs = f'shape=box, style="rounded,filled", fillcolor="{_PALETTE[block_of.get(n.id, 0)]}"'
        lines.append(f'{indent}n{n.id} [label="{_label(n)}", {attrs}];')
    for u, v in r.edges():
        lines.append(f'{indent}n{u.id} -> n{v.id} [label="e{u.id}_{v.id}", fontsize=8];')
    for n in r.nodes:
        if n.body is not None:
            lines.append(f"{indent}subgraph cluster_{n.id} {{")
            lines.append(f'{indent}  label="body of loop #{n.id}"; style=dashed;')
            _region(n.body, lines, indent + "  ")
            lines.append(f"{indent}}}")
            lines.append(f"{indent}n{n.id} -> n{n.body.start.id} [style=dotted, arrowhead=none];")


def to_dot(graph: "TraceGraph") -> str:
    lines = ["digraph TraceGraph {", "  rankdir=TB; node [fontname=Helvetica, fontsize=10];"]
    _region(graph.root, lines, "  ")
    lines.append("}")
    return "\n".join(lines) + "\n"
