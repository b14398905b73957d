"""The former path of :mod:`fedkernels.integrations.flower.legacy_robust` and
:mod:`fedkernels.integrations.flower.legacy_central_dp` (Flower's legacy robust and DP
strategies), kept so that existing imports work."""

import warnings

from fedkernels.integrations.flower.legacy_central_dp import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)
from fedkernels.integrations.flower.legacy_robust import (
    Bulyan,
    FedMedian,
    FedTrimmedAvg,
    Krum,
)

__all__ = [
    "Bulyan",
    "DifferentialPrivacyServerSideAdaptiveClipping",
    "DifferentialPrivacyServerSideFixedClipping",
    "FedMedian",
    "FedTrimmedAvg",
    "Krum",
]

warnings.warn(f"{__name__} is deprecated and will be removed in fedkernels 0.2: "
              "import from fedkernels.integrations.flower.legacy_robust / .legacy_central_dp",
              DeprecationWarning, stacklevel=2)
