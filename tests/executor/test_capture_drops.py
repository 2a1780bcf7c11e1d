"""Memory plans on the native capture (``native/capture_worker.h``, ``Drops``): values dropped
after an op and made again from their kept producer when read, bit-equal to eager whatever reads
them (the backward, Python, the step's end), whatever changes their inputs in place, and on a
step whose path leaves the plan's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coexec.native_budget import path_keys, plan_native_budget, plan_native_paths, planning_graph
from executor import native
from executor.capture import Capture
from executor.step_plans import DropPlan, StepDescription
from planner import ESCAPING, LOCAL, PERSISTENT, BudgetTooSmall, replay

pytestmark = pytest.mark.skipif(not native.enabled(), reason="capture runs on the native module")


def tanh_chain(x: torch.Tensor, w: torch.Tensor, depth: int = 4) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``depth`` layers of ``tanh(h @ w)``, the loss, and the activations."""
    hs, h = [], x
    for _ in range(depth):
        h = torch.tanh(h @ w)
        hs.append(h)
    return h.pow(2).mean(), hs


def described(capture: Capture, step, steps: int = 4) -> StepDescription:
    """Run ``step`` ``steps`` times captured, the last one described."""
    for i in range(steps):
        if i == steps - 1:
            capture.describe_next()
        with capture.step():
            step(i)
    return capture.description()


def drop_all_activations(d: StepDescription) -> DropPlan:
    """Every tanh's value kept and dropped right after the op that made it."""
    keep, after = set(), {}
    for o in d.ops:
        if o.name == "aten::tanh":
            for value, _ in o.values:
                keep.add(value)
                after.setdefault(o.place, []).append(value)
    assert keep, "no tanh in the description"
    sizes = {value: d.storage_bytes[sid] for o in d.ops for value, sid in o.values}
    return DropPlan(
        tuple(0 if o.at_once else o.op_id for o in d.ops), frozenset(keep),
        {p: tuple(v) for p, v in after.items()}, tuple(sizes.get(v, 0) for v in range(max(sizes) + 1)),
    )  # fmt: skip


def test_a_described_step_says_what_each_op_read_wrote_and_made() -> None:
    capture = Capture()
    w, x = torch.randn(6, 6), torch.randn(3, 6)

    def step(i: int) -> None:
        a = x @ w
        b = a.relu_()  # (in place: no new storage)
        c = b.t()  # (a view: the same storage)
        del a, b
        keep.append(c.sum())

    keep: list[torch.Tensor] = []
    d = described(capture, step)
    names = [o.name for o in d.ops]
    assert names == ["aten::mm", "aten::relu_", "aten::t", "aten::sum"]
    mm, relu, t, total = d.ops
    assert d.existed[mm.reads[0]] and d.existed[mm.reads[1]]  # x and w: from before the step
    (made,) = mm.makes
    assert relu.writes == (made,) and relu.makes == () and t.reads == (made,) and t.makes == ()
    assert d.storage_bytes[made] == 3 * 6 * 4
    assert total.values[0][0] in d.alive  # (the sum is kept)
    g = planning_graph(d)
    kinds = {s.sid: s.kind for s in g.storages.values()}
    assert kinds[mm.reads[0]] == PERSISTENT and kinds[made] == LOCAL and kinds[total.makes[0]] == ESCAPING
    assert g.preds[1] == {0} and 1 in g.preds[2]  # relu_ after mm; t after the write


def test_dropped_activations_are_made_again_for_the_backward_bit_equal() -> None:
    torch.manual_seed(0)
    w0, x = torch.randn(32, 32) * 0.3, torch.randn(16, 32)
    eager_w, w = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    capture = Capture()

    def step(weight: torch.Tensor) -> torch.Tensor:
        loss, _ = tanh_chain(x, weight)
        loss.backward()
        with torch.no_grad():
            weight -= 0.1 * weight.grad
        weight.grad = None
        return loss.detach()

    d = described(capture, lambda i: step(w))
    for _ in range(4):
        step(eager_w)
    capture.follow(drop_all_activations(d))
    before = capture.counters
    for i in range(4):
        want = step(eager_w)
        with capture.step():
            got = step(w)
        assert torch.equal(want, got) and torch.equal(eager_w, w), f"step {i}"
        assert capture.followed
    after = capture.counters
    assert after.dropped - before.dropped == 4 * 4 and after.remade - before.remade == 4 * 4
    assert after.remade_seconds > before.remade_seconds


def test_a_dropped_value_python_reads_or_keeps_is_made_again() -> None:
    """Read by ``numpy()`` after its drop, or alive at the step's end: its value is eager's."""
    torch.manual_seed(0)
    w, x = torch.randn(8, 8), torch.randn(4, 8)
    capture = Capture()
    kept: list[torch.Tensor] = []

    def step(i: int) -> None:
        _, hs = tanh_chain(x, w)
        if i >= 4:
            kept.append(torch.from_numpy(hs[1].numpy().copy()))
            kept.append(hs[2])

    d = described(capture, step)
    capture.follow(drop_all_activations(d))
    with capture.step():
        step(4)
    _, want = tanh_chain(x, w)
    assert torch.equal(kept[0], want[1]) and torch.equal(kept[1], want[2])
    assert capture.counters.remade >= 2


def test_an_input_changed_in_place_after_a_drop_makes_the_value_first() -> None:
    """``x.add_(1)`` after ``tanh(x)`` was dropped: the value is made from the ``x`` it was made
    of (before the write), as eager computed it."""
    torch.manual_seed(0)
    w = torch.randn(4, 8)
    capture = Capture()
    out: list[torch.Tensor] = []

    def step(i: int) -> None:
        x = w * (i + 1)
        h = torch.tanh(x)
        x.add_(1)  # (what h is made of changes after h was dropped)
        out.append((h * 2).sum() + x.sum())

    capture.follow(drop_all_activations(described(capture, step)))
    out.clear()
    with capture.step():
        step(5)
    x = w * 6
    want = (torch.tanh(x) * 2).sum() + (x + 1).sum()
    assert torch.equal(out[0], want) and capture.followed


def test_a_step_on_another_path_leaves_the_plan_bit_equal() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(8, 8), torch.randn(4, 8)
    capture = Capture()
    got: list[torch.Tensor] = []

    def step(i: int) -> None:
        loss, hs = tanh_chain(x, w, depth=4 if i < 4 else 2)  # (a shorter chain: another path)
        got.append(loss + hs[0].sum())

    d = described(capture, step)
    capture.follow(drop_all_activations(d))
    got.clear()
    before = capture.counters.dropped
    with capture.step():
        step(4)
    assert capture.counters.dropped - before == 2  # (the two tanh before the paths part)
    loss, hs = tanh_chain(x, w, depth=2)
    assert torch.equal(got[0], loss + hs[0].sum())
    assert not capture.followed


def test_a_step_larger_than_the_planned_one_stops_following_at_its_first_larger_value() -> None:
    """A plan's drops are chosen for the planned step's sizes: a step whose values are larger
    (more rows) stops following it at the first such value, and says so (``outgrew``: a budget's
    guard alone holds it, and the next step is described); a smaller step follows it to the end."""
    torch.manual_seed(0)
    w, xs = torch.randn(8, 8), {rows: torch.randn(rows, 8) for rows in (4, 8, 16)}
    capture = Capture()
    got: list[torch.Tensor] = []

    def step(rows: int) -> None:
        loss, hs = tanh_chain(xs[rows], w)
        got.append(loss + hs[0].sum())

    capture.follow(drop_all_activations(described(capture, lambda i: step(8))))
    for rows, follows, drops in ((16, False, 0), (4, True, 4), (8, True, 4)):
        got.clear()
        before = capture.counters.dropped
        with capture.step():
            step(rows)
        loss, hs = tanh_chain(xs[rows], w)
        assert torch.equal(got[0], loss + hs[0].sum()), rows
        assert (capture.followed, capture.outgrew) == (follows, not follows), rows
        assert capture.counters.dropped - before == drops, rows


def test_a_plan_for_a_budget_holds_the_step_within_it() -> None:
    """The planner's plan for the described step: a lower planned peak, and the peak the
    allocator counts in a step that follows it drops by what the plan says."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 64), torch.randn(256, 64)
    cpu = native.wait()
    cpu.count_cpu_bytes()
    capture = Capture()

    def step(i: int) -> None:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    def measured() -> int:
        opt.zero_grad()  # (outside the step: its peak counts only what it allocates)
        live = cpu.cpu_bytes()[0]
        cpu.reset_cpu_peak()
        with capture.step():
            step(0)
        return cpu.cpu_bytes()[1] - live

    d = described(capture, step)
    g = planning_graph(d)
    eager = replay(g, list(range(len(g))), check_order=False).peak
    with pytest.raises(BudgetTooSmall, match="smallest feasible budget") as small:
        plan_native_budget(d, g.persistent_bytes + 1)
    assert g.persistent_bytes < small.value.smallest < eager
    budget = (small.value.smallest + eager) // 2
    plan = plan_native_budget(d, budget)
    assert plan.eager_peak == eager and plan.planned_peak <= budget and plan.recomputed > 0
    unplanned = measured()
    capture.follow(plan.drops)
    planned = measured()
    assert capture.followed
    assert unplanned - planned >= eager - plan.planned_peak


def test_a_kernels_temporary_bytes_are_in_the_description() -> None:
    """With the CPU's bytes counted, each op's kernel's own temporary bytes (allocated and freed
    again on the worker: a convolution's columns) are described, and the planner counts them at
    the op: a plan without them let ResNet-50 exceed its budget by 0.5%."""
    native.wait().count_cpu_bytes()
    capture = Capture()
    x, w, m = torch.randn(4, 3, 32, 32), torch.randn(8, 3, 3, 3), torch.randn(16, 16)

    def step(i: int) -> None:
        torch.conv2d(x, w).sum()
        (m @ m).sum()

    d = described(capture, step)
    work = {o.name: o.workspace for o in d.ops}
    assert work["aten::convolution"] > 0 and work["aten::mm"] == 0
    g = planning_graph(d)
    conv = next(o.place for o in d.ops if o.name == "aten::convolution")
    assert g.ops[conv].workspace == work["aten::convolution"]


def _branchy(ws: list[torch.Tensor], x: torch.Tensor, i: int) -> torch.Tensor:
    """Three layers on odd steps, six on even ones (a branch): the paths share the first ops."""
    h = x
    for w in ws[: 3 if i % 2 else 6]:
        h = torch.tanh(h @ w)
    loss = h.pow(2).mean()
    loss.backward()
    return loss


def test_paths_share_keys_up_to_where_they_part() -> None:
    capture = Capture()
    ws = [torch.randn(32, 32, requires_grad=True) for _ in range(6)]
    x = torch.randn(16, 32)
    short, long = (described(capture, lambda i, p=p: _branchy(ws, x, i + p)) for p in (0, 1))
    assert len(short.ops) < len(long.ops)
    a, b = path_keys([short, long])
    common = next(j for j, (u, v) in enumerate(zip(a, b)) if u != v)
    assert common > 0 and a[:common] == b[:common]  # (the shared layers)
    assert not set(a[common:]) & set(b[common:])  # (apart once parted)
    assert path_keys([short, long]) == [a, b] and path_keys([long]) != [a]  # (keys name a prefix)


def test_a_step_takes_the_plan_of_its_branch_and_holds_what_it_planned() -> None:
    """Two paths planned together (``plan_native_paths``), the capture following one with the
    other beside it: a step of either branch follows its own plan to its end (``followed_path``),
    bit-equal to eager, and holds at most what that plan planned. (Planned apart, a step that took
    the other branch's plan over held more than that plan: the first plan's drops before the
    branch were not the second's.)"""
    cpu = native.wait()
    cpu.count_cpu_bytes()
    capture = Capture()
    torch.manual_seed(0)
    ws = [torch.randn(128, 128, requires_grad=True) for _ in range(6)]
    x = torch.randn(128, 128)
    ds = [described(capture, lambda i, p=p: _branchy(ws, x, i + p)) for p in (0, 1)]
    smallest, eager = [], []
    for d in ds:
        g = planning_graph(d)
        eager.append(replay(g, list(range(len(g))), check_order=False).peak)
        with pytest.raises(BudgetTooSmall) as small:
            plan_native_budget(d, g.persistent_bytes + 1)
        smallest.append(small.value.smallest)
    budget = (max(smallest) + max(eager)) // 2
    plans = plan_native_paths(ds, budget)
    assert all(p.planned_peak <= budget for p in plans) and sum(p.recomputed for p in plans) > 0
    for first in (0, 1):
        capture.follow(plans[first].drops, (plans[1 - first].drops,))
        for i in range(4):
            ref = [w.detach().clone().requires_grad_() for w in ws]
            for w, r in zip(ws, ref):  # (gradients accumulate, as in the described steps)
                r.grad = w.grad.clone()
            want = _branchy(ref, x, i)
            live = cpu.cpu_bytes()[0]
            cpu.reset_cpu_peak()
            with capture.step():
                got = _branchy(ws, x, i)
            held = cpu.cpu_bytes()[1] - live
            path = capture.followed_path
            assert capture.followed and path >= 0
            plan = plans[first] if path == 0 else plans[1 - first]
            assert plan.drops.ops == (plans[1] if i % 2 == 0 else plans[0]).drops.ops  # (its branch's)
            assert torch.equal(got, want) and all(torch.equal(w.grad, r.grad) for w, r in zip(ws, ref))
            assert held <= plan.planned_peak - plan.persistent_bytes, (first, i, held, plan.planned_peak)
