"""The allocating CPU aggregate puts results of 2 MiB or more in huge-page mappings
(fedkernels.fresh_memory): same bits as the op's own allocation, ordinary tensors otherwise."""

from __future__ import annotations

import copy
import importlib
import io

import pytest
import torch
from safetensors.torch import load, save

import fedkernels
from fedkernels.fresh_memory import HUGE_PAGE_BYTES, empty_huge, huge_pages_available
from fedkernels.ops import summation

# the module, not the function that fedkernels.aggregate names
aggregate_module = importlib.import_module("fedkernels.aggregate")
BIG = (HUGE_PAGE_BYTES // 4 + 1000,)  # just over 2 MiB of float32


def clients(num: int = 3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [{"big": torch.randn(BIG, generator=gen).to(dtype),
             "small": torch.randn(7, 3, generator=gen).to(dtype),
             "steps": torch.tensor(k)} for k in range(num)]


def test_empty_huge_is_an_ordinary_writable_tensor():
    t = empty_huge((513, 1024), torch.float32)
    assert t.shape == (513, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == t.numel() * 4  # no padding to save or send
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
    assert torch.equal(copy.deepcopy(t), t)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), t)
    t.share_memory_()
    assert t.is_shared() and float(t.sum()) == 2.0 * t.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [False, True])
def test_allocating_aggregate_gives_the_ops_bits(dtype, delta):
    sds = clients(dtype=dtype)
    base = clients(1, dtype=dtype)[0] if delta else None
    w = [0.2, 0.3, 0.5]
    result = fedkernels.aggregate(sds, w, base=base, scale=0.9)
    floats = [t for sd in sds for n, t in sd.items() if n != "steps"]
    base_list = [base["big"], base["small"]] if delta else []
    expected = summation.weighted_sum(floats, torch.tensor(w, dtype=torch.float64), base_list,
                                      0.9, delta)
    assert torch.equal(result["big"], expected[0]) and torch.equal(result["small"], expected[1])
    assert result["big"].dtype == dtype
    # every result owns its memory: saved by safetensors (which refuses shared storages)
    assert torch.equal(load(save(result))["big"], result["big"])


def test_huge_pages_are_used_only_where_they_can_be(monkeypatch):
    calls = []
    real = aggregate_module.empty_huge

    def counting(shape, dtype):
        calls.append(tuple(shape))
        return real(shape, dtype)

    monkeypatch.setattr(aggregate_module, "empty_huge", counting)
    sds = clients()
    fedkernels.aggregate(sds, [1, 1, 1])
    assert calls == ([BIG] if huge_pages_available() else [])
    calls.clear()
    small = [{"small": sd["small"]} for sd in sds]
    fedkernels.aggregate(small, [1, 1, 1])  # nothing of 2 MiB: the op allocates
    assert calls == []


def test_a_result_that_needs_a_graph_is_still_differentiable():
    sds = clients(2)
    sds[0]["big"].requires_grad_(True)
    result = fedkernels.aggregate(sds, [0.25, 0.75])
    assert result["big"].grad_fn is not None
    result["big"].sum().backward()
    assert torch.allclose(sds[0]["big"].grad, torch.full(BIG, 0.25))


def test_the_same_bits_without_huge_pages(monkeypatch):
    sds = clients()
    with_huge = fedkernels.aggregate(sds, [0.1, 0.2, 0.7])
    monkeypatch.setattr(aggregate_module, "huge_pages_available", lambda: False)
    monkeypatch.setattr(aggregate_module, "empty_huge", None)  # would fail if called
    without = fedkernels.aggregate(sds, [0.1, 0.2, 0.7])
    assert all(torch.equal(with_huge[n], without[n]) for n in with_huge)
