"""How FL code's model structures map onto the flat tensor lists the native ops take.

A client model is a ``state_dict`` (names -> tensors), a sequence of tensors, or one tensor;
K clients are a sequence of those or one ``[K, P]`` tensor of flat vectors. :class:`ModelLayout`
records one client's structure (kind, names, which entries are floating point) and checks every
other client against it; :func:`weight_vector` checks and converts the K weights. Both the
single-process API (:mod:`fedkernels.aggregate`) and the distributed one
(:mod:`fedkernels.integrations.distributed`) build on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor

Model = Union[Mapping[str, Tensor], Sequence[Tensor], Tensor]

INT_POLICIES = ("max", "first", "skip", "error")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class ModelLayout:
    """How one client's model maps to a flat tensor list: its kind, names, and which entries
    are floating point (aggregated by the op) or integer/bool (handled by ``int_policy``)."""

    def __init__(self, kind: str, names: list, float_mask: list[bool]):
        self.kind = kind  # "dict", "list" or "tensor"
        self.names = names
        self.float_mask = float_mask

    @staticmethod
    def of(model: Model, what: str) -> ModelLayout:
        if isinstance(model, Tensor):
            return ModelLayout("tensor", [None], [is_float_entry(model, what, None)])
        if isinstance(model, Mapping):
            names = list(model.keys())
            return ModelLayout("dict", names, [is_float_entry(model[n], what, n) for n in names])
        if isinstance(model, Sequence) and not isinstance(model, (str, bytes)):
            names = list(range(len(model)))
            return ModelLayout("list", names, [is_float_entry(model[i], what, i) for i in names])
        raise TypeError(
            f"fedkernels.aggregate: {what} must be a state_dict (mapping name -> tensor), "
            f"a sequence of tensors or a tensor, got {type(model).__name__}"
        )

    def tensors(self, model: Model, what: str) -> list[Tensor]:
        """The model's tensors in layout order, after checking it has this layout."""
        if self.kind == "tensor":
            if not isinstance(model, Tensor):
                raise TypeError(f"fedkernels.aggregate: {what} is a {type(model).__name__}, "
                                "client 0 is a tensor")
            return [model]
        if self.kind == "dict":
            if not isinstance(model, Mapping):
                raise TypeError(f"fedkernels.aggregate: {what} is a {type(model).__name__}, "
                                "client 0 is a state_dict")
            if len(model) != len(self.names) or any(n not in model for n in self.names):
                missing = [n for n in self.names if n not in model]
                extra = [n for n in model if n not in set(self.names)]
                raise ValueError(
                    f"fedkernels.aggregate: {what} has different keys than client 0"
                    + (f"; missing {missing[:5]}" if missing else "")
                    + (f"; unexpected {extra[:5]}" if extra else "")
                )
            out = [model[n] for n in self.names]
        else:
            if isinstance(model, (Mapping, Tensor)) or not isinstance(model, Sequence):
                raise TypeError(f"fedkernels.aggregate: {what} is a {type(model).__name__}, "
                                "client 0 is a sequence of tensors")
            if len(model) != len(self.names):
                raise ValueError(f"fedkernels.aggregate: {what} has {len(model)} tensors, "
                                 f"client 0 has {len(self.names)}")
            out = list(model)
        for name, t in zip(self.names, out):
            if not isinstance(t, Tensor):
                raise TypeError(f"fedkernels.aggregate: {what}, tensor {self.label(name)} is a "
                                f"{type(t).__name__}, not a tensor")
        return out

    def label(self, name) -> str:
        return repr(name) if self.kind == "dict" else str(name)

    def build(self, tensors: list[Tensor]) -> Model:
        if self.kind == "tensor":
            return tensors[0]
        if self.kind == "dict":
            return dict(zip(self.names, tensors))
        return list(tensors)


def is_float_entry(t: Any, what: str, name) -> bool:
    if not isinstance(t, Tensor):
        where = what if name is None else f"{what}, tensor {name!r}"
        raise TypeError(f"fedkernels.aggregate: {where} is a {type(t).__name__}, not a tensor")
    if t.dtype in FLOAT_DTYPES:
        return True
    if t.is_floating_point() or t.is_complex():
        where = what if name is None else f"{what}, tensor {name!r}"
        raise TypeError(f"fedkernels.aggregate: {where} has unsupported dtype {t.dtype}; "
                        "supported: float32, float64, float16, bfloat16 (integer and bool "
                        "tensors follow int_policy)")
    return False


def split_clients(updates) -> tuple[list[Model], bool]:
    """The K client models, and whether the input was one [K, P] tensor."""
    if isinstance(updates, Tensor):
        if updates.dim() != 2:
            raise ValueError("fedkernels.aggregate: a tensor of updates must be 2-D [K, P] "
                             f"(one flat vector per client), got shape {tuple(updates.shape)}")
        return list(updates.unbind(0)), True
    if isinstance(updates, Mapping) or not isinstance(updates, Sequence):
        raise TypeError("fedkernels.aggregate: updates must be a sequence of client models "
                        "(state_dicts or tensor lists) or a [K, P] tensor, got "
                        f"{type(updates).__name__}")
    return list(updates), False


def weight_vector(weights, num_clients: int, normalize: bool) -> Tensor:
    if isinstance(weights, Tensor):
        w = weights
    else:
        try:
            w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
        except (TypeError, ValueError) as err:
            raise TypeError(f"fedkernels.aggregate: weights must be K numbers: {err}") from None
    if w.dim() != 1 or w.numel() != num_clients:
        raise ValueError(f"fedkernels.aggregate: got {num_clients} clients but weights of "
                         f"shape {tuple(w.shape)}; expected {num_clients} numbers")
    if w.is_complex() or w.dtype == torch.bool:
        raise TypeError(f"fedkernels.aggregate: weights must be real numbers, got {w.dtype}")
    w = w.to(torch.float64)
    # Data-dependent checks read the weights on the host; under torch.compile they are left to
    # the native op, which checks CPU weights too.
    host_checks = w.device.type == "cpu" and not torch.compiler.is_compiling()
    if host_checks:
        bad = (~torch.isfinite(w)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"fedkernels.aggregate: weight of client {bad[0]} is "
                             f"{w[bad[0]].item()} (non-finite weights: clients {bad[:10]})")
    if normalize:
        total = w.sum()
        if host_checks and total.item() == 0:
            raise ValueError("fedkernels.aggregate: normalize=True but the weights sum to 0")
        if host_checks and not math.isfinite(total.item()):
            # Finite weights whose float64 sum overflows (e.g. two of 1e308): w / inf would be
            # 0. Dividing by the largest magnitude first keeps the sum finite, and the ratios.
            w = w / w.abs().max()
            total = w.sum()
        w = w / total
    return w
