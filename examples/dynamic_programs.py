"""Training programs whose tensor sizes change from step to step (issue 17), in plain PyTorch.

The commonest dynamic behaviour in real training is not a branch but a size: the shorter last
chunk of a language model's epoch, the smaller last batch of a loader without ``drop_last``, a
sequence length drawn per batch, an episode's length, a data-dependent number of boxes. Each
program here has the interface of ``examples/programs.py`` (``step(i)`` runs training step
``i`` eagerly and returns the loss; two instances from one seed train identically) and builds
its own data. ``python bench/dynamic_sizes.py`` runs them under coexec against eager.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from examples.programs import Program


class WordLMLastChunk(Program):
    name = "word_lm_last_chunk"
    description = "an LSTM word LM over a token stream in chunks of 12, the last of each epoch shorter, hidden state detached"

    bptt = 12

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        vocab, self.batch = 40, 4
        self.embed = nn.Embedding(vocab, 16)
        self.lstm = nn.LSTM(16, 32)
        self.head = nn.Linear(32, vocab)
        self.params = [*self.embed.parameters(), *self.lstm.parameters(), *self.head.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=0.5)
        stream = torch.randint(0, vocab, (4 * 51,))  # 51 rows per column: chunks of 12, 12, 12, 12, 2
        self.source = stream.view(self.batch, -1).t().contiguous()
        self.starts = list(range(0, self.source.size(0) - 1, self.bptt))
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def step(self, i: int) -> torch.Tensor:
        k = i % len(self.starts)
        start = self.starts[k]
        length = min(self.bptt, self.source.size(0) - 1 - start)
        data = self.source[start : start + length]
        target = self.source[start + 1 : start + 1 + length].reshape(-1)
        if k == 0:  # a new epoch: a fresh hidden state (as the PyTorch example's init_hidden)
            self.hidden = (torch.zeros(1, self.batch, 32), torch.zeros(1, self.batch, 32))
        hidden = tuple(h.detach() for h in self.hidden)  # repackage_hidden
        self.opt.zero_grad()
        out, self.hidden = self.lstm(self.embed(data), hidden)
        loss = F.cross_entropy(self.head(out).view(-1, self.head.out_features), target)
        loss.backward()
        nn.utils.clip_grad_norm_(self.params, 0.25)
        self.opt.step()
        return loss.detach()


class ClassifierLastBatch(Program):
    name = "classifier_last_batch"
    description = "an MLP classifier fed by a DataLoader with drop_last=False: 100 samples in batches of 32, 32, 32, 4"

    def __init__(self, seed: int = 0, epochs: int = 20) -> None:
        super().__init__(seed)
        x = torch.randn(100, 20)
        y = (x[:, :3].argmax(1) + (x[:, 3] > 1).long()) % 3
        loader = DataLoader(
            TensorDataset(x, y), batch_size=32, shuffle=True, drop_last=False,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        self.batches = [b for _ in range(epochs) for b in loader]  # (fetched outside the steps)
        self.model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def step(self, i: int) -> torch.Tensor:
        x, y = self.batches[i % len(self.batches)]
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


class TransformerRandomLength(Program):
    name = "transformer_random_length"
    description = "a transformer LM whose batch is padded to a length drawn per step in [16, 128], with a padding mask"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        vocab, d, self.batch = 60, 32, 4
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        params = [*self.embed.parameters(), *self.encoder.parameters(), *self.head.parameters()]
        self.opt = torch.optim.AdamW(params, lr=1e-3)
        self.corpus = torch.randint(1, vocab, (self.batch, 129))

    def step(self, i: int) -> torch.Tensor:
        length = self.rng.randint(16, 128)
        # each sequence of the batch ends somewhere in the second half; the rest is padding
        ends = torch.tensor([self.rng.randint(length // 2, length) for _ in range(self.batch)])
        pad = torch.arange(length + 1)[None, :] >= ends[:, None]
        tokens = self.corpus[:, : length + 1].masked_fill(pad, 0)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        self.opt.zero_grad()
        h = self.encoder(self.embed(inputs), src_key_padding_mask=pad[:, :-1])
        loss = F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten(), ignore_index=0)
        loss.backward()
        self.opt.step()
        return loss.detach()


class Reinforce(Program):
    name = "reinforce"
    description = "REINFORCE on a random-walk corridor: episodes of 12-200 steps, torch.tensor(returns) of the episode's length"

    max_steps = 200

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.policy = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.gamma = 0.99

    def step(self, i: int) -> torch.Tensor:
        pos, last, log_probs, rewards = 0.0, 0.0, [], []
        for t in range(self.max_steps):
            obs = torch.tensor([pos / 6.0, t / self.max_steps, last, 1.0])
            dist = torch.distributions.Categorical(logits=self.policy(obs))
            action = dist.sample()
            log_probs.append(dist.log_prob(action))
            last = 2.0 * action.item() - 1.0
            pos += last + self.rng.choice((-1.0, 0.0, 1.0))  # the environment's own noise
            rewards.append(1.0 - abs(pos) / 6.0)
            if t + 1 >= 12 and abs(pos) > 5:  # fell off the corridor
                break
        returns, g = [], 0.0
        for r in reversed(rewards):
            g = r + self.gamma * g
            returns.insert(0, g)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + 1e-8)
        self.opt.zero_grad()
        loss = -(torch.stack(log_probs) * returns).sum()
        loss.backward()
        self.opt.step()
        return loss.detach()


class DetectionBoxes(Program):
    name = "detection_boxes"
    description = "a detector head whose box loss covers a data-dependent number of positive anchors (nonzero)"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(8, 1, 1)
        self.box = nn.Conv2d(8, 4, 1)
        params = [*self.backbone.parameters(), *self.cls.parameters(), *self.box.parameters()]
        self.opt = torch.optim.SGD(params, lr=0.02, momentum=0.9)
        self.images = []
        for _ in range(16):  # each image has 1-24 objects; an anchor is positive near one
            labels = torch.zeros(2, 10, 10)
            n = self.rng.randint(1, 24)
            for _obj in range(n):
                labels[self.rng.randrange(2), self.rng.randrange(10), self.rng.randrange(10)] = 1.0
            self.images.append((torch.randn(2, 3, 10, 10), labels, torch.randn(2, 4, 10, 10)))

    def step(self, i: int) -> torch.Tensor:
        x, labels, box_targets = self.images[self.rng.randrange(len(self.images))]
        self.opt.zero_grad()
        features = self.backbone(x)
        scores = self.cls(features).squeeze(1)  # (2, 10, 10)
        boxes = self.box(features).permute(0, 2, 3, 1)  # (2, 10, 10, 4)
        positives = labels.nonzero(as_tuple=True)  # a data-dependent number of anchors
        loss = F.binary_cross_entropy_with_logits(scores, labels)
        matched = boxes[positives]
        loss = loss + F.smooth_l1_loss(matched, box_targets.permute(0, 2, 3, 1)[positives])
        loss = loss + 0.1 * math.log(1 + matched.size(0)) * matched.pow(2).mean()
        loss.backward()
        self.opt.step()
        return loss.detach()


class MultiScaleCnn(Program):
    name = "multiscale_cnn"
    description = "a convolutional classifier trained on images of a size drawn per step in [40, 72] (multi-scale training)"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
        )  # fmt: skip
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.images = torch.randn(8, 3, 72, 72)
        self.labels = torch.randint(0, 10, (8,))

    def step(self, i: int) -> torch.Tensor:
        side = self.rng.randint(40, 72)
        x = F.interpolate(self.images, size=(side, side), mode="bilinear", align_corners=False)
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), self.labels)
        loss.backward()
        self.opt.step()
        return loss.detach()


DYNAMIC_PROGRAMS: list[type[Program]] = [
    WordLMLastChunk, ClassifierLastBatch, TransformerRandomLength, Reinforce, DetectionBoxes,
]  # fmt: skip
# (measured by bench/dynamic_sizes.py --programs multiscale_cnn, not in the e2e suite's
# interpret runs: a trace per size of a convolutional net takes the planner minutes)
MORE_DYNAMIC_PROGRAMS: list[type[Program]] = [MultiScaleCnn]
DYNAMIC_BY_NAME = {p.name: p for p in DYNAMIC_PROGRAMS + MORE_DYNAMIC_PROGRAMS}
