"""Flower strategies that aggregate with fedkernels (``pip install 'fedkernels[flower]'``).

Message API (``flwr.serverapp.strategy``):

- :mod:`.drop_ins`: ``FedAvg``, ``FedProx``, ``FedAvgM``, ``FedAdam``, ``FedYogi``,
  ``FedAdagrad``, ``QFedAvg``, subclasses of Flower's classes (re-exported here);
- :mod:`.robust`: ``FedMedian``, ``FedTrimmedAvg``, ``Krum``, ``MultiKrum``, ``Bulyan``;
- :mod:`.central_dp`: the server-side clipping DP wrappers;
- :mod:`.weighting_strategies`: fedkernels' own strategies (``FusedStrategy``, ``QFFL``,
  ``TERM``, ``VRed``, ``SemiVRed``, ``FedAU``, ``AAggFF``; re-exported here);
- :mod:`.secagg`: SecAgg+ with fused ring arithmetic (``fused_secaggplus_mod``,
  ``FusedSecAggPlusWorkflow``; import it from there);
- :mod:`.weighted_mean`, :mod:`.records`: the fused mean of replies and the conversions
  between Flower's records and tensors (re-exported here).

Legacy API (``flwr.server.strategy``): :mod:`.legacy`, :mod:`.legacy_robust`,
:mod:`.legacy_central_dp`.
"""

try:
    import flwr.app  # noqa: F401  (the Message API, flwr >= 1.21)
    import flwr.server.strategy  # noqa: F401  (the legacy API)
    import flwr.serverapp.strategy  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised only without flwr
    raise ImportError(
        "fedkernels.integrations.flower needs Flower (flwr >= 1.41), which is not installed: "
        "pip install 'fedkernels[flower]'"
    ) from _err

from .drop_ins import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi, QFedAvg
from .records import (
    array_to_tensor,
    arrayrecord_to_state_dict,
    ndarray_to_array,
    state_dict_to_arrayrecord,
)
from .weighted_mean import aggregate_arrayrecords, fused_weighted_mean
from .weighting_strategies import QFFL, TERM, AAggFF, FedAU, FusedStrategy, SemiVRed, VRed

__all__ = [
    "AAggFF",
    "FedAU",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedProx",
    "FedYogi",
    "FusedStrategy",
    "QFFL",
    "QFedAvg",
    "SemiVRed",
    "TERM",
    "VRed",
    "aggregate_arrayrecords",
    "array_to_tensor",
    "arrayrecord_to_state_dict",
    "fused_weighted_mean",
    "ndarray_to_array",
    "state_dict_to_arrayrecord",
]
