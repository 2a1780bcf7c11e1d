"""What planning tells the user when it cannot do what was asked."""

from __future__ import annotations


class InvalidPlan(ValueError):
    """A plan the executor must not run; the message says what is wrong."""


class BudgetTooSmall(ValueError):
    """No plan fits the budget; ``smallest`` is the lowest peak (bytes) any plan reaches."""

    def __init__(self, budget: int, smallest: int, detail: str = "") -> None:
        self.budget = budget
        self.smallest = smallest
        self.detail = detail
        super().__init__(
            f"a memory budget of {format_bytes(budget)} ({budget} bytes) cannot be met: the "
            f"smallest feasible budget for this step is {format_bytes(smallest)} ({smallest} bytes)"
            + (f"; {detail}" if detail else "")
        )

    def __reduce__(self) -> tuple:
        return BudgetTooSmall, (self.budget, self.smallest, self.detail)


# with offloading, the floor a BudgetTooSmall names rests on measured times: say so
OFFLOAD_FLOOR_NOTE = (
    "with offloading, the smallest budget moves slightly with the op and copy times each run "
    "measures (a copy window may span one op more or less): leave some headroom"
)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
