"""The former path of :mod:`fedkernels.integrations.flower.legacy` (drop-ins for Flower's
legacy strategies), kept so that existing imports work."""

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
