"""Real threads against the stateful objects (the contract: ``docs/guide/python_api.md``,
"Threads"). Accumulator and NVFlare's aggregators serialise concurrent calls with a lock, so
threads adding into one get the exact sum; the objects not meant for concurrent use (an
optimizer, a distributed partial, a Flower strategy) refuse a call made while another thread
is inside one, with a RuntimeError naming them, leaving the object as the first call leaves it.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

import fedkernels
from fedkernels.integrations.distributed import WeightedPartial
from fedkernels.ops import mixing_sgd
from fedkernels.ops.concurrency import CopyableLock, one_call_at_a_time

THREADS = 4


def _in_threads(work, count: int = THREADS) -> list[BaseException]:
    """Runs ``work(i)`` in ``count`` threads started together; returns what they raised."""
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(i):
        start.wait()
        try:
            work(i)
        except BaseException as err:  # noqa: BLE001  (reported to the test)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


@pytest.mark.parametrize("attempt", range(3))
def test_threads_adding_into_one_accumulator_get_the_exact_sum(attempt):
    # Large enough that one add's native pass takes a while: without the lock, two passes
    # over the same running sum interleave and updates are lost (every one of 3 attempts on
    # the unlocked class).
    acc = fedkernels.Accumulator()
    adds = 50
    updates = [{"w": torch.full((200_000,), float(i + 1)), "n": torch.tensor(i)}
                for i in range(THREADS)]

    def work(i):
        for _ in range(adds):
            acc.add(updates[i], 2.0)

    assert _in_threads(work) == []
    assert acc.count == THREADS * adds
    want = 2.0 * adds * sum(range(1, THREADS + 1))  # integers: exact in float32
    got = acc.result()
    assert torch.equal(got["w"], torch.full((200_000,), want))
    assert int(got["n"]) == THREADS - 1
    assert torch.equal(acc.result(normalize=True)["w"],
                       torch.full((200_000,), want / (2.0 * THREADS * adds)))


def test_snapshots_taken_while_threads_add_are_consistent():
    acc = fedkernels.Accumulator()
    ones = [torch.ones(20_000)]
    snapshots = []

    def work(i):
        for _ in range(30):
            if i == 0:
                snapshots.append(copy.copy(acc) if len(snapshots) % 2 else copy.deepcopy(acc))
            else:
                acc.add(ones, 1.0)

    assert _in_threads(work) == []
    assert acc.count == (THREADS - 1) * 30
    for snap in snapshots:
        if snap.count:  # each snapshot's sum is exactly its own count of adds
            assert torch.equal(snap.result()[0], torch.full((20_000,), float(snap.count)))
    snap = copy.copy(acc)
    snap.add(ones, 1.0)  # a copy goes on alone, with a lock of its own
    assert acc.count == (THREADS - 1) * 30 and snap.count == acc.count + 1


def test_nvflare_helper_sums_concurrent_contributions():
    nvflare = pytest.importorskip("fedkernels.integrations.nvflare",
                                  exc_type=ImportError)
    helper = nvflare.WeightedAggregationHelper()
    adds = 20

    def work(i):
        for r in range(adds):
            helper.add({"w": np.full(20_000, float(i + 1), np.float32)}, 1.0, f"site-{i}", r)

    assert _in_threads(work) == []
    want = adds * sum(range(1, THREADS + 1)) / (adds * THREADS)
    np.testing.assert_array_equal(helper.get_result()["w"], np.full(20_000, want, np.float32))


class _Gate:
    """Weights whose conversion holds the calling thread inside the method until opened."""

    def __init__(self, values):
        self.values, self.entered, self.open = values, threading.Event(), threading.Event()

    def __len__(self):
        return len(self.values)

    def __array__(self, dtype=None, copy=None):
        self.entered.set()
        assert self.open.wait(30)
        return np.asarray(self.values, dtype=dtype)


def _second_call_while_first_is_inside(first, second, gate: _Gate) -> BaseException | None:
    """Runs ``first`` in a thread until it is inside the method (at the gate), then ``second``
    here; returns what ``second`` raised, after letting ``first`` finish."""
    errors = []
    thread = threading.Thread(target=lambda: errors.extend(_catch(first)))
    thread.start()
    try:
        assert gate.entered.wait(30)
        raised = _catch(second)
    finally:
        gate.open.set()
        thread.join(30)
    assert errors == [], errors
    return raised[0] if raised else None


def _catch(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001
        return [err]
    return []


def test_a_weighted_partial_refuses_a_concurrent_call_and_stays_whole():
    clients = [{"w": torch.full((4,), float(k + 1))} for k in range(3)]
    partial = WeightedPartial.from_clients(clients[:1], [1.0])
    gate = _Gate([1.0, 1.0])
    err = _second_call_while_first_is_inside(
        lambda: partial.add_clients(clients[1:], gate),
        lambda: partial.add_clients(clients[:1], [5.0]), gate)
    assert isinstance(err, RuntimeError)
    assert "fedkernels.WeightedPartial.add_clients: called while another thread" in str(err)
    assert partial.count == 3  # the first call's clients only
    assert torch.equal(partial.result()["w"], torch.full((4,), 6.0))
    partial.add_clients(clients[:1], [5.0])  # one after the other: fine, from any thread
    assert partial.count == 4


def test_superfed_sgd_refuses_a_concurrent_step(monkeypatch):
    g = [torch.randn(5)]
    l = [torch.randn(5)]
    opt = fedkernels.SuPerFedSGD(g, l, lr=0.1, nu=0.5, mu=0.0)
    theta, reg = opt.mix(0.5)
    (theta[0].sum() + reg).backward()
    gate = _Gate([])
    real_step = mixing_sgd.superfed_sgd_step_

    def held(*args, **kwargs):
        np.asarray(gate)  # waits at the gate, inside step()
        return real_step(*args, **kwargs)

    monkeypatch.setattr(mixing_sgd, "superfed_sgd_step_", held)
    before = [t.clone() for t in g + l]
    err = _second_call_while_first_is_inside(opt.step, lambda: opt.mix(0.5), gate)
    assert isinstance(err, RuntimeError) and "fedkernels.SuPerFedSGD.mix" in str(err)
    assert not all(torch.equal(a, b) for a, b in zip(before, g + l))  # the first step ran
    opt.mix(0.5)  # afterwards: fine


def test_flower_strategies_are_guarded():
    pytest.importorskip("flwr")
    from fedkernels.integrations import flower
    from fedkernels.integrations.flower import central_dp, legacy, legacy_central_dp, robust

    message_api = [flower.FedAvg, flower.FedAvgM, flower.FedAdam, flower.QFedAvg, flower.FedAU,
                   robust.Krum, robust.Bulyan, robust.FedMedian,
                   central_dp.DifferentialPrivacyServerSideAdaptiveClipping]
    for cls in message_api:
        assert hasattr(cls.aggregate_train, "__wrapped__"), cls
    for cls in (legacy.FedAvg, legacy.FedAvgM, legacy.QFedAvg,
                legacy_central_dp.DifferentialPrivacyServerSideFixedClipping):
        assert hasattr(cls.aggregate_fit, "__wrapped__"), cls


def test_the_guard_itself():
    class Thing:
        def __init__(self):
            self.calls = 0
            self.gate = _Gate([])

        @one_call_at_a_time("Thing")
        def slow(self):
            np.asarray(self.gate)
            self.calls += 1
            self.fast()  # a guarded method calling another on the same thread: allowed

        @one_call_at_a_time()
        def fast(self):
            self.calls += 1

    thing = Thing()
    err = _second_call_while_first_is_inside(thing.slow, thing.fast, thing.gate)
    assert isinstance(err, RuntimeError) and str(err).startswith("Thing.fast: called while")
    assert thing.calls == 2
    other = Thing()
    other.gate.open.set()
    other.slow()  # another object: its own guard
    clone = copy.copy(thing)  # and a copy too, free to use
    clone.fast()
    lock = copy.deepcopy(CopyableLock(reentrant=True))
    with lock, lock:  # reentrant, and unlocked after the copy
        pass
