"""pytest-benchmark entries for the aggregation op (ResNet-18 shapes, K=10):

    python -m pytest bench/test_bench_aggregate.py --benchmark-only

The tables with bandwidth and memory come from bench/bench_aggregate.py.
"""

import pytest
import torch
from bench_aggregate import make_clients, methods

from harness.model_shapes import resnet18_shapes

NUM_CLIENTS = 10


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def setup(request):
    dtype = getattr(torch, request.param)
    clients = make_clients(resnet18_shapes(), NUM_CLIENTS, dtype, torch.device("cpu"))
    weights = torch.rand(NUM_CLIENTS, dtype=torch.float64)
    fns, _ = methods(clients, weights, torch.device("cpu"))
    return fns


@pytest.mark.parametrize("method", ["fused", "fused out=", "foreach", "loop", "flat mv"])
def test_aggregate_resnet18(benchmark, setup, method):
    benchmark.pedantic(setup[method], rounds=5, warmup_rounds=1)
