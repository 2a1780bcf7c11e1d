"""Steps whose ``with tape:`` holds only part of the work (the forward before it, the optimizer
after it, a graph kept from an earlier step) train as eager does on the default backend: a
gradient block answers ``backward()`` only over a graph the step itself made (issue 51)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coexec
from executor import native

pytestmark = pytest.mark.skipif(not native.enabled(), reason="the default backend's capture")

Program = Callable[[Callable[[], contextlib.AbstractContextManager]], list[float]]


def _state_of(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def assert_bit_equal(program: Callable, steps: int) -> coexec.GradientTape:
    """``program(within, steps)`` trains from its own seeds, calling ``within()`` for the
    context of each step's tape part; it returns (losses, state tensors). Run eagerly and under
    the default backend's tape: both bit-equal."""
    want_losses, want_state = program(contextlib.nullcontext, steps)
    tape = coexec.GradientTape()
    got_losses, got_state = program(lambda: tape, steps)
    assert got_losses == want_losses, f"losses differ:\ncoexec {got_losses}\neager  {want_losses}"
    assert len(got_state) == len(want_state)
    for i, (a, b) in enumerate(zip(got_state, want_state)):
        assert torch.equal(a, b), f"state tensor {i} differs (max diff {(a - b).abs().max()})"
    return tape


def reinforce(within, steps: int):
    """REINFORCE's ``finish_episode``: the rollout (softmax policy, ``multinomial``, ``.item()``
    per environment step) runs eagerly outside the tape; the tape holds the returns'
    normalisation, the policy loss over the kept log-probabilities, ``backward()`` and Adam."""
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for episode in range(steps):
        log_probs, rewards = [], []
        state = torch.randn(4, generator=g)
        for t in range(5 + episode % 3):
            probs = F.softmax(policy(state), -1)
            action = torch.multinomial(probs, 1)
            log_probs.append(torch.log(probs.gather(0, action)))
            rewards.append(float(action.item()) + 0.1 * t)
            state = torch.randn(4, generator=g)
        with within():
            ret, returns = 0.0, []
            for r in reversed(rewards):
                ret = r + 0.99 * ret
                returns.insert(0, ret)
            returns = torch.tensor(returns)
            returns = (returns - returns.mean()) / (returns.std() + 1e-6)
            loss = (-torch.stack(log_probs).squeeze(-1) * returns).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses, _state_of(policy, opt)


def test_a_forward_outside_the_tape_is_bit_equal_to_eager() -> None:
    """The backward's graph was built outside the tape, with other sampled actions each episode
    (other indices in its gather's backward): before the fix a gradient block replayed an
    earlier episode's backward and the losses left eager's from the 5th episode on."""
    tape = assert_bit_equal(reinforce, 24)
    assert tape.stats.coexec_steps == 24 and tape.stats.gradient_blocks == 0


def forward_outside(within, steps: int):
    """The forward of the same batch outside the tape, its loss's backward and Adam inside."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    data = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(3)]
    losses = []
    for i in range(steps):
        x, y = data[i % 3]
        loss = F.mse_loss(model(x), y)
        with within():
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses, _state_of(model, opt)


def test_a_loss_made_before_the_tape_and_stepped_inside_is_bit_equal() -> None:
    tape = assert_bit_equal(forward_outside, 9)
    assert tape.stats.gradient_blocks == 0


def kept_graph(within, steps: int):
    """A hidden state carried across steps without ``detach()``: each step's backward walks the
    nodes of every earlier step (kept with ``retain_graph``) and its own."""
    torch.manual_seed(0)
    cell = nn.Linear(4, 4)
    opt = torch.optim.SGD(cell.parameters(), lr=0.01)
    h = torch.zeros(1, 4)
    losses = []
    for i in range(steps):
        with within():
            h = torch.tanh(cell(h) + 0.1 * i)
            loss = h.square().sum()
            opt.zero_grad()
            loss.backward(retain_graph=i % 2 == 0)
            opt.step()
        if i % 2:
            h = h.detach()
        losses.append(loss.item())
    return losses, _state_of(cell, opt)


def test_a_graph_kept_from_an_earlier_step_is_walked_by_the_engine() -> None:
    assert_bit_equal(kept_graph, 8)
