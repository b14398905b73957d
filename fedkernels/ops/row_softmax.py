"""Softmax and log-softmax over the last dimension for the ops' backward formulas.

PyTorch's CPU softmax takes a slow path along rows shorter than a vector, several times slower
than a max, an exp and a sum, while along longer rows PyTorch's kernel is the faster. Ten
classes is the common case of the distillation and energy backward passes, so rows shorter than
:data:`SHORT_ROW` take the composition; it gives what ``torch.softmax`` gives, NaN rows where
a value is NaN or +inf included.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["SHORT_ROW", "log_softmax_last", "softmax_last"]

SHORT_ROW = 16


def _composed(x: Tensor) -> bool:
    return x.device.type == "cpu" and 0 < x.shape[-1] < SHORT_ROW


def softmax_last(x: Tensor) -> Tensor:
    """``torch.softmax(x, -1)``."""
    if not _composed(x):
        return torch.softmax(x, -1)
    # Out of place: under create_graph autograd keeps exp's result for the next derivative.
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def log_softmax_last(x: Tensor) -> Tensor:
    """``torch.log_softmax(x, -1)``."""
    if not _composed(x):
        return torch.log_softmax(x, -1)
    z = x - x.amax(-1, keepdim=True)
    return z - z.exp().sum(-1, keepdim=True).log()
