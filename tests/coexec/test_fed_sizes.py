"""A fed number that sets a size (tracegraph ``Cursor.sizes_hold``): the graph turns numbers
that differ between traces into feeds, but a slice's end, a narrow's length, an ``arange``'s
end also set the output's size. A co-executed op whose fed number changes its output's size
must not take the node's sizes, or Python would see the wrong shape (the shorter last chunk of
a language model's epoch crashed in a ``view``, and dividing by ``x.shape[0]`` went wrong
silently)."""

from __future__ import annotations

import torch
from torch import nn

from tests.coexec.helpers import assert_same_as_eager


def make():
    torch.manual_seed(0)
    model = nn.Linear(3, 5)
    return {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.1),
        "source": torch.randn(26, 3),
        "shapes": [],
    }


def chunked_step(state, i):
    """Chunks of 8 rows at 0, 8, 16 and a last one of 2 at 24, as a word LM's bptt loop."""
    model, opt, source = state["model"], state["opt"], state["source"]
    start = 8 * (i % 4)
    x = source[start : min(start + 8, source.size(0))]
    state["shapes"].append(tuple(x.shape))
    opt.zero_grad()
    h = model(x)
    loss = h.view(-1, 5).pow(2).sum() / x.shape[0]  # (Python reads the slice's size)
    loss.backward()
    opt.step()
    return loss


def test_a_shorter_last_chunk_gets_its_own_sizes_bit_equal_to_eager():
    tape = assert_same_as_eager(make, chunked_step, 16)
    s = tape.stats
    assert s.phase == "coexec" and s.coexec_steps >= 8, s
    assert s.traces <= 4, s


def test_python_sees_the_sizes_eager_sees():
    from tests.coexec.helpers import run

    eager, coexec_state = make(), make()
    run(lambda: eager, chunked_step, 12, False)
    run(lambda: coexec_state, chunked_step, 12, True)
    assert coexec_state["shapes"] == eager["shapes"]
    assert (2, 3) in eager["shapes"]


def arange_step(state, i):
    """``arange`` whose end varies: a fed number of a factory sets its size."""
    model, opt = state["model"], state["opt"]
    n = (3, 5, 3, 7)[i % 4]
    with torch.no_grad():
        pos = torch.arange(n).float()
    state["shapes"].append(tuple(pos.shape))
    opt.zero_grad()
    loss = (model(state["source"][:n]) * pos[:, None]).sum() / pos.shape[0]
    loss.backward()
    opt.step()
    return loss


def test_a_factory_whose_end_varies_gets_its_own_sizes():
    tape = assert_same_as_eager(make, arange_step, 16)
    assert tape.stats.coexec_steps >= 4, tape.stats


def remainder_step(state, i):
    """An integer that varies in an op on integer data (``tokens % m``, as the fuzzer made it):
    checking its sizes must not record anything into the step (the meta tensors it works on
    went into the trace, two ops under one index, and merging a later fallback's trace failed
    with a KeyError); step 9 takes a new branch, so such a trace is merged."""
    model, opt = state["model"], state["opt"]
    tokens = torch.arange(8)
    idx = (tokens + i) % (3 if i % 2 else 5)
    opt.zero_grad()
    loss = model(state["source"][idx]).pow(2).mean()
    if i == 9:
        loss = loss * 2
    loss.backward()
    opt.step()
    return loss


def test_checking_sizes_records_nothing_into_the_step():
    tape = assert_same_as_eager(make, remainder_step, 14)
    assert tape.stats.fallbacks >= 1 and tape.stats.coexec_steps >= 4, tape.stats
