r"""fedkernels' own Flower strategies (Message API): the client-weighting methods of the source
papers as Flower ``ServerApp`` strategies. :class:`FusedStrategy` and its subclasses move the
global model :math:`x_t` by

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

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import FedAvg as _FlowerFedAvg
from torch import Tensor

from fedkernels.aggregate import aggregate
from fedkernels.integrations.flower.records import (
    StateDict,
    arrayrecord_to_state_dict,
    state_dict_to_arrayrecord,
)
from fedkernels.model_layout import INT_POLICIES
from fedkernels.ops.concurrency import one_call_at_a_time
from fedkernels.rules.aaggff import AAggFFDDecision, AAggFFSDecision
from fedkernels.rules.fairness_weights import qffl_weights, term_weights, vred_weights
from fedkernels.rules.participation_weights import IntervalWeightEstimator
from fedkernels.rules.server_optimizers import ServerOptimizer, ServerSGD

__all__ = ["AAggFF", "FedAU", "FusedStrategy", "QFFL", "SemiVRed", "TERM", "VRed"]


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

    @one_call_at_a_time()
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
        return torch.tensor([self.index[int(n)] for n in node_ids], dtype=torch.int64, device="cpu")

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
        if grow > 0:
            self.estimator.add_clients(grow)

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
