"""The small task that every example in examples/ trains, so that their costs compare.

scikit-learn's digits (1,797 real 8x8 images, shipped inside scikit-learn: no download), 20 %
held out for the server's evaluation and the rest split evenly among the clients (IID), an MLP
64-64-10 that starts from the same weights everywhere, and one local epoch of SGD per round
(batch 16, learning rate 0.1). The file is the same in every example folder.
"""

from __future__ import annotations

import torch
from torch import nn


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    # one fixed shuffle, so the test rows and the shards are the same in every example
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[: len(y) // 5], order[len(y) // 5:]
    return x[train], y[train], x[test], y[test]


def load_partition(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition_id``'s training rows: one of ``num_partitions`` even IID shards."""
    x, y, _, _ = _digits()
    shard = torch.arange(len(y)).tensor_split(num_partitions)[partition_id]
    return x[shard], y[shard]


def load_test() -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out rows (360 images) on which the server evaluates the global model."""
    _, _, x, y = _digits()
    return x, y


class MLP(nn.Sequential):
    """The MLP 64-64-10 (4,810 parameters), with the same initial weights on every call: a
    class that builds itself without arguments, so that a framework can too (NVFlare's
    persistor does)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.uniform_(-0.125, 0.125, generator=generator)


def make_model() -> nn.Module:
    return MLP()


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1,
          batch_size: int = 16, lr: float = 0.1, seed: int = 0) -> float:
    """Local SGD on (x, y) in place; returns the mean training loss of the last epoch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    total = 0.0
    for _ in range(epochs):
        total = 0.0
        for batch in torch.randperm(len(y), generator=generator).split(batch_size):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
    return total / len(y)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy) of the model on (x, y)."""
    model.eval()
    logits = model(x)
    accuracy = (logits.argmax(1) == y).float().mean().item()
    return nn.functional.cross_entropy(logits, y).item(), accuracy
