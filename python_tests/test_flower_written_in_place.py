"""The Flower drop-ins write their result where the outgoing Array keeps it, and the FedOpt
family steps chunk by chunk: the bytes equal ``Array(ndarray)``'s, the replies' bytes are never
written, and the chunked step equals Flower's classes over several rounds, chunk edges
included (a chunk size far below the arrays' sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flower_message_helpers import assert_arrays_equal, real_reply  # noqa: E402
from flwr.app import Array, ArrayRecord  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402

from fedkernels.integrations import flower as ours  # noqa: E402
from fedkernels.integrations.flower import drop_ins  # noqa: E402
from fedkernels.integrations.flower.records import array_with_buffer  # noqa: E402
from fedkernels.integrations.flower.weighted_mean import fused_weighted_mean  # noqa: E402

SHAPES = {"conv": (7, 3, 5, 5), "bias": (7,), "fc": (45, 11), "one": (1,)}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1,), (13,), (2, 3, 4), (600, 3)])
def test_array_with_buffer_is_numpys_serialization(dtype, shape):
    values = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    array, view = array_with_buffer(values.dtype, shape)
    view.copy_(torch.from_numpy(values))
    expected = Array(values)
    assert type(array.data) is bytes
    assert (array.dtype, array.shape, array.stype) == (expected.dtype, expected.shape,
                                                       expected.stype)
    assert array.data == expected.data
    np.testing.assert_array_equal(array.numpy(), values)


@pytest.mark.parametrize("dtype, shape", [(np.float32, (0,)), (np.int64, (3,)),
                                          (np.dtype(">f4"), (3,))])
def test_array_with_buffer_declines_what_it_cannot_write(dtype, shape):
    assert array_with_buffer(np.dtype(dtype), shape) is None


def _models(k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [{n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
            for _ in range(k)]


def _replies(models, sizes):
    return [real_reply(i + 1, m, {"num-examples": float(n)})
            for i, (m, n) in enumerate(zip(models, sizes))]


def test_fused_mean_as_arrays_leaves_the_replies_bytes_alone():
    models = _models(4, np.float32)
    replies = _replies(models, [3, 1, 4, 1])
    records = [r.content["arrays"] for r in replies]
    before = [{n: bytes(a.data) for n, a in r.items()} for r in records]
    factors = [3 / 9, 1 / 9, 4 / 9, 1 / 9]
    arrays, _ = fused_weighted_mean(records, factors, as_arrays=True)
    means, _ = fused_weighted_mean(records, factors)
    for r, saved in zip(records, before):
        assert {n: a.data for n, a in r.items()} == saved
    for n, a in arrays.items():
        assert isinstance(a, Array)
        assert a.data == Array(means[n]).data


@pytest.mark.parametrize("name", ["FedAvg", "FedAdam", "FedYogi", "FedAdagrad"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rounds_equal_flowers_across_chunk_edges(name, dtype, monkeypatch):
    # 100 values a chunk: every array but the smallest spans chunks, with a partial last one.
    monkeypatch.setattr(drop_ins, "_STEP_CHUNK", 100)
    kwargs = {} if name == "FedAvg" else {"eta": 0.05}
    theirs, mine = getattr(flower, name)(**kwargs), getattr(ours, name)(**kwargs)
    start = _models(1, dtype, seed=9)[0]
    if name != "FedAvg":  # as FedOpt's configure_train keeps them: ndarrays
        theirs.current_arrays = {n: a.copy() for n, a in start.items()}
        mine.current_arrays = {n: a.copy() for n, a in start.items()}
    for server_round in (1, 2, 3):
        models = _models(5, dtype, seed=server_round)
        sizes = [10, 20, 5, 7, 1]
        a, _ = theirs.aggregate_train(server_round, _replies(models, sizes))
        replies = _replies(models, sizes)
        saved = [{n: bytes(x.data) for n, x in r.content["arrays"].items()} for r in replies]
        b, _ = mine.aggregate_train(server_round, replies)
        assert [{n: x.data for n, x in r.content["arrays"].items()} for r in replies] == saved
        rtol, atol = (1e-9, 1e-12) if dtype == np.float64 else (2e-5, 2e-5)
        assert_arrays_equal(b, a, rtol, atol, what=f"{name} round {server_round}")
        if name != "FedAvg":
            assert_arrays_equal(mine.m_t, theirs.m_t, rtol, atol, what="m_t")
            assert_arrays_equal(mine.v_t, theirs.v_t, rtol, atol, what="v_t")
            mine.current_arrays = {n: x.numpy() for n, x in b.items()}
            theirs.current_arrays = {n: x.numpy() for n, x in a.items()}


@pytest.mark.parametrize("name", ["FedAdam", "FedYogi", "FedAdagrad"])
def test_numpy_hyperparameters_keep_flowers_dtypes(name):
    # A NumPy float64 beta/tau promotes float32 moments to float64 in Flower's formulas: the
    # chunked step declines and Flower's arithmetic runs.
    theirs, mine = getattr(flower, name)(), getattr(ours, name)()
    for s in (theirs, mine):
        s.tau = np.float64(1e-3)
        s.beta_1 = np.float64(s.beta_1)
    start = _models(1, np.float32, seed=4)[0]
    models = _models(3, np.float32, seed=5)
    theirs.current_arrays = {n: a.copy() for n, a in start.items()}
    mine.current_arrays = {n: a.copy() for n, a in start.items()}
    a, _ = theirs.aggregate_train(1, _replies(models, [1, 2, 3]))
    b, _ = mine.aggregate_train(1, _replies(models, [1, 2, 3]))
    assert_arrays_equal(b, a, 2e-5, 2e-5)
    assert_arrays_equal(mine.m_t, theirs.m_t, 2e-5, 2e-5, what="m_t")
    assert_arrays_equal(mine.v_t, theirs.v_t, 2e-5, 2e-5, what="v_t")


@pytest.mark.parametrize("kwargs", [{}, {"server_learning_rate": 0.7},
                                    {"server_learning_rate": 0.5, "server_momentum": 0.9}],
                         ids=["mean only", "step", "momentum"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fedavgm_rounds_equal_flowers(kwargs, dtype):
    theirs, mine = flower.FedAvgM(**kwargs), ours.FedAvgM(**kwargs)
    start = _models(1, dtype, seed=9)[0]
    theirs.current_arrays = ArrayRecord({n: Array(a) for n, a in start.items()})
    mine.current_arrays = ArrayRecord({n: Array(a) for n, a in start.items()})
    for server_round in (1, 2, 3):
        models = _models(5, dtype, seed=server_round)
        sizes = [10, 20, 5, 7, 1]
        a, _ = theirs.aggregate_train(server_round, _replies(models, sizes))
        replies = _replies(models, sizes)
        saved = [{n: bytes(x.data) for n, x in r.content["arrays"].items()} for r in replies]
        b, _ = mine.aggregate_train(server_round, replies)
        assert [{n: x.data for n, x in r.content["arrays"].items()} for r in replies] == saved
        rtol, atol = (1e-9, 1e-12) if dtype == np.float64 else (2e-5, 2e-5)
        assert_arrays_equal(b, a, rtol, atol, what=f"FedAvgM round {server_round}")
        assert all(x.data == Array(x.numpy()).data for x in b.values())
        if theirs.momentum_vector is None:
            assert mine.momentum_vector is None
        else:
            for m, t in zip(mine.momentum_vector, theirs.momentum_vector, strict=True):
                assert m.dtype == t.dtype
                np.testing.assert_allclose(m, t, rtol=rtol, atol=atol)
        if not kwargs:  # no server step: Flower keeps current_arrays as it was
            continue
        assert_arrays_equal(mine.current_arrays, theirs.current_arrays, rtol, atol)


def test_fedavgm_steps_every_float_array_in_the_fused_passes(monkeypatch):
    """The fused step takes every float array (Flower's NumPy formulas run on none)."""
    taken = []
    real = drop_ins.FedAvgM._fused_steps

    def counting(self, names, *args):
        out = real(self, names, *args)
        taken.append(set(out) == set(names))
        return out

    monkeypatch.setattr(drop_ins.FedAvgM, "_fused_steps", counting)
    mine = ours.FedAvgM(server_learning_rate=0.5, server_momentum=0.9)
    mine.current_arrays = ArrayRecord({n: Array(a) for n, a in
                                       _models(1, np.float32, seed=3)[0].items()})
    for server_round in (1, 2):
        mine.aggregate_train(server_round, _replies(_models(3, np.float32), [1, 2, 3]))
    assert taken == [True, True]


def test_qfedavg_writes_flowers_float64_result_into_the_outgoing_bytes():
    theirs, mine = flower.QFedAvg(client_learning_rate=0.1), ours.QFedAvg(client_learning_rate=0.1)
    start = _models(1, np.float32, seed=2)[0]
    models = _models(4, np.float32, seed=6)
    result = []
    for s in (theirs, mine):
        s.current_arrays = ArrayRecord({n: Array(a) for n, a in start.items()})
        replies = [real_reply(i + 1, m, {"num-examples": 1.0, "train_loss": 0.5 + i})
                   for i, m in enumerate(models)]
        result.append(s.aggregate_train(1, replies)[0])
    a, b = result
    assert all(x.dtype == "float64" and x.data == Array(x.numpy()).data for x in b.values())
    assert_arrays_equal(b, a, 2e-5, 2e-5, what="QFedAvg")
