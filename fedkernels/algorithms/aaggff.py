r"""AAggFF (Hahn, Kim, Lee, ICML 2024) on the simulation loop: ``aaggff-s`` (cross-silo, every
client every round) and ``aaggff-d`` (cross-device, sampled clients). Each strategy holds one
decision of :mod:`fedkernels.rules.aaggff` (its module docstring has the equations), feeds it
the participants' losses of the current global model and weights the updates by
:math:`w_i = p_i / \sum_{j \in S} p_j`. Defaults and the paper-versus-code table:
``docs/algorithms/aaggff.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from torch import Tensor

from fedkernels.rules.aaggff import AAggFFDDecision, AAggFFSDecision
from fedkernels.sim.config import ConfigError
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import RoundInfo, SetupInfo, Strategy

from .registry import register


def _help(default: Any, text: str) -> Any:
    return field(default=default, metadata={"help": text})


CDFName = Literal["weibull", "exponential", "frechet", "normal", "gumbel", "logistic"]


@dataclass
class AAggFFConfig:
    cdf: CDFName = _help("weibull", "response transform (the paper tunes it per data set)")
    variant: Literal["paper", "official"] = _help(
        "paper", "paper formulas, or the authors' code (ONS objective / DR estimate / init)"
    )
    official_normal_cdf: bool = _help(
        False, "the official code's inverted Normal transform (reproduces its Berka numbers)"
    )


class _AAggFF(Strategy):
    config_class = AAggFFConfig
    wants_global_loss = True

    def decision_options(self) -> dict[str, Any]:
        return {"cdf": self.config.cdf, "variant": self.config.variant,
                "official_normal_cdf": self.config.official_normal_cdf}

    @property
    def decision(self) -> Tensor:
        """The current decision :math:`p` over all N clients."""
        return self.decider.decision

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        weights = self.client_weights(info)
        server.step(info.client_states, weights, info.round)
        p = self.decision
        entropy = float(-(p * p.clamp_min(1e-300).log()).sum())
        return {"decision_max": float(p.max()), "decision_entropy": entropy}

    def state_dict(self) -> dict[str, Any]:
        return self.decider.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decider.load_state_dict(state)


@register
class AAggFFS(_AAggFF):
    r"""AAggFF-S: online Newton step over all N clients (needs full participation)."""

    name = "aaggff-s"

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        n = info.num_clients
        k, p = info.participants_per_round, info.participation_probabilities
        if (k is not None and k != n) or (p is not None and not np.all(p >= 1)):
            # refused before the first round rather than at the first round that misses one
            raise ConfigError(
                "aaggff-s needs every client in every round (participation.kind=full); "
                "use aaggff-d with sampled clients"
            )
        self.decider = AAggFFSDecision(n, **self.decision_options())

    def step(self, losses: Tensor) -> np.ndarray:
        """One decision update from all N clients' losses; returns the new decision."""
        return self.decider.step(losses)

    def client_weights(self, info: RoundInfo) -> Tensor:
        if len(info.participants) != info.num_clients:
            raise ConfigError(
                "aaggff-s needs every client in every round (participation.kind=full); "
                "use aaggff-d with sampled clients"
            )
        self.step(info.global_losses)
        p = self.decision[info.participants]
        return p / p.sum()


@dataclass
class AAggFFDConfig(AAggFFConfig):
    sampling_fraction: float | None = _help(
        None,
        "C = P(i in S): default the sampler's p_i when it has them (Bernoulli, ...), else "
        "|S_t| / N (exact for uniform sampling)",
    )

    def __post_init__(self) -> None:
        if self.sampling_fraction is not None and not 0 < self.sampling_fraction <= 1:
            raise ConfigError("aaggff-d.sampling_fraction must be in (0, 1]")


@register
class AAggFFD(_AAggFF):
    r"""AAggFF-D: doubly-robust responses and closed-form linearised FTRL
    (:class:`~fedkernels.rules.aaggff.AAggFFDDecision`). With per-client inclusion
    probabilities :math:`\pi_i` (Bernoulli participation) the DR estimate divides by
    :math:`\pi_i` and :math:`C` is their mean."""

    name = "aaggff-d"
    config_class = AAggFFDConfig

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        self.decider = AAggFFDDecision(info.num_clients, **self.decision_options())

    @property
    def gradient_sum(self) -> Tensor:
        """The sum of the linearised gradients so far (FTRL's state)."""
        return self.decider.gradient_sum

    def inclusion(self, info: RoundInfo) -> np.ndarray:
        n = info.num_clients
        if self.config.sampling_fraction is not None:
            return np.full(n, self.config.sampling_fraction)
        if self.info.participation_probabilities is not None:
            return np.clip(np.asarray(self.info.participation_probabilities, dtype=np.float64),
                           1e-12, 1.0)
        return np.full(n, len(info.participants) / n)

    def step(self, ids: np.ndarray, losses: np.ndarray, pi: np.ndarray, t: int) -> np.ndarray:
        """One FTRL update in round ``t`` (1-based) from the participants ``ids``' losses."""
        return self.decider.step(ids, losses, pi, t)

    def client_weights(self, info: RoundInfo) -> Tensor:
        ids = info.participants.numpy()
        self.step(ids, info.global_losses.numpy(), self.inclusion(info), info.round + 1)
        p = self.decision[info.participants]
        return p / p.sum()


__all__ = ["AAggFFConfig", "AAggFFD", "AAggFFDConfig", "AAggFFS"]
