r"""Flower's legacy robust and private strategies (``flwr.server.strategy``) with fedkernels
arithmetic (``pip install 'fedkernels[flower]'``).

Each class subclasses Flower's legacy class of the same name and replaces only the O(K·P)
arithmetic of ``aggregate_fit``, reading the ``FitRes`` bytes through zero-copy views
(:func:`~fedkernels.integrations.flower_legacy.parameters_to_arrays`) where Flower
deserializes every array with ``np.load``. Constructor arguments, attributes, ``accept_failures``,
``fit_metrics_aggregation_fn``, the log lines and the errors are Flower's::

    from flwr.server.strategy import Krum                               # before
    from fedkernels.integrations.flower_legacy_robust import Krum       # after

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
:class:`DifferentialPrivacyServerSide\     every client's update clipped by fedkernels (norms
FixedClipping`                             from :func:`fedkernels.privacy.update_norms`), the
                                           wrapped strategy's aggregate (the fused mean with
                                           :class:`~fedkernels.integrations.flower_legacy.FedAvg`),
                                           noise from fedkernels' Philox stream
:class:`DifferentialPrivacyServerSide\     the same, with the clip norm moved by
AdaptiveClipping`                          :func:`fedkernels.privacy.adaptive_clip_norm`
=========================================  =====================================================

Differences from Flower are those of :mod:`fedkernels.integrations.flower_robust`: rounding,
exact float64 Krum distances (Flower's legacy ones are per-pair norms in the models' dtype),
ties at Bulyan's β boundary, noise from a ``torch.Generator`` (``generator=``) instead of
NumPy's global generator, 0-d arrays clipped with the rest (Flower leaves them unclipped), and
a zero update raises ``ZeroDivisionError`` with a message naming the client, as Flower's does
without one. Models of integer or bool arrays only, shapes that differ between clients and
other dtypes go through Flower's own NumPy code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import reduce
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch

try:
    from flwr.common import Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.logger import log
    from flwr.server import strategy as _flower
    from flwr.server.strategy import aggregate as _flower_aggregate
    from flwr.supercore.differential_privacy import (
        CLIENTS_DISCREPANCY_WARNING,
        add_gaussian_noise_inplace,
        compute_clip_model_update,
        compute_stdv,
        get_norm,
    )
except ImportError as _err:  # pragma: no cover - exercised only without flwr
    raise ImportError(
        "fedkernels.integrations.flower_legacy_robust needs Flower (flwr >= 1.41), which is "
        "not installed: pip install 'fedkernels[flower]'"
    ) from _err

from fedkernels.aggregate import aggregate
from fedkernels.integrations.flower import _FUSED_FLOAT_DTYPES, _as_tensors
from fedkernels.integrations.flower_legacy import (
    Failures,
    FitResults,
    _fit_metrics,
    aggregate_ndarrays,
    parameters_to_arrays,
)
from fedkernels.ops.sgld import sgld_step
from fedkernels.privacy.mechanism import adaptive_clip_norm, update_norms
from fedkernels.robust import (
    bulyan,
    coordinate_median,
    krum_scores,
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
]

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
        if any(type(a) is not np.ndarray or a.dtype not in _FUSED_FLOAT_DTYPES
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
    tensors = [_as_tensors(c, dtypes) for c in clients]
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
                                                 _FUSED_FLOAT_DTYPES) for a in c)
           for c in clients):
        return None
    dtypes = []
    for t in range(len(first)):
        d = np.result_type(*(c[t] for c in clients))
        dtypes.append(d if d in _FUSED_FLOAT_DTYPES else np.dtype(np.float64))
    return pairwise_sq_distances([_as_tensors(c, dtypes) for c in clients]).numpy()


def _norm_rounding(length: int, eps: float) -> float:
    r"""A bound on the relative rounding of Flower's legacy Krum distances, squared float
    norms (``np.linalg.norm``) of differences of ``length`` values in a float type of machine
    epsilon ``eps``. The norm's float32 dot product loses more than a few units in the last
    place on long vectors, and alike on every pair: measured 1.6 units at 10^4 values, 26 at
    10^6, 280 at 10^7 and 1380 at 3·10^7 (the bound, :math:`16 + (P/10^5)^{3/2}` units: 17, 48,
    1016 and 5212)."""
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
        result = bulyan([_as_tensors(c, dtypes) for c in clients], f, selection="iterative")
        return [t.numpy() for t in result]


# ---------------------------------------------------------------- central DP wrappers


class _LegacyDP:
    """The clip of the clients' parameters and the noise, by fedkernels."""

    generator: torch.Generator | None = None

    def _clip_results(self, results: FitResults, clip_norm: float) -> list[float]:
        """Flower's clip of every client, in place on the ``FitRes``:
        :math:`x_t + \\min(1, C/\\|x_k - x_t\\|)(x_k - x_t)`. Returns the norms before it."""
        current = self.current_round_params
        clients = [parameters_to_arrays(res.parameters) for _, res in results]
        ok = bool(clients) and all(
            len(c) == len(current) and all(type(a) is np.ndarray and a.dtype == g.dtype
                                           and a.dtype in _FUSED_FLOAT_DTYPES
                                           and a.shape == g.shape for a, g in zip(c, current))
            for c in clients)
        if not ok:
            return self._clip_results_flower(results, clip_norm)
        dtypes = [a.dtype for a in current]
        base = _as_tensors(current, dtypes)
        tensors = [_as_tensors(c, dtypes) for c in clients]
        norms = update_norms(tensors, base).tolist()
        for k, ((_, res), client, norm) in enumerate(zip(results, tensors, norms)):
            if norm == 0.0:
                raise ZeroDivisionError(
                    f"{type(self).__name__}: client {k} sent the global model back (update "
                    "norm 0); Flower's clipping factor clipping_norm / norm divides by zero")
            factor = min(1, clip_norm / norm)
            clipped = aggregate([client], [float(factor)], base=base)
            log(INFO, "aggregate_fit: parameters are clipped by value: %.4f.", clip_norm)
            res.parameters = ndarrays_to_parameters([t.numpy() for t in clipped])
        return norms

    def _clip_results_flower(self, results: FitResults, clip_norm: float) -> list[float]:
        norms = []
        for _, res in results:
            param = parameters_to_ndarrays(res.parameters)
            norms.append(get_norm([np.subtract(x, y) for x, y in
                                   zip(param, self.current_round_params, strict=True)]))
            compute_clip_model_update(param, self.current_round_params, clip_norm)
            log(INFO, "aggregate_fit: parameters are clipped by value: %.4f.", clip_norm)
            res.parameters = ndarrays_to_parameters(param)
        return norms

    def _add_noise(self, parameters: Parameters) -> Parameters:
        stdv = compute_stdv(self.noise_multiplier, self.clipping_norm, self.num_sampled_clients)
        arrays = parameters_to_ndarrays(parameters)
        for t, a in enumerate(arrays):
            if a.dtype in _FUSED_FLOAT_DTYPES:
                x = torch.from_numpy(a if a.flags.c_contiguous else a.copy())
                arrays[t] = sgld_step(x, torch.zeros_like(x), step_size=0.0, noise_std=stdv,
                                      generator=self.generator).numpy()
            else:
                add_gaussian_noise_inplace([a], stdv)
        log(INFO, "aggregate_fit: central DP noise with %.4f stdev added", stdv)
        return ndarrays_to_parameters(arrays)

    def _check_count(self, results: FitResults) -> None:
        if len(results) != self.num_sampled_clients:
            log(WARNING, CLIENTS_DISCREPANCY_WARNING, len(results), self.num_sampled_clients)


class DifferentialPrivacyServerSideFixedClipping(
        _LegacyDP, _flower.DifferentialPrivacyServerSideFixedClipping):
    r"""Flower's legacy ``DifferentialPrivacyServerSideFixedClipping``: the clients'
    updates clipped to ``clipping_norm`` C by fedkernels, the wrapped strategy's
    ``aggregate_fit``, then :math:`\mathcal N(0, (\sigma C/m)^2)` from fedkernels' Philox
    stream. Extra keyword argument: ``generator`` (a ``torch.Generator``)."""

    def __init__(self, strategy: Any, noise_multiplier: float, clipping_norm: float,
                 num_sampled_clients: int, *, generator: torch.Generator | None = None
                 ) -> None:
        super().__init__(strategy, noise_multiplier, clipping_norm, num_sampled_clients)
        self.generator = generator

    def aggregate_fit(self, server_round: int, results: FitResults, failures: Failures
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        if failures:
            return None, {}
        self._check_count(results)
        self._clip_results(results, self.clipping_norm)
        parameters, metrics = self.strategy.aggregate_fit(server_round, results, failures)
        if parameters:
            parameters = self._add_noise(parameters)
        return parameters, metrics


class DifferentialPrivacyServerSideAdaptiveClipping(
        _LegacyDP, _flower.DifferentialPrivacyServerSideAdaptiveClipping):
    r"""Flower's legacy ``DifferentialPrivacyServerSideAdaptiveClipping``: the clip as in
    :class:`DifferentialPrivacyServerSideFixedClipping`, then the clip norm moved by
    :func:`fedkernels.privacy.adaptive_clip_norm` (before the aggregate's noise, whose
    standard deviation uses the new C, as in Flower). Extra keyword argument: ``generator``
    (a CPU ``torch.Generator``, for both noises)."""

    def __init__(self, strategy: Any, noise_multiplier: float, num_sampled_clients: int,
                 initial_clipping_norm: float = 0.1, target_clipped_quantile: float = 0.5,
                 clip_norm_lr: float = 0.2, clipped_count_stddev: float | None = None, *,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(strategy, noise_multiplier, num_sampled_clients,
                         initial_clipping_norm, target_clipped_quantile, clip_norm_lr,
                         clipped_count_stddev)
        self.generator = generator

    def aggregate_fit(self, server_round: int, results: FitResults, failures: Failures
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        if failures:
            return None, {}
        self._check_count(results)
        norms = self._clip_results(results, self.clipping_norm)
        if not results:  # Flower divides the noisy count by len(results)
            raise ZeroDivisionError("float division by zero")
        # A NaN norm is never "clipped" in Flower (min(1, C / nan) is 1): count it as 0.
        self.clipping_norm = adaptive_clip_norm(
            self.clipping_norm, [0.0 if math.isnan(n) else n for n in norms],
            target_quantile=self.target_clipped_quantile, clip_norm_lr=self.clip_norm_lr,
            clipped_count_stddev=self.clipped_count_stddev, generator=self.generator)
        parameters, metrics = self.strategy.aggregate_fit(server_round, results, failures)
        if parameters:
            parameters = self._add_noise(parameters)
        return parameters, metrics
