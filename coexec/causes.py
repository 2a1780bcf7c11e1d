"""What to tell a user whose step keeps making new traces (issue 14): the likely cause, read
from the categories of the latest reasons (``tracegraph.reasons``), and what to change."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tracegraph.reasons import FallbackReason

# reason category -> the cause it points to
_GROUP = {
    "shape": "sizes",
    "scalar": "scalars",
    "tensor": "tensors",
    "control flow": "control flow",
    "new op": "control flow",
    "loop": "control flow",
    "dataflow": "control flow",
    "argument": "control flow",
}
ADVICE = {
    "sizes": "sizes that vary in ways one graph does not follow (a tensor's rank, the length of a "
    "list of tensors): pad or bucket the inputs to a few shapes, or use a fixed batch size "
    "(DataLoader(..., drop_last=True))",
    "scalars": "Python scalars that vary: pass them as 0-d tensors (e.g. the learning rate as "
    "torch.tensor(lr)) or keep them constant",
    "tensors": "inputs whose dtype, device or requires_grad vary: give the step inputs of one kind",
    "control flow": "control flow that varies: the number of distinct paths exceeds max_traces; "
    "raise max_traces or move the varying part out of the step",
}


def likely_causes(reasons: Sequence[FallbackReason]) -> list[str]:
    """The causes the reasons point to, most frequent first, each with its advice and how many
    of the reasons point to it; empty when none says (a first trace, a runtime reason)."""
    groups = Counter(_GROUP[r.category] for r in reasons if r.category in _GROUP)
    total = sum(groups.values())
    return [f"{ADVICE[g]} ({n} of the latest {total} reasons)" for g, n in groups.most_common()]


def max_traces_message(
    where: str, traces: int, max_traces: int, latest: Sequence[tuple[int, FallbackReason]]
) -> str:
    """The warning when a program stops tracing: why, and the two most recent reasons."""
    head = (
        f"coexec: the step at {where} produced {traces} different traces "
        f"(max_traces={max_traces}); it runs eagerly from now on."
    )
    causes = likely_causes([r for _, r in latest])
    if causes:
        cause = " Likely cause: " + "; also ".join(causes) + "."
    else:
        cause = " Its control flow keeps changing; raise max_traces if it settles later."
    recent = "; ".join(f"step {k}: {r.message}" for k, r in latest[-2:])
    return head + cause + (f" Most recent: {recent}." if recent else "")
