r"""Flower's server-side central-DP wrappers for the Message API (``flwr.serverapp.strategy``)
with fedkernels arithmetic.

Each class subclasses Flower's class of the same name and replaces only the O(K·P) part of
``aggregate_train``; the constructor, attributes, ``configure_*``, ``summary``, the log lines,
the exceptions and the wrapped strategy are Flower's. Swap the import::

    from fedkernels.integrations.flower.central_dp import (   # was: flwr.serverapp.strategy
        DifferentialPrivacyServerSideFixedClipping)

=====================================  ===========================================================
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
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.common.logger import log as flwr_log
from flwr.serverapp import strategy as _flwr
from flwr.serverapp.strategy import dp_adaptive_clipping as _flwr_dp_adaptive
from flwr.serverapp.strategy import dp_fixed_clipping as _flwr_dp_fixed
from flwr.supercore.differential_privacy import (
    add_gaussian_noise_inplace,
    compute_clip_model_update,
    compute_stdv,
    get_norm,
)
from torch import Tensor

from fedkernels.aggregate import aggregate
from fedkernels.integrations.flower.drop_ins import averages_like_fedavg
from fedkernels.integrations.flower.records import (
    FUSED_FLOAT_DTYPES,
    as_tensors,
    ndarray_to_array,
    ndarray_view,
)
from fedkernels.integrations.flower.weighted_mean import weights_from_records
from fedkernels.ops.concurrency import one_call_at_a_time
from fedkernels.ops.sgld import sgld_step
from fedkernels.privacy.mechanism import adaptive_clip_norm, private_aggregate, update_norms

__all__ = ["DifferentialPrivacyServerSideAdaptiveClipping",
           "DifferentialPrivacyServerSideFixedClipping"]


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
        current = [ndarray_view(v) for v in self.current_arrays.values()]
        if any(a.dtype not in FUSED_FLOAT_DTYPES for a in current):
            return None
        dtypes = [a.dtype for a in current]
        clients = []
        for m in replies:
            records = list(m.content.array_records.values())
            if len(records) != 1 or list(records[0].keys()) != names:
                return None
            arrays = [ndarray_view(v) for v in records[0].values()]
            if any(a.dtype != g.dtype or a.shape != g.shape for a, g in zip(arrays, current)):
                return None
            clients.append(as_tensors(arrays, dtypes))
        return names, as_tensors(current, dtypes), clients

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
                if a.dtype in FUSED_FLOAT_DTYPES:
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
        if not averages_like_fedavg(self.strategy):
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
        factors = weights_from_records(contents, inner.weighted_by_key)
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
        fused_fedavg = (accountant is not None and averages_like_fedavg(strategy)
                        and type(strategy).aggregate_train is not _flwr.FedAvg.aggregate_train)
        # Flower's accountant check asks for FedAvg.aggregate_train itself; the fused FedAvg
        # computes the same mean, so Flower's checks run on a stand-in FedAvg.
        checked = _flwr.FedAvg(weighted_by_key=strategy.weighted_by_key) if fused_fedavg \
            else strategy
        super().__init__(checked, noise_multiplier, clipping_norm, num_sampled_clients,
                         accountant=accountant)
        self.strategy = strategy
        self.generator = generator

    @one_call_at_a_time()
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

    @one_call_at_a_time()
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
