r"""Flower strategies that aggregate with :func:`fedkernels.aggregate`
(``pip install 'fedkernels[flower]'``).

They subclass Flower's Message-API ``FedAvg`` (``flwr.serverapp.strategy``, the API Flower
recommends since 1.21; the legacy ``flwr.server.strategy`` is deprecated) and replace only
``aggregate_train``: node sampling, configuration, evaluation, ``start()`` and every constructor
argument of Flower's strategy of the same name work as in Flower. Use them in a ``ServerApp``
as Flower's own::

    from fedkernels.integrations.flower import FedAvg

    @app.main()
    def main(grid, context):
        strategy = FedAvg(fraction_train=0.5)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=10)

What changes is how a round is combined. The replies' arrays are viewed as tensors in place
(no ``np.load`` copy: :func:`arrayrecord_to_state_dict`), the K models are combined by one
fused ``weighted_sum`` pass (fp32 accumulation for half types, fixed order), and integer arrays
(``num_batches_tracked``) follow ``int_policy`` ("max" by default) instead of being averaged
into floats. Every strategy but :class:`FedAvg` moves the global model :math:`x_t` by

.. math:: \Delta_t = \sum_k w_k (x_k - x_t)

through a server optimizer (plain: :math:`x_{t+1} = x_t + \eta\Delta_t`; or FedAvgM, FedAdam,
FedYogi, FedAdagrad of :mod:`fedkernels.sim.server`, whose formulas are Flower's), with
:math:`w_k` from:

=====================  ======================================================================
:class:`FedAvg`        :math:`n_k/\sum n_j` (``weighted_by_key``); equal to Flower's ``FedAvg``
:class:`FedAvgM`,      FedAvg weights and the server optimizer of that name; equal to Flower's
:class:`FedAdam`,      strategies of the same names (same constructor arguments)
:class:`FedYogi`,
:class:`FedAdagrad`
:class:`QFedAvg`       q-FedAvg (:func:`~fedkernels.algorithms.fairness.qfedavg_weights`);
                       equal to Flower's ``QFedAvg``
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
Clients are identified by their Flower node id (FedAU's and AAggFF's per-client state).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import FedAvg as _FlowerFedAvg
except ImportError as _err:  # pragma: no cover - exercised only without flwr
    raise ImportError(
        "fedkernels.integrations.flower needs Flower (flwr >= 1.41), which is not installed: "
        "pip install 'fedkernels[flower]'"
    ) from _err

from fedkernels.aggregate import aggregate
from fedkernels.algorithms.aaggff import AAggFFConfig, AAggFFD, AAggFFDConfig, AAggFFS
from fedkernels.algorithms.fairness import (
    qfedavg_weights,
    qffl_weights,
    term_weights,
    vred_weights,
)
from fedkernels.algorithms.participation import IntervalWeightEstimator
from fedkernels.algorithms.update_stats import update_sq_norms
from fedkernels.integrations.adapters import ndarrays_to_tensors, tensors_to_ndarrays
from fedkernels.model_layout import INT_POLICIES
from fedkernels.sim import server as _server
from fedkernels.sim.strategy import SetupInfo

__all__ = [
    "AAggFF",
    "FedAU",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedYogi",
    "FusedStrategy",
    "QFFL",
    "QFedAvg",
    "SemiVRed",
    "TERM",
    "VRed",
    "aggregate_ndarrays",
    "array_to_tensor",
    "arrayrecord_to_state_dict",
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
    data = array.data
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
    a = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    if copy:
        a = a.copy()
    return ndarrays_to_tensors([a])[0]


def arrayrecord_to_state_dict(record: ArrayRecord, *, copy: bool = False) -> StateDict:
    """An ``ArrayRecord`` as a state_dict of CPU tensors (views of its bytes unless ``copy``;
    :func:`array_to_tensor`). Equal to ``record.to_torch_state_dict()`` without its copies."""
    return {k: array_to_tensor(v, copy=copy) for k, v in record.items()}


def state_dict_to_arrayrecord(state: Mapping[str, Tensor]) -> ArrayRecord:
    """A state_dict as an ``ArrayRecord`` (one serialization per tensor, which Flower's wire
    format needs; bfloat16 becomes float32, which NumPy lacks)."""
    arrays = tensors_to_ndarrays(state)
    return ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(state.keys(), arrays)})


def aggregate_ndarrays(results: Sequence[tuple[Sequence[np.ndarray], float]]) -> list[np.ndarray]:
    """For a legacy ``flwr.server.strategy`` ``aggregate_fit``: the same contract as Flower's
    ``flwr.server.strategy.aggregate.aggregate`` (``[(ndarrays, num_examples), ...]`` to the
    example-weighted mean), computed by one fused pass over zero-copy views of the arrays."""
    if not results:
        raise ValueError("aggregate_ndarrays: no results")
    clients = [ndarrays_to_tensors(list(arrays)) for arrays, _ in results]
    weights = [float(n) for _, n in results]
    out = aggregate(clients, weights, normalize=True)
    return [t.numpy() for t in out]


# ---------------------------------------------------------------- strategies


def _int_entry(values: list[Tensor], base: Tensor | None, policy: str) -> Tensor:
    if policy == "first" or (policy == "skip" and base is None):
        return values[0].clone()
    if policy == "skip":
        return base.clone()
    if policy == "error":
        raise TypeError("integer array and int_policy='error'")
    return torch.stack(values).amax(dim=0)


def _check_finite(states: list[StateDict], node_ids=None) -> None:
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
        server_optimizer: a :class:`fedkernels.sim.server.ServerOptimizer` (``ServerSGD``,
            ``FedAvgM``, ``FedAdam``, ``FedYogi``, ``FedAdagrad``); it overrides
            ``server_learning_rate``.
        server_learning_rate: η of the plain server step.
        int_policy: integer/bool arrays: ``"max"`` over clients (default), ``"first"``,
            ``"skip"`` (keep the global one) or ``"error"``.
        check_finite: reject replies that carry NaN/Inf (one extra read of the updates).
    """

    def __init__(self, *, server_optimizer: _server.ServerOptimizer | None = None,
                 server_learning_rate: float = 1.0, int_policy: str = "max",
                 check_finite: bool = False, **flower_kwargs: Any) -> None:
        super().__init__(**flower_kwargs)
        if int_policy not in INT_POLICIES:
            raise ValueError(f"int_policy must be one of 'max', 'first', 'skip', 'error', "
                             f"not {int_policy!r}")
        self.server_optimizer = server_optimizer or _server.ServerSGD(server_learning_rate)
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
        node_ids = [int(m.metadata.src_node_id) for m in valid]
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
                            dtype=torch.float64)

    def losses(self, metrics: list[MetricRecord], key: str) -> Tensor:
        """:math:`f_k`, the float metric ``key`` of every reply, float64 ``[K]``."""
        out = []
        for m in metrics:
            value = m.get(key)
            if value is None or isinstance(value, list):
                raise ValueError(f"{type(self).__name__}: every reply's MetricRecord needs a "
                                 f"float '{key}' (the client's loss)")
            out.append(float(value))
        return torch.tensor(out, dtype=torch.float64)

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
            raise RuntimeError(f"{type(self).__name__}: aggregate_train before configure_train "
                               "(the global model x_t is unknown)")
        names = list(x)
        floats = [n for n in names if x[n].is_floating_point()]
        self._check(states, names)
        clients = [{n: s[n] for n in floats} for s in states]
        params = {n: x[n] for n in floats}
        if self.check_finite:
            _check_finite(clients, node_ids=None)
        if isinstance(self.server_optimizer, _server.ServerSGD):
            aggregate(clients, weights, base=params, scale=self.server_optimizer.lr,
                                 out=params)
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


class FedAvg(FusedStrategy):
    r"""FedAvg: :math:`x_{t+1} = \sum_k n_k x_k / \sum_j n_j`, one fused pass over the K
    replies (equal to Flower's ``FedAvg`` up to float rounding; integer arrays follow
    ``int_policy`` where Flower averages them into floats). With ``server_learning_rate``
    :math:`\eta \ne 1`: :math:`x_{t+1} = x_t + \eta\sum_k p_k (x_k - x_t)`."""

    def configure_train(self, server_round, arrays, config, grid):
        if isinstance(self.server_optimizer, _server.ServerSGD) and \
                self.server_optimizer.lr == 1.0:
            return _FlowerFedAvg.configure_train(self, server_round, arrays, config, grid)
        return super().configure_train(server_round, arrays, config, grid)

    def client_weights(self, server_round, states, metrics, node_ids) -> Tensor:
        n = self.num_examples(metrics)
        return n / n.sum()

    def combine(self, server_round, states, metrics, node_ids) -> StateDict:
        sgd = isinstance(self.server_optimizer, _server.ServerSGD)
        if not (sgd and self.server_optimizer.lr == 1.0):
            return super().combine(server_round, states, metrics, node_ids)
        weights = self.client_weights(server_round, states, metrics, node_ids)
        self.last_weights, self.last_node_ids = weights, node_ids
        return aggregate(states, weights, int_policy=self.int_policy,
                                    check_finite=self.check_finite)


class FedAvgM(FusedStrategy):
    r"""Server momentum (Hsu et al. 2019), Flower's ``FedAvgM`` formulas and arguments:
    :math:`g_t = -\Delta_t`, :math:`m_t = \mu m_{t-1} + g_t`, :math:`x_{t+1} = x_t - \eta m_t`."""

    def __init__(self, *, server_learning_rate: float = 1.0, server_momentum: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(server_optimizer=_server.FedAvgM(server_learning_rate, server_momentum),
                         **kwargs)
        self.server_learning_rate = server_learning_rate
        self.server_momentum = server_momentum

    client_weights = FedAvg.client_weights


class _FedOpt(FusedStrategy):
    _optimizer: type = _server.FedAdam
    _defaults = dict(eta=1e-1, eta_l=1e-1, beta_1=0.0, beta_2=0.0, tau=1e-3)

    def __init__(self, *, eta: float | None = None, eta_l: float | None = None,
                 beta_1: float | None = None, beta_2: float | None = None,
                 tau: float | None = None, **kwargs: Any) -> None:
        given = dict(eta=eta, eta_l=eta_l, beta_1=beta_1, beta_2=beta_2, tau=tau)
        values = {k: (self._defaults[k] if v is None else v) for k, v in given.items()}
        self.eta, self.eta_l = values["eta"], values["eta_l"]  # eta_l: the clients' (unused)
        self.beta_1, self.beta_2, self.tau = values["beta_1"], values["beta_2"], values["tau"]
        if self._optimizer is _server.FedAdagrad:
            optimizer = _server.FedAdagrad(self.eta, self.tau)
        else:
            optimizer = self._optimizer(self.eta, self.beta_1, self.beta_2, self.tau)
        super().__init__(server_optimizer=optimizer, **kwargs)

    client_weights = FedAvg.client_weights


class FedAdam(_FedOpt):
    """FedAdam (Reddi et al. 2021) with Flower's ``FedAdam`` arguments, defaults and
    bias-corrected step (:class:`fedkernels.sim.server.FedAdam`)."""

    _optimizer = _server.FedAdam
    _defaults = dict(eta=1e-1, eta_l=1e-1, beta_1=0.9, beta_2=0.99, tau=1e-3)


class FedYogi(_FedOpt):
    """FedYogi with Flower's ``FedYogi`` arguments and defaults."""

    _optimizer = _server.FedYogi
    _defaults = dict(eta=1e-2, eta_l=0.0316, beta_1=0.9, beta_2=0.99, tau=1e-3)


class FedAdagrad(_FedOpt):
    """FedAdagrad with Flower's ``FedAdagrad`` arguments and defaults."""

    _optimizer = _server.FedAdagrad
    _defaults = dict(eta=1e-1, eta_l=1e-1, beta_1=0.0, beta_2=0.0, tau=1e-3)


class QFedAvg(FusedStrategy):
    r"""q-FedAvg (Li et al., ICLR 2020) with Flower's ``QFedAvg`` arguments: :math:`L = 1/`
    ``client_learning_rate``, :math:`f_k` the reply's ``train_loss_key`` metric, and
    :math:`x_{t+1} = x_t - \sum_k (f_k+\epsilon)^q L (x_t - x_k) / \sum_k h_k`, as weights
    :func:`~fedkernels.algorithms.fairness.qfedavg_weights` (norms over every float array)."""

    def __init__(self, client_learning_rate: float, q: float = 0.1,
                 train_loss_key: str = "train_loss", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.client_learning_rate = client_learning_rate
        self.q = q
        self.train_loss_key = train_loss_key

    def client_weights(self, server_round, states, metrics, node_ids) -> Tensor:
        x = self.global_state
        names = [n for n in x if x[n].is_floating_point()]
        sq_norms = update_sq_norms(states, x, names)
        return qfedavg_weights(self.losses(metrics, self.train_loss_key), sq_norms, self.q,
                               1.0 / self.client_learning_rate)


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
    (:class:`~fedkernels.algorithms.participation.IntervalWeightEstimator`). N is the number
    of nodes connected so far (``num_clients`` fixes it); a node that replied in a round
    participated in it. Sample nodes (``fraction_train`` < 1) or let them drop out: with full
    participation every :math:`\omega_n = 1` and FedAU is the plain mean."""

    def __init__(self, *, cutoff: int = 50, num_clients: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cutoff = cutoff
        self.num_clients = num_clients
        self.nodes = _NodeIndex()
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
    :class:`~fedkernels.algorithms.aaggff.AAggFFD` / ``AAggFFS``."""

    def __init__(self, *, mode: str = "d", cdf: str = "weibull", variant: str = "paper",
                 sampling_fraction: float | None = None, num_clients: int | None = None,
                 loss_key: str = "train_loss", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if mode not in ("d", "s"):
            raise ValueError(f"AAggFF: mode must be 'd' or 's', not {mode!r}")
        self.mode, self.loss_key, self.num_clients = mode, loss_key, num_clients
        if mode == "s":
            self.decider = AAggFFS(AAggFFConfig(cdf=cdf, variant=variant))
        else:
            self.decider = AAggFFD(AAggFFDConfig(cdf=cdf, variant=variant,
                                                 sampling_fraction=sampling_fraction))
        self.nodes = _NodeIndex()
        self._ready = False

    def _setup(self, node_ids: Iterable[int]) -> None:
        self.nodes.add(node_ids)
        n = self.num_clients or len(self.nodes)
        self.decider.setup(SetupInfo(
            num_clients=n, train_sizes=torch.ones(n, dtype=torch.float64), num_classes=0,
            participation_probabilities=None, parameter_names=[]))
        self._ready = True

    def on_configure(self, server_round, node_ids, grid) -> None:
        if not self._ready:
            self._setup(grid.get_node_ids())

    def client_weights(self, server_round, states, metrics, node_ids) -> Tensor:
        if not self._ready:
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
            fraction = self.decider.config.sampling_fraction
            pi = np.full(n, fraction if fraction is not None else len(ids) / n)
            self.decider.step(ids.numpy(), losses.numpy(), pi, server_round)
        p = self.decider.decision[ids]
        return p / p.sum()
