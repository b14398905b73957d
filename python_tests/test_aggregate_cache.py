"""fedkernels.aggregate remembers the layout of a model structure across calls (to keep its
per-call overhead below that of a Python loop on small models). The remembered layout must
never hide an error: after a valid call has warmed it, a call whose inputs differ in shape,
dtype, key set, container type, device or memory aliasing raises exactly the error that a
cold call raises, and writes nothing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from conftest import bitwise_equal

import fedkernels
from fedkernels import model_layout
from fedkernels.model_layout import ModelLayout, weight_vector, weights_and_values

SENTINEL = 123.0


def make_clients(num_clients=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    clients = []
    for k in range(num_clients):
        clients.append({
            "enc.weight": torch.randn(4, 3, generator=g),
            "enc.bias": torch.randn(4, generator=g),
            "bn.num_batches_tracked": torch.tensor(k + 1),
            "head.weight": torch.randn(2, 4, generator=g),
        })
    return clients


def sentinel_like(model):
    return {k: torch.full_like(v, SENTINEL if v.is_floating_point() else 77)
            for k, v in model.items()}


def untouched(model) -> bool:
    return all(bool((v == (SENTINEL if v.is_floating_point() else 77)).all())
               for v in model.values() if v.device.type != "meta")


def outcome(call):
    """("ok", result) or (exception type, message)."""
    try:
        return "ok", call()
    except Exception as err:  # noqa: BLE001 - the type is part of what is compared
        return type(err), str(err)


def same_outcome(a, b) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] != "ok":
        return a[1] == b[1]
    ra, rb = a[1], b[1]
    if isinstance(ra, Mapping):
        return ra.keys() == rb.keys() and all(bitwise_equal(ra[k], rb[k]) for k in ra)
    if isinstance(ra, torch.Tensor):
        return bitwise_equal(ra, rb)
    return all(bitwise_equal(x, y) for x, y in zip(ra, rb))


def warm_then_cold(valid_call, call):
    """``call``'s outcome right after ``valid_call`` warmed the layout cache, and again with
    the cache emptied."""
    model_layout._LAYOUT_CACHE.clear()
    assert outcome(valid_call)[0] == "ok"
    assert model_layout._LAYOUT_CACHE, "the valid call did not remember its layout"
    warm = outcome(call)
    model_layout._LAYOUT_CACHE.clear()
    cold = outcome(call)
    return warm, cold


# ------------------------------------------------------------------ the cache itself


def test_layout_is_remembered_for_the_same_keys_and_dtypes():
    a, b = make_clients(2)
    model_layout._LAYOUT_CACHE.clear()
    first = ModelLayout.of(a, "client 0")
    assert ModelLayout.of(b, "client 1") is first
    assert ModelLayout.of(OrderedDict(b), "client 1") is first  # state_dict's own type
    assert first.float_mask == (True, True, False, True)

    b["bn.num_batches_tracked"] = b["bn.num_batches_tracked"].float()
    changed = ModelLayout.of(b, "client 1")
    assert changed is not first and changed.float_mask == (True, True, True, True)

    reordered = dict(reversed(list(a.items())))
    assert ModelLayout.of(reordered, "client 0").names == tuple(reversed(first.names))


def test_cache_is_bounded():
    model_layout._LAYOUT_CACHE.clear()
    for n in range(3 * model_layout._LAYOUT_CACHE_SIZE):
        ModelLayout.of({f"w{n}": torch.zeros(1)}, "client 0")
    assert len(model_layout._LAYOUT_CACHE) <= model_layout._LAYOUT_CACHE_SIZE


def test_cache_holds_no_tensor():
    """Only names and dtypes are remembered: no client's memory is kept alive."""
    model_layout._LAYOUT_CACHE.clear()
    fedkernels.aggregate(make_clients(2), [0.5, 0.5])
    for key, layout in model_layout._LAYOUT_CACHE.items():
        for part in (*key, *vars(layout).values()):
            assert not isinstance(part, torch.Tensor)
            if isinstance(part, tuple):
                assert not any(isinstance(x, torch.Tensor) for x in part)


# ------------------------------------------------------------------ errors after a warm call
# Each case changes (clients, weights) after a valid call of the same structure and returns
# extra arguments; the call must fail (or succeed) exactly as it does with a cold cache.


def _shape(c, w):
    c[2]["enc.bias"] = torch.randn(5)
    return {}


def _shape_of_client_0(c, w):
    c[0]["head.weight"] = torch.randn(4, 2)
    return {}


def _dtype(c, w):
    c[1]["head.weight"] = c[1]["head.weight"].double()
    return {}


def _dtype_of_client_0(c, w):
    c[0]["enc.weight"] = c[0]["enc.weight"].double()
    return {}


def _dtype_of_every_client(c, w):
    for client in c:
        client["enc.bias"] = client["enc.bias"].half()
    return {}


def _unsupported_dtype(c, w):
    c[0]["enc.bias"] = c[0]["enc.bias"].to(torch.complex64)
    return {}


def _int_entry_becomes_float_in_one_client(c, w):
    c[3]["bn.num_batches_tracked"] = c[3]["bn.num_batches_tracked"].float()
    return {}


def _int_entry_shape(c, w):
    c[1]["bn.num_batches_tracked"] = torch.tensor([1, 2])
    return {}


def _missing_key(c, w):
    del c[2]["head.weight"]
    return {}


def _extra_key(c, w):
    c[1]["extra"] = torch.zeros(1)
    return {}


def _renamed_key(c, w):
    c[3]["head.w"] = c[3].pop("head.weight")
    return {}


def _missing_key_in_client_0(c, w):
    del c[0]["enc.bias"]
    return {}


def _keys_in_another_order(c, w):  # valid: matched by name
    c[2] = dict(reversed(list(c[2].items())))
    return {}


def _other_mapping_type(c, w):  # valid: any Mapping
    class Frozen(Mapping):
        def __init__(self, d):
            self._d = dict(d)

        def __getitem__(self, k):
            return self._d[k]

        def __iter__(self):
            return iter(self._d)

        def __len__(self):
            return len(self._d)

    c[1] = Frozen(c[1])
    return {}


def _dict_subclass_reordering_values(c, w):
    class Odd(dict):  # iterates in a different order than it stores: read by name
        def values(self):
            return reversed(list(super().values()))

    c[1] = Odd(c[1])
    return {}


def _not_a_tensor(c, w):
    c[1]["enc.bias"] = [1.0, 2.0, 3.0, 4.0]
    return {}


def _numpy_array(c, w):
    c[2]["enc.weight"] = c[2]["enc.weight"].numpy()
    return {}


def _client_is_a_list(c, w):
    c[2] = list(c[2].values())
    return {}


def _device(c, w):
    c[3]["enc.weight"] = torch.empty(4, 3, device="meta")
    return {}


def _out_aliases_a_client(c, w):
    return {"out": c[1]}


def _out_entry_is_a_view_of_a_client(c, w):
    out = sentinel_like(c[0])
    out["head.weight"] = c[2]["head.weight"].t().t()
    return {"out": out}


def _out_int_entry_aliases_a_client(c, w):
    out = sentinel_like(c[0])
    out["bn.num_batches_tracked"] = c[1]["bn.num_batches_tracked"]
    return {"out": out}


def _out_expanded(c, w):
    out = sentinel_like(c[0])
    out["enc.bias"] = torch.full((1,), SENTINEL).expand(4)
    return {"out": out}


def _out_shape(c, w):
    out = sentinel_like(c[0])
    out["enc.weight"] = torch.full((3, 4), SENTINEL)
    return {"out": out}


def _base_shape(c, w):
    base = sentinel_like(c[0])
    base["enc.bias"] = torch.zeros(3)
    return {"base": base}


def _base_int_dtype(c, w):
    base = sentinel_like(c[0])
    base["bn.num_batches_tracked"] = torch.tensor(1, dtype=torch.int32)
    return {"base": base, "int_policy": "skip"}


def _weight_nan(c, w):
    w[2] = float("nan")
    return {}


def _weight_int_too_large(c, w):
    return {"weights": [1, 2, 10 ** 400, 4]}


def _weight_beyond_float32(c, w):
    w[1] = 1e39
    return {}


def _weights_short(c, w):
    del w[-1]
    return {}


def _weights_bool(c, w):  # refused, as a bool tensor is: a mask of clients is not a weighting
    return {"weights": [True, False, True, True]}


def _weights_numpy_scalars(c, w):  # valid
    return {"weights": [np.float64(x) for x in w]}


def _weights_sum_to_zero(c, w):
    return {"weights": [1.0, -1.0, 2.0, -2.0], "normalize": True}


def _weights_overflowing_sum(c, w):  # valid: normalize divides by the largest first
    return {"weights": [1e308, 1e308, 1e308, 1e308], "normalize": True}


def _int_policy_error(c, w):
    return {"int_policy": "error"}


CASES = [
    _shape, _shape_of_client_0, _dtype, _dtype_of_client_0, _dtype_of_every_client,
    _unsupported_dtype, _int_entry_becomes_float_in_one_client, _int_entry_shape, _missing_key,
    _extra_key, _renamed_key, _missing_key_in_client_0, _keys_in_another_order,
    _other_mapping_type, _dict_subclass_reordering_values, _not_a_tensor, _numpy_array,
    _client_is_a_list, _device, _out_aliases_a_client, _out_entry_is_a_view_of_a_client,
    _out_int_entry_aliases_a_client, _out_expanded, _out_shape, _base_shape, _base_int_dtype,
    _weight_nan, _weight_int_too_large, _weight_beyond_float32, _weights_short, _weights_bool,
    _weights_numpy_scalars, _weights_sum_to_zero, _weights_overflowing_sum, _int_policy_error,
]
VALID = {"_keys_in_another_order", "_other_mapping_type", "_dict_subclass_reordering_values",
         "_dtype_of_every_client", "_weights_numpy_scalars", "_weights_overflowing_sum"}


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.lstrip("_") for c in CASES])
def test_a_warm_layout_never_hides_an_error(case):
    clients, weights = make_clients(), [0.1, 0.2, 0.3, 0.4]
    valid_clients = make_clients(seed=1)
    kwargs = {"weights": weights, **case(clients, weights)}
    snapshot = [{k: v.clone() for k, v in c.items() if isinstance(v, torch.Tensor)
                 and v.device.type != "meta"} for c in clients if isinstance(c, Mapping)]

    def call():
        return fedkernels.aggregate(clients, **kwargs)

    warm, cold = warm_then_cold(lambda: fedkernels.aggregate(valid_clients, [0.5] * 4), call)
    assert same_outcome(warm, cold), f"warm: {warm}\ncold: {cold}"
    if case.__name__ in VALID:
        assert warm[0] == "ok"
    else:
        assert warm[0] in (ValueError, TypeError, OverflowError), warm
        out = kwargs.get("out")
        if out is not None and out is not clients[1]:  # nothing written to out (the
            # entries that share a client's memory are checked with the inputs below)
            client_memory = {t.data_ptr() for c in clients for t in c.values()}
            assert untouched({k: v for k, v in out.items()
                              if v.data_ptr() not in client_memory})
    # The inputs are never written either.
    for c, before in zip([c for c in clients if isinstance(c, Mapping)], snapshot):
        for k, v in before.items():
            assert bitwise_equal(c[k], v)


def test_in_place_changes_to_the_same_dicts_are_seen():
    """The same dict objects, changed in place between calls: keyed by content, not identity."""
    clients = make_clients()
    weights = [0.25] * 4
    model_layout._LAYOUT_CACHE.clear()
    fedkernels.aggregate(clients, weights)
    clients[2]["enc.bias"] = torch.randn(3)
    with pytest.raises(ValueError, match=r"client 2, tensor 'enc.bias' has shape \[3\]"):
        fedkernels.aggregate(clients, weights)
    clients[2]["enc.bias"] = torch.randn(4)
    del clients[1]["head.weight"]
    with pytest.raises(ValueError, match="client 1 has different keys.*missing"):
        fedkernels.aggregate(clients, weights)
    clients[1]["head.weight"] = torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="client 1, tensor 'head.weight' has dtype"):
        fedkernels.aggregate(clients, weights)


@pytest.mark.parametrize("change", ["shape", "dtype", "length", "not_a_tensor", "tuple"])
def test_tensor_list_clients_after_a_warm_call(change):
    g = torch.Generator().manual_seed(4)
    clients = [[torch.randn(3, generator=g), torch.randn(2, 2, generator=g)] for _ in range(3)]
    if change == "shape":
        clients[1][1] = torch.randn(4)
    elif change == "dtype":
        clients[2][0] = clients[2][0].double()
    elif change == "length":
        clients[1] = clients[1][:1]
    elif change == "not_a_tensor":
        clients[2][1] = 3.0
    else:  # valid: a tuple is a sequence of tensors too
        clients[1] = tuple(clients[1])
    valid = [[torch.randn(3), torch.randn(2, 2)] for _ in range(3)]
    warm, cold = warm_then_cold(lambda: fedkernels.aggregate(valid, [1, 1, 1]),
                                lambda: fedkernels.aggregate(clients, [1, 2, 3]))
    assert same_outcome(warm, cold), f"warm: {warm}\ncold: {cold}"
    assert (warm[0] == "ok") == (change == "tuple")


def test_flat_rows_after_a_warm_call():
    rows = torch.randn(3, 8)
    warm, cold = warm_then_cold(lambda: fedkernels.aggregate(rows, [1, 1, 1]),
                                lambda: fedkernels.aggregate(rows.double(), [1, 1, 1],
                                                             out=torch.zeros(8)))
    assert same_outcome(warm, cold) and warm[0] is TypeError


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize("normalize", [False, True])
def test_plain_weight_lists_equal_the_tensor_path(normalize):
    """Lists of Python numbers skip tensor-side checks; the weights the op gets are the same."""
    for weights in ([0.1, 0.2, 0.3], [1, 2, 3], (3, 1.5, 2), [1e300, 1e308, 1e308]):
        fast, values = weights_and_values(weights, 3, normalize)
        slow = weight_vector(torch.tensor(weights, dtype=torch.float64), 3, normalize)
        assert fast.dtype == torch.float64 and bitwise_equal(fast, slow)
        assert values == slow.tolist()
