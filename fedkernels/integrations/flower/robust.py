r"""Flower's robust Message-API strategies (``flwr.serverapp.strategy``) with fedkernels
arithmetic.

Each class subclasses Flower's class of the same name and replaces only the O(K·P) part of
``aggregate_train``; the constructor, attributes, ``configure_*``, ``summary``, the log lines
and the exceptions are Flower's. Swap the import::

    from fedkernels.integrations.flower.robust import FedMedian   # was: flwr.serverapp.strategy

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from logging import WARN

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import strategy as _flwr
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import bulyan as _flwr_bulyan
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean as _flwr_trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum as _flwr_select_multikrum
from torch import Tensor

from fedkernels.integrations.flower.records import (
    FUSED_FLOAT_DTYPES,
    as_tensors,
    ndarray_to_array,
    ndarray_view,
    to_arrayrecord,
)
from fedkernels.integrations.flower.weighted_mean import fused_weighted_mean, weights_from_records
from fedkernels.ops.concurrency import one_call_at_a_time
from fedkernels.robust import (
    coordinate_median,
    krum_scores,
    nearest_to_median_mean,
    pairwise_sq_distances,
    trimmed_mean,
)

__all__ = ["Bulyan", "FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "select_multikrum"]


# ---------------------------------------------------------------- entries of the replies


def _fusable(arrays: Sequence[np.ndarray]) -> np.dtype | None:
    """The dtype the fused path computes an entry in (NumPy's promotion of the replies'
    float dtypes, as ``np.stack`` does), or None where Flower's NumPy code must run: integer,
    bool or other dtypes (NumPy's median of integers is float64), or differing shapes."""
    if any(a.dtype not in FUSED_FLOAT_DTYPES for a in arrays):
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
    columns = {n: [ndarray_view(r[n]) for r in records] for n in names}
    fused = {n: d for n in names if (d := _fusable(columns[n])) is not None}
    out = {n: np.asarray(numpy_rule(np.stack(columns[n]))) for n in names if n not in fused}
    if fused:
        clients = [dict(zip(fused, as_tensors([columns[n][k] for n in fused],
                                               fused.values())))
                   for k in range(len(records))]
        result = rule(clients)
        out.update({n: result[n].numpy() for n in fused})
    return {n: out[n] for n in names}


def _first_record_key(messages: Sequence[Message]) -> str:
    return list(messages[0].content.array_records.keys())[0]


# ---------------------------------------------------------------- FedMedian, FedTrimmedAvg


class FedMedian(_flwr.FedMedian):
    r"""Flower's ``FedMedian``: the coordinate-wise median of the replies (even K: the mean
    of the two middle values, as ``np.median``) by
    :func:`fedkernels.robust.coordinate_median`. As in Flower, the median of an integer
    array is float64 and the replies' ArrayRecords are emptied by the aggregation."""

    @one_call_at_a_time()
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
        return to_arrayrecord(medians), metrics


class FedTrimmedAvg(_flwr.FedTrimmedAvg):
    r"""Flower's ``FedTrimmedAvg``: per coordinate, the mean of the replies' values after
    cutting :math:`\lfloor \beta K \rfloor` from each end, by
    :func:`fedkernels.robust.trimmed_mean`. A ``beta`` outside [0, 0.5) (set after
    construction) or replies whose shapes differ raise Flower's ``AggregationError``; the
    replies' ArrayRecords are emptied, as in Flower."""

    @one_call_at_a_time()
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
        return to_arrayrecord(means), metrics


# ---------------------------------------------------------------- Krum, Multi-Krum, Bulyan


def _by_position(records: Sequence[ArrayRecord]) -> list[list[np.ndarray]] | None:
    """Each reply's arrays in its own order (Flower flattens and pairs them by position), or
    None where the fused path does not apply: counts or shapes that differ between replies,
    or dtypes other than bool, integer and float16/32/64, or no arrays at all (Flower's code
    runs; its concatenation of nothing is NumPy's ValueError)."""
    columns = [[ndarray_view(v) for v in r.values()] for r in records]
    first = columns[0]
    if not first:
        return None
    for c in columns:
        if len(c) != len(first) or any(a.shape != b.shape for a, b in zip(c, first)):
            return None
        if any(a.dtype.kind not in "biuf" or (a.dtype.kind == "f" and a.dtype not in
                                              FUSED_FLOAT_DTYPES) for a in c):
            return None
    return columns


def _promoted(columns: list[list[np.ndarray]]) -> list[list[Tensor]]:
    """The replies' arrays as tensors, each position in the promoted dtype of its K arrays;
    integer and bool positions become float64 (as Flower's concatenation promotes them)."""
    dtypes = []
    for t in range(len(columns[0])):
        d = np.result_type(*(c[t] for c in columns))
        dtypes.append(d if d in FUSED_FLOAT_DTYPES else np.dtype(np.float64))
    return [as_tensors(c, dtypes) for c in columns]


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
    (:math:`(16 + \sqrt{P}/32)\,\epsilon`, several times the rounding float32 replies show up
    to :math:`P = 3\cdot 10^7`). A score sums ``num_closest`` distances, each at most the
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
    @one_call_at_a_time()
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's ``MultiKrum.aggregate_train`` with the fused distances and mean."""
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        contents = [m.content for m in valid]
        selected = select_multikrum(contents, self.num_malicious_nodes,
                                    self.num_nodes_to_select)
        factors = weights_from_records(selected, self.weighted_by_key)
        records = [next(iter(c.array_records.values())) for c in selected]
        means, _ = fused_weighted_mean(records, factors)
        metrics = self.train_metrics_aggr_fn(selected, self.weighted_by_key)
        return to_arrayrecord(means), metrics


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

    @one_call_at_a_time()
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
        if shared or columns is None or any(a.dtype not in FUSED_FLOAT_DTYPES
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
