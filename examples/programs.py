"""Small training programs with the control flow coexec must handle, in plain PyTorch.

Each program is a class whose ``step(i)`` runs training step ``i`` eagerly: model, loss,
backward, optimizer. They build their own data (no downloads) from a seed, so two instances
with the same seed train identically. Used by ``examples/demo.py`` and the end-to-end tests.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn


class Program:
    name = "program"
    description = ""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.rng = random.Random(seed)

    def step(self, i: int) -> torch.Tensor:
        raise NotImplementedError


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class StaticMLP(Program):
    name = "static_mlp"
    description = "an MLP regression step with SGD: one path, no loops in the model"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = MLP()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.data = [(torch.randn(32, 16), torch.randn(32, 1)) for _ in range(4)]

    def step(self, i: int) -> torch.Tensor:
        x, y = self.data[i % len(self.data)]
        self.opt.zero_grad()
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


class LossBranch(Program):
    name = "loss_branch"
    description = "if loss.item() > c: the loss is clamped (a data-dependent Python branch)"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = MLP()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        # batches of alternating scale, so the loss crosses the threshold now and then
        self.data = [(torch.randn(32, 16) * (1 + 3 * (k % 2)), torch.randn(32, 1)) for k in range(4)]

    def step(self, i: int) -> torch.Tensor:
        x, y = self.data[i % len(self.data)]
        self.opt.zero_grad()
        loss = F.mse_loss(self.model(x), y)
        if loss.item() > 1.0:
            loss = loss.clamp(max=1.0) + 0.1 * loss
        loss.backward()
        self.opt.step()
        return loss.detach()


class DataDependentLoop(Program):
    name = "data_dependent_loop"
    description = "a layer applied n times, n read from the batch with .item()"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.inp = nn.Linear(16, 32)
        self.layer = nn.Linear(32, 32)
        self.out = nn.Linear(32, 1)
        params = [*self.inp.parameters(), *self.layer.parameters(), *self.out.parameters()]
        self.opt = torch.optim.SGD(params, lr=0.01)
        self.data = [(torch.randn(32, 16), torch.randn(32, 1)) for _ in range(6)]

    def step(self, i: int) -> torch.Tensor:
        x, y = self.data[i % len(self.data)]
        self.opt.zero_grad()
        h = torch.relu(self.inp(x))
        n = int(x[0, 0].abs().item() * 3) % 4 + 1  # 1..4, depends on the data
        for _ in range(n):
            h = torch.tanh(self.layer(h)) + h
        loss = F.mse_loss(self.out(h), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


class SDPoint(Program):
    name = "sdpoint"
    description = "a CNN whose downsampling point is drawn at random each step (SDPoint)"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        ch = 8
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Conv2d(ch, ch, 3, padding=1) for _ in range(3))
        self.head = nn.Linear(ch, 10)
        self.opt = torch.optim.SGD(
            [*self.stem.parameters(), *self.blocks.parameters(), *self.head.parameters()], lr=0.01
        )
        self.data = [(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))) for _ in range(3)]

    force_point: int | None = None  # set to pin the downsampling point

    def step(self, i: int) -> torch.Tensor:
        x, y = self.data[i % len(self.data)]
        point = self.rng.randrange(len(self.blocks))  # where to downsample this step
        if self.force_point is not None:
            point = self.force_point
        self.opt.zero_grad()
        h = F.relu(self.stem(x))
        for k, block in enumerate(self.blocks):
            h = F.relu(block(h))
            if k == point:
                h = F.avg_pool2d(h, 2)
        logits = self.head(h.mean(dim=(2, 3)))
        loss = F.cross_entropy(logits, y)
        loss.backward()
        self.opt.step()
        return loss.detach()


class VariableLengthRNN(Program):
    name = "variable_length_rnn"
    description = "an LSTM cell unrolled over a sequence whose length changes every step"

    max_len = 6

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.cell = nn.LSTMCell(8, 16)
        self.head = nn.Linear(16, 1)
        self.opt = torch.optim.SGD([*self.cell.parameters(), *self.head.parameters()], lr=0.05)
        self.data = [(torch.randn(self.max_len, 4, 8), torch.randn(4, 1)) for _ in range(3)]

    lengths: list[int] | None = None  # set to override the length schedule

    def step(self, i: int) -> torch.Tensor:
        seq, y = self.data[i % len(self.data)]
        length = 1 + (5 * i + 2) % self.max_len  # changes every step: 3, 2, 1, 6, 5, 4, ...
        if self.lengths is not None:
            length = self.lengths[i % len(self.lengths)]
        self.opt.zero_grad()
        h = torch.zeros(4, 16)
        c = torch.zeros(4, 16)
        for t in range(length):
            h, c = self.cell(seq[t], (h, c))
        loss = F.mse_loss(self.head(h), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


PROGRAMS: list[type[Program]] = [StaticMLP, LossBranch, DataDependentLoop, SDPoint, VariableLengthRNN]
