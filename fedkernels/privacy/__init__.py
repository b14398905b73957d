"""Central differential privacy: the mechanism (:mod:`.mechanism`: update norms, the clipped
weighted sum plus Gaussian noise, the adaptive clip norm) and its accounting
(:mod:`.accounting`: the ε a run spends, through the optional ``dp-accounting``); the keys and
shares of secure aggregation (:mod:`.secure_aggregation`, imported from there: it needs
`cryptography` and Flower's Shamir helpers)."""

from .accounting import Accountant, dp_accounting_available, epsilon, epsilon_from_rates
from .mechanism import (
    adaptive_clip_norm,
    adaptive_noise_params,
    clip_factors,
    private_aggregate,
    update_norms,
)

__all__ = [
    "Accountant", "dp_accounting_available", "epsilon", "epsilon_from_rates",
    "adaptive_clip_norm", "adaptive_noise_params", "clip_factors", "private_aggregate",
    "update_norms",
]
