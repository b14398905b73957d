r"""Weighted aggregation when the clients' updates live on different ranks (``torch.distributed``).

Each rank holds some of the K clients. It sums its share with the fused ``weighted_sum`` op
into one flat accumulator (fp32 for fp32/fp16/bf16 models, fp64 for fp64) whose last element
is its share of :math:`\sum_k w_k`; then **one** ``all_reduce`` of that one model-sized buffer
gives every rank

.. math:: S = \sum_{k} w_k x_k \quad\text{or, with a base } b,\quad
          S = \sum_k w_k (x_k - b), \qquad W = \sum_k w_k,

and the result is :math:`\mathrm{scale}\cdot S / [W]` (plain) or
:math:`b + \mathrm{scale}\cdot S / [W]` (delta mode, the server-learning-rate form), with the
division by :math:`W` only when ``normalize``: exactly what :func:`fedkernels.aggregate` gives on
the union of all ranks' clients, up to float rounding. Integer tensors
(``num_batches_tracked``) follow ``int_policy`` with a second, tiny all-reduce (``max``).

- :func:`all_reduce_aggregate`: the one-call form.
- :class:`WeightedPartial`: the pieces, for hierarchical aggregation (reduce inside a node or a
  region with ``group=``, then across the leaders, then broadcast), or for adding partial sums
  that arrive by other means.

Any backend works: gloo for CPU tensors, NCCL for CUDA tensors (the buffer lives on the
updates' device). A rank with no clients passes an empty list and ``like=`` (or ``base``) for
the model's structure; it still takes part in the collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fedkernels.model_layout import INT_POLICIES, Model, ModelLayout, weight_vector
from fedkernels.ops import summation

__all__ = ["WeightedPartial", "all_reduce_aggregate"]


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class WeightedPartial:
    r"""A partial weighted sum :math:`S` over some clients and their :math:`W = \sum w_k`,
    held in one flat buffer per accumulate dtype (usually one), plus the integer tensors.

    Build it with :meth:`from_clients`, combine across ranks with :meth:`all_reduce` (or
    :meth:`reduce` + :meth:`broadcast` for hierarchies), and read the model with
    :meth:`result`."""

    def __init__(self, layout: ModelLayout, like: list[Tensor], base: list[Tensor] | None,
                 int_policy: str) -> None:
        self.layout = layout
        self.base = base
        self.int_policy = int_policy
        self.dtypes = [t.dtype for t in like]
        self.shapes = [t.shape for t in like]
        device = like[0].device if like else torch.device("cpu")
        self.device = device
        floats = [i for i, f in enumerate(layout.float_mask) if f]
        # One buffer per accumulate dtype; the first also carries W in its last element.
        groups: dict[torch.dtype, list[int]] = {}
        for i in floats:
            groups.setdefault(_accumulate_dtype(like[i].dtype), []).append(i)
        if not groups:
            groups[torch.float64] = []
        self.buffers: list[Tensor] = []
        self.views: dict[int, Tensor] = {}
        for n, (dtype, members) in enumerate(groups.items()):
            size = sum(like[i].numel() for i in members) + (1 if n == 0 else 0)
            buffer = torch.zeros(size, dtype=dtype, device=device)
            offset = 0
            for i in members:
                numel = like[i].numel()
                self.views[i] = buffer[offset:offset + numel].view(like[i].shape)
                offset += numel
            self.buffers.append(buffer)
        self.ints: dict[int, Tensor] = {}
        self.count = 0

    @property
    def total_weight(self) -> Tensor:
        """:math:`W`, a 0-d tensor on the buffer's device (a view: reduced with the buffer)."""
        return self.buffers[0][-1]

    # ---------------------------------------------------------------- building

    @classmethod
    def from_clients(cls, updates: Sequence[Model], weights, *, base: Model | None = None,
                     like: Model | None = None, int_policy: str = "max") -> WeightedPartial:
        r"""The partial sum over this rank's clients: one fused pass
        :math:`S \mathrel{+}= \sum_k w_k x_k` (with ``base``: the inputs ``x_1..x_K, b`` with
        weights ``w_1..w_K, -\sum w``, i.e. :math:`\sum_k w_k (x_k - b)`).

        ``updates`` may be empty (a rank without clients); then ``like`` or ``base`` gives
        the structure."""
        if int_policy not in INT_POLICIES:
            raise ValueError(f"fedkernels.integrations.distributed: int_policy must be one of "
                             f"{INT_POLICIES}, not {int_policy!r}")
        updates = list(updates)
        template = updates[0] if updates else (like if like is not None else base)
        if template is None:
            raise ValueError("fedkernels.integrations.distributed: a rank without clients needs like= or "
                             "base= (the model's structure)")
        layout = ModelLayout.of(template, "client 0" if updates else "like")
        clients = [layout.tensors(m, f"client {k}") for k, m in enumerate(updates)]
        base_tensors = None if base is None else layout.tensors(base, "base")
        like_tensors = clients[0] if clients else layout.tensors(template, "like")
        if base_tensors is not None:
            like_tensors = [b if f else t for b, t, f in
                            zip(base_tensors, like_tensors, layout.float_mask)]
        partial = cls(layout, like_tensors, base_tensors, int_policy)
        if clients:
            partial.add_clients(clients, weights)
        elif weights is not None and len(weights) != 0:
            raise ValueError("fedkernels.integrations.distributed: weights given but no updates")
        return partial

    def add_clients(self, clients: list[list[Tensor]], weights) -> None:
        """Adds more clients (tensor lists in the layout's order) in one fused pass."""
        w = weight_vector(weights, len(clients), False)
        floats = [i for i, f in enumerate(self.layout.float_mask) if f]
        inputs = [c[i] for c in clients for i in floats]
        total = w.sum()
        if self.base is not None:
            inputs += [self.base[i] for i in floats]
            w = torch.cat([w, -total.reshape(1)])
        if floats:
            summation.weighted_sum_([self.views[i] for i in floats], inputs, w, 1.0, False)
        self.total_weight.add_(total.to(self.buffers[0].dtype))
        for i, f in enumerate(self.layout.float_mask):
            if f:
                continue
            values = [c[i] for c in clients]
            if self.int_policy == "error":
                label = self.layout.label(self.layout.names[i])
                raise TypeError(f"fedkernels.integrations.distributed: tensor {label} has dtype "
                                f"{values[0].dtype} and int_policy='error'")
            if self.int_policy == "max":
                local = torch.stack(values).amax(dim=0)
                self.ints[i] = local if i not in self.ints else torch.maximum(self.ints[i], local)
            else:  # "first" / "skip": the first client seen
                self.ints.setdefault(i, values[0].clone())
        self.count += len(clients)

    # ---------------------------------------------------------------- collectives

    def all_reduce(self, group=None) -> WeightedPartial:
        """Sums the partials of every rank of ``group`` (one all-reduce per accumulate
        dtype, usually one; plus a max over the integer tensors)."""
        for buffer in self.buffers:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        self._reduce_ints(group, dst=None)
        return self

    def reduce(self, dst: int, group=None) -> WeightedPartial:
        """Sums the partials onto rank ``dst`` (global rank) only, e.g. a node's leader."""
        for buffer in self.buffers:
            dist.reduce(buffer, dst=dst, op=dist.ReduceOp.SUM, group=group)
        self._reduce_ints(group, dst=dst)
        return self

    def broadcast(self, src: int, group=None) -> WeightedPartial:
        """Copies rank ``src``'s (global rank) partial to every rank of ``group``."""
        for buffer in self.buffers:
            dist.broadcast(buffer, src=src, group=group)
        for i in self._int_indices():
            dist.broadcast(self._int_tensor(i), src=src, group=group)
        return self

    def _int_indices(self) -> list[int]:
        return [i for i, f in enumerate(self.layout.float_mask) if not f]

    def _int_tensor(self, i: int) -> Tensor:
        if i not in self.ints:
            # A rank without clients: the identity of max, or a placeholder for first/skip.
            dtype, shape = self.dtypes[i], self.shapes[i]
            if self.int_policy == "max":
                fill = False if dtype == torch.bool else torch.iinfo(dtype).min
                self.ints[i] = torch.full(shape, fill, dtype=dtype, device=self.device)
            else:
                self.ints[i] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self.ints[i]

    def _reduce_ints(self, group, dst: int | None) -> None:
        indices = self._int_indices()
        if not indices or self.int_policy == "skip" and self.base is not None:
            return
        if self.int_policy == "max":
            for i in indices:
                t = self._int_tensor(i)
                if t.dtype == torch.bool:  # max of bools: any
                    as_int = t.to(torch.uint8)
                    (dist.all_reduce(as_int, op=dist.ReduceOp.MAX, group=group) if dst is None
                     else dist.reduce(as_int, dst=dst, op=dist.ReduceOp.MAX, group=group))
                    t.copy_(as_int.bool())
                elif dst is None:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                else:
                    dist.reduce(t, dst=dst, op=dist.ReduceOp.MAX, group=group)
            return
        # "first" (and "skip" without base): the first client of the lowest rank with clients.
        ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        has = torch.tensor([self.count > 0], dtype=torch.int64, device=self.device)
        flags = [torch.zeros_like(has) for _ in ranks]
        dist.all_gather(flags, has, group=group)
        owners = [r for r, flag in zip(ranks, flags) if int(flag)]
        if not owners:
            raise ValueError("fedkernels.integrations.distributed: no rank has a client")
        for i in indices:
            dist.broadcast(self._int_tensor(i), src=owners[0], group=group)

    # ---------------------------------------------------------------- reading

    def result(self, *, scale: float = 1.0, normalize: bool = False,
               out: Model | None = None) -> Model:
        r"""The aggregate: :math:`\mathrm{scale}\,S/[W]`, or :math:`b + \mathrm{scale}\,S/[W]`
        with a base; in the models' dtypes (base's in delta mode); written into ``out`` when
        given (which may be the base, for an in-place server step)."""
        total = float(self.total_weight)
        if normalize and total == 0:
            raise ValueError("fedkernels.integrations.distributed: normalize=True but the weights sum to 0")
        factor = scale / total if normalize else scale
        out_tensors = None if out is None else self.layout.tensors(out, "out")
        results = []
        for i, f in enumerate(self.layout.float_mask):
            target = None if out_tensors is None else out_tensors[i]
            if not f:
                if self.int_policy == "skip" and self.base is not None:
                    value = self.base[i]
                else:
                    value = self._int_tensor(i)
                results.append(value.clone() if target is None else target.copy_(value))
                continue
            s = self.views[i]
            if self.base is None:
                value = (s * factor).to(self.dtypes[i])
            else:
                b = self.base[i]
                value = torch.add(b.to(s.dtype), s, alpha=factor).to(b.dtype)
            results.append(value if target is None else target.copy_(value))
        return out if out is not None else self.layout.build(results)


def all_reduce_aggregate(
    updates: Sequence[Model],
    weights,
    *,
    base: Model | None = None,
    scale: float = 1.0,
    normalize: bool = False,
    out: Model | None = None,
    int_policy: str = "max",
    like: Model | None = None,
    group=None,
) -> Model:
    r""":func:`fedkernels.aggregate` over the union of every rank's clients, each rank
    passing only its own ``updates`` and ``weights`` (see the module docstring): plain
    :math:`\mathrm{scale}\sum_k w_k x_k`, or with ``base``
    :math:`b + \mathrm{scale}\sum_k w_k (x_k - b)`; ``normalize`` divides by the global
    :math:`\sum_k w_k`. Every rank of ``group`` must call it (with the same ``base``, and
    ``like`` where it has no clients), and every rank gets the result.

    Cost per rank: one fused pass over its clients, one all-reduce of one model (in the
    accumulate dtype) with :math:`\sum w` appended, and one small max-reduce per integer
    tensor."""
    partial = WeightedPartial.from_clients(updates, weights, base=base, like=like,
                                           int_policy=int_policy)
    return partial.all_reduce(group).result(scale=scale, normalize=normalize, out=out)
