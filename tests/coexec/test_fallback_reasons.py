"""Why a step keeps falling back (issue 14): ``tape.stats.fallback_reasons``, ``last_phase``,
``debug=True`` and the ``max_traces`` warning at the user's ``with`` line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import coexec

SOURCE = Path(__file__).read_text().splitlines()
_keys = itertools.count()


def at(mark: str) -> int:
    """The line of this file that carries the comment ``# mark``."""
    (n,) = [i + 1 for i, line in enumerate(SOURCE) if line.endswith(f"# {mark}")]
    return n


def sgd_step(w: torch.Tensor, x: torch.Tensor, lr: float) -> torch.Tensor:
    loss = (x @ w).pow(2).sum()
    loss.backward()
    with torch.no_grad():
        w.sub_(w.grad * lr)  # update
    w.grad = None
    return loss


def test_reasons_and_phases_of_a_scalar_that_varies(capsys):
    torch.manual_seed(0)
    w = torch.randn(4, 1, requires_grad=True)
    x = torch.randn(8, 4)
    tape = coexec.GradientTape(backend="interpret", key=("reasons", next(_keys)), debug=True)
    seen = []
    for lr in (0.1, 0.1, 0.2, 0.3):
        with tape:
            sgd_step(w, x, lr)
        seen.append((tape.stats.last_phase, tape.stats.phase))
    assert seen == [
        ("tracing", "tracing"), ("tracing", "coexec"), ("coexec", "coexec"), ("coexec", "coexec")
    ]
    scalar = (
        f"argument 1 (other) of aten::mul at test_fallback_reasons.py:{at('update')} was 0.2, "
        "the graph has 0.1 (a Python scalar that varies)"
    )
    stats = tape.stats
    assert stats.fallbacks == 1 and stats.last_fallback == scalar  # lr is fed from then on
    first = "step 0: the first trace: the graph was empty"
    assert stats.fallback_reasons == (first, f"step 2: {scalar}")
    err = capsys.readouterr().err
    assert "new trace: the first trace: the graph was empty" in err
    assert f"fell back to eager: {scalar}" in err


def shape_step(w: torch.Tensor, n: int) -> torch.Tensor:
    # n - 1 batch dimensions: a rank that varies is a new trace (sizes that vary at one rank
    # are one, from the second: tests/coexec/test_sizes_that_vary.py)
    x = torch.ones(*[2] * (n - 1), 4)  # batch
    loss = (x @ w).sum()
    loss.backward()
    w.grad = None
    return loss


def test_the_latest_ten_reasons_are_kept():
    w = torch.randn(4, 1, requires_grad=True)
    tape = coexec.GradientTape(backend="interpret", key=("reasons", next(_keys)), max_traces=100)
    for i in range(14):
        with tape:
            shape_step(w, 2 + i)
    stats = tape.stats
    assert (stats.traces, stats.last_phase, stats.phase) == (14, "tracing", "tracing")
    assert [r.split(":")[0] for r in stats.fallback_reasons] == [f"step {k}" for k in range(4, 14)]
    def size(rank: int) -> list[int]:
        return [2] * (rank - 1) + [4]

    assert stats.fallback_reasons[-1] == (
        f"step 13: argument 0 (size) of aten::ones at test_fallback_reasons.py:{at('batch')} was "
        f"{size(15)}, the graph has {size(12)}, {size(13)}, {size(14)} and 10 more (a rank that varies)"
    )


def branch_step(w: torch.Tensor, i: int) -> torch.Tensor:
    y = w * 1
    if i == 1:
        y = y.sin()
    if i == 2:
        y = y.cos()
    loss = y.sum()
    loss.backward()
    w.grad = None
    return loss


SIZES = (
    "sizes that vary in ways one graph does not follow (a tensor's rank, the length of a list of "
    "tensors): pad or bucket the inputs to a few shapes, or use a fixed batch size "
    "(DataLoader(..., drop_last=True)) (2 of the latest 2 reasons)"
)
SCALARS = (
    "Python scalars that vary: pass them as 0-d tensors (e.g. the learning rate as "
    "torch.tensor(lr)) or keep them constant (1 of the latest 1 reasons)"
)
CONTROL = (
    "control flow that varies: the number of distinct paths exceeds max_traces; raise "
    "max_traces or move the varying part out of the step (2 of the latest 2 reasons)"
)


@pytest.mark.parametrize(
    "step, max_traces, cause",
    [
        (lambda w, i: shape_step(w, 2 + i), 3, SIZES),
        (lambda w, i: sgd_step(w, torch.ones(8, 4), 0.1 * (i + 1)), 2, SCALARS),
        (branch_step, 3, CONTROL),
    ],
    ids=["sizes", "scalars", "control-flow"],
)
def test_max_traces_warns_at_the_with_line_with_the_likely_cause(step, max_traces, cause):
    w = torch.randn(4, 1, requires_grad=True)
    key = ("reasons", next(_keys))
    tape = coexec.GradientTape(backend="interpret", key=key, max_traces=max_traces)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on") as caught:
        for i in range(5):
            with tape:  # the with line
                step(w, i)
    (warning,) = [x for x in caught if "max_traces" in str(x.message)]
    assert (warning.filename, warning.lineno) == (__file__, at("the with line"))
    text = str(warning.message)
    assert f"produced {max_traces} different traces (max_traces={max_traces})" in text
    assert f"it runs eagerly from now on. Likely cause: {cause}. Most recent: step " in text
    reasons = tape.stats.fallback_reasons
    assert text.endswith(f"Most recent: {'; '.join(reasons[-2:])}.")
    assert tape.stats.phase == "eager" and tape.stats.last_phase == "eager"


def test_a_fallback_on_a_size_made_in_the_step_names_where_it_was_made():
    w = torch.ones(3, requires_grad=True)
    tape = coexec.GradientTape(backend="interpret", key=("reasons", next(_keys)))
    for i in range(4):
        x = torch.tensor([1.0, 0.0, 2.0]) if i < 3 else torch.tensor([1.0, 3.0, 2.0])
        with tape:
            idx = (x * w).nonzero()  # made
            loss = idx.sum()  # reads made
        assert float(loss) == float((x != 0).nonzero().sum())
    assert tape.stats.fallbacks == 1 and tape.stats.last_fallback == (
        f"tensor input 0 of aten::sum at test_fallback_reasons.py:{at('reads made')}, made by "
        f"aten::nonzero at test_fallback_reasons.py:{at('made')}, has shape [3, 1], the graph "
        "has [2, 1] (a size that varies)"
    )
