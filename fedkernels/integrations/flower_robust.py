"""The former path of :mod:`fedkernels.integrations.flower.robust` and
:mod:`fedkernels.integrations.flower.central_dp` (Flower's robust and DP Message-API
strategies), kept so that existing imports work."""

import warnings

from fedkernels.integrations.flower.central_dp import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)
from fedkernels.integrations.flower.robust import (
    Bulyan,
    FedMedian,
    FedTrimmedAvg,
    Krum,
    MultiKrum,
    select_multikrum,
)

__all__ = [
    "Bulyan",
    "DifferentialPrivacyServerSideAdaptiveClipping",
    "DifferentialPrivacyServerSideFixedClipping",
    "FedMedian",
    "FedTrimmedAvg",
    "Krum",
    "MultiKrum",
    "select_multikrum",
]

warnings.warn(f"{__name__} is deprecated and will be removed in fedkernels 0.2: "
              "import from fedkernels.integrations.flower.robust / .central_dp",
              DeprecationWarning, stacklevel=2)
