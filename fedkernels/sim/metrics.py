r"""Evaluation of a model on many clients at once, and the statistics over clients.

For per-client accuracies :math:`a_1..a_N` (each on the client's own test split):

- mean and standard deviation (population, ``ddof = 0``);
- worst-10% / best-10%: the mean of the :math:`\max(1, \lfloor 0.1 N \rfloor)` smallest /
  largest values (``docs/algorithms/fairness.md``, "12. Evaluation metrics");
- Gini coefficient :math:`G = \sum_i\sum_j |a_i - a_j| / (2 N^2 \bar a)` (0 when all are
  equal or the mean is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EVAL_CHUNK = 8192


@dataclass
class ClientEvaluation:
    """Per-client mean cross-entropy ``loss``, ``accuracy`` and sample ``count`` (``[K]``)."""

    loss: Tensor
    accuracy: Tensor
    count: Tensor

    def pooled_loss(self) -> float:
        """Mean loss over all samples of all clients."""
        return float((self.loss * self.count).sum() / self.count.sum())

    def pooled_accuracy(self) -> float:
        """Accuracy over all samples of all clients."""
        return float((self.accuracy * self.count).sum() / self.count.sum())


@torch.no_grad()
def evaluate_clients(model: nn.Module, xs: list[Tensor], ys: list[Tensor]) -> ClientEvaluation:
    """Evaluates ``model`` (in eval mode) on each client's ``(xs[k], ys[k])`` with one forward
    pass over their concatenation, reduced per client."""
    was_training = model.training
    model.eval()
    try:
        x, y = torch.cat(xs), torch.cat(ys)
        count = torch.tensor([len(t) for t in ys], dtype=torch.float64)
        owner = torch.repeat_interleave(torch.arange(len(ys)), count.long())
        logits = torch.cat([model(chunk) for chunk in x.split(EVAL_CHUNK)])
        losses = F.cross_entropy(logits, y, reduction="none").double()
        correct = (logits.argmax(dim=1) == y).double()
        k = len(ys)
        loss = torch.zeros(k, dtype=torch.float64).index_add_(0, owner, losses) / count
        accuracy = torch.zeros(k, dtype=torch.float64).index_add_(0, owner, correct) / count
        return ClientEvaluation(loss, accuracy, count)
    finally:
        model.train(was_training)


def gini(values: Tensor) -> float:
    """Gini coefficient of non-negative values (module docstring)."""
    v = values.double()
    mean = v.mean()
    if v.numel() == 0 or mean <= 0:
        return 0.0
    return float((v[:, None] - v[None, :]).abs().sum() / (2 * v.numel() ** 2 * mean))


def distribution_summary(values: Tensor, tail: float = 0.1) -> dict[str, float]:
    """``mean``, ``std``, ``worst10``, ``best10``, ``min``, ``max``, ``gini`` of per-client
    values (the tail is ``tail`` of the clients, at least one)."""
    v = values.double().sort().values
    m = max(1, int(v.numel() * tail))
    label = f"{round(tail * 100)}"
    return {
        "mean": float(v.mean()),
        "std": float(v.std(correction=0)),
        f"worst{label}": float(v[:m].mean()),
        f"best{label}": float(v[-m:].mean()),
        "min": float(v[0]),
        "max": float(v[-1]),
        "gini": gini(v),
    }
