"""Federated-learning algorithms as strategies on the shared simulation loop.

Each module defines one algorithm and registers it; ``fedkernels run --algorithm NAME``
and :func:`build_strategy` choose from the registry:

- ``fedavg``: :class:`~fedkernels.algorithms.fedavg.FedAvg` (with ``server.optimizer`` it is
  also FedAvgM, FedAdam, FedYogi, FedAdagrad);
- ``fedprox``: :class:`~fedkernels.algorithms.fedprox.FedProx`;
- ``superfed-mm``, ``superfed-lm``: :mod:`~fedkernels.algorithms.superfed` (personalized);
- ``fedmedian``, ``trimmed-mean``, ``krum``, ``multikrum``, ``bulyan``:
  :mod:`~fedkernels.algorithms.robust` (Byzantine-robust rules).
"""

# Importing an algorithm's module registers it.
# Fair and participation-aware aggregation: q-FFL, q-FedAvg, AFL, TERM, PropFair,
# GiFair, Delta-FL, FedMGDA+, VRed, Semi-VRed; FedAU, MIFA, FedVARP and the averaging
# baselines; AAggFF-S/-D.
# Ensemble distillation: feddf, fedet, entropy-kd, dafkd, fedgo.
# FedEvg, federated energy-based synthetic data.
from . import (  # noqa: E402,F401
    aaggff,
    distillation,  # noqa: E402,F401
    fairness,
    fedevg,  # noqa: E402,F401
    participation,
    personalized,  # local, fedavg-ft, fedper, fedrep, lg-fedavg, apfl, ditto, pfedme
    robust,  # fedmedian, trimmed-mean, krum, multikrum, bulyan
)
from .fedavg import FedAvg
from .fedprox import FedProx, FedProxConfig
from .registry import available, build_strategy, register, strategy_class
from .superfed import SuPerFedConfig, SuPerFedLM, SuPerFedMM  # noqa: E402

__all__ = [
    "FedAvg",
    "FedProx",
    "FedProxConfig",
    "SuPerFedConfig",
    "SuPerFedLM",
    "SuPerFedMM",
    "available",
    "build_strategy",
    "register",
    "strategy_class",
]
