"""coexec: imperative-symbolic co-execution for PyTorch training loops.

>>> tape = coexec.GradientTape()
>>> for x, y in loader:
...     with tape:
...         loss = loss_fn(model(x), y)
...         loss.backward()
...         optimizer.step()
...     print(loss.item())

By default (``backend="auto"``) a machine without a GPU runs the native backend: every ATen op
of the step is answered in C++ and computed on a C++ worker beside the Python. Otherwise (the
interpret backend) the step runs eagerly while it is traced; once its trace repeats, the Python
program runs as a skeleton and a background executor computes the ops on the planner's plans.
See the README and docs/coexec.md, *Two backends*.
"""

from .errors import (
    CoexecError,
    CoexecUsageError,
    ExecutorDied,
    ExecutorError,
    ExecutorTimeout,
    ValueLostError,
)
from planner import BudgetTooSmall

from .placeholder import Placeholder
from .planning import wait_for_plans
from .programs import set_max_programs
from .runtime import synchronize
from .tape import GradientTape, TapeStats

__version__ = "0.1.0.dev0"

__all__ = [
    "BudgetTooSmall", "CoexecError", "CoexecUsageError", "ExecutorDied", "ExecutorError", "ExecutorTimeout",
    "GradientTape", "Placeholder", "TapeStats", "ValueLostError", "set_max_programs", "synchronize",
    "wait_for_plans",
]  # fmt: skip
