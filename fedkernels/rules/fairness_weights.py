r"""Client weights from the clients' losses, the rules of the fair-aggregation methods:
pure functions of :math:`n_k` (sample counts) and :math:`f_k` (losses), shared by the
simulator's strategies (:mod:`fedkernels.algorithms.fairness`, whose docstring has the table
of rules) and the Flower strategies. Derivations and defaults: ``docs/algorithms/fairness.md``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["cvar_weights", "qfedavg_weights", "qffl_weights", "superquantile_selection",
           "term_weights", "vred_weights"]


def qffl_weights(num_samples: Tensor, losses: Tensor, q: float) -> Tensor:
    r""":math:`w_k = n_k f_k^q / \sum_j n_j f_j^q` (losses clamped at 1e-12)."""
    f = losses.clamp_min(1e-12)
    raw = num_samples * f**q
    w = raw / raw.sum()
    if not bool(torch.isfinite(w).all()):
        # f^q overflowed (or underflowed to 0 for all) for a large q: the same ratio in logs
        w = torch.softmax(num_samples.log() + q * f.log(), dim=0)
    return w


def qfedavg_weights(losses: Tensor, sq_norms: Tensor, q: float, lipschitz: float) -> Tensor:
    r"""q-FedAvg's weights on :math:`x_k - x_t`: :math:`w_k = L (f_k+\epsilon)^q / \sum_j h_j`,
    :math:`h_k = q (f_k+\epsilon)^{q-1} L^2 \|x_k - x_t\|^2 + L (f_k+\epsilon)^q`,
    :math:`\epsilon = 10^{-10}` (``sq_norms``: :math:`\|x_k - x_t\|^2`)."""
    f = losses + 1e-10
    h = q * f ** (q - 1.0) * lipschitz**2 * sq_norms + lipschitz * f**q
    w = lipschitz * f**q / h.sum()
    if not bool(torch.isfinite(w).all()):
        # a power overflowed (large q, tiny L): the same ratio in logs
        log_f = f.log()
        log_num = math.log(lipschitz) + q * log_f
        log_step = (math.log(q) if q > 0 else -math.inf) + (q - 1.0) * log_f \
            + 2 * math.log(lipschitz) + sq_norms.log()
        w = torch.exp(log_num - torch.logsumexp(torch.cat([log_step, log_num]), dim=0))
    return w


def term_weights(num_samples: Tensor, losses: Tensor, tilt: float, use_sizes: bool = True
                 ) -> Tensor:
    r""":math:`w = \mathrm{softmax}(\tau f + \log p)` with :math:`p_k = n_k/\sum_j n_j`
    (without :math:`\log p` when ``use_sizes`` is false)."""
    logits = tilt * losses
    if use_sizes:
        logits = logits + (num_samples / num_samples.sum()).log()
    return torch.softmax(logits, dim=0)


def vred_weights(num_samples: Tensor, losses: Tensor, beta: float, semi: bool,
                 clamp_negative: bool = False) -> Tensor:
    r"""(Semi-)VRed: :math:`w_k = p_k (1 + 2\beta (a_k - A))`, :math:`a_k = f_k - \bar f`
    (``semi``: :math:`(f_k - \bar f)_+`), :math:`\bar f = \sum p_j f_j`,
    :math:`A = \sum p_j a_j`; ``clamp_negative`` clips at 0 and renormalises."""
    p = num_samples / num_samples.sum()
    a = losses - (p * losses).sum()
    if semi:
        a = a.clamp_min(0.0)
    w = p * (1.0 + 2.0 * beta * (a - (p * a).sum()))
    if clamp_negative:
        w = w.clamp_min(0.0)
        w = w / w.sum()
    return w


def cvar_weights(losses: np.ndarray, p: np.ndarray, alpha: float) -> np.ndarray:
    r"""The maximiser of :math:`\sum_k \pi_k f_k` over :math:`0 \le \pi_k \le p_k/\alpha`,
    :math:`\sum\pi = 1`: clients in decreasing loss get :math:`p_k/\alpha` until the mass
    reaches 1, the boundary client the remainder."""
    order = np.argsort(-losses, kind="stable")
    cap = p[order] / alpha
    before = np.concatenate([[0.0], np.cumsum(cap)[:-1]])
    pi = np.clip(1.0 - before, 0.0, cap)
    out = np.zeros_like(p)
    out[order] = pi
    return out


def superquantile_selection(losses: np.ndarray, p: np.ndarray, alpha: float) -> np.ndarray:
    """simplicial-fl's rule: the p-weighted quantile Q of the losses at level 1 - alpha, and
    weights proportional to p over the clients with loss >= Q."""
    order = np.argsort(losses, kind="stable")
    cumulative = np.cumsum(p[order])
    index = int(np.searchsorted(cumulative, 1.0 - alpha - 1e-12, side="left"))
    threshold = losses[order][min(index, len(p) - 1)]
    chosen = losses >= threshold
    w = np.where(chosen, p, 0.0)
    return w / w.sum()
