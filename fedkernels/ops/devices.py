"""The device checks of the ops' fake (meta) implementations, the same checks with the same
messages as the native host code (``check_device`` in ``csrc/common.h``).

The fakes need them because the dispatcher picks a kernel by the highest-priority device among
an op's tensors: with one tensor on ``meta`` and the rest on the CPU, it runs the fake, not the
native kernel, and a fake without these checks would hand back uninitialised memory as a CPU
result (or, for an in-place op, do nothing). Every tensor argument of every op is checked: all
on the parameters' device, except the small host-side ones (weights, lam, log_prior,
log_weights, grad_stats), which may also be on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["check_device", "check_list_device"]


def _subject(what: str, singular: str, plural: str) -> str:
    return f"{what} {plural if what.endswith('s') else singular}"


def check_device(
    op: str, tensor: Tensor, expected: torch.device, what: str, allow_cpu: bool = False
) -> None:
    """``ValueError("fedkernels.<op>: <what> is on <device>, expected <expected>")`` unless
    ``tensor`` is on ``expected`` (or, with ``allow_cpu``, on the CPU)."""
    if tensor.device == expected or (allow_cpu and tensor.device.type == "cpu"):
        return
    also = " (or cpu)" if allow_cpu and expected.type != "cpu" else ""
    raise ValueError(
        f"fedkernels.{op}: {_subject(what, 'is', 'are')} on {tensor.device}, "
        f"expected {expected}{also}"
    )


def check_list_device(
    op: str, tensors: Sequence[Tensor], expected: torch.device, name: str
) -> None:
    """:func:`check_device` for every tensor of a list (``"<name> tensor <i> is on ..."``)."""
    for i, x in enumerate(tensors):
        check_device(op, x, expected, f"{name} tensor {i}")
