"""The Flower apps of fedkernels' algorithms (fedkernels.apps.flower) driven in one process
(fedkernels.apps.in_process: a Grid whose nodes are ClientApp calls, records through Flower's
protobuf serde): the run config's mapping onto the experiment, parity with ``fedkernels run``
(Simulation) for every seed method, bit for bit, and the failures: lost replies, nodes gone,
ClientApps that raise, malformed replies, misconfigured nodes.

The same apps on Flower's simulation engine (Ray) and on a local deployment of SuperLink and
SuperNodes: python_tests/test_apps_flower_engines.py (slow)."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from app_parity_helpers import assert_same_metrics, run_config, simulate  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402

from fedkernels.apps.flower import (  # noqa: E402
    MalformedReply,
    app_settings,
    client_app,
    server_app,
)
from fedkernels.apps.in_process import InProcessGrid, node_id_of, run_in_process  # noqa: E402
from fedkernels.integrations.flower.records import (  # noqa: E402
    arrayrecord_to_state_dict,
    state_dict_to_arrayrecord,
)
from fedkernels.sim.config import ConfigError  # noqa: E402


@pytest.fixture
def server_identity():
    """Messages built outside a ServerApp process read its identity: set one, then restore."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


# ------------------------------------------------------------------ the run config


def test_run_config_maps_onto_the_experiment(tmp_path):
    file = tmp_path / "experiment.json"
    file.write_text('{"rounds": 7, "partition": {"num_clients": 4}, "seed": 3}')
    settings = app_settings({
        "config-file": str(file), "algorithm": "superfed-mm", "rounds": 2,
        "model.hidden": "32,16", "superfed-mm.nu": 0.5, "round-timeout": 30.0,
        "straggler-patience": 0, "result-path": "out/results.json",
    })
    config = settings.experiment
    assert (config.algorithm, config.rounds, config.seed) == ("superfed-mm", 2, 3)
    assert config.partition.num_clients == 4  # from the file
    assert config.model.hidden == [32, 16]  # a comma-separated list
    assert config.algorithm_params == {"nu": 0.5}
    assert settings.round_timeout == 30.0 and settings.straggler_patience is None
    assert settings.result_path == "out/results.json"
    # defaults (server_app's) under the run config
    assert app_settings({"rounds": 5}, {"algorithm": "fedau", "rounds": 9}).experiment.rounds == 5
    # parameters of another registered algorithm wait for it
    other = app_settings({"algorithm": "fedau", "fedau.cutoff": 3, "superfed-mm.nu": 2.0,
                          "app.my-setting": 1})
    assert other.experiment.algorithm_params == {"cutoff": 3}


def test_which_algorithms_run_as_apps():
    """Every algorithm whose clients keep nothing between rounds, and those that say what
    they keep and send (the seed methods, the distillation family); the personalized
    baselines and FedCVAE keep client state in the strategy object and are refused."""
    from fedkernels.algorithms import available, strategy_class

    refused = sorted(n for n in available() if strategy_class(n).apart_problem() is not None)
    assert refused == ["apfl", "ditto", "fedavg-ft", "fedcvae", "fedper", "fedrep",
                       "lg-fedavg", "local", "pfedme"]
    with pytest.raises(ConfigError, match="ditto trains or evaluates its clients its own way "
                       r"\(train_client, evaluate\).*cannot run as a Flower app"):
        app_settings({"algorithm": "ditto"})


@pytest.mark.parametrize("key, value, message", [
    ("rounds_", 3, "unknown key rounds_"),
    ("clients.count", 3, "neither a section"),
    ("fedproxx.mu", 0.1, "nor a parameter of fedau"),
    ("fedau.nope", 1, "unknown key fedau.nope"),
    ("partition.num_clients", "many", "expected an integer"),
    ("round-timeout", -1, "round-timeout must be"),
])
def test_run_config_errors_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        app_settings({"algorithm": "fedau", key: value})


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("name", ["superfed-mm", "superfed-lm", "aaggff-s", "aaggff-d", "fedau",
                                  "fedgo", "fedgo-gan", "fedevg"])
def test_seed_methods_match_fedkernels_run(name):
    """SuPerFed (local models on the clients, personalized evaluation through evaluate
    messages), AAggFF (the clients' losses of the global model), FedAU (participation
    intervals on the server, Bernoulli participation), FedGO (U or the GAN to the clients,
    their discriminators back) and FedEvg (the synthetic set out, energy gradients back):
    every metric of every round, the summary and the per-client table equal Simulation's,
    bit for bit. Each case runs in under a second."""
    config = run_config(name)
    assert_same_metrics(run_in_process(config), simulate(config))


def _every_algorithm_that_runs_apart() -> list[str]:
    from fedkernels.algorithms import available, strategy_class

    return [n for n in available() if strategy_class(n).apart_problem() is None]


@pytest.mark.slow
@pytest.mark.parametrize("name", _every_algorithm_that_runs_apart())
def test_every_algorithm_that_runs_apart_matches_fedkernels_run(name):
    """Beyond the seed methods: every registered algorithm the apps accept (robust rules,
    fairness, participation, update memories, the distillation family, FedProx, ...), seven
    clients, two rounds, server data for the distillers."""
    config = {"algorithm": name, "rounds": 2, "partition.num_clients": 7, "model.hidden": "16",
              "data.server_fraction": 0.2}
    if name in ("feddf", "fedet", "entropy-kd", "dafkd", "fedgo"):
        config.update({f"{name}.disc_epochs": 1, f"{name}.server_epochs": 1})
    assert_same_metrics(run_in_process(config), simulate(config))


def test_the_server_app_runs_on_a_grid(tmp_path, server_identity):
    """server_app()'s main over the in-process grid writes results.json (result-path)."""
    import json

    from flwr.app import Context

    path = tmp_path / "results.json"
    config = {**run_config("fedau"), "result-path": str(path)}
    grid = InProcessGrid(client_app(), 5, config)
    server_app("fedau")(grid, Context(1, 0, {}, RecordDict(), config))
    assert_same_metrics(json.loads(path.read_text()), simulate(config))


# ------------------------------------------------------------------ failures


def _drop(round_index: int, client: int):
    """A tamper that loses ``client``'s training reply in round ``round_index`` (0-based)."""
    def tamper(message, reply):
        config = message.content.get("config")
        if message.metadata.message_type == "train" and int(config["client-id"]) == client \
                and int(config["round"]) == round_index:
            return None
        return reply
    return tamper


def test_a_lost_reply_leaves_the_round_with_the_others():
    """A reply that never arrives (a node that died mid-round): the round aggregates the
    other replies, records the lost client, and the run goes on exactly as fedkernels run's
    round without that client (the history FedAU reads included)."""
    config = run_config("fedau", **{"participation.kind": "full"})
    result = run_in_process({**config, "round-timeout": 0.3}, tamper=_drop(1, 2))
    assert result.rounds[1]["lost_participants"] == [2]
    assert result.rounds[1]["participants"] == 4
    assert "lost_participants" not in result.rounds[0]
    assert result.clients[2]["rounds_participated"] == 3  # of 4
    assert_same_metrics(result, simulate(config, lost={1: {2}}))


def test_a_node_that_stops_mid_run_is_lost_from_then_on():
    """A SuperNode that stops while round 2's messages go out: its reply is the SuperLink's
    "node unavailable", later rounds send it nothing, and the run goes on as fedkernels run's
    without that client from round 2 on."""
    config = run_config("fedau", **{"participation.kind": "full"})
    grids: list[InProcessGrid] = []

    def tamper(message, reply):
        if message.metadata.message_type == "train" and int(message.content["config"]["round"]) == 1:
            grids[0].kill(node_id_of(4))
        return reply

    result = run_in_process(config, tamper=tamper, on_grid=grids.append)
    assert [r.get("lost_participants") for r in result.rounds] == [None, [4], [4], [4]]
    assert "client_errors" not in result.rounds[1]
    assert_same_metrics(result, simulate(config, lost={1: {4}, 2: {4}, 3: {4}}))


def test_a_client_that_raises_is_lost_and_named():
    """A ClientApp that raises answers with Flower's error reply: the round goes on with the
    others and records the error; the node's kept state stays as it was."""
    def mod(message, context, call_next):
        if message.metadata.message_type == "train" and \
                int(context.node_config["partition-id"]) == 1 and \
                int(message.content["config"]["round"]) == 0:
            raise RuntimeError("out of memory on this node")
        return call_next(message, context)

    config = run_config("fedau", **{"participation.kind": "full"})
    result = run_in_process(config, app=client_app(mods=[mod]))
    errors = result.rounds[0]["client_errors"]
    assert list(errors) == ["1"] and "out of memory on this node" in errors["1"]
    assert result.rounds[0]["lost_participants"] == [1]
    del result.rounds[0]["client_errors"]
    assert_same_metrics(result, simulate(config, lost={0: {1}}))


def test_a_round_whose_every_client_raises_stops_the_run():
    def mod(message, context, call_next):
        if message.metadata.message_type == "train":
            raise ValueError("no data here")
        return call_next(message, context)

    with pytest.raises(RuntimeError, match=r"round 1: every client that replied failed: "
                       r"client \d \(node \d+\): .*no data here"):
        run_in_process(run_config("fedau"), app=client_app(mods=[mod]))


def _rewrite(what):
    """A tamper that passes the first training reply of client 1 through ``what``."""
    def tamper(message, reply):
        if message.metadata.message_type == "train" and \
                int(message.content["config"]["client-id"]) == 1 and reply.has_content():
            return Message(what(reply.content), reply_to=message)
        return reply
    return tamper


def _with(content, **records):
    out = {k: v for k, v in content.items()}
    out.update(records)
    return RecordDict({k: v for k, v in out.items() if v is not None})


def _arrays(content, change):
    state = arrayrecord_to_state_dict(content["arrays"], copy=True)
    return state_dict_to_arrayrecord(change(state))


@pytest.mark.parametrize("what, message", [
    (lambda c: _with(c, arrays=None), "without its 'arrays' record"),
    (lambda c: _with(c, arrays=ConfigRecord({"x": 1})), "'arrays' is a ConfigRecord"),
    (lambda c: _with(c, arrays=_arrays(c, lambda s: {**s, "fc.extra": torch.zeros(2)})),
     "unexpected"),
    (lambda c: _with(c, arrays=_arrays(c, lambda s: {k: v[:1] for k, v in s.items()})),
     "is torch.float32 .* expected torch.float32"),
    (lambda c: _with(c, arrays=_arrays(c, lambda s: {k: v.double() for k, v in s.items()})),
     "is torch.float64"),
    (lambda c: _with(c, metrics=MetricRecord({**c["metrics"], "client-id": 0})),
     "answers for client 0"),
    (lambda c: _with(c, metrics=MetricRecord({**c["metrics"], "num-examples": 1})),
     "trained on 1 samples"),
    (lambda c: _with(c, metrics=MetricRecord({"client-id": 1, "round": 0})),
     "lack 'num-examples'"),
])
def test_a_malformed_reply_stops_the_run_naming_the_node(what, message):
    config = run_config("fedau", **{"participation.kind": "full"})
    with pytest.raises(MalformedReply, match=rf"node {node_id_of(1)} \(client 1\).*{message}"):
        run_in_process(config, tamper=_rewrite(what))


def test_a_malformed_discriminator_stops_the_run_naming_the_node():
    """FedGO's extras (the client's discriminator) are checked as the server takes them in."""
    def shrink(content):
        extras = arrayrecord_to_state_dict(content["extras"], copy=True)
        first = next(iter(extras))
        extras[first] = extras[first][:1]
        return _with(content, extras=state_dict_to_arrayrecord(extras))

    with pytest.raises(MalformedReply, match=rf"node {node_id_of(1)} \(client 1\).*"
                       r"discriminator does not fit"):
        run_in_process(run_config("fedgo"), tamper=_rewrite(shrink))


def test_fedevg_replies_are_checked_against_the_synthetic_set():
    def wrong(content):
        state = arrayrecord_to_state_dict(content["arrays"], copy=True)
        state["energy_grad"] = state["energy_grad"][:, :5]
        return _with(content, arrays=state_dict_to_arrayrecord(state))

    with pytest.raises(MalformedReply, match=r"array 'energy_grad' is torch.float32 \(30, 5\), "
                       r"expected torch.float32 \(30, 64\)"):
        run_in_process(run_config("fedevg"), tamper=_rewrite(wrong))


@pytest.mark.parametrize("configs, message", [
    ([{"partition-id": 0}, {"partition-id": 0}, {"partition-id": 2}], "both have partition-id=0"),
    ([{}, {}, {"num-partitions": 4}], "num-partitions=4"),
    ([{}, {}, {"partition-id": 7}], "partition-id=7, outside 0 to 2"),
])
def test_misconfigured_nodes_are_refused_before_the_first_round(configs, message):
    with pytest.raises(ConfigError, match=message):
        run_in_process(run_config("fedau", **{"partition.num_clients": 3}), node_configs=configs)


def test_too_few_nodes_are_refused():
    with pytest.raises(RuntimeError, match="2 SuperNodes connected within 0.5 s; the run has 3"):
        run_in_process({**run_config("fedau", **{"partition.num_clients": 3}),
                        "node-wait-timeout": 0.5}, num_nodes=2)


def test_a_node_asked_for_another_client_refuses(server_identity):
    """A ClientApp runs only its own partition's client."""
    app = client_app()
    from flwr.app import Context

    message = Message(RecordDict({"arrays": ArrayRecord({}), "config": ConfigRecord({
        "client-id": 2, "round": 0, "global-loss": False, "experiment": "{}"})}),
        dst_node_id=5, message_type="train")
    context = Context(1, 5, {"partition-id": 1, "num-partitions": 3}, RecordDict(), {})
    with pytest.raises(ConfigError, match=r"node 5 \(partition-id 1\) to run client 2"):
        app(message, context)
