"""Record N steps of a step function and summarise the TraceGraph they build (a debugging aid,
also behind ``python -m tracegraph show``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .graph import TraceGraph
from .recorder import record


@dataclass
class StepRecord:
    step: int
    ops: int
    externals: int
    fetches: int
    covered: bool  # the trace was already a path of the graph
    loops: int  # loop executions at the top level of the trace


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
        """The first step from which every later trace was covered, or None."""
        last_new = max((s.step for s in self.steps if not s.covered), default=None)
        if last_new is None:
            return self.steps[0].step if self.steps else None
        return last_new + 1 if last_new + 1 <= self.steps[-1].step else None

    def table(self) -> str:
        rows = [f"{'step':>5} {'ops':>7} {'feeds':>6} {'fetches':>8} {'loops':>6}  trace"]
        for s in self.steps:
            verdict = "covered" if s.covered else "new -> merged"
            rows.append(f"{s.step:>5} {s.ops:>7} {s.externals:>6} {s.fetches:>8} {s.loops:>6}  {verdict}")
        return "\n".join(rows)

    def __str__(self) -> str:
        st = self.graph.stats()
        conv = self.converged_at
        conv_txt = (
            f"converged: every trace from step {conv} on was covered"
            if conv is not None
            else "not converged: the last step still added to the graph"
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
        covered = not graph.merge(trace)
        summary.steps.append(
            StepRecord(
                step=i,
                ops=len(trace.ops),
                externals=len(trace.externals),
                fetches=len(trace.fetches) + sum(op.python_result for op in trace.ops),
                covered=covered,
                loops=sum(1 for it in trace.items if hasattr(it, "iterations")),
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
