"""The capture's shape oracle (native/capture_shapes.h): an op whose sizes its line has not met
goes to the worker with the metadata its own CPU code computes, not run at once, and every
tensor Python sees has eager's sizes, strides and values."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import native
from executor.capture import Capture

pytestmark = pytest.mark.skipif(not native.enabled(), reason="capture runs on the native module")


class SizedMlp:
    """A classifier with dropout whose batch has another size at every step (a loader's last
    batch, lengths drawn per step), SGD with momentum."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 3)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def step(self, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(n)
        x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


SIZES = (5, 7, 3, 9, 6, 11, 4)


def test_new_sizes_go_to_the_worker_bit_equal() -> None:
    """A batch of a size not met before is answered by the oracle: no op misses or runs at
    once, from the first step on, and dropout's random numbers are drawn in eager's order."""
    eager, co, capture = SizedMlp(), SizedMlp(), Capture()
    counts = []
    for i, n in enumerate(SIZES):
        torch.manual_seed(i)
        want = eager.step(n)
        torch.manual_seed(i)
        with capture.step():
            got = co.step(n)
        assert torch.equal(got, want), i
        counts.append(capture.counters)
    # (from the first step on: no op of these ran at once, and each step answered its new
    # batch size's ops by the oracle, the rest from the cache)
    assert counts[-1].misses == counts[-1].run_now == 0
    assert all(b.shaped - a.shaped >= 10 for a, b in itertools.pairwise(counts))
    for a, b in zip(eager.model.parameters(), co.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(eager.opt.state.values(), co.opt.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_ops_whose_sizes_follow_data_still_run_at_once() -> None:
    """``nonzero``'s size is its data's: it runs at once at every new input, right."""
    capture = Capture()
    for n in (4, 6, 5):
        x = torch.arange(n * 3.0).reshape(n, 3) % 4
        before = capture.counters
        with capture.step():
            idx = (x > 1).nonzero()
            y = (x[idx[:, 0]] * 2).sum(0)
        assert capture.counters.run_now > before.run_now
        assert torch.equal(idx, (x > 1).nonzero())
        assert torch.equal(y, (x[(x > 1).nonzero()[:, 0]] * 2).sum(0))


def test_an_out_factorys_numbers_are_part_of_its_cache_entry() -> None:
    """``torch.arange`` reaches the capture as ``arange.start_out`` into an empty tensor: its
    start and end size the result, so a step with another start is another entry (with them
    counted by kind, ``arange(n - 1, -1, -1)`` kept the first step's length at every ``n``)."""
    capture = Capture()
    for n in (0, 1, 3, 1, 2):
        with capture.step():
            got = [torch.arange(n - 1, -1, -1), torch.arange(n), torch.arange(1, n + 2, 2), torch.arange(0.5, n + 1)]
        want = [torch.arange(n - 1, -1, -1), torch.arange(n), torch.arange(1, n + 2, 2), torch.arange(0.5, n + 1)]
        assert [g.shape for g in got] == [w.shape for w in want], n
        assert all(torch.equal(g, w) for g, w in zip(got, want)), n


def test_random_ops_at_new_sizes_draw_in_eagers_order() -> None:
    """``multinomial``'s kernel draws before it reads its input: answered by running it on
    stand-ins with a generator of its own, it leaves the default generator to the worker, whose
    draws are eager's."""
    capture = Capture()
    for n in (3, 5, 4, 8):
        probs = torch.arange(1.0, 2.0 * n + 1).reshape(2, n)
        torch.manual_seed(n)
        want = [torch.multinomial(probs, n, replacement=True), torch.rand(n), torch.multinomial(probs, 2)]
        torch.manual_seed(n)
        with capture.step():
            got = [torch.multinomial(probs, n, replacement=True), torch.rand(n), torch.multinomial(probs, 2)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert capture.counters.misses == 0 and capture.counters.shaped >= 12


# Ops of a 2-D tensor (a, b) with a, b drawn per step: views with offsets and strides,
# broadcasting, reductions, data-reading kernels (layer_norm runs at once), in-place ops.
OPS = {
    "add_row": lambda x: x + x[:1],
    "mul_column": lambda x: x * x[:, :1],
    "t": lambda x: x.t(),
    "t_contiguous": lambda x: x.t().contiguous(),
    "every_other_column": lambda x: x[:, ::2],
    "from_second_row": lambda x: x[1:],
    "sum_rows": lambda x: x.sum(0, keepdim=True),
    "softmax": lambda x: x.softmax(-1),
    "log_softmax_rows": lambda x: x.log_softmax(0),
    "relu": lambda x: x.relu(),
    "gram": lambda x: x @ x.t(),
    "cat": lambda x: torch.cat([x, x * 2], 1),
    "expand_add": lambda x: x[:, :1].expand_as(x) + x,
    "flat_row": lambda x: x.reshape(1, -1),
    "where": lambda x: torch.where(x > 0, x, x * 3),
    "masked_fill": lambda x: x.masked_fill(x < 0, 0.5),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "pad": lambda x: F.pad(x, (1, 2)),
    "minus_mean": lambda x: x - x.mean(-1, keepdim=True),
    "unsqueeze_squeeze": lambda x: x.unsqueeze(0).squeeze(0),
    "in_place_mul": lambda x: x.clone().mul_(2),
    "tanh_permute": lambda x: x.tanh().unsqueeze(-1).permute(1, 2, 0).squeeze(1),
    "index_select": lambda x: x.index_select(0, torch.arange(x.shape[0] - 1, -1, -1)),
    "dropout": lambda x: F.dropout(x, 0.5, training=True),
    "times_rand": lambda x: x * torch.rand_like(x),
}


def _run(chain: list[str], a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(a, b, generator=torch.Generator().manual_seed(a * 100 + b)).requires_grad_()
    y = x
    for name in chain:
        y = OPS[name](y)
    (y * y).sum().backward()
    return y.detach(), x.grad


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=2, max_size=5),
)
def test_any_chain_of_ops_at_new_sizes_has_eagers_metadata_and_values(chain: list[str], sizes: list) -> None:
    """Whatever the oracle answers, the worker's op made (it checks each answer: a wrong one
    fails the step), and Python sees eager's sizes, strides and values at every size."""
    capture = Capture()
    for a, b in sizes:
        torch.manual_seed(a)
        want_y, want_grad = _run(chain, a, b)
        torch.manual_seed(a)
        with capture.step():
            got_y, got_grad = _run(chain, a, b)
            shape = (got_y.shape, got_y.stride(), got_y.storage_offset(), got_y.dtype)
        assert shape == (want_y.shape, want_y.stride(), want_y.storage_offset(), want_y.dtype)
        assert torch.equal(got_y, want_y)
        assert torch.equal(got_grad, want_grad)
