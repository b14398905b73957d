"""Calling a differentiable op straight on its kernel when no gradient can flow.

The ops with an autograd formula register it from Python (``torch.library.register_autograd``),
and PyTorch then routes every call through that Python layer, which checks for gradients and
redispatches: 4-8 µs a call on the quiet 2-core CI machine (a tiny ``ensemble_pseudo_labels``
call 18 µs against 10 µs below it; ~15 µs more on a busy one), most of a small call. When
nothing requires grad, or grad mode is off, the wrappers take the same switch PyTorch's layer
would take, without the layer. Under ``torch.compile`` they make the plain call, which it
traces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["below_autograd_unless_needed"]


def _requires_grad(item: Tensor | Sequence[Tensor] | None) -> bool:
    if item is None:
        return False
    if isinstance(item, Tensor):
        return item.requires_grad
    return any(t.requires_grad for t in item)


def below_autograd_unless_needed(
    *inputs: Tensor | Sequence[Tensor] | None,
) -> contextlib.AbstractContextManager:
    """A context for one op call: below the autograd layer when no gradient can flow to or from
    ``inputs`` (tensors, lists of tensors or None), a no-op context otherwise."""
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and any(_requires_grad(x) for x in inputs)
    ):
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()
