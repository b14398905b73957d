"""Federated-learning simulation on top of the fedkernels ops.

Modules, one concept each: :mod:`~fedkernels.sim.config` (dataclasses), :mod:`.seeding`
(random streams), :mod:`.data` (data sets), :mod:`.partition` (splitting among clients),
:mod:`.federation` (the clients' train/test splits), :mod:`.participation` (who takes part),
:mod:`.models`, :mod:`.client` (local training), :mod:`.vmap` (batched local training),
:mod:`.server` (server optimizers), :mod:`.strategy` (the algorithm interface),
:mod:`.metrics`, :mod:`.run` (the round loop, checkpoints), :mod:`.client_runtime` (the
clients' half of a round in another process), :mod:`.results`, :mod:`.plots`.
"""

from .config import (
    ClientConfig,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    ParticipationConfig,
    PartitionConfig,
    ServerConfig,
    from_dict,
)
from .data import Dataset
from .federation import ClientData, Federation
from .participation import ParticipationHistory
from .results import RunResult
from .run import Simulation
from .server import Server
from .strategy import RoundInfo, SetupInfo, Strategy

__all__ = [
    "ClientConfig",
    "ClientData",
    "ConfigError",
    "DataConfig",
    "Dataset",
    "ExperimentConfig",
    "Federation",
    "ModelConfig",
    "ParticipationConfig",
    "ParticipationHistory",
    "PartitionConfig",
    "RoundInfo",
    "RunResult",
    "Server",
    "ServerConfig",
    "SetupInfo",
    "Simulation",
    "Strategy",
    "from_dict",
]
