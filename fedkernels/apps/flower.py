r"""Any registered fedkernels algorithm as a Flower ``ServerApp`` and ``ClientApp`` (Message API,
Flower 1.42), with the algorithm's own code on both sides.

>>> from fedkernels.apps.flower import client_app, server_app
>>> app = server_app("superfed-mm", rounds=20)  # server_app.py of a Flower App  # doctest: +SKIP
>>> app = client_app()                          # client_app.py                   # doctest: +SKIP

The ServerApp runs the server's half of every round of :class:`fedkernels.sim.Simulation`
(``role="server"``): it draws the participants, sends each the global model (and what the
strategy sends besides, :meth:`Strategy.client_payload`), and aggregates the replies with
:meth:`Strategy.aggregate`. A ClientApp runs the clients' half
(:class:`~fedkernels.sim.client_runtime.ClientRuntime`): the same data partition, minibatch
order, random streams and local training as ``fedkernels run``, on the device the node has.
So the apps give the metrics of ``fedkernels run`` with the same configuration and seed.

Configuration: Flower's run config (``[tool.flwr.app.config]`` of the App's
``pyproject.toml``, ``flwr run --run-config``) holds the experiment in ``fedkernels run``'s
spelling: ``algorithm``, ``rounds``, ``seed``, ``device`` and the other top-level fields,
``section.field`` keys (a TOML table ``[tool.flwr.app.config.partition]`` becomes
``partition.*``), the algorithm's parameters as ``<algorithm>.<field>`` (``superfed-mm.nu``;
those of the other registered algorithms are ignored, so that one ``pyproject.toml`` may hold
several), lists as comma-separated strings; ``config-file`` names a YAML or JSON file of
``fedkernels run --config`` read first. The app's own keys: ``round-timeout`` (seconds a round
waits for its replies, default 3600 as Flower's strategies, 0: until all arrive),
``straggler-patience`` (seconds a round still waits after its first reply, 0: no limit),
``node-wait-timeout`` (seconds to wait for the SuperNodes at the start) and ``result-path``
(where the ServerApp writes ``results.json``); keys ``app.*`` are left to the App's own code.

Clients and nodes: SuperNode ``partition-id = k`` (its ``node_config``, as Flower's simulation
engine sets it) is client k of the run's ``partition.num_clients`` clients, and
``num-partitions`` must equal that number. A node's ``device`` (``node_config``) is where its
ClientApp trains (default: the run's ``device``).

Messages: ``query`` (the node's partition), ``train`` (arrays: the global model; payload:
:meth:`Strategy.client_payload`; config: the client, the round, the experiment as JSON; the
reply: the trained state, :meth:`Strategy.reply_extras` and the metrics ``num-examples``,
``train-loss`` and, where the strategy wants it, ``global-loss``) and ``evaluate`` (only for
strategies that evaluate on the clients: SuPerFed's local models). What a client keeps
between rounds lives in the node's ``Context.state``.

Failures follow Flower's semantics: a reply that does not come within the round's time, or
that carries an error (the node became unavailable, its ClientApp crashed or raised), leaves
the round with the others' updates (its record lists ``lost_participants``, and what the
raising ClientApps said in ``client_errors``); a round without any reply leaves
the global model as it was, and one whose every reply is an error stops the run with them. A
reply whose records do not fit (missing, wrong names, shapes or dtypes, another client's)
stops the run with :class:`MalformedReply`, naming the node and the client.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from torch import Tensor

from fedkernels.algorithms.registry import available, build_strategy, strategy_class
from fedkernels.cli.config_file import load_config_file
from fedkernels.integrations.flower.records import (
    arrayrecord_to_state_dict,
    state_dict_to_arrayrecord,
)
from fedkernels.sim.client import ClientUpdate
from fedkernels.sim.client_runtime import ClientRuntime
from fedkernels.sim.config import SECTIONS, ConfigError, ExperimentConfig, from_dict, set_dotted
from fedkernels.sim.devices import reproducible_numerics, synchronize
from fedkernels.sim.results import RunResult
from fedkernels.sim.run import RoundPlan, Simulation

__all__ = ["AppSettings", "MalformedReply", "app_settings", "client_app", "flower_apps",
           "server_app"]

log = logging.getLogger("flwr")

# The app's own run-config keys (hyphenated, as Flower's are); every other key is the
# experiment's.
APP_KEYS = {
    "config-file": "",
    "round-timeout": 3600.0,  # as Flower's strategies' start()
    "straggler-patience": 0.0,
    "node-wait-timeout": 120.0,
    "result-path": "",
}
# Error replies that say the node or its ClientApp went away: the reply is lost, as one that
# never came (the others are the ClientApp's errors, recorded as such).
GONE = (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
        ErrorCode.NODE_UNAVAILABLE, ErrorCode.CLIENT_APP_CRASHED)
STATE_KEY = "fedkernels.client"  # the node's Context.state record of what its client keeps
USER_SECTION = "app"  # run-config keys app.* are the App's own (its mods, ...): left alone
POLL_S = 0.1


class MalformedReply(ValueError):
    """A client's reply whose records do not fit the run (the message names the node)."""


# ------------------------------------------------------------------ configuration


@dataclass
class AppSettings:
    """The experiment and the app's own settings of one run."""

    experiment: ExperimentConfig
    round_timeout: float | None = None  # None: wait for every reply
    straggler_patience: float | None = None  # None: no limit after the first reply
    node_wait_timeout: float = 120.0
    result_path: str = ""

    def experiment_json(self) -> str:
        return json.dumps(self.experiment.to_dict(), sort_keys=True)


def app_settings(run_config: Mapping[str, Any],
                 defaults: Mapping[str, Any] | None = None) -> AppSettings:
    """The settings of a run config (module docstring), over ``defaults`` in the same
    spelling. Raises :class:`ConfigError` naming a key that fits nowhere."""
    merged = {**(defaults or {}), **dict(run_config)}
    app = {k: merged.pop(k, v) for k, v in APP_KEYS.items()}
    tree: dict[str, Any] = {}
    if app["config-file"]:
        tree = load_config_file(app["config-file"])
    for key in ("algorithm", *[k for k in merged if "." not in k and k != "algorithm"]):
        if key in merged:
            tree[key] = merged.pop(key)
    algorithm = tree.get("algorithm", "fedavg")
    if not isinstance(algorithm, str):
        raise ConfigError(f"algorithm: expected a name, got {algorithm!r}")
    name = strategy_class(algorithm).name
    others = set(available()) - {name, algorithm}
    for key, value in merged.items():
        head, _, param = key.partition(".")
        if head in SECTIONS:
            set_dotted(tree, key, value)
        elif head in (name, algorithm):
            tree.setdefault("algorithm_params", {})[param] = value
        elif head in others or head == USER_SECTION:
            continue  # another algorithm's parameters, or the App's own settings
        else:
            raise ConfigError(f"run config key {key!r}: neither a section of the experiment "
                              f"({', '.join(SECTIONS)}) nor a parameter of {name} "
                              f"({name}.FIELD) nor one of the app's ({', '.join(APP_KEYS)}; "
                              f"{USER_SECTION}.* for the App's own code)")
    experiment = from_dict(ExperimentConfig, tree)
    build_strategy(experiment.algorithm, experiment.algorithm_params)  # checks the parameters
    problem = strategy_class(experiment.algorithm).apart_problem()
    if problem is not None:
        raise ConfigError(f"{problem}: it cannot run as a Flower app")

    def seconds(key: str) -> float | None:
        value = float(app[key])
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{key} must be a number of seconds >= 0, got {app[key]!r}")
        return value or None

    return AppSettings(experiment, seconds("round-timeout"), seconds("straggler-patience"),
                       seconds("node-wait-timeout") or 0.0, str(app["result-path"]))


def _experiment(text: str) -> ExperimentConfig:
    return from_dict(ExperimentConfig, json.loads(text))


# ------------------------------------------------------------------ the ServerApp


def server_app(algorithm: str | None = None, **defaults: Any) -> ServerApp:
    """A ``ServerApp`` that runs ``algorithm`` (default: the run config's ``algorithm``) with
    ``defaults`` under the run config, keys in the run config's spelling
    (``server_app("fedau", rounds=5, **{"partition.num_clients": 3})``)."""
    base = dict(defaults)
    if algorithm is not None:
        base["algorithm"] = algorithm
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        FlowerServer(grid, app_settings(context.run_config, base)).run()

    return app


@dataclass
class _Exchange:
    """The replies to one batch of messages, and which clients' never came."""

    replies: dict[int, Message] = field(default_factory=dict)  # by client
    nodes: dict[int, int] = field(default_factory=dict)  # client -> node
    missing: list[int] = field(default_factory=list)


class FlowerServer:
    """The server's side of one Flower run of a fedkernels algorithm (module docstring)."""

    def __init__(self, grid: Grid, settings: AppSettings) -> None:
        self.grid = grid
        self.settings = settings
        config = settings.experiment
        self.strategy = build_strategy(config.algorithm, config.algorithm_params)
        self.simulation = Simulation(config, self.strategy, role="server")
        self.experiment = settings.experiment_json()
        self.nodes: dict[int, int] = {}  # client -> node
        self.last_strategy_metrics: dict[str, Any] | None = None

    # -- nodes

    def connect(self) -> dict[int, int]:
        """Waits for the SuperNodes and maps client k to the node with ``partition-id`` k."""
        n = self.simulation.federation.num_clients
        deadline = time.monotonic() + self.settings.node_wait_timeout
        node_ids = list(self.grid.get_node_ids())
        while len(node_ids) < n and time.monotonic() < deadline:
            time.sleep(1.0)
            node_ids = list(self.grid.get_node_ids())
        if len(node_ids) < n:
            raise RuntimeError(f"{len(node_ids)} SuperNodes connected within "
                               f"{self.settings.node_wait_timeout:g} s; the run has {n} clients "
                               "and needs one node for each (partition-id 0 to "
                               f"{n - 1})")
        messages = [Message(RecordDict({"config": ConfigRecord({"experiment": self.experiment})}),
                            dst_node_id=node, message_type=MessageType.QUERY)
                    for node in node_ids]
        exchange = self._exchange(messages, [(-1 - i, node) for i, node in enumerate(node_ids)],
                                  self.settings.round_timeout)
        partitions: dict[int, int] = {}
        for key, reply in exchange.replies.items():
            node = exchange.nodes[key]
            if reply.has_error():
                raise RuntimeError(f"node {node} failed to answer the query: "
                                   f"{reply.error.reason}")
            metrics = _record(reply, "metrics", MetricRecord, node, "query")
            p, count = _integer(metrics, "partition-id", node), _integer(metrics,
                                                                         "num-partitions", node)
            if count != n:
                raise ConfigError(f"node {node} has num-partitions={count}, the run "
                                  f"partition.num_clients={n}: give every SuperNode "
                                  f"num-partitions={n}")
            if not 0 <= p < n:
                raise ConfigError(f"node {node} has partition-id={p}, outside 0 to {n - 1}")
            if p in partitions:
                raise ConfigError(f"nodes {partitions[p]} and {node} both have partition-id={p}")
            partitions[p] = node
        absent = sorted(set(range(n)) - set(partitions))
        if absent:
            raise RuntimeError(f"no node answered for partition-id {absent} (of the "
                               f"{len(node_ids)} connected)")
        self.nodes = partitions
        log.info("fedkernels: %s on %d nodes, %d rounds", self.strategy.name, n,
                 self.simulation.config.rounds)
        return partitions

    # -- messages

    def _exchange(self, messages: list[Message], keys: list[tuple[int, int]],
                  timeout: float | None) -> _Exchange:
        """Sends ``messages`` (one per ``(key, node)``) and collects their replies until all
        came, the timeout passed, or the straggler patience after the first reply."""
        out = _Exchange(nodes=dict(keys))
        ids = list(self.grid.push_messages(messages))
        pending = {mid: key for mid, (key, _) in zip(ids, keys) if mid}
        out.missing = [key for mid, (key, _) in zip(ids, keys) if not mid]
        start = time.monotonic()
        first = None
        patience = self.settings.straggler_patience
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id, None)
                if key is not None:
                    out.replies[key] = reply
                    first = first if first is not None else time.monotonic()
            now = time.monotonic()
            if not pending or (timeout is not None and now - start >= timeout) or (
                    patience is not None and first is not None and now - first >= patience):
                break
            time.sleep(POLL_S)
        out.missing += sorted(pending.values())
        return out

    def _connected(self, clients: Iterable[int]) -> tuple[list[int], list[int]]:
        """The clients whose nodes are connected now, and the others."""
        now = set(self.grid.get_node_ids())
        up = [k for k in clients if self.nodes[k] in now]
        return up, [k for k in clients if self.nodes[k] not in now]

    # -- rounds

    def run(self) -> RunResult:
        """Plays every round and returns (and writes, with ``result-path``) the result."""
        sim = self.simulation
        self.connect()
        with reproducible_numerics(sim.device):
            for t in range(sim.config.rounds):
                started = time.perf_counter()
                record = self.play_round(t)
                synchronize(sim.device)
                record["wall_time_s"] = time.perf_counter() - started
                sim.records.append(record)
                sim.next_round = t + 1
                log.info("fedkernels round %d: %s", t + 1, _summary_line(record))
            result = sim.result(self.last_strategy_metrics)
        if self.settings.result_path:
            result.write_json(self.settings.result_path)
        return result

    def play_round(self, t: int) -> dict[str, Any]:
        sim, strategy = self.simulation, self.strategy
        plan = sim.open_round(t)
        if plan.participants:
            start = time.perf_counter()
            ids, updates, losses = self.train(plan)
            sim.close_round(plan, ids, updates, losses, time.perf_counter() - start)
        else:
            sim.close_round(plan, [], [], None)
        evaluation = None
        if strategy.evaluates_on_clients and sim.evaluation_due(t):
            evaluation = self.evaluate_on_clients
        return sim.finish_round(plan, evaluation)

    def train(self, plan: RoundPlan) -> tuple[list[int], list[ClientUpdate], Tensor | None]:
        """Sends the round's training messages and takes in the replies: the clients that
        replied (sorted), their updates and, where the strategy wants them, their losses of
        the global model."""
        t, strategy = plan.round, self.strategy
        clients, offline = self._connected(plan.participants)
        arrays = state_dict_to_arrayrecord(plan.global_state)
        wants_loss = strategy.wants_global_loss
        messages = []
        for k in clients:
            content = {"arrays": arrays, "config": ConfigRecord({
                "client-id": k, "round": t, "global-loss": wants_loss,
                "experiment": self.experiment})}
            payload = strategy.client_payload(k, t)
            if payload:
                content["payload"] = state_dict_to_arrayrecord(payload)
            messages.append(Message(RecordDict(content), dst_node_id=self.nodes[k],
                                    message_type=MessageType.TRAIN, group_id=str(t)))
        exchange = self._exchange(messages, [(k, self.nodes[k]) for k in clients],
                                  self.settings.round_timeout)
        template = self._reply_template(plan)
        got: dict[int, tuple[ClientUpdate, float | None, dict[str, Tensor]]] = {}
        errors: dict[str, str] = {}
        unavailable = []
        for k, reply in exchange.replies.items():
            node = self.nodes[k]
            if reply.has_error():
                if reply.error.code in GONE:
                    unavailable.append(k)
                    continue
                errors[str(k)] = reply.error.reason or f"error code {reply.error.code}"
                log.warning("fedkernels round %d: client %d (node %d) failed: %s", t + 1, k,
                            node, errors[str(k)])
                continue
            got[k] = _train_reply(reply, k, node, t, template, wants_loss,
                                  sim_samples=self.simulation.federation.clients[k].num_train)
        ids = sorted(got)
        for k in ids:
            try:
                strategy.receive_reply_extras(k, got[k][2])
            except (ValueError, KeyError, RuntimeError) as err:
                raise MalformedReply(f"node {self.nodes[k]} (client {k}) sent a malformed "
                                     f"reply in round {t + 1}: {err}") from None
        lost = sorted(set(offline) | set(exchange.missing) | set(unavailable))
        if lost:
            log.warning("fedkernels round %d: no reply from clients %s (nodes %s)", t + 1,
                        lost, [self.nodes[k] for k in lost])
        if errors:
            plan.record["client_errors"] = errors
        if errors and not ids:
            raise RuntimeError(f"round {t + 1}: every client that replied failed: "
                               + "; ".join(f"client {k} (node {self.nodes[int(k)]}): {reason}"
                                           for k, reason in errors.items()))
        losses = None
        if wants_loss and ids:
            losses = torch.tensor([got[k][1] for k in ids], dtype=torch.float64, device="cpu")
        return ids, [got[k][0] for k in ids], losses

    def _reply_template(self, plan: RoundPlan) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        if self.strategy.replies_are_models:
            return {k: (tuple(v.shape), v.dtype) for k, v in plan.global_state.items()}
        return self.strategy.reply_template()

    def evaluate_on_clients(self) -> dict[str, Any]:
        """The strategy's evaluation from every client's part (its ``evaluate`` message)."""
        sim, strategy = self.simulation, self.strategy
        n = sim.federation.num_clients
        clients, _ = self._connected(range(n))
        arrays = state_dict_to_arrayrecord(sim.server.state)
        messages = [Message(RecordDict({"arrays": arrays, "config": ConfigRecord({
            "client-id": k, "round": sim.next_round, "experiment": self.experiment})}),
            dst_node_id=self.nodes[k], message_type=MessageType.EVALUATE)
            for k in clients]
        exchange = self._exchange(messages, [(k, self.nodes[k]) for k in clients],
                                  self.settings.round_timeout)
        parts: list[dict[str, Tensor] | None] = [None] * n
        for k, reply in exchange.replies.items():
            node = self.nodes[k]
            if reply.has_error():
                log.warning("fedkernels: client %d (node %d) failed to evaluate: %s", k, node,
                            reply.error.reason)
                continue
            metrics = _record(reply, "metrics", MetricRecord, node, "evaluation", k)
            if _integer(metrics, "client-id", node) != k:
                raise MalformedReply(f"node {node} (client {k}) sent an evaluation for client "
                                     f"{metrics['client-id']}")
            record = _record(reply, "evaluation", ArrayRecord, node, "evaluation", k)
            parts[k] = {name: v.to(sim.device) for name, v in
                        arrayrecord_to_state_dict(record, copy=True).items()}
        try:
            metrics = strategy.combine_client_evaluations(sim.server.state, sim.federation.clients,
                                                          parts)
        except (ValueError, KeyError, RuntimeError, IndexError) as err:
            bad = [k for k, p in enumerate(parts) if p is not None]
            raise MalformedReply(f"the evaluations of clients {bad} (nodes "
                                 f"{[self.nodes[k] for k in bad]}) do not fit: {err}") from None
        self.last_strategy_metrics = metrics
        return metrics


def _summary_line(record: Mapping[str, Any]) -> str:
    keys = ("participants", "train_loss", "test_accuracy", "personalized_accuracy")
    return ", ".join(f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
                     for k in keys if k in record)


def _record(reply: Message, name: str, kind: type, node: int, what: str,
            client: int | None = None) -> Any:
    who = f"node {node}" + ("" if client is None else f" (client {client})")
    if not reply.has_content() or name not in reply.content:
        raise MalformedReply(f"{who} sent a {what} reply without its {name!r} record")
    record = reply.content[name]
    if not isinstance(record, kind):
        raise MalformedReply(f"{who} sent a {what} reply whose {name!r} is a "
                             f"{type(record).__name__}, not a {kind.__name__}")
    return record


def _integer(metrics: Mapping[str, Any], key: str, node: int) -> int:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise MalformedReply(f"node {node} sent {key}={value!r}, not an integer")
    return int(value)


def _train_reply(reply: Message, k: int, node: int, t: int,
                 template: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None,
                 wants_loss: bool, sim_samples: int
                 ) -> tuple[ClientUpdate, float | None, dict[str, Tensor]]:
    """One training reply as ``(update, global loss, extras)``, every record checked."""
    who = f"node {node} (client {k})"

    def bad(problem: str) -> MalformedReply:
        return MalformedReply(f"{who} sent a malformed reply in round {t + 1}: {problem}")

    metrics = _record(reply, "metrics", MetricRecord, node, "training", k)
    arrays = _record(reply, "arrays", ArrayRecord, node, "training", k)
    for key in ("client-id", "round", "num-examples"):
        if key not in metrics:
            raise bad(f"its metrics lack {key!r}")
    if _integer(metrics, "client-id", node) != k or _integer(metrics, "round", node) != t:
        raise bad(f"it answers for client {metrics['client-id']}, round "
                  f"{int(metrics['round']) + 1}")
    samples = _integer(metrics, "num-examples", node)
    if samples != sim_samples:
        raise bad(f"it trained on {samples} samples where the server's copy of its partition "
                  f"has {sim_samples}: the two load different data")
    loss = metrics.get("train-loss")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise bad(f"train-loss is {loss!r}, not a number")
    global_loss = None
    if wants_loss:
        global_loss = metrics.get("global-loss")
        if isinstance(global_loss, bool) or not isinstance(global_loss, (int, float)):
            raise bad(f"global-loss is {global_loss!r}, not a number")
        global_loss = float(global_loss)
    try:
        state = arrayrecord_to_state_dict(arrays, copy=True)
    except (TypeError, ValueError) as err:
        raise bad(f"its arrays cannot be read: {err}") from None
    if template is not None:
        if list(state) != list(template):
            missing = [n for n in template if n not in state]
            extra = [n for n in state if n not in template]
            raise bad(f"its arrays are not the expected ones (missing {missing}, unexpected "
                      f"{extra})")
        for name, (shape, dtype) in template.items():
            got = state[name]
            if tuple(got.shape) != shape or got.dtype != dtype:
                raise bad(f"array {name!r} is {got.dtype} {tuple(got.shape)}, expected "
                          f"{dtype} {shape}")
    extras: dict[str, Tensor] = {}
    if "extras" in reply.content:
        extras = arrayrecord_to_state_dict(
            _record(reply, "extras", ArrayRecord, node, "training", k), copy=True)
    return ClientUpdate(state, float(loss)), global_loss, extras


# ------------------------------------------------------------------ the ClientApp


_RUNTIMES: dict[tuple[str, str | None], ClientRuntime] = {}


def _runtime(experiment: str, device: str | None) -> ClientRuntime:
    """The client runtime of this experiment in this process (built once: the data set is
    loaded and partitioned once per process, not per message; the strategy is new for every
    message)."""
    key = (experiment, device)
    if key not in _RUNTIMES:
        config = _experiment(experiment)
        _RUNTIMES.clear()  # one run at a time per process
        _RUNTIMES[key] = ClientRuntime(
            config, lambda: build_strategy(config.algorithm, config.algorithm_params),
            device=device)
    return _RUNTIMES[key]


def _partition(context: Context) -> tuple[int, int]:
    config = context.node_config
    try:
        return int(config["partition-id"]), int(config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError("this SuperNode has no partition-id and num-partitions in its "
                          "node config (--node-config \"partition-id=K num-partitions=N\")"
                          ) from None


def _asked_client(msg: Message, context: Context) -> tuple[int, ConfigRecord]:
    config = msg.content["config"]
    k = int(config["client-id"])
    p, _ = _partition(context)
    if k != p:
        raise ConfigError(f"the server asked node {context.node_id} (partition-id {p}) to run "
                          f"client {k}")
    return k, config


def _kept(context: Context, k: int) -> dict[str, Tensor]:
    record = context.state.get(f"{STATE_KEY}.{k}")
    return {} if record is None else arrayrecord_to_state_dict(record, copy=True)


def _keep(context: Context, k: int, state: Mapping[str, Tensor]) -> None:
    key = f"{STATE_KEY}.{k}"
    if state:
        context.state[key] = state_dict_to_arrayrecord(state)
    elif key in context.state:
        del context.state[key]


def _node_device(context: Context) -> str | None:
    device = context.node_config.get("device")
    return None if device in (None, "") else str(device)


def client_app(mods: list[Any] | None = None) -> ClientApp:
    """The ``ClientApp`` of every algorithm (the server's messages name the experiment), with
    Flower ``mods`` around its functions."""
    app = ClientApp(mods=mods)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        p, n = _partition(context)
        return Message(RecordDict({"metrics": MetricRecord({"partition-id": p,
                                                            "num-partitions": n})}),
                       reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        k, config = _asked_client(msg, context)
        t = int(config["round"])
        runtime = _runtime(str(config["experiment"]), _node_device(context))
        payload = None
        if "payload" in msg.content:
            payload = arrayrecord_to_state_dict(msg.content["payload"], copy=True)
        reply = runtime.train(
            k, t, arrayrecord_to_state_dict(msg.content["arrays"], copy=True), payload=payload,
            client_state=_kept(context, k), global_loss=bool(config["global-loss"]))
        _keep(context, k, reply.client_state)
        metrics = {"client-id": k, "round": t, "num-examples": reply.num_samples,
                   "train-loss": reply.update.train_loss}
        if reply.global_loss is not None:
            metrics["global-loss"] = reply.global_loss
        content = {"arrays": state_dict_to_arrayrecord(reply.update.state),
                   "metrics": MetricRecord(metrics)}
        if reply.extras:
            content["extras"] = state_dict_to_arrayrecord(reply.extras)
        return Message(RecordDict(content), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        k, config = _asked_client(msg, context)
        runtime = _runtime(str(config["experiment"]), _node_device(context))
        part, kept = runtime.evaluate(
            k, arrayrecord_to_state_dict(msg.content["arrays"], copy=True),
            client_state=_kept(context, k))
        _keep(context, k, kept)
        return Message(RecordDict({"evaluation": state_dict_to_arrayrecord(part),
                                   "metrics": MetricRecord({"client-id": k})}), reply_to=msg)

    return app


def flower_apps(algorithm: str | None = None, **defaults: Any) -> tuple[ServerApp, ClientApp]:
    """``(server_app(algorithm, **defaults), client_app())``."""
    return server_app(algorithm, **defaults), client_app()

