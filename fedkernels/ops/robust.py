r"""Robust-aggregation ops over K client models given as one client-major tensor list
(``clients[k * T + t]`` is tensor t of client k), one pass per coordinate, no ``[K, P]`` stack
(the rules and their NumPy/Flower equivalents: ``docs/algorithms/robust_and_private.md``):

- :func:`coordinate_median`: ``np.median`` over the clients (even K: the two middle values'
  sum, halved, in the accumulate type); NaN where any client is NaN.
- :func:`trimmed_mean`: the mean of ranks ``[cut, K - cut)`` of each coordinate (NaN sorts
  last), summed in ascending order.
- :func:`median_window_mean`: the mean of the ``window`` values closest to the median (the last
  step of Bulyan).
- :func:`pairwise_sq_distances`: the ``[K, K]`` float64 matrix of squared L2 distances over all
  tensors, differences and sums in float64 (Krum, Multi-Krum, Bulyan).

Accumulate type: float32 for float32/float16/bfloat16, float64 for float64. Results have the
clients' dtype. None of these ops is differentiable (they are server-side aggregations).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .devices import check_device
from .native import refuse_jit_trace

_ops = torch.ops.fedkernels

__all__ = ["coordinate_median", "trimmed_mean", "median_window_mean", "pairwise_sq_distances"]


def coordinate_median(clients: Sequence[Tensor], num_clients: int,
                      out: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Coordinate-wise median of the K clients (module docstring); into ``out`` when given."""
    if out is None:
        return _ops.coordinate_median(clients, num_clients)
    refuse_jit_trace("coordinate_median.out")
    _ops.coordinate_median.out(clients, num_clients, out=out)
    return list(out)


def _check_cut(cut: int, num_clients: int) -> None:
    # The native op's check (robust_host.h), for the traced (fake) op: a traced call is refused
    # when it is traced, not only when the kernel runs.
    if num_clients > 0 and not 0 <= cut < num_clients - cut:  # K <= 0: the op's error
        raise ValueError(f"fedkernels.trimmed_mean: cut must be in [0, K/2) for K = "
                         f"{num_clients} clients (it drops `cut` values at each end), got {cut}")


def trimmed_mean(clients: Sequence[Tensor], num_clients: int, cut: int,
                 out: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Mean of ranks ``[cut, K - cut)`` per coordinate; into ``out`` when given."""
    if out is None:
        return _ops.trimmed_mean(clients, num_clients, cut)
    refuse_jit_trace("trimmed_mean.out")
    _ops.trimmed_mean.out(clients, num_clients, cut, out=out)
    return list(out)


def median_window_mean(clients: Sequence[Tensor], num_clients: int, window: int,
                       out: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Mean of the ``window`` values closest to the coordinate's median; into ``out``."""
    if out is None:
        return _ops.median_window_mean(clients, num_clients, window)
    refuse_jit_trace("median_window_mean.out")
    _ops.median_window_mean.out(clients, num_clients, window, out=out)
    return list(out)


def pairwise_sq_distances(clients: Sequence[Tensor], num_clients: int) -> Tensor:
    """``[K, K]`` float64 squared L2 distances between the clients over all their tensors."""
    return _ops.pairwise_sq_distances(clients, num_clients)


# ---------------------------------------------------------------- fake implementations


def lazy_message(message: str):
    """The message callable of ``torch._check``, its text built now (loop variables bound)."""
    return lambda: message


def check_client_list(op: str, clients, num_clients: int) -> int:
    torch._check(num_clients > 0, lambda: f"fedkernels.{op}: need at least one client")
    torch._check(len(clients) % num_clients == 0,
                 lambda: f"fedkernels.{op}: got {len(clients)} client tensors for "
                         f"{num_clients} clients; expected K * T tensors, client-major")
    T = len(clients) // num_clients
    for t in range(T):
        ref = clients[t]
        for k in range(num_clients):
            x = clients[k * T + t]
            check_device(op, x, clients[0].device, f"client {k}, tensor {t}")
            torch._check(x.shape == ref.shape,
                         lazy_message(f"fedkernels.{op}: client {k}, tensor {t} has shape "
                               f"{tuple(x.shape)}, client 0 has {tuple(ref.shape)}"))
    return T


def check_like_client_tensors(op: str, clients, T: int, tensors, name: str = "out") -> None:
    """``tensors`` (``out``, ``base``) are T tensors on the clients' device, shaped like them."""
    torch._check(len(tensors) == T, lambda: f"fedkernels.{op}: {name} has {len(tensors)} "
                                            f"tensors, clients have {T}")
    for t in range(T):
        check_device(op, tensors[t], clients[t].device, f"{name} tensor {t}")
        torch._check(tensors[t].shape == clients[t].shape,
                     lazy_message(f"fedkernels.{op}: {name} tensor {t} has shape "
                                  f"{tuple(tensors[t].shape)}, clients have "
                                  f"{tuple(clients[t].shape)}"))


def _register_order_stat(op: str, extra: bool) -> None:
    if extra:
        @torch.library.register_fake(f"fedkernels::{op}")
        def _fake(clients, num_clients, param):
            T = check_client_list(op, clients, num_clients)
            if op == "trimmed_mean":  # traced calls: refused before the kernel runs
                _check_cut(param, num_clients)
            return [torch.empty_like(clients[t])  # the kernel's at::empty_like: same strides
                    for t in range(T)]

        @torch.library.register_fake(f"fedkernels::{op}.out")
        def _fake_out(clients, num_clients, param, *, out):
            check_like_client_tensors(op, clients, check_client_list(op, clients, num_clients), out)
            if op == "trimmed_mean":
                _check_cut(param, num_clients)
    else:
        @torch.library.register_fake(f"fedkernels::{op}")
        def _fake(clients, num_clients):
            T = check_client_list(op, clients, num_clients)
            return [torch.empty_like(clients[t])  # the kernel's at::empty_like: same strides
                    for t in range(T)]

        @torch.library.register_fake(f"fedkernels::{op}.out")
        def _fake_out(clients, num_clients, *, out):
            check_like_client_tensors(op, clients, check_client_list(op, clients, num_clients), out)


_register_order_stat("coordinate_median", extra=False)
_register_order_stat("trimmed_mean", extra=True)
_register_order_stat("median_window_mean", extra=True)


@torch.library.register_fake("fedkernels::pairwise_sq_distances")
def _distances_fake(clients, num_clients):
    T = check_client_list("pairwise_sq_distances", clients, num_clients)
    device = clients[0].device if T else torch.device("cpu")
    return torch.empty((num_clients, num_clients), dtype=torch.float64, device=device)
