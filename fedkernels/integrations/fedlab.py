r"""Drop-ins for FedLab's server aggregation (``fedlab.utils.aggregator.Aggregators``) on the
fused ``weighted_sum`` op. FedLab itself is not needed to import or use this module; its
``pip install 'fedkernels[fedlab]'`` extra is for the tests that compare against it.

FedLab keeps a model as one flat *serialized* parameter vector (``SerializationTool``) and
aggregates K of them:

- FedAvg: :math:`x = \sum_k p_k x_k` with :math:`p_k = w_k / \sum_j w_j` (equal weights by
  default). FedLab stacks the K vectors into a ``[P, K]`` copy, multiplies by the weights and
  sums (three passes over K·P values and a K·P temporary); here it is one pass that reads each
  vector once and writes the result once, and no copy.
- FedAsync: :math:`x = (1 - \alpha)\,x_{server} + \alpha\,x_{new}`, one pass instead of two
  scaled copies and an add.

Replace the import and nothing else::

    from fedkernels.integrations.fedlab import Aggregators   # was: from fedlab.utils.aggregator

    global_vec = Aggregators.fedavg_aggregate(client_vectors, weights=num_samples)

Same arguments, result values (to the rounding of the vectors' precision) and result dtype:
the weights are normalized as FedLab does (``torch.tensor(weights)``, then divided by their
sum), and the result has the dtype FedLab's arithmetic would give (``float32`` vectors with
``float64`` weights, e.g. a NumPy array, give a ``float64`` result). Also accepted here: one
``[K, P]`` tensor instead of the list of K vectors, and CPU weights with CUDA vectors. Errors:
weights FedLab's ``assert`` refuses (negative or NaN once divided by their sum: mixed signs,
all zero, NaN or Inf) raise :class:`WeightError`, which is both FedLab's
``AssertionError`` and a ``ValueError``; an empty list, vectors of different shapes or
devices, and a weight count that is not K raise a ``ValueError`` naming the client.
Accumulation is in fp32 (fp64 for fp64 vectors), so a float64 result from float32 vectors
carries float32 rounding where FedLab multiplies in float64. Integer, mixed-dtype and sparse
vectors, and a FedAsync ``alpha`` that is not finite (or beyond the float32 range for
vectors that are not float64), go through FedLab's formula and give its result.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from fedkernels.aggregate import FLOAT32_MAX, aggregate
from fedkernels.ops import summation

__all__ = ["Aggregators", "WeightError", "fedasync_aggregate", "fedavg_aggregate"]

_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)


class WeightError(ValueError, AssertionError):
    """Negative, non-finite or all-zero aggregation weights. Also an ``AssertionError``, which
    is what FedLab's ``assert`` raises for them."""


def _vectors(serialized_params_list) -> list[Tensor]:
    if isinstance(serialized_params_list, Tensor):
        if serialized_params_list.dim() != 2:
            raise ValueError("fedavg_aggregate: a tensor of serialized parameters must be 2-D "
                             f"[K, P], got shape {tuple(serialized_params_list.shape)}")
        return list(serialized_params_list.unbind(0))
    if not isinstance(serialized_params_list, Sequence) or isinstance(serialized_params_list, str):
        raise TypeError("fedavg_aggregate: serialized_params_list must be a list of K tensors "
                        f"or a [K, P] tensor, got {type(serialized_params_list).__name__}")
    vectors = list(serialized_params_list)
    if not vectors:
        raise ValueError("fedavg_aggregate: serialized_params_list is empty (K = 0)")
    for k, v in enumerate(vectors):
        if not isinstance(v, Tensor):
            raise TypeError(f"fedavg_aggregate: client {k} is a {type(v).__name__}, not a tensor")
        first = vectors[0]
        if v.shape != first.shape:
            raise ValueError(f"fedavg_aggregate: client {k} has shape {tuple(v.shape)}, client 0 "
                             f"has {tuple(first.shape)}")
        if v.device != first.device:
            raise ValueError(f"fedavg_aggregate: client {k} is on {v.device}, client 0 on "
                             f"{first.device}")
    return vectors


def fedavg_aggregate(serialized_params_list, weights=None) -> Tensor:
    r"""FedLab's ``Aggregators.fedavg_aggregate`` in one fused pass:
    :math:`\sum_k \frac{w_k}{\sum_j w_j} x_k`.

    Args:
        serialized_params_list: K serialized parameter vectors (a list of tensors of one shape,
            usually 1-D ``[P]``), or one ``[K, P]`` tensor.
        weights: K non-negative numbers (list, NumPy array or tensor); equal when None.

    Returns:
        The weighted mean, shaped like one vector, in the dtype FedLab would return.
    """
    vectors = _vectors(serialized_params_list)
    k = len(vectors)
    if weights is None:
        weights = torch.ones(k)
    if not isinstance(weights, Tensor):
        weights = torch.tensor(weights)
    if weights.dim() != 1 or weights.numel() != k:
        raise ValueError(f"fedavg_aggregate: {k} clients but weights of shape "
                         f"{tuple(weights.shape)}; expected {k} numbers")
    weights = weights / torch.sum(weights)
    bad = (~(weights >= 0)).nonzero().flatten().tolist()
    if bad:
        raise WeightError(f"fedavg_aggregate: weights should be non-negative values (normalized "
                          f"weight of client {bad[0]} is {weights[bad[0]].item()}; all-zero or "
                          "non-finite weights give NaN)")
    dtype = vectors[0].dtype
    result_dtype = torch.result_type(vectors[0], weights)
    if (dtype not in _FUSED_DTYPES or any(v.dtype != dtype for v in vectors)
            or any(v.layout != torch.strided for v in vectors)
            or (weights.requires_grad and torch.is_grad_enabled())):
        # FedLab's formula for what the op does not take (integer, mixed-dtype or sparse
        # vectors), and for weights that require grad, whose gradient FedLab's result carries.
        return torch.sum(torch.stack(vectors, dim=-1) * weights.to(vectors[0].device), dim=-1)
    w = weights.detach().to("cpu", torch.float64)
    if dtype in _HALF and result_dtype != dtype:
        # FedLab promotes half vectors times float32/64 weights: sum straight into a float32
        # accumulator rather than round the mean to half first.
        acc = torch.zeros(vectors[0].shape, dtype=torch.float32, device=vectors[0].device)
        summation.weighted_sum_([acc], vectors, w, 1.0, False)
        return acc.to(result_dtype)
    fused = aggregate(vectors, w)
    return fused if fused.dtype == result_dtype else fused.to(result_dtype)


def fedasync_aggregate(server_param: Tensor, new_param: Tensor, alpha) -> Tensor:
    r"""FedLab's ``Aggregators.fedasync_aggregate`` in one fused pass:
    :math:`(1 - \alpha)\,x_{server} + \alpha\,x_{new}`."""
    if not isinstance(server_param, Tensor) or not isinstance(new_param, Tensor):
        raise TypeError("fedasync_aggregate: server_param and new_param must be tensors, got "
                        f"{type(server_param).__name__} and {type(new_param).__name__}")
    if server_param.shape != new_param.shape:
        raise ValueError(f"fedasync_aggregate: new_param has shape {tuple(new_param.shape)}, "
                         f"server_param {tuple(server_param.shape)}")
    # One real number, read as a float; anything else (a tensor of several values, or one
    # that requires grad, a complex number) takes FedLab's formula and its result.
    scalar = (isinstance(alpha, numbers.Real) if not isinstance(alpha, Tensor) else
              alpha.dim() == 0 and not alpha.is_complex()
              and not (alpha.requires_grad and torch.is_grad_enabled()))
    a = float(alpha) if scalar else math.nan
    # The op refuses weights 1 - alpha and alpha that are not finite, or beyond the float32
    # range of its accumulator; FedLab's formula gives its NaN/Inf there.
    limit = math.inf if server_param.dtype == torch.float64 else FLOAT32_MAX
    in_range = math.isfinite(a) and max(abs(a), abs(1.0 - a)) <= limit
    if (not in_range or server_param.dtype not in _FUSED_DTYPES
            or new_param.dtype != server_param.dtype or new_param.device != server_param.device
            or server_param.layout != torch.strided or new_param.layout != torch.strided):
        return torch.mul(1 - alpha, server_param) + torch.mul(alpha, new_param)
    result_dtype = torch.result_type(server_param, alpha if isinstance(alpha, Tensor) else a)
    fused = aggregate([server_param, new_param], [1.0 - a, a])
    return fused if fused.dtype == result_dtype else fused.to(result_dtype)


class Aggregators:
    """``fedlab.utils.aggregator.Aggregators`` with fused arithmetic (same static methods)."""

    fedavg_aggregate = staticmethod(fedavg_aggregate)
    fedasync_aggregate = staticmethod(fedasync_aggregate)
