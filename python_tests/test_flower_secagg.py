"""Flower's SecAgg+ protocol with the fused ring arithmetic
(fedkernels.integrations.flower.secagg): Flower's DefaultWorkflow with
FusedSecAggPlusWorkflow on the server and fused_secaggplus_mod on the clients, over an
in-process Grid whose messages cross as Flower's wire format. With every client, and with one
dropped after sharing its keys (its masked vector lost), the aggregate is the survivors'
weighted mean to the fixed-point precision; Flower's own SecAgg+ pair, run the same way, lands
as close to the same mean. Then the scenarios of Flower's own client-mod tests, run with
both mods."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("cryptography")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.app.message_type import MessageType  # noqa: E402
from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.client.mod import make_ffn, secaggplus_mod  # noqa: E402
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState  # noqa: E402
from flwr.common import ndarrays_to_parameters  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: E402
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.server import ServerConfig  # noqa: E402
from flwr.server.compat.legacy_context import LegacyContext  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedkernels.apps.in_process import RUN_ID, SERVER_NODE_ID, InProcessGrid, node_id_of  # noqa: E402
from fedkernels.integrations.flower.secagg import (  # noqa: E402
    FusedSecAggPlusWorkflow,
    fixed_point_scale,
    fused_secaggplus_mod,
)

K = 5
SHAPES = [(6, 4), (4,), (300,)]


def update_of(partition: int) -> list[np.ndarray]:
    g = np.random.default_rng(100 + partition)
    return [g.normal(0.0, 0.5, s).astype(np.float32) for s in SHAPES]


def examples_of(partition: int) -> int:
    return 10 + 7 * partition


class _Client(NumPyClient):
    def __init__(self, partition: int) -> None:
        self.partition = partition

    def get_parameters(self, config):
        return [np.zeros(s, np.float32) for s in SHAPES]

    def fit(self, parameters, config):
        return update_of(self.partition), examples_of(self.partition), {}


def client_app(mod) -> ClientApp:
    return ClientApp(client_fn=lambda ctx: _Client(int(ctx.node_config["partition-id"]))
                     .to_client(), mods=[mod])


def _drop_at_collect(partition: int):
    """Loses the masked vector of one client (it left after sharing its keys)."""
    def tamper(message: Message, reply: Message):
        cfg = message.content.config_records.get(RECORD_KEY_CONFIGS)
        if (message.metadata.dst_node_id == node_id_of(partition) and cfg is not None
                and cfg.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS):
            return None
        return reply
    return tamper


def run_round(workflow, mod, drop: int | None = None) -> list[np.ndarray]:
    grid = InProcessGrid(client_app(mod), K,
                         tamper=_drop_at_collect(drop) if drop is not None else None)
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=K - 1,
                      min_available_clients=K, initial_parameters=ndarrays_to_parameters(
                          [np.zeros(s, np.float32) for s in SHAPES]))
    context = LegacyContext(Context(1, 0, {}, RecordDict(), {}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, SERVER_NODE_ID, 0
    try:
        DefaultWorkflow(fit_workflow=workflow)(grid, context)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    return [a.numpy() for a in context.state.array_records[MAIN_PARAMS_RECORD].values()]


def weighted_mean(partitions) -> list[np.ndarray]:
    w = np.array([examples_of(p) for p in partitions], np.float64)
    return [sum(wi * update_of(p)[t].astype(np.float64) for wi, p in zip(w, partitions)) / w.sum()
            for t in range(len(SHAPES))]


def _assert_close(got, want, atol):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)


CLIP, QRANGE, MAX_WEIGHT = 4.0, 2**22, 100.0
STEP = 1.0 / fixed_point_scale(CLIP, QRANGE)


def tolerance(partitions) -> float:
    """Each client's w x is off by at most half a step, and its weight w (a multiple of the
    step) by half a step too: the mean Σ w x / Σ w moves by at most
    K step / 2 (1 + max|x|) / Σ w, plus the float32 rounding of the result."""
    total_w = sum(examples_of(p) for p in partitions) / MAX_WEIGHT
    big = max(float(np.abs(a).max()) for p in partitions for a in update_of(p))
    return len(partitions) * STEP / 2 * (1 + big) / total_w + 2**-24 * big


@pytest.mark.parametrize("drop", [None, 2], ids=["all", "one-dropped"])
def test_fused_secaggplus_round_equals_the_survivors_mean(drop):
    workflow = FusedSecAggPlusWorkflow(num_shares=K, reconstruction_threshold=3,
                                       clipping_range=CLIP, quantization_range=QRANGE,
                                       max_weight=MAX_WEIGHT)
    got = run_round(workflow, fused_secaggplus_mod, drop)
    survivors = [p for p in range(K) if p != drop]
    _assert_close(got, weighted_mean(survivors), tolerance(survivors))


def test_a_secaggplus_neighbourhood_smaller_than_all_clients():
    """num_shares 3 of 5: each client masks with its two ring neighbours only."""
    workflow = FusedSecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2,
                                       clipping_range=CLIP, quantization_range=QRANGE,
                                       max_weight=MAX_WEIGHT)
    got = run_round(workflow, fused_secaggplus_mod, drop=4)
    _assert_close(got, weighted_mean([0, 1, 2, 3]), tolerance([0, 1, 2, 3]))


def test_the_workflow_takes_flowers_arguments_and_refuses_another_ring():
    """Flower's keyword arguments pass through unchanged; only the 2^32 ring is possible."""
    workflow = FusedSecAggPlusWorkflow(num_shares=K, reconstruction_threshold=3, max_weight=9.0,
                                       clipping_range=2.0, quantization_range=2**20,
                                       modulus_range=2**32, timeout=30.0)
    assert (workflow.max_weight, workflow.clipping_range, workflow.quantization_range,
            workflow.modulus_range, workflow.timeout) == (9.0, 2.0, 2**20, 2**32, 30.0)
    with pytest.raises(ValueError, match="mod 2\\^32"):
        FusedSecAggPlusWorkflow(num_shares=K, reconstruction_threshold=3, modulus_range=2**31)


def test_flowers_own_pair_lands_on_the_same_mean():
    flower = run_round(SecAggPlusWorkflow(num_shares=K, reconstruction_threshold=3,
                                          clipping_range=CLIP, quantization_range=QRANGE,
                                          max_weight=MAX_WEIGHT), secaggplus_mod, drop=2)
    ours = run_round(FusedSecAggPlusWorkflow(num_shares=K, reconstruction_threshold=3,
                                             clipping_range=CLIP, quantization_range=QRANGE,
                                             max_weight=MAX_WEIGHT), fused_secaggplus_mod,
                     drop=2)
    want = weighted_mean([0, 1, 3, 4])
    _assert_close(flower, want, 2 * tolerance([0, 1, 3, 4]))  # Flower rounds w * x twice
    _assert_close(ours, want, tolerance([0, 1, 3, 4]))


# ------------------------------------------- the scenarios of Flower's secaggplus_mod_test.py
# Re-expressed and run with Flower's mod and ours: which exception a client raises for a stage
# out of order, a missing config key or a value of the wrong type.

BOTH_MODS = pytest.mark.parametrize("mod", [secaggplus_mod, fused_secaggplus_mod],
                                    ids=["flower", "fedkernels"])


class _Handler:
    """A ClientApp made of the mod and an empty train function, on one node's Context."""

    def __init__(self, mod) -> None:
        self.context = Context(run_id=RUN_ID, node_id=7, node_config={},
                               state=RecordDict({RECORD_KEY_STATE: ConfigRecord(
                                   SecAggPlusState().to_dict())}), run_config={})
        self.app = make_ffn(lambda msg, ctx: Message(RecordDict(), reply_to=msg), [mod])

    def at(self, stage: str) -> _Handler:
        state = SecAggPlusState(**self.context.state.config_records[RECORD_KEY_STATE])
        state.current_stage = stage
        self.context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())
        return self

    def __call__(self, configs: dict) -> None:
        message = Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(configs)}),
                          dst_node_id=7, message_type=MessageType.TRAIN)
        self.app(message, self.context)


@pytest.fixture
def node_identity():
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 7, 0
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


STAGES = (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK)
# the next stage, or back to setup from any stage but the last (Flower logs a warning)
ALLOWED = {(a, b) for a, b in zip(STAGES, STAGES[1:] + STAGES[:1])} | \
    {(a, Stage.SETUP) for a in STAGES[:-1]}


@BOTH_MODS
def test_stage_order(mod, node_identity):
    """An allowed step goes on to the stage's work (which fails on the empty content with a
    KeyError); any other step is refused with a ValueError."""
    handler = _Handler(mod)
    for current in STAGES:
        for following in STAGES:
            expected = KeyError if (current, following) in ALLOWED else ValueError
            with pytest.raises(expected):
                handler.at(current)({Key.STAGE: following})


SETUP_KEYS = {Key.SAMPLE_NUMBER: 10, Key.SHARE_NUMBER: 10, Key.THRESHOLD: 10,
              Key.CLIPPING_RANGE: 1.0, Key.TARGET_RANGE: 10, Key.MOD_RANGE: 10}
WRONG_VALUES = (10, True, 1.0, "text", b"bytes")


@BOTH_MODS
def test_setup_config_checks(mod, node_identity):
    handler = _Handler(mod)
    for key, good in SETUP_KEYS.items():
        for wrong in WRONG_VALUES:
            if type(wrong) is type(good):
                continue
            with pytest.raises(TypeError):
                handler.at(Stage.UNMASK)({**SETUP_KEYS, key: wrong, Key.STAGE: Stage.SETUP})
        missing = {k: v for k, v in SETUP_KEYS.items() if k != key}
        with pytest.raises(KeyError):
            handler.at(Stage.UNMASK)({**missing, Key.STAGE: Stage.SETUP})


@BOTH_MODS
def test_share_keys_config_checks(mod, node_identity):
    """Each entry must be a list of exactly two public keys."""
    handler = _Handler(mod)
    good = {str(n): [b"key one", b"key two"] for n in (1, 2, 3)}
    for wrong in (b"key one", [b"key one"], [b"key one", b"key two", b"key three"]):
        with pytest.raises(TypeError):
            handler.at(Stage.SETUP)({**good, "1": wrong, Key.STAGE: Stage.SHARE_KEYS})


@BOTH_MODS
@pytest.mark.parametrize("stage, before, good", [
    (Stage.COLLECT_MASKED_VECTORS, Stage.SHARE_KEYS,
     {Key.CIPHERTEXT_LIST: [b"c1", b"c2", b"c3"], Key.SOURCE_LIST: [4, 90210, -3]}),
    (Stage.UNMASK, Stage.COLLECT_MASKED_VECTORS,
     {Key.ACTIVE_NODE_ID_LIST: [1, 2, 3], Key.DEAD_NODE_ID_LIST: [4, -5]}),
], ids=["collect", "unmask"])
def test_list_config_checks(mod, node_identity, stage, before, good):
    """A missing list is a KeyError, a list of the wrong element type a TypeError."""
    handler = _Handler(mod)
    for key in good:
        with pytest.raises(KeyError):
            handler.at(before)({**{k: v for k, v in good.items() if k != key},
                                Key.STAGE: stage})
        with pytest.raises(TypeError):
            handler.at(before)({**good, key: [2.5], Key.STAGE: stage})
