"""Thin Python wrappers over the native ops (``torch.ops.fedkernels.*``), with the fake
(meta) implementations that let ``torch.compile`` trace them and the autograd formulas of the
differentiable ones. The friendly, structure-aware API is in :mod:`fedkernels.aggregate`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .autograd_bypass import EagerAutograd
from .devices import check_device, check_list_device
from .native import refuse_jit_trace

_ops = torch.ops.fedkernels


# ---------------------------------------------------------------- weighted_sum


def weighted_sum(
    updates: Sequence[Tensor],
    weights: Tensor,
    base: Sequence[Tensor] = (),
    scale: float = 1.0,
    delta: bool = False,
) -> list[Tensor]:
    """``fedkernels::weighted_sum`` on a client-major flat list (``updates[k*T + t]``).

    plain: ``scale * Σ_k w_k x_k``; with base and ``delta``: ``b + scale * Σ_k w_k (x_k - b)``;
    with base and not ``delta``: ``b + scale * Σ_k w_k x_k``.
    """
    updates, base = list(updates), list(base)
    return _WEIGHTED_SUM_AUTOGRAD(updates, weights, base, float(scale), bool(delta))


def weighted_sum_out(
    updates: Sequence[Tensor],
    weights: Tensor,
    base: Sequence[Tensor],
    scale: float,
    delta: bool,
    out: Sequence[Tensor],
) -> None:
    refuse_jit_trace("weighted_sum.out")
    _ops.weighted_sum.out(
        list(updates), weights, list(base), float(scale), bool(delta), out=list(out)
    )


def weighted_sum_(
    base: Sequence[Tensor],
    updates: Sequence[Tensor],
    weights: Tensor,
    scale: float = 1.0,
    delta: bool = True,
) -> None:
    """In place: ``b <- b + scale * Σ_k w_k (x_k - [delta] b)``."""
    refuse_jit_trace("weighted_sum_")
    _ops.weighted_sum_(list(base), list(updates), weights, float(scale), bool(delta))


def _num_tensors(updates: Sequence[Tensor], weights: Tensor) -> int:
    k = weights.numel()
    torch._check(k > 0, lambda: "fedkernels.weighted_sum: need at least one client")
    torch._check(
        len(updates) % k == 0,
        lambda: f"fedkernels.weighted_sum: {len(updates)} update tensors for {k} weights",
    )
    return len(updates) // k


def _check_devices(updates, weights, base, out=()) -> None:
    """The device checks of the native op (see :mod:`.devices` for why the fakes repeat them)."""
    device = updates[0].device if updates else weights.device
    check_device("weighted_sum", weights, device, "weights", allow_cpu=True)
    k_count = max(int(weights.numel()), 1)
    n = len(updates) // k_count
    for t in range(n):  # in the native op's order: tensor by tensor, clients in order
        for k in range(k_count):
            check_device("weighted_sum", updates[k * n + t], device, f"client {k}, tensor {t}")
    check_list_device("weighted_sum", base, device, "base")
    check_list_device("weighted_sum", out, device, "out")


@torch.library.register_fake("fedkernels::weighted_sum")
def _weighted_sum_fake(updates, weights, base, scale, delta):
    n = _num_tensors(updates, weights)
    _check_devices(updates, weights, base)
    torch._check(len(base) in (0, n), lambda: "fedkernels.weighted_sum: base length")
    return [
        updates[t].new_empty(updates[t].shape, dtype=base[t].dtype if base else updates[t].dtype)
        for t in range(n)
    ]


@torch.library.register_fake("fedkernels::weighted_sum.out")
def _weighted_sum_out_fake(updates, weights, base, scale, delta, *, out):
    n = _num_tensors(updates, weights)
    torch._check(len(out) == n, lambda: "fedkernels.weighted_sum: out length")
    _check_devices(updates, weights, base, out)


@torch.library.register_fake("fedkernels::weighted_sum_")
def _weighted_sum_inplace_fake(base, updates, weights, scale, delta):
    n = _num_tensors(updates, weights)
    torch._check(len(base) == n, lambda: "fedkernels.weighted_sum_: base length")
    _check_devices(updates, weights, base)


def _weighted_sum_setup(ctx, inputs, output):
    updates, weights, base, scale, delta = inputs
    ctx.num_tensors = len(updates) // weights.numel()
    ctx.scale, ctx.delta = scale, bool(delta) and len(base) > 0  # delta without base is plain
    ctx.save_for_backward(weights, *updates, *base)
    ctx.has_base = len(base) > 0


def _weighted_sum_backward(ctx, grads):
    """d out_t / d x_kt = scale·w_k;  d out_t / d b_t = 1 − [delta]·scale·Σw (or 0 without base);
    d out / d w_k = scale·Σ_t ⟨G_t, x_kt − [delta] b_t⟩. Only the gradients asked for are formed
    (the weights' reads every update in float64)."""
    weights, *rest = ctx.saved_tensors
    n = ctx.num_tensors
    k_count = weights.numel()
    updates, base = rest[: k_count * n], rest[k_count * n :]
    need_updates, need_weights, need_base = ctx.needs_input_grad[:3]
    grads = [torch.zeros_like(u) if g is None else g for g, u in zip(grads, updates[:n])]
    scale = ctx.scale
    grad_updates = [
        (grads[i % n] * (scale * weights[i // n])).to(updates[i].dtype) if need_updates[i] else None
        for i in range(len(updates))
    ]
    grad_weights = None
    if need_weights and n:
        grad_weights = torch.stack([
            scale * sum(
                (grads[t].double()
                 * (updates[k * n + t].double() - (base[t].double() if ctx.delta else 0))).sum()
                for t in range(n))
            for k in range(k_count)
        ]).to(device=weights.device, dtype=weights.dtype)
    elif need_weights:
        grad_weights = torch.zeros_like(weights)
    grad_base = [None] * len(base)
    if any(need_base):
        factor = 1.0 - scale * weights.sum() if ctx.delta else 1.0
        grad_base = [(grads[t] * factor).to(base[t].dtype) for t in range(n)]
    return grad_updates, grad_weights, grad_base, None, None


torch.library.register_autograd(
    "fedkernels::weighted_sum", _weighted_sum_backward, setup_context=_weighted_sum_setup
)
_WEIGHTED_SUM_AUTOGRAD = EagerAutograd(_ops.weighted_sum.default, _weighted_sum_setup,
                                       _weighted_sum_backward)
