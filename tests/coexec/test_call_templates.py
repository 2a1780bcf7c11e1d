"""Call templates (coexec/calls.py): torch-level calls without autograd issued from what the
same kind of call made before, bit-equal to eager, with numbers that vary fed to the op, and
an exact fallback where the graph does not cover the call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import coexec
from tests.coexec.helpers import assert_same_as_eager, train_step


def make(opt_class=torch.optim.Adam, **opt_args):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
        opt = opt_class(model.parameters(), lr=0.01, **opt_args)
        data = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(3)]
        return {"model": model, "opt": opt, "data": data}

    return build


def test_an_optimizer_step_is_issued_from_templates_bit_equal_to_eager():
    """Adam's step size changes every step (bias correction): the number is fed to the op,
    so the optimizer's calls stay templated step after step."""
    tape = assert_same_as_eager(make(), train_step, 10)
    assert tape.stats.phase == "coexec" and tape.stats.fallbacks == 0
    # per parameter: exp_avg lerp_, exp_avg_sq mul_ and addcmul_, sqrt, div_, add_, addcdiv_
    assert tape.stats.templated_calls >= 4 * 7


def test_sgd_with_momentum_is_bit_equal():
    tape = assert_same_as_eager(make(torch.optim.SGD, momentum=0.9, weight_decay=1e-3), train_step, 8)
    assert tape.stats.templated_calls > 0


def test_a_number_that_sizes_the_result_is_not_fed():
    """``torch.zeros(n, 12)`` with ``n`` changing: the op's output has another shape, so the
    number is not fed from one template (the fuzzer found placeholders of the old shape)."""

    def step_sizes(state, i):
        model, opt = state["model"], state["opt"]
        x, y = state["data"][i % 3]
        n = 8 if i % 2 else 5
        x, y = x[:n], y[:n]
        opt.zero_grad()
        with torch.no_grad():
            shift = torch.zeros(n, 12) + 0.5
        h = model[1](model[0](x) + shift)
        loss = F.mse_loss(model[2](h), y)
        loss.backward()
        opt.step()
        return loss

    tape = assert_same_as_eager(make(), step_sizes, 10)
    assert tape.stats.phase == "coexec" and tape.stats.templated_calls > 0


def test_a_templated_call_the_graph_does_not_cover_falls_back_exactly():
    """A call whose kind has a template, at a line the graph has not seen: nothing of it was
    issued, the step goes on eagerly from there, and the results are eager's."""

    def step_new_line(state, i):
        model, opt = state["model"], state["opt"]
        x, y = state["data"][i % 3]
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            if i == 7:  # the same kind of call as the optimizer's first one, somewhere new
                for p in model.parameters():
                    p.grad.mul_(0.5)
        opt.step()
        return loss

    tape = assert_same_as_eager(make(torch.optim.SGD, momentum=0.9), step_new_line, 9)
    assert tape.stats.fallbacks >= 1


def test_an_in_place_call_bumps_the_version_autograd_checks():
    """Under ``no_grad`` an in-place call is issued from its template; the tensor's version
    counter still moves, so autograd's check of saved tensors sees the write, as in eager."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    tape = coexec.GradientTape(backend="interpret", key="templates-version")
    seen = []
    for _ in range(6):
        with tape:
            y = lin(x) * 2  # (saves no tensor of its own)
            with torch.no_grad():
                z = y.detach()  # (shares y's version counter)
                v0 = y._version
                z.mul_(1.0)
                seen.append(y._version - v0)
            y.sum().backward()
    assert tape.stats.phase == "coexec" and tape.stats.templated_calls >= 1
    assert seen == [1] * 6
