"""Every error path of fedkernels.aggregate and of the native op: the exception names the
client and the tensor (state_dict key) at fault, and nothing is written to ``out`` (or to
the base updated in place) when validation fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import bitwise_equal

import fedkernels
from fedkernels import ops

SENTINEL = 123.0
INT_SENTINEL = 77

SHAPES = {"enc.weight": (4, 3), "enc.bias": (4,), "head.weight": (2, 4), "head.bias": ()}


def make_setup(num_clients=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    clients = []
    for k in range(num_clients):
        sd = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
        sd["bn.num_batches_tracked"] = torch.tensor(k + 1)
        clients.append(sd)
    base = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
    base["bn.num_batches_tracked"] = torch.tensor(10)
    return clients, [0.1, 0.2, 0.3, 0.4][:num_clients], base


def sentinel_like(model):
    return {k: torch.full_like(v, SENTINEL if v.is_floating_point() else INT_SENTINEL)
            for k, v in model.items()}


def untouched(model) -> bool:
    return all(
        bool((v == (SENTINEL if v.is_floating_point() else INT_SENTINEL)).all())
        for v in model.values() if v.device.type != "meta"
    )


def _real_tensors(model):
    items = model.items() if isinstance(model, dict) else enumerate(model)
    return {k: v for k, v in items if isinstance(v, torch.Tensor) and v.device.type != "meta"}


def snapshot(models):
    return [{k: v.clone() for k, v in _real_tensors(m).items()} for m in models]


def same(models, snap) -> bool:
    """Bitwise unchanged (NaN included)."""
    return all(bitwise_equal(_real_tensors(m)[k], s[k]) for m, s in zip(models, snap) for k in s)


# ------------------------------------------------------------------ cases on the inputs
# Each case mutates (clients, weights, base) and returns extra aggregate() arguments,
# the exception type and the words the message must contain.


def _missing_key(c, w, b):
    del c[2]["head.weight"]
    return {}, ValueError, ["client 2", "'head.weight'", "missing"]


def _extra_key(c, w, b):
    c[1]["extra"] = torch.zeros(1)
    return {}, ValueError, ["client 1", "'extra'"]


def _shape(c, w, b):
    c[2]["enc.bias"] = torch.randn(5)
    return {}, ValueError, ["client 2", "'enc.bias'", "shape", "[5]", "[4]"]


def _shape_0d(c, w, b):
    c[3]["head.bias"] = torch.randn(1)
    return {}, ValueError, ["client 3", "'head.bias'", "shape"]


def _dtype(c, w, b):
    c[1]["head.weight"] = c[1]["head.weight"].double()
    return {}, TypeError, ["client 1", "'head.weight'", "dtype", "Double", "Float"]


def _device(c, w, b):
    c[3]["enc.weight"] = torch.empty(4, 3, device="meta")
    return {}, ValueError, ["client 3", "'enc.weight'", "meta"]


def _int_shape(c, w, b):
    c[2]["bn.num_batches_tracked"] = torch.tensor([1, 2])
    return {}, ValueError, ["client 2", "'bn.num_batches_tracked'"]


def _int_dtype(c, w, b):
    c[1]["bn.num_batches_tracked"] = torch.tensor(1, dtype=torch.int32)
    return {}, ValueError, ["client 1", "'bn.num_batches_tracked'", "int32"]


def _unsupported_dtype(c, w, b):
    for client in c:
        client["enc.bias"] = client["enc.bias"].to(torch.complex64)
    return {}, TypeError, ["client 0", "'enc.bias'", "complex64"]


def _unsupported_dtype_later_client(c, w, b):
    c[2]["enc.bias"] = c[2]["enc.bias"].to(torch.complex64)
    return {}, TypeError, ["client 2", "'enc.bias'", "dtype"]


def _not_a_tensor(c, w, b):
    c[1]["enc.bias"] = [1.0, 2.0, 3.0, 4.0]
    return {}, TypeError, ["client 1", "'enc.bias'", "list"]


def _client_structure(c, w, b):
    c[2] = list(c[2].values())
    return {}, TypeError, ["client 2", "list"]


def _weights_short(c, w, b):
    del w[-1]
    return {}, ValueError, ["4 clients", "weights", "(3,)"]


def _weights_long(c, w, b):
    w.append(1.0)
    return {}, ValueError, ["4 clients", "(5,)"]


def _weights_2d(c, w, b):
    return {"weights": torch.tensor([[0.1, 0.2], [0.3, 0.4]])}, ValueError, ["(2, 2)"]


def _weights_nan(c, w, b):
    w[2] = float("nan")
    return {}, ValueError, ["client 2", "nan"]


def _weights_inf(c, w, b):
    w[1] = float("inf")
    return {"weights": torch.tensor(w)}, ValueError, ["client 1", "inf"]


def _weights_not_numbers(c, w, b):
    return {"weights": ["a", "b", "c", "d"]}, TypeError, ["weights"]


def _weights_complex(c, w, b):
    return {"weights": torch.ones(4, dtype=torch.complex64)}, TypeError, ["weights", "complex"]


def _normalize_zero_sum(c, w, b):
    return {"weights": [1.0, -1.0, 2.0, -2.0], "normalize": True}, ValueError, ["sum to 0"]


def _int_policy_error(c, w, b):
    return {"int_policy": "error"}, TypeError, ["'bn.num_batches_tracked'", "int_policy"]


def _bad_int_policy(c, w, b):
    return {"int_policy": "mean"}, ValueError, ["int_policy", "'mean'"]


def _check_finite(c, w, b):
    c[2]["enc.bias"][1] = float("nan")
    c[0]["head.weight"][0, 0] = float("inf")
    return ({"check_finite": True}, ValueError,
            ["client 0", "'head.weight'", "client 2", "'enc.bias'", "NaN"])


INPUT_CASES = [
    _missing_key, _extra_key, _shape, _shape_0d, _dtype, _device, _int_shape, _int_dtype,
    _unsupported_dtype, _unsupported_dtype_later_client, _not_a_tensor, _client_structure,
    _weights_short, _weights_long, _weights_2d, _weights_nan, _weights_inf, _weights_not_numbers,
    _weights_complex, _normalize_zero_sum, _int_policy_error, _bad_int_policy, _check_finite,
]


def _ids(cases):
    return [c.__name__.lstrip("_") for c in cases]


def _raise(call, error, words):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


@pytest.mark.parametrize("case", INPUT_CASES, ids=_ids(INPUT_CASES))
def test_input_error_writes_nothing_to_out(case):
    clients, weights, base = make_setup()
    kwargs, error, words = case(clients, weights, base)
    kwargs = {"weights": weights, **kwargs}
    out = sentinel_like(base)
    before = snapshot(clients)
    _raise(lambda: fedkernels.aggregate(clients, out=out, **kwargs), error, words)
    assert untouched(out)
    assert same(clients, before)


@pytest.mark.parametrize("case", INPUT_CASES, ids=_ids(INPUT_CASES))
def test_input_error_leaves_in_place_base_unchanged(case):
    clients, weights, base = make_setup()
    kwargs, error, words = case(clients, weights, base)
    kwargs = {"weights": weights, **kwargs}
    [before] = snapshot([base])
    _raise(lambda: fedkernels.aggregate(clients, base=base, out=base, **kwargs), error, words)
    assert same([base], [before])


def test_check_finite_off_lets_nan_through():
    clients, weights, _ = make_setup()
    clients[2]["enc.bias"][1] = float("nan")
    result = fedkernels.aggregate(clients, weights)
    assert torch.isnan(result["enc.bias"][1])
    assert torch.isfinite(result["enc.bias"][[0, 2, 3]]).all()
    assert fedkernels.aggregate(clients[:2], weights[:2], check_finite=True)  # clean clients


# ------------------------------------------------------------------ base errors


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda b: b.update({"enc.bias": torch.randn(3)}), ValueError,
         ["base", "'enc.bias'", "shape"]),
        (lambda b: b.update({"head.weight": torch.randn(2, 4, dtype=torch.float64)}), TypeError,
         ["base", "'head.weight'", "dtype"]),
        (lambda b: b.update({"enc.weight": torch.empty(4, 3, device="meta")}), ValueError,
         ["base", "'enc.weight'", "meta"]),
        (lambda b: b.pop("head.bias"), ValueError, ["base", "'head.bias'", "missing"]),
        (lambda b: b.update({"head.bias": 1.0}), TypeError, ["base", "'head.bias'"]),
    ],
    ids=["shape", "dtype", "device", "missing_key", "not_a_tensor"],
)
def test_base_error(change, error, words):
    clients, weights, base = make_setup()
    change(base)
    out = sentinel_like(clients[0])
    _raise(lambda: fedkernels.aggregate(clients, weights, base=base, out=out), error, words)
    assert untouched(out)


# ------------------------------------------------------------------ out errors


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda o: o.update({"enc.bias": torch.zeros(4, dtype=torch.float64)}), TypeError,
         ["out", "'enc.bias'", "dtype"]),
        (lambda o: o.update({"head.weight": torch.zeros(4, 2)}), ValueError,
         ["out", "'head.weight'", "shape"]),
        (lambda o: o.update({"enc.weight": torch.empty(4, 3, device="meta")}), ValueError,
         ["out", "'enc.weight'", "meta"]),
        (lambda o: o.update({"bn.num_batches_tracked": torch.zeros(2, dtype=torch.int64)}),
         ValueError, ["out", "'bn.num_batches_tracked'"]),
        (lambda o: o.update({"bn.num_batches_tracked": torch.zeros((), dtype=torch.float32)}),
         ValueError, ["out", "'bn.num_batches_tracked'"]),
        (lambda o: o.pop("enc.bias"), ValueError, ["out", "'enc.bias'", "missing"]),
        (lambda o: o.update({"enc.bias": torch.zeros(1).expand(4)}), ValueError,
         ["out", "'enc.bias'", "overlap"]),
    ],
    ids=["dtype", "shape", "device", "int_shape", "int_dtype", "missing_key",
         "internal_overlap"],
)
def test_out_error(change, error, words):
    clients, weights, _ = make_setup()
    out = sentinel_like(clients[0])
    original = dict(out)
    change(out)
    _raise(lambda: fedkernels.aggregate(clients, weights, out=out), error, words)
    assert untouched({k: v for k, v in original.items() if out.get(k) is v})


def test_out_aliasing_a_client():
    clients, weights, _ = make_setup()
    before = snapshot(clients)
    message = _raise(lambda: fedkernels.aggregate(clients, weights, out=clients[1]), ValueError,
                     ["client 1", "alias"])
    assert any(f"'{k}'" in message for k in clients[0])
    assert same(clients, before)


def test_out_partly_aliasing_a_client():
    clients, weights, _ = make_setup()
    before = snapshot(clients)
    out = sentinel_like(clients[0])
    out["head.weight"] = clients[2]["head.weight"].t().t()  # a view of client 2's tensor
    _raise(lambda: fedkernels.aggregate(clients, weights, out=out), ValueError,
           ["client 2", "'head.weight'", "overlaps"])
    assert same(clients, before)
    assert untouched({k: v for k, v in out.items() if k != "head.weight"})


def test_out_overlapping_a_slice_of_a_client():
    """Overlap of memory ranges, not only equal pointers: out views the middle of a client."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(100, generator=g)
    clients = [[big[0:40]], [torch.randn(40, generator=g)]]
    before = big.clone()
    _raise(lambda: fedkernels.aggregate(clients, [1.0, 1.0], out=[big[30:70]]), ValueError,
           ["client 0", "tensor 0", "overlaps"])
    assert torch.equal(big, before)


def test_out_aliasing_base_outside_in_place():
    clients, weights, base = make_setup()
    [before] = snapshot([base])
    out = sentinel_like(base)
    out["enc.bias"] = base["enc.bias"]
    _raise(lambda: fedkernels.aggregate(clients, weights, base=base, out=out), ValueError,
           ["base", "'enc.bias'", "overlaps"])
    assert same([base], [before])
    assert untouched({k: v for k, v in out.items() if k != "enc.bias"})


def test_out_twice_the_same_tensor():
    # One tensor under two positions is written once (tied weights), so the clients must agree
    # there; these do not (python_tests/test_written_tensors.py has the accepted case).
    clients = [[torch.randn(5), torch.randn(5)] for _ in range(2)]
    shared = torch.full((5,), SENTINEL)
    _raise(lambda: fedkernels.aggregate(clients, [1.0, 1.0], out=[shared, shared]), ValueError,
           ["out tensors 0 and 1 are one tensor", "client 0"])
    assert (shared == SENTINEL).all()


def test_aliasing_between_inputs_is_fine():
    """The same tensor for several clients (or as base) is only read: allowed."""
    x = torch.randn(6)
    result = fedkernels.aggregate([[x], [x], [x]], [1.0, 2.0, 3.0], base=[x])
    torch.testing.assert_close(result[0], x)


# ------------------------------------------------------------------ other structures


def test_empty_client_list():
    out = [torch.full((3,), SENTINEL)]
    _raise(lambda: fedkernels.aggregate([], [], out=out), ValueError, ["K = 0"])
    assert (out[0] == SENTINEL).all()
    _raise(lambda: fedkernels.aggregate(torch.zeros(0, 5), []), ValueError, ["K = 0"])


def test_list_clients_wrong_number_of_tensors():
    clients = [[torch.randn(2), torch.randn(3), torch.randn(4)] for _ in range(3)]
    clients[1] = clients[1][:2]
    out = [torch.full((n,), SENTINEL) for n in (2, 3, 4)]
    _raise(lambda: fedkernels.aggregate(clients, [1, 1, 1], out=out), ValueError,
           ["client 1", "2 tensors", "client 0 has 3"])
    assert all((o == SENTINEL).all() for o in out)


def test_list_clients_shape_names_index():
    clients = [[torch.randn(2), torch.randn(3)] for _ in range(3)]
    clients[2][1] = torch.randn(4)
    out = [torch.full((2,), SENTINEL), torch.full((3,), SENTINEL)]
    _raise(lambda: fedkernels.aggregate(clients, [1, 1, 1], out=out), ValueError,
           ["client 2, tensor 1", "shape"])
    assert all((o == SENTINEL).all() for o in out)


def test_single_tensor_clients_errors_name_the_client():
    clients = [torch.randn(3), torch.randn(3), torch.randn(4)]
    out = torch.full((3,), SENTINEL)
    message = _raise(lambda: fedkernels.aggregate(clients, [1, 1, 1], out=out), ValueError,
                     ["client 2", "shape"])
    assert "None" not in message
    assert (out == SENTINEL).all()
    _raise(lambda: fedkernels.aggregate(clients[:2], [1, 1], out=torch.zeros(3).double()),
           TypeError, ["out", "dtype"])


def test_flat_errors():
    updates = torch.randn(3, 8)
    _raise(lambda: fedkernels.aggregate(torch.randn(3, 2, 4), [1, 1, 1]), ValueError, ["2-D"])
    _raise(lambda: fedkernels.aggregate(updates, [1, 1, 1], base=torch.randn(2, 4)), ValueError,
           ["1-D"])
    out = torch.full((8,), SENTINEL)
    _raise(lambda: fedkernels.aggregate(updates, [1, 1], out=out), ValueError, ["3 clients"])
    assert (out == SENTINEL).all()
    _raise(lambda: fedkernels.aggregate(updates, [1, 1, 1], out=updates[1]), ValueError,
           ["client 1", "overlaps"])


def test_updates_of_wrong_type():
    _raise(lambda: fedkernels.aggregate({"a": torch.zeros(1)}, [1.0]), TypeError, ["sequence"])
    _raise(lambda: fedkernels.aggregate("abc", [1.0, 1.0, 1.0]), TypeError, ["sequence"])
    _raise(lambda: fedkernels.aggregate([1.0, 2.0], [1.0, 1.0]), TypeError, ["client 0"])
    modules = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    _raise(lambda: fedkernels.aggregate(modules, [1.0, 1.0]), TypeError,
           ["client 0", "Linear", "state_dict()"])


# ------------------------------------------------------------------ the native op


def _op_inputs():
    g = torch.Generator().manual_seed(5)
    clients = [[torch.randn(3, generator=g), torch.randn(2, 2, generator=g)] for _ in range(3)]
    return [t for c in clients for t in c], torch.tensor([0.5, 0.25, 0.25])


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda u, w: (u, torch.tensor([]), []), ValueError, ["at least one client"]),
        (lambda u, w: (u[:5], w, []), ValueError, ["5 update tensors", "3 weights"]),
        (lambda u, w: (u, w.reshape(1, 3), []), ValueError, ["weights must be 1-D"]),
        (lambda u, w: (u, torch.tensor([0.5, float("nan"), 1.0]), []), ValueError,
         ["client 1", "nan"]),
        (lambda u, w: (u, torch.tensor([True, False, True]), []), TypeError, ["weights"]),
        (lambda u, w: (u[:3] + [torch.randn(3)] + u[4:], w, []), ValueError,
         ["client 1, tensor 1", "shape"]),
        (lambda u, w: (u[:4] + [u[4].double()] + u[5:], w, []), TypeError,
         ["client 2, tensor 0", "dtype"]),
        (lambda u, w: (u[:5] + [torch.empty(2, 2, device="meta")], w, []), ValueError,
         ["client 2, tensor 1", "meta"]),
        (lambda u, w: ([t.long() for t in u], w, []), TypeError,
         ["client 0, tensor 0", "Long"]),
        (lambda u, w: (u, w, [torch.randn(3)]), ValueError, ["base has 1 tensors"]),
        (lambda u, w: (u, w, [torch.randn(3), torch.randn(4)]), ValueError,
         ["base tensor 1", "shape"]),
        (lambda u, w: (u, w, [torch.randn(3), torch.randn(2, 2).half()]), TypeError,
         ["base tensor 1", "dtype"]),
    ],
    ids=["no_clients", "count", "weights_2d", "weights_nan", "weights_bool", "shape", "dtype",
         "device", "int_updates", "base_count", "base_shape", "base_dtype"],
)
def test_op_input_errors(make, error, words):
    updates, weights, base = make(*_op_inputs())
    _raise(lambda: ops.weighted_sum(updates, weights, base, 1.0, True), error, words)
    out = [torch.full((3,), SENTINEL), torch.full((2, 2), SENTINEL)]
    _raise(lambda: ops.weighted_sum_out(updates, weights, base, 1.0, True, out), error, words)
    assert all((o == SENTINEL).all() for o in out)


def test_op_out_errors():
    updates, weights = _op_inputs()
    good = [torch.full((3,), SENTINEL), torch.full((2, 2), SENTINEL)]
    for out, error, words in [
        (good[:1], ValueError, ["out has 1 tensors"]),
        ([good[0], torch.zeros(4)], ValueError, ["out tensor 1", "shape"]),
        ([good[0], torch.zeros(2, 2).double()], TypeError, ["out tensor 1", "dtype"]),
        ([good[0], updates[3]], ValueError, ["out tensor 1", "overlaps client 1, tensor 1"]),
        ([good[0], torch.zeros(2).expand(2, 2)], ValueError, ["out tensor 1", "overlap"]),
    ]:
        _raise(lambda out=out: ops.weighted_sum_out(updates, weights, [], 1.0, False, out), error, words)
        assert (good[0] == SENTINEL).all()


def test_op_in_place_base_aliasing_an_update():
    updates, weights = _op_inputs()
    before = [u.clone() for u in updates]
    base = [updates[2], torch.zeros(2, 2)]  # base tensor 0 is client 1's tensor 0
    _raise(lambda: ops.weighted_sum_(base, updates, weights, 1.0, True), ValueError,
           ["out tensor 0", "client 1, tensor 0"])
    assert all(torch.equal(a, b) for a, b in zip(updates, before))
    assert torch.equal(base[1], torch.zeros(2, 2))
    _raise(lambda: ops.weighted_sum_(base[:1], updates, weights, 1.0, True), ValueError,
           ["base has 1 tensors"])


# ------------------------------------------------------------------ CUDA


@pytest.mark.cuda
def test_cuda_device_mismatch_names_client_and_tensor(cuda_device):
    clients, weights, base = make_setup()
    clients = [{k: v.to(cuda_device) for k, v in c.items()} for c in clients]
    clients[2]["enc.bias"] = clients[2]["enc.bias"].cpu()
    out = {k: v.to(cuda_device) for k, v in sentinel_like(base).items()}
    _raise(lambda: fedkernels.aggregate(clients, weights, out=out), ValueError,
           ["client 2", "'enc.bias'", "cpu"])
    assert untouched({k: v.cpu() for k, v in out.items()})
    clients[2]["enc.bias"] = clients[2]["enc.bias"].to(cuda_device)
    cpu_out = sentinel_like(base)
    _raise(lambda: fedkernels.aggregate(clients, weights, out=cpu_out), ValueError,
           ["out", "cpu"])
    assert untouched(cpu_out)
    cpu_clients = [{k: v.cpu() for k, v in c.items()} for c in clients]
    _raise(lambda: fedkernels.aggregate(cpu_clients, torch.tensor(weights, device=cuda_device)),
           ValueError, ["weights are on cuda"])


def test_out_int_entry_aliasing_a_client():
    """Integer entries are copied into out after the sum: out must not alias a client there
    either (it would overwrite the client's counter)."""
    clients, weights, _ = make_setup()
    before = snapshot(clients)
    out = sentinel_like(clients[0])
    out["bn.num_batches_tracked"] = clients[1]["bn.num_batches_tracked"]
    _raise(lambda: fedkernels.aggregate(clients, weights, out=out), ValueError,
           ["client 1", "'bn.num_batches_tracked'", "alias"])
    assert same(clients, before)
    assert untouched({k: v for k, v in out.items() if k != "bn.num_batches_tracked"})


# ------------------------------------------------------------------ integer outputs, base, range


def _two_counters(num_clients=2):
    """Clients with a float entry and two integer entries (two BatchNorm counters)."""
    return [{"w": torch.full((3,), float(k + 1)), "a.n": torch.tensor([k, k + 1, k + 2]),
             "b.n": torch.tensor(k)} for k in range(num_clients)]


def test_out_int_entry_expanded_writes_nothing():
    clients = _two_counters()
    out = sentinel_like(clients[0])
    out["a.n"] = torch.full((1,), INT_SENTINEL).expand(3)  # stride 0: one element, three views
    before = snapshot(clients)
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], out=out), ValueError,
           ["out tensor 'a.n'", "share memory"])
    assert untouched(out) and same(clients, before)


def test_out_int_entry_overlapping_a_slice_of_a_client_int():
    """A partial overlap (not an equal pointer) with a client's counter is caught too."""
    clients = _two_counters()
    storage = torch.arange(10)
    clients[1]["a.n"] = storage[2:5]
    before = snapshot(clients)
    out = sentinel_like(clients[0])
    out["a.n"] = storage[3:6]
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], out=out), ValueError,
           ["out tensor 'a.n'", "overlaps client 1, tensor 'a.n'", "alias"])
    assert same(clients, before)
    assert untouched({k: v for k, v in out.items() if k != "a.n"})
    assert torch.equal(storage, torch.arange(10))


def test_out_int_entry_overlapping_a_client_int_of_another_key():
    clients = _two_counters()
    before = snapshot(clients)
    out = sentinel_like(clients[0])
    out["b.n"] = clients[0]["a.n"][1]  # client 0's other counter
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], out=out), ValueError,
           ["out tensor 'b.n'", "client 0, tensor 'a.n'"])
    assert same(clients, before)


def test_out_int_entries_sharing_memory():
    clients = _two_counters()
    out = sentinel_like(clients[0])
    out["b.n"] = out["a.n"][0]
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], out=out), ValueError,
           ["out tensor", "'a.n'", "'b.n'", "overlaps"])
    assert untouched(out)


def test_out_float_entry_over_a_client_int_is_refused():
    """A float output that reuses the memory of a client's counter would overwrite it."""
    clients = [{"w": torch.full((2,), float(k + 1), dtype=torch.float64),
                "n": torch.tensor([k, k + 1])} for k in range(2)]
    before = snapshot(clients)
    out = sentinel_like(clients[0])
    out["w"] = clients[1]["n"].view(torch.float64)
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], out=out), ValueError,
           ["out tensor 'w'", "client 1, tensor 'n'"])
    assert same(clients, before)


def test_out_int_entry_on_another_device():
    clients = _two_counters()
    out = sentinel_like(clients[0])
    out["b.n"] = torch.empty((), dtype=torch.int64, device="meta")
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], out=out), ValueError,
           ["out tensor 'b.n'", "meta"])
    assert untouched(out)


@pytest.mark.parametrize("policy", ["skip", "max", "first"])
@pytest.mark.parametrize(
    "bad, words",
    [(torch.tensor([1, 2]), ["(2,)", "(3,)"]),
     (torch.tensor([1.0, 2.0, 3.0]), ["torch.float32", "torch.int64"]),
     (torch.tensor([1, 2, 3], dtype=torch.int32), ["torch.int32"]),
     (torch.empty(3, dtype=torch.int64, device="meta"), ["meta"])],
    ids=["shape", "float_dtype", "int_dtype", "device"],
)
def test_base_int_entry_is_checked(policy, bad, words):
    """int_policy='skip' returns the base's integer entries: a wrong one is an error, not the
    result; the other policies check them as well (the base has the clients' structure)."""
    clients = _two_counters()
    base = {k: v.clone() for k, v in clients[0].items()}
    base["a.n"] = bad
    out = sentinel_like(clients[0])
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], base=base, out=out,
                                        int_policy=policy),
           ValueError, ["base tensor 'a.n'", *words])
    assert untouched(out)
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], base=base, int_policy=policy),
           ValueError, ["base tensor 'a.n'"])


def test_skip_keeps_a_valid_base_in_place():
    clients = _two_counters()
    base = {"w": torch.zeros(3), "a.n": torch.tensor([7, 8, 9]), "b.n": torch.tensor(5)}
    counter = base["a.n"]
    result = fedkernels.aggregate(clients, [0.5, 0.5], base=base, out=base, int_policy="skip")
    assert result is base and base["a.n"] is counter
    assert base["a.n"].tolist() == [7, 8, 9] and int(base["b.n"]) == 5
    torch.testing.assert_close(base["w"], torch.full((3,), 1.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_weight_beyond_float32_is_refused(dtype):
    """1e39 is finite in float64 but inf once cast to the fp32 accumulator (and 0 * inf is
    NaN): an error naming the client, before anything is written."""
    clients = [[torch.zeros(3, dtype=dtype)], [torch.ones(3, dtype=dtype)]]
    out = [torch.full((3,), SENTINEL, dtype=dtype)]
    _raise(lambda: fedkernels.aggregate(clients, [1.0, 1e39], out=out), ValueError,
           ["weight of client 1", "1e+39", "float32 range", "tensor 0"])
    assert (out[0] == SENTINEL).all()
    _raise(lambda: fedkernels.aggregate(clients, [-2e39, 1.0]), ValueError,
           ["weight of client 0", "-2e+39"])


def test_huge_weights_with_normalize_are_exact():
    """normalize=True divides in float64 first: 1e39 and 3e39 are exactly 0.25 and 0.75."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        clients = [[torch.randn(7, generator=g).to(dtype)] for _ in range(2)]
        huge = fedkernels.aggregate(clients, [1e39, 3e39], normalize=True)[0]
        plain = fedkernels.aggregate(clients, [0.25, 0.75])[0]
        assert bitwise_equal(huge, plain)
    clients = [[torch.randn(4, generator=g)] for _ in range(2)]
    assert bitwise_equal(fedkernels.aggregate(clients, [1e308, 1e308], normalize=True)[0],
                         fedkernels.aggregate(clients, [0.5, 0.5])[0])  # float64 sum is inf


def test_normalized_weights_beyond_float32_are_refused():
    clients = [[torch.ones(2)], [torch.ones(2)], [torch.ones(2)]]
    _raise(lambda: fedkernels.aggregate(clients, [1e20, -1e20, 1e-20], normalize=True),
           ValueError, ["weight of client 0", "after normalization", "float32"])
    with pytest.raises(ValueError, match="client 0"):  # 1e300 / 1e-100 is inf in float64
        fedkernels.aggregate(clients, [1e300, -1e300, 1e-100], normalize=True)


def test_huge_weights_are_fine_for_float64_models():
    clients = [[torch.full((2,), 2.0, dtype=torch.float64)], [torch.zeros(2, dtype=torch.float64)]]
    result = fedkernels.aggregate(clients, [1e39, 1e39])[0]
    assert result.tolist() == [2e39, 2e39]


def test_scale_must_be_finite_and_fit_the_accumulator():
    clients = [[torch.ones(2)], [torch.ones(2)]]
    out = [torch.full((2,), SENTINEL)]
    for scale in (float("nan"), float("inf")):
        _raise(lambda s=scale: fedkernels.aggregate(clients, [0.5, 0.5], scale=s, out=out),
               ValueError, ["scale must be finite"])
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], scale=1e39, out=out), ValueError,
           ["scale", "float32 range"])
    assert (out[0] == SENTINEL).all()
    doubles = [[c[0].double()] for c in clients]
    assert fedkernels.aggregate(doubles, [0.5, 0.5], scale=1e39)[0].tolist() == [1e39, 1e39]


def test_accumulator_weight_beyond_float32_needs_normalize():
    # As aggregate: a weight beyond float32 is refused for an unnormalised float32 result
    # (w x itself is beyond float32), and fine once normalised.
    acc = fedkernels.Accumulator()
    acc.add([torch.ones(2)], 2.0)
    acc.add([3 * torch.ones(2)], 1e39)
    _raise(lambda: acc.result(), ValueError, ["1e+39", "float32", "normalize=True"])
    torch.testing.assert_close(acc.result(normalize=True)[0], torch.full((2,), 3.0))
    assert acc.count == 2
    wide = fedkernels.Accumulator()
    wide.add([torch.ones(2, dtype=torch.float64)], 1e39)
    assert wide.result(normalize=True)[0].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="scale must be finite"):
        fedkernels.Accumulator(scale=float("nan"))


@pytest.mark.parametrize("weights", [[3e38, 3e38], [1e-46, 1e-46], [1e-30, 3e-30],
                                     [1e38, 2.5e38]])
@pytest.mark.parametrize("form", ["tensor", "list", "state_dict"])
def test_accumulator_sums_weights_near_the_float32_limits_like_aggregate(weights, form):
    # Each weight is a float32 number, but their sum or their fp32 value is not (3e38 + 3e38
    # overflows, 1e-46 is 0 in float32); aggregate normalises them in float64 first.
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    wrap = {"tensor": lambda t: t, "list": lambda t: [t], "state_dict": lambda t: {"w": t}}[form]
    acc = fedkernels.Accumulator()
    acc.add(wrap(x), weights[0])
    acc.add(wrap(y), weights[1])
    got = acc.result(normalize=True)
    expected = fedkernels.aggregate([wrap(x), wrap(y)], weights, normalize=True)
    unwrap = {"tensor": lambda m: m, "list": lambda m: m[0], "state_dict": lambda m: m["w"]}[form]
    torch.testing.assert_close(unwrap(got), unwrap(expected))
    # A later weight far beyond the others: the others' share underflows, as in aggregate.
    acc.add(wrap(y), weights[0] * 1e60)
    torch.testing.assert_close(unwrap(acc.result(normalize=True)), y)


@pytest.mark.parametrize("use_base", [False, True], ids=["plain", "base"])
def test_accumulator_unnormalised_weight_near_the_float32_limit(use_base):
    # The unit of a weight of 3e38 is 2^128, beyond float32: the result was inf (and 0 * inf =
    # NaN) where aggregate gives w x, which float32 holds.
    x = torch.tensor([0.0, 0.5, 1.0])
    base = torch.zeros(3) if use_base else None
    for weights in ([3e38], [1.0, 3e38]):
        acc = fedkernels.Accumulator(base=base)
        for w in weights:
            acc.add(x, w)
        expected = fedkernels.aggregate([x] * len(weights), weights, base=base)
        torch.testing.assert_close(acc.result(), expected)
        assert bool(torch.isfinite(acc.result()).all())


def test_accumulator_weights_whose_float64_sum_overflows():
    # 1e308 + 1e308 is inf in float64: normalising by it gave zeros; aggregate divides by the
    # largest weight first. A weight beyond 2^1023 (no power of two above it in float64)
    # raised OverflowError in add.
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    for weights in ([1e308, 1e308], [1.7e308, 1.7e308]):
        for base in (None, torch.tensor([0.5, -1.0])):
            acc = fedkernels.Accumulator(base=base)
            acc.add(x, weights[0])
            acc.add(y, weights[1])
            expected = fedkernels.aggregate([x, y], weights, base=base, normalize=True)
            torch.testing.assert_close(acc.result(normalize=True), expected)
    wide = fedkernels.Accumulator()
    wide.add(x.double(), 1.7e308)
    torch.testing.assert_close(wide.result(), fedkernels.aggregate([x.double()], [1.7e308]))


def test_accumulator_refuses_what_aggregate_refuses():
    # A scale beyond float32 for a float32 model gave NaN and inf; aggregate refuses it.
    acc = fedkernels.Accumulator(scale=1e39)
    acc.add([torch.zeros(2), torch.ones(2, dtype=torch.float64)], 1.0)
    _raise(lambda: acc.result(), ValueError, ["scale 1e+39", "float32", "tensor 0"])
    wide = fedkernels.Accumulator(scale=1e39)
    wide.add([torch.ones(2, dtype=torch.float64)], 1.0)
    assert wide.result()[0].tolist() == [1e39, 1e39]
    # A sparse update is named, as aggregate names it (not the dispatcher's "Could not run").
    acc = fedkernels.Accumulator()
    acc.add({"w": torch.ones(3)}, 1.0)
    _raise(lambda: acc.add({"w": torch.ones(3).to_sparse()}, 1.0), TypeError,
           ["update 1", "'w'", "sparse_coo", "to_dense"])
    # A weight on the meta device has no value to read.
    _raise(lambda: acc.add({"w": torch.ones(3)}, torch.ones(1, device="meta")), ValueError,
           ["update 1", "meta"])
    assert acc.count == 1
    assert acc.result()["w"].tolist() == [1.0, 1.0, 1.0]


def test_none_weights_and_overflowing_scale_are_named():
    # NumPy read None as NaN: weights=None was "weights of shape ()", [1, None] "weight of
    # client 1 is nan"; a scale of 10**400 raised OverflowError from float().
    models = [{"w": torch.ones(2)}, {"w": torch.ones(2)}]
    _raise(lambda: fedkernels.aggregate(models, None), TypeError,
           ["weights must be real numbers, got None"])
    _raise(lambda: fedkernels.aggregate(models, [1.0, None]), TypeError,
           ["weights must be real numbers, got NoneType"])
    _raise(lambda: fedkernels.aggregate(models, [1.0, 1.0], scale=10**400), ValueError,
           ["scale is beyond the float64 range"])
    # check_finite has no values to scan on the meta device (it raised from .item())
    meta = [{"w": torch.ones(2, device="meta")}] * 2
    assert fedkernels.aggregate(meta, [1.0, 1.0], check_finite=True)["w"].is_meta


def test_accumulator_checks_the_base_int_entries():
    clients = _two_counters()
    base = {"w": torch.zeros(3), "a.n": torch.tensor([1.0, 2.0, 3.0]), "b.n": torch.tensor(0)}
    acc = fedkernels.Accumulator(base=base, int_policy="skip")
    _raise(lambda: acc.add(clients[0], 1.0), ValueError, ["base tensor 'a.n'", "float32"])
    assert acc.count == 0


@pytest.mark.cuda
def test_cuda_out_int_entry_overlapping_a_client_int(cuda_device):
    clients = [{k: v.to(cuda_device) for k, v in c.items()} for c in _two_counters()]
    storage = torch.arange(10, device=cuda_device)
    clients[1]["a.n"] = storage[2:5]
    out = {k: v.to(cuda_device) for k, v in sentinel_like(clients[0]).items()}
    out["a.n"] = storage[3:6]
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], out=out), ValueError,
           ["out tensor 'a.n'", "client 1, tensor 'a.n'"])
    assert torch.equal(storage.cpu(), torch.arange(10))
    assert untouched({k: v.cpu() for k, v in out.items() if k != "a.n"})
    cpu_out = sentinel_like(_two_counters()[0])  # same addresses on another device: no overlap
    _raise(lambda: fedkernels.aggregate(clients, [0.5, 0.5], out=cpu_out), ValueError, ["cpu"])


@pytest.mark.parametrize(
    "weights",
    [[True, False, True], (1.0, np.bool_(True), 0.5), np.array([True, False, True]),
     torch.tensor([True, False, True])],
    ids=["list", "mixed_tuple", "ndarray", "tensor"],
)
def test_boolean_weights_are_refused_however_they_come(weights):
    """A mask of clients is not a weighting: bool weights raise TypeError in a list, a tuple, a
    NumPy array or a tensor alike (before, only the tensor was refused), in aggregate and in
    the private aggregator, which checks weights the same way."""
    models = [{"w": torch.full((3,), float(k))} for k in range(3)]
    _raise(lambda: fedkernels.aggregate(models, weights), TypeError, ["weights must be real numbers"])
    _raise(lambda: fedkernels.privacy.private_aggregate(models, weights, base=models[0],
                                                        clip_norm=1.0, noise_std=0.0),
           TypeError, ["fedkernels.private_aggregate: weights must be real numbers"])


@pytest.mark.parametrize("weights", [["1", "2"], np.array(["1", "2"]), [1.0, b"2"]])
def test_text_weights_are_refused(weights):
    # NumPy would read "1" as 1.0: a table column of text is not a weighting.
    with pytest.raises(TypeError, match="weights must be real numbers, got (str|bytes)"):
        fedkernels.aggregate([torch.ones(2), torch.ones(2)], weights)


@pytest.mark.parametrize("scale", [True, "2", None, [1.0]])
def test_scale_must_be_a_number(scale):
    with pytest.raises(TypeError, match="fedkernels.aggregate: scale must be a number"):
        fedkernels.aggregate([torch.ones(2)], [1.0], scale=scale)
    with pytest.raises(TypeError, match="fedkernels.Accumulator: scale must be a number"):
        fedkernels.Accumulator(scale=scale)


def test_numpy_scalars_are_numbers():
    got = fedkernels.aggregate([torch.ones(2)], [1.0], scale=np.float32(0.5))
    assert got.tolist() == [0.5, 0.5]
    got = fedkernels.trimmed_mean([torch.ones(2)] * 5, np.float32(0.2))
    assert got.tolist() == [1.0, 1.0]


def test_sparse_tensor_is_named():
    clients = [{"a": torch.ones(2), "w": torch.eye(3).to_sparse()} for _ in range(2)]
    with pytest.raises(TypeError, match="client 0, tensor 'w' has layout torch.sparse_coo"):
        fedkernels.aggregate(clients, [1.0, 1.0])
