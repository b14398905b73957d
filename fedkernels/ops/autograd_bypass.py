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

import torch
from torch import Tensor

__all__ = ["below_autograd_unless_needed", "grad_can_flow"]


def _requires_grad(item: object) -> bool:
    # Anything but a tensor or a list/tuple of them counts as not requiring grad, so that a
    # wrong argument reaches the op, whose check names it.
    if isinstance(item, Tensor):
        return item.requires_grad
    if isinstance(item, (list, tuple)):
        return any(isinstance(t, Tensor) and t.requires_grad for t in item)
    return False


def grad_can_flow(*inputs: object) -> bool:
    """Grad mode is on and one of ``inputs`` (tensors, lists of tensors, anything else ignored)
    requires grad."""
    return torch.is_grad_enabled() and any(_requires_grad(x) for x in inputs)


def below_autograd_unless_needed(*inputs: object) -> contextlib.AbstractContextManager:
    """A context for one op call: below the autograd layer when no gradient can flow to or from
    ``inputs``, a no-op context otherwise (and under ``torch.compile``)."""
    if torch.compiler.is_compiling() or grad_can_flow(*inputs):
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()
