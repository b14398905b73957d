"""fedkernels.Accumulator: the streaming form gives what aggregate gives (up to float
rounding), keeps O(P) fp32 state, and rejects bad updates without changing its state."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import (
    DEVICES,
    FLOAT_DTYPES,
    HALF_DTYPES,
    assert_close,
    bitwise_equal,
    clone,
    dtype_id,
    make_clients_list,
    make_state_dicts,
    make_weights,
    to_device,
    trained_state_dicts,
)

import fedkernels
from fedkernels import Accumulator
from fedkernels.ops.reference import aggregate_reference

# mode -> (base given, scale, normalize)
MODES = {
    "plain": (False, 1.0, False),
    "plain_scaled": (False, 0.3, False),
    "normalize": (False, 1.0, True),
    "base": (True, 1.0, False),
    "base_scaled_normalize": (True, 0.6, True),
}


def _inputs(structure, num_clients, dtype, device, seed=0):
    if structure == "state_dict":
        clients = make_state_dicts(num_clients, dtype, seed, device)
        base = make_state_dicts(1, dtype, seed + 50, device)[0]
    elif structure == "tensor_list":
        shapes = [(3, 4), (65537,), (), (0,), (31,)]
        clients = make_clients_list(num_clients, shapes, dtype, seed, device)
        base = make_clients_list(1, shapes, dtype, seed + 50, device)[0]
    else:
        clients = [c[0] for c in make_clients_list(num_clients, [(6, 5)], dtype, seed, device)]
        base = make_clients_list(1, [(6, 5)], dtype, seed + 50, device)[0][0]
    return clients, base


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("structure", ["state_dict", "tensor_list", "single_tensor"])
def test_equals_aggregate(structure, mode, dtype, device):
    use_base, scale, normalize = MODES[mode]
    clients, base = _inputs(structure, 5, dtype, device, seed=1)
    base = base if use_base else None
    weights = make_weights(5, seed=1)
    acc = Accumulator(base=base, scale=scale)
    for client, w in zip(clients, weights):
        acc.add(client, w)
    assert acc.count == 5
    streamed = acc.result(normalize=normalize)
    at_once = fedkernels.aggregate(clients, weights, base=base, scale=scale, normalize=normalize)
    # Not bitwise: the streaming form rounds sum_k w_k x_k, then subtracts (sum w) b.
    assert_close(streamed, at_once, dtype, num_clients=5)
    expected = aggregate_reference(to_device(clients, "cpu"), weights,
                                   base=to_device(base, "cpu") if use_base else None,
                                   scale=scale, normalize=normalize)
    assert_close(streamed, expected, dtype, num_clients=5)


@pytest.mark.parametrize("half", HALF_DTYPES, ids=dtype_id)
def test_half_updates_with_fp32_base(half):
    clients = make_clients_list(4, [(40,), (3, 3)], half, seed=2)
    base = make_clients_list(1, [(40,), (3, 3)], torch.float32, seed=3)[0]
    weights = make_weights(4, seed=2)
    acc = Accumulator(base=base, scale=0.5)
    for c, w in zip(clients, weights):
        acc.add(c, w)
    result = acc.result(normalize=True)
    assert [r.dtype for r in result] == [torch.float32, torch.float32]
    expected = fedkernels.aggregate(clients, weights, base=base, scale=0.5, normalize=True)
    assert_close(result, expected, torch.float32, num_clients=4)


@pytest.mark.parametrize("half", HALF_DTYPES, ids=dtype_id)
def test_accumulates_in_fp32_and_keeps_p_memory(half):
    """Many small half-precision contributions: an fp32 accumulator keeps them (a half one
    would stall), and the state is one fp32 tensor per float tensor whatever K is."""
    x = [torch.full((64,), 1.0, dtype=half)]
    acc = Accumulator()
    for _ in range(2000):
        acc.add(x, 1e-3)
    assert [a.dtype for a in acc._acc] == [torch.float32]
    assert [a.shape for a in acc._acc] == [(64,)]
    result = acc.result()[0]
    assert result.dtype == half
    torch.testing.assert_close(result.float(), torch.full((64,), 2.0), rtol=1e-2, atol=0)


def test_module_state_dict_with_batchnorm():
    states = trained_state_dicts(4, seed=4)
    weights = [5, 1, 3, 2]
    for policy in ("max", "first"):
        acc = Accumulator(int_policy=policy)
        for s, w in zip(states, weights):
            acc.add(s, w)
        result = acc.result(normalize=True)
        expected = aggregate_reference(states, weights, normalize=True, int_policy=policy)
        assert_close(result, expected, num_clients=4)
        assert result["bn.num_batches_tracked"].item() == (4 if policy == "max" else 1)


def test_int_policy_skip_uses_base():
    states = trained_state_dicts(2, seed=5)
    base = {k: v.clone() for k, v in states[0].items()}
    base["bn.num_batches_tracked"].fill_(42)
    acc = Accumulator(base=base, int_policy="skip")
    for s in states:
        acc.add(s, 0.5)
    assert acc.result()["bn.num_batches_tracked"].item() == 42
    no_base = Accumulator(int_policy="skip")
    for s in states:
        no_base.add(s, 0.5)
    assert no_base.result()["bn.num_batches_tracked"].item() == 1  # the first update's


def test_int_policy_error():
    states = trained_state_dicts(1)
    acc = Accumulator(int_policy="error")
    with pytest.raises(TypeError, match="bn.num_batches_tracked"):
        acc.add(states[0], 1.0)
    assert acc.count == 0
    with pytest.raises(ValueError, match="no update"):
        acc.result()


def test_bad_int_policy():
    with pytest.raises(ValueError, match="int_policy"):
        Accumulator(int_policy="mean")


def test_result_is_repeatable_and_can_continue():
    clients = make_clients_list(4, [(10,)], torch.float32, seed=6)
    acc = Accumulator()
    acc.add(clients[0], 1.0)
    acc.add(clients[1], 2.0)
    first = acc.result()
    assert bitwise_equal(acc.result(), first)  # result() does not consume the state
    acc.add(clients[2], 3.0)
    acc.add(clients[3], 4.0)
    assert_close(acc.result(), fedkernels.aggregate(clients, [1.0, 2.0, 3.0, 4.0]),
                 num_clients=4)


def _pickled(acc):
    return pickle.loads(pickle.dumps(acc))


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, _pickled],
                         ids=["copy", "deepcopy", "pickle"])
def test_a_copy_mid_stream_goes_on_without_touching_the_original(how):
    """A copy made between adds (a snapshot, a leave-some-out variant, a checkpoint) continues
    on its own: add() writes the running sums in place, so a shallow copy that shared them
    changed the original's sums while its count and total weight stayed behind."""
    clients = make_clients_list(4, [(10,), (3, 2)], torch.float32, seed=8)
    ints = [{"w": c[0], "steps": torch.tensor([k, 9 - k])} for k, c in enumerate(clients)]
    for updates in (clients, ints):
        acc = Accumulator(base=updates[0], scale=0.5)
        acc.add(updates[0], 1.0)
        acc.add(updates[1], 2.0)
        before = acc.result(normalize=True)
        other = how(acc)
        other.add(updates[2], 3.0)
        other.add(updates[3], 4.0)
        assert acc.count == 2 and other.count == 4
        assert bitwise_equal(acc.result(normalize=True), before)
        full = Accumulator(base=updates[0], scale=0.5)
        for u, w in zip(updates, [1.0, 2.0, 3.0, 4.0]):
            full.add(u, w)
        assert bitwise_equal(other.result(normalize=True), full.result(normalize=True))
        acc.add(updates[3], 4.0)  # and the original goes on too
        assert acc.count == 3


def test_first_add_under_inference_mode_then_outside():
    """The running sums are normal tensors also when the first add() runs under
    torch.inference_mode() (or an add that moves the scale of the sums does): made there, they
    were inference tensors, and the next add() outside it failed ('Inplace update to inference
    tensor outside InferenceMode')."""
    clients = make_clients_list(3, [(10,), (3, 2)], torch.float32, seed=9)
    weights = [1.0, 2.0, 2.0**40]  # the third moves the unit of the sums: a rescaling pass
    acc = Accumulator()
    with torch.inference_mode():
        acc.add(clients[0], weights[0])
    acc.add(clients[1], weights[1])
    with torch.inference_mode():
        acc.add(clients[2], weights[2])
    acc.add(clients[0], 1.0)
    full = Accumulator()
    for c, w in zip(clients + clients[:1], weights + [1.0]):
        full.add(c, w)
    assert bitwise_equal(acc.result(normalize=True), full.result(normalize=True))


def test_reset():
    clients = make_clients_list(2, [(10,)], torch.float32, seed=7)
    acc = Accumulator(scale=2.0)
    acc.add(clients[0], 1.0)
    acc.reset()
    assert acc.count == 0
    acc.add(clients[1], 1.0)
    assert_close(acc.result(), [2.0 * clients[1][0]])


def test_result_before_add_and_zero_weight_sum():
    acc = Accumulator()
    with pytest.raises(ValueError, match="no update"):
        acc.result()
    x = [torch.ones(3)]
    acc.add(x, 1.0)
    acc.add(x, -1.0)
    with pytest.raises(ValueError, match="sum to 0"):
        acc.result(normalize=True)
    assert_close(acc.result(), [torch.zeros(3)])


def test_weight_as_tensor_and_int():
    clients = make_clients_list(2, [(5,)], torch.float64, seed=8)
    acc = Accumulator()
    acc.add(clients[0], torch.tensor(3.0))
    acc.add(clients[1], 2)
    assert_close(acc.result(), aggregate_reference(clients, [3.0, 2.0]), torch.float64)


# ---------------------------------------------------------------- bad updates


def _started():
    acc = Accumulator()
    first = {"w": torch.randn(3, 2), "b": torch.randn(4), "n": torch.tensor(5)}
    acc.add(first, 0.5)
    return acc, first


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda u: u.update(b=torch.randn(5)), ValueError, ["update 1", "'b'", "shape"]),
        (lambda u: u.update(b=torch.randn(4, dtype=torch.float64)), TypeError,
         ["update 1", "'b'", "dtype"]),
        (lambda u: u.update(w=torch.empty(3, 2, device="meta")), ValueError,
         ["update 1", "'w'", "meta"]),
        (lambda u: u.pop("b"), ValueError, ["update 1", "'b'"]),
        (lambda u: u.update(extra=torch.randn(1)), ValueError, ["update 1", "'extra'"]),
        (lambda u: u.update(n=torch.tensor([1, 2])), ValueError, ["update 1", "'n'"]),
        (lambda u: u.update(b=[1.0, 2.0, 3.0, 4.0]), TypeError, ["update 1", "'b'"]),
    ],
    ids=["shape", "dtype", "device", "missing_key", "extra_key", "int_shape", "not_tensor"],
)
def test_bad_update_names_it_and_changes_nothing(change, error, words):
    acc, first = _started()
    before = acc.result()
    update = {k: torch.randn_like(v) if v.is_floating_point() else v.clone()
              for k, v in first.items()}
    change(update)
    with pytest.raises(error) as info:
        acc.add(update, 1.0)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert acc.count == 1
    assert bitwise_equal(acc.result(), before)


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_names_the_update(weight):
    acc, first = _started()
    before = acc.result()
    with pytest.raises(ValueError, match="update 1"):
        acc.add(clone(first), weight)
    assert acc.count == 1
    assert bitwise_equal(acc.result(), before)


@pytest.mark.parametrize(
    "base_change, words",
    [
        (lambda b: b.update(w=torch.randn(1)), ["base", "'w'"]),
        (lambda b: b.update(w=torch.randn(3, 2, dtype=torch.float64)), ["base", "'w'", "float64"]),
        (lambda b: b.pop("w"), ["base", "'w'"]),
    ],
    ids=["shape", "dtype", "missing_key"],
)
def test_bad_base_is_rejected(base_change, words):
    """A base that does not match the updates is an error, never broadcast into the result."""
    update = {"w": torch.randn(3, 2), "b": torch.randn(4)}
    base = {k: torch.randn_like(v) for k, v in update.items()}
    base_change(base)
    acc = Accumulator(base=base)
    with pytest.raises((ValueError, TypeError)) as info:
        acc.add(update, 1.0)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert acc.count == 0


def test_structure_errors_speak_as_the_accumulator():
    # They said "fedkernels.aggregate: update 1 has different keys than client 0".
    acc = Accumulator(int_policy="error")
    acc2 = Accumulator()
    acc2.add({"a": torch.ones(2)}, 1.0)
    with pytest.raises(ValueError, match=r"^fedkernels\.Accumulator: update 1 has different "
                                         r"keys than the first update; missing \['a'\]"):
        acc2.add({"b": torch.ones(2)}, 1.0)
    with pytest.raises(TypeError, match=r"^fedkernels\.Accumulator: update 0 has unsupported"):
        acc2.__class__().add(torch.ones(2, dtype=torch.complex64), 1.0)
    with pytest.raises(TypeError, match=r"^fedkernels\.Accumulator: tensor 'n' .*'error'"):
        acc.add({"a": torch.ones(2), "n": torch.tensor(1)}, 1.0)
