"""Configuration dataclasses: conversion from files and flags, and clear errors."""

from __future__ import annotations

import pytest

from fedkernels.algorithms import FedProx, available, build_strategy
from fedkernels.sim.config import ConfigError, ExperimentConfig, from_dict, set_dotted


def test_from_dict_converts_strings_and_nests():
    cfg = from_dict(
        ExperimentConfig,
        {
            "rounds": "7",
            "vmap": "yes",
            "partition": {"kind": "dirichlet", "alpha": "0.25"},
            "model": {"hidden": "32,16"},
            "server": {"lr": "none", "optimizer": "fedadam"},
            "participation": {
                "kind": "bernoulli",
                "probabilities": [0.5, 1, 0, 0, 0, 0, 0, 0, 0, 0],
            },
        },
    )
    assert cfg.rounds == 7 and cfg.vmap is True
    assert cfg.partition.alpha == 0.25 and cfg.model.hidden == [32, 16]
    assert cfg.server.lr is None and cfg.server.learning_rate == 0.1
    assert cfg.participation.probabilities[:2] == [0.5, 1.0]
    assert from_dict(ExperimentConfig, cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"roundz": 3}, "unknown key roundz"),
        ({"partition": {"alpah": 1}}, "unknown key partition.alpah"),
        ({"rounds": "many"}, "rounds: expected an integer"),
        ({"rounds": 0}, "rounds must be >= 1"),
        ({"vmap": "maybe"}, "vmap: expected true or false"),
        ({"vmap": 2}, "vmap: expected true or false"),
        ({"partition": {"kind": "random"}}, "partition.kind: 'random' is not one of"),
        ({"client": {"lr": -1}}, "client.lr must be > 0"),
        ({"data": {"name": "csv"}}, "needs data.path"),
        ({"partition": 3}, "partition: expected a mapping"),
        ({"participation": {"kind": "bernoulli", "probabilities": [0.5, 0.5]}},
         "one value per client"),
    ],
)
def test_invalid_configs_name_the_key(tree, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(ExperimentConfig, tree)


def test_yaml_zero_and_one_are_booleans_as_on_the_command_line():
    assert from_dict(ExperimentConfig, {"vmap": 1}).vmap is True
    assert from_dict(ExperimentConfig, {"vmap": 0}).vmap is False


def test_set_dotted():
    tree = {}
    set_dotted(tree, "partition.alpha", "0.1")
    set_dotted(tree, "rounds", "3")
    assert tree == {"partition": {"alpha": "0.1"}, "rounds": "3"}


def test_registry():
    assert {"fedavg", "fedprox"} <= set(available())
    prox = build_strategy("fedprox", {"mu": "0.5"})
    assert isinstance(prox, FedProx) and prox.config.mu == 0.5
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'"):
        build_strategy("nope")
    with pytest.raises(ConfigError, match="takes no parameters"):
        build_strategy("fedavg", {"mu": 1})
    with pytest.raises(ConfigError, match="unknown key fedprox.nu"):
        build_strategy("fedprox", {"nu": 1})
    with pytest.raises(ConfigError, match="fedprox.mu must be >= 0"):
        build_strategy("fedprox", {"mu": -1})
