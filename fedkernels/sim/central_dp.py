r"""Server-side central differential privacy in the simulator (the ``dp`` section).

With the round's global model :math:`x_t`, the K participants' models :math:`x_k` and the clip
bound :math:`C_t`, the server's averaged model becomes

.. math:: \bar x = x_t + \frac1K \sum_k \min\Big(1, \frac{C_t}{\|x_k - x_t\|}\Big)(x_k - x_t)
          + \mathcal{N}\big(0, (\sigma C_t / K)^2 I\big),

one :func:`fedkernels.privacy.private_aggregate` call, and the server optimizer moves the global
model towards :math:`\bar x` as it would towards the plain average. The norm runs over all
trainable parameters together. The clients count equally (as in DP-FedAvg with a fixed
denominator), so one client moves :math:`\bar x` by at most :math:`C_t / K` and the noise
multiplier :math:`\sigma` is the one the accountant sees; a strategy's own client weights are
not used.

Adaptive clipping (Andrew et al. 2021, with Flower's defaults: initial :math:`C = 0.1`, target
quantile :math:`\gamma = 0.5`, learning rate :math:`\eta_C = 0.2`, count noise
:math:`\sigma_b = K/20`): after the round,
:math:`C_{t+1} = C_t \exp(-\eta_C(\tilde b - \gamma))` with
:math:`\tilde b = (\#\{k : \|x_k - x_t\| \le C_t\} + \sigma_b z) / K` the noised fraction
of updates left unclipped, so :math:`C` settles near the :math:`\gamma`-quantile of the update
norms; the model's noise multiplier is raised to
:math:`(\sigma^{-2} - (2\sigma_b)^{-2})^{-1/2}` (:func:`fedkernels.privacy.adaptive_noise_params`)
so that the two releases (model and count) together cost what one release at :math:`\sigma`
costs. Two differences from Flower's ``DifferentialPrivacyServerSideAdaptiveClipping``: Flower
counts the *clipped* updates in :math:`\tilde b` with the same sign of the step (the paper, and
Flower's older client-side ``DPFedAvgAdaptive``, count the unclipped ones), which shrinks
:math:`C` when most updates are clipped and grows it when few are, away from the target; and
Flower noises the round's model with the bound already updated for the next round, while here
the noise is scaled by the bound that clipped the round's updates, which is what the
sensitivity argument needs.

Noise comes from the streams ``(seed, DP_NOISE, round, 0)`` (model, a generator of the model's
device: the same noise on one device, other noise on another) and ``(..., 1)`` (count, on the
CPU), so a resumed run draws the same noise. :math:`\varepsilon` after each round is computed with
:mod:`fedkernels.privacy` from the rounds' sampling rates (:func:`sampling_rate`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fedkernels.privacy.accounting import dp_accounting_available, epsilon_from_rates
from fedkernels.privacy.mechanism import adaptive_noise_params, private_aggregate

from . import seeding
from .config import ConfigError, PrivacyConfig

INITIAL_ADAPTIVE_CLIP = 0.1  # Flower's initial_clipping_norm


def _device_of(params: dict[str, Tensor]) -> torch.device:
    """Where the model is: the private op draws its noise from a generator of that device."""
    return next(iter(params.values())).device if params else torch.device("cpu")


def sampling_rate(kind: str, probabilities: Any) -> float | None:
    """The sampling rate the accountant is given for a participation pattern: ``None`` for
    ``uniform`` (the round's K / N, a fixed-size random subset), the largest :math:`p_n` for
    ``bernoulli`` (independent draws: Poisson sampling, and the worst-off client's rate), and 1
    (no amplification) for ``full`` and for ``markov`` and ``cyclic``, whose participation is not
    an independent random draw each round."""
    if kind == "uniform":
        return None
    if kind == "bernoulli":
        return float(max(probabilities))
    return 1.0


class CentralPrivacy:
    """Clip, average and noise the clients' models; keeps the clip bound and the sampling
    rates (for the accountant) across rounds and through checkpoints."""

    def __init__(
        self, config: PrivacyConfig, num_clients: int, seed: int, rate: float | None = None
    ) -> None:
        if not config.enabled:
            raise ConfigError("central DP needs dp.clip or dp.adaptive")
        if config.noise_multiplier > 0 and not dp_accounting_available():
            raise ConfigError(
                "dp.noise_multiplier > 0 reports epsilon, which needs the dp extra "
                "(dp-accounting): pip install 'fedkernels[dp]'"
            )
        self.config = config
        self.num_clients = num_clients
        self.seed = seed
        self.delta = config.delta if config.delta is not None else 1.0 / num_clients
        self.clip = config.clip if config.clip is not None else INITIAL_ADAPTIVE_CLIP
        self.rate = rate  # the accountant's q per round; None: the round's K / N
        self.sampling_rates: list[float] = []  # one entry per noised release
        self.last: dict[str, float] | None = None
        self.releases = 0  # noised means released in the current round

    def noise_levels(self, num_sampled: int) -> tuple[float, float]:
        """``(model noise multiplier, std of the clipped count)`` for ``num_sampled`` clients."""
        sigma = self.config.noise_multiplier
        if not self.config.adaptive:
            return sigma, 0.0
        try:
            count_std, model_sigma = adaptive_noise_params(
                sigma, num_sampled, self.config.clipped_count_stddev
            )
        except ValueError:
            count_std = self.config.clipped_count_stddev
            raise ConfigError(
                f"dp.adaptive: noise multiplier {sigma} needs dp.clipped_count_stddev > "
                f"{sigma / 2} (it is {num_sampled / 20 if count_std is None else count_std}; "
                f"default K/20 with K={num_sampled} clients per round): raise it or lower "
                "dp.noise_multiplier"
            ) from None
        return model_sigma, count_std

    def average(
        self, params: dict[str, Tensor], client_params: list[dict[str, Tensor]], round_index: int
    ) -> dict[str, Tensor]:
        """The clipped, noised mean of ``client_params`` around ``params`` (module docstring);
        updates the clip bound (adaptive) and the record of this round."""
        k = len(client_params)
        model_sigma, count_std = self.noise_levels(k)
        clip = self.clip
        noise_std = model_sigma * clip / k
        averaged, norms = private_aggregate(
            client_params,
            base=params,
            clip_norm=clip,
            noise_std=noise_std,
            generator=seeding.generator(self.seed, seeding.DP_NOISE, round_index, 0,
                                        device=_device_of(params)),
        )
        if self.config.adaptive:
            self.clip = self._next_clip(clip, norms, count_std, round_index)
        self.last = {
            "dp_clip": clip,
            "dp_noise_std": noise_std,
            "dp_clipped_fraction": float((norms > clip).double().mean()),
            "dp_update_norm_median": float(norms.double().quantile(0.5)),
        }
        self.releases += 1
        return averaged

    def _next_clip(self, clip: float, norms: Tensor, count_std: float, round_index: int) -> float:
        """Andrew et al.'s geometric step on the noised fraction of unclipped updates."""
        unclipped = float((norms <= clip).sum())
        if count_std > 0:
            g = seeding.generator(self.seed, seeding.DP_NOISE, round_index, 1)
            z = torch.randn((), dtype=torch.float64, generator=g, device="cpu")
            unclipped += count_std * float(z)
        fraction = unclipped / len(norms)
        return clip * math.exp(-self.config.clip_lr * (fraction - self.config.target_quantile))

    def epsilon(self) -> float | None:
        """``epsilon`` at ``delta`` after the rounds so far (``None`` without noise: no finite
        guarantee)."""
        if self.config.noise_multiplier == 0:
            return None
        return epsilon_from_rates(
            self.config.noise_multiplier,
            self.sampling_rates,
            self.delta,
            accountant=self.config.accountant,
        )

    def take_round_record(self, num_participants: int) -> dict[str, Any]:
        """Closes a round of ``num_participants`` clients for the accountant and returns its DP
        metrics (clip, noise, epsilon); raises when clients took part but the strategy did not
        aggregate through the server's weighted mean, so no noise was added."""
        if num_participants and self.last is None:
            raise ConfigError(
                "dp.* needs an algorithm that aggregates through the server's weighted mean "
                "(fedavg, fedprox, ...); this one combines the clients its own way, so no "
                "noise was added"
            )
        rate = num_participants / self.num_clients if self.rate is None else self.rate
        # a round without participants is still one draw of the sampler; a strategy that steps
        # the server twice releases two noised means
        self.sampling_rates += [rate] * max(1, self.releases)
        record: dict[str, Any] = dict(self.last or {})
        record["dp_epsilon"] = self.epsilon()
        self.last, self.releases = None, 0
        return record

    def summary(self) -> dict[str, Any]:
        """What results.json's summary reports about the privacy of the run."""
        eps = self.epsilon()
        return {
            "dp_epsilon": eps,
            "dp_delta": self.delta,
            "dp_noise_multiplier": self.config.noise_multiplier,
            "dp_accountant": self.config.accountant,
            "dp_final_clip": self.clip,
            "dp_releases": len(self.sampling_rates),
            "dp_mean_sampling_rate": (
                math.fsum(self.sampling_rates) / len(self.sampling_rates)
                if self.sampling_rates
                else None
            ),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"clip": self.clip, "sampling_rates": list(self.sampling_rates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip = float(state["clip"])
        self.sampling_rates = [float(q) for q in state["sampling_rates"]]
