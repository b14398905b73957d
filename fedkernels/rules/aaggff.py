r"""AAggFF (Hahn, Kim, Lee, ICML 2024): fair aggregation as online convex optimisation
(equations, defaults and the paper-versus-code table: ``docs/algorithms/aaggff.md``). The
decision logic, framework-neutral: the simulator's ``aaggff-s``/``aaggff-d`` strategies and the
Flower ``AAggFF`` strategy keep one decision object each.

Each round the server observes the participants' losses :math:`F_i` of the current global
model (before local training), turns them into responses

.. math:: x_i = F_i / \bar F,\qquad r_i = C_1 + (C_2 - C_1)\,\mathrm{CDF}(x_i)

(:math:`\bar F` the plain mean over the participants; six CDFs, :func:`cdf_transform`), and
plays a decision :math:`p \in \Delta_{N-1}` against the loss
:math:`\ell(p) = -\log(1 + \langle p, r\rangle)`. The new decision
:math:`p^{(t+1)}` is applied at once to the round's updates: :math:`w_i = p_i / \sum_{j \in S}
p_j`.

- **AAggFF-S** (cross-silo, every client every round): online Newton step in FTRL form,
  :math:`C_2 = 1/N`, :math:`\alpha = 4`, :math:`\beta = N/4`,
  :math:`p^{(t+1)} = \arg\min_\Delta \tfrac12 p^\top(\alpha I + \beta A_t)p + c_t^\top p`
  with :math:`A_t = \sum g g^\top`, :math:`c_t = \sum g (1 - \beta\langle g, p^{(\tau)}\rangle)`,
  :math:`g = -r/(1 + \langle p, r\rangle)`, solved exactly by an active-set method.
- **AAggFF-D** (cross-device, sampled clients): doubly-robust response estimate
  :math:`\tilde r_i = \bar r + \mathbb 1[i \in S](r_i - \bar r)/\pi_i`, linearised gradient
  :math:`\tilde g = -\tilde r/(1 + \bar r\sum p) + \bar r\langle p, \tilde r - \bar r\rangle/(1 +
  \bar r \sum p)^2`, and closed-form entropic FTRL
  :math:`p^{(t+1)} = \mathrm{softmax}(-\sqrt{\log N}\,G_t / ((C + 2)\sqrt{t+1}))`,
  :math:`C_2 = C`.

``variant="official"`` reproduces the authors' code where it differs from the paper: ONS with
:math:`(\alpha + \alpha\beta) I + \beta A` and no cross term; the DR estimate without
:math:`+\bar r` for sampled clients; :math:`p^{(1)} = C\cdot 1`.
``official_normal_cdf`` reproduces the code's inverted Normal transform.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .simplex import simplex_qp

__all__ = ["CDFS", "AAggFFDDecision", "AAggFFSDecision", "cdf_transform"]

CDFS = ("weibull", "exponential", "frechet", "normal", "gumbel", "logistic")


def cdf_transform(
    losses: np.ndarray,
    cdf: str,
    low: float = 0.0,
    high: float = 1.0,
    official_normal: bool = False,
) -> np.ndarray:
    r"""``low + (high - low) * CDF(F_i / mean(F))``, every scale 1:

    weibull :math:`1 - e^{-x^2}`; exponential :math:`1 - e^{-x}`; frechet :math:`e^{-1/x}`;
    normal :math:`\Phi(x - 1)`; gumbel :math:`e^{-e^{-(x-1)}}`; logistic
    :math:`1/(1 + e^{-(x-1)})`. All-zero losses give the uniform response ``x = 1``.
    ``official_normal``: the code's :math:`\tfrac12(\mathrm{erfc}((x-1)/\sqrt2) + 1)`."""
    f = np.asarray(losses, dtype=np.float64)
    mean = f.mean()
    x = f / mean if mean > 0 else np.ones_like(f)
    if cdf == "weibull":
        y = 1.0 - np.exp(-(x**2))
    elif cdf == "exponential":
        y = 1.0 - np.exp(-x)
    elif cdf == "frechet":
        y = np.exp(-1.0 / np.maximum(x, 1e-12))
    elif cdf == "normal":
        erf = np.vectorize(math.erf)
        erfc = np.vectorize(math.erfc)
        z = (x - 1.0) / math.sqrt(2.0)
        y = 0.5 * (erfc(z) + 1.0) if official_normal else 0.5 * (1.0 + erf(z))
    elif cdf == "gumbel":
        y = np.exp(-np.exp(-(x - 1.0)))
    elif cdf == "logistic":
        y = 1.0 / (1.0 + np.exp(-(x - 1.0)))
    else:
        raise ValueError(f"unknown CDF {cdf!r} (one of {', '.join(CDFS)})")
    return low + (high - low) * y


class _Decision:
    """The decision :math:`p` over N clients and the response transform both variants share."""

    def __init__(self, cdf: str = "weibull", variant: str = "paper",
                 official_normal_cdf: bool = False) -> None:
        self.cdf, self.variant, self.official_normal_cdf = cdf, variant, official_normal_cdf

    def responses(self, losses: Tensor, high: float) -> np.ndarray:
        return cdf_transform(losses.double().numpy(), self.cdf, 0.0, high,
                             self.official_normal_cdf)


class AAggFFSDecision(_Decision):
    r"""AAggFF-S's decision: the online Newton step over all N clients, which needs every
    client's loss every round (module docstring)."""

    def __init__(self, num_clients: int, *, cdf: str = "weibull", variant: str = "paper",
                 official_normal_cdf: bool = False) -> None:
        super().__init__(cdf, variant, official_normal_cdf)
        n = num_clients
        self.alpha, self.beta = 4.0, n / 4.0  # 4 N L, 1/(4 L) with L = C2 = 1/N
        official = variant == "official"
        self.decision = torch.full((n,), 1.0 if official else 1.0 / n, dtype=torch.float64, device="cpu")
        self.quadratic = torch.eye(n, dtype=torch.float64, device="cpu") * (self.alpha if official else 0.0)
        self.linear = torch.zeros(n, dtype=torch.float64, device="cpu")

    def step(self, losses: Tensor) -> np.ndarray:
        """One decision update from all N clients' losses; returns the new decision."""
        n = len(self.decision)
        r = self.responses(losses, 1.0 / n)
        p = self.decision.numpy()
        g = -r / (1.0 + p @ r)
        a = self.quadratic.numpy() + np.outer(g, g)
        if self.variant == "official":
            c = self.linear.numpy() + g
            q = self.alpha * np.eye(n) + self.beta * a  # a started at alpha I
        else:
            c = self.linear.numpy() + g * (1.0 - self.beta * (g @ p))
            q = self.alpha * np.eye(n) + self.beta * a
        new = simplex_qp(q, c, 0.0, np.inf, start=None)
        self.quadratic = torch.from_numpy(a)
        self.linear = torch.from_numpy(c)
        self.decision = torch.from_numpy(new)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "quadratic": self.quadratic, "linear": self.linear}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decision = state["decision"].clone()
        self.quadratic = state["quadratic"].clone()
        self.linear = state["linear"].clone()


class AAggFFDDecision(_Decision):
    r"""AAggFF-D's decision: doubly-robust responses of the sampled clients and closed-form
    linearised FTRL over all N (module docstring)."""

    def __init__(self, num_clients: int, *, cdf: str = "weibull", variant: str = "paper",
                 official_normal_cdf: bool = False) -> None:
        super().__init__(cdf, variant, official_normal_cdf)
        n = num_clients
        self.decision = torch.full((n,), 1.0 / n, dtype=torch.float64, device="cpu")
        self.gradient_sum = torch.zeros(n, dtype=torch.float64, device="cpu")
        self.started = False

    def step(self, ids: np.ndarray, losses: np.ndarray, pi: np.ndarray, t: int) -> np.ndarray:
        """One FTRL update in round ``t`` (1-based) from the participants ``ids``' losses, with
        inclusion probabilities ``pi`` (``[N]``); returns the new decision."""
        n = len(pi)
        c = float(pi.mean())
        official = self.variant == "official"
        if not self.started:
            if official:
                self.decision = torch.full((n,), c, dtype=torch.float64, device="cpu")
            self.started = True
        r_s = self.responses(torch.from_numpy(np.asarray(losses, dtype=np.float64)), c)
        r_bar = float(r_s.mean())
        r = np.full(n, r_bar)
        r[ids] = (0.0 if official else r_bar) + (r_s - r_bar) / pi[ids]
        p = self.decision.numpy()
        denominator = 1.0 + r_bar * p.sum()
        g = -r / denominator + r_bar * (p @ (r - r_bar)) / denominator**2
        total = self.gradient_sum.numpy() + g
        logits = -math.sqrt(math.log(n)) * total / ((c + 2.0) * math.sqrt(t + 1))
        logits -= logits.max()
        new = np.exp(logits)
        new /= new.sum()
        self.gradient_sum = torch.from_numpy(total)
        self.decision = torch.from_numpy(new)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "gradient_sum": self.gradient_sum,
            "started": self.started,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decision = state["decision"].clone()
        self.gradient_sum = state["gradient_sum"].clone()
        self.started = bool(state["started"])
