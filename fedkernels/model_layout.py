"""How FL code's model structures map onto the flat tensor lists the native ops take.

A client model is a ``state_dict`` (names -> tensors), a sequence of tensors, or one tensor;
K clients are a sequence of those or one ``[K, P]`` tensor of flat vectors. :class:`ModelLayout`
records one client's structure (kind, names, which entries are floating point) and checks every
other client against it; :func:`weight_vector` checks and converts the K weights. Both the
single-process API (:mod:`fedkernels.aggregate`) and the distributed one
(:mod:`fedkernels.integrations.distributed`) build on them.
"""

from __future__ import annotations

import copy
import itertools
import math
import numbers
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

Model = Mapping[str, Tensor] | Sequence[Tensor] | Tensor

INT_POLICIES = ("max", "first", "skip", "error")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# Per-call overhead. A server aggregates the same model structure round after round, and for a
# small model the Python checks cost more than the fused op itself. So the layout of a model
# built from plain containers (dict, OrderedDict, list, tuple) is remembered, keyed by its kind,
# its key tuple (or length) and the dtype of every entry: everything the layout is computed
# from, so a remembered layout is exactly the one that would be computed again. Shapes,
# devices and memory are not part of a layout; they are checked on every call. Each client is
# then checked in one fast pass (same container type, same keys in the same order, every entry
# a tensor); anything else takes the general path, which names the fault.
_PLAIN_MAPPINGS = (dict, OrderedDict)
_PLAIN_SEQUENCES = (list, tuple)
_LAYOUT_CACHE: dict[tuple, ModelLayout] = {}
_LAYOUT_CACHE_SIZE = 128


def _layout_key(model: Any) -> tuple | None:
    """(kind, key tuple or length, entry dtypes) of a model made of plain containers of
    tensors, or None (another container, or an entry that is not a tensor)."""
    tp = type(model)
    if tp in _PLAIN_MAPPINGS:
        kind, names, values = "dict", tuple(model), model.values()
    elif tp in _PLAIN_SEQUENCES:
        kind, names, values = "list", len(model), model
    elif isinstance(model, Tensor):
        return ("tensor", None, model.dtype)
    else:
        return None
    dtypes = []
    for t in values:
        if not isinstance(t, Tensor):
            return None
        dtypes.append(t.dtype)
    return kind, names, tuple(dtypes)


class ModelLayout:
    """How one client's model maps to a flat tensor list: its kind, names, and which entries
    are floating point (aggregated by the op) or integer/bool (handled by ``int_policy``).
    Treat it as immutable: :meth:`of` hands the same instance to every call with the same
    structure."""

    def __init__(self, kind: str, names: Sequence, float_mask: Sequence[bool]):
        self.kind = kind  # "dict", "list" or "tensor"
        self.names = names
        self.float_mask = float_mask
        self.float_index = tuple(i for i, f in enumerate(float_mask) if f)
        self.int_index = tuple(i for i, f in enumerate(float_mask) if not f)
        self.float_names = tuple(names[i] for i in self.float_index)
        self._names_key = tuple(names)

    @staticmethod
    def of(model: Model, what: str) -> ModelLayout:
        """The layout of ``model`` (remembered across calls for plain containers; see above)."""
        key = _layout_key(model)
        layout = _LAYOUT_CACHE.get(key) if key is not None else None
        if layout is None:
            layout = ModelLayout._compute(model, what)
            if key is not None:
                if len(_LAYOUT_CACHE) >= _LAYOUT_CACHE_SIZE:
                    _LAYOUT_CACHE.clear()  # many structures in one process: start over
                _LAYOUT_CACHE[key] = layout
        return layout

    @staticmethod
    def _compute(model: Model, what: str) -> ModelLayout:
        if isinstance(model, Tensor):
            return ModelLayout("tensor", (None,), (is_float_entry(model, what, None),))
        if isinstance(model, Mapping):
            names = tuple(model.keys())
            return ModelLayout("dict", names,
                               tuple(is_float_entry(model[n], what, n) for n in names))
        if isinstance(model, Sequence) and not isinstance(model, (str, bytes)):
            names = tuple(range(len(model)))
            return ModelLayout("list", names,
                               tuple(is_float_entry(model[i], what, i) for i in names))
        hint = " (pass module.state_dict())" if isinstance(model, torch.nn.Module) else ""
        raise TypeError(
            f"fedkernels.aggregate: {what} must be a state_dict (mapping name -> tensor), "
            f"a sequence of tensors or a tensor, got {type(model).__name__}{hint}"
        )

    def _fast_tensors(self, model: Any) -> list[Tensor] | None:
        """The model's tensors when it is a plain container with exactly this layout's keys in
        the same order (or its length) and only tensors; None when anything differs."""
        tp = type(model)
        if self.kind == "dict":
            if tp not in _PLAIN_MAPPINGS or tuple(model) != self._names_key:
                return None
            out = list(model.values())
        elif self.kind == "list":
            if tp not in _PLAIN_SEQUENCES or len(model) != len(self._names_key):
                return None
            out = list(model)
        else:
            return [model] if isinstance(model, Tensor) else None
        return out if all(map(isinstance, out, itertools.repeat(Tensor))) else None

    def client_tensors(self, models: Sequence[Model]) -> list[list[Tensor]]:
        """Every client's tensors (``tensors(models[k], "client k")`` for each k)."""
        clients = []
        if self.kind == "dict":  # the fast pass of _fast_tensors, inline: it runs K times a call
            names = self._names_key
            for k, model in enumerate(models):
                if type(model) in _PLAIN_MAPPINGS and tuple(model) == names:
                    tensors = list(model.values())
                    if not all(map(isinstance, tensors, itertools.repeat(Tensor))):
                        tensors = self.tensors(model, f"client {k}")
                else:
                    tensors = self.tensors(model, f"client {k}")
                clients.append(tensors)
            return clients
        for k, model in enumerate(models):
            tensors = self._fast_tensors(model)
            clients.append(self.tensors(model, f"client {k}") if tensors is None else tensors)
        return clients

    def tensors(self, model: Model, what: str) -> list[Tensor]:
        """The model's tensors in layout order, after checking it has this layout."""
        fast = self._fast_tensors(model)
        if fast is not None:
            return fast
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
        # A bare tensor is the model's one tensor: number 0, as in a list of one.
        return repr(name) if self.kind == "dict" else str(0 if name is None else name)

    def build(self, tensors: list[Tensor]) -> Model:
        if self.kind == "tensor":
            return tensors[0]
        if self.kind == "dict":
            return dict(zip(self.names, tensors))
        return list(tensors)


# Unsigned integer dtypes wider than a byte: torch has no maximum (nor comparison) for them on
# the CPU ("maximum_cpu" not implemented for 'UInt32'). uint16 and uint32 values all fit in
# int64; uint64 values keep their order as int64 once the top bit is flipped.
_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def elementwise_max(a: Tensor, b: Tensor) -> Tensor:
    """``torch.maximum(a, b)``, also for uint16, uint32 and uint64 tensors (``int_policy="max"``
    on NumPy arrays of those dtypes turned into tensors)."""
    if a.dtype not in _WIDE_UNSIGNED:
        return torch.maximum(a, b)
    if a.dtype == torch.uint64:
        top = -(2**63)  # the sign bit of int64
        return (torch.maximum(a.view(torch.int64) ^ top, b.view(torch.int64) ^ top)
                ^ top).view(torch.uint64)
    return torch.maximum(a.to(torch.int64), b.to(torch.int64)).to(a.dtype)


def with_metadata(result: Model, meta) -> Model:
    """A state_dict result carries the first client's ``_metadata`` (``meta``: the module
    versions that ``load_state_dict`` hands to each module, e.g. BatchNorm's), as
    ``Module.state_dict()`` returns it; any other result is returned as it is."""
    if meta is None or not isinstance(result, dict):
        return result
    result = OrderedDict(result)
    result._metadata = copy.deepcopy(meta)
    return result


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
    if type(updates) in _PLAIN_SEQUENCES:
        return list(updates), False
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
    """The K weights as a float64 tensor, checked (K numbers, real, finite; with ``normalize``
    a non-zero sum) and divided by their sum when ``normalize``."""
    return weights_and_values(weights, num_clients, normalize)[0]


def _plain_finite_floats(weights, num_clients: int) -> list[float] | None:
    """``weights`` as Python floats when it is a list or tuple of exactly ``num_clients``
    finite ints and floats (the common case, checked without creating any tensor), else None."""
    if type(weights) not in (list, tuple) or len(weights) != num_clients:
        return None
    values = []
    for x in weights:
        tx = type(x)
        if tx is float:
            values.append(x)
        elif tx is int and -(1 << 1000) < x < (1 << 1000):
            values.append(float(x))
        else:
            return None
    return values if all(map(math.isfinite, values)) else None


def refuse_non_real_weights(api: str, weights) -> None:
    """TypeError for a bool or complex weight tensor and for booleans or text among weights
    given as a sequence or NumPy array: a mask of selected clients is not a weighting (pass
    0/1 numbers for that), and NumPy would read "3" as 3."""
    if isinstance(weights, Tensor):
        if weights.dtype == torch.bool or weights.is_complex():
            raise TypeError(f"{api}: weights must be real numbers, got {weights.dtype}")
        return
    if isinstance(weights, np.ndarray):
        kind = {"b": "bool", "U": "str", "S": "bytes"}.get(weights.dtype.kind)
    elif isinstance(weights, (list, tuple)):
        # None too: NumPy reads it as NaN, which would be reported as a NaN weight
        odd = [x for x in weights if x is None or isinstance(x, (bool, np.bool_, str, bytes))]
        kind = type(odd[0]).__name__ if odd else None
    else:  # weights=None: NumPy would make it one NaN ("weights of shape ()")
        kind = {str: "str", bytes: "bytes", type(None): "None"}.get(type(weights))
    if kind is not None:
        raise TypeError(f"{api}: weights must be real numbers, got {kind}")


def real_number(api: str, name: str, value) -> float:
    """``value`` as a float when it is a real number (Python or NumPy; not a bool), else a
    TypeError naming the argument."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{api}: {name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int such as 10**400
        raise ValueError(f"{api}: {name} is beyond the float64 range") from None


def _fits_float64(x) -> bool:
    try:
        float(x)
    except OverflowError:
        return False
    except (TypeError, ValueError):
        pass
    return True


def weights_and_values(weights, num_clients: int,
                       normalize: bool) -> tuple[Tensor, list[float] | None]:
    """:func:`weight_vector`, and the same weights as Python floats where they can be read on
    the host (CPU weights, not under ``torch.compile``; else None), so that callers can check
    their range without more tensor operations."""
    compiling = torch.compiler.is_compiling()
    values = None if compiling else _plain_finite_floats(weights, num_clients)
    if values is not None:
        # Every check below holds already: K real, finite numbers.
        w = torch.from_numpy(np.array(values, dtype=np.float64))
        if not normalize:
            return w, values
        host_checks = True
    else:
        if isinstance(weights, Tensor):
            w = weights
        else:
            refuse_non_real_weights("fedkernels.aggregate", weights)
            try:
                w = torch.as_tensor(np.asarray(weights, dtype=np.float64), device="cpu")
            except OverflowError:
                big = next(k for k, x in enumerate(weights) if not _fits_float64(x))
                raise ValueError(f"fedkernels.aggregate: weight of client {big} is an integer "
                                 "beyond the float64 range") from None
            except (TypeError, ValueError) as err:
                raise TypeError(f"fedkernels.aggregate: weights must be K numbers: {err}") from None
        if w.dim() != 1 or w.numel() != num_clients:
            raise ValueError(f"fedkernels.aggregate: got {num_clients} clients but weights of "
                             f"shape {tuple(w.shape)}; expected {num_clients} numbers")
        refuse_non_real_weights("fedkernels.aggregate", w)
        w = w.to(torch.float64)
        # Data-dependent checks read the weights on the host; under torch.compile they are left
        # to the native op, which checks CPU weights too.
        host_checks = w.device.type == "cpu" and not compiling
        if host_checks:
            values = w.tolist()
            if not all(map(math.isfinite, values)):
                bad = [k for k, x in enumerate(values) if not math.isfinite(x)]
                raise ValueError(f"fedkernels.aggregate: weight of client {bad[0]} is "
                                 f"{values[bad[0]]} (non-finite weights: clients {bad[:10]})")
        if not normalize:
            return w, values
    total = w.sum()
    total_value = total.item() if host_checks else None
    if host_checks and total_value == 0:
        raise ValueError("fedkernels.aggregate: normalize=True but the weights sum to 0")
    if host_checks and not math.isfinite(total_value):
        # Finite weights whose float64 sum overflows (e.g. two of 1e308): w / inf would be
        # 0. Dividing by the largest magnitude first keeps the sum finite, and the ratios.
        w = w / w.abs().max()
        total = w.sum()
    w = w / total
    return w, (w.tolist() if host_checks else None)
