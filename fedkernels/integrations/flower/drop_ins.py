r"""Flower strategies that aggregate with :func:`fedkernels.aggregate.aggregate`
(``pip install 'fedkernels[flower]'``), for Flower's Message API (``flwr.serverapp.strategy``,
the API Flower recommends since 1.21).

**Drop-ins.** :class:`FedAvg`, :class:`FedProx`, :class:`FedAvgM`, :class:`FedAdam`,
:class:`FedYogi`, :class:`FedAdagrad` and :class:`QFedAvg` subclass Flower's class of the same
name (``isinstance(FedAdam(), flwr.serverapp.strategy.FedAdam)`` holds) and override only the
arithmetic of ``aggregate_train``: the weighted sum over the K replies is one fused
``weighted_sum`` pass over zero-copy views of the replies' bytes, instead of Flower's per-reply
``np.load`` copy, multiply and add. Constructor arguments, public attributes
(``current_arrays``, ``m_t``, ``v_t``, ``momentum_vector``, ``server_opt``, ...), attributes
changed after construction, output dtypes, exceptions (``AggregationError``,
``InconsistentMessageReplies``, ``ZeroDivisionError``) and side effects are Flower's; the
server-optimizer step after the mean is Flower's formula on NumPy arrays. Replace the import
and nothing else::

    from fedkernels.integrations.flower import FedAdam   # was: from flwr.serverapp.strategy

    @app.main()
    def main(grid, context):
        strategy = FedAdam(fraction_train=0.5, eta=0.05)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=10)

Values equal Flower's to rounding, not bitwise (a fixed summation order with fused
multiply-adds). Differences one keyword away: integer/bool arrays (BatchNorm's
``num_batches_tracked``) are averaged into float64 as Flower does (``int_policy="mean"``, the
default), ``int_policy="max"`` keeps them integers (the clients' maximum); ``check_finite=True``
rejects replies that carry NaN/Inf. Flower's ``FedTrimmedAvg`` and ``FedMedian`` are not
wrapped: a trimmed mean or a median is a selection over the K replies, not a weighted sum
(it needs a selection kernel, planned as a new op).

**fedkernels' own strategies** (:class:`FusedStrategy` and its subclasses) move the global
model :math:`x_t` by

.. math:: \Delta_t = \sum_k w_k (x_k - x_t)

through a server optimizer (plain: :math:`x_{t+1} = x_t + \eta\Delta_t`), with :math:`w_k`
from:

=====================  ======================================================================
:class:`QFFL`          :math:`n_k f_k^q / \sum_j n_j f_j^q`
:class:`TERM`          :math:`\mathrm{softmax}(\tau f + \log p)`
:class:`SemiVRed`,     (semi-)variance reduction weights
:class:`VRed`
:class:`FedAU`         :math:`\omega_n/N`, online participation-interval estimate per node
:class:`AAggFF`        AAggFF-D (sampled nodes) or AAggFF-S (all nodes every round)
=====================  ======================================================================

:math:`f_k` is the float each client reports in its ``MetricRecord`` under ``loss_key``
(default ``"train_loss"``, Flower's QFedAvg key). The fair-FL papers use the loss of the
*received* global model on the client's training data, measured before local training.
FedAU and AAggFF identify clients by their Flower node id (an integer).
"""

from __future__ import annotations

import functools
import inspect
import io
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp import Grid
    from flwr.serverapp import strategy as _flwr
    from flwr.serverapp.exception import AggregationError
    from flwr.serverapp.strategy import FedAvg as _FlowerFedAvg
    from flwr.serverapp.strategy.qfedavg import get_train_loss as _flwr_train_loss
except ImportError as _err:  # pragma: no cover - exercised only without flwr
    raise ImportError(
        "fedkernels.integrations.flower needs Flower (flwr >= 1.41), which is not installed: "
        "pip install 'fedkernels[flower]'"
    ) from _err

from fedkernels.aggregate import aggregate
from fedkernels.integrations.adapters import ndarrays_to_tensors, tensors_to_ndarrays
from fedkernels.model_layout import INT_POLICIES
from fedkernels.privacy.mechanism import update_norms
from fedkernels.rules.aaggff import AAggFFDDecision, AAggFFSDecision
from fedkernels.rules.fairness_weights import qffl_weights, term_weights, vred_weights
from fedkernels.rules.participation_weights import IntervalWeightEstimator
from fedkernels.rules.server_optimizers import ServerOptimizer, ServerSGD

__all__ = [
    "AAggFF",
    "FedAU",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedProx",
    "FedYogi",
    "FusedStrategy",
    "QFFL",
    "QFedAvg",
    "SemiVRed",
    "TERM",
    "VRed",
    "aggregate_arrayrecords",
    "array_to_tensor",
    "arrayrecord_to_state_dict",
    "fused_weighted_mean",
    "ndarray_to_array",
    "state_dict_to_arrayrecord",
]

StateDict = dict[str, Tensor]
_NUMPY_STYPE = "numpy.ndarray"


# ---------------------------------------------------------------- conversions


def array_to_tensor(array: Array, *, copy: bool = False) -> Tensor:
    """A Flower ``Array`` as a CPU tensor. Without ``copy`` the tensor is a read-only view of
    the ``Array``'s serialized bytes (the ``.npy`` header is parsed and skipped), where
    ``Array.numpy()`` would copy them; it falls back to ``Array.numpy()`` for other
    serializations. Do not write into a view: it aliases the message's bytes."""
    if array.stype != _NUMPY_STYPE:
        return ndarrays_to_tensors([array.numpy()], copy=copy)[0]
    a = _array_view(array)
    if copy:
        a = a.copy()
    return ndarrays_to_tensors([a])[0]


_NPY_MAGIC = b"\x93NUMPY"


def _array_view(array: Array) -> np.ndarray:
    """A read-only ndarray over a NumPy-serialized ``Array``'s bytes (no copy)."""
    data = array.data
    fast = _array_view_from_metadata(array, data)
    if fast is not None:
        return fast
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    if dtype.hasobject:
        raise TypeError("array_to_tensor: object arrays are not supported")
    count = math.prod(shape)
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def _array_view_from_metadata(array: Array, data: bytes) -> np.ndarray | None:
    """The view from the dtype and shape the ``Array`` carries, once the ``.npy`` header has
    been checked to say the same (C order, that descr, that shape): no header parsing
    (``np.lib.format`` evaluates it as a Python literal, ~0.1 ms an array). None where
    anything differs; the caller then parses the header."""
    if data[:6] != _NPY_MAGIC or len(data) < 12 or data[6] not in (1, 2, 3):
        return None
    start = 10 if data[6] == 1 else 12
    end = start + int.from_bytes(data[8:start], "little")
    try:
        expected = _expected_header(array.dtype, array.shape)
    except (TypeError, ValueError):
        return None
    if expected is None:
        return None
    dtype, shape, count, (order, descr, dims) = expected
    if data.find(order, start, end) < 0 or data.find(descr, start, end) < 0 \
            or data.find(dims, start, end) < 0 or end + count * dtype.itemsize > len(data):
        return None
    return np.frombuffer(data, dtype=dtype, count=count, offset=end).reshape(shape)


@functools.lru_cache(maxsize=4096)
def _expected_header(dtype_name: str, shape: tuple[int, ...]):
    """What the ``.npy`` header of a C-ordered array of this dtype and shape says (cached:
    a model has few distinct layer shapes, its replies many arrays)."""
    dtype = np.dtype(dtype_name)
    shape = tuple(int(s) for s in shape)
    if dtype.hasobject:
        return None
    markers = (b"'fortran_order': False", f"'descr': {dtype.str!r}".encode(),
               f"'shape': {shape!r}".encode())
    return dtype, shape, math.prod(shape), markers


def ndarray_to_array(a: np.ndarray) -> Array:
    """``flwr.app.Array(a)``, the same object (``np.save``'s bytes, dtype, shape), built with
    one copy of the data where ``Array`` makes two (``np.save`` into a buffer, then
    ``getvalue``)."""
    a = np.asarray(a)
    if a.dtype.hasobject or not a.flags.c_contiguous:
        return Array(a)
    header = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(a))
    except ValueError:  # a header too long for format 1.0: let NumPy choose
        return Array(a)
    data = b"".join((header.getvalue(), memoryview(a.reshape(-1).view(np.uint8))))
    return Array(dtype=str(a.dtype), shape=tuple(int(s) for s in a.shape),
                 stype=_NUMPY_STYPE, data=data)


def arrayrecord_to_state_dict(record: ArrayRecord, *, copy: bool = False) -> StateDict:
    """An ``ArrayRecord`` as a state_dict of CPU tensors (views of its bytes unless ``copy``;
    :func:`array_to_tensor`). Equal to ``record.to_torch_state_dict()`` without its copies."""
    return {k: array_to_tensor(v, copy=copy) for k, v in record.items()}


def state_dict_to_arrayrecord(state: Mapping[str, Tensor]) -> ArrayRecord:
    """A state_dict as an ``ArrayRecord`` (one serialization per tensor, which Flower's wire
    format needs; bfloat16 becomes float32, which NumPy lacks)."""
    arrays = tensors_to_ndarrays(state)
    return ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(state.keys(), arrays)})


# ---------------------------------------------------------------- Flower drop-ins
#
# Each class below subclasses Flower's Message-API strategy of the same name and replaces only
# the O(K·P) part of aggregate_train, the weighted sum over the K replies, by the fused op.
# Everything else is Flower's: constructor, attributes (current_arrays, m_t, v_t,
# momentum_vector, server_opt, ...), configure_train/evaluate, start(), exceptions, and the
# O(P) server-optimizer formulas, which run as Flower writes them (NumPy on the averaged
# arrays) so that output dtypes and odd cases (0-d arrays, mixed dtypes, broadcasting) match.
# Hyperparameters are read from the instance at every aggregation, as Flower does.

_FUSED_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
INT_POLICIES_FLOWER = ("mean",) + tuple(INT_POLICIES)


def _check_int_policy(owner: str, int_policy: object) -> str:
    if not isinstance(int_policy, str) or int_policy not in INT_POLICIES_FLOWER:
        raise ValueError(f"{owner}: int_policy must be one of {INT_POLICIES_FLOWER}, "
                         f"not {int_policy!r}")
    return int_policy


def _ndarray_view(value: Any) -> np.ndarray:
    """A Flower ``Array`` (or an ndarray, as in FedOpt's ``current_arrays``) as an ndarray:
    a read-only view of the Array's bytes where possible, never a copy of an ndarray."""
    if isinstance(value, Array):
        if value.stype != _NUMPY_STYPE:
            return value.numpy()  # raises Flower's own TypeError for other serializations
        return _array_view(value)
    return np.asarray(value)


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


def _int_policy_entry(name: str, arrays: Sequence[np.ndarray], base: np.ndarray | None,
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


def _weights_from_records(contents: Sequence[Any], key: str) -> list[float]:
    """Flower's normalized weights: :math:`n_k / \\sum_j n_j`, in Python arithmetic (so all
    zero weights raise ``ZeroDivisionError`` as in Flower)."""
    weights = [next(iter(c.metric_records.values()))[key] for c in contents]
    total = sum(weights)
    return [w / total for w in weights]


def fused_weighted_mean(records: Sequence[ArrayRecord], factors: Sequence[float], *,
                        int_policy: str = "mean", check_finite: bool = False,
                        base: Mapping[str, np.ndarray] | None = None,
                        ) -> tuple[dict[str, np.ndarray], set[str]]:
    r""":math:`\sum_k w_k x_k` over the replies' ArrayRecords, entry by entry, with the
    dtypes of Flower's ``aggregate_arrayrecords`` (keys in the first record's order).

    Float entries of equal shape go through one fused ``weighted_sum`` over zero-copy views
    of the replies' bytes (a reply whose dtype differs from the result's is converted first).
    Integer/bool entries follow ``int_policy``: ``"mean"`` (Flower: averaged into float64),
    ``"max"``, ``"first"``, ``"skip"`` (``base``'s entry) or ``"error"``. Returns the means
    and the names of the entries an integer policy other than ``"mean"`` resolved (a server
    optimizer leaves those alone). Non-finite weights, shapes that differ between replies and
    dtypes the op lacks take Flower's NumPy arithmetic, so they give Flower's result or error.
    """
    names = list(records[0].keys())
    views = {n: [_ndarray_view(r[n]) for r in records] for n in names}
    ints = [n for n in names if all(a.dtype.kind in "biu" for a in views[n])]
    if int_policy == "error" and ints:
        raise TypeError(f"integer arrays {ints[:5]} and int_policy='error'; choose 'mean' "
                        "(Flower's), 'max', 'first' or 'skip'")
    finite_weights = all(math.isfinite(w) for w in factors)
    out: dict[str, np.ndarray] = {}
    resolved: set[str] = set()
    fused: dict[str, np.dtype] = {}
    for n in names:
        arrays = views[n]
        if n in ints and int_policy != "mean":
            out[n] = _int_policy_entry(n, arrays, None if base is None else base.get(n),
                                       int_policy)
            resolved.add(n)
            continue
        dtype = _mean_dtype(arrays, factors)
        same_shape = all(a.shape == arrays[0].shape for a in arrays)
        kinds_ok = all(a.dtype.kind in "biuf" and (a.dtype.kind != "f" or a.dtype in
                                                   _FUSED_FLOAT_DTYPES) for a in arrays)
        if finite_weights and same_shape and kinds_ok and dtype in _FUSED_FLOAT_DTYPES:
            fused[n] = dtype
        else:
            out[n] = _flower_mean_entry(arrays, factors)
    if fused:
        clients = [
            dict(zip(fused, _as_tensors([views[n][k] for n in fused], fused.values())))
            for k in range(len(records))
        ]
        weights = torch.tensor([float(w) for w in factors], dtype=torch.float64, device="cpu")
        result = aggregate(clients, weights, check_finite=check_finite)
        for n in fused:
            out[n] = result[n].numpy()
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
    policy = _check_int_policy("aggregate_arrayrecords", int_policy)
    factors = _weights_from_records(records, weighting_metric_name)
    if records and all(len(r.array_records) == 1 for r in records):
        arrays = [next(iter(r.array_records.values())) for r in records]
        names = set(arrays[0].keys())
        if all(set(a.keys()) == names for a in arrays[1:]):
            means, _ = fused_weighted_mean(arrays, factors, int_policy=policy,
                                           check_finite=check_finite)
            return _to_arrayrecord(means, consume=True)
    return _to_arrayrecord(_flower_aggregate_arrayrecords(records, factors, policy,
                                                          check_finite), consume=True)


def _flower_aggregate_arrayrecords(records: Sequence[RecordDict], factors: Sequence[float],
                                   int_policy: str, check_finite: bool) -> dict[str, np.ndarray]:
    """Flower's ``aggregate_arrayrecords`` loop (each array times its record's factor, added
    in place into the first product of its key), on views of the replies' bytes."""
    out: dict[str, np.ndarray] = {}
    for k, (record, factor) in enumerate(zip(records, factors)):
        for array_record in record.array_records.values():
            for name, value in array_record.items():
                a = _ndarray_view(value)
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


def _to_tensor(a: np.ndarray, dtype: np.dtype) -> Tensor:
    return _as_tensors([a], [dtype])[0]


def _as_tensors(arrays: Sequence[np.ndarray], dtypes: Iterable[np.dtype]) -> list[Tensor]:
    """The arrays as tensors in ``dtypes`` (converted where they differ), sharing memory with
    them otherwise. Views of a message's bytes are read-only; the fused op only reads them,
    so torch's warning about that is silenced, once for all the arrays."""
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for a, dtype in zip(arrays, dtypes):
            if a.dtype != dtype:
                a = a.astype(dtype)
            if a.dtype.isnative and all(s >= 0 for s in a.strides):
                out.append(torch.from_numpy(a))
            else:
                out.append(ndarrays_to_tensors([a])[0])
    return out


def _to_arrayrecord(arrays: dict[str, np.ndarray], *, consume: bool = False) -> ArrayRecord:
    """An ArrayRecord of ``arrays``. ``consume`` drops each array from the dict once it is
    serialized, so the peak holds one model plus one array, not two models."""
    if not consume:
        return ArrayRecord({k: ndarray_to_array(v) for k, v in arrays.items()})
    return ArrayRecord({k: ndarray_to_array(arrays.pop(k)) for k in list(arrays)})


class _FusedAggregation:
    """What the drop-ins share: the fedkernels arguments and the fused mean of the replies."""

    int_policy: str = "mean"
    check_finite: bool = False

    def _fused_mean(self, replies: Iterable[Message], base: Mapping[str, np.ndarray] | None
                    = None) -> tuple[list[Any] | None, dict[str, np.ndarray] | None, set[str]]:
        """Flower's reply checks and weights, then :func:`fused_weighted_mean`. Returns the
        valid replies' contents (None if there are none), the means and the resolved
        integer entries."""
        policy = _check_int_policy(type(self).__name__, self.int_policy)
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None, set()
        contents = [m.content for m in valid]
        factors = _weights_from_records(contents, self.weighted_by_key)
        records = [next(iter(c.array_records.values())) for c in contents]
        means, resolved = fused_weighted_mean(records, factors, int_policy=policy,
                                              check_finite=bool(self.check_finite), base=base)
        return contents, means, resolved


def _drop_in(flower_cls: type) -> Callable[[type], type]:
    """Gives a drop-in class Flower's constructor (same arguments, positional ones included)
    plus the keyword-only ``int_policy`` and ``check_finite``, with a matching signature."""

    def decorate(cls: type) -> type:
        def __init__(self, *args: Any, int_policy: str = "mean", check_finite: bool = False,
                     **kwargs: Any) -> None:
            _check_int_policy(cls.__name__, int_policy)
            if not isinstance(check_finite, bool):
                raise TypeError(f"{cls.__name__}: check_finite must be a bool, not "
                                f"{type(check_finite).__name__}")
            flower_cls.__init__(self, *args, **kwargs)
            self.int_policy = int_policy
            self.check_finite = check_finite

        signature = inspect.signature(flower_cls.__init__)
        extra = [
            inspect.Parameter("int_policy", inspect.Parameter.KEYWORD_ONLY, default="mean",
                              annotation=str),
            inspect.Parameter("check_finite", inspect.Parameter.KEYWORD_ONLY, default=False,
                              annotation=bool),
        ]
        params = list(signature.parameters.values())
        __init__.__signature__ = signature.replace(parameters=params + extra)
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__doc__ = (f"Flower's ``{flower_cls.__name__}`` arguments, plus ``int_policy`` "
                            "and ``check_finite`` (see the class docstring).")
        cls.__init__ = __init__
        return cls

    return decorate


class _FusedFedAvgTrain(_FusedAggregation):
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's ``FedAvg.aggregate_train`` with the fused weighted mean."""
        contents, means, _ = self._fused_mean(replies)
        if contents is None:
            return None, None
        arrays = _to_arrayrecord(means, consume=True)
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return arrays, metrics


_DROP_IN_DOC = """

    Differences from Flower's class, all opt-in: ``int_policy`` (keyword-only) decides what
    integer/bool arrays become: ``"mean"`` (the default, Flower's: averaged into float64),
    ``"max"`` over replies (right for BatchNorm's ``num_batches_tracked``), ``"first"``,
    ``"skip"`` (keep the global model's, where the strategy holds one) or ``"error"``
    (``TypeError`` before any state changes); ``check_finite=True`` rejects replies that
    carry NaN/Inf with a ``ValueError`` naming them."""


@_drop_in(_flwr.FedAvg)
class FedAvg(_FusedFedAvgTrain, _flwr.FedAvg):
    __doc__ = (r"""Flower's ``FedAvg`` (a subclass of it) whose ``aggregate_train`` computes
    :math:`x_{t+1} = \sum_k n_k x_k / \sum_j n_j` in one fused pass over zero-copy views of the
    replies' arrays (fp32 accumulation for float16).""" + _DROP_IN_DOC)


@_drop_in(_flwr.FedProx)
class FedProx(_FusedFedAvgTrain, _flwr.FedProx):
    __doc__ = ("""Flower's ``FedProx`` (``proximal_mu`` goes to the clients in the train
    config); the server side is :class:`FedAvg`'s fused mean.""" + _DROP_IN_DOC)


@_drop_in(_flwr.FedAvgM)
class FedAvgM(_FusedAggregation, _flwr.FedAvgM):
    __doc__ = (r"""Flower's ``FedAvgM``: the fused mean :math:`\bar x`, then, when
    ``server_opt`` is on (set by the constructor from ``server_learning_rate`` and
    ``server_momentum``, as in Flower), :math:`g = x_t - \bar x`,
    :math:`m \leftarrow \mu m + g` (``momentum_vector``, when :math:`\mu > 0`),
    :math:`x_{t+1} = x_t - \eta m`; ``current_arrays`` becomes the result.""" + _DROP_IN_DOC)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        current = None
        if self.server_opt and self.current_arrays is not None:
            current = [_ndarray_view(v) for v in self.current_arrays.values()]
        base = None if current is None else dict(zip(self.current_arrays.keys(), current))
        contents, means, resolved = self._fused_mean(replies, base=base)
        if contents is None:
            return None, None
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        if not self.server_opt:
            return _to_arrayrecord(means, consume=True), metrics
        if current is None:
            raise AggregationError(  # Flower's words: the exit reason a ServerApp reports
                "No initial parameters set for FedAvgM. "
                "Ensure that `configure_train` has been called before aggregation.")
        # Flower pairs the averaged arrays with the global ones, then the momentum with the
        # pseudo-gradient, by position, zip(strict=True): a count that differs is zip's
        # ValueError (checked here before anything moves).
        names = list(means)
        previous = self.momentum_vector
        use_momentum = self.server_momentum > 0.0
        pairs = [(len(names), len(current))]
        if use_momentum and previous is not None:
            pairs.append((len(previous), len(names)))
        for first, second in pairs:
            if first != second:
                raise ValueError("zip() argument 2 is "
                                 f"{'shorter' if second < first else 'longer'} than argument 1")
        momentum, arrays = [], {}
        for i, (name, old) in enumerate(zip(names, current)):
            new = means.pop(name)  # array by array: one model of temporaries at most
            g = np.zeros(new.shape) if name in resolved else old - new
            if use_momentum:
                g = g if previous is None else self.server_momentum * previous[i] + g
                momentum.append(g)
            arrays[name] = ndarray_to_array(
                new if name in resolved else old - self.server_learning_rate * g)
        record = ArrayRecord(arrays)
        # State changes only now, with every check passed and every value computed.
        if use_momentum:
            self.momentum_vector = momentum
        self.current_arrays = record
        return record, metrics


class _FusedFedOpt(_FusedAggregation):
    r"""FedOpt's ``aggregate_train`` (Reddi et al. 2021) on the fused mean :math:`\bar x`:
    :math:`\Delta = \bar x - x_t`, :math:`m \leftarrow \beta_1 m + (1-\beta_1)\Delta`,
    :math:`v` by the subclass's rule, :math:`x_{t+1} = x_t + \eta_t m / (\sqrt v + \tau)`."""

    def _second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _step_size(self, server_round: int) -> float:
        return self.eta

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        current = self.current_arrays
        if current is not None:
            current = {k: _ndarray_view(v) for k, v in current.items()}
        contents, means, resolved = self._fused_mean(replies, base=current)
        if contents is None:
            return None, None
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        if current is None:
            raise AggregationError(reason="Current arrays not set. Ensure that "
                                   "`configure_train` has been called before aggregation.")
        if set(means) != set(current):
            raise AggregationError(reason="Keys of the aggregated arrays do not match those "
                                   "of the arrays stored at the strategy. `delta_t = "
                                   "aggregated_arrays - current_arrays` cannot be computed.")
        for name, x in means.items():
            if x.shape != current[name].shape:
                raise AggregationError(reason=f"Shape of aggregated array '{name}' does not "
                                       "match shape of the array under the same key stored in "
                                       "the strategy. Cannot compute `delta_t`.")
        m_prev = self.m_t or {k: np.zeros_like(x) for k, x in means.items()}
        v_prev = self.v_t or {k: np.zeros_like(x) for k, x in means.items()}
        # Flower indexes one dict by the other's keys: Δ by m's, then by v's, then m and v by
        # the global model's. The key its KeyError names is the first one missing there.
        for moments in (m_prev, v_prev):
            for k in moments:
                if k not in means:
                    raise KeyError(k)
        for k in current:
            for moments in (m_prev, v_prev):
                if k not in moments:
                    raise KeyError(k)
        step = self._step_size(server_round)
        m_new, v_new, arrays = {}, {}, {}
        for k, x in current.items():  # array by array: one model of temporaries at most
            mean = means.pop(k)
            if k in resolved:
                m_new[k], v_new[k], out = m_prev[k], v_prev[k], mean
            else:
                delta = mean - x
                m_new[k] = self.beta_1 * m_prev[k] + (1 - self.beta_1) * delta
                v_new[k] = self._second_moment(v_prev[k], delta)
                out = x + step * m_new[k] / (np.sqrt(v_new[k]) + self.tau)
            arrays[k] = ndarray_to_array(out)
        record = ArrayRecord(arrays)
        # Only now, with everything computed, the state changes (in Flower's key order).
        self.m_t = {k: m_new[k] for k in m_prev}
        self.v_t = {k: v_new[k] for k in v_prev}
        return record, metrics


@_drop_in(_flwr.FedAdam)
class FedAdam(_FusedFedOpt, _flwr.FedAdam):
    __doc__ = (r"""Flower's ``FedAdam``: :math:`v \leftarrow \beta_2 v + (1-\beta_2)\Delta^2`
    and the bias-corrected step
    :math:`\eta_t = \eta\sqrt{1-\beta_2^{t+1}}/(1-\beta_1^{t+1})` (a NumPy float64, so
    float32 models come back as float64, as from Flower).""" + _DROP_IN_DOC)

    def _second_moment(self, v, delta):
        return self.beta_2 * v + (1 - self.beta_2) * (delta ** 2)

    def _step_size(self, server_round):
        return (self.eta * np.sqrt(1 - np.power(self.beta_2, server_round + 1.0))
                / (1 - np.power(self.beta_1, server_round + 1.0)))


@_drop_in(_flwr.FedYogi)
class FedYogi(_FusedFedOpt, _flwr.FedYogi):
    __doc__ = (r"""Flower's ``FedYogi``:
    :math:`v \leftarrow v - (1-\beta_2)\Delta^2\,\mathrm{sign}(v - \Delta^2)`.""" + _DROP_IN_DOC)

    def _second_moment(self, v, delta):
        sq = delta ** 2
        return v - (1.0 - self.beta_2) * sq * np.sign(v - sq)


@_drop_in(_flwr.FedAdagrad)
class FedAdagrad(_FusedFedOpt, _flwr.FedAdagrad):
    __doc__ = (r"""Flower's ``FedAdagrad``: :math:`v \leftarrow v + \Delta^2`
    (:math:`\beta_1 = 0`, so :math:`m = \Delta`).""" + _DROP_IN_DOC)

    def _second_moment(self, v, delta):
        return v + delta ** 2


@_drop_in(_flwr.QFedAvg)
class QFedAvg(_FusedAggregation, _flwr.QFedAvg):
    __doc__ = (r"""Flower's ``QFedAvg`` (Li et al., ICLR 2020) with :math:`L = 1/`
    ``client_learning_rate``, :math:`f_k` the reply's ``train_loss_key`` metric,
    :math:`h_k = q (f_k+\epsilon)^{q-1} L^2\|x_t - x_k\|^2 + L (f_k+\epsilon)^q` and
    :math:`x_{t+1} = x_t + \sum_k c_k (x_k - x_t)`, :math:`c_k = L (f_k+\epsilon)^q / \sum_j
    h_j`: the squared norms of all replies from one fused read pass
    (:func:`fedkernels.privacy.update_norms`), then one fused delta-mode pass. As in
    Flower, the result is float64, ``current_arrays`` and the replies' ArrayRecords are
    emptied by the aggregation (Flower reads them with ``keep_input=False``), and arrays pair
    with the global ones by position. Replies Flower's arithmetic would treat differently
    (integer arrays with ``int_policy="mean"``, shapes or counts that differ from the global
    model's, float16 replies, non-finite coefficients) go through Flower's own code.""" +
               _DROP_IN_DOC)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        policy = _check_int_policy(type(self).__name__, self.int_policy)
        valid, failed = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        lipschitz = 1.0 / self.client_learning_rate
        if self.current_arrays is None:
            raise AggregationError(  # Flower's words (its missing space included)
                "Current global model weights are not available. Make sure to call"
                "`configure_train` before calling `aggregate_train`.")
        names = list(self.current_arrays.keys())
        global_arrays = [_ndarray_view(v) for v in self.current_arrays.values()]
        records = [next(iter(m.content.array_records.values())) for m in valid]
        local = [[_ndarray_view(v) for v in r.values()] for r in records]
        losses = [_flwr_train_loss(m, self.train_loss_key) for m in valid]
        # Flower empties each ArrayRecord as it reads it: one shared by two replies (or by a
        # reply and current_arrays) reads as empty the second time, its ValueError.
        shared = len({id(r) for r in [self.current_arrays, *records]}) < len(records) + 1
        if shared or self._needs_flower_path(global_arrays, local, policy):
            return self._flower_aggregate_train(server_round, valid, failed)
        ints = [t for t in range(len(names)) if all(x[t].dtype.kind in "biu" for x in local)]
        if policy == "error" and ints:
            raise TypeError(f"QFedAvg: integer arrays {[names[t] for t in ints][:5]} and "
                            "int_policy='error'")
        floats = [t for t in range(len(names)) if t not in ints]
        dtypes = {t: np.result_type(*(x[t].dtype for x in local)) for t in floats}
        base = {names[t]: _to_tensor(global_arrays[t], dtypes[t]) for t in floats}
        clients = [{names[t]: _to_tensor(x[t], dtypes[t]) for t in floats} for x in local]
        q = self.q
        eps = 1e-10
        # ||x_k - x_t||^2 of every reply from one fused read pass (differences in float64).
        sq_norms = (update_norms(clients, base) ** 2).tolist() if base else [0.0] * len(clients)
        loss_pow_q = [np.float_power(f + eps, q) for f in losses]
        sum_h = 0.0
        for f, lpq, sq in zip(losses, loss_pow_q, sq_norms):
            sum_h += q * np.float_power(f + eps, q - 1) * (lipschitz ** 2 * sq) \
                + lipschitz * lpq
        coefficients = [lipschitz * lpq / sum_h for lpq in loss_pow_q]
        if not all(np.isfinite(c) for c in coefficients):
            return self._flower_aggregate_train(server_round, valid, failed)
        result: dict[str, Tensor] = {}
        if floats:
            weights = torch.tensor([float(c) for c in coefficients], dtype=torch.float64,
                                   device="cpu")
            result = aggregate(clients, weights, base=base, check_finite=bool(self.check_finite))
        arrays = {}
        for t, name in enumerate(names):  # array by array: the float64 copies one at a time
            if t in ints:
                out = _int_policy_entry(name, [x[t] for x in local], global_arrays[t], policy)
            else:
                dtype = np.result_type(global_arrays[t].dtype, dtypes[t], np.float64)
                out = result.pop(name).numpy().astype(dtype, copy=False)
            arrays[name] = ndarray_to_array(out)
        record = ArrayRecord(arrays)
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        # Flower's side effects: it reads the global and the local arrays with keep_input=False.
        for r in [self.current_arrays, *records]:
            for k in list(r.keys()):
                r.pop(k)
        return record, metrics

    def _check_and_log_replies(self, replies: Iterable[Message], is_train: bool,
                               validate: bool = True) -> tuple[list[Message], list[Message]]:
        # Where aggregate_train hands over to Flower's, the replies were checked and logged
        # already: Flower's code gets that outcome instead of logging them a second time.
        checked = self.__dict__.pop("_checked_replies", None)
        if checked is not None:
            return checked
        return super()._check_and_log_replies(replies, is_train, validate)

    def _flower_aggregate_train(self, server_round: int, valid: list[Message],
                                failed: list[Message]
                                ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._checked_replies = (valid, failed)
        try:
            return super().aggregate_train(server_round, valid)
        finally:
            self.__dict__.pop("_checked_replies", None)

    @staticmethod
    def _needs_flower_path(global_arrays: list[np.ndarray], local: list[list[np.ndarray]],
                           policy: str) -> bool:
        for x in local:
            if len(x) != len(global_arrays):
                return True
            for g, a in zip(global_arrays, x):
                if a.shape != g.shape:
                    return True
        columns = [[x[t] for x in local] for t in range(len(global_arrays))]
        kept_ints = policy != "mean" and any(all(a.dtype.kind in "biu" for a in column)
                                             for column in columns)
        for g, column in zip(global_arrays, columns):
            all_int = all(a.dtype.kind in "biu" for a in column)
            if all_int and policy != "mean":
                continue
            if any(a.dtype not in _FUSED_FLOAT_DTYPES for a in column):
                return True
            # Flower computes a float16 reply's gradient, its squared norm (a float16 sum,
            # Inf past 65504, which makes every coefficient 0) and the weighted sum in
            # float16, and adds the result to the global model in float64; ours would round
            # the model to float16 and never overflow. (Integer arrays kept by int_policy,
            # which Flower's code cannot take, keep the fused path.)
            if not kept_ints and any(a.dtype == np.float16 for a in column):
                return True
            if g.dtype.kind not in "biuf" or (g.dtype.kind == "f" and g.dtype not in
                                              _FUSED_FLOAT_DTYPES):
                return True
        return False


# ---------------------------------------------------------------- fedkernels' own strategies


def _int_entry(values: list[Tensor], base: Tensor | None, policy: str) -> Tensor:
    if policy == "first" or (policy == "skip" and base is None):
        return values[0].clone()
    if policy == "skip":
        return base.clone()
    return torch.stack(values).amax(dim=0)


def _int_node_ids(owner: str, node_ids: Sequence[Any]) -> list[int]:
    """Flower node ids as ints, for the strategies that keep per-node state."""
    out = []
    for k, node in enumerate(node_ids):
        if isinstance(node, bool) or not isinstance(node, (int, np.integer)):
            raise TypeError(f"{owner}: reply {k} has metadata.src_node_id {node!r}; this "
                            "strategy keeps per-node state and needs integer node ids")
        out.append(int(node))
    return out


def _check_finite(states: list[StateDict]) -> None:
    for k, s in enumerate(states):
        bad = [n for n, t in s.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise ValueError(f"reply {k} carries NaN/Inf in arrays {bad[:5]}")


class FusedStrategy(_FlowerFedAvg):
    r"""Base class: Flower's ``FedAvg`` with a fedkernels ``aggregate_train``.

    A subclass defines :meth:`client_weights` (:math:`w_k` of
    :math:`\Delta_t = \sum_k w_k (x_k - x_t)`); the result goes through ``server_optimizer``
    (default: :math:`x_{t+1} = x_t + \eta\Delta_t` with ``server_learning_rate`` η).

    Args (beyond Flower ``FedAvg``'s, all keyword):
        server_optimizer: a :class:`fedkernels.rules.server_optimizers.ServerOptimizer` (``ServerSGD``,
            ``FedAvgM``, ``FedAdam``, ``FedYogi``, ``FedAdagrad``); it overrides
            ``server_learning_rate``.
        server_learning_rate: η of the plain server step.
        int_policy: integer/bool arrays: ``"max"`` over clients (default), ``"first"``,
            ``"skip"`` (keep the global one) or ``"error"``.
        check_finite: reject replies that carry NaN/Inf (one extra read of the updates).
    """

    def __init__(self, *, server_optimizer: ServerOptimizer | None = None,
                 server_learning_rate: float = 1.0, int_policy: str = "max",
                 check_finite: bool = False, **flower_kwargs: Any) -> None:
        super().__init__(**flower_kwargs)
        if int_policy not in INT_POLICIES:
            raise ValueError(f"int_policy must be one of 'max', 'first', 'skip', 'error', "
                             f"not {int_policy!r}")
        self.server_optimizer = server_optimizer or ServerSGD(server_learning_rate)
        self.int_policy = int_policy
        self.check_finite = check_finite
        self.global_state: StateDict | None = None  # x_t, writable, owned by the strategy
        self._sent: ArrayRecord | None = None
        self.last_weights: Tensor | None = None
        self.last_node_ids: list[int] = []

    # -- Flower hooks

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        # The record start() hands back is the one aggregate_train returned: x_t is then
        # already held as tensors, and only a foreign record (round 1, or a caller's) is read.
        if self.global_state is None or arrays is not self._sent:
            self.global_state = arrayrecord_to_state_dict(arrays, copy=True)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        with torch.device("cpu"):  # the strategy's state lives on the CPU (see aggregate_train)
            self.on_configure(server_round, [m.metadata.dst_node_id for m in messages], grid)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(list(replies), is_train=True)
        if not valid:
            return None, None
        contents = [m.content for m in valid]
        states = [arrayrecord_to_state_dict(next(iter(c.array_records.values())))
                  for c in contents]
        metrics = [next(iter(c.metric_records.values())) for c in contents]
        node_ids = [m.metadata.src_node_id for m in valid]  # ints where a strategy needs them
        # The replies and x_t are CPU tensors, and so is every tensor the strategy makes here:
        # under torch.set_default_device("cuda") the weights would otherwise land on the GPU,
        # which the fused op refuses for CPU models.
        with torch.device("cpu"):
            new_state = self.combine(server_round, states, metrics, node_ids)
        record = state_dict_to_arrayrecord(new_state)
        self._sent = record
        aggregated_metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return record, aggregated_metrics

    # -- the fedkernels part

    def on_configure(self, server_round: int, node_ids: list[int], grid: Grid) -> None:
        """Called with the nodes sampled for training (strategies with per-node state)."""

    def client_weights(self, server_round: int, states: list[StateDict],
                       metrics: list[MetricRecord], node_ids: list[int]) -> Tensor:
        """:math:`w_k` for the replies, float64 ``[K]``."""
        raise NotImplementedError

    def num_examples(self, metrics: list[MetricRecord]) -> Tensor:
        """:math:`n_k` (the ``weighted_by_key`` metric), float64 ``[K]``."""
        return torch.tensor([float(m[self.weighted_by_key]) for m in metrics],
                            dtype=torch.float64, device="cpu")

    def losses(self, metrics: list[MetricRecord], key: str) -> Tensor:
        """:math:`f_k`, the float metric ``key`` of every reply, float64 ``[K]``."""
        out = []
        for m in metrics:
            value = m.get(key)
            if value is None or isinstance(value, list):
                raise ValueError(f"{type(self).__name__}: every reply's MetricRecord needs a "
                                 f"float '{key}' (the client's loss)")
            out.append(float(value))
        return torch.tensor(out, dtype=torch.float64, device="cpu")

    def combine(self, server_round: int, states: list[StateDict],
                metrics: list[MetricRecord], node_ids: list[int]) -> StateDict:
        """The next global model from the round's client models."""
        weights = self.client_weights(server_round, states, metrics, node_ids)
        self.last_weights, self.last_node_ids = weights, node_ids
        return self.apply_weights(server_round, states, weights)

    def apply_weights(self, server_round: int, states: list[StateDict], weights: Tensor
                      ) -> StateDict:
        r""":math:`x_{t+1}` from :math:`\Delta_t = \sum_k w_k (x_k - x_t)` through the server
        optimizer (in place on :attr:`global_state`); integer entries follow ``int_policy``."""
        x = self.global_state
        if x is None:
            raise AggregationError(f"{type(self).__name__}: aggregate_train before "
                                   "configure_train (the global model x_t is unknown)")
        names = list(x)
        floats = [n for n in names if x[n].is_floating_point()]
        self._check(states, names)
        ints = [n for n in names if n not in floats]
        if ints and self.int_policy == "error":  # before anything moves
            raise TypeError(f"{type(self).__name__}: integer arrays {ints[:5]} and "
                            "int_policy='error'")
        # A reply in another float dtype than the global model (float32 replies to a float64
        # model) is converted to the model's dtype, as Flower's NumPy arithmetic promotes.
        clients = [{n: s[n] if s[n].dtype == x[n].dtype else s[n].to(x[n].dtype)
                    for n in floats} for s in states]
        params = {n: x[n] for n in floats}
        if self.check_finite:
            _check_finite(clients)
        if isinstance(self.server_optimizer, ServerSGD):
            aggregate(clients, weights, base=params, scale=self.server_optimizer.lr, out=params)
        else:
            self.server_optimizer.apply(params, clients, weights, server_round)
        for n in names:
            if n not in params:
                x[n] = _int_entry([s[n] for s in states], x[n], self.int_policy)
        return x

    def _check(self, states: list[StateDict], names: list[str]) -> None:
        for k, s in enumerate(states):
            if set(s) != set(names):
                raise ValueError(f"{type(self).__name__}: reply {k} has arrays "
                                 f"{sorted(set(s) ^ set(names))[:5]} that differ from the "
                                 "global model's")


class QFFL(FusedStrategy):
    r"""q-FFL as mixing weights: :math:`w_k = n_k f_k^q / \sum_j n_j f_j^q`."""

    def __init__(self, *, q: float = 0.1, loss_key: str = "train_loss", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.q, self.loss_key = q, loss_key

    def client_weights(self, server_round, states, metrics, node_ids) -> Tensor:
        return qffl_weights(self.num_examples(metrics), self.losses(metrics, self.loss_key),
                            self.q)


class TERM(FusedStrategy):
    r"""Client-level tilted ERM: :math:`w = \mathrm{softmax}(\tau f + \log p)`
    (``use_sizes=False`` drops :math:`\log p`)."""

    def __init__(self, *, tilt: float = 0.1, use_sizes: bool = True,
                 loss_key: str = "train_loss", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tilt, self.use_sizes, self.loss_key = tilt, use_sizes, loss_key

    def client_weights(self, server_round, states, metrics, node_ids) -> Tensor:
        return term_weights(self.num_examples(metrics), self.losses(metrics, self.loss_key),
                            self.tilt, self.use_sizes)


class VRed(FusedStrategy):
    r"""Variance reduction: :math:`w_k = p_k (1 + 2\beta (a_k - A))`,
    :math:`a_k = f_k - \bar f` (weights may be negative unless ``clamp_negative``)."""

    semi = False

    def __init__(self, *, beta: float = 0.1, clamp_negative: bool = False,
                 loss_key: str = "train_loss", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.beta, self.clamp_negative, self.loss_key = beta, clamp_negative, loss_key

    def client_weights(self, server_round, states, metrics, node_ids) -> Tensor:
        return vred_weights(self.num_examples(metrics), self.losses(metrics, self.loss_key),
                            self.beta, self.semi, self.clamp_negative)


class SemiVRed(VRed):
    r"""Semi-variance reduction: :math:`a_k = (f_k - \bar f)_+`."""

    semi = True


class _NodeIndex:
    """Dense indices 0..N-1 for Flower node ids, in order of first sight."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}

    def add(self, node_ids: Iterable[int]) -> None:
        for node in sorted(node_ids):
            self.index.setdefault(int(node), len(self.index))

    def __call__(self, node_ids: Iterable[int]) -> Tensor:
        return torch.tensor([self.index[int(n)] for n in node_ids], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.index)


class FedAU(FusedStrategy):
    r"""FedAU (Wang & Ji, ICLR 2024): :math:`w_n = \omega_n / N` with :math:`\omega_n` the
    running mean of node n's observed participation intervals, cut off at ``cutoff``
    (:class:`~fedkernels.rules.participation_weights.IntervalWeightEstimator`). N is the number
    of nodes connected so far (``num_clients`` fixes it); a node that replied in a round
    participated in it. Sample nodes (``fraction_train`` < 1) or let them drop out: with full
    participation every :math:`\omega_n = 1` and FedAU is the plain mean."""

    def __init__(self, *, cutoff: int = 50, num_clients: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cutoff = cutoff
        self.num_clients = num_clients
        self.nodes = _NodeIndex()
        with torch.device("cpu"):  # the strategy's state lives on the CPU (see aggregate_train)
            self.estimator = IntervalWeightEstimator(0, cutoff or None)

    def on_configure(self, server_round, node_ids, grid) -> None:
        self.nodes.add(grid.get_node_ids())
        self._grow()

    def _grow(self) -> None:
        grow = len(self.nodes) - len(self.estimator.omega)
        if grow > 0:  # new nodes: no interval observed yet
            e = self.estimator
            e.count = torch.cat([e.count, torch.zeros(grow, dtype=torch.int64)])
            e.intervals = torch.cat([e.intervals, torch.zeros(grow, dtype=torch.int64)])
            e.omega = torch.cat([e.omega, torch.ones(grow, dtype=torch.float64)])

    def client_weights(self, server_round, states, metrics, node_ids) -> Tensor:
        node_ids = _int_node_ids("FedAU", node_ids)
        self.nodes.add(node_ids)
        self._grow()
        ids = self.nodes(node_ids)
        n = self.num_clients or len(self.nodes)
        weights = self.estimator.omega[ids] / n  # uses omega before this round's intervals
        mask = torch.zeros(len(self.nodes), dtype=torch.bool)
        mask[ids] = True
        self.estimator.observe(mask)
        return weights


class AAggFF(FusedStrategy):
    r"""AAggFF (Hahn, Kim, Lee, ICML 2024): the decision :math:`p` over the N nodes is played
    online against the responses to the replies' losses (``loss_key``, the loss of the
    received global model), and :math:`w_k = p_k / \sum_{j \in S} p_j`.

    ``mode="d"`` (cross-device, default): AAggFF-D with inclusion probability
    ``sampling_fraction`` (default :math:`|S_t|/N`). ``mode="s"`` (cross-silo): AAggFF-S, the
    online Newton step, which needs a reply from every node every round. N is the number of
    nodes connected at the first round (or ``num_clients``); the decision logic is
    :class:`~fedkernels.rules.aaggff.AAggFFDDecision` / ``AAggFFSDecision``."""

    def __init__(self, *, mode: str = "d", cdf: str = "weibull", variant: str = "paper",
                 sampling_fraction: float | None = None, num_clients: int | None = None,
                 loss_key: str = "train_loss", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if mode not in ("d", "s"):
            raise ValueError(f"AAggFF: mode must be 'd' or 's', not {mode!r}")
        if mode == "d" and sampling_fraction is not None and not 0 < sampling_fraction <= 1:
            raise ValueError(f"AAggFF: sampling_fraction must be in (0, 1], not "
                             f"{sampling_fraction!r}")
        self.mode, self.loss_key, self.num_clients = mode, loss_key, num_clients
        self.cdf, self.variant, self.sampling_fraction = cdf, variant, sampling_fraction
        self.decider: AAggFFSDecision | AAggFFDDecision | None = None  # made at the first round
        self.nodes = _NodeIndex()

    def _setup(self, node_ids: Iterable[int]) -> None:
        self.nodes.add(node_ids)
        n = self.num_clients or len(self.nodes)
        decision = AAggFFSDecision if self.mode == "s" else AAggFFDDecision
        self.decider = decision(n, cdf=self.cdf, variant=self.variant)

    def on_configure(self, server_round, node_ids, grid) -> None:
        if self.decider is None:
            self._setup(grid.get_node_ids())

    def client_weights(self, server_round, states, metrics, node_ids) -> Tensor:
        node_ids = _int_node_ids("AAggFF", node_ids)
        if self.decider is None:
            self._setup(node_ids)
        self.nodes.add(node_ids)
        n = self.num_clients or len(self.decider.decision)
        if len(self.nodes) > n:
            raise ValueError(f"AAggFF: {len(self.nodes)} nodes seen, but the decision was set "
                             f"up for N = {n}; pass num_clients")
        ids = self.nodes(node_ids)
        losses = self.losses(metrics, self.loss_key)
        if self.mode == "s":
            if len(ids) != n:
                raise ValueError(f"AAggFF mode='s' needs a reply from all {n} nodes every "
                                 f"round, got {len(ids)}; use mode='d'")
            order = torch.argsort(ids)
            full = torch.empty(n, dtype=torch.float64)
            full[ids[order]] = losses[order]
            self.decider.step(full)
        else:
            fraction = self.sampling_fraction
            pi = np.full(n, fraction if fraction is not None else len(ids) / n)
            self.decider.step(ids.numpy(), losses.numpy(), pi, server_round)
        p = self.decider.decision[ids]
        return p / p.sum()
