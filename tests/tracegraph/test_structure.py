"""Grouping a trace's ops into loops and iterations."""

from __future__ import annotations

import torch

from tracegraph import Loop, record


def loops(items) -> list[Loop]:
    return [it for it in items if isinstance(it, Loop)]


def op_names(trace, items) -> list[str]:
    return [trace.ops[i].name for i in items if isinstance(i, int)]


def test_a_loop_becomes_one_loop_item_with_one_list_per_iteration():
    x = torch.randn(3)
    for n in (1, 3, 5):
        with record() as tr:
            h = x.clone()
            for _ in range(n):
                h = h.sin() * 2
            h.sum()
        (loop,) = loops(tr.items)
        assert loop.trips == n
        assert all(op_names(tr, it) == ["aten::sin", "aten::mul.Tensor"] for it in loop.iterations)
        keys = {tuple(tr.ops[i].key for i in it) for it in loop.iterations}
        assert len(keys) == 1  # every iteration has the same op keys
        assert op_names(tr, tr.items) == ["aten::clone", "aten::sum"]


def test_gradient_ops_of_a_loop_form_a_mirrored_loop():
    w = torch.randn(3, 3, requires_grad=True)
    for n in (2, 4):
        with record() as tr:
            h = torch.ones(1, 3)
            for _ in range(n):
                h = torch.tanh(h @ w)
            h.sum().backward()
        fwd, bwd = loops(tr.items)
        assert fwd.trips == n and bwd.trips == n
        assert all(tr.ops[i].is_backward for it in bwd.iterations for i in it)
        # in the middle iterations the gradient ops repeat exactly
        if n > 2:
            mid = [tuple(tr.ops[i].key for i in it) for it in bwd.iterations[1:-1]]
            assert len(set(mid)) == 1


def test_nested_loops_with_an_op_in_the_outer_body():
    x = torch.randn(3)
    with record() as tr:
        for _ in range(2):
            x = x * 2
            for _ in range(3):
                x = x + 1
    (outer,) = loops(tr.items)
    assert outer.trips == 2
    for it in outer.iterations:
        assert op_names(tr, it) == ["aten::mul.Tensor"]
        (inner,) = loops(it)
        assert inner.trips == 3


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


def test_calling_a_module_in_a_loop_makes_one_iteration_per_call():
    blocks = torch.nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(2, 4)
    with record() as tr:
        for b in blocks:
            x = b(x)
    (loop,) = loops(tr.items)
    assert loop.trips == 3
    assert {tuple(op_names(tr, it)) for it in loop.iterations} == {
        ("aten::t", "aten::addmm", "aten::relu", "aten::detach", "aten::add.Tensor")
    }


def test_a_data_dependent_while_loop():
    x = torch.tensor([40.0])
    with record() as tr:
        while x.item() > 1:
            x = x / 2
    (loop,) = loops(tr.items)
    assert loop.trips == 6  # 40 halves 6 times to 0.625
    # the fetch of the loop condition stays inside the iteration that made its value
    assert all(any(not isinstance(i, int) for i in it) for it in loop.iterations)


def test_a_repeated_call_site_without_a_loop_is_not_a_loop():
    x = torch.randn(3)

    def f(t):
        return t.exp()

    with record() as tr:
        f(x)
        f(x)
    assert not loops(tr.items)
