"""Batched personalized evaluation (PersonalizedStrategy.personalized_logits through
fedkernels.sim.vmap.stacked_eval): the same logits as one client at a time, up to float
rounding, for every personalized strategy, MLP and CNN, float32 and float64, clients with 0,
1 and many test rows, chunks split by count and by rows, and the fallbacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedkernels.algorithms import build_strategy
from fedkernels.sim import Simulation
from fedkernels.sim.config import ClientConfig, ModelConfig
from fedkernels.sim.models import build_model
from fedkernels.sim.strategy import SetupInfo
from fedkernels.sim.vmap import eval_batchable, stacked_eval

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py

SIZES = [0, 1, 5, 0, 17, 2, 1, 9, 30, 3, 12, 1]
NAMES = ["local", "fedper", "lg-fedavg", "fedrep", "apfl", "ditto", "pfedme"]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def model_of(kind: str, dtype: torch.dtype, batch_norm: bool = False) -> nn.Module:
    if kind == "mlp":
        config = ModelConfig(name="mlp", hidden=[16, 8], batch_norm=batch_norm)
    else:
        config = ModelConfig(name="cnn", channels=[4, 8], batch_norm=batch_norm)
    return build_model(config, 64, 10, (1, 8, 8), seed=0).to(dtype)


def clients_of(sizes: list[int], dtype: torch.dtype, seed: int = 0) -> list[SimpleNamespace]:
    g = torch.Generator().manual_seed(seed)
    return [
        SimpleNamespace(test_x=torch.randn(n, 64, generator=g, dtype=dtype),
                        test_y=torch.randint(0, 10, (n,), generator=g))
        for n in sizes
    ]


def strategy_with_states(name: str, model: nn.Module, num_clients: int, seed: int = 1):
    """``name`` set up on ``model`` with a different personal part for every client but the
    last (which keeps the default)."""
    s = build_strategy(name, {})
    names = [n for n, _ in model.named_parameters()]
    s.setup(SetupInfo(
        num_clients=num_clients, train_sizes=torch.ones(num_clients, dtype=torch.float64),
        num_classes=10, participation_probabilities=None, parameter_names=names, model=model,
        client_config=ClientConfig(), seed=0,
    ))
    keys = list(s.initial) if name == "local" else getattr(s, "personal_keys", names)
    g = torch.Generator().manual_seed(seed)
    for k in range(num_clients - 1):
        s.personal[k] = {
            n: s.initial[n] + 0.1 * torch.randn(s.initial[n].shape, generator=g).to(s.initial[n].dtype)
            if s.initial[n].is_floating_point() else s.initial[n].clone()
            for n in keys
        }
        if name == "apfl":
            s.alpha[k] = float(torch.rand((), generator=g))
    return s


def both_paths(s, global_state, clients, batched_path=True):
    """Logits batched and one at a time; ``batched_path``: the first took no client through
    the loop."""
    looped = []
    loop = s._sequential_logits
    s._sequential_logits = lambda *a: looped.append(1) or loop(*a)
    batched = s.personalized_logits(global_state, clients)
    del s._sequential_logits
    assert (not looped) == batched_path
    s.batched_eval = False
    try:
        sequential = s.personalized_logits(global_state, clients)
    finally:
        del s.batched_eval
    return batched, sequential


def assert_same(batched, sequential, clients, dtype):
    assert len(batched) == len(sequential) == len(clients)
    for b, q, c in zip(batched, sequential, clients):
        if len(c.test_y) == 0:
            assert b is None and q is None
        else:
            assert b.shape == q.shape == (len(c.test_y), 10)
            torch.testing.assert_close(b, q, **TOL[dtype])


def global_of(model: nn.Module, seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (t + 0.05 * torch.randn(t.shape, generator=g).to(t.dtype)) if t.is_floating_point()
            else t.clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("name", NAMES)
def test_batched_equals_sequential(name, kind, dtype):
    model = model_of(kind, dtype)
    clients = clients_of(SIZES, dtype)
    s = strategy_with_states(name, model, len(clients))
    s.eval_chunk = 4  # several chunks, the last one short
    batched, sequential = both_paths(s, global_of(model), clients)
    assert_same(batched, sequential, clients, dtype)


def test_chunks_bounded_by_rows_and_all_empty():
    model = model_of("mlp", torch.float64)
    clients = clients_of(SIZES, torch.float64)
    s = strategy_with_states("ditto", model, len(clients))
    s.eval_chunk_rows = 20  # the 30-row client alone exceeds it: a chunk of one
    batched, sequential = both_paths(s, global_of(model), clients)
    assert_same(batched, sequential, clients, torch.float64)
    assert s.personalized_logits(global_of(model), clients_of([0, 0], torch.float64)) == [None, None]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_batch_norm_eval_uses_each_clients_running_statistics(kind):
    model = model_of(kind, torch.float32, batch_norm=True)
    assert eval_batchable(model)
    clients = clients_of(SIZES, torch.float32)
    s = strategy_with_states("local", model, len(clients))
    for k, state in s.personal.items():  # running statistics differ per client too
        for n, t in state.items():
            if n.endswith("running_var"):
                state[n] = t + 0.5 * (k + 1)
    batched, sequential = both_paths(s, global_of(model), clients)
    assert_same(batched, sequential, clients, torch.float32)


def test_stacked_eval_declines_mismatched_states():
    model = model_of("mlp", torch.float32)
    state = model.state_dict()
    x = [torch.randn(3, 64)]
    assert stacked_eval(model, [{**state, "extra": torch.zeros(1)}], x) is None
    assert stacked_eval(model, [{n: t.double() for n, t in state.items()}], x) is None
    missing = dict(state)
    missing.pop(next(iter(missing)))
    assert stacked_eval(model, [missing], x) is None
    (out,) = stacked_eval(model, [state], x)
    torch.testing.assert_close(out, model.eval()(x[0]))


def test_spectral_norm_stays_sequential():
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(64, 16)), nn.ReLU(),
                          nn.Linear(16, 10))
    assert not eval_batchable(model)
    clients = clients_of(SIZES, torch.float32)
    s = strategy_with_states("ditto", model, len(clients))
    batched, sequential = both_paths(s, global_of(model), clients, batched_path=False)
    for b, q in zip(batched, sequential):
        assert (b is None and q is None) or torch.equal(b, q)


class RowMixer(nn.Module):
    """A forward vmap has no batching rule for (a data-dependent nonzero)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x):
        z = self.linear(x)
        return z + torch.nonzero(z > 1e9).shape[0]


def test_vmap_failure_falls_back_to_the_loop():
    model = RowMixer()
    clients = clients_of(SIZES, torch.float32)
    s = strategy_with_states("ditto", model, len(clients))
    batched, sequential = both_paths(s, global_of(model), clients, batched_path=False)
    assert s._eval_batchable is False
    assert_same(batched, sequential, clients, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local", "ditto", "apfl", "fedavg-ft"])
def test_after_training_rounds(name):
    from test_personalized_runs import config, strategy

    sim = Simulation(config(rounds=2), strategy(name))
    sim.run()
    clients = sim.federation.clients
    batched, sequential = both_paths(sim.strategy, sim.server.state, clients)
    assert_same(batched, sequential, clients, torch.float32)


@pytest.mark.slow
def test_bench_tiny_run(tmp_path):
    bench = Path(__file__).resolve().parent.parent / "bench"
    out = tmp_path / "pe.json"
    proc = subprocess.run([sys.executable, "bench_personalized_eval.py", "--tiny", "--out", str(out)],
                          cwd=bench, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["personalized_eval"]["rows"]
    assert set(rows) == {"MLP 64-64-10", "CNN 16-32 (8x8)"}
    assert all(r["clients"] == 10 and r["max_abs_diff"] < 1e-4 for r in rows.values())
