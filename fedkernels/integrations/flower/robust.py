r"""Flower's robust and differentially private Message-API strategies
(``flwr.serverapp.strategy``) with fedkernels arithmetic (``pip install 'fedkernels[flower]'``).

Each class subclasses Flower's class of the same name and replaces only the O(K·P) part of
``aggregate_train``; the constructor, attributes, ``configure_*``, ``summary``, the log lines,
the exceptions and the wrapped strategy of the DP wrappers are Flower's. Swap the import::

    from fedkernels.integrations.flower_robust import FedMedian   # was: flwr.serverapp.strategy

=====================================  ===========================================================
:class:`FedMedian`                     :func:`fedkernels.robust.coordinate_median` over views of
                                       the replies' bytes (Flower: ``np.stack`` + ``np.median``
                                       array by array)
:class:`FedTrimmedAvg`                 :func:`fedkernels.robust.trimmed_mean` (β from ``beta``)
:class:`MultiKrum`, :class:`Krum`      the K×K squared distances from
                                       :func:`fedkernels.robust.pairwise_sq_distances` (Flower
                                       stacks the flattened models into a [K, P] copy), Flower's
                                       selection rule on them, the fused weighted mean of the
                                       selected replies
:class:`Bulyan`                        the same selection (θ = K − 2f replies), then the
                                       mean of the β = θ − 2f values nearest to the
                                       coordinate-wise median, in one fused pass
                                       (:func:`fedkernels.robust.nearest_to_median_mean`)
:class:`DifferentialPrivacyServer\     :math:`x_t + \sum_k \bar w_k \min(1, C/\|x_k - x_t\|)
SideFixedClipping`                     (x_k - x_t) + \mathcal N(0, (\sigma C/m)^2)` in
                                       :func:`fedkernels.privacy.private_aggregate` when the
                                       wrapped strategy averages as ``FedAvg`` does; otherwise
                                       the replies are clipped with fedkernels and handed to
                                       the wrapped strategy, as Flower does
:class:`DifferentialPrivacyServer\     the same, with the clip norm moved by
SideAdaptiveClipping`                  :func:`fedkernels.privacy.adaptive_clip_norm`
=====================================  ===========================================================

Values equal Flower's to rounding in the arrays' precision, with Flower's dtypes (integer
arrays become float64 where Flower's NumPy arithmetic makes them so). What differs:

- Arrays Flower's arithmetic treats specially (integer or bool arrays in a median or a trimmed
  mean, shapes that differ between replies, dtypes other than float16/32/64, replies whose
  arrays are in another order than the global model's) go through Flower's own NumPy code, so
  they give Flower's values and errors.
- Krum's distances are exact float64 sums where Flower uses
  :math:`\|x\|^2 + \|y\|^2 - 2x\cdot y` in the models' precision; two replies whose scores
  differ by less than that rounding may be ranked the other way. Where deciding scores are
  equal to within a bound on it (identical or evenly spaced replies), and for float16
  replies, Flower's ``select_multikrum`` makes the selection.
- Bulyan's "β values nearest to the median" is defined up to ties: where two different
  values are equally far from the median and only one of them is kept, ours keeps the earlier
  selected reply's, which may differ from NumPy's ``argpartition`` choice. (A trimmed mean
  has no such ambiguity: the kept values are the same whatever their order.)
- Flower's DP clip multiplies each update in place, which does not reach 0-d arrays (NumPy
  hands out a scalar copy): Flower leaves them unclipped. Ours clips every array by the same
  factor, as the clipping bound needs. A reply equal to the global model is Flower's
  ``ZeroDivisionError`` (its clipping factor divides by the zero norm), with a message.
- DP noise is drawn from fedkernels' counter-based Philox stream (``generator``, a
  ``torch.Generator``; None: a seed from torch's default generator) instead of NumPy's global
  ``np.random``: same distribution, different draws. The adaptive wrapper's noise on the
  clipped count comes from the same generator. Where a caller has replaced
  ``add_gaussian_noise_inplace`` in Flower's wrapper module (Flower's tests patch it out),
  the replacement adds the aggregate's noise instead. On the fused DP path the replies' ArrayRecords
  are left as received, where Flower replaces each by its clipped copy.
- Flower's privacy accountant (``accountant=``, ``privacy_spent()``) works unchanged; with a
  fedkernels :class:`~fedkernels.integrations.flower.FedAvg` as the wrapped strategy it is
  accepted too (Flower's check asks for its own ``FedAvg.aggregate_train``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARN
from typing import Any

import numpy as np
import torch
from torch import Tensor

try:
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.common.logger import log as flwr_log
    from flwr.serverapp import strategy as _flwr
    from flwr.serverapp.exception import AggregationError
    from flwr.serverapp.strategy import bulyan as _flwr_bulyan
    from flwr.serverapp.strategy import dp_adaptive_clipping as _flwr_dp_adaptive
    from flwr.serverapp.strategy import dp_fixed_clipping as _flwr_dp_fixed
    from flwr.serverapp.strategy.fedtrimmedavg import trim_mean as _flwr_trim_mean
    from flwr.serverapp.strategy.multikrum import select_multikrum as _flwr_select_multikrum
    from flwr.supercore.differential_privacy import (
        add_gaussian_noise_inplace,
        compute_clip_model_update,
        compute_stdv,
        get_norm,
    )
except ImportError as _err:  # pragma: no cover - exercised only without flwr
    raise ImportError(
        "fedkernels.integrations.flower_robust needs Flower (flwr >= 1.41), which is not "
        "installed: pip install 'fedkernels[flower]'"
    ) from _err

from fedkernels.aggregate import aggregate
from fedkernels.integrations.flower import (
    _FUSED_FLOAT_DTYPES,
    _as_tensors,
    _FusedFedAvgTrain,
    _ndarray_view,
    _weights_from_records,
    fused_weighted_mean,
    ndarray_to_array,
)
from fedkernels.ops.sgld import sgld_step
from fedkernels.privacy.mechanism import adaptive_clip_norm, private_aggregate, update_norms
from fedkernels.robust import (
    coordinate_median,
    krum_scores,
    nearest_to_median_mean,
    pairwise_sq_distances,
    trimmed_mean,
)

__all__ = [
    "Bulyan",
    "DifferentialPrivacyServerSideAdaptiveClipping",
    "DifferentialPrivacyServerSideFixedClipping",
    "FedMedian",
    "FedTrimmedAvg",
    "Krum",
    "MultiKrum",
    "select_multikrum",
]


# ---------------------------------------------------------------- entries of the replies


def _fusable(arrays: Sequence[np.ndarray]) -> np.dtype | None:
    """The dtype the fused path computes an entry in (NumPy's promotion of the replies'
    float dtypes, as ``np.stack`` does), or None where Flower's NumPy code must run: integer,
    bool or other dtypes (NumPy's median of integers is float64), or differing shapes."""
    if any(a.dtype not in _FUSED_FLOAT_DTYPES for a in arrays):
        return None
    if any(a.shape != arrays[0].shape for a in arrays):
        return None
    return np.result_type(*arrays)


def _coordinate_rule(records: Sequence[ArrayRecord], names: Sequence[str],
                     rule: Callable[[list[dict[str, Tensor]]], dict[str, Tensor]],
                     numpy_rule: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
    """A coordinate-wise rule over the replies, entry by entry with Flower's dtypes: one call
    of the fedkernels ``rule`` for all float entries of one shape (over tensors sharing memory
    with the replies' bytes), ``numpy_rule`` on ``np.stack`` (Flower's arithmetic and errors)
    for the others. Nothing is written to the replies."""
    columns = {n: [_ndarray_view(r[n]) for r in records] for n in names}
    fused = {n: d for n in names if (d := _fusable(columns[n])) is not None}
    out = {n: np.asarray(numpy_rule(np.stack(columns[n]))) for n in names if n not in fused}
    if fused:
        clients = [dict(zip(fused, _as_tensors([columns[n][k] for n in fused],
                                               fused.values())))
                   for k in range(len(records))]
        result = rule(clients)
        out.update({n: result[n].numpy() for n in fused})
    return {n: out[n] for n in names}


def _arrayrecord(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord of ``arrays``, emptying the dict as it goes (one model at the peak)."""
    return ArrayRecord({k: ndarray_to_array(np.asarray(arrays.pop(k))) for k in list(arrays)})


def _first_record_key(messages: Sequence[Message]) -> str:
    return list(messages[0].content.array_records.keys())[0]


# ---------------------------------------------------------------- FedMedian, FedTrimmedAvg


class FedMedian(_flwr.FedMedian):
    r"""Flower's ``FedMedian``: the coordinate-wise median of the replies (even K: the mean
    of the two middle values, as ``np.median``) by
    :func:`fedkernels.robust.coordinate_median`. As in Flower, the median of an integer
    array is float64 and the replies' ArrayRecords are emptied by the aggregation."""

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        key = _first_record_key(valid)
        records = [m.content[key] for m in valid]
        names = list(records[0].keys())
        medians = _coordinate_rule(records, names, coordinate_median,
                                   lambda stack: np.median(stack, axis=0))
        for r in records:  # Flower pops every array from the replies as it reads it
            for n in names:
                r.pop(n)
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        return _arrayrecord(medians), metrics


class FedTrimmedAvg(_flwr.FedTrimmedAvg):
    r"""Flower's ``FedTrimmedAvg``: per coordinate, the mean of the replies' values after
    cutting :math:`\lfloor \beta K \rfloor` from each end, by
    :func:`fedkernels.robust.trimmed_mean`. A ``beta`` outside [0, 0.5) (set after
    construction) or replies whose shapes differ raise Flower's ``AggregationError``; the
    replies' ArrayRecords are emptied, as in Flower."""

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        key = _first_record_key(valid)
        records = [m.content[key] for m in valid]
        names = list(records[0].keys())
        beta = self.beta
        try:
            if not 0.0 <= beta < 0.5:  # Flower's trim_mean check, before any work
                raise ValueError("Cut fraction must be in the range [0, 0.5).")
            means = _coordinate_rule(records, names, lambda c: trimmed_mean(c, beta),
                                     lambda stack: _flwr_trim_mean(stack, beta))
        except ValueError as e:
            raise AggregationError(
                f"Trimmed mean could not be computed. Likely cause: beta={beta} is too "
                "large.") from e
        for r in records:
            for n in names:
                r.pop(n)
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        return _arrayrecord(means), metrics


# ---------------------------------------------------------------- Krum, Multi-Krum, Bulyan


def _by_position(records: Sequence[ArrayRecord]) -> list[list[np.ndarray]] | None:
    """Each reply's arrays in its own order (Flower flattens and pairs them by position), or
    None where the fused path does not apply: counts or shapes that differ between replies,
    or dtypes other than bool, integer and float16/32/64, or no arrays at all (Flower's code
    runs; its concatenation of nothing is NumPy's ValueError)."""
    columns = [[_ndarray_view(v) for v in r.values()] for r in records]
    first = columns[0]
    if not first:
        return None
    for c in columns:
        if len(c) != len(first) or any(a.shape != b.shape for a, b in zip(c, first)):
            return None
        if any(a.dtype.kind not in "biuf" or (a.dtype.kind == "f" and a.dtype not in
                                              _FUSED_FLOAT_DTYPES) for a in c):
            return None
    return columns


def _promoted(columns: list[list[np.ndarray]]) -> list[list[Tensor]]:
    """The replies' arrays as tensors, each position in the promoted dtype of its K arrays;
    integer and bool positions become float64 (as Flower's concatenation promotes them)."""
    dtypes = []
    for t in range(len(columns[0])):
        d = np.result_type(*(c[t] for c in columns))
        dtypes.append(d if d in _FUSED_FLOAT_DTYPES else np.dtype(np.float64))
    return [_as_tensors(c, dtypes) for c in columns]


def select_multikrum(contents: list[RecordDict], num_malicious_nodes: int,
                     num_nodes_to_select: int) -> list[RecordDict]:
    """Flower's ``select_multikrum`` on the distances of
    :func:`fedkernels.robust.pairwise_sq_distances` and the scores of
    :func:`fedkernels.robust.krum_scores`: the ``num_nodes_to_select`` replies with the lowest
    Krum scores, lowest first. Where two of the scores that decide the selection and its
    order are equal to within Flower's rounding (identical or evenly spaced replies), Flower's
    rounding makes its choice, so Flower's function runs and makes it."""
    key = list(contents[0].array_records.keys())[0]
    columns = _by_position([c[key] for c in contents])
    # float16 replies: Flower's float16 distances round away the differences between similar
    # replies, so its selection is its rounding's; its code makes it.
    if columns is None or np.result_type(*(a for c in columns for a in c)) == np.float16:
        return _flwr_select_multikrum(contents, num_malicious_nodes, num_nodes_to_select)
    tensors = _promoted(columns)
    distances = pairwise_sq_distances(tensors)
    scores = krum_scores(distances, num_malicious_nodes).numpy()
    order = np.argsort(scores)
    deciding = order[:num_nodes_to_select + 1]
    if np.isfinite(scores[deciding]).all() and len(deciding) > 1:
        num_closest = max(1, len(contents) - num_malicious_nodes - 2)
        rounding = _flower_score_rounding(columns, tensors, distances.numpy(), scores, deciding,
                                          num_closest)
        if (np.diff(scores[deciding]) <= rounding[:-1] + rounding[1:]).any():
            return _flwr_select_multikrum(contents, num_malicious_nodes, num_nodes_to_select)
    return [contents[i] for i in order[:num_nodes_to_select]]


def _flower_score_rounding(columns: list[list[np.ndarray]], tensors: list[list[Tensor]],
                           distances: np.ndarray, scores: np.ndarray, clients: np.ndarray,
                           num_closest: int) -> np.ndarray:
    r"""Bounds on the rounding of Flower's Krum scores of ``clients``. Flower computes each
    distance as :math:`\|x_i\|^2 + \|x_j\|^2 - 2x_i\cdot x_j` in the replies' common dtype
    (exact for integer replies): off by up to :math:`c\,(\|x_i\|^2 + \|x_j\|^2)`, with
    :math:`c` a few units in the last place growing slowly with the model's length
    (:math:`(16 + \sqrt{P}/32)\,\epsilon`; measured on float32 replies: 2.2 units at
    :math:`P = 10^4`, 15 at :math:`10^6`, 29 at :math:`10^7` and 39 at :math:`3\cdot 10^7`, where
    the bound is 19, 47, 115 and 187). A score sums ``num_closest`` distances, each at most the
    score, so its neighbours' norms are at most :math:`(\|x_i\| + \sqrt{s_i})^2`; the norms
    themselves are bounded from one reference reply, the first of ``clients``, whose norm is
    taken exactly: :math:`\|x_i\| \le \|x_r\| + \sqrt{d_{ri}}`. A far outlier thus does not
    widen the bound of the replies that decide."""
    dtype = np.result_type(*(a for c in columns for a in c))
    if dtype.kind != "f":
        return np.zeros(len(clients))
    length = sum(t.numel() for t in tensors[0])
    c = (16.0 + math.sqrt(length) / 32.0) * float(np.finfo(dtype).eps)
    r = clients[0]
    ref = math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
                        for t in tensors[r]))
    norm = ref + np.sqrt(distances[r, clients])  # bounds on ||x_i||
    neighbour = norm + np.sqrt(scores[clients])  # bounds on the neighbours' norms
    return num_closest * c * (norm ** 2 + neighbour ** 2)


class _MultiKrumTrain:
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's ``MultiKrum.aggregate_train`` with the fused distances and mean."""
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        contents = [m.content for m in valid]
        selected = select_multikrum(contents, self.num_malicious_nodes,
                                    self.num_nodes_to_select)
        factors = _weights_from_records(selected, self.weighted_by_key)
        records = [next(iter(c.array_records.values())) for c in selected]
        means, _ = fused_weighted_mean(records, factors)
        metrics = self.train_metrics_aggr_fn(selected, self.weighted_by_key)
        return _arrayrecord(means), metrics


class MultiKrum(_MultiKrumTrain, _flwr.MultiKrum):
    r"""Flower's ``MultiKrum``: the ``num_nodes_to_select`` replies with the lowest Krum
    scores (:func:`select_multikrum`), averaged weighted by ``weighted_by_key``
    (:func:`~fedkernels.integrations.flower.fused_weighted_mean`, Flower's dtypes); the
    metrics are those of the selected replies."""


class Krum(_MultiKrumTrain, _flwr.Krum):
    r"""Flower's ``Krum``: the reply with the lowest Krum score (:func:`select_multikrum`
    with one node), returned as Flower returns it, the weighted mean of that one reply
    (integer arrays become float64)."""


class Bulyan(_flwr.Bulyan):
    r"""Flower's ``Bulyan``: θ = K − 2f replies chosen by ``selection_rule`` (Flower's
    default, Multi-Krum, runs as :func:`select_multikrum`; another rule is called as Flower
    calls it), then per coordinate the mean of the β = θ − 2f selected values nearest to
    their median (:func:`fedkernels.robust.nearest_to_median_mean`: one pass over all float
    arrays; on an exact distance tie the lower value). Arrays pair by position and the
    selected replies' ArrayRecords are emptied, as in Flower."""

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        f = self.num_malicious_nodes
        if len(valid) < 4 * f + 3:
            flwr_log(WARN, "Insufficient replies, skipping Bulyan aggregation: Required at "
                     "least %d (4*num_malicious_nodes + 3), but received %d.", 4 * f + 3,
                     len(valid))
            return None, None
        contents = [m.content for m in valid]
        theta = len(valid) - 2 * f
        beta = theta - 2 * f
        rule = self.selection_rule
        selected = (select_multikrum if rule is _flwr_select_multikrum else rule)(
            contents, f, theta)
        key = list(selected[0].array_records.keys())[0]
        names = list(selected[0][key].keys())
        columns = _by_position([c[key] for c in selected])
        shared = len({id(c[key]) for c in selected}) < len(selected)
        if shared or columns is None or any(a.dtype not in _FUSED_FLOAT_DTYPES
                                            for c in columns for a in c):
            # Flower's reading empties each ArrayRecord: one shared by two selected replies
            # reads as empty the second time (its ValueError).
            arrays = [c[key].to_numpy_ndarrays(keep_input=False) for c in selected]
            medians = [np.median(a, axis=0) for a in zip(*arrays, strict=True)]
            result = _flwr_bulyan.aggregate_n_closest_weights(medians, arrays, beta)
        else:
            result = [t.numpy() for t in nearest_to_median_mean(_promoted(columns), beta)]
        record = ArrayRecord(dict(zip(names, (ndarray_to_array(np.asarray(a)) for a in result),
                                      strict=True)))
        for c in selected:  # Flower reads them with keep_input=False
            for n in list(c[key].keys()):
                c[key].pop(n)
        metrics = self.train_metrics_aggr_fn(selected, self.weighted_by_key)
        return record, metrics


# ---------------------------------------------------------------- central DP wrappers


def _averages_like_fedavg(strategy: Any) -> bool:
    """Whether the wrapped strategy's aggregate_train is FedAvg's weighted mean (Flower's, or
    the fused drop-in with Flower's integer rule), so clip, mean and noise can be one op."""
    method = type(strategy).aggregate_train
    if method is _flwr.FedAvg.aggregate_train:
        return True
    return (method is _FusedFedAvgTrain.aggregate_train
            and getattr(strategy, "int_policy", None) == "mean"
            and not getattr(strategy, "check_finite", False))


class _DPClipping:
    """What both DP wrappers share: the replies' clip and the noise, by fedkernels."""

    generator: torch.Generator | None = None
    _clip_message = "aggregate_fit: parameters are clipped by value: %.4f."
    _flower_module: Any = _flwr_dp_fixed

    def _replaced_flower_noise(self) -> Callable[[list[np.ndarray], float], None] | None:
        """Flower's noise function where a caller has replaced it in Flower's wrapper module
        (Flower's own tests patch it out to check the noiseless aggregate), else None: the
        replacement then adds the noise, on every array, as in Flower."""
        noise = getattr(self._flower_module, "add_gaussian_noise_inplace",
                        add_gaussian_noise_inplace)
        return None if noise is add_gaussian_noise_inplace else noise

    def _plan(self, replies: list[Message]
              ) -> tuple[list[str], list[Tensor], list[list[Tensor]]] | None:
        """The global model's names and tensors and the replies' tensors (views of their
        bytes) where the fused clip applies: one ArrayRecord a reply with the global model's
        keys in its order, float16/32/64 arrays of the global model's dtypes and shapes.
        None otherwise: Flower's NumPy clip runs (it pairs arrays by position)."""
        names = list(self.current_arrays.keys())
        current = [_ndarray_view(v) for v in self.current_arrays.values()]
        if any(a.dtype not in _FUSED_FLOAT_DTYPES for a in current):
            return None
        dtypes = [a.dtype for a in current]
        clients = []
        for m in replies:
            records = list(m.content.array_records.values())
            if len(records) != 1 or list(records[0].keys()) != names:
                return None
            arrays = [_ndarray_view(v) for v in records[0].values()]
            if any(a.dtype != g.dtype or a.shape != g.shape for a, g in zip(arrays, current)):
                return None
            clients.append(_as_tensors(arrays, dtypes))
        return names, _as_tensors(current, dtypes), clients

    def _scales(self, norms: Sequence[float], clip_norm: float) -> list[float]:
        r"""Flower's :math:`\min(1, C/\|u_k\|)` in Python floats: NaN norms keep factor 1,
        and a zero update is Flower's ZeroDivisionError."""
        out = []
        for k, norm in enumerate(norms):
            if norm == 0.0:
                raise ZeroDivisionError(
                    f"{type(self).__name__}: reply {k} equals the global model (update norm "
                    "0); Flower's clipping factor clipping_norm / norm divides by zero")
            out.append(min(1, clip_norm / norm))
        return out

    def _clip_replies(self, replies: list[Message], clip_norm: float) -> list[float]:
        """Flower's server-side clip of every reply, in place on the messages: each
        ArrayRecord becomes :math:`x_t + \\min(1, C/\\|x_k - x_t\\|)(x_k - x_t)`. Returns the
        update norms before clipping."""
        if not replies:  # nothing to clip: the wrapped strategy sees no replies, as in Flower
            return []
        plan = self._plan(replies)
        if plan is None:
            return self._clip_replies_flower(replies, clip_norm)
        names, base, clients = plan
        norms = update_norms(clients, base).tolist()
        for m, client, s in zip(replies, clients, self._scales(norms, clip_norm)):
            key = next(iter(m.content.array_records.keys()))
            clipped = aggregate([client], [float(s)], base=base)
            m.content[key] = ArrayRecord({n: ndarray_to_array(t.numpy())
                                          for n, t in zip(names, clipped)})
            flwr_log(INFO, self._clip_message, clip_norm)
        return norms

    def _clip_replies_flower(self, replies: list[Message], clip_norm: float) -> list[float]:
        current = self.current_arrays.to_numpy_ndarrays()
        norms = []
        for reply in replies:
            for name, record in reply.content.array_records.items():
                arrays = record.to_numpy_ndarrays()
                norms.append(get_norm([np.subtract(x, y)
                                       for x, y in zip(arrays, current, strict=True)]))
                compute_clip_model_update(arrays, current, clip_norm)
                reply.content[name] = ArrayRecord(
                    {k: Array(np.asarray(v)) for k, v in zip(record.keys(), arrays,
                                                             strict=True)})
            flwr_log(INFO, self._clip_message, clip_norm)
        return norms

    def _add_noise(self, aggregated: ArrayRecord, clip_norm: float) -> ArrayRecord:
        """Noise of Flower's standard deviation :math:`\\sigma C / m` on every array of the
        wrapped strategy's result: float arrays from fedkernels' Philox stream, others by
        Flower's own code (integer arrays get the noise truncated, as Flower's ``astype``)."""
        stdv = compute_stdv(self.noise_multiplier, clip_norm, self.num_sampled_clients)
        names = list(aggregated.keys())
        arrays = aggregated.to_numpy_ndarrays()
        replaced = self._replaced_flower_noise()
        if replaced is not None:
            replaced(arrays, stdv)
        else:
            for t, a in enumerate(arrays):
                if a.dtype in _FUSED_FLOAT_DTYPES:
                    x = torch.from_numpy(a if a.flags.c_contiguous else a.copy())
                    arrays[t] = sgld_step(x, torch.zeros_like(x), step_size=0.0,
                                          noise_std=stdv, generator=self.generator).numpy()
                else:
                    add_gaussian_noise_inplace([a], stdv)
        flwr_log(INFO, "aggregate_fit: central DP noise with %.4f stdev added", stdv)
        return ArrayRecord({k: ndarray_to_array(np.asarray(v))
                            for k, v in zip(names, arrays, strict=True)})

    def _fused_round(self, replies: list[Message], clip_norm: float,
                     noise_clip: Callable[[list[float]], float] | None = None
                     ) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        """Clip, the wrapped FedAvg's mean and the noise as one :func:`private_aggregate`
        call; None where the wrapped strategy or the replies need the general path (also for
        NaN/Inf updates, which Flower averages unclipped or as NaN). The noise's C is
        ``clip_norm``, or ``noise_clip(norms)`` (the adaptive wrapper's updated C, which
        needs the norms first: one :func:`update_norms` pass more)."""
        if not _averages_like_fedavg(self.strategy):
            return None
        plan = self._plan(replies)
        if plan is None:
            return None
        names, base, clients = plan
        norms = None
        if noise_clip is not None:
            norms = update_norms(clients, base).tolist()
            if not all(math.isfinite(n) for n in norms):
                return None
            self._scales(norms, clip_norm)  # Flower clips (and divides) before the inner checks
        inner = self.strategy
        for _ in replies:
            flwr_log(INFO, self._clip_message, clip_norm)
        valid, _ = inner._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        contents = [m.content for m in valid]
        factors = _weights_from_records(contents, inner.weighted_by_key)
        c_noise = clip_norm if noise_clip is None else noise_clip(norms)
        stdv = compute_stdv(self.noise_multiplier, c_noise, self.num_sampled_clients)
        replaced = self._replaced_flower_noise()
        try:
            result, computed = private_aggregate(clients, factors, base=base,
                                                 clip_norm=clip_norm,
                                                 noise_std=stdv if replaced is None else 0.0,
                                                 generator=self.generator)
        except ValueError:
            if all(math.isfinite(n) for n in update_norms(clients, base).tolist()):
                raise
            return None  # NaN/Inf in an update: Flower's arithmetic, not an error
        if norms is None:
            self._scales(computed.tolist(), clip_norm)  # a zero update: Flower's error
        flwr_log(INFO, "aggregate_fit: central DP noise with %.4f stdev added", stdv)
        # The wrapped FedAvg's dtypes: NumPy's for x * w, so a NumPy float64 weight (a
        # MetricRecord takes one as a float) makes a float16/float32 mean float64.
        arrays = [t.numpy() for t in result]
        arrays = [a.astype(np.result_type(a.dtype, factors[0]), copy=False) for a in arrays]
        if replaced is not None:
            replaced(arrays, stdv)
        record = ArrayRecord({n: ndarray_to_array(a) for n, a in zip(names, arrays)})
        return record, inner.train_metrics_aggr_fn(contents, inner.weighted_by_key)


class DifferentialPrivacyServerSideFixedClipping(
        _DPClipping, _flwr.DifferentialPrivacyServerSideFixedClipping):
    r"""Flower's ``DifferentialPrivacyServerSideFixedClipping``: every reply's update
    :math:`x_k - x_t` clipped to L2 norm C (``clipping_norm``), the wrapped strategy's
    aggregate, then :math:`\mathcal N(0, (\sigma C/m)^2)` on every coordinate (σ
    ``noise_multiplier``, m ``num_sampled_clients``). When the wrapped strategy is a
    ``FedAvg`` (Flower's, or fedkernels' with ``int_policy="mean"``) the three steps are one
    :func:`fedkernels.privacy.private_aggregate` call after a norm pass; otherwise the
    replies are clipped by fedkernels and handed to the wrapped strategy, then noised.
    Flower's ``accountant`` and ``privacy_spent()`` work as in Flower.

    Extra keyword argument: ``generator`` (a ``torch.Generator``) seeds the noise."""

    def __init__(self, strategy: Any, noise_multiplier: float, clipping_norm: float,
                 num_sampled_clients: int, *, accountant: Any = None,
                 generator: torch.Generator | None = None) -> None:
        fused_fedavg = (accountant is not None and _averages_like_fedavg(strategy)
                        and type(strategy).aggregate_train is not _flwr.FedAvg.aggregate_train)
        # Flower's accountant check asks for FedAvg.aggregate_train itself; the fused FedAvg
        # computes the same mean, so Flower's checks run on a stand-in FedAvg.
        checked = _flwr.FedAvg(weighted_by_key=strategy.weighted_by_key) if fused_fedavg \
            else strategy
        super().__init__(checked, noise_multiplier, clipping_norm, num_sampled_clients,
                         accountant=accountant)
        self.strategy = strategy
        self.generator = generator

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies_list = list(replies)
        event = self._pop_pending_event(server_round)
        if not _flwr_dp_fixed.validate_replies(replies_list, self.num_sampled_clients,
                                               strict=self.accountant is not None):
            return None, None
        self._validate_uniform_weights(replies_list)
        clip = self.clipping_norm
        fused = self._fused_round(replies_list, clip)
        if fused is None:
            self._clip_replies(replies_list, clip)
            fused = self.strategy.aggregate_train(server_round, replies_list)
            if fused[0]:
                fused = (self._add_noise(fused[0], clip), fused[1])
        if fused[0]:
            self._compose_release(event)
        return fused


class DifferentialPrivacyServerSideAdaptiveClipping(
        _DPClipping, _flwr.DifferentialPrivacyServerSideAdaptiveClipping):
    r"""Flower's ``DifferentialPrivacyServerSideAdaptiveClipping`` (Andrew et al., 2021): the
    replies are clipped to the current C (``clipping_norm``); with b of the K replies
    clipped, :math:`C \leftarrow C\exp(-\eta_C((b + \mathcal N(0, \sigma_b^2))/K - \gamma))`
    (:func:`fedkernels.privacy.adaptive_clip_norm`; :math:`\eta_C` ``clip_norm_lr``,
    :math:`\sigma_b` ``clipped_count_stddev``, γ ``target_clipped_quantile``); then, as in
    Flower, the aggregate's noise uses the updated C: :math:`\sigma C/m`. With a ``FedAvg``
    as the wrapped strategy: one norm pass, then one
    :func:`~fedkernels.privacy.private_aggregate` call.

    Extra keyword argument: ``generator`` (a CPU ``torch.Generator``) seeds both noises."""

    _clip_message = "aggregate_train: arrays in `ArrayRecord` are clipped by value: %.4f."
    _flower_module = _flwr_dp_adaptive

    def __init__(self, strategy: Any, noise_multiplier: float, num_sampled_clients: int,
                 initial_clipping_norm: float = 0.1, target_clipped_quantile: float = 0.5,
                 clip_norm_lr: float = 0.2, clipped_count_stddev: float | None = None, *,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(strategy, noise_multiplier, num_sampled_clients,
                         initial_clipping_norm, target_clipped_quantile, clip_norm_lr,
                         clipped_count_stddev)
        self.generator = generator

    def _next_clip(self, norms: Sequence[float]) -> float:
        # A NaN norm is never "clipped" in Flower (min(1, C / nan) is 1): count it as 0.
        values = [0.0 if math.isnan(n) else n for n in norms]
        return adaptive_clip_norm(
            self.clipping_norm, values, target_quantile=self.target_clipped_quantile,
            clip_norm_lr=self.clip_norm_lr, clipped_count_stddev=self.clipped_count_stddev,
            generator=self.generator)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies_list = list(replies)
        if not _flwr_dp_fixed.validate_replies(replies_list, self.num_sampled_clients):
            return None, None
        if not replies_list:  # Flower divides the noisy clipped count by zero replies
            raise ZeroDivisionError(f"{type(self).__name__}: no replies, and the clipped "
                                    "fraction divides by their number")
        clip = self.clipping_norm
        updated: list[float] = []

        def noise_clip(norms: list[float]) -> float:
            updated.append(self._next_clip(norms))
            return updated[0]

        fused = self._fused_round(replies_list, clip, noise_clip)
        if fused is not None:
            if updated:
                self.clipping_norm = updated[0]
            return fused
        norms = self._clip_replies(replies_list, clip)
        self.clipping_norm = self._next_clip(norms)
        arrays, metrics = self.strategy.aggregate_train(server_round, replies_list)
        if arrays:
            arrays = self._add_noise(arrays, self.clipping_norm)
        return arrays, metrics
