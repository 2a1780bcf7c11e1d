"""Background execution of the ops the co-execution skeleton confirms (DESIGN.md §2, §5).

``Executor`` runs a stream of instructions on its own thread without autograd: it computes
each op on real tensors, keeps the values the skeleton still refers to, and reports errors and
progress back. It knows nothing of graphs or Python programs; ``coexec`` drives it.
"""

from .memory import LiveBytes, ResetPeak, laid_out, span_bytes
from .offload import HostPool, Offload, Prefetch, Wait, measure_bandwidth
from .remat import Drop, Restore
from .stream import Executor, ExecutorDied, ExecutorError, ExecutorTimeout, Free, FreeRange, Run, writes_in_place

__all__ = [
    "Drop", "Executor", "ExecutorDied", "ExecutorError", "ExecutorTimeout", "Free", "FreeRange",
    "HostPool", "LiveBytes", "Offload", "Prefetch", "ResetPeak", "Restore", "Run", "Wait",
    "laid_out", "measure_bandwidth", "span_bytes", "writes_in_place",
]  # fmt: skip
