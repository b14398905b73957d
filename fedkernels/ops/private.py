r"""Differential-privacy ops over K client models given as one client-major tensor list
(``clients[k * T + t]``) and the global model ``base`` (the rules and the noise stream:
``docs/algorithms/robust_and_private.md``):

- :func:`update_norms`: :math:`\lVert x_k - b\rVert_2` over all tensors, ``[K]`` float64, one
  pass (differences and sums in float64).
- :func:`private_sum` / :func:`private_sum_`: :math:`b + \sum_k c_k (x_k - b) + \sigma\varepsilon`
  in a second pass (the coefficients :math:`c_k` carry the weights and the clip factors). The
  noise :math:`\varepsilon` is the Philox-4x32-10 normal stream of :func:`fedkernels.sgld_step`
  with one key per call from ``generator``; element e of the model (all tensors in order) takes
  normal e. ``noise_std = 0`` draws nothing.

Arithmetic in float32 (float64 for float64 models); results in the clients' dtype. Not
differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .devices import check_device
from .native import refuse_jit_trace
from .robust import check_client_list, check_like_client_tensors

_ops = torch.ops.fedkernels

__all__ = ["update_norms", "private_sum", "private_sum_"]


def update_norms(clients: Sequence[Tensor], num_clients: int, base: Sequence[Tensor]) -> Tensor:
    """``[K]`` float64 norms of the client updates ``x_k - base`` over all tensors."""
    return _ops.update_norms(clients, num_clients, base)


def private_sum(clients: Sequence[Tensor], coefficients: Tensor, base: Sequence[Tensor],
                noise_std: float, generator: torch.Generator | None = None,
                out: Sequence[Tensor] | None = None) -> list[Tensor]:
    r""":math:`b + \sum_k c_k (x_k - b) + \sigma\varepsilon` (module docstring); into ``out``
    when given. ``coefficients``: ``[K]`` float64 on the CPU."""
    if out is None:
        return _ops.private_sum(clients, coefficients, base, float(noise_std), generator)
    refuse_jit_trace("private_sum.out")
    _ops.private_sum.out(clients, coefficients, base, float(noise_std), generator, out=out)
    return list(out)


def private_sum_(base: Sequence[Tensor], clients: Sequence[Tensor], coefficients: Tensor,
                 noise_std: float, generator: torch.Generator | None = None) -> None:
    """:func:`private_sum` written into ``base``."""
    refuse_jit_trace("private_sum_")
    _ops.private_sum_(base, clients, coefficients, float(noise_std), generator)


# ---------------------------------------------------------------- fake implementations


@torch.library.register_fake("fedkernels::update_norms")
def _norms_fake(clients, num_clients, base):
    T = check_client_list("update_norms", clients, num_clients)
    check_like_client_tensors("update_norms", clients, T, base, "base")
    device = clients[0].device if T else torch.device("cpu")
    return torch.empty((num_clients,), dtype=torch.float64, device=device)


def _sum_checks(op: str, clients, coefficients, base) -> int:
    torch._check(coefficients.dim() == 1,
                 lambda: f"fedkernels.{op}: coefficients must be 1-D [K]")
    T = check_client_list(op, clients, coefficients.shape[0])
    if T:  # host-side: the native op reads them on the CPU
        check_device(op, coefficients, clients[0].device, "coefficients", allow_cpu=True)
    check_like_client_tensors(op, clients, T, base, "base")
    return T


@torch.library.register_fake("fedkernels::private_sum")
def _sum_fake(clients, coefficients, base, noise_std, generator):
    T = _sum_checks("private_sum", clients, coefficients, base)
    return [torch.empty_like(clients[t])  # the kernel's at::empty_like: same strides
            for t in range(T)]


@torch.library.register_fake("fedkernels::private_sum.out")
def _sum_out_fake(clients, coefficients, base, noise_std, generator, *, out):
    T = _sum_checks("private_sum", clients, coefficients, base)
    check_like_client_tensors("private_sum", clients, T, out)


@torch.library.register_fake("fedkernels::private_sum_")
def _sum_inplace_fake(base, clients, coefficients, noise_std, generator):
    _sum_checks("private_sum_", clients, coefficients, base)
