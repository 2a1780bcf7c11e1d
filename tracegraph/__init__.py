"""Record PyTorch training steps and merge them into a TraceGraph (Terra §3.2).

>>> from tracegraph import TraceGraph, record
>>> graph = TraceGraph()
>>> for step in range(10):
...     with record() as trace:
...         train_step()              # ordinary eager PyTorch, unchanged
...     added = graph.merge(trace)    # True when the trace added nodes or edges
>>> graph.covers(trace)               # True when the trace is a path of the graph
>>> graph.switch_cases()              # Terra Algorithm 1
>>> graph.to_dot()                    # Graphviz text
"""

from .cases import Case, SwitchCase, select_cases
from .graph import Cursor, IncompleteTraceError, Merged, Node, NotCovered, Region, TraceGraph
from .reasons import FallbackReason, why_new
from .recorder import FETCH_CALLS, Recorder, RecordError, record
from .structure import Loop
from .summary import Summary, summarize
from .trace import Fetch, OpKey, OpRecord, Trace, Value

__all__ = [
    "Case", "Cursor", "FETCH_CALLS", "FallbackReason", "Fetch", "IncompleteTraceError", "Loop",
    "Merged", "Node", "NotCovered",
    "OpKey", "OpRecord", "RecordError", "Recorder", "Region", "Summary", "SwitchCase", "Trace",
    "TraceGraph", "Value", "record", "select_cases", "summarize", "why_new",
]  # fmt: skip
