r"""FedEvg: federated energy-based averaging (equations, defaults and the thesis-versus-code
differences: ``docs/algorithms/fedevg.md``).

The server keeps a balanced synthetic set :math:`\hat x` (``spc`` samples per class, fixed
labels :math:`\hat y`, initialised from N(0, I)). Each round:

1. every participant re-initialises an energy model / classifier f (a SiLU MLP with spectral
   norm on its last layer, or with ``energy_model=resnet10`` the official code's ResNet-10;
   :math:`E(x, y) = -f(x)[y]`), trains it on its real data plus persistent
   SGLD chains started from the downloaded :math:`\hat x` (loss
   :math:`L = \overline{E(x, y)} - \overline{E(\hat x', \hat y)} + CE(f(x), y)
   + \lambda CE(f(\hat x), \hat y)`,
   one SGLD step per minibatch with :func:`fedkernels.sgld_step`), and uploads, on the downloaded
   :math:`\hat x`, the clipped energy gradients :math:`g_{kj}` and energies :math:`E_{kj}`;
2. the server composes them with :func:`fedkernels.sgld_compose_step` (the thesis' eq. 4.14):
   :math:`\pi_{kj} = \mathrm{softmax}_k(\log w_k + \mathrm{sgn}(-E_{kj}))`, :math:`w_k \propto n_k`,
   :math:`\hat x_j \leftarrow
   \mathrm{clamp}(\hat x_j - \beta^{(t)} \sum_k \pi_{kj} g_{kj} + \delta\varepsilon)`,
   with the cosine schedule :math:`\beta^{(t)}` from ``server_beta`` to ``server_beta_last``;
3. a fresh copy of the run's model is trained on :math:`(\hat x, \hat y)` only and becomes the
   global model, so the simulation's test accuracy is the paper's metric (that classifier on
   every client's held-out split).

Constants: ``constants="paper"`` (default) takes the thesis' values (β_last = 0.01, δ = 0.01);
``constants="code"`` the official scripts' (β_last = 1, δ = 1e-4). The gradient clip τ = 3 and the
[0, 1] clamp exist only in the code; they are on by default (``grad_clip``, ``clamp``) because
the sampler diverges without them; set ``clamp=false`` for unbounded data.

Each round also logs diagnostics of the synthetic set (:func:`synthetic_set_diagnostics`: the
energy gap between the clients' real data and the synthetic set, the server step against the
noise, movement, saturation and within-class spread). ``fedcvae`` (:class:`FedCVAE`) is the
thesis' federated generative baseline with the same synthetic-set classifier: a conditional VAE
trained by the clients and averaged by the server, whose decoder draws the synthetic set.
"""

from __future__ import annotations

import copy
import math
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedkernels.aggregate import aggregate as aggregate_models
from fedkernels.ops.sgld import energy_from_logits, sgld_compose_step, sgld_step
from fedkernels.sim import seeding
from fedkernels.sim.client import ClientUpdate
from fedkernels.sim.config import ConfigError
from fedkernels.sim.models.energy import FedEvgResNet10
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import RoundInfo, SetupInfo, Strategy

from .generators import ConditionalVAE, resolve_image_shape
from .registry import register

# Random streams of their own (beside those of fedkernels.sim.seeding).
SYNTH_INIT = 121  # (seed, SYNTH_INIT): the initial synthetic set
CLIENT = 122  # (seed, CLIENT, round, client): energy-model init, minibatches, SGLD noise
SERVER = 123  # (seed, SERVER, round): the server's SGLD noise in the round
EVAL = 124  # (seed, EVAL, round): the synthetic-set classifier's init and minibatches

CONSTANTS = {"paper": dict(server_beta_last=0.01, server_sigma=0.01),
             "code": dict(server_beta_last=1.0, server_sigma=1e-4)}


@dataclass
class FedEvgConfig:
    constants: Literal["paper", "code"] = field(
        default="paper", metadata={"help": "beta_last/delta of the thesis (0.01/0.01) or code (1/1e-4)"})
    spc: int = field(default=10, metadata={"help": "synthetic samples per class (M = L * spc)"})
    server_beta: float = field(default=10.0, metadata={"help": "beta^(0) of the server step"})
    server_beta_last: float | None = field(
        default=None, metadata={"help": "beta^(T-1) (default: from constants)"})
    server_sigma: float | None = field(
        default=None, metadata={"help": "delta, server SGLD noise (default: from constants)"})
    mode: Literal["signed", "exact"] = field(
        default="signed", metadata={"help": "client weights softmax(log w + sgn(-E)) or (log w - E)"})
    grad_clip: float | None = field(default=3.0, metadata={"help": "tau, elementwise energy-grad clip"})
    clamp: bool = field(default=True, metadata={"help": "clamp samples to [0, 1] (image data)"})
    client_step: float = field(default=1.0, metadata={"help": "gamma, client SGLD step"})
    client_sigma: float = field(default=0.01, metadata={"help": "sigma, client SGLD noise"})
    sgld_steps: int = field(default=1, metadata={"help": "R, client SGLD steps per minibatch"})
    ce_lambda: float = field(default=0.1, metadata={"help": "lambda, CE weight on synthetic data"})
    lr: float = field(default=1e-3, metadata={"help": "client Adam learning rate"})
    lr_decay: float = field(default=0.9, metadata={"help": "lr factor every lr_decay_step rounds"})
    lr_decay_step: int = field(default=50, metadata={"help": "rounds between lr decays"})
    weight_decay: float = field(default=1e-4, metadata={"help": "client Adam weight decay"})
    local_epochs: int = field(default=1, metadata={"help": "E, local epochs"})
    batch_size: int = field(default=64, metadata={"help": "B, local minibatch size"})
    energy_model: Literal["mlp", "resnet10"] = field(
        default="mlp", metadata={"help": "the clients' energy model: SiLU MLP (hidden) or the "
                                         "official code's ResNet-10 (image data)"})
    hidden: list[int] = field(default_factory=lambda: [128, 128],
                              metadata={"help": "energy-model MLP hidden widths"})
    server_epochs: int = field(default=1, metadata={"help": "epochs of the synthetic-set classifier"})
    server_lr: float = field(default=1e-3, metadata={"help": "Adam lr of the synthetic-set classifier"})
    server_batch_size: int = field(default=64, metadata={"help": "its minibatch size"})
    classify_every: int = field(
        default=1, metadata={"help": "train the synthetic-set classifier (the global model) every "
                                     "this many rounds and after the last (set it to eval_every)"})
    image_path: str = field(default="", metadata={"help": "write the synthetic set as a PNG grid here"})
    image_shape: list[int] = field(default_factory=list,
                                   metadata={"help": "H W of one image (default: square)"})

    def __post_init__(self) -> None:
        if self.spc < 1 or self.sgld_steps < 1 or self.local_epochs < 1 or self.batch_size < 1:
            raise ConfigError("fedevg: spc, sgld_steps, local_epochs and batch_size must be >= 1")
        if self.server_epochs < 0 or self.lr <= 0 or self.server_lr <= 0:
            raise ConfigError("fedevg: server_epochs >= 0 and learning rates > 0")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError("fedevg: grad_clip must be > 0 (or None)")
        if self.classify_every < 1:
            raise ConfigError("fedevg: classify_every must be >= 1")
        if self.energy_model != "mlp" and self.hidden != [128, 128]:
            raise ConfigError("fedevg: hidden is the MLP energy model's; energy_model=resnet10 "
                              "has fixed widths")
        c = CONSTANTS[self.constants]
        if self.server_beta_last is None:
            self.server_beta_last = c["server_beta_last"]
        if self.server_sigma is None:
            self.server_sigma = c["server_sigma"]


def cosine_beta_schedule(beta_first: float, beta_last: float, rounds: int, s: float = 0.008) -> Tensor:
    r"""The cosine schedule of improved DDPM, mapped onto [beta_last, beta_first]:
    :math:`\bar\alpha_t = \cos^2(((t/T)+s)/(1+s)\,\pi/2)/\cos^2(s/(1+s)\,\pi/2)`,
    :math:`b_t = 1 - \bar\alpha_{t+1}/\bar\alpha_t`,
    :math:`\beta^{(t)} = b_t(\beta_{last} - \beta_0) + \beta_0`."""
    t = torch.arange(rounds + 1, dtype=torch.float64, device="cpu")
    f = torch.cos(((t / rounds) + s) / (1 + s) * math.pi / 2) ** 2
    abar = f / f[0]
    b = 1 - abar[1:] / abar[:-1]
    return b * (beta_last - beta_first) + beta_first


class EnergyMLP(nn.Module):
    """SiLU MLP with spectral norm on the last layer (the official ResNet-10's stabilisers, at
    MLP scale)."""

    def __init__(self, num_features: int, hidden: list[int], num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.SiLU()]
            width = h
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)
        self.classifier = nn.utils.parametrizations.spectral_norm(self.classifier)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.body(x))


def energy_grad(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``(dE/dx, E)`` of :math:`E(x, y) = -f(x)[y]` per sample (the sum's gradient is per-sample
    since samples do not interact)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        e = energy_from_logits(model(x), y)
        (g,) = torch.autograd.grad(e.sum(), x)
    return g, e.detach()


def write_png_grid(path: str | Path, images: Tensor, rows: int) -> None:
    """Grey images ``[N, H, W]`` in [0, 1] as one PNG grid (``rows`` rows, 1-pixel gaps)."""
    images = images.cpu()
    n, h, w = images.shape
    cols = max(1, math.ceil(n / rows))
    grid = torch.ones(rows * (h + 1) + 1, cols * (w + 1) + 1, device="cpu")
    for i in range(n):
        r, c = divmod(i, cols)
        grid[1 + r * (h + 1): 1 + r * (h + 1) + h, 1 + c * (w + 1): 1 + c * (w + 1) + w] = images[i]
    scale = max(1, 384 // max(grid.shape))
    grid = grid.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    pix = (grid.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    raw = b"".join(b"\x00" + row.tobytes() for row in pix)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", pix.shape[1], pix.shape[0], 8, 0, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(png)


def classify_now(round_index: int, rounds: int, every: int) -> bool:
    """Whether round ``round_index`` (0-based) trains the synthetic-set classifier: every
    ``every`` rounds and the last."""
    return (round_index + 1) % every == 0 or round_index + 1 >= rounds


def train_on_synthetic(
    classifier: nn.Module, template: nn.Module, x: Tensor, y: Tensor, *, epochs: int, lr: float,
    batch_size: int, seed: int, round_index: int,
) -> float:
    """A fresh initialisation of ``template`` trained with Adam(``lr``) and cross-entropy for
    ``epochs`` shuffled passes over ``(x, y)``, from the ``(seed, EVAL, round)`` stream; its
    weights are loaded into ``classifier``. Returns the last minibatch loss. The
    initialisation and the minibatch orders are drawn on the CPU (the same on every device);
    the training runs on the device of ``x``."""
    device = x.device
    with seeding.torch_stream(seed, EVAL, round_index, device=device):
        model = copy.deepcopy(template).to("cpu")
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        model.to(device)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        M = len(y)
        last = None
        model.train()
        for _ in range(epochs):
            order = torch.randperm(M, device="cpu").to(device)
            for start in range(0, M, batch_size):
                i = order[start: start + batch_size]
                out = F.cross_entropy(model(x[i]), y[i])
                opt.zero_grad(set_to_none=True)
                out.backward()
                opt.step()
                last = out.detach()
    classifier.load_state_dict(model.state_dict())
    return float("nan") if last is None else float(last)


def save_synthetic_images(path: str, x: Tensor, image_shape: list[int], rows: int) -> None:
    """The synthetic rows as a PNG grid, one row of images per class (nothing when the rows are
    not square or ``image_shape`` [H, W] images)."""
    d = x.shape[1]
    if image_shape:
        h, w = image_shape
    else:
        h = w = int(round(math.sqrt(d)))
    if h * w != d:
        return  # not images
    write_png_grid(path, x.reshape(-1, h, w), rows=rows)


@torch.no_grad()
def synthetic_set_diagnostics(
    before: Tensor, after: Tensor, labels: Tensor, step: Tensor, noise_std: float, clamp: bool
) -> dict[str, float]:
    r"""What one server step did to the synthetic set (docs/fedevg.md, "Why the accuracy stops
    rising"): ``step_abs`` the mean :math:`|\beta_t a_j|` per value before the clamp,
    ``noise_std`` δ, ``moved_abs`` the mean :math:`|\hat x' - \hat x|` after it,
    ``changed_fraction`` the share of values that moved by more than 1e-3, ``saturated_fraction``
    the share at a bound of [0, 1] (with the clamp), and ``within_class_distance`` the mean
    Euclidean distance between two samples of the same class (0 when each class has collapsed
    onto one point)."""
    x = after.flatten(1).double()
    moved = (after - before).abs().flatten(1).double()
    spreads = []
    for c in labels.unique():
        rows = x[labels == c]
        if len(rows) > 1:
            d = torch.cdist(rows, rows)
            spreads.append(d.sum() / (len(rows) * (len(rows) - 1)))
    out = {
        "step_abs": float(step.abs().double().mean()),
        "noise_std": float(noise_std),
        "moved_abs": float(moved.mean()),
        "changed_fraction": float((moved > 1e-3).double().mean()),
        "within_class_distance": float(torch.stack(spreads).mean()) if spreads else 0.0,
    }
    if clamp:
        out["saturated_fraction"] = float(((x <= 0) | (x >= 1)).double().mean())
    return out


def _untrained_classifier_caveat(server_epochs: int, what: str) -> list[str]:
    """With no server epochs the global model is never trained: say so in the results."""
    if server_epochs > 0:
        return []
    return [f"server_epochs = 0: the global model (the classifier trained on {what}) was never "
            "trained, so its accuracies are those of an untrained model"]


@register
class FedEvg(Strategy):
    """The round of the module docstring."""

    name = "fedevg"
    config_class = FedEvgConfig
    supports_central_dp = False  # the server combines energy models its own way
    replies_are_models = False  # a client replies with its energy model
    runs_apart = True  # the synthetic set through client_payload, nothing kept

    def rounds_dependence(self, old_rounds: int, played: int) -> str | None:
        cfg = self.config
        old = cosine_beta_schedule(cfg.server_beta, cfg.server_beta_last, max(old_rounds, 1))
        if not torch.equal(old[:played], self.betas[:played]):
            return "the server's beta follows a cosine schedule over all the rounds"
        return None

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        if info.model is None:
            raise ConfigError("fedevg needs the model in SetupInfo")
        self.classifier = copy.deepcopy(info.model)
        cfg = self.config
        self.betas = cosine_beta_schedule(cfg.server_beta, cfg.server_beta_last, max(info.rounds, 1))
        L = info.num_classes
        self.device = info.device
        self.synth_y = torch.arange(L, device=self.device).repeat_interleave(cfg.spc)
        self.synth_x: Tensor | None = None  # [M, D], created when D is known (first client)

    def _ensure_synthetic(self, num_features: int) -> None:
        if self.synth_x is None:  # drawn on the CPU: the same start on every device
            g = seeding.generator(self.info.seed, SYNTH_INIT)
            x = torch.randn(len(self.synth_y), num_features, generator=g, device="cpu")
            self.synth_x = x.to(self.device)

    def client_lr(self, round_index: int) -> float:
        cfg = self.config
        return cfg.lr * cfg.lr_decay ** ((round_index + 1) // cfg.lr_decay_step)

    # -- clients apart: the server sends the synthetic set, a client replies with its energy
    # gradients and energies on it (train_client's state)

    def client_payload(self, client_id: int, round_index: int) -> dict[str, Tensor]:
        self._ensure_synthetic(self.info.num_features)
        return {"synthetic_x": self.synth_x}

    def receive_payload(self, client_id: int, payload: Mapping[str, Tensor]) -> None:
        x = payload["synthetic_x"]
        if x.shape != (len(self.synth_y), self.info.num_features):
            raise ValueError(f"fedevg: the synthetic set has shape {tuple(x.shape)}, expected "
                             f"({len(self.synth_y)}, {self.info.num_features})")
        self.synth_x = x.to(self.device, copy=True)

    def reply_template(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        m, d = len(self.synth_y), self.info.num_features
        return {"energy_grad": ((m, d), torch.float32), "energy": ((m,), torch.float32),
                "energy_real_mean": ((), torch.float32),
                "energy_synthetic_mean": ((), torch.float32)}

    def new_energy_model(self, num_features: int) -> nn.Module:
        """A freshly initialised energy model (``energy_model``) for rows of ``num_features``;
        the ResNet-10 views them as the run's model does, else as ``image_shape``."""
        cfg = self.config
        if cfg.energy_model == "resnet10":
            shape = getattr(self.info.model, "image_shape", None)
            if shape is None or len(shape) != 3:
                shape = resolve_image_shape(num_features, cfg.image_shape)
            return FedEvgResNet10(shape, self.info.num_classes)
        return EnergyMLP(num_features, cfg.hidden, self.info.num_classes)

    # -- clients: local training, then the upload

    def train_client(self, global_state, data, round_index, client_id):
        cfg = self.config
        self._ensure_synthetic(data.train_x.shape[1])
        x_init = self.synth_x.clone()
        y_hat = self.synth_y
        M = len(y_hat)
        clamp = (0.0, 1.0) if cfg.clamp else None
        seed = seeding.torch_seed(self.info.seed, CLIENT, round_index, client_id)
        device = self.device
        gen = torch.Generator(device="cpu").manual_seed(seed)  # minibatches (alike everywhere)
        # the SGLD noise: from gen on the CPU, from a generator of the device (same seed) else
        noise_gen = gen if device.type == "cpu" else torch.Generator(device).manual_seed(seed)
        with seeding.torch_stream(self.info.seed, CLIENT, round_index, client_id), \
                torch.device("cpu"):
            model = self.new_energy_model(data.train_x.shape[1])
        model.to(device)
        opt = torch.optim.Adam(model.parameters(), lr=self.client_lr(round_index),
                               betas=(0.5, 0.999), weight_decay=cfg.weight_decay)
        buf = x_init.clone()
        n = data.train_x.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        steps = 0
        for _ in range(cfg.local_epochs):
            order = torch.randperm(n, generator=gen, device="cpu").to(device)
            for start in range(0, n, cfg.batch_size):
                idx_real = order[start: start + cfg.batch_size]
                x, y = data.train_x[idx_real], data.train_y[idx_real]
                b = min(len(idx_real), M)
                idx = torch.randperm(M, generator=gen, device="cpu")[:b].to(device)
                z, zy = buf[idx], y_hat[idx]
                model.eval()
                for r in range(cfg.sgld_steps):
                    g, _ = energy_grad(model, z, zy)
                    last = r + 1 == cfg.sgld_steps
                    z = sgld_step(z, g, step_size=cfg.client_step, noise_std=cfg.client_sigma,
                                  grad_clip=cfg.grad_clip, clamp=clamp if last else None,
                                  generator=noise_gen)
                buf[idx] = z
                model.train()
                e_real = energy_from_logits(logits_real := model(x), y)
                e_fake = energy_from_logits(model(z), zy)
                loss = (e_real.mean() - e_fake.mean() + F.cross_entropy(logits_real, y)
                        + cfg.ce_lambda * F.cross_entropy(model(x_init[idx]), zy))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += loss.detach()
                steps += 1
        model.eval()
        g, e = energy_grad(model, x_init, y_hat)
        if cfg.grad_clip is not None:
            g = g.clamp(-cfg.grad_clip, cfg.grad_clip)
        with torch.no_grad():  # diagnostics: the trained model's energy of its real data
            e_real = energy_from_logits(model(data.train_x), data.train_y).mean()
        mean_loss = float(loss_sum) / max(steps, 1)  # one copy to the host
        return ClientUpdate(
            state={"energy_grad": g, "energy": e, "energy_real_mean": e_real,
                   "energy_synthetic_mean": e.mean()},
            train_loss=mean_loss,
        )

    # -- server: the composed SGLD step (eq. 4.14), then the synthetic-set classifier

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        cfg = self.config
        grads = torch.stack([s["energy_grad"] for s in info.client_states])
        energies = torch.stack([s["energy"] for s in info.client_states])
        log_w = torch.log(info.num_samples / info.num_samples.sum()).float()  # host-side
        beta = float(self.betas[min(info.round, len(self.betas) - 1)])
        before = self.synth_x.clone()
        _, pi = sgld_compose_step(
            self.synth_x, grads, energies, log_w, mode=cfg.mode, step_size=beta,
            noise_std=cfg.server_sigma, grad_clip=cfg.grad_clip,
            clamp=(0.0, 1.0) if cfg.clamp else None,
            generator=seeding.generator(self.info.seed, SERVER, info.round, device=self.device),
            inplace=True, return_weights=True,
        )
        extra: dict[str, float] = {}
        if classify_now(info.round, self.info.rounds, cfg.classify_every):
            loss = self.train_synthetic_classifier(info.round)
            if cfg.server_epochs > 0:  # no step (server_epochs=0): no loss to report
                extra["synthetic_ce"] = loss
            with torch.no_grad():
                for name, value in self.classifier.state_dict().items():
                    server.state[name].copy_(value)
        if cfg.image_path and (info.round + 1 == self.info.rounds or (info.round + 1) % 10 == 0):
            self.save_images(cfg.image_path)
        g_used = grads if cfg.grad_clip is None else grads.clamp(-cfg.grad_clip, cfg.grad_clip)
        drift = (pi[:, :, None].to(g_used.dtype) * g_used.flatten(2)).sum(0)  # a_j of eq. 4.14
        return {
            **extra, "beta": beta, "pi_max_mean": float(pi.max(0).values.mean()),
            "client_lr": self.client_lr(info.round),
            **synthetic_set_diagnostics(before, self.synth_x, self.synth_y, beta * drift,
                                        cfg.server_sigma, cfg.clamp),
            "energy_gap": float(torch.stack([
                s["energy_synthetic_mean"] - s["energy_real_mean"] for s in info.client_states
            ]).mean()),
        }

    def train_synthetic_classifier(self, round_index: int) -> float:
        """A fresh copy of the run's model trained on the synthetic set only."""
        cfg = self.config
        return train_on_synthetic(
            self.classifier, self.info.model, self.synth_x, self.synth_y, epochs=cfg.server_epochs,
            lr=cfg.server_lr, batch_size=cfg.server_batch_size, seed=self.info.seed,
            round_index=round_index)

    def save_images(self, path: str) -> None:
        save_synthetic_images(path, self.synth_x, self.config.image_shape, self.info.num_classes)

    def result_caveats(self) -> list[str]:
        return _untrained_classifier_caveat(self.config.server_epochs, "the synthetic set")

    def state_dict(self) -> dict[str, Any]:
        return {"synth_x": None if self.synth_x is None else self.synth_x.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["synth_x"]
        self.synth_x = None if saved is None else saved.to(self.device, copy=True)


# ---------------------------------------------------------------- the FedCVAE baseline

CVAE_INIT = 125  # (seed, CVAE_INIT): the global CVAE's initialisation
CVAE_CLIENT = 126  # (seed, CVAE_CLIENT, round, client): minibatches and reparameterisation noise
CVAE_SAMPLE = 127  # (seed, CVAE_SAMPLE, round): the latent draws of the synthetic set


@dataclass
class FedCVAEConfig:
    spc: int = field(default=10, metadata={"help": "synthetic samples per class (M = L * spc)"})
    latent_dim: int = field(default=8, metadata={"help": "CVAE latent dimension"})
    hidden: list[int] = field(default_factory=lambda: [128, 128],
                              metadata={"help": "encoder widths (the decoder mirrors them)"})
    output: Literal["sigmoid", "linear"] = field(
        default="sigmoid", metadata={"help": "decoder output: sigmoid for pixels in [0, 1]"})
    share: Literal["all", "decoder"] = field(
        default="all", metadata={"help": "average the whole CVAE, or only the decoders "
                                         "(encoders stay with their clients)"})
    lr: float = field(default=1e-3, metadata={"help": "client Adam learning rate"})
    lr_decay: float = field(default=0.9, metadata={"help": "lr factor every lr_decay_step rounds"})
    lr_decay_step: int = field(default=5, metadata={"help": "rounds between lr decays"})
    weight_decay: float = field(default=1e-4, metadata={"help": "client Adam weight decay"})
    local_epochs: int = field(default=1, metadata={"help": "local epochs"})
    batch_size: int = field(default=64, metadata={"help": "local minibatch size"})
    server_epochs: int = field(default=1, metadata={"help": "epochs of the synthetic-set classifier"})
    server_lr: float = field(default=1e-3, metadata={"help": "Adam lr of the synthetic-set classifier"})
    server_batch_size: int = field(default=64, metadata={"help": "its minibatch size"})
    classify_every: int = field(
        default=1, metadata={"help": "train the synthetic-set classifier (the global model) every "
                                     "this many rounds and after the last (set it to eval_every)"})
    image_path: str = field(default="", metadata={"help": "write the synthetic set as a PNG grid here"})
    image_shape: list[int] = field(default_factory=list,
                                   metadata={"help": "H W of one image (default: square)"})

    def __post_init__(self) -> None:
        if min(self.spc, self.latent_dim, self.local_epochs, self.batch_size,
               self.lr_decay_step, self.server_batch_size) < 1:
            raise ConfigError("fedcvae: spc, latent_dim, local_epochs, batch sizes and "
                              "lr_decay_step must be >= 1")
        if not self.hidden or min(self.hidden) < 1:
            raise ConfigError("fedcvae: hidden needs at least one width >= 1")
        if self.server_epochs < 0 or self.lr <= 0 or self.server_lr <= 0:
            raise ConfigError("fedcvae: server_epochs >= 0 and learning rates > 0")
        if not 0 < self.lr_decay <= 1 or self.weight_decay < 0:
            raise ConfigError("fedcvae: lr_decay in (0, 1] and weight_decay >= 0")
        if self.classify_every < 1:
            raise ConfigError("fedcvae: classify_every must be >= 1")


@register
class FedCVAE(Strategy):
    """Federated conditional VAE, the generative baseline of FedEvg's evaluation: every
    participant trains the global CVAE on its data for ``local_epochs`` (Adam, summed squared
    error plus KL), the server averages the CVAEs (``share=all``) or only their decoders
    (``share=decoder``; each client keeps its encoder) with weights n_k / sum n, decodes a
    balanced synthetic set of ``spc`` samples per class from z ~ N(0, I), and trains a fresh
    copy of the run's model on it, exactly as FedEvg's server does; that classifier is the
    global model."""

    name = "fedcvae"
    config_class = FedCVAEConfig
    supports_central_dp = False  # the server averages CVAEs, not the global model
    replies_are_models = False  # a client replies with its CVAE

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        if info.model is None:
            raise ConfigError("fedcvae needs the model in SetupInfo")
        self.classifier = copy.deepcopy(info.model)
        self.device = info.device
        self.synth_y = torch.arange(info.num_classes, device=self.device).repeat_interleave(
            self.config.spc)
        self.synth_x: Tensor | None = None
        self.global_cvae: dict[str, Tensor] | None = None  # built when D is known
        self.encoders: dict[int, dict[str, Tensor]] = {}

    def new_cvae(self, num_features: int) -> ConditionalVAE:
        """A CVAE initialised on the CPU (torch's CPU generator) and moved to the run's
        device."""
        cfg = self.config
        with torch.device("cpu"):
            cvae = ConditionalVAE(num_features, self.info.num_classes, cfg.hidden,
                                  cfg.latent_dim, cfg.output)
        return cvae.to(self.device)

    def _ensure_cvae(self, num_features: int) -> None:
        if self.global_cvae is None:
            with seeding.torch_stream(self.info.seed, CVAE_INIT):
                cvae = self.new_cvae(num_features)
            self.global_cvae = {k: v.detach().clone() for k, v in cvae.state_dict().items()}
            self.num_features = num_features

    def client_lr(self, round_index: int) -> float:
        cfg = self.config
        return cfg.lr * cfg.lr_decay ** ((round_index + 1) // cfg.lr_decay_step)

    def train_client(self, global_state, data, round_index, client_id):
        cfg = self.config
        self._ensure_cvae(data.train_x.shape[1])
        cvae = self.new_cvae(self.num_features)
        cvae.load_state_dict(self.global_cvae)
        if cfg.share == "decoder" and client_id in self.encoders:
            cvae.encoder.load_state_dict(self.encoders[client_id])
        # minibatches and reparameterisation noise, drawn on the CPU (alike on every device)
        gen = seeding.generator(self.info.seed, CVAE_CLIENT, round_index, client_id)
        opt = torch.optim.Adam(cvae.parameters(), lr=self.client_lr(round_index),
                               weight_decay=cfg.weight_decay)
        n = data.train_x.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        steps = 0
        cvae.train()
        for _ in range(cfg.local_epochs):
            order = torch.randperm(n, generator=gen, device="cpu").to(self.device)
            for start in range(0, n, cfg.batch_size):
                rows = order[start: start + cfg.batch_size]
                loss = cvae.loss(data.train_x[rows], data.train_y[rows], gen)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += loss.detach()
                steps += 1
        state = {k: v.detach().clone() for k, v in cvae.state_dict().items()}
        return ClientUpdate(state=state, train_loss=float(loss_sum) / max(steps, 1))

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        cfg = self.config
        shared = [k for k in self.global_cvae
                  if cfg.share == "all" or k.startswith("decoder.")]
        averaged = aggregate_models([{k: s[k] for k in shared} for s in info.client_states],
                             info.num_samples, normalize=True)
        self.global_cvae.update({k: v.clone() for k, v in averaged.items()})
        if cfg.share == "decoder":
            for k, s in zip(info.participants.tolist(), info.client_states):
                self.encoders[k] = {name[len("encoder."):]: v for name, v in s.items()
                                    if name.startswith("encoder.")}
        cvae = self.new_cvae(self.num_features)
        cvae.load_state_dict(self.global_cvae)
        cvae.eval()
        g = seeding.generator(self.info.seed, CVAE_SAMPLE, info.round)
        before = self.synth_x if self.synth_x is not None else torch.zeros(
            len(self.synth_y), self.num_features, device=self.device)
        self.synth_x = cvae.sample(self.synth_y, g)
        extra: dict[str, float] = {}
        if classify_now(info.round, self.info.rounds, cfg.classify_every):
            loss = train_on_synthetic(
                self.classifier, self.info.model, self.synth_x, self.synth_y,
                epochs=cfg.server_epochs, lr=cfg.server_lr, batch_size=cfg.server_batch_size,
                seed=self.info.seed, round_index=info.round)
            if cfg.server_epochs > 0:  # no step (server_epochs=0): no loss to report
                extra["synthetic_ce"] = loss
            with torch.no_grad():
                for name, value in self.classifier.state_dict().items():
                    server.state[name].copy_(value)
        if cfg.image_path and (info.round + 1 == self.info.rounds or (info.round + 1) % 10 == 0):
            save_synthetic_images(cfg.image_path, self.synth_x, cfg.image_shape,
                                  self.info.num_classes)
        diag = synthetic_set_diagnostics(before, self.synth_x, self.synth_y,
                                         torch.zeros((), device="cpu"), 0.0, False)
        return {**extra, "client_lr": self.client_lr(info.round),
                "within_class_distance": diag["within_class_distance"]}

    def result_caveats(self) -> list[str]:
        return _untrained_classifier_caveat(self.config.server_epochs, "the decoder's samples")

    def state_dict(self) -> dict[str, Any]:
        return {"global_cvae": self.global_cvae,
                "encoders": {str(k): v for k, v in self.encoders.items()},
                "synth_x": None if self.synth_x is None else self.synth_x.clone(),
                "num_features": getattr(self, "num_features", 0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.device
        cvae = state["global_cvae"]
        self.global_cvae = None if cvae is None else {k: v.to(device) for k, v in cvae.items()}
        self.encoders = {int(k): {n: t.to(device) for n, t in v.items()}
                         for k, v in state["encoders"].items()}
        saved = state["synth_x"]
        self.synth_x = None if saved is None else saved.to(device, copy=True)
        if state["num_features"]:
            self.num_features = int(state["num_features"])
