r"""SGLD and energy-composition ops of FedEvg (math: ``docs/algorithms/fedevg.md``, sections 2,
4, 5 and 8).

- :func:`energy_from_logits`: :math:`E(x, y) = -f(x)[y]` (class-conditional) or
  :math:`E(x) = -\log\sum_y e^{f(x)[y]}` (marginal, JEM's p(x)), differentiable in the logits
  (:math:`\partial E/\partial f = -\mathrm{onehot}(y)` or :math:`-\mathrm{softmax}(f)`).
- :func:`sgld_step` / :func:`sgld_step_`: one fused Langevin step
  :math:`x' = \mathrm{clamp}(x - \gamma\,\mathrm{clip}(\nabla E, -\tau, \tau) + \sigma\varepsilon, lo, hi)`
  (step and noise decoupled as in JEM's short-run SGLD: the textbook form is
  ``step_size=α/2, noise_std=sqrt(α)``).
- :func:`sgld_compose_step`: the server step of FedEvg: per sample j,
  :math:`\pi_{kj} = \mathrm{softmax}_k(\log w_k + \phi(-E_{kj}))` with :math:`\phi` the identity
  (``mode="exact"``, the gradient of the mixture's energy) or ``sign`` (``mode="signed"``, what
  FedEvg uses), :math:`a_j = \sum_k \pi_{kj}\,\mathrm{clip}(G_{kj})`, then the step above, in one
  pass over ``grads``.

Noise: :math:`\varepsilon` is ``noise`` when given (exact tests), else standard normals from a
counter-based Philox-4x32-10 stream keyed by one draw from ``generator`` (the default generator
of x's device when None; on CUDA its Philox seed and offset): a seeded generator reproduces a
run, and CPU and CUDA compute the same per-element formula. The SGLD ops are samplers and have
no autograd formula (call them under ``torch.no_grad()`` or on tensors that do not require grad).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .autograd_bypass import EagerAutograd
from .devices import check_device
from .row_softmax import softmax_last

_ops = torch.ops.fedkernels

MODES = ("exact", "signed")

__all__ = ["MODES", "energy_from_logits", "sgld_step", "sgld_step_", "sgld_compose_step"]


def _bounds(clamp: tuple[float | None, float | None] | None) -> tuple[float | None, float | None]:
    if clamp is None:
        return None, None
    lo, hi = clamp
    return (None if lo is None else float(lo)), (None if hi is None else float(hi))


def _opt(v: float | None) -> float | None:
    return None if v is None else float(v)


def energy_from_logits(logits: Tensor, labels: Tensor | None = None) -> Tensor:
    r"""Energies ``[N]`` of ``logits[N, C]``: :math:`-f_i[y_i]` with ``labels`` (int64 ``[N]``),
    :math:`-\mathrm{logsumexp}_c f_{ic}` without; in ``logits``' dtype."""
    return _ENERGY_AUTOGRAD(logits, labels)


def sgld_step(
    x: Tensor,
    grad: Tensor,
    *,
    step_size: float,
    noise_std: float,
    grad_clip: float | None = None,
    clamp: tuple[float | None, float | None] | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> Tensor:
    r""":math:`\mathrm{clamp}(x - \gamma\,\mathrm{clip}(g, -\tau, \tau) + \sigma\varepsilon, lo, hi)`
    as a new tensor (module docstring); ``clamp=(lo, hi)``, either bound may be None."""
    lo, hi = _bounds(clamp)
    return _ops.sgld_step(
        x, grad, float(step_size), float(noise_std), _opt(grad_clip), lo, hi, noise, generator
    )


def sgld_step_(
    x: Tensor,
    grad: Tensor,
    *,
    step_size: float,
    noise_std: float,
    grad_clip: float | None = None,
    clamp: tuple[float | None, float | None] | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> Tensor:
    """:func:`sgld_step` written into ``x``; returns ``x``."""
    lo, hi = _bounds(clamp)
    _ops.sgld_step_(
        x, grad, float(step_size), float(noise_std), _opt(grad_clip), lo, hi, noise, generator
    )
    return x


def sgld_compose_step(
    x: Tensor,
    grads: Tensor,
    energies: Tensor,
    log_weights: Tensor,
    *,
    mode: str = "exact",
    step_size: float,
    noise_std: float,
    grad_clip: float | None = None,
    clamp: tuple[float | None, float | None] | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    inplace: bool = False,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""One composed SGLD step of ``x[M, ...]`` from K clients' ``grads[K, M, ...]`` and
    ``energies[K, M]`` with mixing ``log_weights[K]`` (module docstring). Returns ``x'`` (``x``
    itself when ``inplace``), and the weights ``pi[K, M]`` (fp32; fp64 for fp64 x) with
    ``return_weights``."""
    lo, hi = _bounds(clamp)
    args = (
        x, grads, energies, log_weights, mode, float(step_size), float(noise_std),
        _opt(grad_clip), lo, hi, noise, generator,
    )
    if inplace:
        pi = _ops.sgld_compose_step_(*args)
        out = x
    else:
        out, pi = _ops.sgld_compose_step(*args)
    return (out, pi) if return_weights else out


# ---------------------------------------------------------------- fake implementations


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("fedkernels::energy_from_logits")
def _energy_fake(logits, labels):
    torch._check(
        logits.dim() == 2,
        lambda: f"fedkernels.energy_from_logits: logits must be [N, C], got {logits.dim()}-D",
    )
    if labels is not None:
        check_device("energy_from_logits", labels, logits.device, "labels")
    return logits.new_empty((logits.shape[0],))


def _step_checks(op, x, grad, noise):
    torch._check(grad.shape == x.shape, lambda: f"fedkernels.{op}: grad and x differ in shape")
    check_device(op, grad, x.device, "grad")
    if noise is not None:
        check_device(op, noise, x.device, "noise")


@torch.library.register_fake("fedkernels::sgld_step")
def _sgld_step_fake(x, grad, step_size, noise_std, grad_clip, clamp_min, clamp_max, noise, generator):
    _step_checks("sgld_step", x, grad, noise)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fedkernels::sgld_step_")
def _sgld_step_inplace_fake(x, grad, step_size, noise_std, grad_clip, clamp_min, clamp_max, noise, generator):
    _step_checks("sgld_step_", x, grad, noise)
    return None


def _compose_checks(op, x, grads, energies, log_weights, noise):
    torch._check(
        grads.dim() == x.dim() + 1 and grads.shape[1:] == x.shape,
        lambda: f"fedkernels.{op}: grads must be [K, M, ...] with [M, ...] = x.shape",
    )
    check_device(op, grads, x.device, "grads")
    k, m = grads.shape[0], x.shape[0]
    torch._check(
        energies.dim() == 2 and energies.shape[0] == k and energies.shape[1] == m,
        lambda: f"fedkernels.{op}: energies must be [K, M]",
    )
    check_device(op, energies, x.device, "energies")
    check_device(op, log_weights, x.device, "log_weights", allow_cpu=True)
    if noise is not None:
        check_device(op, noise, x.device, "noise")
    return x.new_empty((k, m), dtype=_acc(x.dtype))


@torch.library.register_fake("fedkernels::sgld_compose_step")
def _compose_fake(x, grads, energies, log_weights, weighting, step_size, noise_std, grad_clip,
                  clamp_min, clamp_max, noise, generator):
    pi = _compose_checks("sgld_compose_step", x, grads, energies, log_weights, noise)
    return torch.empty_like(x, memory_format=torch.contiguous_format), pi


@torch.library.register_fake("fedkernels::sgld_compose_step_")
def _compose_inplace_fake(x, grads, energies, log_weights, weighting, step_size, noise_std, grad_clip,
                          clamp_min, clamp_max, noise, generator):
    return _compose_checks("sgld_compose_step_", x, grads, energies, log_weights, noise)


# ---------------------------------------------------------------- autograd (energy only)


def _energy_setup(ctx, inputs, output):
    logits, labels = inputs
    ctx.has_labels = labels is not None
    ctx.save_for_backward(logits, labels)


def _energy_backward(ctx, grad_e):
    """dE/df = -onehot(y) (conditional) or -softmax(f) (marginal), times the incoming grad."""
    logits, labels = ctx.saved_tensors
    acc = _acc(logits.dtype)
    g = grad_e.to(acc)[:, None]
    if ctx.has_labels:
        onehot = torch.zeros(logits.shape, dtype=acc, device=logits.device)
        onehot.scatter_(1, labels[:, None], 1.0)
        grad = -onehot * g
    else:
        grad = -softmax_last(logits.to(acc)) * g
    return grad.to(logits.dtype), None


torch.library.register_autograd(
    "fedkernels::energy_from_logits", _energy_backward, setup_context=_energy_setup
)
_ENERGY_AUTOGRAD = EagerAutograd(_ops.energy_from_logits.default, _energy_setup, _energy_backward)


@torch.library.register_vmap("fedkernels::energy_from_logits")
def _energy_vmap(info, in_dims, logits, labels):
    """Under ``torch.vmap``: the batch's rows as one call of B * N rows (each row's energy
    depends on that row alone)."""
    def batched(t, dim):
        return t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)

    x = batched(logits, in_dims[0])
    y = None if labels is None else batched(labels, in_dims[1])
    # checked per entry before the rows are merged, where the op's own check would see B * N
    if x.dim() != 3 or (y is not None and y.shape[1:] != x.shape[1:2]):
        got = "" if y is None else f" and labels {list(y.shape[1:])}"
        raise ValueError(f"fedkernels.energy_from_logits: logits must be [N, C] and labels [N], "
                         f"got logits {list(x.shape[1:])}{got} per vmap entry")
    y = None if y is None else y.reshape(-1)
    energies = _ops.energy_from_logits(x.reshape(-1, x.shape[-1]), y)
    return energies.reshape(info.batch_size, x.shape[1]), 0
