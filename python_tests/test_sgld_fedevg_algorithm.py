"""FedEvg on the simulation loop (fedkernels/algorithms/fedevg.py; docs/algorithms/fedevg.md):
the server step schedule against reference values, a run on digits from Python and the CLI
(synthetic PNG grid), the server composition equal to the PyTorch formula, resume."""

from __future__ import annotations

import json

import pytest
import torch

from fedkernels.algorithms import available, build_strategy
from fedkernels.algorithms.fedevg import FedEvgConfig, cosine_beta_schedule
from fedkernels.cli import main
from fedkernels.sim import ExperimentConfig, Simulation
from fedkernels.sim.config import from_dict
from fedkernels.sim.strategy import RoundInfo

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def config(rounds=2):
    return from_dict(
        ExperimentConfig,
        {
            "rounds": rounds,
            "seed": 1,
            "data": {"name": "digits"},
            "partition": {"kind": "dirichlet", "num_clients": 4, "alpha": 1.0},
            "participation": {"kind": "full"},
            "model": {"name": "mlp", "hidden": [32]},
        },
    )


FAST = {"hidden": [32], "batch_size": 64, "server_epochs": 5}


def test_schedule_matches_reference_values():
    # T = 500, beta 10 -> 1 (docs/algorithms/fedevg.md, "6. Step-size schedule").
    b = cosine_beta_schedule(10.0, 1.0, 500)
    assert len(b) == 500
    for t, want, tol in [(0, 9.9992, 1e-3), (249, 9.944, 1e-3), (489, 8.44, 1e-2),
                         (497, 5.0, 0.05), (499, 1.0, 1e-9)]:
        assert abs(float(b[t]) - want) < tol, (t, float(b[t]))


def test_constants():
    assert "fedevg" in available()
    paper, code = FedEvgConfig(), FedEvgConfig(constants="code")
    assert (paper.server_beta_last, paper.server_sigma) == (0.01, 0.01)
    assert (code.server_beta_last, code.server_sigma) == (1.0, 1e-4)


def test_run_digits_and_png(tmp_path):
    png = tmp_path / "synth.png"
    strategy = build_strategy("fedevg", {**FAST, "image_path": str(png)})
    sim = Simulation(config(rounds=2), strategy)
    result = sim.run()
    x = strategy.synth_x
    assert x.shape == (100, 64) and torch.isfinite(x).all()
    assert float(x.min()) >= 0 and float(x.max()) <= 1  # clamped to the pixel range
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "test_accuracy" in result.summary
    rec = result.rounds[-1]
    assert rec["strategy_beta"] > 0 and 0 < rec["strategy_pi_max_mean"] <= 1


def test_compose_matches_pytorch_formula():
    """One server step equals its plain PyTorch composition with the same noise."""
    strategy = build_strategy("fedevg", {**FAST, "server_sigma": 0.0})
    sim = Simulation(config(rounds=1), strategy)
    fed = sim.federation
    ids = list(range(fed.num_clients))
    x0 = None
    ups = []
    for i in ids:
        ups.append(strategy.train_client(sim.server.state, fed.clients[i], 0, i))
        x0 = strategy.synth_x.clone()
    g = torch.stack([u.state["energy_grad"] for u in ups])
    e = torch.stack([u.state["energy"] for u in ups])
    n = torch.tensor([c.num_train for c in fed.clients], dtype=torch.float64)
    pi = torch.softmax(torch.log(n / n.sum())[:, None] + torch.sign(-e.double()), 0).float()
    a = (pi[:, :, None] * g.clamp(-3, 3)).sum(0)
    want = (x0 - float(strategy.betas[0]) * a).clamp(0, 1)
    info = RoundInfo(round=0, num_clients=len(ids), participants=torch.tensor(ids), num_samples=n,
                     global_state=sim.server.state, client_states=[u.state for u in ups],
                     train_losses=torch.zeros(len(ids), dtype=torch.float64), global_losses=None,
                     history=sim.history)
    strategy.aggregate(info, sim.server)
    torch.testing.assert_close(strategy.synth_x, want, rtol=1e-5, atol=1e-5)


def test_resume_equals_full_run(tmp_path):
    """The state (synthetic set, server noise generator) survives a checkpoint. The step schedule
    depends on the total rounds, so the interrupted run has the same config (3 rounds)."""
    full = build_strategy("fedevg", FAST)
    Simulation(config(rounds=3), full).run()
    path = tmp_path / "ckpt.pt"
    first = Simulation(config(rounds=3), build_strategy("fedevg", FAST), checkpoint=path)
    for t in range(2):
        first.records.append(first.play_round(t))
        first.next_round = t + 1
    first.save_checkpoint()
    resumed = build_strategy("fedevg", FAST)
    Simulation(config(rounds=3), resumed, checkpoint=path).run(resume=True)
    assert torch.equal(full.synth_x, resumed.synth_x)


def test_cli_runs_fedevg(tmp_path):
    out = tmp_path / "run"
    code = main([
        "run", "--algorithm", "fedevg", "--rounds", "1", "--data.name", "digits",
        "--partition.kind", "dirichlet", "--partition.num_clients", "3", "--partition.alpha", "1.0",
        "--model.hidden", "8", "--fedevg.hidden", "16", "--fedevg.image_path", str(out / "synth.png"),
        "--out", str(out),
    ])
    assert code in (0, None)
    assert (out / "synth.png").is_file()
    assert list(out.glob("*.json"))
    text = json.dumps([json.loads(f.read_text()) for f in out.glob("*.json")])
    assert "strategy_beta" in text
