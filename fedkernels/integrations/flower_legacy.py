"""The former path of :mod:`fedkernels.integrations.flower.legacy` (drop-ins for Flower's
legacy strategies), kept so that existing imports work."""

import warnings

from fedkernels.integrations.flower.legacy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedProx,
    FedYogi,
    QFedAvg,
    aggregate_inplace,
    aggregate_ndarrays,
    parameters_to_arrays,
)

__all__ = [
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedProx",
    "FedYogi",
    "QFedAvg",
    "aggregate_inplace",
    "aggregate_ndarrays",
    "parameters_to_arrays",
]

warnings.warn(f"{__name__} is deprecated and will be removed in fedkernels 0.2: "
              "import from fedkernels.integrations.flower.legacy", DeprecationWarning, stacklevel=2)
