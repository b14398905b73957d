r"""SuPerFed's fused ops (math: ``docs/algorithms/superfed.md``, sections 2-4 and 8).

Native ops do the work, each with a fake (``torch.compile``) and an autograd formula:

- ``fedkernels::mix_endpoints``: the mixed model
  :math:`\theta_t = (1-\lambda_t) g_t + \lambda_t l_t` of the global (federated) endpoint ``g`` and
  the local endpoint ``l``, with one :math:`\lambda` for all tensors (model mixing, MM) or one
  per tensor (layer mixing, LM).
  Its backward is one pass: :math:`(1-\lambda)G` to ``g``, :math:`\lambda G` to ``l`` and
  :math:`\langle G, l - g\rangle` to :math:`\lambda`.
- ``fedkernels::superfed_stats``: one read pass over ``g``, ``l`` and the round's anchor
  :math:`a = \theta_0` giving float64 per-tensor rows
  :math:`[\langle g,l\rangle, \|g\|^2, \|l\|^2, \|g-a\|^2]`. Both regularizers are scalar functions
  of these rows, so :func:`superfed_regularizer` costs one reduction pass forward and one fused
  elementwise pass backward whatever combination of terms is asked for.
- ``fedkernels::mix_endpoints_with_stats``: both of the above in one pass over ``g``, ``l``, ``a``,
  and one pass back that writes each endpoint's whole gradient (mixing plus regularizers) once:
  :func:`superfed_mix`, the SuPerFed local step's op.

The regularizers (with :math:`s = \langle g, l\rangle`, :math:`A = \|g\|^2`, :math:`B = \|l\|^2`):

- orthogonality :math:`\cos^2(g, l) = (s + \varepsilon_n N)^2 / (A B + \varepsilon)`, over the whole
  flattened model (the paper's and the official code's form) or per tensor. ``numerator_eps``
  :math:`\varepsilon_n` is the official code's per-element ``1e-6`` (0 in the paper form; N is the
  number of elements); ``eps`` :math:`\varepsilon` (default :data:`COSINE_EPS` = 1e-12, added to
  :math:`AB` in float64) keeps the value and the gradient finite when a norm is zero: with
  :math:`\varepsilon_n = 0` and :math:`A = 0` or :math:`B = 0`, the value and the gradient are 0.
  It changes the result by a relative :math:`\varepsilon/(AB)`, i.e. nothing for any real model.
- proximal term, paper form :math:`\tfrac{\mu}{2}\sum_p \|g^p - a^p\|^2`, or the official code's
  :math:`\mu \sum_p \|g^p - a^p\|` (unsquared, a sum of per-tensor norms), whose gradient
  :math:`\mu (g^p - a^p)/\|g^p - a^p\|` is taken as 0 where the norm is 0 (the first step of every
  round), as torch's ``norm`` does.

The coefficients :math:`\nu`, :math:`\mu`, ``eps`` and ``numerator_eps`` must be finite and
:math:`\ge 0` (a ``ValueError`` names the one that is not); 0 leaves a term out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import reference
from .autograd_bypass import (
    EagerAutograd,
    backward_through_reference,
)
from .devices import check_device, check_list_device

_ops = torch.ops.fedkernels

COSINE_EPS = 1e-12
PROX_FORMS = ("paper", "code")

__all__ = [
    "COSINE_EPS",
    "mix_endpoints",
    "superfed_stats",
    "cosine_orthogonality",
    "proximal_term",
    "superfed_regularizer",
    "superfed_mix",
    "mix_endpoints_with_stats",
    "orthogonality_from_stats",
    "proximal_from_stats",
]


# ---------------------------------------------------------------- public API


def mix_endpoints(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor],
    lam: float | Sequence[float] | Tensor,
) -> list[Tensor]:
    r"""The mixed model :math:`\theta_t = (1-\lambda_t) g_t + \lambda_t l_t` of two tensor lists.

    ``lam``: one value for every tensor (SuPerFed-MM) or one per tensor (SuPerFed-LM), as a
    number, a sequence or a tensor (on the CPU or the parameters' device). Computed as
    ``torch.lerp`` does (exact endpoints at 0 and 1), in fp32 for half types. Differentiable in
    all three arguments.
    """
    if not isinstance(lam, Tensor):
        lam = torch.tensor(lam, dtype=torch.float64, device="cpu")
    g, l = list(global_params), list(local_params)
    return _MIX_AUTOGRAD(g, l, lam)


def superfed_stats(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor] = (),
    anchor: Sequence[Tensor] = (),
) -> Tensor:
    r"""Float64 ``[T, 4]``: per tensor :math:`[\langle g,l\rangle, \|g\|^2, \|l\|^2, \|g-a\|^2]`
    (a column is 0 when its list is not given). One fused read pass; differentiable. An empty
    model (all three lists empty) gives a ``[0, 4]`` tensor on the CPU."""
    g, l, a = list(global_params), list(local_params), list(anchor)
    if not (g or l or a):  # no tensor to dispatch on: the native op cannot be called
        return torch.zeros((0, 4), dtype=torch.float64, device="cpu")
    return _STATS_AUTOGRAD(g, l, a)


def orthogonality_from_stats(
    stats: Tensor,
    numels: Sequence[int],
    per_tensor: bool = False,
    numerator_eps: float = 0.0,
    eps: float = COSINE_EPS,
) -> Tensor:
    r""":math:`(s + \varepsilon_n N)^2/(AB + \varepsilon)` from :func:`superfed_stats` rows, over
    the whole flattened model (a scalar) or per tensor (``[T]``), in float64."""
    s, a, b = stats[:, 0], stats[:, 1], stats[:, 2]
    if not per_tensor:
        s, a, b = s.sum(), a.sum(), b.sum()
    num = s
    if numerator_eps:
        if any(isinstance(x, torch.SymInt) for x in numels):
            # Traced with dynamic shapes: float() of a symbol would fix the graph to the
            # traced sizes, so the counts become tensors by tensor ops.
            n = torch.stack([torch.scalar_tensor(x, dtype=stats.dtype, device=stats.device)
                             for x in numels])
        else:
            n = torch.tensor([float(x) for x in numels], dtype=stats.dtype, device=stats.device)
        num = s + numerator_eps * (n if per_tensor else n.sum())
    return num * num / (a * b + eps)


def proximal_from_stats(stats: Tensor, mu: float, form: str = "paper") -> Tensor:
    r"""Paper: :math:`\tfrac{\mu}{2}\sum_p \|g^p-a^p\|^2`; code: :math:`\mu\sum_p \|g^p-a^p\|`
    (gradient 0 where a norm is 0), from :func:`superfed_stats` rows, in float64."""
    d = stats[:, 3]
    if form == "paper":
        return 0.5 * mu * d.sum()
    if form == "code":
        positive = d > 0
        root = torch.sqrt(torch.where(positive, d, torch.ones_like(d)))
        return mu * torch.where(positive, root, torch.zeros_like(d)).sum()
    raise ValueError(f"proximal form must be one of {PROX_FORMS}, not {form!r}")


def cosine_orthogonality(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor],
    per_tensor: bool = False,
    *,
    numerator_eps: float = 0.0,
    eps: float = COSINE_EPS,
) -> Tensor:
    r""":math:`\cos^2(g, l)` over the whole flattened model (or per tensor, ``[T]``); see the
    module docstring for ``numerator_eps`` and ``eps``. Float32 (float64 for float64
    parameters)."""
    _check_coefficients("cosine_orthogonality", numerator_eps=numerator_eps, eps=eps)
    g = list(global_params)
    stats = superfed_stats(g, local_params)
    value = orthogonality_from_stats(stats, [x.numel() for x in g], per_tensor, numerator_eps, eps)
    return value.to(_loss_dtype(g))


def proximal_term(
    global_params: Sequence[Tensor],
    anchor: Sequence[Tensor],
    mu: float = 1.0,
    form: str = "paper",
) -> Tensor:
    r"""FedProx-style anchor term: ``"paper"`` :math:`\tfrac{\mu}{2}\|g - a\|^2`, ``"code"``
    :math:`\mu\sum_p\|g^p - a^p\|`. Float32 (float64 for float64 parameters)."""
    _check_coefficients("proximal_term", mu=mu)
    g = list(global_params)
    return proximal_from_stats(superfed_stats(g, (), anchor), mu, form).to(_loss_dtype(g))


def superfed_regularizer(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor] | None,
    anchor: Sequence[Tensor] | None,
    *,
    nu: float,
    mu: float,
    prox_form: str = "paper",
    per_tensor: bool = False,
    numerator_eps: float = 0.0,
    eps: float = COSINE_EPS,
) -> Tensor:
    r"""SuPerFed's :math:`\Omega = \nu\cos^2(g, l) + R_{prox}(g, a)` from ONE fused statistics
    pass (forward) and one fused elementwise pass (backward). A term whose coefficient is 0, or
    whose list is ``None``, is left out (its inputs are not read). Per-tensor cosines are summed."""
    _check_coefficients("superfed_regularizer", nu=nu, mu=mu, numerator_eps=numerator_eps, eps=eps)
    g = list(global_params)
    use_orth = nu != 0 and local_params is not None
    use_prox = mu != 0 and anchor is not None
    if not (use_orth or use_prox):
        dtype = _loss_dtype(g)
        device = g[0].device if g else None
        return torch.zeros((), dtype=dtype, device=device)
    stats = superfed_stats(
        g, list(local_params) if use_orth else (), list(anchor) if use_prox else ()
    )
    total = None
    if use_orth:
        cos2 = orthogonality_from_stats(
            stats, [x.numel() for x in g], per_tensor, numerator_eps, eps
        )
        total = nu * cos2.sum()
    if use_prox:
        prox = proximal_from_stats(stats, mu, prox_form)
        total = prox if total is None else total + prox
    return total.to(_loss_dtype(g))


def mix_endpoints_with_stats(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor],
    lam: float | Sequence[float] | Tensor,
    anchor: Sequence[Tensor] = (),
) -> tuple[list[Tensor], Tensor]:
    r""":func:`mix_endpoints` and :func:`superfed_stats` ``(g, l, anchor)`` in one pass over the
    parameters (and one pass backward, where the gradients of both meet): returns the mixed
    parameters and the float64 ``[T, 4]`` statistics rows."""
    if not isinstance(lam, Tensor):
        lam = torch.tensor(lam, dtype=torch.float64, device="cpu")
    g, l, a = list(global_params), list(local_params), list(anchor)
    theta, stats = _MIX_STATS_AUTOGRAD(g, l, lam, a)
    return list(theta), stats


def superfed_mix(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor],
    lam: float | Sequence[float] | Tensor,
    anchor: Sequence[Tensor] | None = None,
    *,
    nu: float,
    mu: float,
    prox_form: str = "paper",
    per_tensor: bool = False,
    numerator_eps: float = 0.0,
    eps: float = COSINE_EPS,
) -> tuple[list[Tensor], Tensor]:
    r"""Everything of a SuPerFed local step but the network: the mixed parameters
    :math:`\theta = (1-\lambda) g + \lambda l` and :math:`\Omega = \nu\cos^2(g, l) + R_{prox}(g, a)`
    (as :func:`superfed_regularizer`), from one fused pass over ``g``, ``l``, ``anchor``; the
    backward is one fused pass too (``(1-\lambda)G + \partial\Omega/\partial g`` and
    ``\lambda G + \partial\Omega/\partial l`` written once, with no separate accumulation)."""
    _check_coefficients("superfed_mix", nu=nu, mu=mu, numerator_eps=numerator_eps, eps=eps)
    g = list(global_params)
    use_prox = mu != 0 and anchor is not None
    theta, stats = mix_endpoints_with_stats(g, local_params, lam, list(anchor) if use_prox else ())
    total = torch.zeros((), dtype=torch.float64, device=stats.device)
    if nu != 0:
        cos2 = orthogonality_from_stats(
            stats, [x.numel() for x in g], per_tensor, numerator_eps, eps
        )
        total = total + nu * cos2.sum()
    if use_prox:
        total = total + proximal_from_stats(stats, mu, prox_form)
    return theta, total.to(_loss_dtype(g))


def _check_coefficients(op: str, **coefficients) -> None:
    """The regularizers' weights (nu, mu) and the cosine's epsilons must be finite and >= 0: a
    negative weight would reward what the term penalises, and a NaN would reach every gradient.
    Plain numbers only; a tensor coefficient is the caller's to check (reading it here would
    synchronise a GPU and break a compiled graph)."""
    for name, value in coefficients.items():
        if isinstance(value, (int, float)) and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"fedkernels.{op}: {name} must be finite and >= 0, got {value}")


def _loss_dtype(params: Sequence[Tensor]) -> torch.dtype:
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


# ---------------------------------------------------------------- fake implementations


def _check_same_length(op: str, a, b, name_a: str, name_b: str) -> None:
    torch._check(
        len(a) == len(b),
        lambda: f"fedkernels.{op}: {name_b} has {len(b)} tensors, {name_a} has {len(a)}",
    )


def _check_inputs(op, global_params, lists=(), optional=(), lam=None, grad_stats=None):
    """The native op's checks of list lengths and devices (see :mod:`.devices`); returns the
    parameters' device: global_params' own, or for an empty model lam's (grad_stats'), else
    the CPU. ``lists``: (name, list) that match global_params; ``optional``: the same, but an
    empty list means "not given"."""
    for name, tensors in lists:
        _check_same_length(op, global_params, tensors, "global_params", name)
    for name, tensors in optional:
        if tensors or not global_params:
            _check_same_length(op, global_params, tensors, "global_params", name)
    other = lam if lam is not None else grad_stats
    if global_params:
        device = global_params[0].device
    else:
        device = other.device if other is not None else torch.device("cpu")
    check_list_device(op, global_params, device, "global_params")
    for name, tensors in (*lists, *optional):
        check_list_device(op, tensors, device, name)
    if lam is not None:
        check_device(op, lam, device, "lam", allow_cpu=True)
    if grad_stats is not None:
        check_device(op, grad_stats, device, "grad_stats", allow_cpu=True)
    return device


def _like(global_params, wanted=True):
    return [g.new_empty(g.shape) for g in global_params] if wanted else []


def _stats(global_params, device):
    return torch.empty((len(global_params), 4), dtype=torch.float64, device=device)


@torch.library.register_fake("fedkernels::mix_endpoints")
def _mix_endpoints_fake(global_params, local_params, lam):
    _check_inputs("mix_endpoints", global_params, [("local_params", local_params)], lam=lam)
    return _like(global_params)


@torch.library.register_fake("fedkernels::mix_endpoints_backward")
def _mix_endpoints_backward_fake(grads, global_params, local_params, lam, output_mask):
    _check_inputs(
        "mix_endpoints_backward", global_params,
        [("local_params", local_params), ("grads", grads)], lam=lam,
    )
    return (
        _like(global_params, output_mask[0]),
        _like(global_params, output_mask[1]),
        lam.new_empty(lam.shape),
    )


@torch.library.register_fake("fedkernels::superfed_stats")
def _superfed_stats_fake(global_params, local_params, anchor):
    device = _check_inputs(
        "superfed_stats", global_params,
        optional=[("local_params", local_params), ("anchor", anchor)],
    )
    return _stats(global_params, device)


@torch.library.register_fake("fedkernels::superfed_stats_backward")
def _superfed_stats_backward_fake(grad_stats, global_params, local_params, anchor, output_mask):
    _check_inputs(
        "superfed_stats_backward", global_params,
        optional=[("local_params", local_params), ("anchor", anchor)], grad_stats=grad_stats,
    )
    return (
        _like(global_params, output_mask[0]),
        _like(global_params, output_mask[1] and len(local_params) > 0),
        _like(global_params, output_mask[2] and len(anchor) > 0),
    )


@torch.library.register_fake("fedkernels::mix_endpoints_with_stats")
def _mix_endpoints_with_stats_fake(global_params, local_params, lam, anchor):
    device = _check_inputs(
        "mix_endpoints_with_stats", global_params, [("local_params", local_params)],
        optional=[("anchor", anchor)], lam=lam,
    )
    return _like(global_params), _stats(global_params, device)


@torch.library.register_fake("fedkernels::mix_endpoints_with_stats_backward")
def _mix_endpoints_with_stats_backward_fake(
    grads, grad_stats, global_params, local_params, lam, anchor, output_mask
):
    _check_inputs(
        "mix_endpoints_with_stats_backward", global_params,
        [("local_params", local_params), ("grads", grads)], optional=[("anchor", anchor)],
        lam=lam, grad_stats=grad_stats,
    )
    return (
        _like(global_params, output_mask[0]),
        _like(global_params, output_mask[1]),
        lam.new_empty(lam.shape),
        _like(global_params, output_mask[3] and len(anchor) > 0),
    )


# ---------------------------------------------------------------- autograd


def _mix_setup(ctx, inputs, output):
    global_params, local_params, lam = inputs
    ctx.num_tensors = len(global_params)
    ctx.save_for_backward(*global_params, *local_params, lam)


def _mix_backward(ctx, grads):
    n = ctx.num_tensors
    saved = ctx.saved_tensors
    g, l, lam = list(saved[:n]), list(saved[n : 2 * n]), saved[2 * n]
    if torch.is_grad_enabled():  # create_graph: a backward that can be differentiated again
        return backward_through_reference(
            reference.mix_endpoints_reference, (g, l, lam), ctx.needs_input_grad, (grads,))
    need_g, need_l, need_lam = ctx.needs_input_grad
    mask = [any(need_g), any(need_l), bool(need_lam)]
    grads = [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, g)]
    grad_g, grad_l, grad_lam = _ops.mix_endpoints_backward(grads, g, l, lam, mask)
    return (
        grad_g if mask[0] else [None] * n,
        grad_l if mask[1] else [None] * n,
        grad_lam if mask[2] else None,
    )


torch.library.register_autograd(
    "fedkernels::mix_endpoints", _mix_backward, setup_context=_mix_setup
)
_MIX_AUTOGRAD = EagerAutograd(_ops.mix_endpoints.default, _mix_setup, _mix_backward)


def _stats_setup(ctx, inputs, output):
    global_params, local_params, anchor = inputs
    ctx.sizes = (len(global_params), len(local_params), len(anchor))
    ctx.save_for_backward(*global_params, *local_params, *anchor)


def _stats_backward(ctx, grad_stats):
    ng, nl, na = ctx.sizes
    saved = ctx.saved_tensors
    g, l, a = list(saved[:ng]), list(saved[ng : ng + nl]), list(saved[ng + nl :])
    if torch.is_grad_enabled():
        return backward_through_reference(
            reference.superfed_stats_reference, (g, l, a), ctx.needs_input_grad, (grad_stats,))
    need_g, need_l, need_a = ctx.needs_input_grad
    mask = [any(need_g), any(need_l), any(need_a)]
    grad_g, grad_l, grad_a = _ops.superfed_stats_backward(grad_stats, g, l, a, mask)
    return (
        grad_g if mask[0] else [None] * ng,
        grad_l if mask[1] else [None] * nl,
        grad_a if mask[2] else [None] * na,
    )


torch.library.register_autograd(
    "fedkernels::superfed_stats", _stats_backward, setup_context=_stats_setup
)
_STATS_AUTOGRAD = EagerAutograd(_ops.superfed_stats.default, _stats_setup, _stats_backward)


def _mix_with_stats_reference(g, l, lam, a):
    return (reference.mix_endpoints_reference(g, l, lam),
            reference.superfed_stats_reference(g, l, a))


def _mix_stats_setup(ctx, inputs, output):
    global_params, local_params, lam, anchor = inputs
    ctx.sizes = (len(global_params), len(anchor))
    ctx.save_for_backward(*global_params, *local_params, lam, *anchor)


def _mix_stats_backward(ctx, grads, grad_stats):
    n, na = ctx.sizes
    saved = ctx.saved_tensors
    g, l, lam, a = list(saved[:n]), list(saved[n : 2 * n]), saved[2 * n], list(saved[2 * n + 1 :])
    if torch.is_grad_enabled():
        return backward_through_reference(
            _mix_with_stats_reference, (g, l, lam, a), ctx.needs_input_grad, (grads, grad_stats))
    need_g, need_l, need_lam, need_a = ctx.needs_input_grad
    mask = [any(need_g), any(need_l), bool(need_lam), any(need_a)]
    grads = [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, g)]
    if grad_stats is None:
        grad_stats = torch.zeros((n, 4), dtype=torch.float64, device=lam.device)
    grad_g, grad_l, grad_lam, grad_a = _ops.mix_endpoints_with_stats_backward(
        grads, grad_stats, g, l, lam, a, mask
    )
    return (
        grad_g if mask[0] else [None] * n,
        grad_l if mask[1] else [None] * n,
        grad_lam if mask[2] else None,
        grad_a if mask[3] else [None] * na,
    )


torch.library.register_autograd(
    "fedkernels::mix_endpoints_with_stats", _mix_stats_backward, setup_context=_mix_stats_setup
)
_MIX_STATS_AUTOGRAD = EagerAutograd(_ops.mix_endpoints_with_stats.default, _mix_stats_setup,
                                    _mix_stats_backward)
