"""Build a :class:`~coexec.fuzz.spec.Spec` into modules and a step function.

No source text is generated: each block becomes a small closure ``f(h, env) -> h`` over its module,
and the step composes them between data, loss, checkpoint, backward and optimizer code that is
also chosen by the spec. Everything a step shows (printed text, a checkpoint loaded back) goes
into its :class:`Env` so the runner can compare it with eager's.
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .spec import Block, Spec

N_OUT = 3  # classes (``ce``) or targets (``mse``)
GRID = {4: (2, 2), 8: (2, 4), 16: (4, 4)}  # conv2d's view of a width


@dataclass
class Env:
    """What one step shows besides its loss."""

    text: io.StringIO = field(default_factory=io.StringIO)
    saved: tuple[torch.Tensor, ...] = ()
    tape: Any = None  # the coexec run's tape (``tape_gradient`` calls its ``gradient``)
    # the context of each part of the step the tape holds (the tape, or nothing in the eager run)
    within: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


Fn = Callable[[torch.Tensor, Env], torch.Tensor]


def make_module(block: Block, width: int) -> nn.Module:
    """The module a block owns (``nn.Identity`` for plain code blocks)."""
    w = width
    makers: dict[str, Callable[[], nn.Module]] = {
        "linear": lambda: nn.Linear(w, w),
        "conv1d": lambda: nn.Conv1d(1, 2, 3, padding=1),
        "conv2d": lambda: nn.Conv2d(1, 2, 3, padding=1),
        "lstm": lambda: nn.LSTMCell(w, w),
        "gru": lambda: nn.GRUCell(w, w),
        "embedding": lambda: nn.Embedding(block.k + 2, w),
        "layernorm": lambda: nn.LayerNorm(w),
        "batchnorm": lambda: nn.BatchNorm1d(w),
        "dropout": lambda: nn.Dropout(block.t),
        "loop": lambda: nn.Linear(w, w),
    }
    return makers.get(block.kind, nn.Identity)()


def _activation(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return (torch.relu, torch.tanh, lambda h: h)[k % 3]


def block_fn(block: Block, mod: nn.Module, width: int) -> Fn:
    """The closure that applies ``block`` (with its module ``mod``) to an activation."""
    k, t, w = block.k, block.t, width
    act = _activation(k)
    kind = block.kind
    if kind == "linear":
        return lambda h, env: act(mod(h))
    if kind == "conv1d":
        return lambda h, env: mod(h.unsqueeze(1)).mean(1)
    if kind == "conv2d":
        return lambda h, env: mod(h.view(h.shape[0], 1, *GRID[w])).mean(1).flatten(1)
    if kind == "lstm":
        return lambda h, env: mod(h)[k % 2]  # the hidden or the cell state
    if kind == "embedding":
        n = k + 2
        return lambda h, env: h + mod((h.detach()[:, 0].abs() * (4 * t)).long() % n)
    if kind in ("gru", "layernorm", "batchnorm", "dropout"):
        return lambda h, env: mod(h)
    return CODE_BLOCKS[kind](k, t, w, mod)


def _branch(k: int, t: float, w: int, mod: nn.Module) -> Fn:
    def f(h: torch.Tensor, env: Env) -> torch.Tensor:
        taken = (
            h.mean().item() > t if k == 0
            else bool(h.sum() > t * h.shape[0]) if k == 1
            else float(h[0, 0].detach()) > t
        )  # fmt: skip
        return h * 1.5 if taken else torch.tanh(h)

    return f


def _loop(k: int, t: float, w: int, mod: nn.Module) -> Fn:
    def f(h: torch.Tensor, env: Env) -> torch.Tensor:
        for _ in range(int(h.detach().abs().sum().item()) % 4 + 1):
            h = h + 0.5 * torch.tanh(mod(h)) if k else torch.tanh(mod(h))
        return h

    return f


def _inplace(k: int, t: float, w: int, mod: nn.Module) -> Fn:
    def f(h: torch.Tensor, env: Env) -> torch.Tensor:
        h = h.clone() if k == 0 else h * 1.0  # a non-leaf no one saved for backward
        h.mul_(t).add_(0.1)
        if k == 2:
            h[:, 0].mul_(2.0)  # in place on a view: CopySlices
        h.relu_()
        return h

    return f


def _views(k: int, t: float, w: int, mod: nn.Module) -> Fn:
    def f(h: torch.Tensor, env: Env) -> torch.Tensor:
        b = h.shape[0]
        h = torch.cat([h.narrow(1, k, w - k), h[:, :k] * t], 1)
        h = h.view(b, 2, w // 2).transpose(1, 2).reshape(b, w)
        return h.unsqueeze(0).squeeze(0).t().contiguous().t()

    return f


def _floats(k: int, t: float, w: int, mod: nn.Module) -> Fn:
    def f(h: torch.Tensor, env: Env) -> torch.Tensor:
        if k == 0:
            scale = torch.tensor([h.mean().item()])
        elif k == 1:
            scale = torch.tensor([float(v) for v in h[0].detach()])
        else:
            scale = torch.tensor([h.detach().abs().mean()])  # a 0-d tensor of the step
        return h * (1.0 + 0.1 * scale.tanh())

    return f


def _stack(k: int, t: float, w: int, mod: nn.Module) -> Fn:
    def f(h: torch.Tensor, env: Env) -> torch.Tensor:
        outs = [torch.tanh(h * (j + t)) for j in range(k % 3 + 2)]
        if k % 2:
            return torch.stack(outs).mean(0)
        return torch.cat(outs, 1).view(h.shape[0], len(outs), w).sum(1)

    return f


def _try_index(k: int, t: float, w: int, mod: nn.Module) -> Fn:
    def f(h: torch.Tensor, env: Env) -> torch.Tensor:
        idx = (h.detach().abs().sum(0) * t).long()[:2]  # may be out of range
        try:
            picked = h[:, idx]
        except IndexError as e:
            print("caught", type(e).__name__, file=env.text)
            picked = h[:, idx.clamp(max=w - 1)]
        return h + picked.sum(1, keepdim=True)

    return f


def _print(k: int, t: float, w: int, mod: nn.Module) -> Fn:
    def f(h: torch.Tensor, env: Env) -> torch.Tensor:
        print(h.sum(0), file=env.text)  # 1-D, with grad_fn
        print(h.mean(), file=env.text)  # 0-d
        if k == 1:
            print(h.detach()[0], f"{h.max():.5f}", file=env.text)
        return h

    return f


CODE_BLOCKS: dict[str, Callable[[int, float, int, nn.Module], Fn]] = {
    "branch": _branch, "loop": _loop, "inplace": _inplace, "views": _views, "floats": _floats,
    "stack": _stack, "try_index": _try_index, "print": _print,
}  # fmt: skip


class Net(nn.Module):
    """The spec's blocks in order, then a linear head."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.mods = nn.ModuleList(make_module(b, spec.width) for b in spec.blocks)
        self.head = nn.Linear(spec.width, N_OUT)
        self.fns = [block_fn(b, m, spec.width) for b, m in zip(spec.blocks, self.mods)]

    def forward(self, h: torch.Tensor, env: Env) -> torch.Tensor:
        for f in self.fns:
            h = f(h, env)
        return self.head(h)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
    "adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
    "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.01),
    "rmsprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr),
}


@dataclass
class State:
    """A built program: its spec, model and optimizer (made from the current torch seed)."""

    spec: Spec
    net: Net
    opt: torch.optim.Optimizer
    carry: torch.Tensor | None = None  # ``carry``: a detached activation kept from the last step
    losses: list[torch.Tensor] = field(default_factory=list)  # ``kept_losses``
    flipped: tuple[torch.Tensor, torch.Tensor] | None = None  # ``accumulate``: the second batch


def build(spec: Spec) -> State:
    net = Net(spec)
    return State(spec, net, OPTIMIZERS[spec.optimizer](net.parameters(), spec.lr))


def batch(spec: Spec, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s data, from a generator keyed by the seed and the step (made in the step)."""
    size = random.Random(spec.seed * 7919 + i).choice(spec.batch_sizes)
    g = torch.Generator().manual_seed(spec.seed * 7919 + i)
    x = torch.randn(size, spec.width, generator=g)
    if spec.loss == "ce":
        return x, torch.randint(0, N_OUT, (size,), generator=g)
    return x, torch.randn(size, N_OUT, generator=g)


def step(state: State, i: int, env: Env) -> torch.Tensor:
    """One training step of the program, its parts inside ``with env.within():`` as the spec's
    tape boundary says (the whole step by default); returns the loss."""
    extra = state.spec.extra
    if "new_optimizer" in extra and i % 4 == 3:  # (between steps: a fresh object, the same state)
        fresh = OPTIMIZERS[state.spec.optimizer](state.net.parameters(), state.spec.lr)
        fresh.load_state_dict(state.opt.state_dict())
        state.opt = fresh
    if "forward_outside" in extra:
        loss, out, x = _forward(state, i, env)
        with env.within():
            _backward(state, i, env, loss, out, x)
            _update(state, i, env, loss, x)
    elif "optimizer_outside" in extra:
        with env.within():
            loss, out, x = _forward(state, i, env)
            _backward(state, i, env, loss, out, x)
        _update(state, i, env, loss, x)
    elif "two_withs" in extra:
        with env.within():
            loss, out, x = _forward(state, i, env)
            _backward(state, i, env, loss, out, x)
        with env.within():
            _update(state, i, env, loss, x)
    else:
        with env.within():
            loss, out, x = _forward(state, i, env)
            _backward(state, i, env, loss, out, x)
            _update(state, i, env, loss, x)
    return loss


def _forward(state: State, i: int, env: Env) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Data, gradients cleared, the forward and the loss (and a double backward's penalty)."""
    spec, opt, extra = state.spec, state.opt, state.spec.extra
    x, y = batch(spec, i)
    opt.zero_grad(set_to_none=spec.set_to_none)
    if "carry" in extra and state.carry is not None:
        x = x + 0.5 * state.carry  # a tensor the previous step computed
    if "grad_penalty" in extra:
        x = x.detach().requires_grad_()
    loss, out = _loss(state, x, y, env)
    if "grad_penalty" in extra:  # double backward (WGAN-GP style)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = loss + 0.1 * (gx.norm(2, dim=1) - 1).pow(2).mean()
    if "accumulate" in extra:
        state.flipped = (x.flip(0), y.flip(0))
    return loss, out, x


def _backward(
    state: State, i: int, env: Env, loss: torch.Tensor, out: torch.Tensor, x: torch.Tensor
) -> None:
    """Hooks, fetches, the backward pass(es), the carried activation, a mid-step checkpoint."""
    spec, net, extra = state.spec, state.net, state.spec.extra
    if "grad_hook" in extra:
        out.register_hook(lambda g: _hook(g, env))
    if "fetches" in extra:
        vals = out.detach().numpy().round(4).tolist()
        print("fetch", vals[0], float(np.asarray(out.detach()).sum()), file=env.text)
    if "retain_graph" in extra:  # the same graph backward twice
        (loss * 0.25).backward(retain_graph=True)
        (loss * 0.75).backward()
    elif "accumulate" in extra:  # two backward passes into the same gradients
        (loss * 0.5).backward()
        loss2, _ = _loss(state, *state.flipped, env)
        (loss2 * 0.5).backward()
    if "carry" in extra:
        state.carry = out.detach().mean(0).repeat(spec.width // N_OUT + 1)[: spec.width]
    if spec.checkpoint_every and i % spec.checkpoint_every == 0:
        buf = io.BytesIO()
        torch.save(net.state_dict(), buf)  # mid-step: after the forward, before backward
        buf.seek(0)
        env.saved = tuple(torch.load(buf).values())
    if "accumulate" in extra or "retain_graph" in extra:
        pass
    elif "tape_gradient" in extra and env.tape is not None:
        env.tape.gradient(loss, net.parameters())  # into .grad, as backward() (eager's run)
    else:
        loss.backward()


def _update(state: State, i: int, env: Env, loss: torch.Tensor, x: torch.Tensor) -> None:
    """Clipping, learning rates, the optimizer step, and what comes after it."""
    spec, net, opt, extra = state.spec, state.net, state.opt, state.spec.extra
    if spec.clip is not None:
        nn.utils.clip_grad_norm_(net.parameters(), spec.clip)
    if spec.lr_mode == "lr_schedule":
        for g in opt.param_groups:
            g["lr"] = spec.lr * 0.9 ** (i % 7)
    elif spec.lr_mode == "lr_from_loss":
        for g in opt.param_groups:
            g["lr"] = spec.lr * (0.5 if loss.item() > 1.0 else 1.0)
    opt.step()
    if "param_clamp" in extra:
        with torch.no_grad():
            for p in net.parameters():
                p.clamp_(-0.3, 0.3)
    if "no_grad_eval" in extra:
        net.eval()
        with torch.no_grad():
            print("eval", net(x, env).sum(), file=env.text)
        net.train()
    if "kept_losses" in extra:
        state.losses = [*state.losses[-3:], loss]  # placeholders of earlier steps, kept
        print("mean", torch.stack([l.detach() for l in state.losses]).mean(), file=env.text)


def _hook(g: torch.Tensor, env: Env) -> torch.Tensor:
    print("grad", g.norm(), file=env.text)  # printed inside the backward
    return g * 0.5


def _loss(state: State, x: torch.Tensor, y: torch.Tensor, env: Env) -> tuple[torch.Tensor, ...]:
    spec = state.spec
    out = state.net(x, env)
    if "mask" in spec.extra:
        out = out.masked_fill(out.detach() > 0.5, 0.0) + torch.where(out < -0.5, out, 0.1 * out)
    loss = F.cross_entropy(out, y) if spec.loss == "ce" else F.mse_loss(out, y)
    if spec.loss_branch is not None and loss.item() > spec.loss_branch:
        loss = loss + 0.1 * out.pow(2).mean()
    return loss, out
