"""Which native-backend steps are traced, and their traces merged into the program's TraceGraph.

The native capture logs a step's ops only when asked before it (``Capture.trace_next``), so that
an untraced step pays one branch per op. A program's first steps are traced until the graph
covers three in a row. After that, a step that called an op from a line no traced step had
called one from (``Capture.lines``: a branch or code not seen in a traced step) may have gone
where the graph has not, and the steps after it are traced until one meets a line no traced
step had, or :data:`TRIES` were (the branch it took may be rare). Sizes and trip counts that
vary do not count: they are the graph's to generalise. A trace costs 5-100 ms of conversion
and merging on the step's thread (docs/coexec.md, *The native backend's TraceGraph*), so at
most :data:`FIRST` steps, then one in :data:`SHARE`, are traced, and none once ``max_traces``
traces changed the graph.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from tracegraph.from_capture import trace_of
from tracegraph.reasons import FallbackReason, why_new

if TYPE_CHECKING:
    from executor.capture import Capture
    from tracegraph import TraceGraph

COVERED_IN_A_ROW = 3  # traced steps the graph covers, in a row, before tracing stops
TRIES = 16  # traced steps that look for what an untraced step met
FIRST, SHARE = 16, 8  # steps traced at most: FIRST, then one in SHARE


class NativeTraces:
    """One program's tracing state (coexec/tape.py, ``_NativeStep``)."""

    def __init__(self) -> None:
        self.covered_in_a_row = 0
        self.looking = 0  # traced steps left to look for lines an untraced step met
        self.traced = 0  # steps traced
        self.steps = 0  # steps ended, traced or not
        self.merged = 0  # traces that changed the graph
        self.broken = ""  # why a trace could not be merged (then no step is traced again)

    def wants_trace(self, max_traces: int) -> bool:
        """Is the next step traced? Not once ``max_traces`` traces changed the graph (the
        tape's setting: a program whose every step is new would be traced at every step)."""
        if self.merged >= max_traces or self.broken:
            return False
        if self.covered_in_a_row < COVERED_IN_A_ROW:
            return True
        return self.looking > 0 and self.traced < FIRST + self.steps // SHARE

    def untraced(self, capture: Capture) -> bool:
        """An untraced step ended: did it call ops from lines no traced step had?"""
        self.steps += 1
        if capture.lines.untraced == 0:
            return False
        self.looking = TRIES
        return True

    def traced_step(
        self, capture: Capture, graph: TraceGraph, outside_loops: frozenset, failed: bool, explain: bool
    ) -> tuple[bool, FallbackReason | None, str]:
        """A traced step ended: its trace merged (unless it failed or its log was cut short).
        Returns (the graph changed, why the trace was new where ``explain``, why it was not
        merged or "")."""
        step = capture.take_trace()
        self.traced += 1
        self.steps += 1
        # (it met a line no traced step had: what was looked for, or something else new)
        self.looking = 0 if capture.lines.newly_traced else max(0, self.looking - 1)
        if failed:
            return False, None, "the step raised"
        if step.cut:
            return False, None, step.cut
        try:
            trace = trace_of(step, outside_loops)
            why = why_new(graph, trace) if explain else None
            changed = graph.merge_placed(trace).changed
        except Exception as e:  # noqa: BLE001 (a bug of ours: the step's values are eager's all the same)
            self.broken = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"coexec: a native step's trace could not be merged into its TraceGraph ({self.broken}); "
                "the program is not traced from now on (its steps run as before). Please report it.",
                RuntimeWarning,
                stacklevel=2,
            )
            return False, None, self.broken
        if changed:
            self.merged += 1
            self.covered_in_a_row = 0
        else:
            self.covered_in_a_row += 1
        return changed, why, ""
