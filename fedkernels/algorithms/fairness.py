r"""Fair aggregation: strategies that weight clients by the loss of the current global model.

All of them see :math:`f_k = f_k(x_t)`, the mean cross-entropy of the global model on client
k's training split before local training (``loss_source="global"``, the FairFL convention),
or the mean of the client's local minibatch losses (``loss_source="local"``, the cheaper
approximation), and return weights :math:`w_k` of the server's combine
:math:`\Delta_t = \sum_k w_k (x_k - x_t)`. With :math:`p_k = n_k / \sum_{j \in S_t} n_j` (the
participants' data fractions) the rules are (derivations, defaults and citations:
``docs/algorithms/fairness.md``; the pure weight functions: :mod:`fedkernels.rules.fairness_weights`):

=============  ==========================================================================
``qffl``       :math:`w_k \propto n_k f_k^q` (q-FFL as mixing weights)
``qfedavg``    q-FedAvg (Li et al. 2020; Flower's ``QFedAvg``):
               :math:`h_k = q f_k^{q-1} L^2 \|x_k - x_t\|^2 + L f_k^q`,
               :math:`w_k = L f_k^q / \sum_j h_j`
``afl``        :math:`\lambda_S \leftarrow \Pi_\Delta(\lambda_S + \gamma f_S)`, :math:`w = \lambda_S`
``term``       :math:`w = \mathrm{softmax}(\tau f + \log p)` (official AAggFF code: no
               :math:`\log p`)
``propfair``   FedAvg server; client loss :math:`-\log(1 - \ell/M)` (:math:`\ell/M` when
               :math:`M - \ell < \epsilon`)
``gifair``     :math:`w_k = p_k + \lambda (2\,\mathrm{rank}_k - (m+1))`,
               :math:`\lambda = c \min_j p_j / (m-1)`
``delta-fl``   CVaR weights of the worst :math:`\alpha` mass of clients
``fedmgda``    :math:`\lambda^* = \arg\min_{\lambda \in \Delta, |\lambda_k - 1/m| \le
               \epsilon} \|\sum_k \lambda_k d_k\|^2`, :math:`d_k = u_k/\|u_k\|`,
               :math:`w_k = \lambda_k / \|u_k\|`
``vred``       :math:`w_k = p_k (1 + 2\beta (a_k - A))`, :math:`a_k = f_k - \bar f`
``semi-vred``  the same with :math:`a_k = (f_k - \bar f)_+`, :math:`A = \sum_j p_j a_j`
=============  ==========================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from fedkernels.aggregate import FLOAT32_MAX
from fedkernels.rules.fairness_weights import (
    cvar_weights,
    qfedavg_weights,
    qffl_weights,
    superquantile_selection,
    term_weights,
    vred_weights,
)
from fedkernels.rules.simplex import project_simplex, simplex_qp
from fedkernels.sim.config import ConfigError
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import RoundInfo, SetupInfo, Strategy

from .registry import register
from .update_stats import update_gram, update_sq_norms


def _help(default: Any, text: str) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class LossConfig:
    """The signal every loss-based strategy reads."""

    loss_source: Literal["global", "local"] = _help(
        "global",
        "f_k: loss of the global model on the client's train split before local training "
        "(global), or the mean local minibatch loss (local, no extra forward pass)",
    )


class LossWeighted(Strategy):
    """Base class: reads :math:`f_k` and :math:`p_k`, logs the weights' range."""

    config_class = LossConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.wants_global_loss = self.config.loss_source == "global"

    def losses(self, info: RoundInfo) -> Tensor:
        """:math:`f_k` of the participants, float64 ``[K]``; a NaN or infinite one (the
        training diverged) stops the run with a one-line error instead of NaN weights."""
        if self.config.loss_source == "global":
            if info.global_losses is None:
                raise RuntimeError(f"{self.name}: the simulation did not compute global losses")
            losses = info.global_losses.double()
        else:
            losses = info.train_losses.double()
        bad = (~torch.isfinite(losses)).nonzero().flatten()
        if len(bad):
            which = "global model's loss" if self.config.loss_source == "global" else \
                "mean local training loss"
            clients = info.participants[bad].tolist()
            raise ConfigError(
                f"round {info.round + 1}: the training diverged: the {which} f_k is "
                f"{float(losses[bad[0]])} on clients {clients}, so {self.name} cannot weight the "
                "clients by it; lower client.lr (or attack.scale)"
            )
        return losses

    @staticmethod
    def data_fractions(info: RoundInfo) -> Tensor:
        """:math:`p_k = n_k / \\sum_{j \\in S_t} n_j`."""
        return info.num_samples / info.num_samples.sum()

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        weights = self.client_weights(info)
        largest = float(weights.abs().max())
        if not math.isfinite(largest) or largest > FLOAT32_MAX:
            params = ", ".join(f"{self.name}.{k}={v}" for k, v in vars(self.config).items()
                               if isinstance(v, float))
            raise ConfigError(
                f"round {info.round + 1}: {self.name}'s client weights reach {largest:.3g}, beyond "
                f"what the server can apply (|w| <= {FLOAT32_MAX:.3g}); lower {params}"
            )
        server.step(info.client_states, weights, info.round)
        return {"weight_min": float(weights.min()), "weight_max": float(weights.max())}


# ---------------------------------------------------------------- q-FFL


@dataclass
class QFFLConfig(LossConfig):
    q: float = _help(0.1, "fairness exponent q (0 gives FedAvg)")

    def __post_init__(self) -> None:
        if self.q < 0:
            raise ConfigError("qffl.q must be >= 0")


@register
class QFFL(LossWeighted):
    r"""q-FFL as mixing coefficients (the gradient of its objective, local updates for gradients):
    :math:`w_k = n_k f_k^q / \sum_j n_j f_j^q`."""

    name = "qffl"
    config_class = QFFLConfig

    def client_weights(self, info: RoundInfo) -> Tensor:
        return qffl_weights(info.num_samples, self.losses(info), self.config.q)


@dataclass
class QFedAvgConfig(LossConfig):
    q: float = _help(0.1, "fairness exponent q")
    lipschitz: float | None = _help(
        None, "L of the step 1/L (default: 1 / client.lr, the local learning rate of round 0)"
    )

    def __post_init__(self) -> None:
        if self.q < 0:
            raise ConfigError("qfedavg.q must be >= 0")
        if self.lipschitz is not None and self.lipschitz <= 0:
            raise ConfigError("qfedavg.lipschitz must be > 0")


@register
class QFedAvg(LossWeighted):
    r"""q-FedAvg (Li, Sanjabi, Beirami, Smith, ICLR 2020), the form of Flower's ``QFedAvg``
    but with each client's own loss :math:`f_k` (Flower uses one server-side loss for all):

    .. math:: \Delta w_k = L (x_t - x_k),\quad
              h_k = q (f_k + \epsilon)^{q-1} \|\Delta w_k\|^2 + L (f_k + \epsilon)^q,\quad
              x_{t+1} = x_t - \frac{\sum_k (f_k + \epsilon)^q \Delta w_k}{\sum_k h_k}

    with :math:`\epsilon = 10^{-10}`; as weights on :math:`x_k - x_t`:
    :math:`w_k = L (f_k+\epsilon)^q / \sum_j h_j`. The squared norms come from one fused
    ``_foreach_norm`` over all participants' tensors."""

    name = "qfedavg"
    config_class = QFedAvgConfig

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        lr = getattr(info.client_config, "lr", None)
        if self.config.lipschitz is not None:
            self.lipschitz = self.config.lipschitz
        elif lr:
            self.lipschitz = 1.0 / lr
        else:
            raise ConfigError("qfedavg: set qfedavg.lipschitz (no client learning rate known)")

    def client_weights(self, info: RoundInfo) -> Tensor:
        sq_norms = update_sq_norms(info.client_states, info.global_state, self.info.parameter_names)
        return qfedavg_weights(self.losses(info), sq_norms, self.config.q, self.lipschitz)


# ---------------------------------------------------------------- AFL


@dataclass
class AFLConfig(LossConfig):
    step: float = _help(0.1, "dual step gamma_lambda of lambda <- Proj(lambda + gamma f)")
    init: Literal["sizes", "uniform"] = _help(
        "sizes", "lambda_0: data fractions n_k/n (FairFL) or 1/N"
    )

    def __post_init__(self) -> None:
        if self.step <= 0:
            raise ConfigError("afl.step must be > 0")


@register
class AFL(LossWeighted):
    r"""Agnostic FL (Mohri et al. 2019) as in FairFL/AAggFF's code: projected dual ascent
    :math:`\lambda_S \leftarrow \Pi_\Delta(\lambda_S + \gamma f_S)` over the participants'
    entries (the others are kept), then :math:`w = \lambda_S`."""

    name = "afl"
    config_class = AFLConfig

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        n = info.train_sizes.double()
        if self.config.init == "sizes":
            self.dual = n / n.sum()
        else:
            self.dual = torch.full((info.num_clients,), 1.0 / info.num_clients,
                                   dtype=torch.float64, device="cpu")

    def client_weights(self, info: RoundInfo) -> Tensor:
        ids = info.participants
        moved = self.dual[ids] + self.config.step * self.losses(info)
        self.dual[ids] = torch.from_numpy(project_simplex(moved.numpy()))
        return self.dual[ids].clone()

    def state_dict(self) -> dict[str, Any]:
        return {"dual": self.dual.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dual = state["dual"].clone()


# ---------------------------------------------------------------- TERM


@dataclass
class TERMConfig(LossConfig):
    tilt: float = _help(0.1, "tilt tau of (1/tau) log sum p_k exp(tau f_k)")
    use_sizes: bool = _help(
        True, "include p_k (paper); false drops it, as the official AAggFF code does"
    )


@register
class TERM(LossWeighted):
    r"""Tilted ERM at client level (Li et al. 2021):
    :math:`w = \mathrm{softmax}(\tau f + \log p)`, i.e. :math:`w_k \propto p_k e^{\tau f_k}`."""

    name = "term"
    config_class = TERMConfig

    def client_weights(self, info: RoundInfo) -> Tensor:
        return term_weights(info.num_samples, self.losses(info), self.config.tilt,
                            self.config.use_sizes)


# ---------------------------------------------------------------- PropFair


@dataclass
class PropFairConfig:
    utility_bound: float = _help(3.0, "M of -log(M - loss) (the paper's grid: 2, 3, 4, 5)")
    epsilon: float = _help(0.2, "below M - loss < epsilon the loss becomes loss / M")

    def __post_init__(self) -> None:
        if self.utility_bound <= self.epsilon or self.epsilon <= 0:
            raise ConfigError("propfair needs utility_bound > epsilon > 0")
        if self.utility_bound > FLOAT32_MAX:
            raise ConfigError(f"propfair.utility_bound must be at most {FLOAT32_MAX:.4g} (the "
                              "float32 range of the losses it bounds)")


@register
class PropFair(Strategy):
    r"""PropFair (Zhang et al. 2023): FedAvg's server (:math:`w_k = n_k/\sum n_j`), and every
    local minibatch loss :math:`\ell` replaced by :math:`-\log(1 - \ell/M)` (gradient
    :math:`\nabla\ell/(M - \ell)`), or by :math:`\ell/M` where :math:`M - \ell < \epsilon`."""

    name = "propfair"
    config_class = PropFairConfig

    def transform_local_loss(self, loss: Tensor) -> Tensor:
        m, eps = self.config.utility_bound, self.config.epsilon
        safe = loss.clamp(max=m - eps)  # keeps the unused branch finite (NaN-free gradients)
        return torch.where(m - loss >= eps, -torch.log1p(-safe / m), loss / m)

    def client_weights(self, info: RoundInfo) -> Tensor:
        return info.num_samples / info.num_samples.sum()


# ---------------------------------------------------------------- GiFair


@dataclass
class GiFairConfig(LossConfig):
    coefficient: float = _help(
        1.0, "lambda as a fraction of its bound min_k p_k / (m - 1) (1 keeps weights >= 0)"
    )


@register
class GiFair(LossWeighted):
    r"""GiFair with groups of one client (Yue et al.; FairFL's rule): with
    :math:`\mathrm{rank}_k = 1` for the smallest loss,
    :math:`w_k = p_k + \lambda (2\,\mathrm{rank}_k - (m+1))`, :math:`\lambda = c\min_j p_j/(m-1)`.
    The offsets sum to 0, so :math:`\sum w = 1`."""

    name = "gifair"
    config_class = GiFairConfig

    def client_weights(self, info: RoundInfo) -> Tensor:
        p = self.data_fractions(info)
        m = len(p)
        if m == 1:
            return p
        lam = self.config.coefficient * float(p.min()) / (m - 1)
        ranks = torch.empty(m, dtype=torch.float64, device="cpu")
        ranks[torch.argsort(self.losses(info), stable=True)] = torch.arange(
            1, m + 1, dtype=torch.float64, device="cpu"
        )
        return p + lam * (2.0 * ranks - (m + 1))


# ---------------------------------------------------------------- Delta-FL


@dataclass
class DeltaFLConfig(LossConfig):
    alpha: float = _help(0.5, "mass alpha of the worst clients averaged (CVaR level)")
    variant: Literal["paper", "official"] = _help(
        "paper",
        "paper: exact CVaR weights (fractional client at the boundary); official "
        "(simplicial-fl): clients with f_k >= the p-weighted (1-alpha)-quantile, weights n_k",
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError("delta-fl.alpha must be in (0, 1]")


@register
class DeltaFL(LossWeighted):
    r"""Δ-FL / superquantile FL (Laguel et al.; Pillutla et al.): minimise
    :math:`\mathrm{CVaR}_{1-\alpha}` of the client losses, i.e. aggregate with the weights
    that put mass :math:`p_k/\alpha` on the worst clients
    (:func:`~fedkernels.rules.fairness_weights.cvar_weights`). The orientation of α (mass of
    the *worst* clients) is our reading: the papers do not state it."""

    name = "delta-fl"
    config_class = DeltaFLConfig

    def client_weights(self, info: RoundInfo) -> Tensor:
        f = self.losses(info).numpy()
        p = self.data_fractions(info).numpy()
        rule = cvar_weights if self.config.variant == "paper" else superquantile_selection
        return torch.from_numpy(rule(f, p, self.config.alpha))


# ---------------------------------------------------------------- FedMGDA+


@dataclass
class FedMGDAConfig:
    epsilon: float = _help(0.2, "largest deviation |lambda_k - 1/m| from uniform")

    def __post_init__(self) -> None:
        if self.epsilon < 0:
            raise ConfigError("fedmgda.epsilon must be >= 0")


@register
class FedMGDA(Strategy):
    r"""FedMGDA+ (Hu et al. 2022): normalised updates :math:`d_k = u_k/\|u_k\|`,
    :math:`\lambda^* = \arg\min \lambda^\top D \lambda` over the simplex with
    :math:`\max(0, 1/m - \epsilon) \le \lambda_k \le 1/m + \epsilon` (:math:`D_{jk} =
    \langle d_j, d_k\rangle`, from one Gram matmul of the flattened updates), solved exactly by
    :func:`~fedkernels.algorithms.simplex.simplex_qp`; the server moves by
    :math:`\eta\sum_k \lambda_k d_k`, i.e. :math:`w_k = \lambda_k/\|u_k\|`."""

    name = "fedmgda"
    config_class = FedMGDAConfig

    def client_weights(self, info: RoundInfo) -> Tensor:
        gram = update_gram(info.client_states, info.global_state, self.info.parameter_names)
        norms = gram.diagonal().clamp_min(0).sqrt()
        m = len(norms)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        unit = (gram / safe[:, None] / safe[None, :]).numpy()
        eps = self.config.epsilon
        lam = simplex_qp(
            unit + 1e-12 * np.eye(m), np.zeros(m), max(0.0, 1.0 / m - eps), 1.0 / m + eps
        )
        self.last_lambda = lam
        return torch.where(norms > 0, torch.from_numpy(lam) / safe, torch.zeros_like(norms))


# ---------------------------------------------------------------- VRed / Semi-VRed


@dataclass
class VRedConfig(LossConfig):
    beta: float = _help(0.1, "variance penalty beta (the paper's grid: 0.01 ... 1)")
    clamp_negative: bool = _help(
        False, "clip negative weights at 0 and renormalise (the paper does not)"
    )

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise ConfigError("beta must be >= 0")


@register
class VRed(LossWeighted):
    r"""Variance reduction (Malekmohammadi & Yu): the gradient of
    :math:`\sum p_k f_k + \beta \sum p_k (f_k - \bar f)^2` with pseudo-gradients for
    :math:`\nabla f_k` gives :math:`w_k = p_k (1 + 2\beta (a_k - A))`, :math:`a_k = f_k -
    \bar f`, :math:`\bar f = \sum p_j f_j`, :math:`A = \sum p_j a_j` (0 here); :math:`\sum w = 1`
    and weights may be negative."""

    name = "vred"
    config_class = VRedConfig
    semi = False

    def client_weights(self, info: RoundInfo) -> Tensor:
        return vred_weights(info.num_samples, self.losses(info), self.config.beta, self.semi,
                            self.config.clamp_negative)


@register
class SemiVRed(VRed):
    r"""Semi-variance reduction: as :class:`VRed` with the downside semi-variance
    :math:`\beta \sum p_k (f_k - \bar f)_+^2`, so :math:`a_k = (f_k - \bar f)_+` and
    :math:`A = \sum_j p_j a_j`; clients below the mean all share the same reduction."""

    name = "semi-vred"
    semi = True


__all__ = [
    "AFL",
    "QFFL",
    "TERM",
    "DeltaFL",
    "FedMGDA",
    "GiFair",
    "LossWeighted",
    "PropFair",
    "QFedAvg",
    "SemiVRed",
    "VRed",
]
