"""Record N steps of a step function and summarise the TraceGraph they build (a debugging aid,
also behind ``python -m tracegraph show``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .graph import TraceGraph
from .reasons import why_new
from .recorder import record

CONVERGED = 3  # covered steps in a row, up to the last, that make a step function converged


def converged_at(covered: list[bool], steps: list[int], need: int = CONVERGED) -> int | None:
    """The first step of the covered steps that end the run, if there are at least ``need``
    of them in a row (one covered step after new ones says little), else None."""
    k = len(covered)
    while k > 0 and covered[k - 1]:
        k -= 1
    return steps[k] if len(covered) - k >= need else None


@dataclass
class StepRecord:
    step: int
    ops: int
    externals: int
    fetches: int
    covered: bool  # the trace was already a path of the graph
    loops: int  # loop executions at the top level of the trace
    why: str | None = None  # why the trace was new (tracegraph.reasons); None when covered


@dataclass
class Summary:
    graph: TraceGraph
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def traces(self) -> int:
        """Traces that added to the graph: Terra's tracing phase lasts this many steps."""
        return sum(not s.covered for s in self.steps)

    @property
    def converged_at(self) -> int | None:
        """The first step from which every later trace was covered, when at least
        ``CONVERGED`` steps in a row were covered up to the last; else None."""
        return converged_at([s.covered for s in self.steps], [s.step for s in self.steps])

    def latest_reasons(self, n: int = 3) -> str:
        new = [s for s in self.steps if not s.covered][-n:]
        return "; ".join(f"step {s.step}: {s.why}" for s in new) or "none"

    def table(self) -> str:
        rows = [f"{'step':>5} {'ops':>7} {'feeds':>6} {'fetches':>8} {'loops':>6}  trace"]
        for s in self.steps:
            verdict = "covered" if s.covered else f"new -> merged: {s.why}"
            rows.append(f"{s.step:>5} {s.ops:>7} {s.externals:>6} {s.fetches:>8} {s.loops:>6}  {verdict}")
        return "\n".join(rows)

    def __str__(self) -> str:
        st = self.graph.stats()
        conv = self.converged_at
        conv_txt = (
            f"converged: every trace from step {conv} on was covered"
            if conv is not None
            else f"not converged after {len(self.steps)} steps (converged: {CONVERGED} covered "
            f"steps in a row at the end); reasons: {self.latest_reasons()}"
        )
        return "\n".join(
            [
                self.table(),
                f"new traces: {self.traces} of {len(self.steps)} steps; {conv_txt}",
                f"graph: {st['nodes']} op nodes, {st['loops']} loops, {st['edges']} edges, "
                f"{st['blocks']} basic blocks, {st['switches']} switches "
                f"({st['top_switches']} at top level, the rest in loop bodies), {st['feeds']} feeds, "
                f"{st['fetches']} fetch points",
            ]
        )


def summarize(
    step_fn: Callable[..., Any], steps: int = 10, graph: TraceGraph | None = None
) -> Summary:
    """Run ``step_fn`` ``steps`` times under :func:`record` and merge each trace (a covered
    trace adds nothing but its statistics: visits, trip counts). ``step_fn`` takes no argument
    or the step index."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    takes_step = _takes_one_arg(step_fn)
    graph = graph if graph is not None else TraceGraph()
    summary = Summary(graph)
    for i in range(steps):
        with record() as trace:
            step_fn(i) if takes_step else step_fn()
        why = why_new(graph, trace)
        covered = not graph.merge(trace)
        summary.steps.append(
            StepRecord(
                step=i,
                ops=len(trace.ops),
                externals=len(trace.externals),
                fetches=len(trace.fetches) + sum(op.python_result for op in trace.ops),
                covered=covered,
                loops=sum(1 for it in trace.items if hasattr(it, "iterations")),
                why=None if why is None else why.message,
            )
        )
    return summary


def _takes_one_arg(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(positional) == 1
