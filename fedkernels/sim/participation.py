"""Which clients take part in each round, and the record of who took part.

The patterns follow the FedAU experiments (IBM/fedau ``WorkerSampler``; see
``docs/algorithms/participation.md``, "5. Participation patterns"): full participation, a
uniform sample of a fraction C, and three patterns with a stationary probability ``p_n`` per
client (independent Bernoulli, a Markov on/off chain, and deterministic on/off cycles with a
random phase). ``p_n`` is either the same for all clients, given explicitly, or correlated with
each client's labels as in FedAU:
``p_n = clip(C * p_mean * <kappa_n, q>, p_min, 1)`` with ``q ~ Dirichlet(0.1)`` (the clip at
1, absent from the official code, keeps every p_n a probability).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import seeding
from .config import ConfigError, ParticipationConfig
from .federation import Federation


class ParticipationHistory:
    """``I[t, n]``: whether client n took part in round t, for the rounds played so far.

    Strategies read it from :class:`~fedkernels.sim.strategy.RoundInfo` (e.g. FedAU estimates
    each client's participation interval from it).
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self._rows: list[Tensor] = []

    def record(self, mask: Tensor) -> None:
        if mask.shape != (self.num_clients,) or mask.dtype != torch.bool:
            raise ValueError(f"participation mask must be bool of shape ({self.num_clients},)")
        self._rows.append(mask.clone())

    @property
    def num_rounds(self) -> int:
        return len(self._rows)

    @property
    def matrix(self) -> Tensor:
        """``[rounds, N]`` bool."""
        if not self._rows:
            return torch.zeros(0, self.num_clients, dtype=torch.bool, device="cpu")
        return torch.stack(self._rows)

    def counts(self) -> Tensor:
        """Number of rounds each client took part in (int64, ``[N]``)."""
        return self.matrix.sum(dim=0)

    def state_dict(self) -> dict[str, Any]:
        return {"matrix": self.matrix}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rows = list(state["matrix"].unbind(0))


class ParticipationSampler(ABC):
    """Draws the participation mask ``I_t`` of each round, in round order.

    ``probabilities`` is the stationary ``p_n`` of each client (``None`` for the full and
    uniform patterns, where it is the same for all: 1 and C)."""

    probabilities: np.ndarray | None = None

    def __init__(self, num_clients: int, rng: np.random.Generator) -> None:
        self.num_clients = num_clients
        self.rng = rng

    @abstractmethod
    def sample(self) -> np.ndarray:
        """The next round's mask (bool, ``[N]``)."""

    @property
    def fixed_count(self) -> int | None:
        """How many clients every round has when the pattern fixes it (full: N, uniform: m,
        Bernoulli with every p_n = 1: N), else ``None``: the count varies from round to round."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


class FullParticipation(ParticipationSampler):
    """Every client in every round."""

    def sample(self) -> np.ndarray:
        return np.ones(self.num_clients, dtype=bool)

    @property
    def fixed_count(self) -> int | None:
        return self.num_clients


class UniformParticipation(ParticipationSampler):
    """``m = max(1, round(C * N))`` clients drawn uniformly without replacement each round."""

    def __init__(self, num_clients: int, rng: np.random.Generator, fraction: float) -> None:
        super().__init__(num_clients, rng)
        self.num_sampled = max(1, round(fraction * num_clients))

    def sample(self) -> np.ndarray:
        mask = np.zeros(self.num_clients, dtype=bool)
        mask[self.rng.choice(self.num_clients, self.num_sampled, replace=False)] = True
        return mask

    @property
    def fixed_count(self) -> int | None:
        return self.num_sampled


class BernoulliParticipation(ParticipationSampler):
    """``I_t^n ~ Bernoulli(p_n)``, independent across rounds and clients."""

    def __init__(
        self, num_clients: int, rng: np.random.Generator, probabilities: np.ndarray
    ) -> None:
        super().__init__(num_clients, rng)
        self.probabilities = probabilities

    def sample(self) -> np.ndarray:
        return self.rng.random(self.num_clients) < self.probabilities

    @property
    def fixed_count(self) -> int | None:
        return self.num_clients if bool(np.all(self.probabilities >= 1)) else None


class MarkovParticipation(ParticipationSampler):
    """A two-state chain per client with stationary probability ``p_n`` of being active.

    ``P(off -> on) = delta`` and ``P(on -> off) = delta (1/p_n - 1)``; when the latter exceeds
    1 it is set to 1 and ``P(off -> on) = p_n / (1 - p_n)``. The initial state is
    ``Bernoulli(p_n)``, and each round first moves the chain, then reports its state.
    """

    def __init__(
        self, num_clients: int, rng: np.random.Generator, probabilities: np.ndarray, delta: float
    ) -> None:
        super().__init__(num_clients, rng)
        self.probabilities = p = probabilities
        with np.errstate(divide="ignore", invalid="ignore"):
            to_off = np.where(p > 0, delta * (1.0 / np.maximum(p, 1e-300) - 1.0), np.inf)
            saturated = to_off > 1.0
            self.to_on = np.where(saturated, p / np.maximum(1.0 - p, 1e-300), delta)
        self.to_off = np.where(saturated, 1.0, to_off)
        self.state = self.rng.random(num_clients) < p

    def sample(self) -> np.ndarray:
        u = self.rng.random(self.num_clients)
        self.state = np.where(self.state, u >= self.to_off, u < self.to_on)
        return self.state.copy()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "state": self.state.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.state = np.array(state["state"], dtype=bool)


class CyclicParticipation(ParticipationSampler):
    """Deterministic on/off cycles of length ``C`` with a random phase.

    Client n is active for ``a_n = max(1, round(C p_n))`` rounds and inactive for
    ``max(1, C - a_n)``. It starts inactive with ``randint(0, inactive - 1)`` rounds left;
    each round, when no rounds are left it toggles and restarts the count with the new state's
    length, then counts down and reports its state.
    """

    def __init__(
        self,
        num_clients: int,
        rng: np.random.Generator,
        probabilities: np.ndarray,
        cycle_length: int,
    ) -> None:
        super().__init__(num_clients, rng)
        self.probabilities = probabilities
        self.active_rounds = np.maximum(1, np.round(cycle_length * probabilities)).astype(np.int64)
        self.inactive_rounds = np.maximum(1, cycle_length - self.active_rounds)
        self.state = np.zeros(num_clients, dtype=bool)
        self.rounds_left = self.rng.integers(0, self.inactive_rounds)

    def sample(self) -> np.ndarray:
        switch = self.rounds_left == 0
        self.state = np.where(switch, ~self.state, self.state)
        length = np.where(self.state, self.active_rounds, self.inactive_rounds)
        self.rounds_left = np.where(switch, length, self.rounds_left) - 1
        return self.state.copy()

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "state": self.state.tolist(),
            "rounds_left": self.rounds_left.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.state = np.array(state["state"], dtype=bool)
        self.rounds_left = np.array(state["rounds_left"], dtype=np.int64)


def client_probabilities(
    config: ParticipationConfig, federation: Federation, seed: int
) -> np.ndarray:
    """The stationary ``p_n`` of each client (see the module docstring)."""
    n = federation.num_clients
    if config.probabilities is not None:
        if len(config.probabilities) != n:
            count = len(config.probabilities)
            raise ConfigError(f"participation.probabilities has {count} values for {n} clients")
        return np.asarray(config.probabilities, dtype=np.float64)
    if config.probability_model == "constant":
        return np.full(n, config.fraction)
    q = seeding.numpy_rng(seed, seeding.PARTICIPATION, 1).dirichlet(
        np.full(federation.num_classes, config.label_concentration)
    )
    kappa = federation.label_distributions()
    return np.clip(
        federation.num_classes * config.fraction * kappa @ q, config.min_probability, 1.0
    )


def build_sampler(
    config: ParticipationConfig, federation: Federation, seed: int
) -> ParticipationSampler:
    """The sampler ``config`` names, with its generator seeded by ``(seed, PARTICIPATION)``."""
    n = federation.num_clients
    rng = seeding.numpy_rng(seed, seeding.PARTICIPATION)
    if config.kind == "full":
        return FullParticipation(n, rng)
    if config.kind == "uniform":
        return UniformParticipation(n, rng, config.fraction)
    p = client_probabilities(config, federation, seed)
    if config.kind == "bernoulli":
        return BernoulliParticipation(n, rng, p)
    if config.kind == "markov":
        return MarkovParticipation(n, rng, p, config.markov_delta)
    return CyclicParticipation(n, rng, p, config.cycle_length)
