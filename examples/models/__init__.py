"""A model zoo in plain PyTorch (no downloads), sized for a CPU: the models OLLA and Rockmate
report on, at small inputs. ``ZOO[name](batch)`` returns a :class:`ZooModel` whose ``step()``
is one SGD training step; gradients are released after the update
(``zero_grad(set_to_none=True)`` at the end of the step), so a planner may free each gradient
as soon as its update ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPT
from .lstm import LSTMLanguageModel
from .mobilenet import MobileNetV2
from .resnet import resnet18, resnet50
from .vgg import vgg11


@dataclass
class ZooModel:
    name: str
    model: nn.Module
    inputs: tuple
    loss: Callable[..., torch.Tensor]
    optimizer: torch.optim.Optimizer

    def step(self) -> torch.Tensor:
        out = self.model(self.inputs[0])
        loss = self.loss(out, self.inputs[1])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _image_classifier(name: str, make: Callable[[], nn.Module], size: int, classes: int = 10):
    def build(batch: int, seed: int = 0) -> ZooModel:
        torch.manual_seed(seed)
        model = make()
        x = torch.randn(batch, 3, size, size)
        y = torch.randint(0, classes, (batch,))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return ZooModel(name, model, (x, y), F.cross_entropy, opt)

    return build


def _mlp(batch: int, seed: int = 0) -> ZooModel:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return ZooModel("mlp", model, (torch.randn(batch, 256), torch.randint(0, 10, (batch,))), F.cross_entropy, opt)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gpt(batch: int, seed: int = 0) -> ZooModel:
    torch.manual_seed(seed)
    model = GPT(vocab=512, d_model=128, n_layers=6, n_heads=4, seq_len=64)
    tokens = torch.randint(0, 512, (batch, 65))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return ZooModel("gpt2-6l", model, (tokens[:, :-1], tokens[:, 1:]), _lm_loss, opt)


def _lstm(batch: int, seed: int = 0) -> ZooModel:
    torch.manual_seed(seed)
    model = LSTMLanguageModel(vocab=512, d_model=128, hidden=256, layers=2)
    tokens = torch.randint(0, 512, (batch, 33))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return ZooModel("lstm-lm", model, (tokens[:, :-1], tokens[:, 1:]), _lm_loss, opt)


ZOO: dict[str, Callable[..., ZooModel]] = {
    "resnet18": _image_classifier("resnet18", resnet18, 64),
    "resnet50": _image_classifier("resnet50", resnet50, 64),
    "mobilenet_v2": _image_classifier("mobilenet_v2", MobileNetV2, 64),
    "vgg11": _image_classifier("vgg11", vgg11, 64),
    "gpt2-6l": _gpt,
    "lstm-lm": _lstm,
    "mlp": _mlp,
}
