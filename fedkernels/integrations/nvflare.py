r"""NVIDIA FLARE aggregators whose arithmetic is the fused ``weighted_sum`` op
(``pip install 'fedkernels[nvflare]'``, NVFlare >= 2.9).

NVFlare's in-time aggregation keeps, for every model key :math:`j`, a running weighted sum and
a running weight, and divides at the end of the round:

.. math:: r_j = \frac{\sum_{k \ni j} w_k\, x_{k,j}}{\sum_{k \ni j} w_k},
   \qquad w_k = a_k \cdot n_k

(:math:`a_k` the contributor's ``aggregation_weights`` entry, default 1, :math:`n_k` the
``NUM_STEPS_CURRENT_ROUND`` of its result, default 1; the sums run over the contributions that
carry key :math:`j`). With ``weigh_by_local_iter=False`` the numerator is :math:`\sum x_{k,j}`,
the denominator unchanged. NVFlare computes this with one multiply and one add per array and
contribution (``v * w`` then ``total + ...`` in NumPy, ``add_`` in torch); here each NumPy
contribution is folded in as it arrives by one fused ``weighted_sum_`` pass over all of its
arrays into fp32 accumulators (fp64 from where NumPy's running total turns float64, as with
float64 arrays or ``np.float64`` weights): one model of accumulators whatever the number of
clients. Torch contributions may be held (``hold_bytes``, on by default in the aggregators) and
summed several at a time, so that each pass reads and writes the running sums once for
several contributions.

Drop-ins (same names as NVFlare's, so a job config changes the module path only):

- :class:`WeightedAggregationHelper`: NVFlare's helper
  (``nvflare.app_common.aggregators.weighted_aggregation_helper``), same methods, attributes,
  history and aggregation stats.
- :class:`InTimeAccumulateWeightedAggregator`: subclasses NVFlare's class of the same name and
  swaps only its helpers for ours, so constructor arguments and their checks, contribution-round
  and duplicate checks, accept/reject values, log messages, DXO collections, the
  ``PROCESSED_ALGORITHM`` meta and the stats published to the ``FLContext`` are NVFlare's code.
- :class:`WeightedModelAggregator`: a ``ModelAggregator`` for NVFlare's ``FedAvg`` controller
  and ``FedAvgRecipe`` (``aggregator=WeightedModelAggregator()``) that gives the result of the
  controller's built-in aggregation; :func:`aggregate_fn` replaces ``BaseFedAvg.aggregate_fn``.

Integer and bool NumPy arrays, NumPy array subclasses (masked arrays, ``np.matrix``) and values
that are not arrays of at least one dimension (Python or NumPy scalars, 0-d tensors, complex
arrays, encrypted tensors, metrics) go through NVFlare's own formula, so they give NVFlare's
result exactly (NumPy's integer wrap-around, the logical OR of a bool sum). Result dtypes are
NumPy's for NVFlare's products, sums and final ``total * (1.0 / sum)``, NumPy-scalar weights
included. Weights that sum to a Python 0 raise NVFlare's ``ZeroDivisionError`` (naming the key)
for NumPy and Python values; torch tensors give NVFlare's NaN/Inf. Where this module differs on
purpose: a contribution whose array for a key has another shape (or device, or kind) than the
earlier ones is refused with a ``ValueError`` naming the contributor and key, before anything
is accumulated (NVFlare broadcasts shapes that broadcast and raises half-way otherwise); a
non-finite weight, or one beyond the float32 range of an fp32 accumulator, is refused the same
way; tensors that require grad are read as values (no autograd graph); half-precision arrays
accumulate in fp32; integer tensors average into floating point also with
``weigh_by_local_iter=False`` (NVFlare's in-place division raises there).
"""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
import warnings
from typing import Any, NamedTuple

import numpy as np
import torch

try:
    from nvflare.apis.fl_constant import FLMetaKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable
    from nvflare.app_common.abstract.fl_model import FLModel
    from nvflare.app_common.aggregators.intime_accumulate_model_aggregator import (
        InTimeAccumulateWeightedAggregator as _FlareInTimeAggregator,
    )
    from nvflare.app_common.aggregators.model_aggregator import ModelAggregator
    from nvflare.app_common.aggregators.weighted_aggregation_helper import (
        AggregationStatsKey,
        filter_aggregatable_metrics,
    )
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.workflows.base_fedavg import make_fedavg_metrics_aggregation_info
except ImportError as _err:  # pragma: no cover - exercised only without nvflare
    raise ImportError(
        "fedkernels.integrations.nvflare needs NVIDIA FLARE (nvflare >= 2.9), which is not "
        "installed: pip install 'fedkernels[nvflare]'"
    ) from _err

from fedkernels.aggregate import FLOAT32_MAX
from fedkernels.ops import summation
from fedkernels.ops.concurrency import CopyableLock

__all__ = [
    "ContributionError",
    "InTimeAccumulateWeightedAggregator",
    "WeightedAggregationHelper",
    "WeightedModelAggregator",
    "aggregate_fn",
]

_HALF = (torch.float16, torch.bfloat16)
_NUMPY_FUSED = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class ContributionError(ValueError):
    """A contribution that cannot be folded into the running sums (shape, device or kind of an
    array differs from the earlier contributions', or a non-finite weight). Raised before
    anything is accumulated."""


class _WeightTypeError(ContributionError, TypeError):
    """A weight that is not a real number: also the TypeError NVFlare's ``v * weight`` raises."""


def _tensor_from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory where torch can (it only reads it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only arrays: the tensor is never written
            return torch.from_numpy(a)
    except (ValueError, TypeError):  # negative strides, non-native byte order
        return torch.from_numpy(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("=")))


class _ArrayEntry:
    """One key's array as the fused pass takes it. ``dtype``: a NumPy array's own dtype (the
    running total's dtype follows from it and the weight), a torch tensor's result dtype."""

    __slots__ = ("tensor", "kind", "dtype")

    def __init__(self, tensor: torch.Tensor, kind: str, dtype):
        self.tensor, self.kind, self.dtype = tensor, kind, dtype


def _array_entry(v: Any) -> _ArrayEntry | None:
    """The fused path takes floating-point NumPy arrays and real torch tensors of at least one
    dimension; None sends ``v`` to NVFlare's formula. Integer and bool NumPy arrays go there
    too: NumPy's integer arithmetic (wrap-around, logical OR of bools) is part of NVFlare's
    result. Torch gives NVFlare's result the default float dtype for integer tensors."""
    if isinstance(v, np.ndarray):
        # Subclasses (masked arrays, np.matrix) keep their own arithmetic and type in NVFlare's
        # formula; the op would read the raw data and return a plain ndarray.
        if type(v) is not np.ndarray or v.ndim == 0 or v.dtype not in _NUMPY_FUSED:
            return None
        return _ArrayEntry(_tensor_from_numpy(v), "numpy", v.dtype)
    if isinstance(v, torch.Tensor):
        # sparse (and other non-strided) tensors: NVFlare's formula, which torch runs on them
        if v.layout != torch.strided or v.dim() == 0 or v.is_complex() or v.dtype not in (
            torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.uint8,
            torch.int8, torch.int16, torch.int32, torch.int64
        ):
            return None
        t = v.detach()
        if not t.is_floating_point():
            t = t.to(torch.get_default_dtype())
        return _ArrayEntry(t, "torch", t.dtype)
    return None


def _describe(entry: _ArrayEntry) -> str:
    name = "NumPy array" if entry.kind == "numpy" else "torch tensor"
    return f"{name} of shape {tuple(entry.tensor.shape)} on {entry.tensor.device}"


def _is_nd_array(v: Any) -> bool:
    return isinstance(v, np.ndarray) and v.ndim > 0


def _check_hold_bytes(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"hold_bytes must be an int >= 0 (bytes; 0 sums each contribution at "
                         f"once), got {value!r}")
    return value


class _Plan(NamedTuple):
    """What one ``add`` will do, decided before anything changes."""

    fresh: dict  # device -> (keys, arrays): new keys, whose accumulator is step * x
    fused: dict  # device -> (accumulators, arrays): summed now
    held: dict  # device -> (accumulators, arrays): torch arrays that may be held back
    new_arrays: dict  # key -> a new accumulator
    new_types: dict  # key -> (kind, dtype)
    new_values: dict  # key -> NVFlare's formula's new total
    demoted: set  # keys leaving the op for NVFlare's formula
    contributed: list
    skipped: list
    narrow: str | None  # a key with an fp32 accumulator (the weight must fit float32)


class _HeldContribution:
    """A contribution's torch arrays for keys with running sums, held to be summed later
    (``hold_bytes``). ``versions``: the arrays' version counters when added, so that an array
    changed in place since (the sum would take its new values) is refused, not summed."""

    __slots__ = ("contributor", "arrays", "step", "nbytes", "signature", "versions",
                 "versions_known")

    def __init__(self, contributor: str, arrays: dict, step: float):
        self.contributor, self.arrays, self.step = contributor, arrays, step
        xs = [x for _, xs in arrays.values() for x in xs]
        self.nbytes = sum(x.nbytes for x in xs)
        self.signature = tuple(
            (device, tuple(map(id, accs)), tuple(x.dtype for x in xs))
            for device, (accs, xs) in arrays.items())
        try:
            self.versions = [x._version for x in xs]
            self.versions_known = True
        except RuntimeError:  # inference tensors keep no version counter: summed at once
            self.versions, self.versions_known = [], False

    def check_unchanged(self) -> None:
        xs = [x for _, xs in self.arrays.values() for x in xs]
        for x, version in zip(xs, self.versions):
            if x._version != version:
                raise ContributionError(
                    f"contribution from {self.contributor!r}: a tensor of shape "
                    f"{tuple(x.shape)} was changed in place after add(), before it was summed; "
                    "the helper holds torch contributions back (hold_bytes) to sum several in "
                    "one pass: do not change them until get_result(), or set hold_bytes=0")


class WeightedAggregationHelper:
    r"""Streaming weighted mean per key, NVFlare's ``WeightedAggregationHelper`` on the fused op.

    :meth:`add` folds one contribution in: for every key :math:`j` of ``data`` (but those
    matching ``exclude_vars``) :math:`S_j \mathrel{+}= w\,x_j` (or :math:`x_j` with
    ``weigh_by_local_iter=False``) and :math:`W_j \mathrel{+}= w`; :meth:`get_result` returns
    :math:`S_j \cdot (1 / W_j)` and resets. All float arrays of a contribution go through one
    fused pass into fp32 accumulators (fp64 where NumPy's total would be float64); the results
    have NVFlare's types and dtypes (NumPy in, NumPy out, with NumPy's promotion of the arrays
    and the weights; torch in, torch out on the same device). Integer and bool NumPy arrays
    take NVFlare's NumPy formula. Thread-safe like NVFlare's (one lock).

    ``hold_bytes`` (default 0: each contribution is summed in :meth:`add`, as NVFlare does):
    the torch arrays of later contributions, for keys that have running sums, are held (not
    copied) until holding the next would pass ``hold_bytes`` bytes, then summed in one pass.
    That reads and writes the running sums once per batch instead of once per contribution.
    A held tensor changed in place before it is summed is refused (:class:`ContributionError`
    from the call that sums it, and from :meth:`get_result`), not summed with its new values.

    Same public attributes as NVFlare's: ``lock``, ``exclude_vars`` (compiled regex or None),
    ``weigh_by_local_iter``, ``total`` (key -> running sum; reading it sums the held
    contributions in), ``counts`` (key -> :math:`W_j`), ``history``,
    ``key_contribution_counts``, ``skipped_keys``, ``last_aggregation_stats``.
    """

    def __init__(self, exclude_vars: str | None = None, weigh_by_local_iter: bool = True, *,
                 hold_bytes: int = 0):
        self.hold_bytes = _check_hold_bytes(hold_bytes)
        self.lock = threading.Lock()
        self.exclude_vars = re.compile(exclude_vars) if exclude_vars else None
        self.weigh_by_local_iter = weigh_by_local_iter
        self.last_aggregation_stats = None
        self.reset_stats()

    @property
    def total(self) -> dict:
        """key -> running weighted sum (contributions held back are summed in first)."""
        with self.lock, torch.inference_mode(False), torch.no_grad():
            self._sum_held()
            return self._total

    @total.setter
    def total(self, value: dict) -> None:
        with self.lock:
            self._held = []
            self._torch_layouts = {}
            self._total = value

    def reset_stats(self) -> None:
        self._total = {}
        # Torch contributions not yet summed into ``_total`` (``hold_bytes``), oldest first.
        self._held: list[_HeldContribution] = []
        # key -> (accumulator, dtype, shape, device) of the keys summed in torch, as seen by
        # _plan_known_torch (a torch key keeps its accumulator until the reset).
        self._torch_layouts: dict[str, tuple] = {}
        self.counts = {}
        self.history = []
        self.key_contribution_counts = {}
        self.skipped_keys = set()
        # Keys summed by the fused op: key -> ("numpy", dtype of NVFlare's running total) or
        # ("torch", result dtype).
        self._array_keys: dict[str, tuple[str, Any]] = {}

    def _total_dtype(self, total: np.dtype | None, dtype: np.dtype, weight) -> np.dtype:
        """The dtype of NVFlare's running total once ``v * weight`` (or ``v``), ``v`` an array
        of ``dtype``, is added to a total of dtype ``total`` (None: the key's first value).
        NumPy's promotion: a Python number takes the array's dtype, a NumPy scalar counts
        with its own."""
        if self.weigh_by_local_iter and type(weight) not in (float, int, bool):
            dtype = (np.empty(0, dtype) * weight).dtype
        return dtype if total is None or total == dtype else np.result_type(total, dtype)

    def add(self, data: dict, weight: float, contributor_name: str, contribution_round) -> None:
        """Folds ``weight`` × ``data`` into the running sums (see the class docstring).

        Raises :class:`ContributionError` (a ``ValueError``), with nothing accumulated, when the
        weight is not a finite number or an array's shape, device or kind (NumPy/torch) differs
        from the earlier contributions' for the same key. A weight that is not a real number
        (None, text) raises one that is also a ``TypeError``, as NVFlare's ``v * weight`` does.
        """
        # The running sums are made as normal tensors also under torch.inference_mode(): made
        # there, they would be inference tensors, which no later add() outside it could write.
        with self.lock, torch.inference_mode(False):
            who = f"contribution from {contributor_name!r}"
            try:
                if isinstance(weight, (str, bytes, bytearray)):  # float("2") would take it,
                    raise TypeError  # and get_result would fail on the text in counts
                w = float(weight)
            except (TypeError, ValueError):
                raise _WeightTypeError(
                    f"{who}: weight must be a number, got {type(weight).__name__}") from None
            if not math.isfinite(w):
                raise ContributionError(f"{who}: weight is {w}; it must be finite")

            plan = self._plan_known_torch(data) or self._plan(data, weight, who)
            (fresh, fused, held, new_arrays, new_types, new_values, demoted, contributed, skipped,
             narrow) = plan
            step = w if self.weigh_by_local_iter else 1.0
            if narrow is not None and abs(step) > FLOAT32_MAX:
                raise ContributionError(
                    f"{who}: weight {step:.4g} is beyond the float32 range of the accumulator "
                    f"of key {narrow!r}")

            holding = None
            if held:
                holding = _HeldContribution(contributor_name, held, step)
                if not holding.versions_known or holding.nbytes > self.hold_bytes:
                    holding = None  # summed now, with the other arrays
                    for device, (accs, xs) in held.items():
                        fused_accs, fused_xs = fused.setdefault(device, ([], []))
                        fused_accs += accs
                        fused_xs += xs

            # One fused pass per device over the new keys (acc = step·x) and one over the
            # arrays of keys seen before (acc += step·x). The new keys first: their pass writes
            # only new tensors, so if it fails no running sum has been changed.
            weights = torch.tensor([step], dtype=torch.float64, device="cpu") if fresh or fused else None
            with torch.no_grad():
                for keys, xs in fresh.values():
                    new_arrays.update(zip(keys, summation.weighted_sum(xs, weights)))
                for accs, xs in fused.values():
                    summation.weighted_sum_(accs, xs, weights, 1.0, False)

            for k in contributed:
                self.key_contribution_counts[k] = self.key_contribution_counts.get(k, 0) + 1
                if k in new_arrays:
                    self._total[k] = new_arrays[k]
                elif k in new_values:
                    self._total[k] = new_values[k]
                if k in new_types:
                    self._array_keys[k] = new_types[k]
                elif k in demoted:
                    del self._array_keys[k]
                self.counts[k] = self.counts[k] + weight if k in self.counts else weight
            self.skipped_keys.update(skipped)
            self.history.append(
                {"contributor_name": contributor_name, "round": contribution_round, "weight": weight}
            )
            if holding is not None:  # last: it is counted whatever summing held ones raises
                with torch.no_grad():
                    self._hold(holding)

    def _plan(self, data: dict, weight, who: str) -> _Plan:
        """What ``add`` does with each value of ``data``, checked against the earlier
        contributions; nothing is changed yet."""
        fused: dict[torch.device, tuple[list, list]] = {}
        held: dict[torch.device, tuple[list, list]] = {}  # torch arrays of known keys
        fresh: dict[torch.device, tuple[list, list]] = {}
        new_arrays: dict[str, torch.Tensor] = {}
        new_types: dict[str, tuple[str, Any]] = {}
        new_values: dict[str, Any] = {}
        demoted: set[str] = set()
        contributed, skipped = [], []
        narrow = None
        for k, v in data.items():
            if self.exclude_vars is not None and self.exclude_vars.search(k):
                skipped.append(k)
                continue
            contributed.append(k)
            materialize = getattr(v, "materialize", None)
            if callable(materialize):  # NVFlare's lazy references to tensors on disk
                v = materialize()
            entry = _array_entry(v)
            known = self._array_keys.get(k)
            current = self._total.get(k)
            if known is None:
                if current is not None:
                    self._check_formula_key(who, k, v, entry, current)
                if entry is None or current is not None:
                    new_values[k] = self._fallback_sum(current, v, weight)
                    continue
                t = entry.tensor
                if entry.kind == "numpy":
                    total_dtype = self._total_dtype(None, entry.dtype, weight)
                    if total_dtype not in _NUMPY_FUSED:  # a long double weight
                        new_values[k] = self._fallback_sum(None, v, weight)
                        continue
                    new_types[k] = ("numpy", total_dtype)
                    if total_dtype == np.float64:  # also for float32 data with np.float64
                        t = t.to(torch.float64)
                else:
                    new_types[k] = ("torch", entry.dtype)
                if t.dtype in (torch.float32, torch.float64):
                    # A new key: its accumulator is the op's output w·x (no zero fill).
                    if narrow is None and t.dtype == torch.float32:
                        narrow = k
                    fresh_keys, fresh_xs = fresh.setdefault(t.device, ([], []))
                    fresh_keys.append(k)
                    fresh_xs.append(t)
                    continue
                acc = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                new_arrays[k] = acc
            else:
                acc = current
                total_dtype = None
                if known[0] == "numpy" and entry is not None and entry.kind == "numpy":
                    total_dtype = self._total_dtype(known[1], entry.dtype, weight)
                fusable = total_dtype is not None and total_dtype in _NUMPY_FUSED
                if known[0] == "numpy" and _is_nd_array(v) and not fusable \
                        and tuple(v.shape) == tuple(acc.shape):
                    # An integer array (or a long double weight) for a key summed so far by
                    # the op: from here on NVFlare's formula, from the total in its dtype.
                    numpy_total = acc.to(_torch_dtype(known[1])).numpy()
                    new_values[k] = self._fallback_sum(numpy_total, v, weight)
                    demoted.add(k)
                    continue
                if entry is None:
                    raise ContributionError(
                        f"{who}, key {k!r}: got a {type(v).__name__}"
                        + (f" of shape {tuple(np.shape(v))}" if hasattr(v, "shape") else "")
                        + f"; earlier contributions sent a {known[0]} array of shape "
                        f"{tuple(acc.shape)}")
                t = entry.tensor
                if entry.kind != known[0] or t.shape != acc.shape or t.device != acc.device:
                    raise ContributionError(
                        f"{who}, key {k!r}: got a {_describe(entry)}; earlier contributions "
                        f"sent a {'NumPy array' if known[0] == 'numpy' else 'torch tensor'} "
                        f"of shape {tuple(acc.shape)} on {acc.device}")
                if entry.kind == "numpy":
                    new_types[k] = ("numpy", total_dtype)
                    if total_dtype == np.float64 and acc.dtype != torch.float64:
                        # NumPy's total turns float64 here (a float64 array or weight).
                        acc = acc.to(torch.float64)
                        new_arrays[k] = acc
            if t.dtype != acc.dtype and not (acc.dtype == torch.float32 and t.dtype in _HALF):
                t = t.to(acc.dtype)
            if acc.dtype == torch.float32 and narrow is None:
                narrow = k
            accs, xs = (held if known is not None and known[0] == "torch" and k not in
                        new_arrays else fused).setdefault(t.device, ([], []))
            accs.append(acc)
            xs.append(t)
        return _Plan(fresh, fused, held, new_arrays, new_types, new_values, demoted, contributed,
                     skipped, narrow)

    def _plan_known_torch(self, data: dict) -> _Plan | None:
        """The plan of a contribution that sends, for keys all summed so far in torch, tensors
        of their accumulators' dtypes, shapes and devices (every contribution after the first
        in a PyTorch job), without the general checks' per-key cost; None otherwise."""
        if self.exclude_vars is not None or not data:
            return None
        layouts = self._torch_layouts
        arrays: dict[torch.device, tuple[list, list]] = {}
        narrow = None
        for k, v in data.items():
            layout = layouts.get(k)
            if layout is None:
                acc = self._total.get(k)
                if acc is None or self._array_keys.get(k, ("",))[0] != "torch":
                    return None
                layout = layouts[k] = (acc, acc.dtype, acc.shape, acc.device)
            acc, dtype, shape, device = layout
            if type(v) is not torch.Tensor or v.dtype != dtype or v.shape != shape \
                    or v.device != device or v.layout != torch.strided:
                return None
            if narrow is None and dtype == torch.float32:
                narrow = k
            accs, xs = arrays.setdefault(device, ([], []))
            accs.append(acc)
            xs.append(v)  # read under no_grad: no detach needed
        fused, held = ({}, arrays) if self.hold_bytes else (arrays, {})
        return _Plan({}, fused, held, {}, {}, {}, set(), list(data), [], narrow)

    def _hold(self, contribution: _HeldContribution) -> None:
        """Holds a contribution's torch arrays back to sum several in one pass of the op, which
        reads each running sum once per batch instead of once per contribution; sums now what
        cannot wait (the held bytes would pass ``hold_bytes``, or the arrays differ in keys or
        dtypes from those held)."""
        if self._held and self._held[0].signature != contribution.signature:
            self._sum_held()
        self._held.append(contribution)
        if sum(c.nbytes for c in self._held) > self.hold_bytes:
            self._sum_held()

    def _sum_held(self) -> None:
        """Adds the held contributions into the running sums, one fused pass per device. The
        caller holds the lock."""
        if not self._held:
            return
        for c in self._held:  # kept held if this raises: get_result() refuses too
            c.check_unchanged()
        held, self._held = self._held, []
        weights = torch.tensor([c.step for c in held], dtype=torch.float64, device="cpu")
        for device, (accs, _) in held[0].arrays.items():
            xs = [x for c in held for x in c.arrays[device][1]]
            summation.weighted_sum_(accs, xs, weights, 1.0, False)

    @staticmethod
    def _check_formula_key(who: str, k: str, v: Any, entry: _ArrayEntry | None, current) -> None:
        """A key summed by NVFlare's formula takes what that formula takes, but arrays of
        another shape (NumPy would broadcast them) and arrays where it holds a scalar."""
        if _is_nd_array(v) and _is_nd_array(current):
            if v.shape != current.shape:
                raise ContributionError(
                    f"{who}, key {k!r}: got a NumPy array of shape {v.shape}; earlier "
                    f"contributions sent a NumPy array of shape {current.shape}")
        elif entry is not None:
            raise ContributionError(
                f"{who}, key {k!r}: got a {_describe(entry)}; earlier contributions "
                f"sent a {type(current).__name__}")

    def _fallback_sum(self, current: Any, v: Any, w) -> Any:
        """NVFlare's arithmetic for a value the fused op does not take, added to ``current``
        (None for a key's first value) without changing it (torch values are cloned before
        the in-place add)."""
        is_torch = WeightedAggregationHelper._is_pytorch_tensor
        if current is None:
            if is_torch(v):
                return v.mul(w) if self.weigh_by_local_iter else v.clone()
            if self.weigh_by_local_iter:
                return v * w
            try:
                return v.copy() if hasattr(v, "copy") else v
            except (ValueError, RuntimeError):  # encrypted values cannot be copied
                return v
        if is_torch(v) and is_torch(current):
            out = current.clone()
            return out.add_(v, alpha=w) if self.weigh_by_local_iter else out.add_(v)
        return current + v * w if self.weigh_by_local_iter else current + v

    @staticmethod
    def _is_pytorch_tensor(tensor) -> bool:
        return hasattr(tensor, "add_") and hasattr(tensor, "mul_") and hasattr(tensor, "clone")

    def get_result(self) -> dict:
        """:math:`S_j \\cdot (1 / W_j)` for every key, in the order keys were first seen; then
        resets.

        Raises ``ZeroDivisionError`` naming the key, as NVFlare does (its ``1.0 / W_j``), where
        the weights of a NumPy or Python value sum to a Python 0; nothing is reset then. Torch
        tensors divide in place as in NVFlare, giving NaN/Inf for a zero sum.
        """
        with self.lock:
            with torch.inference_mode(False), torch.no_grad():
                self._sum_held()
            reciprocals = {}
            for k, v in self._total.items():
                known = self._array_keys.get(k)
                torch_value = known[0] == "torch" if known else self._is_pytorch_tensor(v)
                if torch_value:
                    continue  # torch divides in place: NaN/Inf for a zero sum, as in NVFlare
                try:
                    reciprocals[k] = 1.0 / self.counts[k]
                except ZeroDivisionError:
                    raise ZeroDivisionError(
                        f"key {k!r}: the weights of its {self.key_contribution_counts[k]} "
                        f"contribution(s) sum to {self.counts[k]!r}; the weighted mean "
                        "divides by that sum (1.0 / sum in NVFlare)") from None
            result = {}
            scaled = self._scaled_by_the_op(reciprocals)
            for k, v in self._total.items():
                if k in scaled:
                    result[k] = scaled[k]
                    continue
                known = self._array_keys.get(k)
                if known is None:
                    if k in reciprocals:
                        result[k] = v * reciprocals[k]
                    else:
                        # In place as NVFlare does; an integer 0-d tensor (summed unweighted)
                        # cannot hold its mean, so it gets a new floating-point one.
                        integral = isinstance(v, torch.Tensor) and not (
                            v.is_floating_point() or v.is_complex())
                        result[k] = v / self.counts[k] if integral else v.div_(self.counts[k])
                    continue
                kind, dtype = known
                if kind == "torch":
                    result[k] = v.div_(self.counts[k]).to(dtype)  # the accumulator is dropped
                    continue
                # NVFlare's total (dtype) times its reciprocal: NumPy's dtype for the product.
                scale = reciprocals[k]
                out = (np.empty(0, dtype) * scale).dtype
                if out == np.float64 and v.dtype != torch.float64:
                    v = v.to(torch.float64)
                result[k] = v.mul_(float(scale)).numpy().astype(out, copy=False)
            self.last_aggregation_stats = self._compute_aggregation_stats()
            self.reset_stats()
            return result

    def _scaled_by_the_op(self, reciprocals: dict) -> dict:
        """NVFlare's final ``total * (1.0 / W)`` of the NumPy keys whose running total keeps
        its dtype, by the fused op (one fp32 or fp64 multiply per value, NumPy's rounding), a
        few MiB of accumulators a call, each accumulator dropped as soon as it is scaled (the
        peak stays one model): PyTorch's per-tensor ``mul_`` is one parallel region per tensor,
        which a busy machine's other work slows many times over."""
        groups: dict[tuple, list[str]] = {}
        for k, v in self._total.items():
            known = self._array_keys.get(k)
            if known is None or known[0] != "numpy" or k not in reciprocals:
                continue
            scale = reciprocals[k]
            if v.dtype != _torch_dtype(known[1]) or not math.isfinite(scale) \
                    or (v.dtype != torch.float64 and abs(float(scale)) > FLOAT32_MAX) \
                    or (np.empty(0, known[1]) * scale).dtype != np.dtype(known[1]):
                continue
            groups.setdefault((float(scale), v.dtype, v.device), []).append(k)
        out = {}
        for (scale, _, _), keys in groups.items():
            weight = torch.tensor([scale], dtype=torch.float64, device="cpu")
            batch, batch_bytes = [], 0
            for i, k in enumerate(keys):
                batch.append(k)
                batch_bytes += self._total[k].numel() * self._total[k].element_size()
                if batch_bytes < _SCALE_BATCH_BYTES and i + 1 < len(keys):
                    continue
                with torch.no_grad():
                    results = summation.weighted_sum([self._total[b] for b in batch], weight)
                for b, r in zip(batch, results):
                    out[b] = r.numpy()
                    self._total[b] = r  # the accumulator goes now
                batch, batch_bytes = [], 0
        return out

    def _compute_aggregation_stats(self) -> dict:
        n = len(self.history)
        aggregated = len(self._total)
        full = sum(1 for c in self.key_contribution_counts.values() if c == n) if n else 0
        return {
            AggregationStatsKey.ACCEPTED_CONTRIBUTIONS: n,
            AggregationStatsKey.CONTRIBUTORS: sorted({h["contributor_name"] for h in self.history}),
            AggregationStatsKey.KEYS_AGGREGATED: aggregated,
            AggregationStatsKey.KEYS_SEEN: aggregated + len(self.skipped_keys),
            AggregationStatsKey.FULLY_MATCHED_KEYS: full,
            AggregationStatsKey.PARTIALLY_MATCHED_KEYS: aggregated - full,
            AggregationStatsKey.SKIPPED_KEYS: len(self.skipped_keys),
        }

    def get_aggregation_stats(self) -> dict:
        """Key-match stats of the contributions added so far this round (NVFlare's fields)."""
        with self.lock:
            return self._compute_aggregation_stats()

    def get_history(self) -> list:
        return self.history

    def get_len(self) -> int:
        return len(self.get_history())


# The aggregators' default ``hold_bytes``: the torch arrays of up to this many bytes of
# contributions wait to be summed together (reading each running sum once per batch).
AGGREGATOR_HOLD_BYTES = 256 << 20

# How many bytes of accumulators one call of the final scaling takes.
_SCALE_BATCH_BYTES = 8 << 20

_FLARE_INTIME_LOGGER = f"{_FlareInTimeAggregator.__module__}.{_FlareInTimeAggregator.__qualname__}"


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


class InTimeAccumulateWeightedAggregator(_FlareInTimeAggregator):
    """NVFlare's ``InTimeAccumulateWeightedAggregator`` with the fused helper.

    Same constructor arguments (``exclude_vars``, ``aggregation_weights``,
    ``expected_data_kind``: WEIGHTS, WEIGHT_DIFF, METRICS or a dict per DXO of a collection,
    ``weigh_by_local_iter``) and the same behaviour, which is NVFlare's own code: this class only
    replaces the :class:`WeightedAggregationHelper` of each per-DXO aggregator when NVFlare
    builds them (at ``START_RUN``, or when ``_initialize`` is called as NVFlare's tests do).
    ``hold_bytes`` (keyword, default :data:`AGGREGATOR_HOLD_BYTES`) goes to those helpers:
    torch contributions are summed several at a time; 0 sums each on arrival.
    One addition: a contribution refused by the helper (:class:`ContributionError`: another
    shape, device or kind than earlier contributions for a key, or a non-finite weight) is
    logged as an error naming the contributor and key, and :meth:`accept` returns False.

    In a job config, change the component's path only::

        "path": "fedkernels.integrations.nvflare.InTimeAccumulateWeightedAggregator"

    Its records go to the logger of NVFlare's class: NVFlare's log configuration selects by
    logger name (``log_fl.txt`` and the concise console keep INFO records of
    ``nvflare.app_common`` loggers only), so they are filed as NVFlare's own.
    """

    @property
    def logger(self) -> logging.Logger:
        return self._logger

    @logger.setter
    def logger(self, value: logging.Logger) -> None:
        # FLComponent names the logger after the instance's class; ours takes NVFlare's name.
        if value is not None and value.name == f"{__name__}.InTimeAccumulateWeightedAggregator":
            value = logging.getLogger(_FLARE_INTIME_LOGGER)
        self._logger = value

    def __init__(self, *args, hold_bytes: int = AGGREGATOR_HOLD_BYTES, **kwargs):
        self.hold_bytes = _check_hold_bytes(hold_bytes)
        super().__init__(*args, **kwargs)

    def _initialize(self, aggregation_weights, exclude_vars, expected_data_kind):
        super()._initialize(aggregation_weights, exclude_vars, expected_data_kind)
        for key, dxo_aggregator in self.dxo_aggregators.items():
            dxo_aggregator.aggregation_helper = WeightedAggregationHelper(
                exclude_vars=self.exclude_vars[key], weigh_by_local_iter=self._weigh_by_local_iter,
                hold_bytes=self.hold_bytes)

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        try:
            return super().accept(shareable, fl_ctx)
        except ContributionError as err:
            self.log_error(fl_ctx, f"rejected: {err}")
            return False


def _client_name(model: FLModel) -> str:
    value = (model.meta or {}).get("client_name", AppConstants.CLIENT_UNKNOWN)
    return value if isinstance(value, str) and value else AppConstants.CLIENT_UNKNOWN


def _num_steps_weight(model: FLModel) -> float:
    """``NUM_STEPS_CURRENT_ROUND`` of a result; 1.0 when missing, not a number, or not > 0."""
    value = (model.meta or {}).get(FLMetaKey.NUM_STEPS_CURRENT_ROUND)
    if value is None or isinstance(value, bool):
        return 1.0
    try:
        weight = float(value)
    except (TypeError, ValueError, OverflowError):
        return 1.0
    return weight if math.isfinite(weight) and weight > 0 else 1.0


class WeightedModelAggregator(ModelAggregator):
    r"""The built-in in-time aggregation of NVFlare's ``FedAvg`` controller, as a
    ``ModelAggregator`` on the fused helper.

    Pass it to the controller or the recipe; NVFlare ignores the controller's own
    ``exclude_vars``/``aggregation_weights`` once an aggregator is given, so they move here::

        FedAvgRecipe(..., aggregator=WeightedModelAggregator(exclude_vars="bn",
                                                             aggregation_weights={"site-1": 2.0}))

    Each result's weight is ``aggregation_weights.get(client, 1.0)`` times its
    ``NUM_STEPS_CURRENT_ROUND`` (1.0 when missing or not positive); params are averaged per key,
    and the numeric metrics with the same weights while every result carries metrics (as the
    controller does). The aggregated ``FLModel`` has the controller's params, params type,
    metrics, round and meta (``nr_aggregated``, ``current_round``, metrics aggregation info);
    the round's key-match stats go to ``AppConstants.AGGREGATION_STATS`` of the aggregator's
    ``FLContext``. ``hold_bytes``: as for :class:`InTimeAccumulateWeightedAggregator`.
    Thread-safe: :meth:`accept_model`, :meth:`aggregate_model` and :meth:`reset_stats` hold
    one lock.
    """

    def __init__(self, exclude_vars: str | None = None,
                 aggregation_weights: dict[str, float] | None = None, *,
                 hold_bytes: int = AGGREGATOR_HOLD_BYTES):
        super().__init__()
        self.hold_bytes = _check_hold_bytes(hold_bytes)
        if exclude_vars is not None and not isinstance(exclude_vars, str):
            raise TypeError(f"WeightedModelAggregator: exclude_vars must be a regex string or "
                            f"None, got {type(exclude_vars).__name__}")
        if aggregation_weights is not None and not isinstance(aggregation_weights, dict):
            raise TypeError("WeightedModelAggregator: aggregation_weights must be a dict "
                            f"{{client name: weight}} or None, got "
                            f"{type(aggregation_weights).__name__}")
        self.exclude_vars = exclude_vars
        self.aggregation_weights = aggregation_weights or {}
        self._warned_metric_keys: set[str] = set()
        # Results may be accepted from several threads (NVFlare's result callbacks), as the
        # helpers allow: the counts, metric weights and round beside them are held by one lock.
        self._lock = CopyableLock(reentrant=True)
        self.reset_stats()

    def reset_stats(self) -> None:
        with self._lock:
            self._reset_stats()

    def _reset_stats(self) -> None:
        self._params_helper = WeightedAggregationHelper(exclude_vars=self.exclude_vars,
                                                        hold_bytes=self.hold_bytes)
        self._metrics_helper = WeightedAggregationHelper()
        self._all_metrics = True
        self._params_type = None
        self._site_metric_weights: dict[str, dict] = {}
        self._received = 0
        self._round = None

    def accept_model(self, model: FLModel) -> bool:
        with self._lock:
            return self._accept_model(model)

    def _accept_model(self, model: FLModel) -> bool:
        client = _client_name(model)
        if not model.params:
            self.warning(f"Empty result from client {client}, skipping.")
            return False
        if self._params_type is None:
            self._params_type = model.params_type
        weight = self.aggregation_weights.get(client, 1.0) * _num_steps_weight(model)
        self._params_helper.add(model.params, weight, client, model.current_round)
        self._site_metric_weights[client] = {
            "name": client, "weight": weight, "weight_key": "effective_fedavg_metric_weight"}
        if model.metrics is None:
            self._all_metrics = False
        if self._all_metrics and model.metrics:
            numeric = filter_aggregatable_metrics(
                model.metrics,
                warn_skipped=lambda k, tn: self.warning(f"Metric '{k}' ({tn}) skipped for aggregation."),
                warned_metric_keys=self._warned_metric_keys,
            )
            if numeric:
                self._metrics_helper.add(numeric, weight, client, model.current_round)
        self._received += 1
        self._round = model.current_round
        return True

    def aggregate_model(self) -> FLModel:
        with self._lock:
            return self._aggregate_model()

    def _aggregate_model(self) -> FLModel:
        current_round = self._round
        if self.fl_ctx is not None:
            ctx_round = self.fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
            current_round = ctx_round if ctx_round is not None else current_round
        stats = self._params_helper.get_aggregation_stats()
        stats[AggregationStatsKey.ROUND] = current_round
        if self.fl_ctx is not None:
            self.fl_ctx.set_prop(AppConstants.AGGREGATION_STATS, stats, private=True, sticky=False)
        params = self._params_helper.get_result()
        metrics = (self._metrics_helper.get_result() if self._all_metrics else None) or None
        site_weights = list(self._site_metric_weights.values()) or None
        info = make_fedavg_metrics_aggregation_info(
            weight_key="effective_fedavg_metric_weight" if site_weights
            else FLMetaKey.NUM_STEPS_CURRENT_ROUND,
            weight_formula="aggregation_weight * NUM_STEPS_CURRENT_ROUND" if site_weights else None,
            site_weights=site_weights,
        )
        result = FLModel(
            params=params,
            params_type=self._params_type,
            metrics=metrics,
            current_round=current_round,
            meta={"nr_aggregated": self._received, "current_round": current_round,
                  AppConstants.METRICS_AGGREGATION_INFO: info},
        )
        self.reset_stats()
        return result


def aggregate_fn(results: list[FLModel]) -> FLModel:
    """``BaseFedAvg.aggregate_fn`` on the fused helper: for ``self.aggregate(results,
    aggregate_fn=aggregate_fn)`` in a ``ModelController`` workflow. Params and numeric metrics
    are averaged with each result's ``NUM_STEPS_CURRENT_ROUND`` as weight (1.0 when missing);
    metrics are None when any result has none."""
    if not results:
        raise ValueError("received empty results for aggregation.")
    # Every result is in memory already: all of them are summed in one pass.
    params = WeightedAggregationHelper(hold_bytes=sys.maxsize)
    for r in results:
        params.add(r.params, _num_steps_weight(r), _client_name(r), r.current_round)
    metrics = WeightedAggregationHelper()
    all_metrics = True
    for r in results:
        if r.metrics is None:
            all_metrics = False
            break
        numeric = filter_aggregatable_metrics(r.metrics)
        if numeric:
            metrics.add(numeric, _num_steps_weight(r), _client_name(r), r.current_round)
    return FLModel(
        params=params.get_result(),
        params_type=results[0].params_type,
        metrics=(metrics.get_result() or None) if all_metrics else None,
        meta={
            "nr_aggregated": len(results),
            "current_round": results[0].current_round,
            AppConstants.METRICS_AGGREGATION_INFO: make_fedavg_metrics_aggregation_info(),
        },
    )

