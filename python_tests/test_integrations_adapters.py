"""fedkernels.integrations.adapters: nn.Module, state_dict, NumPy (Flower NDArrays) and flat vectors
(FedLab-style), with the zero-copy claims checked by data_ptr / np.shares_memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fedkernels
from fedkernels.integrations.adapters import (
    FlatLayout,
    aggregate_into_module,
    deserialize_model,
    module_state,
    ndarrays_to_state_dict,
    ndarrays_to_tensors,
    serialize_model,
    state_dict_to_ndarrays,
    tensors_to_ndarrays,
)


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 5))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].num_batches_tracked.fill_(seed)
    return model


# ---------------------------------------------------------------- nn.Module


def test_module_state_shares_the_modules_memory():
    model = net(0)
    state = module_state(model)
    assert state["0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert state["1.running_mean"].data_ptr() == model[1].running_mean.data_ptr()
    assert not state["0.weight"].requires_grad
    assert set(module_state(model, buffers=False)) == {n for n, _ in model.named_parameters()}


def test_aggregate_into_module_writes_in_place():
    clients = [net(s) for s in (1, 2, 3)]
    weights = [1.0, 2.0, 5.0]
    target = net(0)
    ptr = target[3].weight.data_ptr()
    expected = fedkernels.aggregate([c.state_dict() for c in clients], weights, normalize=True)
    aggregate_into_module(target, clients, weights)
    assert target[3].weight.data_ptr() == ptr  # same storage: optimizers keep working
    for n, t in target.state_dict().items():
        torch.testing.assert_close(t, expected[n])
    assert int(target[1].num_batches_tracked) == 3  # int_policy="max"

    # delta mode: x <- x + eta * sum_k p_k (x_k - x)
    before = {n: t.clone() for n, t in net(0).state_dict().items()}
    target = net(0)
    aggregate_into_module(target, [c.state_dict() for c in clients], weights, delta=True,
                          scale=0.5)
    p = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    for n, x in before.items():
        if x.is_floating_point():
            step = sum(float(w) * (c.state_dict()[n] - x) for w, c in zip(p, clients))
            torch.testing.assert_close(target.state_dict()[n], x + 0.5 * step)


# ---------------------------------------------------------------- NumPy


def test_ndarrays_are_viewed_not_copied():
    arrays = [np.random.rand(3, 4).astype(np.float32), np.arange(6, dtype=np.int64),
              np.random.rand(5)[::2]]  # a strided view stays a view
    tensors = ndarrays_to_tensors(arrays)
    for a, t in zip(arrays, tensors):
        assert np.shares_memory(t.numpy(), a)
        assert np.array_equal(t.numpy(), a)
    copied = ndarrays_to_tensors(arrays, copy=True)
    assert not any(np.shares_memory(t.numpy(), a) for a, t in zip(arrays, copied))
    # read-only (deserialized) arrays are viewed too; big-endian / reversed ones are copied
    frozen = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), dtype=np.float32)
    assert np.shares_memory(ndarrays_to_tensors([frozen])[0].numpy(), frozen)
    odd = [np.arange(4, dtype=">f4"), np.arange(5.0)[::-1]]
    for a, t in zip(odd, ndarrays_to_tensors(odd)):
        assert np.array_equal(t.numpy(), a)


def test_tensors_to_ndarrays_and_state_dict_round_trip():
    state = net(1).state_dict()
    arrays = state_dict_to_ndarrays(state)
    assert all(np.shares_memory(a, t.numpy()) for a, t in zip(arrays, state.values()))
    back = ndarrays_to_state_dict(arrays, state)
    assert list(back) == list(state)
    assert all(back[n].data_ptr() == state[n].data_ptr() for n in state)
    with pytest.raises(ValueError, match="shape"):
        ndarrays_to_state_dict(arrays[::-1], state)
    bf = tensors_to_ndarrays([torch.ones(2, dtype=torch.bfloat16)])[0]
    assert bf.dtype == np.float32


def test_numpy_clients_aggregate_like_flower_fedavg():
    rng = np.random.default_rng(0)
    clients = [[rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(2)]
               for _ in range(4)]
    n = [10, 40, 20, 30]
    out = fedkernels.aggregate([ndarrays_to_tensors(c) for c in clients], n, normalize=True)
    for i, t in enumerate(out):
        expected = sum(w * c[i] for w, c in zip(np.array(n) / sum(n), clients))
        np.testing.assert_allclose(t.numpy(), expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- flat vectors


def test_flat_layout_flatten_unflatten():
    state = net(2).state_dict()
    floats = {n: t for n, t in state.items() if t.is_floating_point()}
    layout = FlatLayout.of(floats)
    vec = layout.flatten(floats)
    assert vec.shape == (sum(t.numel() for t in floats.values()),)
    views = layout.unflatten(vec)
    assert all(v.data_ptr() >= vec.data_ptr() for v in views.values())
    assert all(torch.equal(views[n], floats[n]) for n in floats)
    # K flat vectors as [K, P] through the fused op, back to a state_dict of views
    vecs = torch.stack([layout.flatten({n: t + k for n, t in floats.items()}) for k in range(3)])
    avg = layout.unflatten(fedkernels.aggregate(vecs, [1, 1, 2], normalize=True))
    for n, t in floats.items():
        torch.testing.assert_close(avg[n], t + 1.25)
    with pytest.raises(ValueError, match="1-D vector"):
        layout.unflatten(vec[:-1])


def test_bind_makes_serialization_free():
    model = net(3)
    optimizer_params = list(model.parameters())
    layout = FlatLayout.of(model)
    flat = layout.bind(model)
    assert all(p is q for p, q in zip(model.parameters(), optimizer_params))
    vec = serialize_model(model)
    assert vec.data_ptr() == flat.data_ptr() and vec.numel() == layout.numel
    out = model(torch.randn(2, 3, 4, 4))  # the module still works on the views
    out.sum().backward()
    # writing an aggregate into the flat vector updates the module
    fedkernels.aggregate(torch.stack([flat.detach() * 2, flat.detach() * 4]), [0.5, 0.5],
                         out=flat.detach())
    assert torch.equal(serialize_model(model), flat)


def test_fedlab_style_serialize_deserialize():
    a, b = net(4), net(5)
    vec = serialize_model(a)
    assert vec.numel() == sum(p.numel() for p in a.parameters())
    deserialize_model(b, vec)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    deserialize_model(b, vec, mode="add")
    assert all(torch.allclose(q, 2 * p) for p, q in zip(a.parameters(), b.parameters()))
    deserialize_model(b, vec, mode="sub")
    assert all(torch.allclose(q, p) for p, q in zip(a.parameters(), b.parameters()))
    with_buffers = serialize_model(a, buffers=True)
    assert with_buffers.numel() == FlatLayout.of(a, buffers=True).numel


def test_bind_refuses_tied_weights_and_missing_names():
    # A layout with buffers comes from the state_dict, which lists a tied parameter under both
    # names: bind raised KeyError (named_parameters() lists it once).
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    with pytest.raises(ValueError, match="'emb.weight' and 'head.weight' are one tensor"):
        FlatLayout.of(model, buffers=True).bind(model)
    flat = FlatLayout.of(model).bind(model)  # the parameters: the tied one once
    assert flat.numel() == 15 and model.head.weight.data_ptr() == flat.data_ptr()
    with pytest.raises(ValueError, match="no parameter or buffer 'emb.weight'"):
        FlatLayout.of(model).bind(nn.Linear(3, 5))


def test_module_without_parameters():
    # serialize raised "Tensor list must have at least one tensor", deserialize IndexError
    relu = nn.ReLU()
    assert serialize_model(relu).shape == (0,)
    assert deserialize_model(relu, torch.empty(0)) is relu
    with pytest.raises(ValueError, match="expected a 1-D vector of 0 values"):
        deserialize_model(relu, torch.ones(3))
    with pytest.raises(ValueError, match="mode must be"):
        deserialize_model(relu, torch.empty(0), mode="mul")
