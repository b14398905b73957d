r"""Flower's legacy robust strategies (``flwr.server.strategy``) with fedkernels arithmetic.

Each class subclasses Flower's legacy class of the same name and replaces only the O(K·P)
arithmetic of ``aggregate_fit``, reading the ``FitRes`` bytes through zero-copy views
(:func:`~fedkernels.integrations.flower.legacy.parameters_to_arrays`) where Flower
deserializes every array with ``np.load``. Constructor arguments, attributes, ``accept_failures``,
``fit_metrics_aggregation_fn``, the log lines and the errors are Flower's::

    from flwr.server.strategy import Krum                               # before
    from fedkernels.integrations.flower.legacy_robust import Krum       # after

=========================================  =====================================================
:class:`FedMedian`                         :func:`fedkernels.robust.coordinate_median`
:class:`FedTrimmedAvg`                     :func:`fedkernels.robust.trimmed_mean`
:class:`Krum`                              distances by
                                           :func:`fedkernels.robust.pairwise_sq_distances`,
                                           scores by :func:`fedkernels.robust.krum_scores`,
                                           Flower's legacy selection; ``num_clients_to_keep``
                                           > 0 averages the kept clients with the fused
                                           weighted mean
:class:`Bulyan`                            :func:`fedkernels.robust.bulyan` with the legacy
                                           (iterative Krum) selection
=========================================  =====================================================

Differences from Flower are those of :mod:`fedkernels.integrations.flower.robust`: rounding,
exact float64 Krum distances (Flower's legacy ones are per-pair norms in the models' dtype)
and ties at Bulyan's β boundary. Models of integer or bool arrays only, shapes that differ
between clients and other dtypes go through Flower's own NumPy code.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce

import numpy as np
import torch
from flwr.common import Parameters, Scalar, ndarrays_to_parameters
from flwr.server import strategy as _flower
from flwr.server.strategy import aggregate as _flower_aggregate

from fedkernels.integrations.flower.legacy import (
    Failures,
    FitResults,
    _fit_metrics,
    aggregate_ndarrays,
    parameters_to_arrays,
)
from fedkernels.integrations.flower.records import FUSED_FLOAT_DTYPES, as_tensors
from fedkernels.ops.concurrency import one_call_at_a_time
from fedkernels.robust import (
    bulyan,
    coordinate_median,
    krum_scores,
    pairwise_sq_distances,
    trimmed_mean,
)

__all__ = ["Bulyan", "FedMedian", "FedTrimmedAvg", "Krum"]

Clients = list[list[np.ndarray]]


def _layers_fusable(clients: Clients, same_dtype: bool = False) -> list[np.dtype] | None:
    """Per layer, the dtype the fused path computes in (NumPy's promotion of the clients'
    float16/32/64 dtypes), or None where Flower's NumPy code must run (layer counts or shapes
    that differ, integer, bool or other dtypes; ``same_dtype``: dtypes that differ)."""
    first = clients[0]
    if any(len(c) != len(first) for c in clients):
        return None
    dtypes = []
    for t in range(len(first)):
        column = [c[t] for c in clients]
        if any(type(a) is not np.ndarray or a.dtype not in FUSED_FLOAT_DTYPES
               or a.shape != first[t].shape for a in column):
            return None
        if same_dtype and any(a.dtype != first[t].dtype for a in column):
            return None
        dtypes.append(np.result_type(*column))
    return dtypes


class _RobustFit:
    """Flower's legacy ``aggregate_fit`` skeleton around :meth:`_combine`."""

    def _combine(self, clients: Clients, examples: list[int]) -> list[np.ndarray]:
        raise NotImplementedError

    @one_call_at_a_time()
    def aggregate_fit(self, server_round: int, results: FitResults, failures: Failures
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        if not results:
            return None, {}
        if not self.accept_failures and failures:
            return None, {}
        clients = [parameters_to_arrays(res.parameters) for _, res in results]
        arrays = self._combine(clients, [res.num_examples for _, res in results])
        return ndarrays_to_parameters(arrays), _fit_metrics(self, server_round, results)


def _coordinatewise(clients: Clients, rule: Callable, numpy_rule: Callable
                    ) -> list[np.ndarray]:
    """``rule`` (fedkernels) over all layers where they suit it, else Flower's ``numpy_rule``
    on the whole result (its values and errors)."""
    dtypes = _layers_fusable(clients)
    if dtypes is None:
        return numpy_rule([(c, 0) for c in clients])
    tensors = [as_tensors(c, dtypes) for c in clients]
    return [t.numpy() for t in rule(tensors)]


class FedMedian(_RobustFit, _flower.FedMedian):
    """Flower's legacy ``FedMedian`` with :func:`fedkernels.robust.coordinate_median`."""

    def _combine(self, clients, examples):
        return _coordinatewise(clients, coordinate_median, _flower_aggregate.aggregate_median)


class FedTrimmedAvg(_RobustFit, _flower.FedTrimmedAvg):
    """Flower's legacy ``FedTrimmedAvg`` with :func:`fedkernels.robust.trimmed_mean`; a
    ``beta`` outside [0, 0.5) is Flower's ``ValueError``."""

    def _combine(self, clients, examples):
        beta = self.beta
        if not 0.0 <= beta < 0.5:
            raise ValueError("Proportion to cut must be in the range [0, 0.5).")
        return _coordinatewise(clients, lambda c: trimmed_mean(c, beta),
                               lambda results: _flower_aggregate.aggregate_trimmed_avg(
                                   results, beta))


def _distances(clients: Clients) -> np.ndarray | None:
    """The K×K squared distances over every layer (integer layers as float64, as Flower's
    concatenation promotes them), or None where the layers do not line up or Flower's
    concatenation of them is not floating point (its integer arithmetic, or its TypeError
    for booleans) or is float16, or there is none (NumPy's ValueError)."""
    first = clients[0]
    if not first:
        return None
    flat = reduce(np.promote_types, {a.dtype for c in clients for a in c})
    # float16: Flower's float16 distances round away those between similar clients, so its
    # selection is its rounding's; its code makes it.
    if flat.kind != "f" or flat == np.float16:
        return None
    if any(len(c) != len(first) or any(a.shape != b.shape for a, b in zip(c, first))
           or any(a.dtype.kind not in "biuf" or (a.dtype.kind == "f" and a.dtype not in
                                                 FUSED_FLOAT_DTYPES) for a in c)
           for c in clients):
        return None
    dtypes = []
    for t in range(len(first)):
        d = np.result_type(*(c[t] for c in clients))
        dtypes.append(d if d in FUSED_FLOAT_DTYPES else np.dtype(np.float64))
    return pairwise_sq_distances([as_tensors(c, dtypes) for c in clients]).numpy()


def _norm_rounding(length: int, eps: float) -> float:
    r"""A bound on the relative rounding of Flower's legacy Krum distances, squared float
    norms (``np.linalg.norm``) of differences of ``length`` values in a float type of machine
    epsilon ``eps``: :math:`16 + (P/10^5)^{3/2}` units in the last place. The norm's float32
    dot product loses more than a few units on long vectors, and alike on every pair; the bound
    stays several times above what float32 models show up to :math:`P = 3\cdot 10^7`."""
    return (16.0 + (length / 1e5) ** 1.5) * eps


class Krum(_RobustFit, _flower.Krum):
    r"""Flower's legacy ``Krum``: the client with the lowest Krum score
    (``num_clients_to_keep=0``, its arrays as sent), or the weighted mean of the
    ``num_clients_to_keep`` lowest (Multi-Krum), with Flower's order of ties."""

    def _combine(self, clients, examples):
        distances = _distances(clients)
        if distances is None:
            return _flower_aggregate.aggregate_krum(list(zip(clients, examples)),
                                                    self.num_malicious_clients,
                                                    self.num_clients_to_keep)
        scores = krum_scores(torch.from_numpy(distances), self.num_malicious_clients).numpy()
        keep = self.num_clients_to_keep
        # Flower's distances are float norms squared, off by their rounding (_norm_rounding):
        # where the scores that decide the selection are that close (identical or evenly
        # spaced clients), its rounding decides, so its code runs.
        # (Not with a NaN client, which Flower's argmin would select and ours never does.)
        deciding = np.sort(scores)[:max(keep, 1) + 1]
        if len(deciding) > 1 and np.isfinite(scores).all():
            flat = np.result_type(*(a for c in clients for a in c))
            eps = float(np.finfo(flat if flat.kind == "f" else np.float64).eps)
            length = sum(a.size for a in clients[0])
            if np.diff(deciding).min() <= _norm_rounding(length, eps) * float(deciding[-1]):
                return _flower_aggregate.aggregate_krum(list(zip(clients, examples)),
                                                        self.num_malicious_clients, keep)
        if keep > 0:
            best = np.argsort(scores)[::-1][len(scores) - keep:]
            return aggregate_ndarrays([(clients[i], examples[i]) for i in best])
        return [np.array(a) for a in clients[int(np.argmin(scores))]]


def _first_nan_client(clients: Clients) -> int | None:
    """The first client with a NaN in its float arrays, or None. A plain sum is finite
    unless a value is NaN or Inf (or the sum overflows): only those arrays are searched."""
    for k, client in enumerate(clients):
        for a in client:
            if not np.isfinite(a.sum()) and np.isnan(a).any():
                return k
    return None


class Bulyan(_RobustFit, _flower.Bulyan):
    r"""Flower's legacy ``Bulyan`` (θ = K − 2f clients chosen by Krum one at a time, then per
    coordinate the mean of the β = θ − 2f values nearest to the median) by
    :func:`fedkernels.robust.bulyan` (``selection="iterative"``). As in Flower, the Krum rule
    needs ``to_keep=0`` among the keyword arguments (``Bulyan(num_malicious_clients=f,
    to_keep=0)``); without it, or with another ``first_aggregation_rule``, Flower's
    ``aggregate_bulyan`` runs (and raises what it raises). A client whose parameters contain
    NaN raises a ``ValueError`` naming it, where Flower raises one from its Krum selection."""

    def _combine(self, clients, examples):
        f = self.num_malicious_clients
        kwargs = self.aggregation_rule_kwargs
        dtypes = _layers_fusable(clients, same_dtype=True)
        # Flower's aggregate_krum needs to_keep=0 passed (Bulyan(..., to_keep=0)): without it
        # Flower's own call is its TypeError, with to_keep > 0 its ValueError.
        flower_rule = (self.first_aggregation_rule is not _flower_aggregate.aggregate_krum
                       or kwargs != {"to_keep": 0})
        if dtypes is None or not dtypes or flower_rule or len(clients) < 4 * f + 3:
            return _flower_aggregate.aggregate_bulyan(list(zip(clients, examples)), f,
                                                      self.first_aggregation_rule, **kwargs)
        nan_client = _first_nan_client(clients)
        if nan_client is not None:
            # Flower's Krum scores this client NaN, np.argmin selects it first, and Flower
            # then fails to find it among the clients (NaN != NaN): a ValueError either way.
            raise ValueError(f"Bulyan: client {nan_client}'s parameters contain NaN, which "
                             "Flower's Krum selection cannot handle (Flower raises 'The reference "
                             "weights not found in list_of_weights.')")
        result = bulyan([as_tensors(c, dtypes) for c in clients], f, selection="iterative")
        return [t.numpy() for t in result]
