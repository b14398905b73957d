r"""Flower's legacy server-side central-DP wrappers (``flwr.server.strategy``) with fedkernels
arithmetic.

Each class subclasses Flower's legacy class of the same name and replaces only the O(K·P)
arithmetic of ``aggregate_fit``; constructor arguments, attributes, the wrapped strategy, the
log lines and the errors are Flower's::

    from flwr.server.strategy import DifferentialPrivacyServerSideFixedClipping      # before
    from fedkernels.integrations.flower.legacy_central_dp import (                     # after
        DifferentialPrivacyServerSideFixedClipping)

=========================================  =====================================================
:class:`DifferentialPrivacyServerSide\     every client's update clipped by fedkernels (norms
FixedClipping`                             from :func:`fedkernels.privacy.update_norms`), the
                                           wrapped strategy's aggregate (the fused mean with
                                           :class:`~fedkernels.integrations.flower.legacy.FedAvg`),
                                           noise from fedkernels' Philox stream
:class:`DifferentialPrivacyServerSide\     the same, with the clip norm moved by
AdaptiveClipping`                          :func:`fedkernels.privacy.adaptive_clip_norm`
=========================================  =====================================================

Differences from Flower are those of :mod:`fedkernels.integrations.flower.central_dp`: noise
from a ``torch.Generator`` (``generator=``) instead of NumPy's global generator, 0-d arrays
clipped with the rest (Flower leaves them unclipped), and a zero update raises
``ZeroDivisionError`` with a message naming the client, as Flower's does without one.
Parameters that do not line up with the global model's, and dtypes other than float16/32/64,
go through Flower's own NumPy code.
"""

from __future__ import annotations

import math
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.common import Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import log
from flwr.server import strategy as _flower
from flwr.supercore.differential_privacy import (
    CLIENTS_DISCREPANCY_WARNING,
    add_gaussian_noise_inplace,
    compute_clip_model_update,
    compute_stdv,
    get_norm,
)

from fedkernels.aggregate import aggregate
from fedkernels.integrations.flower.legacy import Failures, FitResults, parameters_to_arrays
from fedkernels.integrations.flower.records import FUSED_FLOAT_DTYPES, as_tensors
from fedkernels.ops.concurrency import one_call_at_a_time
from fedkernels.ops.sgld import sgld_step
from fedkernels.privacy.mechanism import adaptive_clip_norm, update_norms

__all__ = ["DifferentialPrivacyServerSideAdaptiveClipping",
           "DifferentialPrivacyServerSideFixedClipping"]


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
                                           and a.dtype in FUSED_FLOAT_DTYPES
                                           and a.shape == g.shape for a, g in zip(c, current))
            for c in clients)
        if not ok:
            return self._clip_results_flower(results, clip_norm)
        dtypes = [a.dtype for a in current]
        base = as_tensors(current, dtypes)
        tensors = [as_tensors(c, dtypes) for c in clients]
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
            if a.dtype in FUSED_FLOAT_DTYPES:
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

    @one_call_at_a_time()
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

    @one_call_at_a_time()
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
