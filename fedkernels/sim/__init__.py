"""Federated-learning simulation on top of the fedkernels ops.

Modules, one concept each: :mod:`~fedkernels.sim.config` (dataclasses), :mod:`.seeding`
(random streams), :mod:`.dataset` (the data set type), :mod:`.data` (loaders),
:mod:`.partition` (splitting among clients), :mod:`.federation` (the clients' train/test
splits), :mod:`.participation` (who takes part), :mod:`.models`, :mod:`.client` (local
training), :mod:`.vmap` (batched local training), :mod:`.server` (server optimizers),
:mod:`.strategy` (the algorithm interface), :mod:`.metrics`, :mod:`.run` (the round loop,
checkpoints), :mod:`.client_runtime` (the clients' half of a round in another process),
:mod:`.results`, :mod:`.plots`.
"""

import importlib

# name -> the module defining it; imported on first use, so that the torch-free modules
# (config, provenance) load without torch (the command line's --help reads the configuration)
_EXPORTS = {
    **dict.fromkeys(("ClientConfig", "ConfigError", "DataConfig", "ExperimentConfig",
                     "ModelConfig", "ParticipationConfig", "PartitionConfig", "ServerConfig",
                     "from_dict"), "config"),
    "Dataset": "dataset",
    "ClientData": "federation",
    "Federation": "federation",
    "ParticipationHistory": "participation",
    "RunResult": "results",
    "Simulation": "run",
    "Server": "server",
    **dict.fromkeys(("RoundInfo", "SetupInfo", "Strategy"), "strategy"),
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
