"""The update rules of the personalized baselines (fedkernels/algorithms/personalized.py;
docs/algorithms/personalized.md) against hand computations: one client, one sample, one SGD
step (no momentum, no weight decay) on tiny linear models whose cross-entropy gradients are
written out below with plain tensor arithmetic (no autograd)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from algorithm_helpers import round_info
from torch import nn

from fedkernels.algorithms import build_strategy
from fedkernels.rules.server_optimizers import ServerSGD
from fedkernels.sim.config import ClientConfig, ConfigError, ModelConfig
from fedkernels.sim.models import build_model
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import SetupInfo

LR = 0.1
X = 2.0  # the one training sample
Y = 1  # its label (two classes)


def ce_grad_logits(z: torch.Tensor, y: int) -> torch.Tensor:
    """d CE / d logits = softmax(z) - onehot(y)."""
    p = torch.exp(z - z.max())
    p = p / p.sum()
    return p - torch.eye(len(z), dtype=z.dtype)[y]


def linear_grad(w: torch.Tensor) -> torch.Tensor:
    """CE gradient of the 2-parameter model logits = w * x (w of shape [2, 1])."""
    return (ce_grad_logits(w[:, 0] * X, Y) * X)[:, None]


def two_layer_grads(a: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CE gradients of logits = h * (a * x) (a: [1, 1] body, h: [2, 1] head)."""
    feature = a[0, 0] * X
    d = ce_grad_logits(h[:, 0] * feature, Y)
    return (d * h[:, 0]).sum().reshape(1, 1) * X, (d * feature)[:, None]


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(1, 1, bias=False)
        self.head = nn.Linear(1, 2, bias=False)

    def forward(self, x):
        return self.head(self.body(x))


def linear_model() -> nn.Module:
    model = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.3], [-0.2]]))
    return model


def two_layer_model() -> nn.Module:
    model = TwoLayer()
    with torch.no_grad():
        model.body.weight.fill_(0.7)
        model.head.weight.copy_(torch.tensor([[0.4], [-0.5]]))
    return model


def make(name: str, model: nn.Module, params=None, **client):
    strategy = build_strategy(name, params or {})
    client = {"epochs": 1, "batch_size": 1, "lr": LR, **client}
    strategy.setup(
        SetupInfo(
            num_clients=1,
            train_sizes=torch.tensor([1.0], dtype=torch.float64),
            num_classes=2,
            participation_probabilities=None,
            parameter_names=[n for n, _ in model.named_parameters()],
            model=model,
            client_config=ClientConfig(**client),
            rounds=1,
            seed=0,
        )
    )
    return strategy


DATA = SimpleNamespace(
    train_x=torch.tensor([[X]]),
    train_y=torch.tensor([Y]),
    test_x=torch.tensor([[X]]),
    test_y=torch.tensor([Y]),
    num_train=1,
)

# the round's global model, different from the initial model the strategies copy personal
# parts from, so that the tests see which one each rule starts from
GLOBAL_LINEAR = {"weight": torch.tensor([[-0.1], [0.25]])}
GLOBAL_TWO = {"body.weight": torch.tensor([[1.2]]), "head.weight": torch.tensor([[0.1], [0.3]])}


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_local_one_step_from_the_clients_own_model():
    model = linear_model()
    v0 = model.weight.detach().clone()
    s = make("local", model)
    update = s.train_client(GLOBAL_LINEAR, DATA, 0, 0)
    close(s.personal[0]["weight"], v0 - LR * linear_grad(v0))
    close(update.state["weight"], GLOBAL_LINEAR["weight"])  # nothing of it is shared


def test_fedavg_ft_fine_tunes_a_copy_of_the_global_model():
    s = make("fedavg-ft", linear_model(), {"finetune_epochs": 1, "finetune_lr": 0.3})
    assert s.train_client(GLOBAL_LINEAR, DATA, 0, 0) is None  # plain FedAvg training
    g = GLOBAL_LINEAR["weight"]
    close(s.personal_state(0, GLOBAL_LINEAR, DATA)["weight"], g - 0.3 * linear_grad(g))
    # 0 epochs: the personalized model is the global model
    s0 = make("fedavg-ft", linear_model(), {"finetune_epochs": 0})
    close(s0.personal_state(0, GLOBAL_LINEAR, DATA)["weight"], g)


def test_fedper_trains_body_and_personal_head_together_and_shares_the_body():
    model = two_layer_model()
    h0 = model.head.weight.detach().clone()
    s = make("fedper", model)
    assert s.head_keys == ["head.weight"]  # the last Linear by default
    update = s.train_client(GLOBAL_TWO, DATA, 0, 0)
    a = GLOBAL_TWO["body.weight"]
    ga, gh = two_layer_grads(a, h0)
    close(s.personal[0]["head.weight"], h0 - LR * gh)
    close(update.state["body.weight"], a - LR * ga)
    close(update.state["head.weight"], GLOBAL_TWO["head.weight"])


def test_lg_fedavg_keeps_the_body_and_shares_the_head():
    model = two_layer_model()
    a0 = model.body.weight.detach().clone()
    s = make("lg-fedavg", model)
    update = s.train_client(GLOBAL_TWO, DATA, 0, 0)
    h = GLOBAL_TWO["head.weight"]
    ga, gh = two_layer_grads(a0, h)
    close(s.personal[0]["body.weight"], a0 - LR * ga)
    close(update.state["head.weight"], h - LR * gh)
    close(update.state["body.weight"], GLOBAL_TWO["body.weight"])


def test_fedrep_head_first_with_body_frozen_then_body_with_head_frozen():
    model = two_layer_model()
    h0 = model.head.weight.detach().clone()
    s = make("fedrep", model, {"head_epochs": 1})
    update = s.train_client(GLOBAL_TWO, DATA, 0, 0)
    a = GLOBAL_TWO["body.weight"]
    _, gh = two_layer_grads(a, h0)
    h1 = h0 - LR * gh  # head step at the global body
    ga, _ = two_layer_grads(a, h1)
    a1 = a - LR * ga  # body step at the new head
    close(s.personal[0]["head.weight"], h1)
    close(update.state["body.weight"], a1)
    close(update.state["head.weight"], GLOBAL_TWO["head.weight"])


@pytest.mark.parametrize("learn", [False, True])
def test_apfl_steps_w_and_v_from_the_same_iterate(learn):
    model = linear_model()
    v0 = model.weight.detach().clone()
    alpha = 0.25
    s = make("apfl", model, {"alpha": alpha, "learn_alpha": learn, "alpha_lr": 2.0})
    update = s.train_client(GLOBAL_LINEAR, DATA, 0, 0)
    w0 = GLOBAL_LINEAR["weight"]
    v_bar = alpha * v0 + (1 - alpha) * w0
    g_bar = linear_grad(v_bar)
    close(update.state["weight"], w0 - LR * linear_grad(w0))
    close(s.personal[0]["weight"], v0 - LR * alpha * g_bar)  # d f(v_bar) / d v = alpha * grad
    if learn:
        expected = min(1.0, max(0.0, alpha - 2.0 * float(((v0 - w0) * g_bar).sum())))
        assert s.alpha[0] == pytest.approx(expected, rel=1e-6)
        assert s.alpha[0] != alpha
        mix = s.alpha[0]
    else:
        assert s.alpha == {}
        mix = alpha
    # the personalized model mixes the client's v with the current global model
    v1 = s.personal[0]["weight"]
    close(s.personal_state(0, GLOBAL_LINEAR, DATA)["weight"], mix * v1 + (1 - mix) * w0)


def test_apfl_alpha_is_projected_onto_the_unit_interval():
    s = make("apfl", linear_model(), {"alpha": 0.9, "learn_alpha": True, "alpha_lr": 1e6})
    s.train_client(GLOBAL_LINEAR, DATA, 0, 0)
    assert s.alpha[0] in (0.0, 1.0)


def test_ditto_global_step_then_proximal_personal_step():
    model = linear_model()
    v0 = model.weight.detach().clone()
    lam = 0.7
    s = make("ditto", model, {"lam": lam})
    update = s.train_client(GLOBAL_LINEAR, DATA, 0, 0)
    w0 = GLOBAL_LINEAR["weight"]
    close(update.state["weight"], w0 - LR * linear_grad(w0))
    close(s.personal[0]["weight"], v0 - LR * (linear_grad(v0) + lam * (v0 - w0)))


def test_pfedme_inner_steps_then_moreau_step():
    lam, plr, k = 3.0, 0.05, 2
    s = make("pfedme", linear_model(), {"lam": lam, "personal_lr": plr, "inner_steps": k})
    update = s.train_client(GLOBAL_LINEAR, DATA, 0, 0)
    w0 = GLOBAL_LINEAR["weight"]
    theta = w0.clone()
    for _ in range(k):
        theta = theta - plr * (linear_grad(theta) + lam * (theta - w0))
    close(s.personal[0]["weight"], theta)
    close(update.state["weight"], w0 - LR * lam * (w0 - theta))


def test_pfedme_server_mixes_with_beta():
    beta = 1.5
    model = linear_model()
    s = make("pfedme", model, {"beta": beta})
    glob = {"weight": torch.tensor([[1.0], [2.0]])}
    clients = [{"weight": torch.tensor([[0.0], [4.0]])}, {"weight": torch.tensor([[3.0], [-1.0]])}]
    info = round_info([0.0, 0.0], [1.0, 3.0], global_state=glob, client_states=clients)
    server = Server(model, ServerSGD(1.0))
    server.state["weight"].copy_(glob["weight"])
    s.aggregate(info, server)
    average = 0.25 * clients[0]["weight"] + 0.75 * clients[1]["weight"]
    close(server.state["weight"], (1 - beta) * glob["weight"] + beta * average)


def test_local_aggregates_nothing():
    model = linear_model()
    s = make("local", model)
    server = Server(model, ServerSGD(1.0))
    before = server.state["weight"].clone()
    clients = [{"weight": torch.ones(2, 1)}]
    s.aggregate(round_info([0.0], [1.0], global_state=dict(server.state), client_states=clients),
                server)
    assert torch.equal(server.state["weight"], before)


def test_head_choice():
    mlp = build_model(ModelConfig(name="mlp", hidden=[8, 8]), 4, 3, None, 0)
    s = make("fedper", mlp)
    assert s.head_keys == ["layers.4.weight", "layers.4.bias"]
    assert s.body_keys[0] == "layers.0.weight"
    named = make("lg-fedavg", mlp, {"head": "layers.2,layers.4.weight"})
    assert named.head_keys == ["layers.2.weight", "layers.2.bias", "layers.4.weight"]
    assert "layers.4.bias" in named.personal_keys  # lg-fedavg: the body is personal
    with pytest.raises(ConfigError, match="fedrep.head: 'layers.9' names no parameter"):
        make("fedrep", mlp, {"head": "layers.9"})
    with pytest.raises(ConfigError, match="leaves no body"):
        make("fedper", build_model(ModelConfig(name="logreg"), 4, 3, None, 0))
    with pytest.raises(ConfigError, match="leaves no body"):
        make("fedper", mlp, {"head": "layers"})


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("apfl", {"alpha": "1.5"}, "apfl.alpha must be in"),
        ("apfl", {"alpha_lr": "0"}, "apfl.alpha_lr must be > 0"),
        ("ditto", {"lam": "-1"}, "ditto.lam must be >= 0"),
        ("ditto", {"personal_epochs": "0"}, "ditto.personal_epochs must be >= 1"),
        ("pfedme", {"beta": "0"}, "pfedme.beta must be > 0"),
        ("pfedme", {"inner_steps": "0"}, "pfedme.inner_steps must be >= 1"),
        ("pfedme", {"lam": "0"}, "pfedme.lam must be > 0"),
        ("fedrep", {"head_epochs": "-1"}, "fedrep.head_epochs must be >= 0"),
        ("fedavg-ft", {"finetune_lr": "0"}, "fedavg-ft.finetune_lr must be > 0"),
        ("local", {"x": "1"}, "takes no parameters"),
    ],
)
def test_bad_parameters_are_named(name, params, message):
    with pytest.raises(ConfigError, match=message):
        build_strategy(name, params)
