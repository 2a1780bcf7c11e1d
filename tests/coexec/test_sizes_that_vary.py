"""Sizes that vary between steps on the interpret backend (issue 17): from the second distinct
size an op's node is sized (tracegraph/graph.py), so a batch or sequence length drawn per step
is one path, co-executed from then on with placeholders of each step's own sizes (worked out on
the meta device, checked once against the op's real result), bit-equal to eager."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.coexec.helpers import assert_same_as_eager

LENGTHS = [5, 9, 7, 3, 11, 6, 4, 8, 10, 2, 12, 5]


def mlp_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)) for n in LENGTHS]
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=0.01), "data": data}


def mlp_step(state: dict, i: int) -> torch.Tensor:
    model, opt = state["model"], state["opt"]
    x, y = state["data"][i]
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def test_a_batch_size_drawn_per_step_is_one_path_bit_equal_to_eager():
    tape = assert_same_as_eager(mlp_state, mlp_step, len(LENGTHS))
    s = tape.stats
    # two traces (the first two sizes, both while tracing), then every step co-executed
    assert (s.traces, s.fallbacks, s.phase) == (2, 0, "coexec"), s
    assert s.coexec_steps == len(LENGTHS) - 3, s
    graph = tape._program.graph
    addmm = [n for n in graph.nodes() if n.name == "aten::addmm"]
    assert addmm and all(n.sized for n in addmm)


def deep_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.Tanh())], nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16 * n, 32, generator=g), torch.randn(16 * n, 1, generator=g)) for n in LENGTHS]
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01), "data": data}


def test_under_an_arena_sized_ops_are_bit_equal():
    """The arena places sizes as planned, which a step's may pass: sized ops' outputs go to the
    allocator."""
    tape = assert_same_as_eager(deep_state, mlp_step, len(LENGTHS), arena=True)
    assert tape.stats.coexec_steps == len(LENGTHS) - 3
    # one plan per trace: larger steps ask for none (the arena would not place their sized ops)
    assert tape.stats.plans_made == 2 and tape.stats.planning_seconds > 0


def budgeted(budget: int) -> tuple:
    """The deep MLP under ``budget``, bit-equal to eager; its tape, and what coexec warned
    (from ``used``, or after the budget error's figures)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tape = assert_same_as_eager(deep_state, mlp_step, len(LENGTHS), memory_budget=budget)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    over = [w for w in caught if "over its memory budget" in str(w.message)]
    assert all(w.filename.endswith("helpers.py") for w in over)  # (the ``with`` line: tests/coexec/helpers.py)
    return tape, [x[x.index("used"):] if "used" in x else x[x.index(");") + 2 :] for x in said]


def test_a_step_larger_than_the_planned_one_is_held_by_the_guard_and_planned_again_in_the_background():
    """Under a budget a path is planned for the largest step seen: the step that first
    allocates more follows the plan for smaller ones up to its first op that makes more than
    planned, then the executor's guard holds it within the budget (executor/guard.py); it asks
    for a plan of its own sizes and does not wait for it; that plan covers the smaller steps
    after it (by recomputing more), and the next largest is planned again."""
    # (without the guard, step 4 on step 1's plan used 229772 bytes, over 226000, warned)
    tape, said = budgeted(226_000)
    assert said == []
    s = tape.stats
    assert s.over_budget_steps == 0 and s.coexec_steps == len(LENGTHS) - 3, s
    # steps 4, 5, 7, 8 and 10: each larger than the smallest step a plan was made for (5 rows,
    # the first trace's path; a step's path is known only at its end: coexec/tape.py, _site_bytes)
    assert s.guarded_steps == 5
    assert s.plans_made == 4  # the two traces', then steps 4 and 10's
    # the last step (of 5 rows x 16) ran on the plan made for step 10 (12 x 16, the largest)
    assert s.planned_for_step == 10 and s.recomputed_ops > 0 and s.guard_drops == 0, s
    assert [row["planned for step"] for row in tape.report()] == [0, 10]


def test_a_larger_step_no_plan_meets_the_budget_for_keeps_the_plan_in_use():
    tape, said = budgeted(170_000)
    kept = " the plan in use stays, and steps that large may go over the budget (counted in tape.stats.over_budget_steps)"
    assert [x for x in said if not x.startswith("used")] == [kept, kept]  # (for steps 4 and 10)
    used = [int(x.split()[1]) for x in said if x.startswith("used")]
    s = tape.stats
    # no plan meets the budget at 11 and 12 rows, nor does the guard hold those steps within it
    # (it finds too little to drop: 3-19% over; unguarded, steps 4, 8 and 10 went 0-17% over)
    assert s.over_budget_steps == len(used) <= 3, said
    assert s.coexec_steps == len(LENGTHS) - 3 and s.guarded_steps >= 3, s
    assert s.planned_for_step == 1 and s.recomputed_ops > 0, s


def lstm_state() -> dict:
    torch.manual_seed(0)
    lstm, head = nn.LSTM(8, 16), nn.Linear(16, 1)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(n, 2, 8, generator=g) for n in LENGTHS]
    return {"lstm": lstm, "head": head, "opt": torch.optim.SGD([*lstm.parameters(), *head.parameters()], lr=0.1),
            "data": data}  # fmt: skip


def lstm_step(state: dict, i: int) -> torch.Tensor:
    out, _ = state["lstm"](state["data"][i])
    loss = state["head"](out).pow(2).mean()
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad()
    return loss


def test_an_op_whose_meta_kernel_is_wrong_is_waited_for():
    """The CPU LSTM's ``mkldnn_rnn_layer`` says on the meta device that its workspace is empty;
    its real workspace is not. The first co-executed step finds that out (it waits for the op
    once) and the node's results are waited for from then on: no placeholder of a wrong size."""
    tape = assert_same_as_eager(lstm_state, lstm_step, len(LENGTHS))
    s = tape.stats
    assert (s.traces, s.fallbacks, s.coexec_steps) == (2, 0, len(LENGTHS) - 3), s
    checked = {n.name: n.inferred for n in tape._program.graph.nodes() if n.sized and n.inferred is not None}
    assert checked["aten::mkldnn_rnn_layer"] is False
    assert checked["aten::addmm"] is True


def rank_step(state: dict, i: int) -> torch.Tensor:
    w = state["model"][0].weight
    x = torch.ones(*[2] * (1 + i % 3), 6)  # 1, 2, 3 batch dimensions in turn
    loss = (x @ w.t()).sum()
    loss.backward()
    w.grad = None
    return loss


def test_a_rank_that_varies_is_another_path():
    tape = assert_same_as_eager(mlp_state, rank_step, 9)
    s = tape.stats
    assert s.traces == 3 and s.phase == "coexec", s
    assert s.fallback_reasons[-1].endswith("was [2, 2, 2, 6], the graph has [2, 6] and [2, 2, 6] (a rank that varies)")


def _meta(*shape: int, dtype: torch.dtype = torch.float32, t: bool = False) -> torch.Tensor:
    x = torch.empty(*shape, dtype=dtype, device="meta")
    return x.t() if t else x


META_CASES = [
    (torch.ops.aten.add.Tensor, (_meta(4, 7, 3), _meta(1, 7, 1)), {}),
    (torch.ops.aten.add.Tensor, (_meta(5, 3, dtype=torch.int64), _meta(3)), {"alpha": 2}),
    (torch.ops.aten.mul.Tensor, (_meta(8, 5, t=True), _meta(8, 5, t=True)), {}),
    (torch.ops.aten.addmm.default, (_meta(6), _meta(4, 3), _meta(3, 6)), {}),
    (torch.ops.aten.mm.default, (_meta(4, 3), _meta(3, 6, t=False)), {}),
    (torch.ops.aten.sum.dim_IntList, (_meta(4, 7, 3), [1]), {"keepdim": True}),
    (torch.ops.aten.mean.dim, (_meta(4, 7, 3), [0, 2]), {}),
    (torch.ops.aten._softmax.default, (_meta(2, 9), -1, False), {}),
    (torch.ops.aten.gelu.default, (_meta(3, 4),), {"approximate": "tanh"}),
    (torch.ops.aten.cat.default, ([_meta(2, 3), _meta(5, 3)],), {}),
    (torch.ops.aten.add_.Tensor, (_meta(4, 3), _meta(3)), {}),
]


@pytest.mark.parametrize("func, args, kwargs", META_CASES, ids=[str(c[0]) for c in META_CASES])
def test_structured_meta_functions_answer_as_the_meta_key(func, args, kwargs):
    """The skeleton works out a sized op's outputs through the native module's C++ meta
    functions of structured kernels (coexec/skeleton.py ``_on_meta``): the same sizes, strides
    and dtypes as torch's own Meta key."""
    from coexec.skeleton import _STRUCTURED, _on_meta
    from executor import native

    if native.wait() is None:
        pytest.skip("the native module is not built")
    got = _on_meta(func, list(args), dict(kwargs))
    want = func(*args, **kwargs)
    assert _STRUCTURED[func] is True  # (answered by the C++ meta function, not the Meta key)
    for g, w in zip(*(x if isinstance(x, (list, tuple)) else [x] for x in (got, want))):
        assert (g.shape, g.stride(), g.dtype, g.device) == (w.shape, w.stride(), w.dtype, w.device)


def test_an_argument_only_python_converts_takes_the_meta_key():
    """A call template fills a number where the schema has a Tensor (``x + 0.5``): the C++
    call refuses it, and the Meta key answers (it wraps the number, as eager does)."""
    from coexec.skeleton import _on_meta

    x = _meta(5, 12)
    got = _on_meta(torch.ops.aten.add.Tensor, [x, 0.5], {})
    assert (got.shape, got.dtype) == ((5, 12), torch.float32)


def rnn_state() -> dict:
    torch.manual_seed(0)
    cell, head = nn.RNNCell(3, 8), nn.Linear(8, 1)
    params = [*cell.parameters(), *head.parameters()]
    g = torch.Generator().manual_seed(1)
    return {"cell": cell, "head": head, "opt": torch.optim.SGD(params, lr=0.1),
            "data": [torch.randn(n, 2, 3, generator=g) for n in LENGTHS]}  # fmt: skip


def rnn_step(state: dict, i: int) -> torch.Tensor:
    """A loop that runs as many times as the step's sequence is long."""
    cell, head, opt = state["cell"], state["head"], state["opt"]
    opt.zero_grad()
    h, xs = torch.zeros(2, 8), state["data"][i]
    for t in range(len(xs)):  # (``for x in xs`` unbinds: an op whose number of outputs varies)
        h = cell(xs[t], h)
    loss = head(h).pow(2).mean()
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("budget", [None, "100MB"])
def test_a_loop_that_runs_another_number_of_times_each_step_plans_at_most_four_paths(budget):
    """Each trip count of a loop is another path (other sites); an episode's length drawn per
    step would be a plan over ever more paths (REINFORCE: a plan of 2 paths took 12.5 s, the
    next step under a budget waited for each). After LOOP_PATHS paths of one loop shape no
    more are added: without a budget such a step runs unplanned; under one the largest path is
    planned again, in the background, for a step that allocated more."""
    from coexec.tape import LOOP_PATHS

    tape = assert_same_as_eager(rnn_state, rnn_step, len(LENGTHS), memory_budget=budget)
    program = tape._program
    assert tape.stats.traces == 2 and tape.stats.coexec_steps == len(LENGTHS) - 3, tape.stats
    assert max(len(paths) for paths in program.shapes.values()) == LOOP_PATHS == 4
    # (a sequence of 2 is another shape: its first iteration's state comes from outside the loop
    # on both sides of its only back edge)
    assert len(program.paths) <= LOOP_PATHS + 1 < len(set(LENGTHS))
    if budget is None:  # step 4 (11 long) was the fourth path of its shape; step 10 (12) is none
        assert 4 in program.path_steps and 10 not in program.path_steps, program.path_steps
    else:  # the largest path was replaced by step 4's (11 long), then by step 10's (12)
        assert 10 in program.path_steps and 4 not in program.path_steps, program.path_steps
