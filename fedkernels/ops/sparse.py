r"""Sparse client updates (the method and its guarantees: ``docs/algorithms/sparse.md``):

- :func:`sparsify_topk` (client side): the ``k`` entries of largest magnitude of each tensor,
  or of the whole model, as (index, value) lists; ties go to the lower position, so the
  selection is a function of the values alone. With ``residual`` (error feedback) it selects
  from :math:`v = x + r` and returns :math:`r' = v` with the sent entries zeroed.
- :func:`aggregate_sparse` / :func:`aggregate_sparse_` / :func:`sparse_weighted_sum` (server
  side): :math:`b + \sum_k w_k \,\mathrm{scatter}(i_k, v_k)` in one pass over the dense model,
  per element the clients' terms added in client order: the same bits for any thread count,
  no float atomics.

Not differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .devices import check_device
from .native import refuse_jit_trace

_ops = torch.ops.fedkernels

__all__ = ["SparseTensors", "sparsify_topk", "sparse_weighted_sum", "sparse_weighted_sum_",
           "aggregate_sparse", "aggregate_sparse_"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


class SparseTensors(NamedTuple):
    """One client's sparse tensor list: ``indices[t]`` (1-D int32 or int64, strictly
    increasing flat C-order positions in tensor t), ``values[t]`` (1-D, tensor t's dtype, as
    many), the dense ``shapes``, and the new error-feedback ``residual`` (None without error
    feedback; it stays on the client)."""

    indices: list[Tensor]
    values: list[Tensor]
    shapes: list[torch.Size]
    residual: list[Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes a client sends: its indices and values."""
        return sum(i.numel() * i.element_size() + v.numel() * v.element_size()
                   for i, v in zip(self.indices, self.values))

    def to_dense(self) -> list[Tensor]:
        """The dense tensors these lists stand for (zeros where no entry is sent)."""
        out = [torch.empty(s, dtype=v.dtype, device=v.device)
               for s, v in zip(self.shapes, self.values)]
        if out:
            sparse_weighted_sum([], self.indices, self.values, torch.ones(1, dtype=torch.float64),
                                out=out)
        return out


def _as_list(tensors) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def _top_positions(v: Tensor, k: int) -> Tensor:
    """Increasing positions (int64) of the k largest |v| of a 1-D tensor, ties to the lower
    position, NaN above every number (reference: ``topk_indices_reference``).

    torch.topk gives the k-th largest magnitude t (which tied entries it keeps is
    unspecified). Where exactly k entries are >= t they are the answer, and nonzero lists
    them in order; otherwise t is tied with entries topk left out, and the entries above t
    plus the first tied ones in position order are taken. Listing a mask's positions is a pass
    over n; sorting topk's k indices costs k log k, less only for small k (at 1 % density it
    was 12 % faster, at 10 % 2.7x slower, on a 2.4 M-element tensor)."""
    n = v.numel()
    if k >= n:
        return torch.arange(n, device=v.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=v.device)
    a = v.abs()
    a.masked_fill_(torch.isnan(a), float("inf"))
    top = torch.topk(a, k, sorted=False)
    t = top.values.min()
    mask = a >= t
    if int(mask.sum()) == k:
        if 16 * k < n:  # few entries: sorting topk's own indices is cheaper than a mask pass
            return torch.sort(top.indices).values
    else:
        torch.gt(a, t, out=mask)
        tied = torch.nonzero(a == t).squeeze(1)[: k - int(mask.sum())]
        mask[tied] = True
    return torch.nonzero(mask).squeeze(1)


def _count(n: int, k: int | None, fraction: float | None) -> int:
    if k is not None:
        return min(k, n)
    return min(n, max(1, round(fraction * n))) if n else 0


def sparsify_topk(
    tensors: Tensor | Sequence[Tensor],
    k: int | None = None,
    *,
    fraction: float | None = None,
    scope: str = "tensor",
    residual: Sequence[Tensor] | None = None,
    index_dtype: torch.dtype = torch.int32,
) -> SparseTensors:
    """Top-k sparsification of a client's tensors (a tensor or a list) by magnitude.

    Args:
        k: entries kept per tensor (``scope="tensor"``) or over the whole list
            (``scope="model"``); at most the number of elements.
        fraction: instead of ``k``, the share kept: ``round(fraction * n)`` entries, at least
            one, of each tensor's n elements or of the whole list's.
        scope: ``"tensor"`` (every tensor sends its own top k) or ``"model"`` (one selection
            over all tensors, which all have one dtype and device).
        residual: the error-feedback memory (one tensor per input, same shapes and dtypes;
            zeros at the first round): selects from ``x + residual`` and returns the new
            residual, the entries not sent.
        index_dtype: int32 (4 bytes an index, for tensors below 2**31 elements) or int64.

    Ties in magnitude go to the lower flat position and NaN ranks above every number, so the
    result depends on the values only. Indices come out increasing, as the server needs them.
    """
    op = "sparsify_topk"
    x = _as_list(tensors)
    if (k is None) == (fraction is None):
        raise ValueError(f"fedkernels.{op}: give exactly one of k and fraction")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
        raise ValueError(f"fedkernels.{op}: k must be an int >= 0, got {k!r}")
    if fraction is not None and not (isinstance(fraction, (int, float))
                                     and 0 < fraction <= 1):
        raise ValueError(f"fedkernels.{op}: fraction must be in (0, 1], got {fraction!r}")
    if scope not in ("tensor", "model"):
        raise ValueError(f"fedkernels.{op}: scope must be 'tensor' or 'model', got {scope!r}")
    if index_dtype not in _INDEX_DTYPES:
        raise TypeError(f"fedkernels.{op}: index_dtype must be torch.int32 or torch.int64, "
                        f"got {index_dtype}")
    res = None if residual is None else _as_list(residual)
    if res is not None and len(res) != len(x):
        raise ValueError(f"fedkernels.{op}: residual has {len(res)} tensors, x has {len(x)}")
    for t, xt in enumerate(x):
        if xt.dtype not in _FLOATS:
            raise TypeError(f"fedkernels.{op}: x tensor {t} has dtype {xt.dtype}; supported: "
                            "float32, float64, float16, bfloat16")
        if scope == "model":
            check_device(op, xt, x[0].device, f"x tensor {t}")
            if xt.dtype != x[0].dtype:
                raise TypeError(f"fedkernels.{op}: x tensor {t} has dtype {xt.dtype}, x tensor "
                                f"0 has {x[0].dtype} (scope='model' needs one dtype)")
        if index_dtype == torch.int32 and xt.numel() >= 2**31:
            raise ValueError(f"fedkernels.{op}: x tensor {t} has {xt.numel()} elements, too "
                             "many for int32 indices (use index_dtype=torch.int64)")
        if res is not None:
            check_device(op, res[t], xt.device, f"residual tensor {t}")
            if res[t].shape != xt.shape:
                raise ValueError(f"fedkernels.{op}: residual tensor {t} has shape "
                                 f"{list(res[t].shape)}, x tensor {t} has {list(xt.shape)}")
            if res[t].dtype != xt.dtype:
                raise TypeError(f"fedkernels.{op}: residual tensor {t} has dtype "
                                f"{res[t].dtype}, x tensor {t} has {xt.dtype}")
    with torch.no_grad():
        if scope == "tensor":
            indices, values, new_res = [], [], []
            for t, xt in enumerate(x):
                # v = x + r in one pass into a fresh buffer that becomes the new residual
                v = xt.reshape(-1) if res is None else torch.add(xt, res[t]).reshape(-1)
                i = _top_positions(v, _count(v.numel(), k, fraction))
                indices.append(i.to(index_dtype))
                values.append(v[i])
                if res is not None:
                    new_res.append(v.index_fill_(0, i, 0).reshape(xt.shape))
        else:
            sizes = [xt.numel() for xt in x]
            total = sum(sizes)
            dtype = x[0].dtype if x else torch.float32
            device = x[0].device if x else torch.device("cpu")
            flat = torch.empty(total, dtype=dtype, device=device)
            parts = list(torch.split(flat, sizes)) if x else []
            for t, xt in enumerate(x):
                if res is None:
                    parts[t].copy_(xt.reshape(-1))
                else:
                    torch.add(xt.reshape(-1), res[t].reshape(-1), out=parts[t])
            i = _top_positions(flat, _count(total, k, fraction))
            picked = flat[i]
            starts = torch.tensor([0] + sizes, device=device).cumsum(0)
            cuts = torch.searchsorted(i, starts).tolist()
            indices = [(i[cuts[t]:cuts[t + 1]] - int(starts[t])).to(index_dtype)
                       for t in range(len(x))]
            values = [picked[cuts[t]:cuts[t + 1]] for t in range(len(x))]
            if res is not None:
                flat.index_fill_(0, i, 0)
                new_res = [p.view(xt.shape) for p, xt in zip(parts, x)]
    return SparseTensors(indices, values, [xt.shape for xt in x],
                         new_res if res is not None else None)


# ---------------------------------------------------------------- server side


def sparse_weighted_sum(base: Sequence[Tensor], indices: Sequence[Tensor],
                        values: Sequence[Tensor], weights: Tensor,
                        out: Sequence[Tensor] | None = None) -> list[Tensor]:
    r""":math:`b_t + \sum_k w_k \,\mathrm{scatter}(i_{kt}, v_{kt})` over K =
    ``weights.numel()`` clients given client-major (``indices[k * T + t]``), into fresh
    tensors or ``out`` (where ``base`` may be empty: the sum from zeros)."""
    if out is None:
        return _ops.sparse_weighted_sum(base, indices, values, weights)
    refuse_jit_trace("sparse_weighted_sum.out")
    _ops.sparse_weighted_sum.out(base, indices, values, weights, out=out)
    return list(out)


def sparse_weighted_sum_(base: Sequence[Tensor], indices: Sequence[Tensor],
                         values: Sequence[Tensor], weights: Tensor) -> None:
    """:func:`sparse_weighted_sum` in place into ``base``."""
    refuse_jit_trace("sparse_weighted_sum_")
    _ops.sparse_weighted_sum_(base, indices, values, weights)


def _client_lists(op: str, clients, weights, normalize: bool):
    clients = list(clients)
    if not clients:
        raise ValueError(f"fedkernels.{op}: no clients")
    shapes = [torch.Size(s) for s in clients[0].shapes]
    for k, c in enumerate(clients):
        if len(c.indices) != len(shapes) or len(c.values) != len(shapes):
            raise ValueError(f"fedkernels.{op}: client {k} has {len(c.indices)} tensors, client "
                             f"0 has {len(shapes)}")
        if [torch.Size(s) for s in c.shapes] != shapes:
            raise ValueError(f"fedkernels.{op}: client {k}'s shapes differ from client 0's")
    if isinstance(weights, Tensor) and weights.dtype == torch.bool or (
            not isinstance(weights, Tensor) and any(isinstance(w, bool) for w in weights)):
        raise TypeError(f"fedkernels.{op}: weights must be real numbers, not bool")
    w = weights.to(torch.float64).reshape(-1) if isinstance(weights, Tensor) else \
        torch.as_tensor(weights, dtype=torch.float64, device="cpu").reshape(-1)
    if w.numel() != len(clients):
        raise ValueError(f"fedkernels.{op}: {w.numel()} weights for {len(clients)} clients")
    if normalize:
        total = w.sum()
        if not torch.isfinite(total) or total == 0:
            raise ValueError(f"fedkernels.{op}: normalize needs weights with a finite non-zero "
                             f"sum, got {total.item()}")
        w = w / total
    indices = [i for c in clients for i in c.indices]
    values = [v for c in clients for v in c.values]
    return shapes, indices, values, w


def _check_dense_shapes(op: str, what: str, tensors: Sequence[Tensor] | None,
                        shapes: list[torch.Size]) -> None:
    """Dense tensors (base, out) must have the shapes the clients were sparsified from: the op
    sees only flat indices, so a smaller tensor whose numel covers the sent indices would
    otherwise take the update silently."""
    if tensors is None:
        return
    tensors = list(tensors)
    if len(tensors) != len(shapes):
        raise ValueError(f"fedkernels.{op}: {len(tensors)} {what} tensors for the clients' "
                         f"{len(shapes)}")
    for t, (x, s) in enumerate(zip(tensors, shapes)):
        if x.shape != s:
            raise ValueError(f"fedkernels.{op}: {what} tensor {t} has shape {list(x.shape)}, "
                             f"the clients' tensor {t} has {list(s)}")


def aggregate_sparse(
    clients: Sequence[SparseTensors],
    weights,
    base: Sequence[Tensor] | None = None,
    *,
    normalize: bool = False,
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    r"""Weighted sum of K clients' sparse updates, :math:`b + \sum_k w_k \hat x_k`, in one pass
    over the dense result: per element, ``base`` (zeros when None) and then each client that
    sent it, in client order, accumulated in float32 (float64 for float64).

    Args:
        clients: K :class:`SparseTensors` from :func:`sparsify_topk`, with the same shapes.
        weights: K real numbers (tensor, list or array); divided by their sum with ``normalize``.
        base: dense tensors to add to (the global model, say); its dtype is the result's, and
            the clients' values must have it. None: the weighted sum alone, in the values'
            dtype.
        out: where to write the result; a server that keeps these buffers between rounds
            saves the page faults of fresh memory. Fresh results come from the output pool.
    """
    op = "aggregate_sparse"
    shapes, indices, values, w = _client_lists(op, clients, weights, normalize)
    _check_dense_shapes(op, "base", base, shapes)
    _check_dense_shapes(op, "out", out, shapes)
    if base is not None:
        return sparse_weighted_sum(list(base), indices, values, w, out=out)
    if out is not None:
        return sparse_weighted_sum([], indices, values, w, out=out)
    if not shapes:
        return []
    result = [torch.zeros(s, dtype=values[t].dtype, device=values[t].device)
              for t, s in enumerate(shapes)]
    sparse_weighted_sum_(result, indices, values, w)
    return result


def aggregate_sparse_(
    base: Sequence[Tensor],
    clients: Sequence[SparseTensors],
    weights,
    *,
    normalize: bool = False,
) -> list[Tensor]:
    """:func:`aggregate_sparse` in place into ``base`` (the dense global model), which it
    returns; the clients' values must have ``base``'s dtype."""
    shapes, indices, values, w = _client_lists("aggregate_sparse_", clients, weights, normalize)
    _check_dense_shapes("aggregate_sparse_", "base", base, shapes)
    base = list(base)
    sparse_weighted_sum_(base, indices, values, w)
    return base


# ---------------------------------------------------------------- fake implementations


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sparse_checks(op, base, indices, values, weights, out=None) -> None:
    """The checks the native op makes before reading any index, on shapes, dtypes and
    devices only (the index contents are data the fakes do not have)."""
    from_zeros = out is not None and not base
    shapes = out if from_zeros else base
    T = len(shapes)
    if weights.dim() != 1 or weights.numel() < 1:
        raise ValueError(f"fedkernels.{op}: weights must be 1-D [K] with K >= 1, got shape "
                         f"{list(weights.shape)}")
    if not weights.dtype.is_floating_point:
        raise TypeError(f"fedkernels.{op}: weights must be floating point, got {weights.dtype}")
    K = int(weights.shape[0])  # the list lengths depend on it: specialized
    if out is not None and not from_zeros and len(out) != T:
        raise ValueError(f"fedkernels.{op}: out has {len(out)} tensors, base has {T}")
    if len(indices) != K * T:
        raise ValueError(f"fedkernels.{op}: {len(indices)} indices tensors for K = {K} clients "
                         f"and T = {T} tensors (expected K * T, client-major)")
    if len(values) != len(indices):
        raise ValueError(f"fedkernels.{op}: {len(values)} values tensors for {len(indices)} "
                         "indices tensors (expected one per indices tensor)")
    if T == 0:
        return
    device = shapes[0].device
    tname = "out tensor" if from_zeros else "base tensor"
    for t, s in enumerate(shapes):
        if s.dtype not in _FLOATS:
            raise TypeError(f"fedkernels.{op}: {tname} {t} has dtype {s.dtype}; supported: "
                            "float32, float64, float16, bfloat16")
        check_device(op, s, device, f"{tname} {t}")
        if out is not None and not from_zeros:
            check_device(op, out[t], device, f"out tensor {t}")
            if out[t].dtype != s.dtype:
                raise TypeError(f"fedkernels.{op}: out tensor {t} has dtype {out[t].dtype}, "
                                f"base tensor {t} has {s.dtype}")
            if out[t].shape != s.shape:
                raise ValueError(f"fedkernels.{op}: out tensor {t} has shape "
                                 f"{list(out[t].shape)}, base tensor {t} has {list(s.shape)}")
    if indices[0].dtype not in _INDEX_DTYPES:
        raise TypeError(f"fedkernels.{op}: indices tensor 0 has dtype {_name(indices[0].dtype)}, "
                        "expected int32 or int64")
    for i, (ix, v) in enumerate(zip(indices, values)):
        k, t = divmod(i, T)
        check_device(op, ix, device, f"indices tensor {i}")
        check_device(op, v, device, f"values tensor {i}")
        if ix.dtype != indices[0].dtype:
            raise TypeError(f"fedkernels.{op}: indices tensor {i} (client {k}, tensor {t}) has "
                            f"dtype {_name(ix.dtype)}, indices tensor 0 has "
                            f"{_name(indices[0].dtype)}")
        if v.dtype != shapes[t].dtype:
            raise TypeError(f"fedkernels.{op}: values tensor {i} (client {k}, tensor {t}) has "
                            f"dtype {v.dtype}, {tname} {t} has {shapes[t].dtype}")
        if ix.dim() != 1 or v.dim() != 1 or v.numel() != ix.numel():
            raise ValueError(f"fedkernels.{op}: indices and values tensors {i} (client {k}, "
                             f"tensor {t}) must be 1-D of one length, got shapes "
                             f"{list(ix.shape)} and {list(v.shape)}")
    for t, s in enumerate(shapes):
        if s.dtype != shapes[0].dtype:
            raise TypeError(f"fedkernels.{op}: {tname} {t} has dtype {s.dtype}, {tname} 0 has "
                            f"{shapes[0].dtype} (one dtype per call)")
    if weights.device.type != "cpu":
        check_device(op, weights, device, "weights")


@torch.library.register_fake("fedkernels::sparse_weighted_sum")
def _sparse_fake(base, indices, values, weights):
    _sparse_checks("sparse_weighted_sum", base, indices, values, weights)
    return [torch.empty_like(b, memory_format=torch.contiguous_format) for b in base]


@torch.library.register_fake("fedkernels::sparse_weighted_sum.out")
def _sparse_out_fake(base, indices, values, weights, *, out):
    _sparse_checks("sparse_weighted_sum.out", base, indices, values, weights, out)


@torch.library.register_fake("fedkernels::sparse_weighted_sum_")
def _sparse_inplace_fake(base, indices, values, weights):
    _sparse_checks("sparse_weighted_sum_", base, indices, values, weights)
