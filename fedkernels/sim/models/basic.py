"""The simulator's first models: logistic regression, an MLP and a small CNN."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ConfigError


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: ``logits = W x + b``."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


class RowBatchNorm(nn.BatchNorm1d):
    """``nn.BatchNorm1d`` that normalises a training batch of one row with its running
    statistics, as in evaluation: one row has no batch statistics (PyTorch raises), and a
    client may hold a single training row."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training and x.shape[0] == 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        return super().forward(x)


class MLP(nn.Module):
    """Fully connected ReLU network; optional BatchNorm after each hidden layer, optional
    bias-free linear layers."""

    def __init__(
        self,
        num_features: int,
        hidden: list[int],
        num_classes: int,
        batch_norm: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for h in hidden:
            layers.append(nn.Linear(width, h, bias=bias))
            if batch_norm:
                layers.append(RowBatchNorm(h))
            layers.append(nn.ReLU())
            width = h
        layers.append(nn.Linear(width, num_classes, bias=bias))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class SmallCNN(nn.Module):
    """Two conv3x3 (padding 1) + ReLU + maxpool2 blocks, then a linear layer; for small
    images such as the 8x8 digits (8x8 -> 4x4 -> 2x2). Rows are viewed as ``image_shape``."""

    def __init__(
        self,
        image_shape: tuple[int, ...],
        num_classes: int,
        channels: list[int] = (16, 32),
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if len(image_shape) != 3:
            raise ConfigError(
                f"cnn needs a (channels, height, width) image shape, got {image_shape}"
            )
        self.image_shape = tuple(image_shape)
        blocks: list[nn.Module] = []
        width = image_shape[0]
        for c in channels:
            blocks.append(nn.Conv2d(width, c, 3, padding=1))
            if batch_norm:
                blocks.append(nn.BatchNorm2d(c))
            blocks += [nn.ReLU(), nn.MaxPool2d(2)]
            width = c
        self.features = nn.Sequential(*blocks)
        side = math.prod(s // 4 for s in image_shape[1:])
        if side == 0:
            raise ConfigError(f"cnn needs images of at least 4x4, got {image_shape}")
        self.head = nn.Linear(width * side, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = x.view(x.shape[0], *self.image_shape)
        return self.head(self.features(x).flatten(1))
