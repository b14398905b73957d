r"""Server-side ensemble distillation: FedDF, Fed-ET, entropy weighting, DaFKD-style
domain-aware weighting and FedGO (Jang, Park, Lee, ICML 2025). Equations, defaults and
citations: ``docs/algorithms/distillation.md``.

Every method shares one round (Algorithm 1 of the FedGO paper):

1. the participants train their classifiers locally (the shared trainer: cross-entropy, the
   run's client optimizer settings) from the server model;
2. the server model is initialised by FedAvg, :math:`\theta_s = \sum_k n_k\theta_k / \sum n`;
3. the teachers' logits on the server's distillation set :math:`U` are computed once per round
   (the teachers are frozen during distillation: ``E_s``-fold fewer forwards than recomputing
   them per batch), and the pseudo-labels
   :math:`\tilde y = \mathrm{softmax}(\sum_k w_k(x) f(x;\theta_k))` of all of U are formed by one
   :func:`fedkernels.ensemble_pseudo_labels` call (there is no augmentation of U here, so they
   are constant within the round);
4. the server model is distilled for ``server_epochs`` epochs of Adam on
   :func:`fedkernels.distill_kl` (forward KL, batchmean) over minibatches of U.

They differ only in :math:`w_k(x)`: ``feddf`` uniform, ``fedet`` variance of the logits,
``entropy-kd`` :math:`\mathrm{softmax}(-H/\tau)`, ``dafkd`` :math:`D_k/\sum D_j` and ``fedgo``
:math:`\mathrm{softmax}(\mathrm{sig}(z_k) + \log n_k)` (the double-sigmoid odds of Theorem 3.6).
``dafkd`` is the *weighting* of DaFKD in FedGO's pipeline (the paper's Fig. 2 comparison), not
the full DaFKD method, which retrains generator and discriminators jointly every round.

Discriminators (``dafkd``, ``fedgo``; Algorithm 3): client k trains an MLP discriminator once,
on its own training rows (real) against fake rows from the server's generator, the first time
it takes part (the result is the same as training all K before round 0: it depends only on the
client's data, the generator and a per-client seed). Its logits on U are cached for the whole
run (the discriminators never change). Generators: ``server_data`` uses U itself as the
fake set (p_g = p_s, the paper's toy example), ``random`` a randomly initialised MLP generator
(Table 12's "0 steps"), ``gan`` a small MLP GAN trained on U by the server before round 0 (G1).
The distillation set is U (scenario D1) or, with ``distill_set=generated``, ``num_generated``
samples of the generator drawn once (D2).

The server's unlabeled data comes from ``data.server_fraction`` (that fraction of every class is
held out before the clients' partition); without it the run stops with a clear error.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedkernels.ops.distill import distill_kl, ensemble_pseudo_labels
from fedkernels.sim import seeding
from fedkernels.sim.config import ConfigError
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import RoundInfo, SetupInfo, Strategy

from .registry import register

# Random streams of their own (beside those of fedkernels.sim.seeding).
DISCRIMINATOR = 111  # (seed, DISCRIMINATOR, client): init and minibatches of D_k
GENERATOR = 112  # (seed, GENERATOR): the generator's init, training and generated set
DISTILL = 113  # (seed, DISTILL, round): the server's minibatch order


@dataclass
class DistillationConfig:
    server_epochs: int = field(default=2, metadata={"help": "E_s: distillation epochs per round"})
    server_lr: float = field(default=1e-3, metadata={"help": "server Adam learning rate"})
    server_batch_size: int = field(default=64, metadata={"help": "distillation minibatch size"})
    lr_schedule: Literal["cosine", "none"] = field(
        default="cosine",
        metadata={"help": "per-round cosine decay of the server lr over the run, or none"},
    )
    combine: Literal["logits", "probs"] = field(
        default="logits", metadata={"help": "weighted logits then softmax, or weighted probs"}
    )
    temperature: float = field(default=1.0, metadata={"help": "distillation temperature T"})
    reduction: Literal["batchmean", "feddf", "dafkd", "sum"] = field(
        default="batchmean", metadata={"help": "KL scale: T^2/N, 1/N, T^2/(N C) or T^2"}
    )
    max_grad_norm: float | None = field(
        default=None, metadata={"help": "clip the server gradient norm (FedDF's code: 5)"}
    )
    tau: float = field(default=1.0, metadata={"help": "entropy weighting temperature"})
    odds: Literal["double_sigmoid", "exact"] = field(
        default="double_sigmoid", metadata={"help": "fedgo: w = softmax(sig(z)+log n) or (z+log n)"}
    )
    generator: Literal["server_data", "random", "gan"] = field(
        default="server_data",
        metadata={"help": "fake data of the discriminators: U itself, a random-init or a GAN-"
                          "trained MLP generator"},
    )
    distill_set: Literal["server", "generated"] = field(
        default="server", metadata={"help": "distil on U (D1) or on generated samples (D2)"}
    )
    num_generated: int = field(default=1000, metadata={"help": "size of the generated set (D2)"})
    noise_dim: int = field(default=16, metadata={"help": "generator input dimension"})
    gan_steps: int = field(default=500, metadata={"help": "generator steps of the server GAN"})
    disc_epochs: int = field(default=10, metadata={"help": "discriminator training epochs"})
    disc_lr: float = field(default=2e-4, metadata={"help": "discriminator Adam learning rate"})
    disc_batch_size: int = field(default=64, metadata={"help": "discriminator minibatch size"})
    disc_hidden: list[int] = field(
        default_factory=lambda: [64, 64], metadata={"help": "discriminator MLP hidden widths"}
    )

    def __post_init__(self) -> None:
        if self.server_epochs < 0:
            raise ConfigError("server_epochs must be >= 0")
        if self.server_lr <= 0 or self.disc_lr <= 0:
            raise ConfigError("server_lr and disc_lr must be > 0")
        if min(self.server_batch_size, self.disc_batch_size, self.num_generated) < 1:
            raise ConfigError("batch sizes and num_generated must be >= 1")
        if self.temperature <= 0 or self.tau <= 0:
            raise ConfigError("temperature and tau must be > 0")
        if self.disc_epochs < 1 or self.noise_dim < 1 or self.gan_steps < 0:
            raise ConfigError("disc_epochs and noise_dim must be >= 1, gan_steps >= 0")


# ---------------------------------------------------------------- building blocks


def mlp(num_in: int, hidden: list[int], num_out: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = num_in
    for h in hidden:
        layers += [nn.Linear(width, h), nn.LeakyReLU(0.2)]
        width = h
    layers.append(nn.Linear(width, num_out))
    return nn.Sequential(*layers)


def train_discriminator(
    disc: nn.Module,
    real: Tensor,
    fake: Callable[[int, torch.Generator], Tensor],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    optimizer: str = "adam",
) -> nn.Module:
    """Algorithm 3: minimise BCE-with-logits (real = 1, fake = 0) over ``epochs`` passes of
    ``real`` in minibatches, each paired with as many fresh fake rows ``fake(n, generator)``.
    Adam(lr, betas (0.5, 0.999)) as the DCGAN code, or RMSprop (the paper's toy example)."""
    g = torch.Generator().manual_seed(seed)
    opt = (
        torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.999))
        if optimizer == "adam"
        else torch.optim.RMSprop(disc.parameters(), lr=lr)
    )
    n = real.shape[0]
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for start in range(0, n, batch_size):
            x_real = real[order[start : start + batch_size]]
            x_fake = fake(x_real.shape[0], g)
            logits = disc(torch.cat([x_real, x_fake])).squeeze(-1)
            target = torch.cat([torch.ones(x_real.shape[0]), torch.zeros(x_fake.shape[0])])
            loss = F.binary_cross_entropy_with_logits(logits, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return disc


def train_gan(
    generator: nn.Module, data: Tensor, *, steps: int, noise_dim: int, seed: int, batch_size: int = 64
) -> nn.Module:
    """A small non-saturating GAN on ``data`` (a scaled-down stand-in for the paper's WGAN-GP):
    an MLP critic, Adam 2e-4 betas (0.5, 0.999), one critic step per generator step."""
    if steps == 0:
        return generator
    g = torch.Generator().manual_seed(seed)
    critic = mlp(data.shape[1], [64, 64], 1)
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(critic.parameters(), lr=2e-4, betas=(0.5, 0.999))
    ones, zeros = torch.ones(batch_size), torch.zeros(batch_size)
    for _ in range(steps):
        real = data[torch.randint(0, data.shape[0], (batch_size,), generator=g)]
        fake = generator(torch.randn(batch_size, noise_dim, generator=g))
        d_loss = F.binary_cross_entropy_with_logits(
            critic(real).squeeze(-1), ones
        ) + F.binary_cross_entropy_with_logits(critic(fake.detach()).squeeze(-1), zeros)
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(critic(fake).squeeze(-1), ones)
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
    return generator


@torch.no_grad()
def teacher_logits(model: nn.Module, states: list[Mapping[str, Tensor]], x: Tensor) -> Tensor:
    """``[K, M, C]``: each state's logits on ``x`` (eval mode), by ``functional_call`` on one
    module."""
    was_training = model.training
    model.eval()
    try:
        return torch.stack([functional_call(model, dict(s), (x,)) for s in states])
    finally:
        model.train(was_training)


def distill(
    student: nn.Module,
    x: Tensor,
    pseudo_labels: Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    max_grad_norm: float | None = None,
) -> float:
    """Adam on ``distill_kl(student(x_b), y_b)`` over ``epochs`` shuffled passes of ``x``
    (a fresh optimizer every round); returns the mean loss of the last
    epoch (``nan`` without steps)."""
    if epochs == 0 or x.shape[0] == 0:
        return math.nan
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    student.train()
    last = math.nan
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=g)
        total, count = 0.0, 0
        for start in range(0, x.shape[0], batch_size):
            rows = order[start : start + batch_size]
            if rows.numel() == 1 and x.shape[0] > 1:
                continue  # a trailing single row (BatchNorm cannot train on it)
            loss = distill_kl(
                student(x[rows]), pseudo_labels[rows], temperature, reduction=reduction
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm is not None:
                nn.utils.clip_grad_norm_(student.parameters(), max_grad_norm)
            opt.step()
            total += float(loss.detach()) * rows.numel()
            count += rows.numel()
        last = total / max(count, 1)
    return last


# ---------------------------------------------------------------- the strategies


class EnsembleDistillation(Strategy):
    """The shared round of the module docstring; subclasses set ``weighting``."""

    config_class = DistillationConfig
    weighting: ClassVar[str] = "uniform"

    @property
    def uses_discriminators(self) -> bool:
        return self.weighting in ("fedgo", "domain")

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        cfg = self.config
        if info.server_data is None or info.server_data.shape[0] == 0:
            raise ConfigError(
                f"{self.name} distils on the server's unlabeled data: set data.server_fraction "
                "(e.g. 0.5, the paper's half of every class)"
            )
        if info.model is None:
            raise ConfigError(f"{self.name} needs the model in SetupInfo")
        self.model = copy.deepcopy(info.model)
        self.server_x = info.server_data
        d = self.server_x.shape[1]
        with seeding.torch_stream(info.seed, GENERATOR):
            self.generator = mlp(cfg.noise_dim, [64, 64], d)
            if cfg.generator == "gan":
                train_gan(self.generator, self.server_x, steps=cfg.gan_steps,
                          noise_dim=cfg.noise_dim, seed=seeding.torch_seed(info.seed, GENERATOR))
            self.generator.requires_grad_(False)
            if cfg.distill_set == "generated":
                self.distill_x = self.generate(cfg.num_generated, torch.Generator().manual_seed(
                    seeding.torch_seed(info.seed, GENERATOR, 1)))
            else:
                self.distill_x = self.server_x
        # Per-client discriminator logits on the distillation set (NaN: not trained yet).
        self.disc_scores = torch.full((info.num_clients, self.distill_x.shape[0]), math.nan)
        self.discriminators: dict[int, dict[str, Tensor]] = {}
        self.last_teachers: list[dict[str, Tensor]] = []
        self.last_participants: list[int] = []
        self.last_sizes: list[float] = []

    def generate(self, n: int, g: torch.Generator) -> Tensor:
        with torch.no_grad():
            return self.generator(torch.randn(n, self.config.noise_dim, generator=g))

    def fake_sampler(self) -> Callable[[int, torch.Generator], Tensor]:
        if self.config.generator == "server_data":
            u = self.server_x
            return lambda n, g: u[torch.randint(0, u.shape[0], (n,), generator=g)]
        return self.generate

    def new_discriminator(self) -> nn.Module:
        return mlp(self.server_x.shape[1], list(self.config.disc_hidden), 1)

    # -- clients: the shared trainer for the classifier; the discriminator once per client.

    def train_client(self, global_state, data, round_index, client_id):
        if self.uses_discriminators and client_id not in self.discriminators:
            cfg = self.config
            with seeding.torch_stream(self.info.seed, DISCRIMINATOR, client_id):
                disc = train_discriminator(
                    self.new_discriminator(), data.train_x, self.fake_sampler(),
                    epochs=cfg.disc_epochs, batch_size=cfg.disc_batch_size, lr=cfg.disc_lr,
                    seed=seeding.torch_seed(self.info.seed, DISCRIMINATOR, client_id),
                )
                with torch.no_grad():
                    self.disc_scores[client_id] = disc(self.distill_x).squeeze(-1)
            self.discriminators[client_id] = {k: v.detach().clone() for k, v in disc.state_dict().items()}
        return None  # the shared trainer trains the classifier

    # -- server

    def pseudo_labels(self, logits: Tensor, participants: list[int], sizes: Tensor,
                      scores: Tensor | None) -> tuple[Tensor, Tensor]:
        cfg = self.config
        return ensemble_pseudo_labels(
            logits,
            scores if self.uses_discriminators else None,
            weighting=self.weighting,
            sample_sizes=sizes if self.weighting == "fedgo" else None,
            combine=cfg.combine,
            temperature=cfg.temperature,
            tau=cfg.tau,
            odds=cfg.odds,
            return_weights=True,
        )

    def server_lr(self, round_index: int) -> float:
        cfg = self.config
        if cfg.lr_schedule == "none" or self.info.rounds <= 1:
            return cfg.server_lr
        return 0.5 * cfg.server_lr * (1 + math.cos(math.pi * round_index / self.info.rounds))

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        cfg = self.config
        # FedAvg initialisation of the server model.
        server.step(info.client_states, info.num_samples / info.num_samples.sum(), info.round)
        ids = info.participants.tolist()
        logits = teacher_logits(self.model, info.client_states, self.distill_x)  # cached per round
        scores = self.disc_scores[ids] if self.uses_discriminators else None
        y, w = self.pseudo_labels(logits, ids, info.num_samples, scores)
        student = self.model
        student.load_state_dict(server.state)
        with seeding.torch_stream(self.info.seed, DISTILL, info.round):
            loss = distill(
                student, self.distill_x, y, epochs=cfg.server_epochs,
                batch_size=cfg.server_batch_size, lr=self.server_lr(info.round),
                seed=seeding.torch_seed(self.info.seed, DISTILL, info.round),
                temperature=cfg.temperature, reduction=cfg.reduction,
                max_grad_norm=cfg.max_grad_norm,
            )
        with torch.no_grad():
            for name, value in student.state_dict().items():
                server.state[name].copy_(value)
        self.last_teachers = [{k: v.clone() for k, v in s.items()} for s in info.client_states]
        self.last_participants = ids
        self.last_sizes = info.num_samples.tolist()
        return {"distill_loss": loss, "weight_max_mean": float(w.max(0).values.mean())}

    def evaluate(self, global_state, clients) -> dict[str, float]:
        """Ensemble test accuracy: argmax of the pseudo-label of the last round's
        teachers on every client's test rows, the discriminators evaluated at those rows."""
        if not self.last_teachers:
            return {}
        x = torch.cat([c.test_x for c in clients])
        y = torch.cat([c.test_y for c in clients])
        logits = teacher_logits(self.model, self.last_teachers, x)
        scores = None
        if self.uses_discriminators:
            disc = self.new_discriminator()
            rows = []
            with torch.no_grad():
                for k in self.last_participants:
                    disc.load_state_dict(self.discriminators[k])
                    rows.append(disc(x).squeeze(-1))
            scores = torch.stack(rows)
        labels, _ = self.pseudo_labels(logits, self.last_participants,
                                       torch.tensor(self.last_sizes, dtype=torch.float64), scores)
        return {"ensemble_accuracy": float((labels.argmax(1) == y).double().mean())}

    def state_dict(self) -> dict[str, Any]:
        return {
            "disc_scores": self.disc_scores.clone(),
            "discriminators": {str(k): v for k, v in self.discriminators.items()},
            "last_teachers": self.last_teachers,
            "last_participants": list(self.last_participants),
            "last_sizes": list(self.last_sizes),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.disc_scores = state["disc_scores"].clone()
        self.discriminators = {int(k): v for k, v in state["discriminators"].items()}
        self.last_teachers = list(state["last_teachers"])
        self.last_participants = list(state["last_participants"])
        self.last_sizes = list(state["last_sizes"])


@register
class FedDF(EnsembleDistillation):
    """FedDF (Lin et al. 2020): uniform weights on the logits."""

    name = "feddf"
    weighting = "uniform"


@register
class FedET(EnsembleDistillation):
    """Fed-ET's variance weighting (Cho et al. 2022): w_k ∝ Var_c f_k(x)."""

    name = "fedet"
    weighting = "variance"


@register
class EntropyDistillation(EnsembleDistillation):
    """Entropy weighting (FedHKT / FedDS): w_k ∝ exp(-H(σ(f_k(x)))/τ)."""

    name = "entropy-kd"
    weighting = "entropy"


@register
class DaFKDWeighting(EnsembleDistillation):
    """DaFKD's domain-aware weighting (Wang et al. 2023) in FedGO's pipeline:
    w_k ∝ D_k(x) with the clients' discriminators."""

    name = "dafkd"
    weighting = "domain"


@register
class FedGO(EnsembleDistillation):
    """FedGO: w_k = n_k Φ_k(x) / Σ n_j Φ_j(x) from the discriminators' odds (Theorem 3.6), with
    the double-sigmoid head: softmax_k(sig(z_k) + log n_k)."""

    name = "fedgo"
    weighting = "fedgo"
