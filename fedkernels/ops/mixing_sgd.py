r"""SuPerFed's local step with the optimizer folded into the mixing op's backward
(math: ``docs/algorithms/superfed.md``, section 8).

With :func:`~fedkernels.superfed_mix` and ``torch.optim.SGD``, a step of the two endpoints makes
three trips over the parameters after the network's backward: the mixing backward writes the
gradients of ``g`` and ``l``, and the optimizer reads them back with the parameters and momentum
buffers, in several ``_foreach`` passes per endpoint. ``fedkernels::superfed_sgd_step_`` does it
in one pass: each element's gradients

.. math::

    \nabla_g = (1-\lambda) G + H_0 l + 2H_1 g + 2H_3 (g - a), \qquad
    \nabla_l = \lambda G + H_0 g + 2H_2 l

(``G`` the mixed model's gradient, ``H`` the regularizer's gradient with respect to the
statistics rows) go straight into torch.optim.SGD's update of ``g``, ``l`` and their momentum
buffers, and are never stored.

:class:`SuPerFedSGD` packages it as an optimizer: ``mix(lam)`` gives the mixed parameters (leaf
tensors for the network) and the regularizer, and ``step()`` after the backward updates both
endpoints. It computes what :func:`~fedkernels.superfed_mix` followed by ``torch.optim.SGD`` over
``g + l`` computes (same settings, same momentum state), up to rounding: the fused update rounds
once per element where the composition rounds after each ``_foreach`` op (to the parameters'
dtype, so bfloat16 parameters differ by more than float32 ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .concurrency import one_call_at_a_time
from .devices import check_device, check_list_device
from .mixing import (
    COSINE_EPS,
    _check_coefficients,
    _check_same_length,
    _loss_dtype,
    mix_endpoints_with_stats,
    orthogonality_from_stats,
    proximal_from_stats,
)
from .native import refuse_jit_trace

_ops = torch.ops.fedkernels

__all__ = ["SuPerFedSGD", "superfed_sgd_step_"]


def superfed_sgd_step_(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor],
    global_momentum: Sequence[Tensor],
    local_momentum: Sequence[Tensor],
    grads: Sequence[Tensor],
    grad_stats: Tensor,
    lam: float | Sequence[float] | Tensor,
    anchor: Sequence[Tensor] = (),
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_step: bool | tuple[bool, bool] = False,
) -> None:
    r"""One SGD step of both endpoints, in place, from the gradient ``grads`` of the mixed
    parameters :math:`\theta = (1-\lambda) g + \lambda l` and ``grad_stats``
    (:math:`H = \partial\,\mathrm{loss}/\partial\,\mathrm{stats}`, ``[T, 4]``, for the rows of
    :func:`~fedkernels.ops.mixing.mix_endpoints_with_stats` with the same ``anchor``).

    The update is torch.optim.SGD's (weight decay, momentum with ``dampening``, ``nesterov``).
    With ``momentum > 0`` the buffers ``global_momentum`` and ``local_momentum`` are updated in
    place; with ``first_step`` (one flag, or one for ``g``'s and one for ``l``'s) they are only
    written (torch's first step sets a buffer to the gradient). With ``momentum == 0`` they must
    be empty lists. As PyTorch's in-place ops, with grad mode on it refuses parameters that
    are leaves requiring grad: call it under ``torch.no_grad()``, as an optimizer's step is.
    """
    if not isinstance(lam, Tensor):
        lam = torch.tensor(lam, dtype=torch.float64, device="cpu")
    first = (first_step, first_step) if isinstance(first_step, bool) else tuple(first_step)
    refuse_jit_trace("superfed_sgd_step_")
    _ops.superfed_sgd_step_(
        list(global_params), list(local_params), list(global_momentum), list(local_momentum),
        list(grads), grad_stats, lam, list(anchor), float(lr), float(momentum),
        float(dampening), float(weight_decay), bool(nesterov), [bool(x) for x in first],
    )


@torch.library.register_fake("fedkernels::superfed_sgd_step_")
def _superfed_sgd_step_fake(
    global_params, local_params, global_momentum, local_momentum, grads, grad_stats, lam, anchor,
    lr, momentum, dampening, weight_decay, nesterov, first_step,
):
    op = "superfed_sgd_step_"
    lists = [("local_params", local_params), ("grads", grads),
             ("global_momentum", global_momentum), ("local_momentum", local_momentum),
             ("anchor", anchor)]
    for name, tensors in lists:
        if name in ("local_params", "grads") or tensors:
            _check_same_length(op, global_params, tensors, "global_params", name)
    device = global_params[0].device if global_params else lam.device
    check_list_device(op, global_params, device, "global_params")
    for name, tensors in lists:
        check_list_device(op, tensors, device, name)
    check_device(op, lam, device, "lam", allow_cpu=True)
    check_device(op, grad_stats, device, "grad_stats", allow_cpu=True)


class SuPerFedSGD(torch.optim.Optimizer):
    r"""``torch.optim.SGD`` over both SuPerFed endpoints, fused with the mixing op's backward.

    ::

        opt = fedkernels.SuPerFedSGD(g, l, anchor, lr=0.01, momentum=0.9, nu=1.0, mu=0.01)
        for x, y in batches:
            theta, reg = opt.mix(lam)           # theta: leaves that require grad
            loss = F.cross_entropy(torch.func.functional_call(model, dict(zip(names, theta)),
                                                              (x,)), y)
            (loss + reg).backward()
            opt.step()                          # updates g and l in place

    ``global_params`` (``g``) and ``local_params`` (``l``) are the two endpoints; ``anchor`` the
    round's global model for the proximal term (``None``: no proximal term). ``nu``, ``mu``,
    ``prox_form``, ``per_tensor``, ``numerator_eps`` and ``eps`` define the regularizer as in
    :func:`~fedkernels.superfed_mix`; ``lr``, ``momentum``, ``dampening``, ``weight_decay`` and
    ``nesterov`` the update, as in ``torch.optim.SGD``.

    The result is that of :func:`~fedkernels.superfed_mix` with ``torch.optim.SGD(g + l, ...)``
    (up to rounding; see the module docstring). As there, every tensor of both endpoints is
    updated in every step, also one whose mixed copy the loss did not use (its gradient is then
    the regularizer's alone, or zero: weight decay and momentum still apply). The parameters
    form one group (``g`` then ``l``), so a learning-rate scheduler and ``state_dict`` work as
    with SGD over ``g + l``, momentum buffers included.

    Not for concurrent use (as ``torch.optim`` optimizers): :meth:`mix` or :meth:`step` called
    while another thread is inside one of them raises ``RuntimeError`` without touching the
    parameters.
    """

    def __init__(
        self,
        global_params: Sequence[Tensor],
        local_params: Sequence[Tensor],
        anchor: Sequence[Tensor] | None = None,
        *,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        nu: float,
        mu: float,
        prox_form: str = "paper",
        per_tensor: bool = False,
        numerator_eps: float = 0.0,
        eps: float = COSINE_EPS,
    ) -> None:
        g, l = list(global_params), list(local_params)
        if len(g) != len(l):
            raise ValueError(
                f"fedkernels.SuPerFedSGD: local_params has {len(l)} tensors, global_params "
                f"has {len(g)}"
            )
        if not g:
            raise ValueError("fedkernels.SuPerFedSGD: global_params is empty")
        for name, value in (("lr", lr), ("momentum", momentum), ("dampening", dampening),
                            ("weight_decay", weight_decay)):
            if not (isinstance(value, (int, float)) and value >= 0 and value == value
                    and value != float("inf")):
                raise ValueError(f"fedkernels.SuPerFedSGD: {name} must be finite and >= 0, "
                                 f"got {value!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("fedkernels.SuPerFedSGD: nesterov needs momentum > 0 and "
                             "dampening 0")
        _check_coefficients("SuPerFedSGD", nu=nu, mu=mu, numerator_eps=numerator_eps, eps=eps)
        if prox_form not in ("paper", "code"):
            raise ValueError(f"fedkernels.SuPerFedSGD: prox_form must be 'paper' or 'code', "
                             f"not {prox_form!r}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(g + l, defaults)
        self.num_tensors = len(g)
        self.anchor = [a.detach() for a in anchor] if anchor is not None and mu != 0 else []
        self.nu, self.mu, self.prox_form = nu, mu, prox_form
        self.per_tensor, self.numerator_eps, self.eps = per_tensor, numerator_eps, eps
        self._pending: tuple[list[Tensor], Tensor, Tensor] | None = None

    @property
    def global_params(self) -> list[Tensor]:
        return self.param_groups[0]["params"][: self.num_tensors]

    @property
    def local_params(self) -> list[Tensor]:
        return self.param_groups[0]["params"][self.num_tensors :]

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:
            raise ValueError("fedkernels.SuPerFedSGD has one parameter group (g then l)")
        super().add_param_group(param_group)

    @one_call_at_a_time("fedkernels.SuPerFedSGD")
    def mix(self, lam: float | Sequence[float] | Tensor) -> tuple[list[Tensor], Tensor]:
        r"""``(theta, reg)``: the mixed parameters :math:`(1-\lambda) g + \lambda l` as fresh
        leaf tensors that require grad (give them to the network), and the regularizer
        :math:`\nu\cos^2(g, l) + R_{prox}(g, a)` (a scalar that depends on the statistics of
        this one fused pass). Add ``reg`` to the loss, call ``backward``, then :meth:`step`."""
        if not isinstance(lam, Tensor):
            lam = torch.tensor(lam, dtype=torch.float64, device="cpu")
        g, l = self.global_params, self.local_params
        with torch.no_grad():
            theta, stats = mix_endpoints_with_stats(g, l, lam, self.anchor)
        theta = [t.requires_grad_() for t in theta]
        stats.requires_grad_()
        total = torch.zeros((), dtype=torch.float64, device=stats.device)
        if self.nu != 0:
            cos2 = orthogonality_from_stats(
                stats, [x.numel() for x in g], self.per_tensor, self.numerator_eps, self.eps
            )
            total = total + self.nu * cos2.sum()
        if self.anchor:
            total = total + proximal_from_stats(stats, self.mu, self.prox_form)
        self._pending = (theta, stats, lam.detach())
        return theta, total.to(_loss_dtype(g))

    @torch.no_grad()
    @one_call_at_a_time("fedkernels.SuPerFedSGD")
    def step(self, closure=None) -> None:
        """Updates ``g``, ``l`` and the momentum buffers from the gradients of the last
        :meth:`mix`'s outputs (after ``backward``). ``closure`` is not supported."""
        if closure is not None:
            raise ValueError("fedkernels.SuPerFedSGD.step takes no closure")
        if self._pending is None:
            raise RuntimeError("fedkernels.SuPerFedSGD.step: call mix() and backward() first")
        theta, stats, lam = self._pending
        grad_stats = stats.grad
        if grad_stats is None and all(t.grad is None for t in theta):
            raise RuntimeError(
                "fedkernels.SuPerFedSGD.step: no gradient reached the mixed parameters or the "
                "regularizer; call backward() on a loss that uses them first"
            )
        group = self.param_groups[0]
        n = self.num_tensors
        g, l = self.global_params, self.local_params
        if grad_stats is None:
            grad_stats = torch.zeros((n, 4), dtype=torch.float64, device=stats.device)
        momentum = group["momentum"]
        # One call per kind of momentum state: (g's buffer is new, l's buffer is new). All
        # tensors share one in an ordinary run; a loaded SGD state may hold some buffers only.
        calls: dict[tuple[bool, bool], list[int]] = {}
        for t in range(n):
            first = tuple(momentum != 0 and self.state[p].get("momentum_buffer") is None
                          for p in (g[t], l[t]))
            calls.setdefault(first, []).append(t)
        for first, pick in calls.items():
            grads = [theta[t].grad if theta[t].grad is not None else torch.zeros_like(theta[t])
                     for t in pick]
            buffers_g, buffers_l = [], []
            created = []  # new buffers enter the state only once the op has filled them
            if momentum != 0:
                for t in pick:
                    for p, out in ((g[t], buffers_g), (l[t], buffers_l)):
                        buf = self.state[p].get("momentum_buffer")
                        if buf is None:
                            buf = torch.empty_like(p, memory_format=torch.preserve_format)
                            created.append((p, buf))
                        out.append(buf)
            every = len(pick) == n  # the whole model: the lists as they are
            superfed_sgd_step_(
                g if every else [g[t] for t in pick], l if every else [l[t] for t in pick],
                buffers_g, buffers_l, grads, grad_stats if every else grad_stats[pick],
                lam if every or lam.numel() == 1 else lam.reshape(-1)[pick],
                (self.anchor if every else [self.anchor[t] for t in pick]) if self.anchor else [],
                lr=group["lr"], momentum=momentum, dampening=group["dampening"],
                weight_decay=group["weight_decay"], nesterov=group["nesterov"], first_step=first,
            )
            for p, buf in created:
                self.state[p]["momentum_buffer"] = buf
        self._pending = None
