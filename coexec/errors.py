"""Errors coexec raises, besides the ones the user's own program raises."""

from executor import ExecutorDied, ExecutorError, ExecutorTimeout


class CoexecError(RuntimeError):
    """Base class of coexec's own errors."""


class CoexecUsageError(CoexecError):
    """The API was used in a way coexec does not support (nested tapes, another thread, ...)."""


class ValueLostError(CoexecError):
    """A placeholder's value was never computed: its step failed before the op ran."""


__all__ = [
    "CoexecError", "CoexecUsageError", "ExecutorDied", "ExecutorError", "ExecutorTimeout",
    "ValueLostError",
]  # fmt: skip
