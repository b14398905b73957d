"""weighted_sum under CUDA graph capture: captured directly with ``torch.cuda.graph`` and through
``torch.compile(mode="reduce-overhead")`` (CUDA graph trees). A captured graph replays the op's
launch metadata from a copy it owns, so replays after the call (with new values in the same
input tensors) compute the new weighted sums. The host-side layout of that metadata is checked
on the CPU by test_multi_tensor_layout.py. Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close

from fedkernels.ops import reference as R
from fedkernels.ops import summation

pytestmark = pytest.mark.cuda


def _clients(K, shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).cuda()
            for _ in range(K) for s in shapes]


def _by_client(flat, K):
    T = len(flat) // K
    return [flat[k * T:(k + 1) * T] for k in range(K)]


# Enough clients and tensors that the metadata (K * T pointers and more) spans several of the
# capture-time upload's blocks; odd sizes for the element-by-element path.
SHAPES = [(64, 33), (7,), (), (129,), (3, 5, 8)] * 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights_on", ["cuda", "cpu"])
def test_captured_graph_replays_with_new_inputs(dtype, weights_on):
    K, T = 16, len(SHAPES)
    updates = _clients(K, SHAPES, dtype, seed=0)
    base = [torch.randn(s, dtype=dtype, device="cuda") for s in SHAPES]
    weights = torch.linspace(0.1, 1.0, K, dtype=torch.float64, device=weights_on)

    def step():
        return summation.weighted_sum(updates, weights, base, 0.5, True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for seed in (1, 2):
        for x, new in zip(updates, _clients(K, SHAPES, dtype, seed=seed)):
            x.copy_(new)
        if weights_on == "cuda":  # device weights are read at replay; CPU ones were captured
            weights.copy_(torch.rand(K, dtype=torch.float64, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        expected = R.weighted_sum_reference(_by_client(updates, K), weights, base, 0.5, True)
        assert_close(out, expected, dtype, K)
    assert len(out) == T


def test_weighted_sum_under_torch_compile_reduce_overhead():
    K, shapes = 8, [(32, 16), (16,), (5,)]

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def aggregate(updates, weights):
        return summation.weighted_sum(updates, weights)

    for seed in range(4):
        updates = _clients(K, shapes, torch.float32, seed)
        weights = torch.rand(K, dtype=torch.float64, device="cuda")
        got = [t.clone() for t in aggregate(updates, weights)]
        expected = R.weighted_sum_reference(_by_client(updates, K), weights)
        assert_close(got, expected, torch.float32, K)
