"""Pure-PyTorch references of every fedkernels op.

They are written for clarity, not speed: the tests compare the native ops against them and
the benchmarks time them as the baseline a user could write. The native ops never fall back
to them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def weighted_sum_reference(
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float] | Tensor,
    base: Sequence[Tensor] | None = None,
    scale: float = 1.0,
    delta: bool = False,
) -> list[Tensor]:
    """Tensor-list form of ``fedkernels::weighted_sum``: ``updates[k][t]`` is tensor t of client k.

    plain: ``scale * sum_k w_k x_k``; delta: ``b + scale * sum_k w_k (x_k - b)``;
    accumulate (base without delta): ``b + scale * sum_k w_k x_k``. Accumulates in client order
    in fp32 (fp64 for fp64 inputs) and stores in base's dtype (or the updates').
    """
    w = torch.as_tensor(weights, dtype=torch.float64).tolist()
    result = []
    for t in range(len(updates[0])):
        acc_dtype = _acc_dtype(updates[0][t].dtype)
        b = None if base is None else base[t].to(acc_dtype)
        acc = torch.zeros(updates[0][t].shape, dtype=acc_dtype, device=updates[0][t].device)
        for k, client in enumerate(updates):
            x = client[t].to(acc_dtype)
            acc = acc + w[k] * (x - b if delta else x)
        res = scale * acc if b is None else b + scale * acc
        out_dtype = updates[0][t].dtype if base is None else base[t].dtype
        result.append(res.to(out_dtype))
    return result


def _int_reference(values: list[Tensor], base: Tensor | None, policy: str) -> Tensor:
    if policy == "first":
        return values[0].clone()
    if policy == "skip":
        return (base if base is not None else values[0]).clone()
    if policy == "max":
        out = values[0].clone()
        for v in values[1:]:
            out = torch.maximum(out, v)
        return out
    raise TypeError(f"integer tensor with int_policy={policy!r}")


def aggregate_reference(
    updates,
    weights,
    *,
    base=None,
    scale: float = 1.0,
    normalize: bool = False,
    int_policy: str = "max",
):
    """What :func:`fedkernels.aggregate` computes, written with plain loops.

    ``updates`` is a list of state_dicts, a list of tensor lists, a list of tensors, or a
    ``[K, P]`` tensor.
    """
    w = torch.as_tensor(weights, dtype=torch.float64).cpu()
    if normalize:
        w = w / w.sum()
    delta = base is not None
    if isinstance(updates, Tensor):
        rows = [[updates[k]] for k in range(updates.shape[0])]
        b = None if base is None else [base]
        return weighted_sum_reference(rows, w, b, scale, delta)[0]
    if isinstance(updates[0], Tensor):  # one tensor per client: the result is one tensor
        out = aggregate_reference(
            [[u] for u in updates], w, base=None if base is None else [base], scale=scale,
            normalize=False, int_policy=int_policy,
        )
        return out[0]
    if isinstance(updates[0], Mapping):
        result = {}
        for name, first in updates[0].items():
            values = [client[name] for client in updates]
            b = None if base is None else base[name]
            if first.is_floating_point():
                result[name] = weighted_sum_reference(
                    [[v] for v in values], w, None if b is None else [b], scale, delta
                )[0]
            else:
                result[name] = _int_reference(values, b, int_policy)
        return result
    names = list(range(len(updates[0])))
    as_dicts = [dict(zip(names, client)) for client in updates]
    b = None if base is None else dict(zip(names, base))
    out = aggregate_reference(
        as_dicts, w, base=b, scale=scale, normalize=False, int_policy=int_policy
    )
    return [out[n] for n in names]
