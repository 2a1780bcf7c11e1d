"""VGG-11 (Simonyan and Zisserman 2015, configuration A) with batch norm."""

from __future__ import annotations

from torch import nn


def vgg11(classes: int = 10) -> nn.Module:
    layers, cin = [], 3
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
            cin = v
    return nn.Sequential(
        *layers, nn.Flatten(), nn.Linear(512 * 2 * 2, 512), nn.ReLU(inplace=True),
        nn.Dropout(0.5), nn.Linear(512, classes),
    )  # fmt: skip
