"""The native backend's steps merge into the program's TraceGraph (coexec/native_traces.py,
tracegraph/from_capture.py): branches, loops and switch-cases from the capture's own log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from coexec.native_traces import COVERED_IN_A_ROW
from executor import native
from tests.coexec.helpers import assert_same_as_eager

pytestmark = pytest.mark.skipif(native.wait() is None, reason="the native module is not available")


def make():
    torch.manual_seed(0)
    return SimpleNamespace(
        inp=nn.Linear(8, 16),
        body=nn.Linear(16, 16),
        out=nn.Linear(16, 1),
        data=[(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)],
    )


def params(s):
    return (*s.inp.parameters(), *s.body.parameters(), *s.out.parameters())


def branch_and_loop(s, i):
    """A 3-way branch on the data (read with .item()) and a loop of 2, 3 or 4 trips."""
    x, y = s.data[i % 5]
    h = s.inp(x)
    pick = int(h.sum().item() * 1000) % 3
    if pick == 0:
        h = torch.sin(h)
    elif pick == 1:
        h = torch.cos(h) * 0.5
    else:
        h = torch.tanh(h) + 1.0
    for _ in range(2 + i % 3):
        h = torch.relu(s.body(h))
    return loss_and_update(s, s.out(h), y)


def picks(steps: int) -> list[tuple[int, int]]:
    """(branch, trips) per step, as eager takes them."""
    s, out = make(), []
    for i in range(steps):
        x, _ = s.data[i % 5]
        out.append((int(s.inp(x).sum().item() * 1000) % 3, 2 + i % 3))
        branch_and_loop(s, i)
    return out


def test_a_three_way_branch_and_a_loop_of_varying_trips_merge_into_one_graph_with_a_three_case_switch():
    steps = 15
    assert {b for b, _ in picks(steps)} == {0, 1, 2}  # (every branch is taken)
    tape = assert_same_as_eager(make, branch_and_loop, steps, backend="native")
    s, graph = tape.stats, tape.graph
    assert s.coexec_steps == steps and s.fallbacks == 0
    # the first trace (2 trips), the two other branches, and the third trip: the engine's
    # gradient accumulation into the loop's weight differs in a middle trip (an add, and no
    # AccumulateGrad yet), which only a loop of 3 trips or more has
    assert 3 <= s.traces <= 4, s.traces
    assert graph.traces >= s.traces
    assert max(len(c.cases) for c in graph.switch_cases()) == 3
    assert graph.stats()["loops"] >= 2  # the forward's loop and its gradient's, mirrored
    traces = tape._program.native_traces
    assert traces.covered_in_a_row >= COVERED_IN_A_ROW and traces.traced < steps


def static(s, i):
    x, y = s.data[i % 5]
    return static_rest(s, s.inp(x), y)


def test_a_static_program_makes_one_trace_and_is_traced_no_more_once_covered():
    steps = 12
    tape = assert_same_as_eager(make, static, steps, backend="native")
    traces = tape._program.native_traces
    assert tape.stats.traces == 1
    # traced until three in a row were covered; the untraced steps call ops from the lines the
    # traced ones did
    assert traces.traced == 1 + COVERED_IN_A_ROW, traces.traced
    assert traces.looking == 0
    names = [n.name for n in tape.graph.nodes() if n.kind == "op"]
    assert "aten::addmm" in names and "aten::threshold_backward" in names


def test_a_step_that_raises_is_not_merged():
    s = make()
    tape = coexec.GradientTape(backend="native", key="native-traces-raises")
    with pytest.raises(RuntimeError):
        with tape:
            h = s.inp(s.data[0][0])
            h @ torch.ones(3, 3)  # (sizes that do not match: raised at the step's end)
    assert tape.stats.traces == 0 and tape.graph.traces == 0
    with tape:
        static(s, 0)
    assert tape.stats.traces == 1


def test_a_new_branch_met_in_an_untraced_step_is_looked_for_in_the_steps_after_it():
    rare = 9  # the branch first taken at this step, after tracing stopped
    def step(s, i):
        x, y = s.data[i % 5]
        h = s.inp(x)
        h = torch.sin(h) if i % rare == rare - 1 else torch.relu(h)
        return static_rest(s, h, y)

    steps = 3 * rare
    tape = assert_same_as_eager(make, step, steps, backend="native")
    names = {n.name for n in tape.graph.nodes() if n.kind == "op"}
    assert "aten::sin" in names  # traced at its second or third taking
    assert tape.stats.traces == 2


def static_rest(s, h, y):
    return loss_and_update(s, s.out(torch.relu(s.body(h))), y)


def loss_and_update(s, out, y):
    """The loss, its backward and a plain SGD update (no optimizer state: one path per branch)."""
    loss = F.mse_loss(out, y)
    loss.backward()
    with torch.no_grad():
        for p in params(s):
            p.add_(p.grad, alpha=-1e-2)
            p.grad = None
    return loss.detach()


def test_a_traced_step_numbers_a_tensor_by_its_memory_not_its_object():
    """``torch.ones`` hands Python another TensorImpl over the memory its ``fill_`` wrote (a
    shallow copy, where anything else holds a reference to it): the op that reads it reads the
    fill_'s value, not a tensor from outside the step."""
    from coexec import runtime
    from tracegraph.from_capture import trace_of

    capture = runtime.claim_capture()
    try:
        capture.trace_next()
        with capture.step():
            x = torch.ones(8, 4)
            y = x * 2
        trace = trace_of(capture.take_trace())
    finally:
        runtime.release_capture()
    assert torch.equal(y, torch.full((8, 4), 2.0))
    fill, mul = trace.ops
    assert (fill.name, mul.name) == ("aten::fill_.Scalar", "aten::mul.Tensor")
    assert trace.values[mul.inputs[0]].producer == fill.index
    assert trace.externals == [fill.inputs[0], mul.inputs[1]]  # (empty's result, the wrapped 2)


def test_a_trace_that_cannot_be_merged_warns_and_leaves_the_steps_as_they_were(monkeypatch):
    from coexec import native_traces

    def broken(step, outside_loops):
        raise ValueError("no such op")

    monkeypatch.setattr(native_traces, "trace_of", broken)
    tape = coexec.GradientTape(backend="native", key="native-traces-broken")
    eager, taped = make(), make()
    with pytest.warns(RuntimeWarning, match=r"could not be merged .*ValueError: no such op.*not traced from now on"):
        for i in range(3):
            want = static(eager, i)
            with tape:
                got = static(taped, i)
            assert torch.equal(want, got)
    traces = tape._program.native_traces
    assert traces.traced == 1 and tape.stats.traces == 0 and not traces.wants_trace(10)
