r"""Adapters between the model forms FL code already has and what :func:`fedkernels.aggregate`
takes, copying nothing where the memory allows.

=============================  =================================================================
``nn.Module``                  :func:`module_state` (parameters and buffers as a state_dict of
                               the module's own storage), :func:`aggregate_into_module` (the
                               fused op writes straight into the module)
``state_dict``                 taken by :func:`fedkernels.aggregate` as it is
NumPy arrays (Flower's         :func:`ndarrays_to_tensors` / :func:`tensors_to_ndarrays`
``NDArrays``)                  (``torch.from_numpy`` / ``Tensor.numpy``: shared memory on the
                               CPU), :func:`ndarrays_to_state_dict`,
                               :func:`state_dict_to_ndarrays`
flat vectors (FedLab's         :class:`FlatLayout`: ``flatten`` (one copy, or none once a module
``SerializationTool``)         is bound to a flat buffer with :meth:`FlatLayout.bind`) and
                               ``unflatten`` (views of the vector, no copy);
                               :func:`serialize_model` / :func:`deserialize_model`
=============================  =================================================================

A list of NumPy arrays, a list of tensors and a state_dict are all "one client" for
:func:`fedkernels.aggregate`; K flat vectors can be passed as a list of 1-D tensors or one
``[K, P]`` tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from fedkernels.aggregate import aggregate

__all__ = [
    "FlatLayout",
    "aggregate_into_module",
    "deserialize_model",
    "module_state",
    "ndarrays_to_state_dict",
    "ndarrays_to_tensors",
    "serialize_model",
    "state_dict_to_ndarrays",
    "tensors_to_ndarrays",
]


# ---------------------------------------------------------------- nn.Module


def module_state(module: nn.Module, *, buffers: bool = True) -> dict[str, Tensor]:
    """The module's parameters (and, by default, persistent buffers) in ``state_dict`` order,
    as detached tensors that share the module's storage: writing into them (``out=`` of
    :func:`fedkernels.aggregate`) updates the module, with no copy and no reload."""
    if buffers:
        return module.state_dict(keep_vars=False)
    return {n: p.detach() for n, p in module.named_parameters()}


@torch.no_grad()
def aggregate_into_module(
    target: nn.Module,
    clients: Sequence[nn.Module | Mapping[str, Tensor]],
    weights,
    *,
    delta: bool = False,
    scale: float = 1.0,
    normalize: bool = True,
    buffers: bool = True,
    int_policy: str = "max",
) -> nn.Module:
    r"""Writes the weighted aggregate of ``clients`` (modules or state_dicts with the same
    keys) into ``target``'s own parameters and buffers, in one fused pass.

    Plain: :math:`x \leftarrow \mathrm{scale}\sum_k w_k x_k`; ``delta=True`` (server learning
    rate form): :math:`x \leftarrow x + \mathrm{scale}\sum_k w_k (x_k - x)`, in place.
    ``normalize`` (default on, FedAvg) divides the weights by their sum."""
    out = module_state(target, buffers=buffers)
    states = [module_state(c, buffers=buffers) if isinstance(c, nn.Module)
              else {n: c[n] for n in out} for c in clients]
    aggregate(states, weights, base=out if delta else None, scale=scale,
                         normalize=normalize, out=out, int_policy=int_policy)
    return target


# ---------------------------------------------------------------- NumPy (Flower NDArrays)


def ndarrays_to_tensors(arrays: Sequence[np.ndarray], *, copy: bool = False) -> list[Tensor]:
    """NumPy arrays as CPU tensors. Without ``copy`` each tensor shares its array's memory
    (``torch.from_numpy``) whenever torch can view it: a native-byte-order array of a dtype
    torch has, with non-negative strides. Other arrays (big-endian, negative strides) are
    copied. Read-only arrays (e.g. deserialized from bytes) are viewed too; the fused op only
    reads its inputs, so torch's warning about non-writable memory is silenced."""
    out = []
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            a = np.asarray(a)
        if a.dtype.kind not in "biuf":
            raise TypeError(f"ndarrays_to_tensors: array {i} has dtype {a.dtype}; expected a "
                            "numeric or bool array")
        if copy:
            out.append(torch.tensor(a))
            continue
        if not a.dtype.isnative or any(s < 0 for s in a.strides):
            a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
        if not a.flags.writeable:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                out.append(torch.from_numpy(a))
        else:
            out.append(torch.from_numpy(a))
    return out


def tensors_to_ndarrays(tensors: Sequence[Tensor] | Mapping[str, Tensor]) -> list[np.ndarray]:
    """Tensors (or a state_dict's values, in order) as NumPy arrays: views of CPU tensors'
    memory (``Tensor.numpy``), copies of GPU tensors. bfloat16, which NumPy lacks, becomes
    float32 (a copy)."""
    if isinstance(tensors, Mapping):
        tensors = list(tensors.values())
    out = []
    for t in tensors:
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        out.append(t.cpu().numpy())
    return out


def ndarrays_to_state_dict(arrays: Sequence[np.ndarray], names: Sequence[str] | Mapping,
                           *, copy: bool = False) -> dict[str, Tensor]:
    """Zips NumPy arrays with names (or a state_dict / ``module.state_dict()`` whose keys give
    the order) into a state_dict of tensors that share the arrays' memory
    (:func:`ndarrays_to_tensors`). Shapes are checked against a state_dict's when given."""
    keys = list(names.keys()) if isinstance(names, Mapping) else list(names)
    if len(keys) != len(arrays):
        raise ValueError(f"ndarrays_to_state_dict: {len(arrays)} arrays for {len(keys)} names")
    tensors = ndarrays_to_tensors(arrays, copy=copy)
    if isinstance(names, Mapping):
        for k, t in zip(keys, tensors):
            like = names[k]
            if tuple(like.shape) != tuple(t.shape):
                raise ValueError(f"ndarrays_to_state_dict: array for {k!r} has shape "
                                 f"{tuple(t.shape)}, expected {tuple(like.shape)}")
    return dict(zip(keys, tensors))


def state_dict_to_ndarrays(state: Mapping[str, Tensor]) -> list[np.ndarray]:
    """A state_dict's tensors as NumPy arrays, in key order (:func:`tensors_to_ndarrays`):
    what Flower's ``ndarrays_to_parameters`` and ``ArrayRecord`` take."""
    return tensors_to_ndarrays(state)


# ---------------------------------------------------------------- flat vectors


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a model lives in one flat vector: names (state_dict keys, or list
    indices), shapes and offsets, in model order. The FedLab ``SerializationTool`` convention
    (concatenation of ``t.view(-1)``), with the inverse as views rather than copies.

    >>> layout = FlatLayout.of(model.state_dict())              # doctest: +SKIP
    >>> vec = layout.flatten(model.state_dict())                # [P]
    >>> avg = aggregate(torch.stack(vecs), w, normalize=True)  # [K, P] -> [P]
    >>> model.load_state_dict(layout.unflatten(avg))
    """

    names: tuple
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    kind: str  # "dict" or "list"

    @staticmethod
    def of(model: nn.Module | Mapping[str, Tensor] | Sequence[Tensor], *,
           buffers: bool = False) -> FlatLayout:
        """The layout of a state_dict, a tensor list, or a module (its parameters, plus its
        buffers with ``buffers=True``)."""
        if isinstance(model, nn.Module):
            model = module_state(model, buffers=buffers)
        if isinstance(model, Mapping):
            names, tensors, kind = tuple(model.keys()), list(model.values()), "dict"
        else:
            tensors = list(model)
            names, kind = tuple(range(len(tensors))), "list"
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += t.numel()
        offsets.append(total)
        return FlatLayout(names, tuple(tuple(t.shape) for t in tensors), tuple(offsets), kind)

    @property
    def numel(self) -> int:
        """P, the length of the flat vector."""
        return self.offsets[-1]

    def _tensors(self, model) -> list[Tensor]:
        if isinstance(model, nn.Module):
            state = module_state(model, buffers=True)
            return [state[n] for n in self.names]
        if isinstance(model, Mapping):
            return [model[n] for n in self.names]
        tensors = list(model)
        if len(tensors) != len(self.names):
            raise ValueError(f"FlatLayout: {len(tensors)} tensors, the layout has "
                             f"{len(self.names)}")
        return tensors

    def flatten(self, model, *, out: Tensor | None = None, dtype: torch.dtype | None = None
                ) -> Tensor:
        """The model's tensors concatenated into one ``[P]`` vector (one copy; into ``out``
        when given). Every tensor is cast to ``dtype`` (default: the first tensor's)."""
        tensors = self._tensors(model)
        for n, t, s in zip(self.names, tensors, self.shapes):
            if tuple(t.shape) != s:
                raise ValueError(f"FlatLayout.flatten: tensor {n!r} has shape "
                                 f"{tuple(t.shape)}, the layout has {s}")
        if out is None:
            dtype = dtype or (tensors[0].dtype if tensors else torch.float32)
            device = tensors[0].device if tensors else None
            out = torch.empty(self.numel, dtype=dtype, device=device)
        elif out.shape != (self.numel,):
            raise ValueError(f"FlatLayout.flatten: out has shape {tuple(out.shape)}, "
                             f"expected ({self.numel},)")
        views = self._views(out)
        if views:  # (_foreach_copy_ refuses empty lists: a module without parameters)
            with torch.no_grad():
                torch._foreach_copy_(views, [t.detach() for t in tensors])
        return out

    def _views(self, vector: Tensor) -> list[Tensor]:
        return [vector[a:b].view(s)
                for a, b, s in zip(self.offsets[:-1], self.offsets[1:], self.shapes)]

    def unflatten(self, vector: Tensor) -> dict[str, Tensor] | list[Tensor]:
        """Views of a ``[P]`` vector shaped like the model's tensors (no copy), as a
        state_dict or a list (the form the layout was made from)."""
        if vector.dim() != 1 or vector.numel() != self.numel:
            raise ValueError(f"FlatLayout.unflatten: expected a 1-D vector of {self.numel} "
                             f"values, got shape {tuple(vector.shape)}")
        if not vector.is_contiguous():
            raise ValueError("FlatLayout.unflatten: the vector must be contiguous")
        views = self._views(vector)
        return dict(zip(self.names, views)) if self.kind == "dict" else views

    @torch.no_grad()
    def bind(self, module: nn.Module, *, vector: Tensor | None = None) -> Tensor:
        """Moves ``module``'s tensors of this layout (its parameters, and buffers if the
        layout has them) into one flat buffer and makes each a view of it, so the flat vector
        *is* the model: serializing it afterwards copies nothing, and writing an aggregate
        into it updates the module. Returns the buffer (all tensors must share one dtype and
        device). Bind before creating the optimizer, which holds the parameter objects (they
        stay the same objects; only their storage moves)."""
        # Every name, shared ones too: a layout with buffers comes from the state_dict, which
        # lists a tied parameter under each of its names (named_parameters() only once).
        named = dict(module.named_parameters(remove_duplicate=False))
        named.update(dict(module.named_buffers(remove_duplicate=False)))
        missing = [n for n in self.names if n not in named]
        if missing:
            raise ValueError(f"FlatLayout.bind: the module has no parameter or buffer "
                             f"{missing[0]!r} (missing: {missing[:5]})")
        tensors = [named[n] for n in self.names]
        first_name: dict[int, str] = {}
        for n, t in zip(self.names, tensors):
            other = first_name.setdefault(id(t), n)
            if other != n:  # one tensor cannot be a view of two places of the buffer
                raise ValueError(
                    f"FlatLayout.bind: {other!r} and {n!r} are one tensor (tied weights), which "
                    "the layout holds twice; bind a layout of the parameters "
                    "(FlatLayout.of(module)), which holds it once")
        dtypes = {t.dtype for t in tensors}
        devices = {t.device for t in tensors}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"FlatLayout.bind: tensors of several dtypes/devices "
                             f"({sorted(map(str, dtypes))}, {sorted(map(str, devices))})")
        if vector is None:
            vector = torch.empty(self.numel, dtype=tensors[0].dtype, device=tensors[0].device)
        self.flatten(tensors if self.kind == "list" else dict(zip(self.names, tensors)),
                     out=vector)
        for t, view in zip(tensors, self._views(vector)):
            t.data = view
        return vector


def serialize_model(module: nn.Module, *, buffers: bool = False) -> Tensor:
    """FedLab's ``SerializationTool.serialize_model``: the module's parameters (and buffers)
    concatenated into one 1-D tensor. If the module was bound to a flat buffer
    (:meth:`FlatLayout.bind`) that buffer is returned itself, without a copy."""
    layout = FlatLayout.of(module, buffers=buffers)
    tensors = layout._tensors(module)
    if tensors:
        first = tensors[0]
        base = first.untyped_storage().data_ptr()
        itemsize = first.element_size()
        contiguous_run = all(
            t.untyped_storage().data_ptr() == base and t.dtype == first.dtype
            and t.is_contiguous()
            and t.storage_offset() - first.storage_offset() == off
            for t, off in zip(tensors, layout.offsets)
        )
        if contiguous_run and first.untyped_storage().nbytes() >= (
                first.storage_offset() + layout.numel) * itemsize:
            return first.detach().as_strided((layout.numel,), (1,), first.storage_offset())
    return layout.flatten(tensors)


@torch.no_grad()
def deserialize_model(module: nn.Module, vector: Tensor, *, mode: str = "copy",
                      buffers: bool = False) -> nn.Module:
    """FedLab's ``SerializationTool.deserialize_model``: writes ``vector`` into the module's
    parameters (and buffers): ``mode="copy"`` (``x = v``), ``"add"`` (``x += v``) or
    ``"sub"`` (``x -= v``), with one fused ``_foreach`` call."""
    if mode not in ("copy", "add", "sub"):
        raise ValueError(f"deserialize_model: mode must be 'copy', 'add' or 'sub', not {mode!r}")
    layout = FlatLayout.of(module, buffers=buffers)
    tensors = layout._tensors(module)
    if not tensors:  # a module without parameters: only an empty vector fits it
        layout.unflatten(vector)
        return module
    views = layout.unflatten(vector.to(tensors[0].device))
    views = list(views.values()) if isinstance(views, dict) else views
    if mode == "copy":
        torch._foreach_copy_(tensors, views)
    elif mode == "add":
        torch._foreach_add_(tensors, views)
    else:
        torch._foreach_sub_(tensors, views)
    return module
