r"""Flower's legacy strategies (``flwr.server.strategy``) with the fused aggregation
(``pip install 'fedkernels[flower]'``).

Each class subclasses Flower's legacy class of the same name and replaces only the weighted
average of the clients' models, :math:`\bar x = \sum_k n_k x_k / \sum_k n_k`, by one pass of
:func:`fedkernels.aggregate` over zero-copy views of the ``FitRes`` bytes (Flower
deserializes every array with ``np.load``, then multiplies, sums and divides in NumPy, one
temporary array per step). Everything else is Flower's own code or behaves exactly like it:
constructor arguments and defaults, sampling, configuration, evaluation, ``accept_failures``,
``inplace``, ``fit_metrics_aggregation_fn`` and the warnings Flower logs, the server optimizer
state (FedOpt's ``current_weights``, ``m_t``, ``v_t``; FedAvgM's ``momentum_vector`` and
``initial_parameters``; QFedAvg's ``pre_weights``) and hyperparameters changed on the
instance between rounds. Swap the import and nothing else::

    from flwr.server.strategy import FedAdam                            # before
    from fedkernels.integrations.flower.legacy import FedAdam           # after

=======================  ==================================================================
:class:`FedAvg`          the mean through :func:`aggregate_inplace` (``inplace=True``,
                         Flower's default) or :func:`aggregate_ndarrays`
:class:`FedProx`,        Flower's classes on top of our :class:`FedAvg`: their server step
:class:`FedAdam`,        runs on the fused mean
:class:`FedYogi`,
:class:`FedAdagrad`
:class:`FedAvgM`         the fused mean, then Flower's server step and momentum
:class:`QFedAvg`         :math:`x_{t+1} = x_t + c\sum_k (x_k - x_t)` with q-FFL's
                         :math:`c = (f+10^{-10})^q / (\eta H)`, one fused pass in delta mode;
                         the norms :math:`\|x_t - x_k\|^2` of Flower's Lipschitz estimate
                         :math:`H` come from one fused read pass per client
=======================  ==================================================================

The results equal Flower's in dtype, shape and value up to rounding in the arrays' precision
(float32 models: fp32 rounding). The documented differences, all in corner cases:

- float16 arrays accumulate in fp32, so no overflow where Flower's float16 product
  :math:`n_k x_k` passes 65504 (Flower returns Inf there).
- On the fused path NumPy's arithmetic warnings inside the sum (``inf - inf``, ``inf * 0``,
  overflow) are not raised; the values (NaN, Inf) are Flower's. Inputs the fused op does not
  take (integer, bool, or complex arrays, shapes that only broadcast, non-array objects, a total
  of zero examples) go through Flower's NumPy formula with NumPy's warnings and errors.
- QFedAvg returns float64 as Flower does, but the sum is computed in the models' own precision
  (fp32 for fp32 models) where Flower promotes everything to float64. float16 models (float16
  gradients, whose float16 norm Flower lets overflow) run Flower's own code.
- Results are C-ordered; Flower keeps the Fortran order of Fortran-ordered inputs.
"""

from __future__ import annotations

import io
import math
import numbers
import sys
from collections.abc import Sequence
from functools import reduce
from logging import WARNING

import numpy as np
import torch
from flwr.common import (
    FitRes,
    NDArrays,
    Parameters,
    Scalar,
    bytes_to_ndarray,
    ndarrays_to_parameters,
)
from flwr.common.logger import log
from flwr.server import strategy as _flower
from flwr.server.client_proxy import ClientProxy

from fedkernels.aggregate import aggregate
from fedkernels.integrations.adapters import ndarrays_to_tensors
from fedkernels.ops.concurrency import one_call_at_a_time
from fedkernels.ops.mixing import superfed_stats

__all__ = [
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedProx",
    "FedYogi",
    "QFedAvg",
    "aggregate_inplace",
    "aggregate_ndarrays",
    "parameters_to_arrays",
]

_TORCH_DTYPES = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}

# Flower's QFedAvg without a loss reads an unset local from inside a comprehension: a free
# variable (NameError) before Python 3.12, an inlined local (UnboundLocalError) since.
_MISSING_LOSS = UnboundLocalError if sys.version_info >= (3, 12) else NameError

FitResults = Sequence[tuple[ClientProxy, FitRes]]
Failures = Sequence[tuple[ClientProxy, FitRes] | BaseException]


# ---------------------------------------------------------------- FitRes bytes


def _npy_view(data: bytes) -> np.ndarray:
    """One ``.npy`` payload as a read-only array over its bytes; anything this does not parse
    (another format version, object arrays, truncated data) goes to Flower's own loader, so it
    fails or succeeds exactly as Flower does."""
    try:
        stream = io.BytesIO(data)
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            return bytes_to_ndarray(data)
    except (ValueError, TypeError):
        return bytes_to_ndarray(data)
    count = math.prod(shape)
    offset = stream.tell()
    if dtype.hasobject or len(data) - offset < count * dtype.itemsize:
        return bytes_to_ndarray(data)
    if count == 0:
        return np.empty(shape, dtype)
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def parameters_to_arrays(parameters: Parameters) -> list[np.ndarray]:
    """Flower ``Parameters`` as NumPy arrays, like ``flwr.common.parameters_to_ndarrays`` but
    read-only views of the serialized bytes instead of ``np.load`` copies."""
    return [_npy_view(t) for t in parameters.tensors]


# ---------------------------------------------------------------- the weighted mean


def _fusable(column: Sequence) -> bool:
    """One layer of every client: plain float16/32/64 arrays of one shape (what the fused op
    takes; masked arrays and other subclasses keep their NumPy semantics)."""
    first = column[0]
    return all(type(a) is np.ndarray and a.dtype in _TORCH_DTYPES and a.shape == first.shape
               for a in column)


def _real_and_finite(values: Sequence) -> bool:
    return all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
               for v in values)


def _check_layer_counts(clients: Sequence[Sequence], where: str) -> None:
    for k, arrays in enumerate(clients):
        if len(arrays) != len(clients[0]):
            raise ValueError(f"{where}: client {k} has {len(arrays)} arrays, client 0 has "
                             f"{len(clients[0])}")


def _fused_weighted_sum(clients: Sequence[Sequence[np.ndarray]], layers: Sequence[int],
                        weights: Sequence[float], dtypes: Sequence[np.dtype],
                        scale: float = 1.0) -> list[np.ndarray]:
    r""":math:`\mathrm{scale}\sum_k w_k x_k^{(l)}` for the ``layers``, one fused pass over all
    of them; each client's layer is read in place (cast first only where its dtype is not
    ``dtypes[l]``)."""
    targets = [_TORCH_DTYPES[np.dtype(d).newbyteorder("=")] for d in dtypes]
    tensors = []
    for arrays in clients:
        views = ndarrays_to_tensors([arrays[l] for l in layers])
        tensors.append([t if t.dtype == d else t.to(d) for t, d in zip(views, targets)])
    sums = aggregate(tensors, torch.tensor(np.asarray(weights, dtype=np.float64), device="cpu"),
                     scale=scale)
    return [s.numpy().astype(d, copy=False) for s, d in zip(sums, dtypes)]


def aggregate_ndarrays(results: Sequence[tuple[NDArrays, int]]) -> NDArrays:
    r"""Drop-in for ``flwr.server.strategy.aggregate.aggregate``:
    :math:`\bar x^{(l)} = \sum_k n_k x_k^{(l)} / \sum_k n_k` for every layer l of
    ``[(arrays, num_examples), ...]``.

    The result has Flower's dtype per layer (NumPy's promotion of ``x * n`` summed and divided
    by the total: float32 stays float32, float32 with float64 gives float64, integer and bool
    arrays give their float64 mean) and Flower's type (a 0-d layer comes back as a NumPy
    scalar). Float layers of one shape are combined by one fused pass (fp32 accumulation for
    float16); every other input, and a total of zero examples (NaN, with NumPy's warnings),
    follows Flower's NumPy formula. No results give ``[]``; clients with different numbers of
    arrays raise ``ValueError``.
    """
    results = list(results)
    counts = [n for _, n in results]
    total = sum(counts)
    clients = [list(arrays) for arrays, _ in results]
    if not clients:
        return []
    _check_layer_counts(clients, "aggregate_ndarrays")
    num_layers = len(clients[0])
    fused = []
    if _real_and_finite(counts) and _real_and_finite([total]) and total != 0:
        fused = [l for l in range(num_layers) if _fusable([c[l] for c in clients])]
    out: list = [None] * num_layers
    if fused:
        mean_dtype: dict[tuple, np.dtype] = {}
        dtypes = []
        for l in fused:
            key = tuple(c[l].dtype for c in clients)
            if key not in mean_dtype:  # NumPy's own promotion, asked on empty arrays
                parts = [np.empty(0, d) * n for d, n in zip(key, counts)]
                mean_dtype[key] = (reduce(np.add, parts) / total).dtype
            dtypes.append(mean_dtype[key])
        # float32/float64: sum n_k x_k, then Flower's own final division by the total (so
        # only the rounding inside the sum differs); float16: n_k x_k would overflow its
        # range, so the fp32 accumulator is scaled by 1/total instead.
        for half in (False, True):
            group = [i for i, d in enumerate(dtypes) if (d == np.float16) == half]
            if not group:
                continue
            sums = _fused_weighted_sum(clients, [fused[i] for i in group], counts,
                                       [dtypes[i] for i in group],
                                       scale=1.0 / total if half else 1.0)
            for i, s in zip(group, sums):
                if not half:
                    np.divide(s, total, out=s)
                out[fused[i]] = s[()] if s.ndim == 0 else s  # NumPy's scalars for 0-d arrays
    done = set(fused)
    for l in range(num_layers):
        if l not in done:
            out[l] = reduce(np.add, [c[l] * n for c, n in zip(clients, counts)]) / total
    return out


def _into(x: np.ndarray, y, ufunc: np.ufunc) -> np.ndarray:
    """``ufunc(x, y)`` written into ``x``; ``y`` is first cast to ``x``'s dtype where NumPy's
    same-kind rule forbids writing the result into ``x`` (so a float factor truncates to an
    integer for integer arrays, as in Flower's in-place average)."""
    if np.can_cast(y, x.dtype, casting="same_kind"):
        return ufunc(x, y, out=x)
    return ufunc(x, np.array(y, x.dtype), out=x)


def aggregate_inplace(results: FitResults) -> NDArrays:
    r"""Drop-in for ``flwr.server.strategy.aggregate.aggregate_inplace``: the mean
    :math:`\sum_k s_k x_k` with :math:`s_k = n_k / \sum_j n_j` of ``[(client, FitRes), ...]``.

    As in Flower every layer keeps client 0's dtype (a float64 client added to a float32
    client 0 gives float32), a 0-d layer stays a 0-d array, ``ZeroDivisionError`` when the
    examples sum to 0 and ``IndexError`` for no results. Float layers of one shape are one
    fused pass over views of the ``FitRes`` bytes (no ``np.load`` copies, nothing scaled in
    place); integer, bool and other layers follow Flower's in-place NumPy arithmetic, where
    the factors :math:`s_k` are cast to the layer's integer dtype (usually 0).
    """
    results = list(results)
    total = sum(fit_res.num_examples for _, fit_res in results)
    factors = np.asarray([fit_res.num_examples / total for _, fit_res in results])
    clients = [parameters_to_arrays(results[0][1].parameters)]
    clients += [parameters_to_arrays(fit_res.parameters) for _, fit_res in results[1:]]
    _check_layer_counts(clients, "aggregate_inplace")
    num_layers = len(clients[0])
    fused = []
    if factors.dtype.kind == "f" and np.isfinite(factors).all():
        fused = [l for l in range(num_layers) if _fusable([c[l] for c in clients])]
    out: list = [None] * num_layers
    if fused:
        dtypes = [clients[0][l].dtype for l in fused]
        for l, s in zip(fused, _fused_weighted_sum(clients, fused, factors, dtypes)):
            out[l] = s
    done = set(fused)
    for l in range(num_layers):
        if l in done:
            continue
        layer = _into(np.array(clients[0][l]), factors[0], np.multiply)
        for arrays, s in zip(clients[1:], factors[1:]):
            layer = _into(layer, _into(np.array(arrays[l]), s, np.multiply), np.add)
        out[l] = layer
    return out


# ---------------------------------------------------------------- strategies


def _fit_metrics(strategy: _flower.FedAvg, server_round: int, results: FitResults
                 ) -> dict[str, Scalar]:
    """Flower's metrics step of ``aggregate_fit``: the user's function, or a warning in
    round 1 that there is none."""
    if strategy.fit_metrics_aggregation_fn:
        return strategy.fit_metrics_aggregation_fn(
            [(res.num_examples, res.metrics) for _, res in results])
    if server_round == 1:
        log(WARNING, "No fit_metrics_aggregation_fn provided")
    return {}


def _weights_results(results: FitResults) -> list[tuple[list[np.ndarray], int]]:
    return [(parameters_to_arrays(fit_res.parameters), fit_res.num_examples)
            for _, fit_res in results]


class FedAvg(_flower.FedAvg):
    r"""Flower's legacy ``FedAvg`` (same arguments, attributes and behaviour) whose
    ``aggregate_fit`` computes :math:`\sum_k n_k x_k / \sum_k n_k` with the fused op:
    :func:`aggregate_inplace` when ``inplace`` (the default) and :func:`aggregate_ndarrays`
    otherwise, exactly where Flower calls its functions of those names."""

    @one_call_at_a_time()
    def aggregate_fit(self, server_round: int, results: FitResults, failures: Failures
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """The clients' weighted mean (None when there are no results, or failures that
        ``accept_failures`` rejects) and the aggregated fit metrics."""
        if not results:
            return None, {}
        if not self.accept_failures and failures:
            return None, {}
        if self.inplace:
            arrays = aggregate_inplace(results)
        else:
            arrays = aggregate_ndarrays(_weights_results(results))
        return ndarrays_to_parameters(arrays), _fit_metrics(self, server_round, results)


class FedProx(_flower.FedProx, FedAvg):
    """Flower's legacy ``FedProx`` (``proximal_mu`` sent to the clients) on the fused
    :class:`FedAvg` aggregation."""


class FedAdam(_flower.FedAdam, FedAvg):
    """Flower's legacy ``FedAdam``: its Adam server step on the fused :class:`FedAvg` mean."""


class FedYogi(_flower.FedYogi, FedAvg):
    """Flower's legacy ``FedYogi``: its Yogi server step on the fused :class:`FedAvg` mean."""


class FedAdagrad(_flower.FedAdagrad, FedAvg):
    """Flower's legacy ``FedAdagrad``: its Adagrad server step on the fused :class:`FedAvg`
    mean."""


class FedAvgM(_flower.FedAvgM, FedAvg):
    r"""Flower's legacy ``FedAvgM``: the fused mean :math:`\bar x` (:func:`aggregate_ndarrays`,
    as Flower's uses ``aggregate``), then, when ``server_opt`` (set at construction from
    ``server_learning_rate != 1`` or ``server_momentum != 0``), Flower's server step from
    ``initial_parameters`` :math:`x_t`: :math:`g = x_t - \bar x`, with momentum
    :math:`m \leftarrow \mu m + g` (``momentum_vector``, started with :math:`g` in round 1) and
    :math:`g = m`, :math:`x_{t+1} = x_t - \eta g`, stored back into ``initial_parameters``."""

    @one_call_at_a_time()
    def aggregate_fit(self, server_round: int, results: FitResults, failures: Failures
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """The server-optimized mean and the aggregated fit metrics."""
        if not results:
            return None, {}
        if not self.accept_failures and failures:
            return None, {}
        new = aggregate_ndarrays(_weights_results(results))
        if self.server_opt:
            assert self.initial_parameters is not None, (  # Flower's words
                "When using server-side optimization, model needs to be initialized.")
            current = parameters_to_arrays(self.initial_parameters)
            step = [x - m for x, m in zip(current, new, strict=True)]
            if self.server_momentum > 0.0:
                if server_round > 1:
                    assert self.momentum_vector, "Momentum should have been created on round 1."
                    self.momentum_vector = [self.server_momentum * v + g for v, g in
                                            zip(self.momentum_vector, step, strict=True)]
                else:
                    self.momentum_vector = step
                step = self.momentum_vector
            new = [x - self.server_learning_rate * g for x, g in zip(current, step, strict=True)]
            self.initial_parameters = ndarrays_to_parameters(new)
        return ndarrays_to_parameters(new), _fit_metrics(self, server_round, results)


class QFedAvg(_flower.QFedAvg, FedAvg):
    r"""Flower's legacy ``QFedAvg`` (Li et al., ICLR 2020) with its arguments (``q_param``,
    ``qffl_learning_rate``, stored as ``learning_rate``) and its loss: the server-side
    ``evaluate_fn`` loss :math:`f` of ``pre_weights`` :math:`x_t` (the round's global weights,
    set by ``configure_fit``), one value for all clients. With
    :math:`L = f + 10^{-10}`, learning rate :math:`\eta` and

    .. math:: h_k = q L^{q-1} \|x_t - x_k\|^2/\eta^2 + L^q/\eta, \qquad H = \sum_k h_k,

    Flower's update :math:`x_{t+1} = x_t - \sum_k L^q (x_t - x_k)/(\eta H)` is
    :math:`x_t + c\sum_k (x_k - x_t)`, :math:`c = L^q/(\eta H)`: one fused pass in delta mode,
    with the norms from one fused read pass per client. The result is float64, as Flower's.
    Where a gradient :math:`x_t - x_k` is float16 (a float16 global model and client), Flower
    computes it and its squared norm in float16, an Inf past 65504 that zeroes the update;
    there Flower's own ``aggregate_fit`` runs.
    Without ``evaluate_fn`` it raises ``NameError`` (``UnboundLocalError`` from Python 3.12)
    and without ``pre_weights`` ``AttributeError``, as Flower's does.
    """

    @one_call_at_a_time()
    def aggregate_fit(self, server_round: int, results: FitResults, failures: Failures
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """The q-FFL update of ``pre_weights`` and the aggregated fit metrics."""
        if not results:
            return None, {}
        if not self.accept_failures and failures:
            return None, {}
        if self.pre_weights is None:
            raise AttributeError("QFedAvg.aggregate_fit: pre_weights is None; configure_fit "
                                 "sets it to the round's global weights")
        before = self.pre_weights
        clients = [parameters_to_arrays(fit_res.parameters) for _, fit_res in results]
        if _float16_gradients(before, clients) or not before:
            # Flower's gradients x_t - x_k are float16 there, and so is their squared norm
            # (Inf past 65504, which zeroes the update); its result is float64, not rounded
            # to float16 as the fused pass would round it. (A model without arrays is its
            # IndexError.) Flower's own code runs.
            return _flower.QFedAvg.aggregate_fit(self, server_round, results, failures)
        evaluated = self.evaluate(server_round, ndarrays_to_parameters(before))
        if evaluated is None:  # Flower reads an unset local here: the same exception type
            raise _MISSING_LOSS("QFedAvg.aggregate_fit needs the server-side loss of "
                                "pre_weights: pass evaluate_fn returning (loss, metrics)")
        loss, _ = evaluated
        new = _qffl_update(before, clients, loss, self.q_param, self.learning_rate)
        return ndarrays_to_parameters(new), _fit_metrics(self, server_round, results)


def _float16_gradients(before: Sequence, clients: Sequence[Sequence]) -> bool:
    """Whether Flower's QFedAvg computes a layer's gradient ``x_t - x_k`` in float16."""
    return any(np.result_type(b, a) == np.float16 for arrays in clients
               for b, a in zip(before, arrays))


def _qffl_update(before: Sequence, clients: Sequence[Sequence], loss: float, q: float,
                 lr: float) -> list:
    r""":math:`x_t + c\sum_k (x_k - x_t)` of :class:`QFedAvg` (see there)."""
    for k, arrays in enumerate(clients):
        if len(arrays) != len(before):
            raise ValueError(f"QFedAvg: client {k} has {len(arrays)} arrays, pre_weights has "
                             f"{len(before)}")
    num_layers = len(before)
    fused = [l for l in range(num_layers) if _fusable([before[l]] + [c[l] for c in clients])]
    work = [np.result_type(before[l], *[c[l] for c in clients]) for l in fused]
    targets = [_TORCH_DTYPES[d.newbyteorder("=")] for d in work]

    def as_tensors(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        views = ndarrays_to_tensors([arrays[l] for l in fused])
        return [t if t.dtype == d else t.to(d) for t, d in zip(views, targets)]

    base = as_tensors(before)
    client_tensors = [as_tensors(arrays) for arrays in clients]
    others = [l for l in range(num_layers) if l not in set(fused)]
    power = np.float_power(loss + 1e-10, q)  # L^q, float64 as in Flower
    sq_norms = []
    for arrays, tensors in zip(clients, client_tensors):
        fused_part = float(superfed_stats(tensors, (), base)[:, 3].sum()) if fused else 0.0
        rest = sum(float(np.sum(np.square((before[l] - arrays[l]) * 1.0), dtype=np.float64))
                   for l in others)
        sq_norms.append((fused_part + rest) / lr**2)
    h = [q * np.float_power(loss + 1e-10, q - 1) * s + (1.0 / lr) * power for s in sq_norms]
    denominator = np.sum(np.asarray(h))
    c = power * (1.0 / lr) / denominator

    # Flower's dtype per layer (float64 for real inputs: np.float_power makes float64 scalars).
    def flower_dtype(l: int) -> np.dtype:
        grads = [np.multiply(np.empty(0, before[l].dtype) - np.empty(0, a[l].dtype), 1.0 / lr)
                 for a in clients]
        scaled = [power * g * 1.0 / denominator for g in grads]
        return ((np.empty(0, before[l].dtype) - reduce(np.add, scaled)) * 1.0).dtype

    out: list = [None] * num_layers
    if fused and np.isfinite(c):
        sums = aggregate(client_tensors, torch.full((len(clients),), float(c),
                                                    dtype=torch.float64, device="cpu"), base=base)
        for l, s in zip(fused, sums):
            out[l] = s.numpy().astype(flower_dtype(l))
    else:
        others = list(range(num_layers))
    for l in others:  # Flower's NumPy arithmetic, layer by layer
        step = None
        for arrays in clients:
            scaled = power * np.multiply(before[l] - arrays[l], 1.0 / lr) * 1.0 / denominator
            if step is None:
                step = scaled
            else:  # in place, as Flower: a later shape that only broadcasts is its ValueError
                step += scaled
        out[l] = (before[l] - step) * 1.0
    return out
