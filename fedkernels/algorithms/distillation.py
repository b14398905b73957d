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

Discriminators (``dafkd``, ``fedgo``; Algorithm 3): client k trains a discriminator once, on
its own training rows (real) against fake rows from the server's generator, the first time it
takes part (the result is the same as training all K before round 0: it depends only on the
client's data, the generator and a per-client seed). ``disc_arch`` picks an MLP or the paper's
small convolutional (DCGAN-style) discriminator for images. Its logits on the distillation set
are cached for the whole run (the discriminators never change). Generators: ``server_data`` uses
U itself as the fake set (p_g = p_s, the paper's toy example), ``random`` a randomly initialised
generator (Table 12's "0 steps"), ``gan`` a small non-saturating MLP GAN and ``wgan_gp`` a
WGAN-GP (the paper's G1: n_critic 5, gradient penalty 10, Adam 2e-4 betas (0, 0.9)), both
trained on U by the server before round 0. The distillation set is U (scenario D1) or, with
``distill_set=generated``, ``num_generated`` samples of the generator drawn once (D2).

Fed-ET's weighted consensus with diversity regularisation (``consensus=hard``,
``diversity_lambda``): the student fits the argmax of the weighted ensemble with cross-entropy,
plus λ times the KL divergence to the weighted ensemble of the teachers that disagree with that
consensus (:func:`distillation_loss`).

The server's unlabeled data comes from ``data.server_fraction`` (that fraction of every class is
held out before the clients' partition); without it the run stops with a clear error.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedkernels.aggregate import FLOAT32_MAX
from fedkernels.ops.distill import distill_kl, ensemble_pseudo_labels
from fedkernels.sim import seeding
from fedkernels.sim.atomic_files import replacing
from fedkernels.sim.config import ConfigError
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import RoundInfo, SetupInfo, Strategy

from .generators import (
    ConvGenerator,
    DCGANDiscriminator,
    MLPGenerator,
    mlp,
    resolve_image_shape,
    train_wgan_gp,
)
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
    generator: Literal["server_data", "random", "gan", "wgan_gp"] = field(
        default="server_data",
        metadata={"help": "fake data of the discriminators: U itself, a random-init generator, "
                          "a small MLP GAN or a WGAN-GP trained on U"},
    )
    generator_arch: Literal["auto", "mlp", "conv"] = field(
        default="auto",
        metadata={"help": "generator network: auto = conv (DCGAN-style) for wgan_gp on image "
                          "rows, MLP otherwise"},
    )
    generator_width: int = field(
        default=64, metadata={"help": "channels of the conv generator and WGAN-GP critic"})
    distill_set: Literal["server", "generated"] = field(
        default="server", metadata={"help": "distil on U (D1) or on generated samples (D2)"}
    )
    num_generated: int = field(default=1000, metadata={"help": "size of the generated set (D2)"})
    noise_dim: int = field(default=16, metadata={"help": "generator input dimension"})
    gan_steps: int = field(default=500, metadata={"help": "generator steps of the server GAN"})
    generator_path: str = field(
        default="",
        metadata={"help": "load the trained generator from this file when it was trained with "
                          "the same settings, seed and U; else train it and write it there"},
    )
    n_critic: int = field(default=5, metadata={"help": "wgan_gp: critic steps per generator step"})
    gp_weight: float = field(default=10.0, metadata={"help": "wgan_gp: gradient-penalty weight"})
    disc_arch: Literal["mlp", "cnn", "cnn_mlp"] = field(
        default="mlp",
        metadata={"help": "discriminator: MLP, the paper's 4-layer DCGAN-style CNN, or its "
                          "CNN+MLP variant (images)"},
    )
    disc_width: int = field(default=64, metadata={"help": "channels of the first conv layer"})
    disc_epochs: int = field(default=10, metadata={"help": "discriminator training epochs"})
    disc_lr: float = field(default=2e-4, metadata={"help": "discriminator Adam learning rate"})
    disc_batch_size: int = field(default=64, metadata={"help": "discriminator minibatch size"})
    disc_hidden: list[int] = field(
        default_factory=lambda: [64, 64], metadata={"help": "discriminator MLP hidden widths"}
    )
    image_shape: list[int] = field(
        default_factory=list,
        metadata={"help": "C H W (or H W) of one row for the conv networks (default: square, "
                          "one channel)"},
    )
    consensus: Literal["soft", "hard"] = field(
        default="soft",
        metadata={"help": "fit the soft pseudo-labels (KL) or their argmax (cross-entropy, "
                          "Fed-ET)"},
    )
    diversity_lambda: float = field(
        default=0.0,
        metadata={"help": "Fed-ET diversity weight: KL to the ensemble of the teachers that "
                          "disagree with the consensus (Fed-ET: 0.05)"},
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
        if max(self.server_lr, self.disc_lr) > FLOAT32_MAX / 10:
            raise ConfigError(f"server_lr and disc_lr must be at most {FLOAT32_MAX / 10:.4g} "
                              "(Adam's first step, lr / (1 - 0.9), on float32 parameters)")
        if self.temperature > FLOAT32_MAX**0.5:
            raise ConfigError(f"temperature must be at most {FLOAT32_MAX**0.5:.4g} (the KL is "
                              "scaled by T^2, a float32)")
        if self.disc_epochs < 1 or self.noise_dim < 1 or self.gan_steps < 0:
            raise ConfigError("disc_epochs and noise_dim must be >= 1, gan_steps >= 0")
        if min(self.n_critic, self.generator_width, self.disc_width) < 1:
            raise ConfigError("n_critic, generator_width and disc_width must be >= 1")
        if self.gp_weight < 0 or self.diversity_lambda < 0:
            raise ConfigError("gp_weight and diversity_lambda must be >= 0")


# ---------------------------------------------------------------- building blocks


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
    Adam(lr, betas (0.5, 0.999)) as the DCGAN code, or RMSprop (the paper's toy example).
    ``disc`` must be on the device of ``real``; the minibatch orders are drawn on the CPU
    from ``seed`` (a CPU generator, which ``fake`` draws from too)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    device = real.device
    opt = (
        torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.999))
        if optimizer == "adam"
        else torch.optim.RMSprop(disc.parameters(), lr=lr)
    )
    n = real.shape[0]
    for _ in range(epochs):
        order = torch.randperm(n, generator=g, device="cpu").to(device)
        for start in range(0, n, batch_size):
            x_real = real[order[start : start + batch_size]]
            x_fake = fake(x_real.shape[0], g)
            logits = disc(torch.cat([x_real, x_fake])).squeeze(-1)
            target = torch.cat([torch.ones(x_real.shape[0], device=device),
                                torch.zeros(x_fake.shape[0], device=device)])
            loss = F.binary_cross_entropy_with_logits(logits, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return disc


def train_gan(
    generator: nn.Module, data: Tensor, *, steps: int, noise_dim: int, seed: int, batch_size: int = 64
) -> nn.Module:
    """A small non-saturating GAN on ``data`` (a scaled-down stand-in for the paper's WGAN-GP):
    an MLP critic, Adam 2e-4 betas (0.5, 0.999), one critic step per generator step. The
    generator must be on the device of ``data``; the critic is initialised on the CPU (torch's
    CPU generator, which the caller seeds) and the draws are made there from ``seed``."""
    if steps == 0:
        return generator
    g = torch.Generator(device="cpu").manual_seed(seed)
    device = data.device
    with torch.device("cpu"):
        critic = mlp(data.shape[1], [64, 64], 1)
    critic.to(device)
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(critic.parameters(), lr=2e-4, betas=(0.5, 0.999))
    ones = torch.ones(batch_size, device=device)
    zeros = torch.zeros(batch_size, device=device)
    for _ in range(steps):
        rows = torch.randint(0, data.shape[0], (batch_size,), generator=g, device="cpu")
        real = data[rows.to(device)]
        noise = torch.randn(batch_size, noise_dim, generator=g, device="cpu")
        fake = generator(noise.to(device))
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


def diversity_targets(
    logits: Tensor,
    weights: Tensor,
    consensus: Tensor,
    *,
    combine: str = "logits",
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    r"""Fed-ET's diversity targets: for each sample i, the teachers whose argmax differs from
    the consensus label ``consensus[i]`` (:math:`\bar V_i`), combined with their weights
    renormalised over :math:`\bar V_i` (uniform where those weights sum to 0):
    :math:`d_i = \mathrm{softmax}(\sum_{k\in\bar V_i} w'_{k,i} L_{k,i}/T)` (``combine=logits``) or
    :math:`\sum_k w'_{k,i}\,\mathrm{softmax}(L_{k,i}/T)` (``probs``). Returns ``(d [N, C],
    has [N])``; rows where every teacher agrees have ``has`` false (and a uniform ``d``)."""
    disagree = logits.argmax(-1) != consensus[None]  # [K, N]
    mask = disagree.to(weights.dtype)
    masked = weights * mask
    total = masked.sum(0, keepdim=True)
    count = mask.sum(0, keepdim=True).clamp_min(1)
    w = torch.where(total > 0, masked / total.clamp_min(torch.finfo(weights.dtype).tiny),
                    mask / count)
    L = logits.to(weights.dtype)
    if combine == "logits":
        d = torch.softmax((w[:, :, None] * L).sum(0) / temperature, dim=-1)
    else:
        d = (w[:, :, None] * torch.softmax(L / temperature, dim=-1)).sum(0)
    has = disagree.any(0)
    d = torch.where(has[:, None], d, torch.full_like(d, 1.0 / d.shape[-1]))
    return d.to(logits.dtype), has


def distillation_loss(
    student_logits: Tensor,
    pseudo_labels: Tensor,
    *,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    hard: bool = False,
    diversity: Tensor | None = None,
    has_diversity: Tensor | None = None,
    diversity_lambda: float = 0.0,
) -> Tensor:
    r"""The server's loss on one minibatch of N samples:
    :math:`\mathrm{KL}(\tilde y \,\|\, q)` scaled by ``reduction`` (:func:`distill_kl`), or with
    ``hard`` the cross-entropy :math:`\frac1N\sum_i -\log q_{i, \arg\max \tilde y_i}` (Fed-ET's
    consensus); plus, when ``diversity_lambda > 0``,
    :math:`\lambda\,\frac{T^2}{N}\sum_{i:\,has_i} \mathrm{KL}(d_i \,\|\, q_i)` with
    :math:`q = \mathrm{softmax}(S/T)` (Fed-ET's diversity regularisation)."""
    if hard:
        loss = F.cross_entropy(student_logits / temperature, pseudo_labels.argmax(-1))
    else:
        loss = distill_kl(student_logits, pseudo_labels, temperature, reduction=reduction)
    if diversity_lambda > 0 and diversity is not None and has_diversity is not None:
        rows = has_diversity.nonzero().flatten()
        if rows.numel():
            term = distill_kl(student_logits[rows], diversity[rows], temperature, reduction="sum")
            loss = loss + diversity_lambda * term / student_logits.shape[0]
    return loss


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
    hard: bool = False,
    diversity: Tensor | None = None,
    has_diversity: Tensor | None = None,
    diversity_lambda: float = 0.0,
) -> float:
    """Adam on :func:`distillation_loss` of ``student(x_b)`` over ``epochs`` shuffled passes of
    ``x`` (a fresh optimizer every round); returns the mean loss of the last epoch (``nan``
    without steps)."""
    if epochs == 0 or x.shape[0] == 0:
        return math.nan
    g = torch.Generator(device="cpu").manual_seed(seed)
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    student.train()
    last = math.nan
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=g, device="cpu").to(x.device)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        count = 0
        for start in range(0, x.shape[0], batch_size):
            rows = order[start : start + batch_size]
            if rows.numel() == 1 and x.shape[0] > 1:
                continue  # a trailing single row (BatchNorm cannot train on it)
            loss = distillation_loss(
                student(x[rows]), pseudo_labels[rows], temperature=temperature,
                reduction=reduction, hard=hard,
                diversity=None if diversity is None else diversity[rows],
                has_diversity=None if has_diversity is None else has_diversity[rows],
                diversity_lambda=diversity_lambda,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm is not None:
                nn.utils.clip_grad_norm_(student.parameters(), max_grad_norm)
            opt.step()
            total += loss.detach().double() * rows.numel()
            count += rows.numel()
        last = total / max(count, 1)
    return float(last)  # one copy to the host


# ---------------------------------------------------------------- the strategies


class EnsembleDistillation(Strategy):
    """The shared round of the module docstring; subclasses set ``weighting``."""

    config_class = DistillationConfig
    weighting: ClassVar[str] = "uniform"
    runs_apart = True  # the fake data's source and the discriminators cross as tensors

    @property
    def uses_discriminators(self) -> bool:
        return self.weighting in ("fedgo", "domain")

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        cfg = self.config
        client_side = info.role == "client"  # the server's rows and generator come later
        if not client_side and (info.server_data is None or info.server_data.shape[0] == 0):
            raise ConfigError(
                f"{self.name} distils on the server's unlabeled data: set data.server_fraction "
                "(e.g. 0.5, the paper's half of every class)"
            )
        if info.model is None:
            raise ConfigError(f"{self.name} needs the model in SetupInfo")
        self.device = info.device
        self.model = copy.deepcopy(info.model)
        self.server_x = None if client_side else info.server_data
        d = info.num_features if client_side else self.server_x.shape[1]
        self.num_features = d
        self.conv_generator = cfg.generator_arch == "conv" or (
            cfg.generator_arch == "auto" and cfg.generator == "wgan_gp" and self._is_image(d))
        # The conv networks need an image shape: checked here, before anything is trained.
        self.image_shape = (
            resolve_image_shape(d, cfg.image_shape)
            if self.conv_generator or cfg.disc_arch != "mlp" else None
        )
        self.discriminators: dict[int, dict[str, Tensor]] = {}
        self.discriminator_wanted: set[int] = set()  # client side: asked for by the server
        self.generator_stats: dict[str, float] = {}
        self.generator = None
        if client_side:
            return
        # Generated rows lie in [0, 1] when U does (pixels), else anywhere.
        unit = bool(self.server_x.min() >= 0) and bool(self.server_x.max() <= 1)
        self.generator_output = "sigmoid" if unit else "linear"
        with seeding.torch_stream(info.seed, GENERATOR, device=self.device):
            self.generator = self.new_generator(self.generator_output)
            gen_seed = seeding.torch_seed(info.seed, GENERATOR)
            if self._load_generator():
                pass
            elif cfg.generator == "gan":
                train_gan(self.generator, self.server_x, steps=cfg.gan_steps,
                          noise_dim=cfg.noise_dim, seed=gen_seed)
            elif cfg.generator == "wgan_gp":
                with torch.device("cpu"):
                    critic = (DCGANDiscriminator(self.image_shape, cfg.generator_width)
                              if self.conv_generator else mlp(d, [64, 64], 1))
                critic.to(self.device)
                self.generator_stats = train_wgan_gp(
                    self.generator, critic, self.server_x, steps=cfg.gan_steps,
                    noise_dim=cfg.noise_dim, seed=gen_seed, n_critic=cfg.n_critic,
                    gp_weight=cfg.gp_weight)
            self.generator.eval()
            self.generator.requires_grad_(False)
            if cfg.generator_path and cfg.generator in ("gan", "wgan_gp"):
                self._save_generator()
            if cfg.distill_set == "generated":
                self.distill_x = self.generate(
                    cfg.num_generated, seeding.generator(info.seed, GENERATOR, 1))
            else:
                self.distill_x = self.server_x
        # Per-client discriminator logits on the distillation set (NaN: not trained yet).
        self.disc_scores = torch.full((info.num_clients, self.distill_x.shape[0]), math.nan,
                                      device=self.device)
        self.last_teachers: list[dict[str, Tensor]] = []
        self.last_participants: list[int] = []
        self.last_sizes: list[float] = []

    def new_generator(self, output: str) -> nn.Module:
        """The generator network, initialised on the CPU (torch's CPU generator, which the
        caller seeds: alike on every device) and moved to the run's device."""
        cfg = self.config
        with torch.device("cpu"):
            if self.conv_generator:
                generator = ConvGenerator(cfg.noise_dim, self.image_shape, cfg.generator_width,
                                          output)
            else:
                generator = MLPGenerator(cfg.noise_dim, self.num_features, [64, 64], output)
        return generator.to(self.device)

    def _generator_key(self) -> dict[str, Any]:
        """What a trained generator depends on: its settings, the seed and U."""
        cfg = self.config
        names = ("generator", "generator_arch", "generator_width", "noise_dim", "gan_steps",
                 "n_critic", "gp_weight", "image_shape")
        u = self.server_x.double().cpu()  # sums in the CPU's order: one key on every device
        return {**{n: getattr(cfg, n) for n in names}, "seed": self.info.seed,
                "server_rows": list(u.shape), "server_sum": float(u.sum()),
                "server_square_sum": float((u * u).sum())}

    def _load_generator(self) -> bool:
        """Loads ``generator_path`` (True) when it exists; refuses one trained differently."""
        path = self.config.generator_path
        if not path or self.config.generator not in ("gan", "wgan_gp") or not os.path.isfile(path):
            return False
        try:
            saved = torch.load(path, weights_only=True, map_location="cpu")
            key, state = saved["key"], saved["state"]
        except Exception as err:  # damaged or foreign file
            raise ConfigError(f"generator_path {path} is not a saved generator ({err})") from None
        want = self._generator_key()
        changed = sorted(k for k in set(key) | set(want) if key.get(k) != want.get(k))
        if changed:
            raise ConfigError(
                f"generator_path {path} holds a generator trained with other "
                f"{', '.join(changed)}; remove the file or choose another path"
            )
        self.generator.load_state_dict(state)
        self.generator_stats = dict(saved.get("stats", {}))
        return True

    def _save_generator(self) -> None:
        path = Path(self.config.generator_path)
        if path.is_file():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as partial:
            torch.save({"key": self._generator_key(), "state": self.generator.state_dict(),
                        "stats": self.generator_stats}, os.fspath(partial))

    def generate(self, n: int, g: torch.Generator) -> Tensor:
        """``n`` rows of the generator, its input drawn on the CPU from ``g``."""
        noise = torch.randn(n, self.config.noise_dim, generator=g, device="cpu")
        with torch.no_grad():
            return self.generator(noise.to(self.device))

    def fake_sampler(self) -> Callable[[int, torch.Generator], Tensor]:
        if self.config.generator == "server_data":
            u = self.server_x
            return lambda n, g: u[torch.randint(0, u.shape[0], (n,), generator=g,
                                                device="cpu").to(u.device)]
        return self.generate

    def _is_image(self, num_features: int) -> bool:
        if self.config.image_shape:
            return True
        side = math.isqrt(num_features)
        return side * side == num_features and side >= 4

    def new_discriminator(self) -> nn.Module:
        """A discriminator initialised on the CPU (from torch's CPU generator, which the
        caller seeds) and moved to the run's device."""
        cfg = self.config
        with torch.device("cpu"):
            if cfg.disc_arch == "mlp":
                disc = mlp(self.num_features, list(cfg.disc_hidden), 1)
            else:
                head = "conv" if cfg.disc_arch == "cnn" else "linear"
                disc = DCGANDiscriminator(self.image_shape, cfg.disc_width, head)
        return disc.to(self.device)

    # -- clients: the shared trainer for the classifier; the discriminator once per client.

    def train_client(self, global_state, data, round_index, client_id):
        if not self.uses_discriminators:
            return None
        if self.info.role == "client":
            wanted = client_id in self.discriminator_wanted
        else:
            wanted = client_id not in self.discriminators
        if wanted:
            cfg = self.config
            with seeding.torch_stream(self.info.seed, DISCRIMINATOR, client_id,
                                      device=self.device):
                disc = train_discriminator(
                    self.new_discriminator(), data.train_x, self.fake_sampler(),
                    epochs=cfg.disc_epochs, batch_size=cfg.disc_batch_size, lr=cfg.disc_lr,
                    seed=seeding.torch_seed(self.info.seed, DISCRIMINATOR, client_id),
                )
                if self.info.role == "client":  # the server scores it (reply_extras)
                    self.discriminators[client_id] = {
                        k: v.detach().clone() for k, v in disc.state_dict().items()}
                else:
                    self.add_discriminator(client_id, disc)
        return None  # the shared trainer trains the classifier

    def add_discriminator(self, client_id: int, disc: nn.Module) -> None:
        """Server side: client ``client_id``'s trained discriminator, its logits on the
        distillation set cached for the run."""
        with torch.no_grad():
            self.disc_scores[client_id] = disc(self.distill_x).squeeze(-1)
        self.discriminators[client_id] = {k: v.detach().clone() for k, v in disc.state_dict().items()}

    # -- clients apart: the server sends the fake data's source to a client without a
    # discriminator, the client sends its trained discriminator back.

    def client_payload(self, client_id: int, round_index: int) -> dict[str, Tensor]:
        if not self.uses_discriminators or client_id in self.discriminators:
            return {}
        if self.config.generator == "server_data":
            return {"server_rows": self.server_x}
        state = {f"generator.{k}": v for k, v in self.generator.state_dict().items()}
        sigmoid = self.generator_output == "sigmoid"
        return {**state, "generator_sigmoid": torch.tensor(sigmoid, device="cpu")}

    def receive_payload(self, client_id: int, payload: Mapping[str, Tensor]) -> None:
        if not payload:
            return
        if "server_rows" in payload:
            self.server_x = payload["server_rows"]
        else:
            output = "sigmoid" if bool(payload["generator_sigmoid"]) else "linear"
            with torch.random.fork_rng(devices=[]):  # its initialisation is overwritten
                generator = self.new_generator(output)
            generator.load_state_dict({k[len("generator."):]: v for k, v in payload.items()
                                       if k.startswith("generator.")})
            generator.eval()
            self.generator = generator.requires_grad_(False)
        self.discriminator_wanted.add(client_id)

    def reply_extras(self, client_id: int) -> dict[str, Tensor]:
        if client_id not in self.discriminator_wanted:
            return {}
        self.discriminator_wanted.discard(client_id)
        state = self.discriminators.pop(client_id)
        return {f"discriminator.{k}": v for k, v in state.items()}

    def receive_reply_extras(self, client_id: int, extras: Mapping[str, Tensor]) -> None:
        state = {k[len("discriminator."):]: v for k, v in extras.items()
                 if k.startswith("discriminator.")}
        if not state:
            if self.uses_discriminators and client_id not in self.discriminators:
                raise ValueError(f"{self.name}: client {client_id} sent no discriminator")
            return
        with torch.random.fork_rng(devices=[]):  # its initialisation is overwritten
            disc = self.new_discriminator()
        try:
            disc.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"{self.name}: client {client_id}'s discriminator does not fit: "
                             f"{' '.join(str(err).split())}") from None
        self.add_discriminator(client_id, disc)

    # -- server

    def pseudo_labels(self, logits: Tensor, participants: list[int], sizes: Tensor,
                      scores: Tensor | None) -> tuple[Tensor, Tensor]:
        cfg = self.config
        return ensemble_pseudo_labels(
            logits,
            scores if self.uses_discriminators else None,
            weighting=self.weighting,
            sample_sizes=sizes.tolist() if self.weighting == "fedgo" else None,
            combine=cfg.combine,
            temperature=cfg.temperature,
            tau=cfg.tau,
            odds=cfg.odds,
            return_weights=True,
        )

    def rounds_dependence(self, old_rounds: int, played: int) -> str | None:
        new = [self.server_lr(t) for t in range(played)]
        now = self.info.rounds
        try:
            self.info.rounds = old_rounds
            old = [self.server_lr(t) for t in range(played)]
        finally:
            self.info.rounds = now
        if old != new:
            return f"{self.name}.lr_schedule=cosine decays the server lr over all the rounds"
        return None

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
        diversity = has = None
        if cfg.diversity_lambda > 0:
            diversity, has = diversity_targets(logits, w, y.argmax(-1), combine=cfg.combine,
                                               temperature=cfg.temperature)
        student = self.model
        student.load_state_dict(server.state)
        with seeding.torch_stream(self.info.seed, DISTILL, info.round, device=self.device):
            loss = distill(
                student, self.distill_x, y, epochs=cfg.server_epochs,
                batch_size=cfg.server_batch_size, lr=self.server_lr(info.round),
                seed=seeding.torch_seed(self.info.seed, DISTILL, info.round),
                temperature=cfg.temperature, reduction=cfg.reduction,
                max_grad_norm=cfg.max_grad_norm, hard=cfg.consensus == "hard",
                diversity=diversity, has_diversity=has, diversity_lambda=cfg.diversity_lambda,
            )
        with torch.no_grad():
            for name, value in student.state_dict().items():
                server.state[name].copy_(value)
        self.last_teachers = [{k: v.clone() for k, v in s.items()} for s in info.client_states]
        self.last_participants = ids
        self.last_sizes = info.num_samples.tolist()
        extra = {"weight_max_mean": float(w.max(0).values.mean())}
        if cfg.server_epochs > 0 and self.distill_x.shape[0] > 0:
            extra["distill_loss"] = loss  # no distillation step (server_epochs=0): no loss
        if has is not None:
            extra["disagreeing_fraction"] = float(has.double().mean())
        return extra

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
        sizes = torch.tensor(self.last_sizes, dtype=torch.float64, device="cpu")
        labels, _ = self.pseudo_labels(logits, self.last_participants, sizes, scores)
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
        device = self.device
        self.disc_scores = state["disc_scores"].to(device, copy=True)
        self.discriminators = {int(k): {n: t.to(device) for n, t in v.items()}
                               for k, v in state["discriminators"].items()}
        self.last_teachers = [{n: t.to(device) for n, t in s.items()}
                              for s in state["last_teachers"]]
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
