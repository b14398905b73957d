"""The fused weighted mean of Flower replies' ArrayRecords, with the dtypes, integer rules and
errors of Flower's ``aggregate_arrayrecords``: what the drop-ins, the robust strategies and the
DP wrappers of :mod:`fedkernels.integrations.flower` average with, and a function for custom
strategies (:func:`aggregate_arrayrecords`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from fedkernels.aggregate import aggregate
from fedkernels.integrations.flower.records import (
    FUSED_FLOAT_DTYPES,
    array_with_buffer,
    as_tensors,
    ndarray_to_array,
    ndarray_view,
    to_arrayrecord,
)
from fedkernels.model_layout import INT_POLICIES

__all__ = ["INT_POLICIES_FLOWER", "aggregate_arrayrecords", "fused_weighted_mean"]

INT_POLICIES_FLOWER = ("mean",) + tuple(INT_POLICIES)


def check_int_policy(owner: str, int_policy: object) -> str:
    """``int_policy`` if it is one of :data:`INT_POLICIES_FLOWER`, else ValueError naming ``owner``."""
    if not isinstance(int_policy, str) or int_policy not in INT_POLICIES_FLOWER:
        raise ValueError(f"{owner}: int_policy must be one of {INT_POLICIES_FLOWER}, "
                         f"not {int_policy!r}")
    return int_policy


def _flower_mean_entry(arrays: Sequence[np.ndarray], factors: Sequence[float]) -> np.ndarray:
    """One entry of Flower's ``aggregate_arrayrecords``, with its NumPy semantics (dtype of
    the first reply, 0-d promotion, broadcasting, its exceptions). Used for what the fused op
    does not take: exotic dtypes, shapes that differ between replies, non-finite weights."""
    acc = None
    for a, w in zip(arrays, factors):
        if acc is None:
            acc = a * w
        else:
            acc += a * w
    return np.asarray(acc)


def _mean_dtype(arrays: Sequence[np.ndarray], factors: Sequence[Any]) -> np.dtype:
    """The dtype of Flower's weighted mean of one entry, ``acc = x_0 * w_0; acc += x_k * w_k``:
    NumPy's dtype for ``x * w`` (a Python float keeps a float array's dtype and makes int/bool
    float64; a NumPy float64 weight, which a MetricRecord accepts as a float subclass, makes
    float16/float32 arrays float64 too); the in-place sum keeps the first product's dtype, but
    0-d entries are NumPy scalars, whose sum promotes."""
    if arrays[0].ndim == 0:
        return np.result_type(*(np.result_type(a.dtype, w) for a, w in zip(arrays, factors)))
    return np.result_type(arrays[0].dtype, factors[0])


def int_policy_entry(name: str, arrays: Sequence[np.ndarray], base: np.ndarray | None,
                      policy: str) -> np.ndarray:
    """An all-integer entry under a fedkernels int_policy ("max", "first", "skip")."""
    first = arrays[0]
    for k, a in enumerate(arrays[1:], start=1):
        if a.shape != first.shape or a.dtype != first.dtype:
            raise ValueError(f"array '{name}': reply {k} is {a.dtype} {a.shape}, reply 0 is "
                             f"{first.dtype} {first.shape} (int_policy={policy!r} needs equal "
                             "shapes and dtypes)")
    if policy == "skip" and base is not None:
        return np.array(base)
    if policy in ("first", "skip"):
        return np.array(first)
    return np.maximum.reduce([np.asarray(a) for a in arrays])


def weights_from_records(contents: Sequence[Any], key: str) -> list[float]:
    """Flower's normalized weights: :math:`n_k / \\sum_j n_j`, in Python arithmetic (so all
    zero weights raise ``ZeroDivisionError`` as in Flower)."""
    weights = [next(iter(c.metric_records.values()))[key] for c in contents]
    total = sum(weights)
    return [w / total for w in weights]


def fused_weighted_mean(records: Sequence[ArrayRecord], factors: Sequence[float], *,
                        int_policy: str = "mean", check_finite: bool = False,
                        base: Mapping[str, np.ndarray] | None = None,
                        as_arrays: bool = False,
                        ) -> tuple[dict[str, Any], set[str]]:
    r""":math:`\sum_k w_k x_k` over the replies' ArrayRecords, entry by entry, with the
    dtypes of Flower's ``aggregate_arrayrecords`` (keys in the first record's order).

    Float entries of equal shape go through one fused ``weighted_sum`` over zero-copy views
    of the replies' bytes (a reply whose dtype differs from the result's is converted first).
    Integer/bool entries follow ``int_policy``: ``"mean"`` (Flower: averaged into float64),
    ``"max"``, ``"first"``, ``"skip"`` (``base``'s entry) or ``"error"``. Returns the means
    and the names of the entries an integer policy other than ``"mean"`` resolved (a server
    optimizer leaves those alone). Non-finite weights, shapes that differ between replies and
    dtypes the op lacks take Flower's NumPy arithmetic, so they give Flower's result or error.

    With ``as_arrays`` the values are Flower ``Array`` objects, equal to ``Array(mean)``: the
    fused op writes each mean straight into the bytes its ``Array`` keeps (no copy of the
    result into a second buffer).
    """
    names = list(records[0].keys())
    views = {n: [ndarray_view(r[n]) for r in records] for n in names}
    ints = [n for n in names if all(a.dtype.kind in "biu" for a in views[n])]
    if int_policy == "error" and ints:
        raise TypeError(f"integer arrays {ints[:5]} and int_policy='error'; choose 'mean' "
                        "(Flower's), 'max', 'first' or 'skip'")
    finite_weights = all(math.isfinite(w) for w in factors)
    out: dict[str, np.ndarray] = {}
    resolved: set[str] = set()
    fused: dict[str, np.dtype] = {}
    targets = None
    for n in names:
        arrays = views[n]
        if n in ints and int_policy != "mean":
            out[n] = int_policy_entry(n, arrays, None if base is None else base.get(n),
                                       int_policy)
            resolved.add(n)
            continue
        dtype = _mean_dtype(arrays, factors)
        same_shape = all(a.shape == arrays[0].shape for a in arrays)
        kinds_ok = all(a.dtype.kind in "biuf" and (a.dtype.kind != "f" or a.dtype in
                                                   FUSED_FLOAT_DTYPES) for a in arrays)
        if finite_weights and same_shape and kinds_ok and dtype in FUSED_FLOAT_DTYPES:
            fused[n] = dtype
        else:
            out[n] = _flower_mean_entry(arrays, factors)
    if fused:
        clients = [
            dict(zip(fused, as_tensors([views[n][k] for n in fused], fused.values())))
            for k in range(len(records))
        ]
        weights = torch.tensor([float(w) for w in factors], dtype=torch.float64, device="cpu")
        targets = None
        if as_arrays:
            targets = {n: array_with_buffer(dtype, views[n][0].shape)
                       for n, dtype in fused.items()}
            if any(t is None for t in targets.values()):
                targets = None
        if targets is None:
            result = aggregate(clients, weights, check_finite=check_finite)
            for n in fused:
                out[n] = result[n].numpy()
        else:
            aggregate(clients, weights, check_finite=check_finite,
                      out={n: values for n, (_, values) in targets.items()})
            for n, (array, _) in targets.items():
                out[n] = array
    if as_arrays:
        return {n: out[n] if n in fused and targets is not None else ndarray_to_array(out[n])
                for n in names}, resolved
    return {n: out[n] for n in names}, resolved


def aggregate_arrayrecords(records: list[RecordDict], weighting_metric_name: str, *,
                           int_policy: str = "mean", check_finite: bool = False) -> ArrayRecord:
    """Flower's ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords`` (the
    weighted mean of the replies' ArrayRecords, weighted by the ``weighting_metric_name``
    metric), for custom strategies.

    Records that each carry one ArrayRecord with the same keys (what Flower's strategies
    validate replies to be) go through :func:`fused_weighted_mean`. Anything else takes
    Flower's own semantics, array by array: every ArrayRecord of every record is summed with
    its record's weight into the entry of its key, in the order keys are first seen (a key some
    records lack is summed over those that carry it, with the weights normalized over all
    records); no records, or records without ArrayRecords, give an empty ArrayRecord. There
    an integer array with an ``int_policy`` other than ``"mean"`` raises (those policies need
    aligned replies), and ``check_finite`` checks every array."""
    policy = check_int_policy("aggregate_arrayrecords", int_policy)
    factors = weights_from_records(records, weighting_metric_name)
    if records and all(len(r.array_records) == 1 for r in records):
        arrays = [next(iter(r.array_records.values())) for r in records]
        names = set(arrays[0].keys())
        if all(set(a.keys()) == names for a in arrays[1:]):
            means, _ = fused_weighted_mean(arrays, factors, int_policy=policy,
                                           check_finite=check_finite, as_arrays=True)
            return ArrayRecord(means)
    return to_arrayrecord(_flower_aggregate_arrayrecords(records, factors, policy,
                                                         check_finite))


def _flower_aggregate_arrayrecords(records: Sequence[RecordDict], factors: Sequence[float],
                                   int_policy: str, check_finite: bool) -> dict[str, np.ndarray]:
    """Flower's ``aggregate_arrayrecords`` loop (each array times its record's factor, added
    in place into the first product of its key), on views of the replies' bytes."""
    out: dict[str, np.ndarray] = {}
    for k, (record, factor) in enumerate(zip(records, factors)):
        for array_record in record.array_records.values():
            for name, value in array_record.items():
                a = ndarray_view(value)
                if int_policy != "mean" and a.dtype.kind in "biu":
                    error = TypeError if int_policy == "error" else ValueError
                    raise error(f"aggregate_arrayrecords: integer array '{name}' in record {k} "
                                f"and int_policy={int_policy!r}, which needs every record to "
                                "carry one ArrayRecord with the same keys; these do not")
                if check_finite and a.dtype.kind in "fc" and not np.isfinite(a).all():
                    raise ValueError(f"aggregate_arrayrecords: record {k} carries NaN/Inf in "
                                     f"array '{name}'")
                if name in out:
                    out[name] += a * factor
                else:
                    out[name] = a * factor
    return out
