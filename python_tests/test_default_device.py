"""Calls on CPU models under another default device (``torch.set_default_device("cuda")`` in a
training script, or a ``with torch.device(...)`` block) give the result of the same calls
without it.

The ops take their small host-side arguments (weights, ``lam``, the log prior, clip
coefficients) on the CPU whatever the models' device, so every such tensor the library makes
from Python numbers is made on the CPU. These tests stand ``meta`` in for the GPU as the default
device: a tensor made there holds no values, so any one the library made without saying where
shows as an error, on machines without a GPU too.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import fedkernels as fk

HAS_FLWR = importlib.util.find_spec("flwr") is not None
HAS_NVFLARE = importlib.util.find_spec("nvflare") is not None


def _updates(k: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(6, 3, generator=g), "b": torch.randn(3, generator=g).half(),
             "n": torch.tensor(k + i)} for i in range(k)]


def _same(a, b) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.device == b.device and a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b


def _accumulate(ups, weights):
    acc = fk.Accumulator(base=ups[0])
    for u, w in zip(ups, weights):
        acc.add(u, w)
    return acc.result(normalize=True)


def _superfed_sgd(g, l, a):
    g, l = [t.clone() for t in g], [t.clone() for t in l]
    opt = fk.SuPerFedSGD(g, l, a, lr=0.1, momentum=0.9, nu=0.1, mu=0.1)
    for _ in range(2):
        theta, reg = opt.mix(0.3)
        (sum((t * t).sum() for t in theta) + reg).backward()
        opt.step()
    return g + l


def _core_calls():
    ups = _updates()
    flat = [{"w": u["w"]} for u in ups]
    g = torch.Generator().manual_seed(1)
    ge, lo, an = ([torch.randn(5, generator=g), torch.randn(2, generator=g)] for _ in range(3))
    logits = torch.randn(3, 4, 5, generator=g)
    return {
        "aggregate, NumPy weights": lambda: fk.aggregate(ups, np.array([1.0, 2, 3, 4]),
                                                         base=ups[0]),
        "aggregate, weights as a tuple of NumPy numbers": lambda: fk.aggregate(
            ups, (np.float32(1), 2, 3, 4), normalize=True),
        "Accumulator": lambda: _accumulate(ups, [1, 2.5, np.float32(3), 4]),
        "private_aggregate": lambda: fk.private_aggregate(flat, [1.0, 2, 3, 4], base=flat[0],
                                                         clip_norm=1.0, noise_std=0.0),
        "mix_endpoints, one lam": lambda: fk.mix_endpoints(ge, lo, 0.3),
        "mix_endpoints, a lam per tensor": lambda: fk.mix_endpoints(ge, lo, [0.3, 0.6]),
        "superfed_mix": lambda: fk.superfed_mix(ge, lo, 0.3, an, nu=0.1, mu=0.1),
        "superfed_stats, empty model": lambda: fk.ops.superfed_stats([]),
        "SuPerFedSGD": lambda: _superfed_sgd(ge, lo, an),
        "ensemble_pseudo_labels, sample_sizes": lambda: fk.ensemble_pseudo_labels(
            logits, sample_sizes=[10.0, 20.0, 30.0]),
    }


CORE = list(_core_calls())


@pytest.mark.parametrize("name", CORE)
def test_core_calls_on_cpu_models_ignore_the_default_device(name):
    expected = _core_calls()[name]()
    calls = _core_calls()  # the inputs are made on the CPU, before the default changes
    with torch.device("meta"):
        got = calls[name]()
    _same(got, expected)


def _flower_calls():
    from flwr.app import Array, ArrayRecord

    from fedkernels.integrations.flower import fused_weighted_mean
    from fedkernels.integrations.flower.legacy import aggregate_ndarrays

    ups = _updates()
    records = [ArrayRecord({k: Array(v.numpy()) for k, v in u.items()}) for u in ups]
    arrays = [([v.numpy() for v in u.values()], 10 + i) for i, u in enumerate(ups)]
    return {
        "fused_weighted_mean": lambda: fused_weighted_mean(records, [1.0, 2, 3, 4])[0],
        "flower_legacy.aggregate_ndarrays": lambda: aggregate_ndarrays(arrays),
    }


def _nvflare_calls():
    from fedkernels.integrations.nvflare import WeightedAggregationHelper

    ups = _updates()

    def run(as_numpy: bool):
        helper = WeightedAggregationHelper()
        for i, u in enumerate(ups):
            data = {k: v.numpy() if as_numpy else v for k, v in u.items() if k != "n"}
            helper.add(data, 1.0 + i, f"site-{i}", 1)
        return helper.get_result()

    return {"WeightedAggregationHelper, NumPy": lambda: run(True),
            "WeightedAggregationHelper, torch": lambda: run(False)}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.skipif(not HAS_FLWR, reason="needs flwr"))
    for n in ("fused_weighted_mean", "flower_legacy.aggregate_ndarrays")] + [
    pytest.param(n, marks=pytest.mark.skipif(not HAS_NVFLARE, reason="needs nvflare"))
    for n in ("WeightedAggregationHelper, NumPy", "WeightedAggregationHelper, torch")])
def test_integration_helpers_ignore_the_default_device(name):
    make = _nvflare_calls if name.startswith("Weighted") else _flower_calls
    expected = make()[name]()
    calls = make()
    with torch.device("meta"):
        got = calls[name]()
    _same(got, expected)


@pytest.mark.skipif(not HAS_FLWR, reason="needs flwr")
@pytest.mark.parametrize("strategy", ["QFFL", "FedAU", "AAggFF"])
def test_fused_flower_strategies_ignore_the_default_device(strategy):
    """A strategy built and run under another default device (its constructor too: FedAU's
    and AAggFF's state is made there) holds its state on the CPU, as the replies are."""
    from flower_message_helpers import StandInGrid, real_reply
    from flwr.app import Array, ArrayRecord, ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity

    from fedkernels.integrations import flower as fkf

    ups = _updates()
    start = {k: v.numpy() for k, v in ups[0].items()}

    def run(default: str | None):
        def rounds():
            s = getattr(fkf, strategy)(fraction_train=1.0)
            arrays = ArrayRecord({k: Array(v) for k, v in start.items()})
            for r in (1, 2):
                s.configure_train(r, arrays, ConfigRecord(), StandInGrid([1, 2, 3, 4]))
                replies = [real_reply(i + 1, {k: v.numpy() + r for k, v in u.items()},
                                      {"num-examples": 10.0 + i, "train_loss": 0.5 + i})
                           for i, u in enumerate(ups)]
                arrays, _ = s.aggregate_train(r, replies)
            return {k: v.numpy() for k, v in arrays.items()}

        if default is None:
            return rounds()
        with torch.device(default):
            return rounds()

    # configure_train builds Messages, which read the ServerApp process's identity
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    try:
        _same(run("meta"), run(None))
    finally:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = saved
