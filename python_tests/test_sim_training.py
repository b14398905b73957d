"""End-to-end behaviour of the simulation loop: accuracy on real data, FedProx(0) = FedAvg,
vmap = sequential, resume = uninterrupted, and what strategies see."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedkernels.algorithms import FedAvg, FedProx, FedProxConfig, build_strategy
from fedkernels.sim import (
    ClientConfig,
    ConfigError,
    Dataset,
    ExperimentConfig,
    ModelConfig,
    ParticipationConfig,
    PartitionConfig,
    RoundInfo,
    ServerConfig,
    Simulation,
    Strategy,
    seeding,
)
from fedkernels.sim.client import batch_indices, batch_plan, plan_indices
from fedkernels.sim.metrics import evaluate_clients

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def without_times(records):
    return [{k: v for k, v in r.items() if not (k.startswith("time") or k == "wall_time_s")}
            for r in records]


def test_fedavg_on_digits_reaches_90_percent():
    cfg = ExperimentConfig(
        rounds=10,
        eval_every=5,
        partition=PartitionConfig(kind="iid", num_clients=10),
        client=ClientConfig(epochs=2, batch_size=10, lr=0.1),
    )
    result = Simulation(cfg, FedAvg()).run()
    assert result.summary["test_accuracy"] >= 0.90
    assert result.rounds[-1]["test_accuracy"] == result.summary["test_accuracy"]
    assert len(result.clients) == 10 and all(c["rounds_participated"] == 10 for c in result.clients)
    assert result.config["algorithm"] == "fedavg"


def test_fedprox_with_mu_zero_equals_fedavg_exactly():
    cfg = ExperimentConfig(
        rounds=3,
        partition=PartitionConfig(kind="dirichlet", num_clients=6, alpha=0.5),
        client=ClientConfig(lr=0.1, momentum=0.5, weight_decay=1e-4),
    )
    avg = Simulation(cfg, FedAvg())
    prox = Simulation(cfg, FedProx(FedProxConfig(mu=0.0)))
    avg.run(), prox.run()
    for name, value in avg.server.state.items():
        assert torch.equal(value, prox.server.state[name]), name
    # ... and a positive mu pulls the clients towards the global model.
    pulled = Simulation(cfg, FedProx(FedProxConfig(mu=1.0)))
    pulled.run()
    assert any(not torch.equal(v, pulled.server.state[k]) for k, v in avg.server.state.items())


@pytest.mark.parametrize(
    "model, client",
    [
        ("mlp", ClientConfig(epochs=2, batch_size=16, lr=0.1, momentum=0.9, weight_decay=1e-3)),
        ("mlp", ClientConfig(steps=7, batch_size=8, lr=0.05)),
        ("cnn", ClientConfig(steps=4, batch_size=8, lr=0.05, momentum=0.5)),
    ],
    ids=["mlp-epochs-momentum", "mlp-steps", "cnn-steps"],
)
def test_vmap_equals_sequential(client, model):
    base = dict(
        rounds=2,
        partition=PartitionConfig(kind="dirichlet", num_clients=6, alpha=0.5),  # unequal sizes
        participation=ParticipationConfig(kind="uniform", fraction=0.7),
        model=ModelConfig(name=model, **({"hidden": [32]} if model == "mlp" else {"channels": [4, 8]})),
        client=client,
    )
    runs = {}
    for vmap in (False, True):
        sim = Simulation(ExperimentConfig(vmap=vmap, **base), FedProx(FedProxConfig(mu=0.1)))
        runs[vmap] = (sim.run(), sim.server.state)
    for name, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], value, rtol=1e-4, atol=1e-5)
    for seq, bat in zip(runs[False][0].rounds, runs[True][0].rounds):
        assert seq["participants"] == bat["participants"]
        assert seq["train_loss"] == pytest.approx(bat["train_loss"], rel=1e-4)


def test_vmap_rejects_batchnorm():
    cfg = ExperimentConfig(rounds=1, vmap=True, model=ModelConfig(batch_norm=True))
    with pytest.raises(ConfigError, match="BatchNorm"):
        Simulation(cfg, FedAvg())


@pytest.mark.parametrize("vmap", [False, True])
def test_resume_equals_uninterrupted(tmp_path, vmap):
    def config(rounds):
        return ExperimentConfig(
            rounds=rounds,
            vmap=vmap,
            checkpoint_every=2,
            partition=PartitionConfig(kind="dirichlet", num_clients=8, alpha=1.0),
            participation=ParticipationConfig(kind="markov", fraction=0.4, markov_delta=0.3),
            client=ClientConfig(lr=0.1, momentum=0.5),
            server=ServerConfig(optimizer="fedyogi"),
        )

    straight = Simulation(config(5), FedAvg())
    expected = straight.run()
    path = tmp_path / "ckpt.pt"
    Simulation(config(4), FedAvg(), checkpoint=path).run()  # checkpoints after rounds 2 and 4
    resumed_sim = Simulation(config(5), FedAvg(), checkpoint=path)
    resumed = resumed_sim.run(resume=True)
    assert without_times(resumed.rounds) == without_times(expected.rounds)
    assert resumed.clients == expected.clients
    for name, value in straight.server.state.items():
        assert torch.equal(resumed_sim.server.state[name], value)


def test_resume_checks_the_configuration(tmp_path):
    path = tmp_path / "ckpt.pt"
    cfg = ExperimentConfig(rounds=2, partition=PartitionConfig(num_clients=4))
    Simulation(cfg, FedAvg(), checkpoint=path).run()
    changed = ExperimentConfig(
        rounds=3, partition=PartitionConfig(num_clients=4), client=ClientConfig(lr=0.3)
    )
    with pytest.raises(ConfigError, match="differs from the checkpoint's in client.lr"):
        Simulation(changed, FedAvg(), checkpoint=path).run(resume=True)
    with pytest.raises(ConfigError, match="no checkpoint"):
        Simulation(cfg, FedAvg(), checkpoint=tmp_path / "none.pt").run(resume=True)


class Recorder(Strategy):
    """Uniform weights; keeps every RoundInfo and asks for the pre-training losses."""

    name = "recorder"
    wants_global_loss = True

    def __init__(self):
        super().__init__()
        self.seen: list[RoundInfo] = []
        self.aggregations = 0

    def client_weights(self, info):
        self.seen.append(info)
        return torch.full(
            (len(info.participants),), 1.0 / len(info.participants), dtype=torch.float64
        )

    def aggregate(self, info, server):
        out = super().aggregate(info, server)
        self.aggregations += 1
        return {**out, "weight_sum": 1.0}

    def state_dict(self):
        return {"aggregations": self.aggregations}


def test_strategy_sees_the_round():
    cfg = ExperimentConfig(
        rounds=3,
        partition=PartitionConfig(num_clients=8),
        participation=ParticipationConfig(kind="uniform", fraction=0.5),
    )
    strategy = Recorder()
    sim = Simulation(cfg, strategy)
    initial = {k: v.clone() for k, v in sim.server.state.items()}
    result = sim.run()
    assert strategy.info.num_clients == 8 and strategy.info.participation_probabilities is None
    first = strategy.seen[0]
    assert (
        first.participants.tolist() == sorted(first.participants.tolist())
        and len(first.participants) == 4
    )
    assert first.history.num_rounds == 3  # the same live history object, now after 3 rounds
    assert first.history.matrix[0].nonzero().flatten().tolist() == first.participants.tolist()
    clients = [sim.federation.clients[i] for i in first.participants.tolist()]
    assert first.num_samples.tolist() == [c.num_train for c in clients]
    model = sim.eval_model
    model.load_state_dict(initial)
    losses = evaluate_clients(
        model, [c.train_x for c in clients], [c.train_y for c in clients]
    ).loss
    torch.testing.assert_close(first.global_losses, losses)
    assert all(torch.equal(first.global_state[k], initial[k]) for k in initial)
    assert result.rounds[0]["strategy_weight_sum"] == 1.0
    assert "global_loss_before" in result.rounds[0]


def test_rounds_without_participants_leave_the_model():
    cfg = ExperimentConfig(
        rounds=6,
        partition=PartitionConfig(num_clients=3),
        participation=ParticipationConfig(kind="bernoulli", probabilities=[0.0, 0.0, 0.3]),
    )
    result = Simulation(cfg, FedAvg()).run()
    empty = [r for r in result.rounds if r["participants"] == 0]
    assert empty and all("train_loss" not in r for r in empty)
    assert result.clients[0]["rounds_participated"] == 0
    assert result.clients[0]["participation_probability"] == 0.0


def test_user_model_and_tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, generator=g)
    y = (x[:, 0] > 0).long()
    data = Dataset.from_tensors(x, y, groups=torch.arange(300) % 5)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    cfg = ExperimentConfig(
        rounds=10, partition=PartitionConfig(kind="natural"), client=ClientConfig(lr=0.3, epochs=3)
    )
    result = Simulation(cfg, build_strategy("fedavg"), dataset=data, model=model).run()
    assert result.dataset == "tensors" and len(result.clients) == 5
    assert result.summary["test_accuracy"] > 0.85


def test_server_optimizers_train():
    for optimizer in ("fedavgm", "fedadam"):
        cfg = ExperimentConfig(
            rounds=6,
            model=ModelConfig(name="logreg"),
            client=ClientConfig(lr=0.2),
            server=ServerConfig(optimizer=optimizer, lr=0.5 if optimizer == "fedavgm" else 0.05),
        )
        assert Simulation(cfg, FedAvg()).run().summary["test_accuracy"] > 0.8, optimizer


def test_batch_plan():
    rng = np.random.default_rng(0)
    plan = batch_plan(23, ClientConfig(epochs=2, batch_size=10), rng)
    assert [len(b) for b in plan] == [10, 10, 3] * 2
    assert all(
        np.array_equal(np.sort(np.concatenate(plan[i : i + 3])), np.arange(23)) for i in (0, 3)
    )
    merged = batch_plan(21, ClientConfig(batch_size=10), rng)
    assert [len(b) for b in merged] == [10, 11]  # a trailing single row joins the batch before
    steps = batch_plan(5, ClientConfig(steps=4, batch_size=3), rng)
    assert [len(b) for b in steps] == [3] * 4


@pytest.mark.parametrize("n", [0, 1, 5, 21, 23, 32, 33, 40, 64, 65])
@pytest.mark.parametrize("config", [ClientConfig(epochs=1, batch_size=32),
                                    ClientConfig(epochs=3, batch_size=10),
                                    ClientConfig(epochs=2, batch_size=1),
                                    ClientConfig(steps=4, batch_size=3)])
def test_plan_indices_are_the_batch_plan(n, config):
    # the trainer's shortcut draws the same permutations and cuts the same batches
    if n == 0 and config.steps is not None:
        pytest.skip("step mode needs rows")
    cpu = torch.device("cpu")
    expected = batch_indices(batch_plan(n, config, np.random.default_rng(n)), cpu)
    got = plan_indices(n, config, np.random.default_rng(n), cpu)
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]
    assert all(b.dtype == torch.int64 for b in got)


def test_torch_stream_restores_the_callers_generator():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with seeding.torch_stream(7, seeding.LOCAL_TRAINING, 1, 2):
        first = torch.rand(3)
    with pytest.raises(RuntimeError), seeding.torch_stream(7, seeding.LOCAL_TRAINING, 1, 2):
        assert torch.equal(torch.rand(3), first)
        raise RuntimeError
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 1e-3), (0.5, 5e-4)])
def test_local_sgd_is_torch_sgd_bit_for_bit(foreach, momentum, weight_decay):
    """LocalSGD against torch.optim.SGD with the same path (per tensor, as on the CPU, or the
    foreach kernels of other devices), over steps at two learning rates, a parameter without
    a gradient and a buffer reset between two clients."""
    from fedkernels.sim.client import LocalSGD

    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen),
             torch.randn(2, generator=gen, dtype=torch.float64)]
    ours = [p.clone().requires_grad_() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    sgd = LocalSGD(ours, momentum, weight_decay)
    sgd.foreach = foreach
    for client in range(2):
        reference = torch.optim.SGD(theirs, lr=0.1, momentum=momentum, weight_decay=weight_decay,
                                    foreach=foreach)
        sgd.reset()
        for step in range(4):
            lr = 0.1 if step < 2 else 0.03
            reference.param_groups[0]["lr"] = lr
            grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in start]
            for params in (ours, theirs):
                for i, (p, g) in enumerate(zip(params, grads)):
                    p.grad = None if (i == 2 and step == 1) else g.clone()
            sgd.step(lr)
            reference.step()
            for a, b in zip(ours, theirs):
                assert torch.equal(a, b), (client, step)


@pytest.mark.slow
def test_sequential_training_does_not_import_dynamo():
    """The first torch.optim optimizer of a process imports torch._dynamo (seconds on a small
    machine); a sequential client's training builds none."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from fedkernels.algorithms import FedAvg\n"
        "from fedkernels.sim import ClientConfig\n"
        "from fedkernels.sim.client import LocalTrainer\n"
        "from fedkernels.sim.federation import ClientData\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))\n"
        "x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))\n"
        "import numpy as np\n"
        "rows = np.arange(20)\n"
        "data = ClientData(x, y, x, y, rows, rows)\n"
        "trainer = LocalTrainer(model, ClientConfig(momentum=0.9, batch_size=8), FedAvg(), seed=0)\n"
        "trainer.train(model.state_dict(), data, 0, 0)\n"
        "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
