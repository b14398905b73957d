"""fedkernels.aggregate against the pure-PyTorch reference: every mode, dtype and structure,
odd-sized / empty / 0-d / non-contiguous tensors, K = 1 and K = 1000, out= and in place,
int_policy, normalize, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    DEVICES,
    FLOAT_DTYPES,
    HALF_DTYPES,
    ODD_SHAPES,
    SmallNet,
    assert_close,
    bitwise_equal,
    clone,
    dtype_id,
    make_clients_list,
    make_state_dicts,
    make_weights,
    randn,
    to_device,
    trained_state_dicts,
)

import fedkernels
from fedkernels.ops.reference import aggregate_reference, weighted_sum_reference

STRUCTURES = ["state_dict", "tensor_list", "single_tensor", "flat"]
# mode -> (use a base, scale, normalize)
MODES = {
    "plain": (False, 1.0, False),
    "plain_scaled": (False, 0.5, False),
    "normalize": (False, 1.0, True),
    "delta": (True, 1.0, False),
    "delta_scaled": (True, 1.7, False),
    "delta_normalize_scaled": (True, 0.8, True),
}


def make_inputs(structure, num_clients, dtype, seed=0, base_dtype=None):
    """(updates, base) on the CPU for one structure."""
    g = torch.Generator().manual_seed(seed + 7)
    base_dtype = base_dtype or dtype
    if structure == "state_dict":
        clients = make_state_dicts(num_clients, dtype, seed)
        base = {k: randn(v.shape, base_dtype, g) for k, v in clients[0].items()}
    elif structure == "tensor_list":
        clients = make_clients_list(num_clients, [(3, 4), (7,), (), (0,), (33,)], dtype, seed)
        base = [randn(t.shape, base_dtype, g) for t in clients[0]]
    elif structure == "single_tensor":
        clients = [c[0] for c in make_clients_list(num_clients, [(6, 5)], dtype, seed)]
        base = randn((6, 5), base_dtype, g)
    else:
        clients = randn((num_clients, 37), dtype, g)
        base = randn((37,), base_dtype, g)
    return clients, base


def result_kind_ok(result, structure, like):
    if structure == "state_dict":
        return isinstance(result, dict) and list(result) == list(like[0])
    if structure == "tensor_list":
        return isinstance(result, list) and len(result) == len(like[0])
    if structure == "single_tensor":
        return isinstance(result, torch.Tensor) and result.shape == like[0].shape
    return isinstance(result, torch.Tensor) and result.shape == like.shape[1:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("structure", STRUCTURES)
def test_matches_reference(structure, mode, dtype, device):
    use_base, scale, normalize = MODES[mode]
    clients, base = make_inputs(structure, 5, dtype, seed=3)
    weights = make_weights(5, seed=3)
    base = base if use_base else None
    expected = aggregate_reference(clients, weights, base=base, scale=scale, normalize=normalize)

    dev_clients = to_device(clients, device)
    dev_base = to_device(base, device) if use_base else None
    before = clone(dev_clients), clone(dev_base) if use_base else None
    result = fedkernels.aggregate(dev_clients, weights, base=dev_base, scale=scale,
                                  normalize=normalize)
    assert result_kind_ok(result, structure, clients)
    assert_close(result, expected, dtype, num_clients=5)
    for t in result.values() if isinstance(result, dict) else (
            result if isinstance(result, list) else [result]):
        assert t.device.type == device
    # The inputs are read, never written.
    assert bitwise_equal(dev_clients, before[0])
    if use_base:
        assert bitwise_equal(dev_base, before[1])
    if device == "cuda":  # the CUDA op agrees with the CPU op too
        on_cpu = fedkernels.aggregate(clients, weights, base=base, scale=scale,
                                      normalize=normalize)
        assert_close(result, on_cpu, dtype, num_clients=5)


def test_independent_formula_float64():
    """The delta and plain formulas written out directly (not via the reference)."""
    clients, base = make_inputs("tensor_list", 4, torch.float64, seed=11)
    w = torch.tensor([0.3, -1.2, 2.0, 0.25], dtype=torch.float64)
    for use_base in (False, True):
        got = fedkernels.aggregate(clients, w, base=base if use_base else None, scale=0.6)
        for t in range(len(base)):
            s = sum(w[k] * clients[k][t] for k in range(4))
            want = base[t] + 0.6 * (s - w.sum() * base[t]) if use_base else 0.6 * s
            torch.testing.assert_close(got[t], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_half_updates_into_fp32_base(structure, half, device):
    clients, base = make_inputs(structure, 4, half, seed=5, base_dtype=torch.float32)
    weights = make_weights(4, seed=5)
    expected = aggregate_reference(clients, weights, base=base, scale=0.9, normalize=True)
    result = fedkernels.aggregate(to_device(clients, device), weights,
                                  base=to_device(base, device), scale=0.9, normalize=True)
    # The result is stored in the fp32 base dtype, accumulated in fp32.
    assert_close(result, expected, torch.float32, num_clients=4)

    # ... and in place into the fp32 base.
    in_place = to_device(clone(base), device)
    returned = fedkernels.aggregate(to_device(clients, device), weights, base=in_place,
                                    scale=0.9, normalize=True, out=in_place)
    assert returned is in_place
    assert_close(in_place, expected, torch.float32, num_clients=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", ["plain_scaled", "normalize", "delta_scaled"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_out(structure, mode, dtype, device):
    use_base, scale, normalize = MODES[mode]
    clients, base = make_inputs(structure, 3, dtype, seed=8)
    weights = make_weights(3, seed=8)
    base = base if use_base else None
    expected = aggregate_reference(clients, weights, base=base, scale=scale, normalize=normalize)
    out = to_device(clone(expected), device)
    for t in (out.values() if isinstance(out, dict) else out if isinstance(out, list) else [out]):
        t.fill_(123.0)
    kept = dict(out) if isinstance(out, dict) else list(out) if isinstance(out, list) else out
    returned = fedkernels.aggregate(to_device(clients, device), weights,
                                    base=to_device(base, device) if use_base else None,
                                    scale=scale, normalize=normalize, out=out)
    assert returned is out
    # The very same tensors were written (no reallocation).
    if isinstance(out, dict):
        assert all(out[k] is kept[k] for k in out)
    elif isinstance(out, list):
        assert all(a is b for a, b in zip(out, kept))
    assert_close(out, expected, dtype, num_clients=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_out_is_base_in_place(structure, dtype, device):
    clients, base = make_inputs(structure, 4, dtype, seed=9)
    weights = make_weights(4, seed=9)
    expected = aggregate_reference(clients, weights, base=base, scale=1.3)
    global_model = to_device(clone(base), device)
    returned = fedkernels.aggregate(to_device(clients, device), weights, base=global_model,
                                    scale=1.3, out=global_model)
    assert returned is global_model
    assert_close(global_model, expected, dtype, num_clients=4)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_into_non_contiguous_base(device):
    g = torch.Generator().manual_seed(0)
    storage = randn((12, 10), torch.float32, g, device)
    base = [storage[1:7, ::2].t()]  # a strided, transposed view into a bigger buffer
    clients = [[randn(base[0].shape, torch.float32, g, device)] for _ in range(3)]
    weights = [0.2, 0.5, 0.3]
    expected = aggregate_reference(to_device(clients, "cpu"), weights,
                                   base=to_device(base, "cpu"), scale=2.0)
    untouched = storage.clone()
    mask = torch.ones_like(storage, dtype=torch.bool)
    mask[1:7, ::2] = False
    fedkernels.aggregate(clients, weights, base=base, scale=2.0, out=base)
    assert_close(base, expected, torch.float32, num_clients=3)
    assert torch.equal(storage[mask], untouched[mask])  # nothing outside the view was written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", ["plain_scaled", "delta_scaled"])
def test_odd_sized_empty_and_0d(mode, dtype, device):
    use_base, scale, _ = MODES[mode]
    shapes = ODD_SHAPES + [(65537,), (2, 65536 + 5)]  # across the kernel's chunk boundary
    clients = make_clients_list(3, shapes, dtype, seed=2)
    base = make_clients_list(1, shapes, dtype, seed=99)[0] if use_base else None
    weights = [0.7, -0.4, 1.1]
    expected = aggregate_reference(clients, weights, base=base, scale=scale)
    result = fedkernels.aggregate(to_device(clients, device), weights,
                                  base=to_device(base, device) if use_base else None, scale=scale)
    assert [tuple(r.shape) for r in result] == [tuple(s) for s in shapes]
    assert_close(result, expected, dtype, num_clients=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [1, 31, 65537])
def test_single_tensor_sizes(size, device):
    clients = [c[0] for c in make_clients_list(2, [(size,)], torch.float32, seed=size)]
    expected = aggregate_reference(clients, [0.25, 0.75])
    result = fedkernels.aggregate(to_device(clients, device), [0.25, 0.75])
    assert_close(result, expected, torch.float32)


def _strided_views(dtype, g, device):
    return [
        randn((7, 5), dtype, g, device).t(),                  # transposed
        randn((10, 9), dtype, g, device)[1:8:2, ::3],         # sliced in both dims
        randn((1, 6), dtype, g, device).expand(4, 6),         # stride 0 (read-only is fine)
        randn((40,), dtype, g, device)[3::4],                 # offset + step
        randn((2, 3, 4), dtype, g, device).permute(2, 0, 1),  # permuted
        randn((3, 1), dtype, g, device).squeeze(1)[None],     # odd strides of a size-1 dim
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("use_base", [False, True], ids=["plain", "delta"])
def test_non_contiguous_inputs(use_base, dtype, device):
    g = torch.Generator().manual_seed(1)
    clients = [_strided_views(dtype, g, device) for _ in range(4)]
    base = _strided_views(dtype, g, device) if use_base else None
    assert not all(t.is_contiguous() for t in clients[0])
    weights = [0.1, 0.2, 0.3, 0.4]
    expected = aggregate_reference(to_device(clients, "cpu"), weights,
                                   base=to_device(base, "cpu") if use_base else None, scale=1.5)
    result = fedkernels.aggregate(clients, weights, base=base, scale=1.5)
    assert_close(result, expected, dtype, num_clients=4)
    contiguous = fedkernels.aggregate([[t.contiguous() for t in c] for c in clients], weights,
                                      base=[t.contiguous() for t in base] if use_base else None,
                                      scale=1.5)
    assert bitwise_equal(result, contiguous)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_out(device):
    clients = make_clients_list(3, [(5, 4), (9,)], torch.float32, seed=4, device=device)
    buf_a = torch.full((8, 10), -5.0, device=device)
    buf_b = torch.full((30,), -5.0, device=device)
    out = [buf_a[1:5, 2:7].t(), buf_b[::3][:9]]  # [5, 4] transposed slice; strided [9]
    assert not out[0].is_contiguous() and not out[1].is_contiguous()
    weights = [1.0, 2.0, -0.5]
    expected = aggregate_reference(to_device(clients, "cpu"), weights)
    fedkernels.aggregate(clients, weights, out=out)
    assert_close(out, expected, torch.float32, num_clients=3)
    # Only the viewed elements were written.
    written_a = torch.zeros_like(buf_a, dtype=torch.bool)
    written_a[1:5, 2:7] = True
    written_b = torch.zeros_like(buf_b, dtype=torch.bool)
    written_b[0:27:3] = True
    assert (buf_a[~written_a] == -5.0).all() and (buf_b[~written_b] == -5.0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_flat_non_contiguous(layout, device):
    g = torch.Generator().manual_seed(6)
    if layout == "transposed":
        updates = randn((129, 6), torch.float32, g, device).t()  # rows are strided
    else:
        updates = randn((6, 258), torch.float32, g, device)[:, ::2]
    base = randn((129,), torch.float32, g, device)
    weights = make_weights(6)
    for b in (None, base):
        expected = aggregate_reference(updates.cpu(), weights, base=None if b is None else b.cpu())
        result = fedkernels.aggregate(updates, weights, base=b)
        assert result.shape == (129,)
        assert_close(result, expected, torch.float32, num_clients=6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("num_clients", [1, 1000])
def test_number_of_clients(num_clients, dtype, device):
    shapes = [(1,), (17,), (3, 5), (257,)]
    clients = make_clients_list(num_clients, shapes, dtype, seed=num_clients)
    base = make_clients_list(1, shapes, dtype, seed=1)[0]
    weights = make_weights(num_clients)
    for b, normalize in ((None, True), (base, False), (base, True)):
        expected = aggregate_reference(clients, weights, base=b, normalize=normalize, scale=0.9)
        result = fedkernels.aggregate(to_device(clients, device), weights,
                                      base=to_device(b, device) if b is not None else None,
                                      normalize=normalize, scale=0.9)
        assert_close(result, expected, dtype, num_clients=num_clients)
    flat = torch.stack([torch.cat([t.flatten() for t in c]) for c in clients]).to(device)
    assert_close(fedkernels.aggregate(flat, weights), aggregate_reference(flat.cpu(), weights),
                 dtype, num_clients=num_clients)


def test_one_client_is_scaled_copy():
    x = make_clients_list(1, [(5, 3), ()], torch.float32, seed=3)
    result = fedkernels.aggregate(x, [1.0])
    assert bitwise_equal(result, x[0])
    assert all(r.data_ptr() != t.data_ptr() for r, t in zip(result, x[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors(device):
    shapes = [((i * 37) % 53,) for i in range(300)]  # includes empty tensors
    clients = make_clients_list(4, shapes, torch.float32, seed=12, device=device)
    weights = make_weights(4)
    expected = aggregate_reference(to_device(clients, "cpu"), weights)
    assert_close(fedkernels.aggregate(clients, weights), expected, num_clients=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_bitwise_deterministic(dtype, device):
    """Same inputs -> bitwise the same output, run after run and whatever the thread count
    (the reduction order per element is the client order, independent of the chunking)."""
    shapes = [(200_003,), (65_537,), (31,), ()]
    clients = make_clients_list(7, shapes, dtype, seed=13, device=device)
    base = make_clients_list(1, shapes, dtype, seed=14, device=device)[0]
    weights = make_weights(7)
    first = fedkernels.aggregate(clients, weights, base=base, scale=0.7)
    for _ in range(2):
        assert bitwise_equal(fedkernels.aggregate(clients, weights, base=base, scale=0.7), first)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = fedkernels.aggregate(clients, weights, base=base, scale=0.7)
    finally:
        torch.set_num_threads(threads)
    assert bitwise_equal(single, first)


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize(
    "weights",
    [
        [0.5, 0.25, 2.0],
        (0.5, 0.25, 2.0),
        np.array([0.5, 0.25, 2.0], dtype=np.float32),
        np.array([0.5, 0.25, 2.0]),
        torch.tensor([0.5, 0.25, 2.0]),
        torch.tensor([0.5, 0.25, 2.0], dtype=torch.float64, requires_grad=True),
        torch.tensor([0.5, 0.25, 2.0, 9.0])[:3],
        torch.tensor([0.5, 9.0, 0.25, 9.0, 2.0])[::2],  # non-contiguous
    ],
    ids=["list", "tuple", "np32", "np64", "tensor32", "tensor64_grad", "slice", "strided"],
)
def test_weight_containers(weights):
    clients = make_clients_list(3, [(4, 4), (9,)], torch.float32, seed=21)
    expected = fedkernels.aggregate(clients, [0.5, 0.25, 2.0])
    assert bitwise_equal(fedkernels.aggregate(clients, weights), expected)
    assert_close(expected, aggregate_reference(clients, [0.5, 0.25, 2.0]), num_clients=3)


def test_integer_weights():
    clients = make_clients_list(3, [(6,)], torch.float64, seed=22)
    for w in ([30, 50, 20], np.array([30, 50, 20]), torch.tensor([30, 50, 20])):
        result = fedkernels.aggregate(clients, w, normalize=True)
        assert_close(result, aggregate_reference(clients, [0.3, 0.5, 0.2]), torch.float64)


def test_normalize_divides_by_sum():
    clients = make_clients_list(4, [(5,), (2, 2)], torch.float64, seed=23)
    w = [1.0, 3.0, -0.5, 2.5]
    normalized = fedkernels.aggregate(clients, w, normalize=True)
    by_hand = fedkernels.aggregate(clients, [x / 6.0 for x in w])
    assert_close(normalized, by_hand, torch.float64)
    # Invariant to a common factor of the weights; not so without normalize.
    assert_close(fedkernels.aggregate(clients, [7 * x for x in w], normalize=True), normalized,
                 torch.float64)
    unnormalized = fedkernels.aggregate(clients, w)
    assert not torch.allclose(unnormalized[0], normalized[0])
    assert_close(unnormalized, [6.0 * t for t in normalized], torch.float64)


# ---------------------------------------------------------------- real models, int_policy


def test_module_state_dict_with_batchnorm_default_args():
    states = trained_state_dicts(3)
    assert any(not t.is_floating_point() for t in states[0].values())
    weights = [10, 30, 60]
    result = fedkernels.aggregate(states, weights, normalize=True)
    expected = aggregate_reference(states, weights, normalize=True)
    assert_close(result, expected, num_clients=3)
    # The default int_policy is "max": a counter takes the largest value.
    for key in ("bn.num_batches_tracked", "bn1d.num_batches_tracked"):
        assert result[key].dtype == torch.int64
        assert result[key].item() == max(s[key].item() for s in states) == 3
    net = SmallNet()
    net.load_state_dict(result, strict=True)
    net.eval()
    assert torch.isfinite(net(torch.randn(2, 1, 6, 6))).all()


def test_state_dict_result_keeps_the_module_versions():
    """A Module.state_dict() carries `_metadata` (each module's version, which
    load_state_dict hands to _load_from_state_dict: BatchNorm reads it). The result of
    aggregate and of Accumulator keeps the first client's, as a copy; plain dicts stay dicts."""
    states = []
    for sd in trained_state_dicts(3):
        net = SmallNet()
        net.load_state_dict(sd)
        states.append(net.state_dict())
    want = states[0]._metadata
    assert want["bn"]["version"] >= 2
    acc = fedkernels.Accumulator()
    for sd in states:
        acc.add(sd, 1.0)
    results = (fedkernels.aggregate(states, [1, 2, 3]), acc.result(normalize=True),
               fedkernels.robust.coordinate_median(states), fedkernels.robust.krum(states, 0)[0])
    for result in results:
        assert result._metadata == want and result._metadata is not want
        assert list(result) == list(states[0])
        SmallNet().load_state_dict(result, strict=True)
    assert type(fedkernels.aggregate([dict(s) for s in states], [1, 2, 3])) is dict
    assert not hasattr(fedkernels.aggregate([list(s.values()) for s in states], [1, 1, 1]),
                       "_metadata")


def test_module_state_dict_delta_into_global_model_in_place():
    states = trained_state_dicts(3, seed=1)
    global_model = {k: v.clone() for k, v in SmallNet().state_dict().items()}
    expected = aggregate_reference(states, [1, 1, 1], base=global_model, scale=0.5,
                                   normalize=True)
    fedkernels.aggregate(states, [1, 1, 1], base=global_model, scale=0.5, normalize=True,
                         out=global_model)
    assert_close(global_model, expected, num_clients=3)
    assert global_model["bn.num_batches_tracked"].item() == 3


@pytest.mark.parametrize("policy", ["max", "first", "skip"])
@pytest.mark.parametrize("use_base", [False, True], ids=["plain", "delta"])
def test_int_policy(policy, use_base):
    states = trained_state_dicts(3, seed=2)
    states[0]["bn.num_batches_tracked"].fill_(2)
    states[1]["bn.num_batches_tracked"].fill_(7)
    states[2]["bn.num_batches_tracked"].fill_(5)
    base = {k: v.clone() for k, v in states[0].items()} if use_base else None
    if use_base:
        base["bn.num_batches_tracked"].fill_(100)
    result = fedkernels.aggregate(states, [0.2, 0.3, 0.5], base=base, int_policy=policy)
    expected = aggregate_reference(states, [0.2, 0.3, 0.5], base=base, int_policy=policy)
    assert_close(result, expected, num_clients=3)
    want = {"max": 7, "first": 2, "skip": 100 if use_base else 2}[policy]
    assert result["bn.num_batches_tracked"].item() == want
    # A fresh tensor, never an alias of a client's or base's.
    ptrs = {s["bn.num_batches_tracked"].data_ptr() for s in states}
    if use_base:
        ptrs.add(base["bn.num_batches_tracked"].data_ptr())
    assert result["bn.num_batches_tracked"].data_ptr() not in ptrs


def test_int_policy_elementwise_max_and_bool():
    clients = [
        {"w": torch.randn(3), "count": torch.tensor([1, 9, 3]),
         "mask": torch.tensor([True, False, False])},
        {"w": torch.randn(3), "count": torch.tensor([4, 2, 3]),
         "mask": torch.tensor([False, False, True])},
    ]
    result = fedkernels.aggregate(clients, [0.5, 0.5])
    assert torch.equal(result["count"], torch.tensor([4, 9, 3]))
    assert torch.equal(result["mask"], torch.tensor([True, False, True]))
    first = fedkernels.aggregate(clients, [0.5, 0.5], int_policy="first")
    assert torch.equal(first["count"], clients[0]["count"])
    assert torch.equal(first["mask"], clients[0]["mask"])


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_int_policy_max_of_wide_unsigned_entries(dtype):
    # torch has no maximum for these dtypes on the CPU ("maximum_cpu" not implemented for
    # 'UInt32'), which NumPy arrays of them become; the max is taken in a wider or flipped form.
    high = (torch.tensor([-1]).view(torch.uint64) if dtype == torch.uint64  # 2**64 - 1
            else torch.tensor([2 ** (8 * dtype.itemsize) - 1]).to(dtype))
    clients = [{"w": torch.ones(2), "n": torch.cat([torch.tensor([1, 9], dtype=dtype), high])},
               {"w": torch.ones(2), "n": torch.tensor([4, 2, 3], dtype=dtype)}]
    expected = torch.cat([torch.tensor([4, 9], dtype=dtype), high])
    assert torch.equal(fedkernels.aggregate(clients, [0.5, 0.5])["n"], expected)
    acc = fedkernels.Accumulator()
    for c in clients:
        acc.add(c, 1.0)
    assert torch.equal(acc.result()["n"], expected)
    assert torch.equal(fedkernels.coordinate_median(clients)["n"], expected)


def test_int_entries_written_into_out():
    states = trained_state_dicts(2, seed=3)
    out = {k: torch.full_like(v, 77) for k, v in states[0].items()}
    fedkernels.aggregate(states, [0.5, 0.5], out=out)
    expected = aggregate_reference(states, [0.5, 0.5])
    assert_close(out, expected, num_clients=2)


def test_only_integer_tensors():
    clients = [{"n": torch.tensor(3)}, {"n": torch.tensor(8)}]
    assert fedkernels.aggregate(clients, [1.0, 1.0])["n"].item() == 8


def test_result_keys_keep_client_order():
    clients = make_state_dicts(2, torch.float32)
    reordered = [{k: c[k] for k in reversed(list(c))} for c in clients]
    result = fedkernels.aggregate([clients[0], reordered[1]], [1.0, 1.0])
    assert list(result) == list(clients[0])
    for k in result:
        torch.testing.assert_close(result[k], clients[0][k] + clients[1][k])


def test_weighted_sum_reference_modes():
    """The reference itself, against formulas written out (so the other tests stand on it)."""
    x = make_clients_list(3, [(4,)], torch.float64, seed=30)
    b = [torch.randn(4, dtype=torch.float64)]
    w = [0.5, -1.0, 2.0]
    s = sum(wk * xk[0] for wk, xk in zip(w, x))
    torch.testing.assert_close(weighted_sum_reference(x, w, scale=3.0)[0], 3.0 * s)
    torch.testing.assert_close(weighted_sum_reference(x, w, b, 3.0, delta=False)[0], b[0] + 3.0 * s)
    torch.testing.assert_close(weighted_sum_reference(x, w, b, 3.0, delta=True)[0],
                               b[0] + 3.0 * (s - sum(w) * b[0]))
