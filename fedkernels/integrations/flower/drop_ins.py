r"""Drop-ins for Flower's Message-API strategies (``flwr.serverapp.strategy``, the API Flower
recommends since 1.21) that aggregate with :func:`fedkernels.aggregate.aggregate`.

:class:`FedAvg`, :class:`FedProx`, :class:`FedAvgM`, :class:`FedAdam`,
:class:`FedYogi`, :class:`FedAdagrad` and :class:`QFedAvg` subclass Flower's class of the same
name (``isinstance(FedAdam(), flwr.serverapp.strategy.FedAdam)`` holds) and override only the
arithmetic of ``aggregate_train``: the weighted sum over the K replies is one fused
``weighted_sum`` pass over zero-copy views of the replies' bytes, instead of Flower's per-reply
``np.load`` copy, multiply and add. Constructor arguments, public attributes
(``current_arrays``, ``m_t``, ``v_t``, ``momentum_vector``, ``server_opt``, ...), attributes
changed after construction, output dtypes, exceptions (``AggregationError``,
``InconsistentMessageReplies``, ``ZeroDivisionError``) and side effects are Flower's. The
result is written straight into the bytes of the outgoing ``Array`` objects (no copy of it into
a second buffer); FedAdam, FedYogi and FedAdagrad run Flower's moment updates and step chunk by
chunk in one pass, with Flower's output dtypes. Replace the import and nothing else::

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
rejects replies that carry NaN/Inf. The robust strategies (``FedMedian``, ``FedTrimmedAvg``,
``Krum``, ...) are in :mod:`fedkernels.integrations.flower.robust`, the central-DP wrappers in
:mod:`fedkernels.integrations.flower.central_dp`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp import strategy as _flwr
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy.qfedavg import get_train_loss as _flwr_train_loss
from torch import Tensor

from fedkernels.aggregate import aggregate
from fedkernels.integrations.flower.records import (
    FUSED_FLOAT_DTYPES,
    array_with_buffer,
    as_tensors,
    ndarray_to_array,
    ndarray_view,
    to_tensor,
)
from fedkernels.integrations.flower.weighted_mean import (
    check_int_policy,
    fused_weighted_mean,
    int_policy_entry,
    weights_from_records,
)
from fedkernels.ops import summation
from fedkernels.ops.concurrency import one_call_at_a_time
from fedkernels.privacy.mechanism import update_norms

__all__ = ["FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedProx", "FedYogi", "QFedAvg"]

# ---------------------------------------------------------------- Flower drop-ins
#
# Each class below subclasses Flower's Message-API strategy of the same name and replaces only
# the O(K·P) part of aggregate_train, the weighted sum over the K replies, by the fused op.
# Everything else is Flower's: constructor, attributes (current_arrays, m_t, v_t,
# momentum_vector, server_opt, ...), configure_train/evaluate, start(), exceptions, and the
# O(P) server-optimizer formulas: the FedOpt family runs them chunk by chunk where NumPy's
# dtypes allow, and as Flower writes them (NumPy on the averaged arrays) elsewhere, so that
# output dtypes and odd cases (0-d arrays, mixed dtypes, broadcasting) match.
# Hyperparameters are read from the instance at every aggregation, as Flower does.


class _FusedAggregation:
    """What the drop-ins share: the fedkernels arguments and the fused mean of the replies."""

    int_policy: str = "mean"
    check_finite: bool = False

    def _fused_mean(self, replies: Iterable[Message], base: Mapping[str, np.ndarray] | None
                    = None, as_arrays: bool = False
                    ) -> tuple[list[Any] | None, dict[str, Any] | None, set[str]]:
        """Flower's reply checks and weights, then :func:`fused_weighted_mean`. Returns the
        valid replies' contents (None if there are none), the means (ndarrays, or Flower
        Arrays with ``as_arrays``) and the resolved integer entries."""
        policy = check_int_policy(type(self).__name__, self.int_policy)
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None, set()
        contents = [m.content for m in valid]
        factors = weights_from_records(contents, self.weighted_by_key)
        records = [next(iter(c.array_records.values())) for c in contents]
        means, resolved = fused_weighted_mean(records, factors, int_policy=policy,
                                              check_finite=bool(self.check_finite), base=base,
                                              as_arrays=as_arrays)
        return contents, means, resolved


def _drop_in(flower_cls: type) -> Callable[[type], type]:
    """Gives a drop-in class Flower's constructor (same arguments, positional ones included)
    plus the keyword-only ``int_policy`` and ``check_finite``, with a matching signature."""

    def decorate(cls: type) -> type:
        def __init__(self, *args: Any, int_policy: str = "mean", check_finite: bool = False,
                     **kwargs: Any) -> None:
            check_int_policy(cls.__name__, int_policy)
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
    @one_call_at_a_time()
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's ``FedAvg.aggregate_train`` with the fused weighted mean, written straight
        into the outgoing record's bytes."""
        contents, means, _ = self._fused_mean(replies, as_arrays=True)
        if contents is None:
            return None, None
        arrays = ArrayRecord(means)
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return arrays, metrics


def averages_like_fedavg(strategy: Any) -> bool:
    """Whether ``strategy``'s aggregate_train is FedAvg's weighted mean (Flower's, or the fused
    drop-in with Flower's integer rule): a DP wrapper then clips, averages and noises in one op."""
    method = type(strategy).aggregate_train
    if method is _flwr.FedAvg.aggregate_train:
        return True
    return (method is _FusedFedAvgTrain.aggregate_train
            and getattr(strategy, "int_policy", None) == "mean"
            and not getattr(strategy, "check_finite", False))


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

    @one_call_at_a_time()
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        current = None
        if self.server_opt and self.current_arrays is not None:
            current = [ndarray_view(v) for v in self.current_arrays.values()]
        base = None if current is None else dict(zip(self.current_arrays.keys(), current))
        # Without the server step the mean is the result: written into the outgoing bytes.
        contents, means, resolved = self._fused_mean(replies, base=base,
                                                     as_arrays=not self.server_opt)
        if contents is None:
            return None, None
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        if not self.server_opt:
            return ArrayRecord(means), metrics
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
        prevs = [None if not use_momentum or previous is None else previous[i]
                 for i in range(len(names))]
        fused = self._fused_steps(names, current, means, prevs, resolved, use_momentum)
        for i, (name, old) in enumerate(zip(names, current)):
            new = means.pop(name)  # array by array: one model of temporaries at most
            if name in fused:
                m, arrays[name] = fused.pop(name)
                if use_momentum:
                    momentum.append(m)
                continue
            g = np.zeros(new.shape) if name in resolved else old - new
            if use_momentum:
                g = g if prevs[i] is None else self.server_momentum * prevs[i] + g
                momentum.append(g)
            arrays[name] = ndarray_to_array(
                new if name in resolved else old - self.server_learning_rate * g)
        record = ArrayRecord(arrays)
        # State changes only now, with every check passed and every value computed.
        if use_momentum:
            self.momentum_vector = momentum
        self.current_arrays = record
        return record, metrics

    def _fused_steps(self, names: list[str], current: list[np.ndarray],
                     means: dict[str, np.ndarray], prevs: list[np.ndarray | None],
                     resolved: set[str], use_momentum: bool
                     ) -> dict[str, tuple[np.ndarray | None, Array]]:
        r"""Flower's step for every array it can take, as two fused passes over the whole
        model: :math:`g = (x_t - \bar x) + \mu m` (Flower's ``mu * m + g``, the same
        roundings), then :math:`x_t - \eta g` written straight into the outgoing ``Array``'s
        bytes. Returns name -> (momentum or None, Array); arrays where NumPy's dtypes would
        differ (NumPy-float hyperparameters, float16, 0-d, mixed dtypes) are left out, and the
        caller runs Flower's formulas on them."""
        mu, lr = self.server_momentum, self.server_learning_rate
        if not all(type(p) in (float, int) for p in (mu, lr)):
            return {}
        chosen = []
        for name, old, prev in zip(names, current, prevs):
            mean = means[name]
            if name in resolved or old.ndim == 0 or old.size == 0 \
                    or old.dtype not in _STEP_DTYPES:
                continue
            operands = (mean,) if prev is None else (mean, prev)
            if any(a.shape != old.shape or a.dtype != old.dtype for a in operands):
                continue
            # Flower's formulas on empty slices: the dtypes NumPy gives its results.
            e_old = old.reshape(-1)[:0]
            g0 = e_old - mean.reshape(-1)[:0]
            m0 = g0 if prev is None else mu * prev.reshape(-1)[:0] + g0
            if m0.dtype != old.dtype or (e_old - lr * m0).dtype != old.dtype:
                continue
            target = array_with_buffer(old.dtype, old.shape)
            if target is not None:
                chosen.append((name, old, mean, prev, target))
        out = {}
        for with_prev in (False, True):  # the first round's momentum has no previous term
            group = [c for c in chosen if (c[3] is not None) == with_prev]
            if not group:
                continue
            olds = as_tensors([c[1] for c in group], [c[1].dtype for c in group])
            terms = olds + as_tensors([c[2] for c in group], [c[1].dtype for c in group])
            coefficients = [1.0, -1.0]
            if with_prev:
                terms += as_tensors([c[3] for c in group], [c[1].dtype for c in group])
                coefficients.append(float(mu))
            g = summation.weighted_sum(terms, torch.tensor(coefficients, dtype=torch.float64,
                                                           device="cpu"))
            summation.weighted_sum_out(olds + g, torch.tensor([1.0, -float(lr)],
                                                              dtype=torch.float64, device="cpu"),
                                       (), 1.0, False, [c[4][1] for c in group])
            for c, m in zip(group, g):
                out[c[0]] = (m.numpy() if use_momentum else None, c[4][0])
        return out


class _FusedFedOpt(_FusedAggregation):
    r"""FedOpt's ``aggregate_train`` (Reddi et al. 2021) on the fused mean :math:`\bar x`:
    :math:`\Delta = \bar x - x_t`, :math:`m \leftarrow \beta_1 m + (1-\beta_1)\Delta`,
    :math:`v` by the subclass's rule, :math:`x_{t+1} = x_t + \eta_t m / (\sqrt v + \tau)`."""

    def _second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _step_size(self, server_round: int) -> float:
        return self.eta

    @one_call_at_a_time()
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        current = self.current_arrays
        if current is not None:
            current = {k: ndarray_view(v) for k, v in current.items()}
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
        scratch: dict[np.dtype, Tensor] = {}  # the chunked step's temporaries, per dtype
        m_new, v_new, arrays = {}, {}, {}
        for k, x in current.items():  # array by array: one model of temporaries at most
            mean = means.pop(k)
            if k in resolved:
                m_new[k], v_new[k], out = m_prev[k], v_prev[k], mean
            elif (fused := self._fused_step(x, mean, m_prev[k], v_prev[k], step, scratch)
                  ) is not None:
                m_new[k], v_new[k], arrays[k] = fused
                continue
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

    def _second_moment_chunk(self, v: Tensor, delta: Tensor, out: Tensor, tmp: Tensor,
                             tmp2: Tensor) -> None:
        """:meth:`_second_moment` on one chunk of tensors, into ``out`` (``tmp`` and ``tmp2``
        are scratch of the chunk's size)."""
        raise NotImplementedError

    def _fused_step(self, x: np.ndarray, mean: np.ndarray, m: np.ndarray, v: np.ndarray,
                    step: Any, scratch: dict[np.dtype, Tensor]
                    ) -> tuple[np.ndarray, np.ndarray, Array] | None:
        """Flower's moment updates and step for one array in one pass over memory: the
        formulas run on cache-sized chunks (each chunk's delta, moments and step while it is
        in cache, temporaries in ``scratch``), the new point written straight into the
        outgoing ``Array``'s bytes and the new second moment into the mean's memory. None
        where this would not give Flower's dtypes (the caller then runs Flower's NumPy
        formulas). Values equal Flower's to rounding (the step divides before it scales)."""
        if x.ndim == 0 or x.size == 0 or x.dtype not in _STEP_DTYPES:
            return None
        if any(a.shape != x.shape or a.dtype != x.dtype for a in (mean, m, v)):
            return None
        params = (self.beta_1, self.tau) + self._moment_params()
        if not all(type(p) in (float, int) for p in params) \
                or not isinstance(step, (float, int, np.floating)):
            return None
        # Flower's formulas on empty slices: the dtypes NumPy gives its results.
        ex, emean, em, ev = (a.reshape(-1)[:0] for a in (x, mean, m, v))
        d0 = emean - ex
        m0 = self.beta_1 * em + (1 - self.beta_1) * d0
        v0 = self._second_moment(ev, d0)
        o0 = ex + step * m0 / (np.sqrt(v0) + self.tau)
        if m0.dtype != x.dtype or v0.dtype != x.dtype or o0.dtype not in _STEP_DTYPES:
            return None
        # The mean is this call's own result: the new second moment may take its place.
        reuse = mean.flags.writeable and mean.flags.c_contiguous and not any(
            np.may_share_memory(mean, a) for a in (x, m, v))
        m_out = np.empty(x.shape, x.dtype)
        v_out = mean if reuse else np.empty(x.shape, x.dtype)
        target = array_with_buffer(o0.dtype, x.shape)
        if target is None:
            point = np.empty(x.shape, o0.dtype)
            t_out = torch.from_numpy(point).reshape(-1)
        else:
            t_out = target[1].reshape(-1)
        tx, tmean, tm, tv = (t.reshape(-1) for t in as_tensors([x, mean, m, v], [x.dtype] * 4))
        t_m, t_v = torch.from_numpy(m_out).reshape(-1), torch.from_numpy(v_out).reshape(-1)
        if x.dtype not in scratch:  # pages are touched only as far as chunks reach
            scratch[x.dtype] = torch.empty(3, _STEP_CHUNK, dtype=tx.dtype)
        work = scratch[x.dtype]
        beta_1, tau, step = float(self.beta_1), float(self.tau), float(step)
        for start in range(0, x.size, _STEP_CHUNK):
            part = slice(start, start + _STEP_CHUNK)
            n = min(_STEP_CHUNK, x.size - start)
            delta, tmp, tmp2 = work[0, :n], work[1, :n], work[2, :n]
            torch.sub(tmean[part], tx[part], out=delta)  # before the mean's memory is reused
            mc, vc = t_m[part], t_v[part]
            torch.mul(tm[part], beta_1, out=mc).add_(torch.mul(delta, 1 - beta_1, out=tmp))
            self._second_moment_chunk(tv[part], delta, vc, tmp, tmp2)
            # x + step * (m / (sqrt(v) + tau)), in the output's dtype
            quotient = torch.div(mc, torch.sqrt(vc, out=tmp2).add_(tau), out=tmp2)
            t_out[part].copy_(tx[part]).add_(quotient, alpha=step)
        if target is None:
            return m_out, v_out, ndarray_to_array(point)
        return m_out, v_out, target[0]

    def _moment_params(self) -> tuple[Any, ...]:
        return ()


# What the chunked server step takes, and its chunk: 256 Ki values, a few MB of operands,
# large enough that torch's per-call cost is small and its threads split each chunk.
_STEP_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_STEP_CHUNK = 1 << 18


@_drop_in(_flwr.FedAdam)
class FedAdam(_FusedFedOpt, _flwr.FedAdam):
    __doc__ = (r"""Flower's ``FedAdam``: :math:`v \leftarrow \beta_2 v + (1-\beta_2)\Delta^2`
    and the bias-corrected step
    :math:`\eta_t = \eta\sqrt{1-\beta_2^{t+1}}/(1-\beta_1^{t+1})` (a NumPy float64, so
    float32 models come back as float64, as from Flower).""" + _DROP_IN_DOC)

    def _second_moment(self, v, delta):
        return self.beta_2 * v + (1 - self.beta_2) * (delta ** 2)

    def _second_moment_chunk(self, v, delta, out, tmp, tmp2):
        torch.mul(delta, delta, out=tmp).mul_(1 - self.beta_2)
        torch.mul(v, self.beta_2, out=out).add_(tmp)

    def _moment_params(self):
        return (self.beta_2,)

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

    def _second_moment_chunk(self, v, delta, out, tmp, tmp2):
        sq = torch.mul(delta, delta, out=tmp)
        direction = torch.sub(v, sq, out=tmp2).sign_()
        torch.sub(v, sq.mul_(1.0 - self.beta_2).mul_(direction), out=out)

    def _moment_params(self):
        return (self.beta_2,)


@_drop_in(_flwr.FedAdagrad)
class FedAdagrad(_FusedFedOpt, _flwr.FedAdagrad):
    __doc__ = (r"""Flower's ``FedAdagrad``: :math:`v \leftarrow v + \Delta^2`
    (:math:`\beta_1 = 0`, so :math:`m = \Delta`).""" + _DROP_IN_DOC)

    def _second_moment(self, v, delta):
        return v + delta ** 2

    def _second_moment_chunk(self, v, delta, out, tmp, tmp2):
        torch.add(v, torch.mul(delta, delta, out=tmp), out=out)


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

    @one_call_at_a_time()
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        policy = check_int_policy(type(self).__name__, self.int_policy)
        valid, failed = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        lipschitz = 1.0 / self.client_learning_rate
        if self.current_arrays is None:
            raise AggregationError(  # Flower's words (its missing space included)
                "Current global model weights are not available. Make sure to call"
                "`configure_train` before calling `aggregate_train`.")
        names = list(self.current_arrays.keys())
        global_arrays = [ndarray_view(v) for v in self.current_arrays.values()]
        records = [next(iter(m.content.array_records.values())) for m in valid]
        local = [[ndarray_view(v) for v in r.values()] for r in records]
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
        base = {names[t]: to_tensor(global_arrays[t], dtypes[t]) for t in floats}
        clients = [{names[t]: to_tensor(x[t], dtypes[t]) for t in floats} for x in local]
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
                out = int_policy_entry(name, [x[t] for x in local], global_arrays[t], policy)
            else:
                dtype = np.result_type(global_arrays[t].dtype, dtypes[t], np.float64)
                value = result.pop(name)
                # Flower's float64 result, converted straight into the outgoing bytes (by
                # NumPy, one thread: PyTorch's copy_ is a parallel region per tensor, many
                # times slower on a machine busy with other work)
                target = array_with_buffer(dtype, tuple(value.shape))
                if target is not None:
                    np.copyto(target[1].numpy(), value.numpy())
                    arrays[name] = target[0]
                    continue
                out = value.numpy().astype(dtype, copy=False)
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
            if any(a.dtype not in FUSED_FLOAT_DTYPES for a in column):
                return True
            # Flower computes a float16 reply's gradient, its squared norm (a float16 sum,
            # Inf past 65504, which makes every coefficient 0) and the weighted sum in
            # float16, and adds the result to the global model in float64; ours would round
            # the model to float16 and never overflow. (Integer arrays kept by int_policy,
            # which Flower's code cannot take, keep the fused path.)
            if not kept_ints and any(a.dtype == np.float16 for a in column):
                return True
            if g.dtype.kind not in "biuf" or (g.dtype.kind == "f" and g.dtype not in
                                              FUSED_FLOAT_DTYPES):
                return True
        return False
