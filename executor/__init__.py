"""Background execution of the ops the co-execution skeleton confirms (DESIGN.md §2, §5).

An executor runs a stream of instructions (a closed set, :data:`Instruction`) on its own
thread without autograd: it computes each op on real tensors, as it arrives or a block at a
time in the block's planned order (a ``planner.schedule.Block``, the only planner type it
reads), keeps the values the skeleton still refers to, and reports errors, progress and a
:class:`ExecutorStats` snapshot back. It knows nothing of graphs or Python programs;
``coexec`` drives it. Two run the same instructions with the same results:
:class:`NativeExecutor`, a C++ thread that never takes the GIL (steps without a memory budget,
once the native module is built), and :class:`Executor`, a Python thread (memory budgets:
recomputation and offloading; and until the native module is built).
"""

from . import native
from .engine import NativeExecutor, make_executor
from .guard import Cap
from .memory import LiveBytes, ResetPeak, laid_out, span_bytes
from .offload import HostPool, Offload, Prefetch, Wait, measure_bandwidth
from .remat import Drop, Restore
from .stream import (
    Executor, ExecutorDied, ExecutorError, ExecutorStats, ExecutorTimeout, Follow, Free, FreeRange,
    Instruction, Launch, Run, RunAhead, writes_in_place,
)  # fmt: skip

__all__ = [
    "Cap", "Drop", "Executor", "ExecutorDied", "ExecutorError", "ExecutorStats", "ExecutorTimeout",
    "Follow", "Free", "FreeRange", "HostPool", "Instruction", "Launch", "LiveBytes", "NativeExecutor", "Offload", "Prefetch",
    "ResetPeak", "Restore", "Run", "RunAhead", "Wait", "laid_out", "make_executor", "measure_bandwidth", "native", "span_bytes",
    "writes_in_place",
]  # fmt: skip
