"""The public aggregation API: :func:`aggregate` (all K clients at once) and
:class:`Accumulator` (clients arrive one at a time).

Both accept the shapes FL code already has: a list of ``state_dict`` s, a list of tensor lists,
or one ``[K, P]`` tensor of flat vectors, and run the fused ``fedkernels::weighted_sum`` op,
which reads every client tensor once and writes the result once.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import re
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from .memory_footprints import Footprints, byte_span, has_internal_overlap, same_memory
from .model_layout import (
    INT_POLICIES,
    Model,
    ModelLayout,
    elementwise_max,
    real_number,
    split_clients,
    weights_and_values,
    with_metadata,
)
from .ops import summation
from .ops.concurrency import CopyableLock


def _int_result(values: list[Tensor], base: Tensor | None, policy: str, label: str,
                who: Sequence[str] | None = None, api: str = "fedkernels.aggregate") -> Tensor:
    first = values[0]
    who = who or [f"client {k}" for k in range(len(values))]
    for k, v in enumerate(values[1:], start=1):
        if v.shape != first.shape or v.dtype != first.dtype or v.device != first.device:
            raise ValueError(
                f"{api}: {who[k]}, tensor {label}: {v.dtype} {tuple(v.shape)} "
                f"on {v.device}, {who[0]} has {first.dtype} {tuple(first.shape)} on {first.device}"
            )
    # The base has the clients' structure: its integer entries are checked whatever the policy
    # ("skip" returns them as the result, and an in-place out is the base).
    if base is not None and (base.shape != first.shape or base.dtype != first.dtype
                             or base.device != first.device):
        raise ValueError(
            f"{api}: base tensor {label} is {base.dtype} {tuple(base.shape)} on "
            f"{base.device}, {who[0]} has {first.dtype} {tuple(first.shape)} on {first.device}"
        )
    if policy == "error":
        raise TypeError(f"{api}: tensor {label} has dtype {first.dtype} and "
                        "int_policy='error'; choose 'max', 'first' or 'skip'")
    if policy == "first":
        return first
    if policy == "skip":
        return first if base is None else base
    out = first
    for v in values[1:]:
        out = elementwise_max(out, v)
    return out


_WHERE = re.compile(r"(client \d+, tensor |base tensor |out tensor |tensor )(\d+)")


def _rename(err: Exception, layout: ModelLayout, float_names: list,
            api: str = "fedkernels.aggregate") -> Exception:
    """Rewrites the native op's tensor indices into the user's names (state_dict keys), and
    its name (``fedkernels.weighted_sum.out: ...``) into the API's that was called."""

    def name(match: re.Match) -> str:
        if layout.kind == "tensor":  # one tensor per client: "client 2", "out", "base"
            head = match.group(1).rsplit(" tensor", 1)[0].rstrip(",")
            return head or match.group(0)
        i = int(match.group(2))
        label = layout.label(float_names[i]) if i < len(float_names) else match.group(2)
        return match.group(1) + label

    message = _WHERE.sub(name, str(err).split("\nException raised from")[0])
    message = re.sub(r"^fedkernels\.weighted_sum\w*(\.out)?:", f"{api}:", message)
    kind = type(err) if isinstance(err, (ValueError, TypeError)) else RuntimeError
    return kind(message)


def _nonfinite_clients(clients: list[list[Tensor]], names: list, layout: ModelLayout) -> list[str]:
    report = []
    for k, tensors in enumerate(clients):
        bad = [layout.label(n) for n, t in zip(names, tensors)
               if t.device.type != "meta" and not torch.isfinite(t).all()]  # meta: no values
        if bad:
            report.append(f"client {k} (tensors {', '.join(bad[:5])}"
                          + (", ..." if len(bad) > 5 else "") + ")")
    return report


# The native op checks the floating-point outputs against the floating-point inputs. Integer
# entries never reach it: they are copied into ``out`` afterwards, so their outputs are checked
# here (with memory_footprints), before anything is written.


def _check_outputs(layout: ModelLayout, out_tensors: list[Tensor], int_results: dict[int, Tensor],
                   clients: list[list[Tensor]], base_tensors: list[Tensor] | None) -> None:
    """Every check of ``out`` that the native op does not make: the integer entries' shape,
    dtype, device and memory (no expanded view, no overlap with an integer input or with another
    output entry). Raises before anything is written."""
    if not int_results:
        return

    def label(i: int) -> str:
        return layout.label(layout.names[i])

    for i, r in int_results.items():
        o = out_tensors[i]
        if o.shape != r.shape or o.dtype != r.dtype or o.device != r.device:
            raise ValueError(f"fedkernels.aggregate: out tensor {label(i)} is {o.dtype} "
                             f"{tuple(o.shape)} on {o.device}, expected {r.dtype} "
                             f"{tuple(r.shape)} on {r.device}")
        if has_internal_overlap(o):
            raise ValueError(f"fedkernels.aggregate: out tensor {label(i)} has elements that "
                             "share memory (an expanded or overlapping view); the output needs "
                             "one element of memory each")
    inputs = [(byte_span(c[i]), c[i], (k, i)) for k, c in enumerate(clients) for i in int_results]
    if base_tensors is not None:  # the base may be the out entry itself (in place), not part
        inputs += [(byte_span(base_tensors[i]), base_tensors[i], ("base", i))
                   for i in int_results if not same_memory(base_tensors[i], out_tensors[i])]
    outputs = [(byte_span(o), o, j) for j, o in enumerate(out_tensors)]
    inputs_map = Footprints(inputs)
    for span, o, i in outputs:
        hit = inputs_map.overlap(span, o)
        if hit is not None:
            who = "base tensor " if hit[0] == "base" else f"client {hit[0]}, tensor "
            raise ValueError(f"fedkernels.aggregate: out tensor {label(i)} overlaps "
                             f"{who}{label(hit[1])}; the output must not alias a client update "
                             "(or base, except in place)")
    outputs_map = Footprints(outputs)
    for i in int_results:
        hit = outputs_map.overlap(outputs[i][0], out_tensors[i], exclude=i)
        if hit is not None:
            raise ValueError(f"fedkernels.aggregate: out tensor {label(i)} overlaps out tensor "
                             f"{label(hit)}; every output entry needs its own memory")


# ---------------------------------------------------------------- weight range

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest normal float32


def weight_unit(weight: float) -> float:
    """The power of two at or just above ``|weight|`` that running sums are held relative to
    (Accumulator, the distributed WeightedPartial); 2^1023 past it, since 2^1024 overflows
    float64."""
    return math.ldexp(1.0, min(math.frexp(abs(weight))[1], 1023))


def needs_float64_factor(factor: float) -> bool:
    """Whether a float32 tensor must be multiplied by ``factor`` in float64: a tensor times a
    Python number rounds the number to the tensor's dtype, and a factor beyond float32's normal
    range (the unit of a weight of 3e38 is 2^128) would give inf, and 0 * inf NaN."""
    return not (factor == 0 or _FLOAT32_TINY <= abs(factor) <= FLOAT32_MAX)


def _untied_entries(layout: ModelLayout, names: list, float_out: list[Tensor],
                    floats: list[list[Tensor]], float_base: list[Tensor]) -> list[int] | None:
    """The float entries to compute when some ``out`` entries are one tensor under several
    keys (a model with tied weights, e.g. an embedding shared with the output layer: its
    state_dict holds the parameter twice), or None when none is. Each tied tensor is written
    once, through its first key; so that this is the result under every key, the base's and
    each client's entries under the tied keys must agree (the same memory, or equal values)."""
    starts = list(map(Tensor.data_ptr, float_out))
    if len(set(starts)) == len(starts):  # the usual case: no two entries start at one address
        return None
    seen: dict[int, list[int]] = {}
    repeats = []
    for j, o in enumerate(float_out):
        if o.numel() == 0:
            continue
        same = [i for i in seen.get(o.data_ptr(), ()) if same_memory(float_out[i], o)]
        if same:
            repeats.append((same[0], j))
        else:
            seen.setdefault(o.data_ptr(), []).append(j)
    if not repeats:
        return None
    sources = ([("base", float_base)] if float_base else []) + [
        (f"client {k}", c) for k, c in enumerate(floats)]
    for i, j in repeats:
        for who, tensors in sources:
            a, b = tensors[i], tensors[j]
            if not (same_memory(a, b) or torch.equal(a, b)
                    or (a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0,
                                                              equal_nan=True))):
                raise ValueError(
                    f"fedkernels.aggregate: out tensors {layout.label(names[i])} and "
                    f"{layout.label(names[j])} are one tensor (tied weights), but {who} has "
                    "different values under the two keys; the result could not be both")
    dropped = {j for _, j in repeats}
    return [j for j in range(len(float_out)) if j not in dropped]


def _refuse_non_strided(layout: ModelLayout, names: list, floats: list[list[Tensor]],
                        base: list[Tensor]) -> None:
    """After the native op failed: a TypeError naming the first sparse (or otherwise not
    strided) tensor, which the op cannot read; looked for only then, so valid calls pay
    nothing for it."""
    sources = [(f"client {k}, tensor", c) for k, c in enumerate(floats)] + [("base tensor", base)]
    for who, tensors in sources:
        for name, t in zip(names, tensors):
            if t.layout != torch.strided:
                raise TypeError(f"fedkernels.aggregate: {who} {layout.label(name)} has layout "
                                f"{t.layout}; only dense (strided) tensors are supported "
                                "(call .to_dense())")


def _refuse_gradients_into_out(layout: ModelLayout, names: list, floats: list[list[Tensor]],
                               float_base: list[Tensor], float_out: list[Tensor]) -> None:
    """With grad mode on, ``out=`` takes no input that requires grad: the result is written into
    existing tensors and carries no graph (PyTorch's own ``out=`` functions refuse the same;
    the call without ``out`` is differentiable). Nor may it write a leaf that requires grad,
    as no in-place op may. The op refuses both before writing anything (its autograd kernel,
    csrc/ops.cpp), so this runs only after the op failed, to name the tensor: a pass over
    every tensor in Python would be a large part of a call on a model of many small tensors."""
    if not torch.is_grad_enabled():
        return
    api = "fedkernels.aggregate"
    for name, o in zip(names, float_out):
        if o.requires_grad and o.is_leaf:
            raise RuntimeError(f"{api}: out tensor {layout.label(name)} is a leaf that requires "
                               "grad; write it under torch.no_grad(), as PyTorch's in-place ops "
                               "require")
    sources = [(f"client {k}, tensor ", c) for k, c in enumerate(floats)]
    sources.append(("base tensor ", float_base))
    for who, tensors in sources:
        for name, t in zip(names, tensors):
            if t.requires_grad:
                raise RuntimeError(
                    f"{api}: {who}{layout.label(name)} requires grad, but out= writes the result "
                    "into existing tensors, which carry no gradient; call aggregate without out= "
                    "for a differentiable result, or under torch.no_grad()")


def _check_weight_range(values: list[float] | None, scale, normalize: bool,
                        named_floats: Iterable[tuple[object, Tensor]], layout: ModelLayout,
                        api: str = "fedkernels.aggregate", who: str = "client") -> None:
    """The op casts each weight and ``scale`` to the accumulate dtype: fp32 for fp32, fp16
    and bf16 tensors. A weight that is finite in float64 but beyond fp32's range would become
    inf there (and 0 * inf = NaN), so it is refused, naming the client. ``normalize=True``
    divides in float64 first, so weights of any finite size are exact there. ``values`` are
    the (normalized) weights read on the host, None where they cannot be (weights on a GPU,
    or under torch.compile: the scale checks need no data, the weight check does)."""
    if torch.compiler.is_compiling():
        return
    if isinstance(scale, (int, float)) and not math.isfinite(scale):
        raise ValueError(f"{api}: scale must be finite, got {scale}")
    narrow = next(((name, t.dtype) for name, t in named_floats if t.dtype != torch.float64), None)
    if narrow is None:
        return
    where = f"tensor {layout.label(narrow[0])} ({narrow[1]}) accumulates in float32"
    if isinstance(scale, (int, float)) and abs(scale) > FLOAT32_MAX:
        raise ValueError(f"{api}: scale {scale:.4g} is beyond the float32 range "
                         f"(|x| <= {FLOAT32_MAX:.4g}); {where}")
    if values is None or (max(values) <= FLOAT32_MAX and min(values) >= -FLOAT32_MAX):
        return
    big = [k for k, x in enumerate(values) if abs(x) > FLOAT32_MAX]
    if big:
        k = big[0]
        after = " after normalization (the weights nearly cancel)" if normalize else ""
        hint = "" if normalize else "; scale them down or pass normalize=True, which divides " \
                                    "in float64 first"
        raise ValueError(f"{api}: weight of {who} {k} is {values[k]:.4g}{after}, beyond the "
                         f"float32 range (|w| <= {FLOAT32_MAX:.4g}): {where} (weights out of "
                         f"range: {who}s {big[:10]}){hint}")


# ---------------------------------------------------------------- aggregate


def aggregate(
    updates,
    weights,
    *,
    base: Model | None = None,
    scale: float = 1.0,
    normalize: bool = False,
    out: Model | None = None,
    int_policy: str = "max",
    check_finite: bool = False,
) -> Model:
    r"""Weighted sum of K client models in one fused pass.

    Plain mode: :math:`r = \mathrm{scale}\cdot\sum_k w_k x_k`. Delta mode (``base`` given):
    :math:`r = b + \mathrm{scale}\cdot\sum_k w_k (x_k - b)`, the server-learning-rate form of
    FedAvgM, FedAU and AAggFF (``scale`` is the server learning rate).

    Args:
        updates: K client models: a list of state_dicts (same keys and shapes), a list of
            tensor lists (same shapes), a list of tensors, or one ``[K, P]`` tensor of flat
            vectors. The result has the structure of one client (dict, list or 1-D tensor;
            a ``Module.state_dict()``'s ``_metadata`` is carried over, as a copy).
        weights: K real numbers (tensor, list or numpy array; booleans are refused), used as given
            unless ``normalize``.
        base: the current global model, same structure as a client; turns on delta mode.
        scale: multiplies the weighted sum (server learning rate in delta mode).
        normalize: divide the weights by their sum (FedAvg); off by default because some
            methods (FedAU) divide by the number of clients instead.
        out: where to write the result (same structure, dtype and device as the result); may
            be ``base`` itself to update the global model in place. Must not alias a client.
            Entries that are one tensor under two keys (tied weights) are written once; the
            clients and ``base`` must then agree under those keys.
        int_policy: what integer/bool tensors (BatchNorm's ``num_batches_tracked``) become:
            ``"max"`` (default: elementwise max over clients, right for counters),
            ``"first"`` (client 0's), ``"skip"`` (base's, or client 0's without a base), or
            ``"error"``.
        check_finite: scan the updates first and raise a ``ValueError`` naming the clients
            that carry NaN/Inf (costs one extra read of the updates).

    Half-precision inputs accumulate in fp32, float64 in fp64; the result has the updates'
    dtype (or base's in delta mode). Clients are summed in order, so the same inputs give
    bitwise the same result on the same device. Nothing is written before every input has
    been checked; errors name the client and tensor at fault.
    """
    if int_policy not in INT_POLICIES:
        raise ValueError(f"fedkernels.aggregate: int_policy must be one of {INT_POLICIES}, "
                         f"not {int_policy!r}")
    models, flat = split_clients(updates)
    if not models:
        raise ValueError("fedkernels.aggregate: no client updates (K = 0)")
    # The layout of client 0 is remembered across calls (see model_layout); every client is
    # still checked against it on every call, and the native op checks shapes, dtypes,
    # devices, weights and memory overlap in C++.
    if type(scale) is not float and not torch.compiler.is_compiling():  # traced: symbolic
        scale = real_number("fedkernels.aggregate", "scale", scale)
    layout = ModelLayout.of(models[0], "client 0")
    clients = layout.client_tensors(models)
    w, w_values = weights_and_values(weights, len(models), normalize)
    base_tensors = None if base is None else layout.tensors(base, "base")
    out_tensors = None if out is None else layout.tensors(out, "out")
    if flat and base_tensors is not None and base_tensors[0].dim() != 1:
        raise ValueError("fedkernels.aggregate: with [K, P] updates, base must be a 1-D [P] tensor")

    is_float = layout.float_mask
    float_names = layout.float_names
    if layout.int_index:
        index = layout.float_index
        floats = [[c[i] for i in index] for c in clients]
        float_base = [] if base_tensors is None else [base_tensors[i] for i in index]
    else:
        floats, float_base = clients, base_tensors or []

    # Integer/bool entries: checked and resolved before anything is written.
    int_results = {}
    for i in layout.int_index:
        int_results[i] = _int_result(
            [c[i] for c in clients],
            None if base_tensors is None else base_tensors[i],
            int_policy,
            layout.label(layout.names[i]),
        )
    if check_finite:
        report = _nonfinite_clients(floats, float_names, layout)
        if report:
            raise ValueError("fedkernels.aggregate: non-finite values (NaN/Inf) in "
                             + "; ".join(report))

    _check_weight_range(w_values, scale, normalize,
                        itertools.chain(zip(float_names, floats[0]), zip(float_names, float_base)),
                        layout)
    if out_tensors is not None:
        _check_outputs(layout, out_tensors, int_results, clients, base_tensors)
        float_out = [t for t, f in zip(out_tensors, is_float) if f]
        op_out = float_out
        keep = _untied_entries(layout, float_names, float_out, floats, float_base)
        if keep is not None:  # tied entries: computed once, through their first key
            float_names = [float_names[j] for j in keep]
            floats = [[c[j] for j in keep] for c in floats]
            float_base = [float_base[j] for j in keep] if float_base else float_base
            op_out = [float_out[j] for j in keep]

    flat_updates = [t for c in floats for t in c]
    delta = base is not None
    try:
        if out_tensors is None:
            results = summation.weighted_sum(flat_updates, w, float_base, scale, delta)
        else:
            in_place = bool(float_base) and all(
                same_memory(o, b) for o, b in zip(op_out, float_base)
            )
            if in_place:
                summation.weighted_sum_(float_base, flat_updates, w, scale, delta)
            else:
                summation.weighted_sum_out(flat_updates, w, float_base, scale, delta, op_out)
            results = float_out
    except (RuntimeError, ValueError, TypeError) as err:
        if out_tensors is not None:
            _refuse_gradients_into_out(layout, float_names, floats, float_base, op_out)
        _refuse_non_strided(layout, float_names, floats, float_base)
        raise _rename(err, layout, float_names) from None

    meta = getattr(models[0], "_metadata", None)
    if not int_results:
        return out if out is not None else with_metadata(layout.build(results), meta)
    merged, it = [], iter(results)
    for i, f in enumerate(is_float):
        if f:
            merged.append(next(it))
        elif out_tensors is not None:
            if out_tensors[i].data_ptr() != int_results[i].data_ptr():
                out_tensors[i].copy_(int_results[i])
            merged.append(out_tensors[i])
        else:
            merged.append(int_results[i].clone())
    if out is not None:
        return out
    return with_metadata(layout.build(merged), meta)


# ---------------------------------------------------------------- streaming


def _one_weight(weight, what: str) -> Tensor:
    """Accumulator.add's weight: one real, finite number (a Python or NumPy scalar, or a
    one-element tensor), as a float64 tensor of one element."""
    api = "fedkernels.Accumulator"
    if isinstance(weight, Tensor):
        if weight.numel() != 1:
            raise ValueError(f"{api}: the weight of {what} must be one number, got a tensor of "
                             f"shape {tuple(weight.shape)}")
        if weight.is_complex() or weight.dtype == torch.bool:
            raise TypeError(f"{api}: the weight of {what} must be a real number, got {weight.dtype}")
        if weight.device.type == "meta":  # no value to read, nor to sum
            raise ValueError(f"{api}: the weight of {what} is on the meta device, which holds "
                             "no values")
        w = weight.detach().reshape(1).to(torch.float64)
        value = float(w[0]) if w.device.type == "cpu" else None
    else:
        if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, numbers.Real):
            raise TypeError(f"{api}: the weight of {what} must be a real number, got "
                            f"{type(weight).__name__}")
        try:
            value = float(weight)
        except OverflowError:
            raise ValueError(f"{api}: the weight of {what} is beyond the float64 range") from None
        w = torch.tensor([value], dtype=torch.float64, device="cpu")
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{api}: the weight of {what} is {value}")
    return w


@contextlib.contextmanager
def _speaking_as_accumulator(reference: str):
    """The layout checks' errors, which speak as aggregate's ("client 0"), in Accumulator's
    words: ``reference`` is the update the structure comes from."""
    try:
        yield
    except (TypeError, ValueError) as err:
        message = str(err).replace("fedkernels.aggregate:", "fedkernels.Accumulator:", 1)
        raise type(err)(message.replace("client 0", reference)) from None


class Accumulator:
    r"""Streaming weighted sum for servers that receive clients one at a time.

    Holds one accumulator per tensor (fp32, or fp64 for fp64 models): O(P) memory whatever
    the number of clients. Each :meth:`add` is one fused pass ``acc += w·x``.
    :meth:`result` returns what :func:`aggregate` would for the same clients and weights, up
    to float rounding: :math:`\mathrm{scale}\sum_k w_k x_k`, or with ``base``
    :math:`b + \mathrm{scale}\,(\sum_k w_k x_k - (\sum_k w_k)\, b)`. Updates are read as
    values: the result carries no gradient (call :func:`aggregate` for a differentiable one).
    The accumulators hold the sum relative to a power of two near the largest weight and
    :math:`\sum w_k` is kept in float64, so weights whose float32 sum or value would overflow
    or vanish (3e38 + 3e38, 1e-46) normalise as in :func:`aggregate`. A copy made between
    adds (``copy.copy``, ``copy.deepcopy``, pickling) goes on without touching the original.
    Thread-safe: :meth:`add`, :meth:`result`, :meth:`reset` and copies hold one lock, so
    threads that add into one accumulator (a server receiving uploads concurrently) get the
    sum of all their updates, added one at a time in some order.

    >>> acc = Accumulator()
    >>> for sd, n in incoming:        # doctest: +SKIP
    ...     acc.add(sd, n)
    >>> global_sd = acc.result(normalize=True)  # doctest: +SKIP
    """

    def __init__(self, *, base: Model | None = None, scale: float = 1.0,
                 int_policy: str = "max"):
        if int_policy not in INT_POLICIES:
            raise ValueError(f"fedkernels.Accumulator: int_policy must be one of {INT_POLICIES}, "
                             f"not {int_policy!r}")
        scale = real_number("fedkernels.Accumulator", "scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"fedkernels.Accumulator: scale must be finite, got {scale}")
        self.base = base
        self.scale = scale
        self.int_policy = int_policy
        # add(), result(), reset() and copies hold it: two threads adding into one accumulator
        # raced on the running sums (an in-place pass each) and on the totals.
        self._lock = CopyableLock()
        self._clear()

    def _clear(self) -> None:
        self._layout: ModelLayout | None = None
        self._acc: list[Tensor] = []
        self._ints: dict[int, Tensor] = {}
        self._dtypes: list[torch.dtype] = []
        self._total_weight = 0.0
        # sum_k w_k / unit (rescaled with the unit): finite where sum_k w_k overflows float64
        # (two weights of 1e308), so such weights still normalise
        self._total_units = 0.0
        # The accumulators hold sum_k (w_k / unit) x_k, unit a power of two near the largest
        # weight (moved, with one rescaling pass, when a weight exceeds it by 2^32): weights
        # near or past the float32 limits (3e38 + 3e38, 1e-46) then sum as aggregate's
        # normalised ones do, and the float64 factor unit / sum w is applied once.
        self._unit: float | None = None
        self._largest_weight = 0.0
        self._metadata = None
        self.count = 0

    def add(self, update: Model, weight: float) -> None:
        """Adds ``weight · update``. ``update`` has the structure of the first one added.
        Thread-safe: concurrent adds are applied one at a time, in some order."""
        with self._lock:
            self._add(update, weight)

    def _add(self, update: Model, weight: float) -> None:
        what = f"update {self.count}"
        w = _one_weight(weight, what)
        if self._layout is None:
            with _speaking_as_accumulator(what):
                layout = ModelLayout.of(update, what)
                tensors = layout.tensors(update, what)
                base = None if self.base is None else layout.tensors(self.base, "base")
            if base is not None:
                for name, t, b, f in zip(layout.names, tensors, base, layout.float_mask):
                    ok_dtype = b.dtype == t.dtype or (
                        f and b.dtype == torch.float32
                        and t.dtype in (torch.float16, torch.bfloat16))
                    if b.shape != t.shape or b.device != t.device or not ok_dtype:
                        raise ValueError(
                            f"fedkernels.Accumulator: base tensor {layout.label(name)} is "
                            f"{b.dtype} {tuple(b.shape)} on {b.device}, {what} has {t.dtype} "
                            f"{tuple(t.shape)} on {t.device}")
        else:
            layout = self._layout
            with _speaking_as_accumulator("the first update"):
                tensors = layout.tensors(update, what)
            for name, t, dtype in zip(layout.names, tensors, self._dtypes):
                if t.dtype != dtype:
                    raise TypeError(f"fedkernels.Accumulator: update {self.count}, tensor "
                                    f"{layout.label(name)} has dtype {t.dtype}, the first "
                                    f"update had {dtype}")
        # Read as values: the running sum is a buffer, not a graph (the class docstring).
        floats = [t.detach() for t, f in zip(tensors, layout.float_mask) if f]
        float_names = [n for n, f in zip(layout.names, layout.float_mask) if f]
        value = float(w[0])
        unit, rescale = self._unit, None
        if value != 0 and (unit is None or abs(value) > unit * 2.0**32):
            new_unit = weight_unit(value)
            rescale = None if unit is None else unit / new_unit
            unit = new_unit
        unit = unit if unit is not None else 1.0
        for name, t, a in zip(float_names, floats, self._acc):
            if t.shape != a.shape or t.device != a.device:
                raise ValueError(f"fedkernels.Accumulator: {what}, tensor {layout.label(name)} "
                                 f"has shape {tuple(t.shape)} on {t.device}, the first update "
                                 f"had {tuple(a.shape)} on {a.device}")
        for i, f in enumerate(layout.float_mask):
            if not f:
                prev = self._ints.get(i)
                values = [tensors[i]] if prev is None else [prev, tensors[i]]
                policy = "first" if self.int_policy in ("first", "skip") else self.int_policy
                _int_result(values, None, policy, layout.label(layout.names[i]),
                            who=[what] if prev is None else ["the first update", what],
                            api="fedkernels.Accumulator")
        acc = self._acc
        # The running sums are made as normal tensors also under torch.inference_mode(): made
        # there, they would be inference tensors, which no later add() outside it could write.
        with torch.inference_mode(False):
            if rescale is not None:  # new tensors: the old ones stay until the update is accepted
                acc = [a * rescale for a in acc]
            if self._layout is None:
                acc = [torch.zeros(t.shape, device=t.device, dtype=torch.float64
                                   if t.dtype == torch.float64 else torch.float32)
                       for t in floats]
        try:
            summation.weighted_sum_(acc, floats, w / unit, 1.0, False)
        except (RuntimeError, ValueError, TypeError) as err:
            try:  # a sparse (not strided) update: named, not the dispatcher's message
                _refuse_non_strided(layout, float_names, [floats], [])
            except TypeError as layout_err:
                raise TypeError(str(layout_err).replace("client 0", what)) from None
            err = _rename(err, layout, float_names, "fedkernels.Accumulator")  # client 0: `what`
            raise type(err)(str(err).replace("client 0", what)) from None
        # Only now, with the update accepted, is any state changed.
        for i, f in enumerate(layout.float_mask):
            if not f:
                prev = self._ints.get(i)
                if prev is None or self.int_policy in ("first", "skip"):
                    self._ints.setdefault(i, tensors[i].clone())
                else:
                    self._ints[i] = elementwise_max(prev, tensors[i])
        if self._layout is None:  # the first update's state_dict _metadata, if any
            self._metadata = getattr(update, "_metadata", None)  # with_metadata copies it
        self._layout, self._acc = layout, acc
        self._dtypes = [t.dtype for t in tensors]
        self._total_weight += value
        self._total_units = (self._total_units * (1.0 if rescale is None else rescale)
                             + value / unit)
        self._largest_weight = max(self._largest_weight, abs(value))
        if value != 0:
            self._unit = unit
        self.count += 1

    def result(self, *, normalize: bool = False) -> Model:
        """The aggregate so far, in the models' dtypes; ``normalize`` divides by Σw. Taken
        between adds when other threads are adding."""
        with self._lock:
            return self._result(normalize)

    def _result(self, normalize: bool) -> Model:
        if self._layout is None:
            raise ValueError("fedkernels.Accumulator: no update was added")
        if normalize and self._total_units == 0:
            raise ValueError("fedkernels.Accumulator: normalize=True but the weights sum to 0")
        layout = self._layout
        narrow = [n for n, d, f in zip(layout.names, self._dtypes, layout.float_mask)
                  if f and d != torch.float64]
        if narrow and abs(self.scale) > FLOAT32_MAX:  # as aggregate refuses it
            raise ValueError(
                f"fedkernels.Accumulator: scale {self.scale:.4g} is beyond the float32 range "
                f"(|x| <= {FLOAT32_MAX:.4g}) of tensor {layout.label(narrow[0])}")
        if not normalize and self._largest_weight > FLOAT32_MAX and narrow:
            # as aggregate refuses it: w x is beyond float32 in the result
            raise ValueError(
                f"fedkernels.Accumulator: a weight of {self._largest_weight:.4g} is beyond "
                f"the float32 range (|w| <= {FLOAT32_MAX:.4g}) of tensor "
                f"{layout.label(narrow[0])}; use result(normalize=True), or float64 models")
        unit = self._unit or 1.0
        units = self._total_units  # sum_k w_k / unit
        # sum_k w_k x_k = unit * accumulator, and sum_k w_k = unit * units
        factor = (1.0 / units if normalize else unit) * self.scale
        with _speaking_as_accumulator("the first update"):
            base = None if self.base is None else layout.tensors(self.base, "base")
        out, acc = [], iter(self._acc)
        for i, f in enumerate(layout.float_mask):
            if not f:
                if self.int_policy == "skip" and base is not None:
                    out.append(base[i].clone())
                else:
                    out.append(self._ints[i].clone())
                continue
            a = next(acc)
            dtype = self._dtypes[i]
            wide = a.dtype == torch.float32 and needs_float64_factor(factor)
            if base is None:
                out.append(((a.double() if wide else a) * factor).to(dtype))
            else:
                b = base[i].to(a.dtype)
                d = a - units * b
                out.append((b + ((d.double() if wide else d) * factor)).to(base[i].dtype))
        return with_metadata(layout.build(out), self._metadata)

    def __copy__(self) -> Accumulator:
        """A snapshot that goes on on its own: :meth:`add` writes the running sums in place,
        so ``copy.copy`` gives the copy its own (``base`` stays shared: it is only read).
        ``copy.deepcopy`` and pickling copy everything, ``base`` included."""
        new = type(self).__new__(type(self))
        with self._lock:
            new.__dict__.update(self.__dict__)
            new._acc = [a.clone() for a in self._acc]
            new._ints = dict(self._ints)  # its tensors are replaced, never written
        new._lock = CopyableLock()
        return new

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickling: a snapshot taken between adds (the running sums
        cloned under the lock, as another thread may be adding)."""
        with self._lock:
            state = dict(self.__dict__)
            state["_acc"] = [a.clone() for a in self._acc]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "_lock" not in state:  # pickled before the lock existed
            self._lock = CopyableLock()

    def reset(self) -> None:
        """Forgets every update added so far."""
        with self._lock:
            self._clear()
