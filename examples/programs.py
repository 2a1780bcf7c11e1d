"""Small training programs with the control flow coexec must handle, in plain PyTorch.

Each program is a class whose ``step(i)`` runs training step ``i`` eagerly: model, loss,
backward, optimizer; it returns the loss. They build their own data (no downloads) from a seed,
so two instances with the same seed train identically. The categories follow the programs Terra
was evaluated on (thesis §3.3.2). Run one with ``python examples/train.py NAME [--coexec]``;
they are also the end-to-end test programs.
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


class DropBlock2d(nn.Module):
    """DropBlock (Ghiasi et al. 2018): drops contiguous blocks; ``drop_prob`` is set from
    outside by a schedule, as the reference implementation's LinearScheduler does."""

    def __init__(self, block_size: int = 3) -> None:
        super().__init__()
        self.block_size = block_size
        self.drop_prob = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        gamma = self.drop_prob / (self.block_size**2)
        mask = (torch.rand(x.shape[0], *x.shape[2:]) < gamma).float()
        block = 1 - F.max_pool2d(mask[:, None], self.block_size, 1, self.block_size // 2)
        return x * block * block.numel() / block.sum()


class DropBlockSchedule(Program):
    name = "dropblock"
    description = "a CNN with DropBlock whose drop_prob attribute a schedule changes every step"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.drop = DropBlock2d(3)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)
        params = [*self.conv1.parameters(), *self.conv2.parameters(), *self.head.parameters()]
        self.opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        self.data = [(torch.randn(8, 3, 12, 12), torch.randint(0, 10, (8,))) for _ in range(3)]

    def step(self, i: int) -> torch.Tensor:
        self.drop.drop_prob = min(0.2, 0.02 * max(0, i - 2))  # 0 for 3 steps, then ramps up
        x, y = self.data[i % len(self.data)]
        self.opt.zero_grad()
        h = self.drop(F.relu(self.conv1(x)))
        h = F.relu(self.conv2(h))
        loss = F.cross_entropy(self.head(h.mean(dim=(2, 3))), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


class TrainerClass(Program):
    name = "trainer_class"
    description = "a trainer object that stores the loss in self.loss_value and reads it back"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = MLP(16, 32, 4)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.data = [(torch.randn(32, 16), torch.randint(0, 4, (32,))) for _ in range(4)]
        self.best = float("inf")
        self.history: list[torch.Tensor] = []

    def step(self, i: int) -> torch.Tensor:
        x, y = self.data[i % len(self.data)]
        self.opt.zero_grad()
        self.loss_value = F.cross_entropy(self.model(x), y)
        self.loss_value.backward()
        self.opt.step()
        self.history.append(self.loss_value.detach())
        if self.loss_value.item() < self.best:
            self.best = self.loss_value.item()
        return self.loss_value


class NumpyMetric(Program):
    name = "numpy_metric"
    description = "accuracy computed with numpy on fetched tensors mid-step steers the loss"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = MLP(16, 32, 4)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.data = [(torch.randn(32, 16), torch.randint(0, 4, (32,))) for _ in range(4)]

    def step(self, i: int) -> torch.Tensor:
        import numpy as np

        x, y = self.data[i % len(self.data)]
        self.opt.zero_grad()
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        accuracy = float(np.mean(logits.argmax(dim=1).numpy() == y.numpy()))
        if accuracy < 0.3:  # a hard batch: weigh it up
            loss = loss * 1.5
        loss.backward()
        self.opt.step()
        return loss.detach()


class DetectionStyle(Program):
    name = "detection"
    description = "anchor scoring whose Python logic depends on nonzero() and .item() results"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.score = nn.Conv2d(8, 1, 1)
        params = [*self.backbone.parameters(), *self.score.parameters()]
        self.opt = torch.optim.SGD(params, lr=0.05)
        self.data = []
        for k in range(3):  # each image has its own number of positive anchors
            labels = torch.zeros(2 * 8 * 8)
            labels[torch.randperm(labels.numel())[: 3 + 4 * k]] = 1.0
            self.data.append((torch.randn(2, 3, 8, 8), labels))

    def step(self, i: int) -> torch.Tensor:
        x, labels = self.data[i % len(self.data)]
        self.opt.zero_grad()
        scores = self.score(self.backbone(x)).flatten()
        positives = labels.nonzero()[:, 0]
        negatives = (labels == 0).nonzero()[:, 0]
        loss = F.binary_cross_entropy_with_logits(scores[positives], labels[positives])
        hard = scores[negatives].topk(8).values  # hard negative mining, a fixed number
        loss = loss + F.binary_cross_entropy_with_logits(hard, torch.zeros(8))
        if scores.max().item() > 2.0:  # confident false positives: regularise
            loss = loss + 0.01 * scores.pow(2).mean()
        loss.backward()
        self.opt.step()
        return loss.detach()


def _batches(seed: int):
    """An endless Python generator of (x, y) batches, made on the fly."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=g)
    while True:
        x = torch.randn(16, 8, generator=g)
        yield x, x @ w + 0.1 * torch.randn(16, 1, generator=g)


class GeneratorInputs(Program):
    name = "generator_inputs"
    description = "batches come from a Python generator consumed inside the step"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = MLP(8, 16, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.batches = _batches(seed)

    def step(self, i: int) -> torch.Tensor:
        x, y = next(self.batches)
        self.opt.zero_grad()
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


class LossSpike(Exception):
    pass


class TryExcept(Program):
    name = "try_except"
    description = "try/except inside the step: a loss spike raises and is handled"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = MLP(16, 32, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.02)
        self.data = [(torch.randn(32, 16) * (1 + 2 * (k % 2)), torch.randn(32, 1)) for k in range(4)]

    def check(self, loss: torch.Tensor) -> None:
        if loss.item() > 1.2:
            raise LossSpike(f"loss {loss.item():.3f}")

    def step(self, i: int) -> torch.Tensor:
        x, y = self.data[i % len(self.data)]
        self.opt.zero_grad()
        loss = F.mse_loss(self.model(x), y)
        try:
            self.check(loss)
            loss.backward()
        except LossSpike:
            (loss * 0.1).backward()  # damp the update
        self.opt.step()
        return loss.detach()


class DCGAN(Program):
    name = "dcgan"
    description = "DCGAN: conv generator and discriminator with BatchNorm, two Adam optimizers"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        nz, nf = 8, 8
        self.G = nn.Sequential(
            nn.ConvTranspose2d(nz, nf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(nf * 2), nn.ReLU(),
            nn.ConvTranspose2d(nf * 2, nf, 4, 2, 1, bias=False), nn.BatchNorm2d(nf), nn.ReLU(),
            nn.ConvTranspose2d(nf, 3, 4, 2, 1, bias=False), nn.Tanh(),
        )  # fmt: skip
        self.D = nn.Sequential(
            nn.Conv2d(3, nf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2),
            nn.Conv2d(nf, nf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(nf * 2), nn.LeakyReLU(0.2),
            nn.Conv2d(nf * 2, 1, 4, 1, 0, bias=False), nn.Flatten(),
        )  # fmt: skip
        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.real = [torch.randn(8, 3, 16, 16).tanh() for _ in range(3)]
        self.nz = nz

    def step(self, i: int) -> torch.Tensor:
        real = self.real[i % len(self.real)]
        fake = self.G(torch.randn(real.shape[0], self.nz, 1, 1))
        self.opt_d.zero_grad()
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        d_loss = F.binary_cross_entropy_with_logits(self.D(real), ones) + F.binary_cross_entropy_with_logits(
            self.D(fake.detach()), zeros
        )
        d_loss.backward()
        self.opt_d.step()
        self.opt_g.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(self.D(fake), ones)
        g_loss.backward()
        self.opt_g.step()
        return (d_loss + g_loss).detach()


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class SmallResNet(Program):
    name = "resnet"
    description = "a small ResNet (basic blocks, BatchNorm), SGD with momentum and weight decay"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), BasicBlock(16, 16, 1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )  # fmt: skip
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        self.data = [(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))) for _ in range(3)]

    def step(self, i: int) -> torch.Tensor:
        x, y = self.data[i % len(self.data)]
        self.opt.zero_grad()
        loss = F.cross_entropy(self.net(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


class SmallTransformer(Program):
    name = "transformer"
    description = "a small transformer encoder language model with dropout, AdamW"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        vocab, d = 50, 32
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        params = [*self.embed.parameters(), *self.encoder.parameters(), *self.head.parameters()]
        self.opt = torch.optim.AdamW(params, lr=1e-3)
        self.data = [torch.randint(0, vocab, (4, 13)) for _ in range(3)]
        self.mask = nn.Transformer.generate_square_subsequent_mask(12)

    def step(self, i: int) -> torch.Tensor:
        tokens = self.data[i % len(self.data)]
        self.opt.zero_grad()
        h = self.encoder(self.embed(tokens[:, :-1]), mask=self.mask, is_causal=True)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        return loss.detach()


PROGRAMS: list[type[Program]] = [
    StaticMLP, LossBranch, DataDependentLoop, SDPoint, VariableLengthRNN, DropBlockSchedule,
    TrainerClass, NumpyMetric, DetectionStyle, GeneratorInputs, TryExcept, DCGAN, SmallResNet,
    SmallTransformer,
]  # fmt: skip
BY_NAME = {p.name: p for p in PROGRAMS}
