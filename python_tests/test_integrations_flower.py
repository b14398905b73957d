"""fedkernels.integrations.flower against Flower's own strategies on the same replies.

Replies are real ``flwr.app.Message`` objects (ArrayRecord + MetricRecord), handed to Flower's
``FedAvg``/``QFedAvg``/``FedAvgM``/``FedAdam``/``FedYogi``/``FedAdagrad`` and to ours; several
rounds run through ``configure_train``/``aggregate_train`` with a stand-in grid (the deployed
run with a SuperLink is in test_integrations_flower_deployment.py).
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flower_message_helpers import StandInGrid, task_identity  # noqa: E402, F401
from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import strategy as flower_strategies  # noqa: E402

from fedkernels.algorithms.aaggff import AAggFFConfig, AAggFFD, AAggFFDConfig, AAggFFS  # noqa: E402
from fedkernels.integrations import flower as fkf  # noqa: E402
from fedkernels.sim.strategy import SetupInfo  # noqa: E402

pytestmark = pytest.mark.usefixtures("task_identity")


def reply(node: int, state: dict, num_examples: float, loss: float) -> Message:
    metadata = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0,
                        reply_to_message_id="m", group_id="", created_at=time.time(),
                        ttl=3600.0, message_type=MessageType.TRAIN)
    content = RecordDict({
        "arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in state.items()}),
        "metrics": MetricRecord({"num-examples": num_examples, "train_loss": loss}),
    })
    return Message(metadata=metadata, content=content)


def model(generator, dtype=np.float32, scale=1.0, like=None):
    shapes = {"conv.weight": (4, 3, 3), "conv.bias": (4,), "fc.weight": (5, 7),
              "fc.bias": (5,), "scalar": ()}
    out = {}
    for k, s in shapes.items():
        noise = np.asarray(generator.standard_normal(s) * scale, dtype=dtype)
        out[k] = noise if like is None else np.asarray(like[k] + noise, dtype=dtype)
    return out


def round_replies(generator, global_state, nodes, dtype=np.float32):
    """A function that builds the round's replies afresh on each call (Flower's QFedAvg, and
    ours, empty the replies' ArrayRecords while aggregating)."""
    sizes = generator.integers(5, 50, size=len(nodes)).astype(float)
    losses = generator.uniform(0.2, 2.5, size=len(nodes))
    states = [model(generator, dtype, 0.1, like=global_state) for _ in nodes]
    return lambda: [reply(n, s, float(z), float(f))
                    for n, s, z, f in zip(nodes, states, sizes, losses)]


def to_numpy(record: ArrayRecord) -> dict:
    return {k: v.numpy() for k, v in record.items()}


def run_rounds(ours, theirs, rounds=3, nodes=(11, 22, 33, 44), dtype=np.float32, seed=0):
    """Runs both strategies over the same replies; returns the max abs difference per round."""
    generator = np.random.default_rng(seed)
    start = model(generator, dtype)
    arrays_ours = ArrayRecord({k: Array(v) for k, v in start.items()})
    arrays_theirs = ArrayRecord({k: Array(v) for k, v in start.items()})
    grid = StandInGrid(nodes)
    diffs = []
    for r in range(1, rounds + 1):
        ours.configure_train(r, arrays_ours, ConfigRecord(), grid)
        theirs.configure_train(r, arrays_theirs, ConfigRecord(), grid)
        replies = round_replies(generator, to_numpy(arrays_theirs), nodes, dtype)
        arrays_ours, metrics_ours = ours.aggregate_train(r, replies())
        arrays_theirs, metrics_theirs = theirs.aggregate_train(r, replies())
        a, b = to_numpy(arrays_ours), to_numpy(arrays_theirs)
        assert a.keys() == b.keys()
        assert dict(metrics_ours) == pytest.approx(dict(metrics_theirs))
        diffs.append(max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a))
    return diffs


# ---------------------------------------------------------------- equality with Flower


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fedavg_equals_flower(dtype):
    diffs = run_rounds(fkf.FedAvg(), flower_strategies.FedAvg(), dtype=dtype)
    assert max(diffs) < (2e-6 if dtype == np.float32 else 1e-14)


def test_fedavgm_server_learning_rate():
    generator = np.random.default_rng(3)
    start = model(generator)
    strategy = fkf.FedAvgM(server_learning_rate=0.5)
    strategy.configure_train(1, ArrayRecord({k: Array(v) for k, v in start.items()}),
                             ConfigRecord(), StandInGrid([1, 2]))
    replies = round_replies(generator, start, [1, 2])()
    out, _ = strategy.aggregate_train(1, replies)
    n = np.array([float(m.content["metrics"]["num-examples"]) for m in replies])
    for k, x in start.items():
        clients = [m.content["arrays"][k].numpy() for m in replies]
        mean = sum(w * c for w, c in zip(n / n.sum(), clients))
        np.testing.assert_allclose(out[k].numpy(), x + 0.5 * (mean - x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q", [0.0, 0.2, 1.5])
def test_qfedavg_equals_flower(q):
    ours = fkf.QFedAvg(client_learning_rate=0.05, q=q)
    theirs = flower_strategies.QFedAvg(client_learning_rate=0.05, q=q)
    diffs = run_rounds(ours, theirs, dtype=np.float64)
    assert max(diffs) < 1e-12


@pytest.mark.parametrize("name,kwargs", [
    ("FedAvgM", dict(server_learning_rate=0.7, server_momentum=0.9)),
    ("FedAdam", dict(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)),
    ("FedYogi", dict(eta=0.02, tau=1e-3)),
    ("FedAdagrad", dict(eta=0.1, tau=1e-2)),
])
def test_server_optimizers_equal_flower(name, kwargs):
    ours = getattr(fkf, name)(**kwargs)
    theirs = getattr(flower_strategies, name)(**kwargs)
    diffs = run_rounds(ours, theirs, rounds=4, dtype=np.float64)
    assert max(diffs) < 1e-10


def test_aggregate_ndarrays_equals_flower_legacy():
    from flwr.server.strategy.aggregate import aggregate as flower_aggregate

    from fedkernels.integrations.flower.legacy import aggregate_ndarrays

    generator = np.random.default_rng(1)
    results = [(list(model(generator).values()), int(n)) for n in (3, 10, 7)]
    ours = aggregate_ndarrays(results)
    theirs = flower_aggregate([([a.copy() for a in arrays], n) for arrays, n in results])
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6)


# ---------------------------------------------------------------- fairness and participation


def one_round(strategy, nodes=(1, 2, 3), seed=5, losses=None, sizes=None, grid_nodes=None):
    generator = np.random.default_rng(seed)
    start = {"w": generator.standard_normal((3, 4)), "b": generator.standard_normal(4)}
    strategy.configure_train(1, ArrayRecord({k: Array(v) for k, v in start.items()}),
                             ConfigRecord(), StandInGrid(grid_nodes or nodes))
    sizes = sizes or [10.0, 30.0, 20.0][: len(nodes)]
    losses = losses or [0.5, 2.0, 1.0][: len(nodes)]
    states = [{k: v + generator.standard_normal(v.shape) for k, v in start.items()}
              for _ in nodes]
    replies = [reply(n, s, z, f) for n, s, z, f in zip(nodes, states, sizes, losses)]
    out, _ = strategy.aggregate_train(1, replies)
    return start, states, np.array(sizes), np.array(losses), to_numpy(out)


def assert_step(start, states, weights, out, lr=1.0):
    for k, x in start.items():
        delta = sum(w * (s[k] - x) for w, s in zip(weights, states))
        np.testing.assert_allclose(out[k], x + lr * delta, rtol=1e-12, atol=1e-12)


def test_qffl_term_semivred_weights():
    start, states, n, f, out = one_round(fkf.QFFL(q=0.5))
    raw = n * f**0.5
    assert_step(start, states, raw / raw.sum(), out)

    start, states, n, f, out = one_round(fkf.TERM(tilt=2.0, server_learning_rate=0.5))
    raw = n / n.sum() * np.exp(2.0 * f)
    assert_step(start, states, raw / raw.sum(), out, lr=0.5)

    start, states, n, f, out = one_round(fkf.SemiVRed(beta=0.3))
    p = n / n.sum()
    a = np.maximum(f - (p * f).sum(), 0.0)
    assert_step(start, states, p * (1 + 2 * 0.3 * (a - (p * a).sum())), out)


def test_fedau_interval_weights():
    """Node 1 replies every round, node 2 in rounds 1, 3, 5, 7: w_n = omega_n / N with N = 2
    connected nodes and omega_n the mean of the intervals closed before the round."""
    strategy = fkf.FedAU(cutoff=50)
    grid = StandInGrid([1, 2])
    generator = np.random.default_rng(0)
    arrays = ArrayRecord({"w": Array(np.zeros(3))})
    for r in range(1, 8):
        strategy.configure_train(r, arrays, ConfigRecord(), grid)
        nodes = [1, 2] if r % 2 == 1 else [1]
        replies = [reply(n, {"w": generator.standard_normal(3)}, 1.0, 1.0) for n in nodes]
        arrays, _ = strategy.aggregate_train(r, replies)
        weights = strategy.last_weights.tolist()
    # Round 7: node 1's intervals are all 1; node 2 closed 1 (round 1, counted from the
    # start), 2 (round 3) and 2 (round 5).
    assert weights == pytest.approx([1.0 / 2, (5.0 / 3) / 2])


def test_aaggff_matches_decision_logic():
    losses = [0.5, 2.0, 1.0]
    strategy = fkf.AAggFF(mode="d", cdf="weibull")
    start, states, n, f, out = one_round(strategy, losses=losses, grid_nodes=[1, 2, 3, 4])
    reference = AAggFFD(AAggFFDConfig(cdf="weibull"))
    reference.setup(SetupInfo(num_clients=4, train_sizes=torch.ones(4), num_classes=0,
                              participation_probabilities=None, parameter_names=[]))
    reference.step(np.array([0, 1, 2]), np.array(losses), np.full(4, 3 / 4), 1)
    p = reference.decision.numpy()[:3]
    assert_step(start, states, p / p.sum(), out)

    strategy = fkf.AAggFF(mode="s")
    start, states, n, f, out = one_round(strategy, losses=losses)
    reference = AAggFFS(AAggFFConfig())
    reference.setup(SetupInfo(num_clients=3, train_sizes=torch.ones(3), num_classes=0,
                              participation_probabilities=None, parameter_names=[]))
    reference.step(torch.tensor(losses, dtype=torch.float64))
    p = reference.decision.numpy()
    assert_step(start, states, p / p.sum(), out)


def test_missing_loss_is_a_clear_error():
    strategy = fkf.TERM(loss_key="pre-train-loss")
    with pytest.raises(ValueError, match="pre-train-loss"):
        one_round(strategy)


# ---------------------------------------------------------------- conversions


def test_array_to_tensor_is_a_view_of_the_message_bytes():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    array = Array(a)
    t = fkf.array_to_tensor(array)
    base = np.frombuffer(array.data, dtype=np.uint8).ctypes.data
    assert base <= t.data_ptr() < base + len(array.data)
    assert torch.equal(t, torch.from_numpy(a))
    copied = fkf.array_to_tensor(array, copy=True)
    assert not (base <= copied.data_ptr() < base + len(array.data))
    # Fortran order, 0-d, bool and int arrays round-trip too.
    for value in (np.asfortranarray(a), np.float64(3.5) * np.ones(()), np.array([True, False]),
                  np.arange(5, dtype=np.int64)):
        assert np.array_equal(fkf.array_to_tensor(Array(np.asarray(value))).numpy(), value)


def test_integer_arrays_follow_int_policy():
    states = [{"w": np.ones(2, np.float32) * k, "num_batches_tracked": np.array(k * 10)}
              for k in (1, 2, 3)]
    replies = [reply(k, s, 1.0, 1.0) for k, s in enumerate(states)]
    # Default: Flower's behaviour, the counter averaged into float64.
    out, _ = fkf.FedAvg().aggregate_train(1, replies)
    assert out["num_batches_tracked"].numpy().dtype == np.float64
    assert float(out["num_batches_tracked"].numpy()) == pytest.approx(20.0)
    # One argument away: the counter stays an integer, the max over clients.
    out, _ = fkf.FedAvg(int_policy="max").aggregate_train(1, replies)
    assert out["num_batches_tracked"].numpy().dtype == np.int64
    assert int(out["num_batches_tracked"].numpy()) == 30
    np.testing.assert_allclose(out["w"].numpy(), [2.0, 2.0])


def test_state_dict_round_trip_bfloat16():
    state = {"a": torch.randn(3, dtype=torch.bfloat16), "b": torch.arange(4)}
    back = fkf.arrayrecord_to_state_dict(fkf.state_dict_to_arrayrecord(state))
    assert back["a"].dtype == torch.float32 and torch.equal(back["a"], state["a"].float())
    assert torch.equal(back["b"], state["b"])


@pytest.mark.slow
def test_import_without_flwr_says_how_to_install():
    code = (
        "import sys; sys.modules['flwr'] = None\n"
        "import fedkernels, fedkernels.integrations, fedkernels.integrations.adapters\n"
        "try:\n"
        "    import fedkernels.integrations.flower\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'fedkernels[flower]'" in out.stdout


ODD_ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asarray(2.5),  # 0-d float64
    np.array([True, False, True]),
    np.arange(5, dtype=np.int64),
    np.zeros((0, 3), dtype=np.float32),
    np.arange(6, dtype=">f4"),  # big-endian
    np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    np.arange(20.0)[::2],  # not contiguous
    np.arange(7, dtype=np.float16),
    np.arange(9, dtype=np.uint8).reshape(3, 3),
]


@pytest.mark.parametrize("a", ODD_ARRAYS, ids=lambda a: f"{a.dtype}-{a.shape}")
def test_ndarray_to_array_is_flowers_array(a):
    """The same object as flwr.app.Array(a), built with one copy instead of two."""
    ours, theirs = fkf.ndarray_to_array(a), Array(a)
    assert (ours.dtype, ours.shape, ours.stype) == (theirs.dtype, theirs.shape, theirs.stype)
    assert ours.data == theirs.data
    assert ours.object_id == theirs.object_id


@pytest.mark.parametrize("a", ODD_ARRAYS, ids=lambda a: f"{a.dtype}-{a.shape}")
def test_array_views_of_odd_arrays(a):
    np.testing.assert_array_equal(fkf.array_to_tensor(Array(a)).numpy(), a)


def test_array_view_checks_the_header_against_the_metadata():
    """An Array whose dtype/shape attributes disagree with its bytes is read by its header."""
    good = Array(np.arange(6, dtype=np.float32).reshape(2, 3))
    for dtype, shape in (("float64", (2, 3)), ("float32", (3, 2)), ("float32", (6,))):
        odd = Array(dtype=dtype, shape=shape, stype=good.stype, data=good.data)
        np.testing.assert_array_equal(fkf.array_to_tensor(odd).numpy(),
                                      np.arange(6, dtype=np.float32).reshape(2, 3))
