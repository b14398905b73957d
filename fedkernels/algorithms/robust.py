r"""Byzantine-robust aggregation rules as strategies: ``fedmedian``, ``trimmed-mean``,
``krum``, ``multikrum`` and ``bulyan`` (the rules of :mod:`fedkernels.robust`, with the
arithmetic of Flower's strategies of the same names).

Each rule combines the K participants' full models into one model :math:`\tilde x`, and the
server optimizer moves the global model towards it as it moves towards FedAvg's average
(plain server SGD with learning rate 1: :math:`x_{t+1} = \tilde x`). Equations, defaults and
the paper-versus-Flower choices: ``docs/algorithms/robust.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fedkernels.robust import bulyan, coordinate_median, krum, trimmed_mean
from fedkernels.sim.config import ConfigError
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import RoundInfo, SetupInfo, Strategy

from .registry import register


class RobustRule(Strategy):
    """A strategy whose aggregate is one robust combination of the participants' models."""

    supports_central_dp = False

    def combine(self, info: RoundInfo) -> tuple[dict[str, Any], dict[str, float]]:
        """The combined full state_dict and scalars to log."""
        raise NotImplementedError

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        if server.private is not None:
            raise ConfigError(
                f"dp.* (central DP) clips and noises a weighted mean; {self.name} is not one, so "
                "the two cannot be combined"
            )
        combined, extra = self.combine(info)
        server.step([combined], torch.ones(1, dtype=torch.float64, device="cpu"), info.round)
        return extra


def _malicious_field() -> Any:
    return field(
        default=0,
        metadata={"help": "f, the number of Byzantine clients the rule must tolerate (Flower's "
                  "num_malicious_nodes)"},
    )


def _check_malicious(name: str, f: int) -> None:
    if f < 0:
        raise ConfigError(f"{name}.num_malicious must be >= 0")


@register
class FedMedian(RobustRule):
    r""":math:`\tilde x` is the coordinate-wise median of the participants' models (Yin et al.
    2018; Flower's ``FedMedian``)."""

    name = "fedmedian"

    def combine(self, info: RoundInfo) -> tuple[dict[str, Any], dict[str, float]]:
        return coordinate_median(info.client_states), {}


@dataclass
class TrimmedMeanConfig:
    beta: float = field(
        default=0.2,
        metadata={"help": "fraction trimmed at each end of every coordinate: int(beta*K) "
                  "smallest and largest values dropped (Flower's default 0.2)"},
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta < 0.5:
            raise ConfigError("trimmed-mean.beta must be in [0, 0.5)")


@register
class TrimmedMean(RobustRule):
    r""":math:`\tilde x` is the coordinate-wise :math:`\beta`-trimmed mean (Yin et al. 2018;
    Flower's ``FedTrimmedAvg``)."""

    name = "trimmed-mean"
    config_class = TrimmedMeanConfig

    def combine(self, info: RoundInfo) -> tuple[dict[str, Any], dict[str, float]]:
        return trimmed_mean(info.client_states, self.config.beta), {}


@dataclass
class KrumConfig:
    num_malicious: int = _malicious_field()

    def __post_init__(self) -> None:
        _check_malicious("krum", self.num_malicious)


@register
class Krum(RobustRule):
    r""":math:`\tilde x` is the participant whose summed squared distance to its
    :math:`K - f - 2` nearest other participants is smallest (Blanchard et al. 2017)."""

    name = "krum"
    config_class = KrumConfig

    def combine(self, info: RoundInfo) -> tuple[dict[str, Any], dict[str, float]]:
        combined, selected = krum(info.client_states, self.config.num_malicious)
        return combined, {"selected_client": float(info.participants[selected[0]])}


@dataclass
class MultiKrumConfig:
    num_malicious: int = _malicious_field()
    num_to_keep: int | None = field(
        default=None,
        metadata={"help": "m, how many lowest-score participants are averaged (default: K - f, "
                  "the Multi-Krum paper's choice)"},
    )

    def __post_init__(self) -> None:
        _check_malicious("multikrum", self.num_malicious)
        if self.num_to_keep is not None and self.num_to_keep < 1:
            raise ConfigError("multikrum.num_to_keep must be >= 1")


@register
class MultiKrum(RobustRule):
    r""":math:`\tilde x` is the example-weighted average of the :math:`m` participants with the
    lowest Krum scores (El Mhamdi et al. 2018; Flower's ``MultiKrum``)."""

    name = "multikrum"
    config_class = MultiKrumConfig

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        # checked before the first round where every round has the same K, and where no K up
        # to N can work; otherwise at a round whose K does not fit (combine)
        f, m = self.config.num_malicious, self.config.num_to_keep
        k = info.participants_per_round
        if k is not None:
            reason = self.too_few_participants(k)
            if reason is not None:
                raise ConfigError(f"{reason}, in every round: it must be in [1, {k}]")
        elif m is not None and m > info.num_clients:
            raise ConfigError(
                f"multikrum.num_to_keep={m} exceeds the {info.num_clients} clients of the run"
            )
        elif m is None and f >= info.num_clients:
            raise ConfigError(
                f"multikrum.num_malicious={f} leaves no client of the {info.num_clients} to "
                "keep (K - num_malicious < 1 in every round)"
            )

    def too_few_participants(self, count: int) -> str | None:
        f, m = self.config.num_malicious, self.config.num_to_keep
        keep = m if m is not None else count - f
        if 1 <= keep <= count:
            return None
        why = "multikrum.num_to_keep" if m is not None else "K - multikrum.num_malicious"
        return f"multikrum keeps {keep} ({why}) of the round's {count} participants"

    def combine(self, info: RoundInfo) -> tuple[dict[str, Any], dict[str, float]]:
        k = len(info.client_states)
        f = self.config.num_malicious
        keep = self.config.num_to_keep if self.config.num_to_keep is not None else k - f
        reason = self.too_few_participants(k)
        if reason is not None:  # the round loop skips such rounds before training
            raise ConfigError(f"{reason}: it must be in [1, {k}]")
        combined, selected = krum(info.client_states, f, keep, weights=info.num_samples)
        return combined, {"selected": float(len(selected))}


@dataclass
class BulyanConfig:
    num_malicious: int = _malicious_field()
    selection: Literal["iterative", "multikrum"] = field(
        default="iterative",
        metadata={"help": "how the K - 2f candidates are chosen: Krum applied repeatedly "
                  "(the paper, Flower's legacy Bulyan) or one Multi-Krum scoring (Flower's "
                  "Message API Bulyan)"},
    )

    def __post_init__(self) -> None:
        _check_malicious("bulyan", self.num_malicious)


@register
class Bulyan(RobustRule):
    r"""Bulyan (El Mhamdi et al. 2018): :math:`K - 2f` candidates chosen by Krum, then per
    coordinate the mean of the :math:`K - 4f` candidate values closest to their median. Needs
    :math:`K \ge 4f + 3` participants."""

    name = "bulyan"
    config_class = BulyanConfig

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        k = info.participants_per_round
        most = info.num_clients if k is None else k
        reason = self.too_few_participants(most)
        if reason is not None:
            have = (f"{k} per round" if k is not None
                    else f"at most {most} (partition.num_clients)")
            raise ConfigError(f"{reason} per round (bulyan.num_malicious); this run has {have}")

    def too_few_participants(self, count: int) -> str | None:
        f = self.config.num_malicious
        if count >= 4 * f + 3:
            return None
        return f"bulyan with num_malicious={f} needs at least {4 * f + 3} participants"

    def combine(self, info: RoundInfo) -> tuple[dict[str, Any], dict[str, float]]:
        reason = self.too_few_participants(len(info.client_states))
        if reason is not None:  # the round loop skips such rounds before training
            raise ConfigError(f"{reason}, got {len(info.client_states)}")
        return bulyan(info.client_states, self.config.num_malicious,
                      selection=self.config.selection), {}
