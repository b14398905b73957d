"""The Flower apps of :mod:`fedkernels.apps.flower` driven in one process, without Flower's
simulation engine (Ray) or a SuperLink: :class:`InProcessGrid` is a ``Grid`` whose nodes are
calls of the ``ClientApp`` here, each with its own ``Context`` (node config
``partition-id``/``num-partitions``, as Flower's simulation engine gives them, and a ``state``
kept between messages), and every message's records cross as Flower's wire format does
(serialized to protobuf and parsed back). A ClientApp that raises answers with an error reply,
and leaves its node's state as it was, as in Flower's engine.

For tests and debugging: the same server and client code as a deployment, in one process.

>>> from fedkernels.apps.in_process import run_in_process
>>> result = run_in_process({"algorithm": "fedau", "rounds": 3})  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedkernels.sim.results import RunResult

from .flower import FlowerServer, app_settings, client_app

__all__ = ["InProcessGrid", "run_in_process"]

RUN_ID = 1
SERVER_NODE_ID = 0


def node_id_of(partition: int) -> int:
    """The node id of partition ``partition`` (distinct from it, as real node ids are)."""
    return 1_000_003 + 7_919 * partition


def _over_the_wire(content: RecordDict) -> RecordDict:
    proto = ProtoRecordDict.FromString(recorddict_to_proto(content).SerializeToString())
    return recorddict_from_proto(proto)


class InProcessGrid(Grid):
    """A ``Grid`` over ``num_nodes`` in-process nodes running ``app`` (module docstring).

    ``tamper(message, reply)`` may replace each reply before the server sees it (return None
    to lose it: the server then waits for it until ``round-timeout``); :meth:`kill` takes a
    node away as a SuperNode that stopped: it no longer appears among the nodes, and a message
    to it gets the error reply of an unavailable node."""

    def __init__(
        self,
        app: ClientApp,
        num_nodes: int,
        run_config: Mapping[str, Any] | None = None,
        *,
        node_configs: list[dict[str, Any]] | None = None,
        tamper: Callable[[Message, Message], Message | None] | None = None,
    ) -> None:
        self.app = app
        self.tamper = tamper
        configs = node_configs or [{} for _ in range(num_nodes)]
        self.contexts: dict[int, Context] = {}
        for p, extra in enumerate(configs):
            node_config = {"partition-id": p, "num-partitions": num_nodes, **extra}
            node = node_id_of(p)
            self.contexts[node] = Context(RUN_ID, node, node_config, RecordDict(),
                                          dict(run_config or {}))
        self.dead: set[int] = set()
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(RUN_ID)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.dead]

    def kill(self, node_id: int) -> None:
        self.dead.add(node_id)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            ids.append(message_id)
            node = message.metadata.dst_node_id
            if node not in self.contexts or node in self.dead:
                # what the SuperLink answers once it has seen the node go
                reply = Message(Error(ErrorCode.NODE_UNAVAILABLE, "node unavailable"),
                                reply_to=message)
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                self._replies[message_id] = reply
                continue
            sent = Message(_over_the_wire(message.content), metadata=copy.copy(message.metadata))
            reply = self._handle(sent, node)
            if self.tamper is not None:
                reply = self.tamper(message, reply)
            if reply is not None and node not in self.dead:
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                self._replies[message_id] = reply
        return ids

    def _handle(self, message: Message, node: int) -> Message:
        context = copy.deepcopy(self.contexts[node])
        try:
            reply = self.app(message, context)
        except Exception as err:  # noqa: BLE001 - reported as Flower reports it
            reason = f"{type(err)}:<'{err}'>"
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)
        self.contexts[node] = context
        if reply.has_content():
            reply = Message(_over_the_wire(reply.content), metadata=reply.metadata)
        return reply

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


def run_in_process(
    run_config: Mapping[str, Any],
    *,
    defaults: Mapping[str, Any] | None = None,
    app: ClientApp | None = None,
    num_nodes: int | None = None,
    node_configs: list[dict[str, Any]] | None = None,
    tamper: Callable[[Message, Message], Message | None] | None = None,
    on_grid: Callable[[InProcessGrid], None] | None = None,
) -> RunResult:
    """Runs the ServerApp's loop (:class:`~fedkernels.apps.flower.FlowerServer`) for
    ``run_config`` over an :class:`InProcessGrid` of ``num_nodes`` nodes (default: one per
    client) running ``app`` (default: :func:`~fedkernels.apps.flower.client_app`), and returns
    the result. ``on_grid`` sees the grid before the run starts."""
    settings = app_settings(run_config, defaults)
    nodes = num_nodes if num_nodes is not None else settings.experiment.partition.num_clients
    grid = InProcessGrid(app or client_app(), nodes, run_config, node_configs=node_configs,
                         tamper=tamper)
    if on_grid is not None:
        on_grid(grid)
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, SERVER_NODE_ID, 0
    try:
        return FlowerServer(grid, settings).run()
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
