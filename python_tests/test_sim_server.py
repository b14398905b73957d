"""Server optimizers against independent numpy formulas (Flower's FedAvgM, FedAdagrad, FedAdam,
FedYogi update rules), and BatchNorm buffer handling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedkernels.sim.config import ServerConfig
from fedkernels.sim.server import Server, build_server_optimizer

ROUNDS = 4


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def client_rounds(model, num_clients=3, seed=1):
    """Per round, K client state_dicts that scatter around the previous global model."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(num_clients, p.numel(), generator=g, dtype=torch.float64) * 0.1
            for p in model.parameters()
        ]
        for _ in range(ROUNDS)
    ]


def numpy_server(name, x, clients_per_round, weights, cfg):
    """The update formulas written out on one flat float64 vector per round."""
    lr = cfg.learning_rate
    m = v = momentum = None
    for t, clients in enumerate(clients_per_round, start=1):
        xs = clients(x)  # [K, P] client models of this round
        delta = (weights[:, None] * (xs - x)).sum(axis=0)
        if name == "sgd":
            x = x + lr * delta
        elif name == "fedavgm":
            g = -delta
            momentum = g if momentum is None else cfg.momentum * momentum + g
            x = x - lr * momentum
        elif name == "fedadagrad":
            v = (0 if v is None else v) + delta**2
            x = x + lr * delta / (np.sqrt(v) + cfg.tau)
        else:
            m = (1 - cfg.beta1) * delta + cfg.beta1 * (0 if m is None else m)
            prev = np.zeros_like(x) if v is None else v
            if name == "fedadam":
                v = cfg.beta2 * prev + (1 - cfg.beta2) * delta**2
                step = lr * np.sqrt(1 - cfg.beta2 ** (t + 1)) / (1 - cfg.beta1 ** (t + 1))
            else:  # fedyogi
                v = prev - (1 - cfg.beta2) * delta**2 * np.sign(prev - delta**2)
                step = lr
            x = x + step * m / (np.sqrt(v) + cfg.tau)
    return x


@pytest.mark.parametrize("name", ["sgd", "fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_server_optimizers_match_the_formulas(name):
    cfg = ServerConfig(optimizer=name, lr=0.3 if name in ("sgd", "fedavgm") else 0.05, momentum=0.7)
    model = make_model().double()
    server = Server(model, build_server_optimizer(cfg))
    names = server.parameter_names
    shapes = [server.state[n].shape for n in names]
    sizes = [s.numel() for s in shapes]
    noise = client_rounds(model)
    weights = np.array([0.2, 0.5, 0.3])

    def flat(state):
        return np.concatenate([state[n].numpy().ravel() for n in names])

    def unflat(vector):
        parts = np.split(vector, np.cumsum(sizes)[:-1])
        return {n: torch.from_numpy(p.reshape(s).copy()) for n, p, s in zip(names, parts, shapes)}

    def make_clients(t):
        return lambda x: (
            x[None, :] + np.concatenate([n.numpy() for n in noise[t]], axis=1) + 0.05 * t
        )

    expected = numpy_server(
        name, flat(server.state), [make_clients(t) for t in range(ROUNDS)], weights, cfg
    )
    for t in range(ROUNDS):
        xs = make_clients(t)(flat(server.state))
        server.step([unflat(row) for row in xs], torch.tensor(weights), t)
    np.testing.assert_allclose(flat(server.state), expected, rtol=1e-10, atol=1e-12)


def test_optimizer_state_round_trip():
    cfg = ServerConfig(optimizer="fedadam")
    model = make_model()
    a = Server(model, build_server_optimizer(cfg))
    clients = [{k: v + 0.1 * (i + 1) for k, v in a.state.items()} for i in range(2)]
    a.step(clients, torch.tensor([0.5, 0.5]), 0)
    b = Server(model, build_server_optimizer(cfg))
    b.load_state_dict(a.state_dict())
    for s in (a, b):
        s.step(clients, torch.tensor([0.5, 0.5]), 1)
    for k in a.state:
        assert torch.equal(a.state[k], b.state[k])


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize("optimizer", ["sgd", "fedadam"])
def test_batchnorm_buffers_are_averaged_not_optimized(optimizer):
    torch.manual_seed(0)
    server = Server(BNNet(), build_server_optimizer(ServerConfig(optimizer=optimizer, lr=0.5)))
    assert server.buffer_names == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    clients = []
    for k in range(3):
        net = BNNet()
        net.load_state_dict(server.state)
        net.train()
        for _ in range(k + 1):
            net(torch.randn(8, 4) + k)
        clients.append({n: t.detach().clone() for n, t in net.state_dict().items()})
    weights = torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64)  # not normalised
    before = {k: v.clone() for k, v in server.state.items()}
    server.step(clients, weights, 0)
    share = weights / weights.sum()
    for name in ("bn.running_mean", "bn.running_var"):
        expected = sum(w * c[name].double() for w, c in zip(share, clients)).float()
        torch.testing.assert_close(server.state[name], expected)
    assert server.state["bn.num_batches_tracked"].item() == 3
    if optimizer == "sgd":
        for name in server.parameter_names:
            expected = before[name] + 0.5 * sum(
                w * (c[name] - before[name]) for w, c in zip(weights, clients)
            )
            torch.testing.assert_close(server.state[name], expected.float())
