r"""Aggregation under unknown, heterogeneous client participation (equations, defaults and
citations: ``docs/algorithms/participation.md``).

The objective is the unweighted average :math:`f = \frac1N \sum_n F_n` of all N clients, but
client n takes part in a round only with (unknown) probability :math:`p_n`. With
:math:`u_n = x_n - x_t` (model after local training minus the global model) the server step is
:math:`x_{t+1} = x_t + \eta \sum_{n \in S_t} w_n u_n` with:

=======================  ==================================================================
``fedau``                :math:`w_n = \omega_n / N`, :math:`\omega_n` = running mean of the
                         client's observed participation intervals, each cut off at K
``avg-participating``    :math:`w_n = 1/|S_t|` (biased towards frequent participants)
``avg-all``              :math:`w_n = 1/N`
``known-p``              :math:`w_n = 1/(N p_n)` (needs the true :math:`p_n`)
``mifa``                 :math:`x_{t+1} = x_t + \eta\,\frac1N \sum_n Y_n` with
                         :math:`Y_n` the latest update of every client
``fedvarp``              :math:`x_{t+1} = x_t + \eta\,(\bar Y + \frac{1}{|S_t|}\sum_{n\in S_t}
                         (u_n - Y_n))` with :math:`\bar Y` the table's mean before the round
=======================  ==================================================================

MIFA and FedVARP keep their N update vectors in one preallocated ``[N + 1, P]`` buffer (row N
holds the running mean :math:`\bar Y`) and update it with the fused ``weighted_sum`` op and
``torch._foreach_*`` calls: :math:`O(|S_t| P)` work per round instead of recomputing the
mean over N rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedkernels.ops import summation
from fedkernels.rules.participation_weights import IntervalWeightEstimator
from fedkernels.sim.config import ConfigError
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import RoundInfo, SetupInfo, Strategy

from .registry import register
from .server_step import apply_direction


def _help(default: Any, text: str) -> Any:
    return field(default=default, metadata={"help": text})


# ---------------------------------------------------------------- FedAU


@dataclass
class FedAUConfig:
    cutoff: int = _help(50, "interval cutoff K (0: no cutoff, K -> infinity)")

    def __post_init__(self) -> None:
        if self.cutoff < 0:
            raise ConfigError("fedau.cutoff must be >= 0 (0 means no cutoff)")


@register
class FedAU(Strategy):
    r"""FedAU (Wang & Ji, ICLR 2024): :math:`w_n = \omega_n / N` with :math:`\omega_n` from
    :class:`~fedkernels.rules.participation_weights.IntervalWeightEstimator`, read off the
    participation history (rounds without any participant are caught up with)."""

    name = "fedau"
    config_class = FedAUConfig

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        self.estimator = IntervalWeightEstimator(info.num_clients, self.config.cutoff or None)
        self.rounds_seen = 0

    def _catch_up(self, info: RoundInfo, upto: int) -> None:
        matrix = info.history.matrix
        for t in range(self.rounds_seen, upto):
            self.estimator.observe(matrix[t])
        self.rounds_seen = max(self.rounds_seen, upto)

    def client_weights(self, info: RoundInfo) -> Tensor:
        self._catch_up(info, info.round)  # rounds before this one
        weights = self.estimator.omega[info.participants] / info.num_clients
        self._catch_up(info, info.round + 1)
        return weights

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        weights = self.client_weights(info)
        server.step(info.client_states, weights, info.round)
        omega = self.estimator.omega
        return {"omega_mean": float(omega.mean()), "omega_max": float(omega.max())}

    def state_dict(self) -> dict[str, Any]:
        return {"estimator": self.estimator.state_dict(), "rounds_seen": self.rounds_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self.rounds_seen = int(state["rounds_seen"])


@register
class AverageParticipating(Strategy):
    r""":math:`w_n = 1/|S_t|`: the plain mean of the participants' updates."""

    name = "avg-participating"

    def client_weights(self, info: RoundInfo) -> Tensor:
        k = len(info.participants)
        return torch.full((k,), 1.0 / k, dtype=torch.float64, device="cpu")


@register
class AverageAll(Strategy):
    r""":math:`w_n = 1/N`: the participants' updates summed, divided by all N clients."""

    name = "avg-all"

    def client_weights(self, info: RoundInfo) -> Tensor:
        return torch.full((len(info.participants),), 1.0 / info.num_clients, dtype=torch.float64,
                          device="cpu")


@register
class KnownParticipation(Strategy):
    r""":math:`w_n = 1/(N p_n)` with the sampler's true :math:`p_n` (the oracle baseline). For
    full or uniform participation, whose :math:`p_n` the simulation does not publish, it uses
    :math:`|S_t|/N`."""

    name = "known-p"

    def client_weights(self, info: RoundInfo) -> Tensor:
        probabilities = self.info.participation_probabilities
        if probabilities is None:
            p = torch.full((len(info.participants),), len(info.participants) / info.num_clients,
                           device="cpu")
        else:
            p = torch.as_tensor(probabilities, dtype=torch.float64, device="cpu")[info.participants]
        return 1.0 / (info.num_clients * p.double().clamp_min(1e-12))


# ---------------------------------------------------------------- MIFA / FedVARP


class UpdateTable:
    r"""The last update :math:`Y_n` of every client and their mean :math:`\bar Y`, in one
    ``[N + 1, P]`` buffer (row N is :math:`\bar Y`) on the device of ``like`` (the model's),
    with per-client lists of views shaped like the model's parameters so the fused ops read
    and write it directly."""

    def __init__(self, num_clients: int, like: list[Tensor]) -> None:
        self.num_clients = num_clients
        sizes = [t.numel() for t in like]
        self.buffer = torch.zeros(num_clients + 1, sum(sizes), dtype=like[0].dtype,
                                  device=like[0].device)
        self.rows: list[list[Tensor]] = []
        for n in range(num_clients + 1):
            pieces = self.buffer[n].split(sizes)
            self.rows.append([p.view(t.shape) for p, t in zip(pieces, like)])

    @property
    def mean(self) -> list[Tensor]:
        return self.rows[self.num_clients]

    def update(
        self, ids: list[int], clients: list[list[Tensor]], global_params: list[Tensor]
    ) -> list[Tensor] | None:
        r"""Writes :math:`Y_j \leftarrow u_j = x_j - x_t` for ``ids`` and moves the mean by
        :math:`\frac1N\sum_j (u_j - Y_j^{old})`; returns FedVARP's
        :math:`v = \bar Y^{old} + \frac1K \sum_j (u_j - Y_j^{old})`, from one fused
        ``weighted_sum`` over the 2K+1 inputs ``x_j``, ``Y_j``, ``x_t`` before the writes."""
        k, n = len(ids), self.num_clients
        old = [self.rows[j] for j in ids]
        inputs = [t for c in clients for t in c] + [t for r in old for t in r] + global_params
        weights = torch.tensor([1.0] * k + [-1.0] * k + [-float(k)], dtype=torch.float64,
                               device="cpu")
        variance_reduced = summation.weighted_sum(inputs, weights / k, self.mean, 1.0, False)
        summation.weighted_sum_(self.mean, inputs, weights / n, 1.0, False)
        flat_old = [t for r in old for t in r]
        torch._foreach_copy_(flat_old, [t for c in clients for t in c])
        torch._foreach_sub_(flat_old, global_params * k)
        return variance_reduced


class _UpdateMemory(Strategy):
    """Shared by MIFA and FedVARP: the table, its checkpoint, and the server step."""

    supports_central_dp = False  # the server moves along the table, not a weighted mean

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        if info.model is None:
            raise ConfigError(f"{self.name} needs the model to size its update table")
        named = dict(info.model.named_parameters())
        like = [named[n].detach() for n in info.parameter_names]
        self.table = UpdateTable(info.num_clients, like)

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        names = self.info.parameter_names
        clients = [[s[n] for n in names] for s in info.client_states]
        global_params = [info.global_state[n] for n in names]
        variance_reduced = self.table.update(info.participants.tolist(), clients, global_params)
        direction = self.table.mean if self.name == "mifa" else variance_reduced
        apply_direction(server, direction, info.round, info.client_states)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"table": self.table.buffer.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.table.buffer.copy_(state["table"])


@register
class MIFA(_UpdateMemory):
    r"""MIFA (Gu et al. 2021): :math:`x_{t+1} = x_t + \eta \frac1N\sum_n Y_n`, every client's
    latest update (zero before its first participation)."""

    name = "mifa"


@register
class FedVARP(_UpdateMemory):
    r"""FedVARP (Jhunjhunwala et al. 2022): SAGA-style variance reduction over clients,
    :math:`v = \bar Y^{old} + \frac{1}{|S_t|} \sum_{j \in S_t} (u_j - Y_j^{old})`."""

    name = "fedvarp"


__all__ = [
    "AverageAll",
    "AverageParticipating",
    "FedAU",
    "FedAUConfig",
    "FedVARP",
    "IntervalWeightEstimator",
    "KnownParticipation",
    "MIFA",
    "UpdateTable",
]
