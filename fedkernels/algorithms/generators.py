r"""Generative models and discriminators shared by the data-centric algorithms: the server
generator and client discriminators of FedGO (``distillation.py``), and the conditional VAE of
the FedCVAE baseline of FedEvg (``fedevg.py``). Equations and sources:
``docs/algorithms/distillation.md`` (section 5) and ``docs/algorithms/fedevg.md`` (section 11).

- :class:`DCGANDiscriminator`: the small convolutional discriminator of the FedGO paper (the
  DCGAN discriminator without biases or BatchNorm: k4 s2 p1 convolutions with LeakyReLU 0.2,
  then one convolution to a single logit), scaled to the image size; also its "CNN+MLP"
  variant (two convolutions and a bias-free linear head). On 3x32x32 images with width 64 they
  have the paper's 662,528 and 142,336 parameters.
- :class:`ConvGenerator`: a DCGAN-style generator (linear layer to a small feature map, then
  k4 s2 p1 transposed convolutions with BatchNorm and ReLU).
- :func:`gradient_penalty` and :func:`train_wgan_gp`: WGAN-GP (Gulrajani et al. 2017),
  :math:`\min_G\max_D\ \mathbb E[D(x)] - \mathbb E[D(G(z))]
  - \lambda\,\mathbb E[(\lVert\nabla_{\hat x} D(\hat x)\rVert_2 - 1)^2]` with
  :math:`\hat x = \epsilon x + (1-\epsilon) G(z)`, :math:`\epsilon \sim U(0, 1)` per sample;
  ``n_critic`` critic steps per generator step, Adam(2e-4, betas (0, 0.9)).
- :class:`ConditionalVAE`: an MLP conditional VAE (encoder :math:`q(z \mid x, y)`, decoder
  :math:`p(x \mid z, y)`) with the loss :math:`\lVert x - \hat x\rVert^2 + \mathrm{KL}(q \,\|\, N(0, I))`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedkernels.sim.config import ConfigError


def mlp(num_in: int, hidden: Sequence[int], num_out: int) -> nn.Sequential:
    """Linear layers with LeakyReLU 0.2 between them."""
    layers: list[nn.Module] = []
    width = num_in
    for h in hidden:
        layers += [nn.Linear(width, h), nn.LeakyReLU(0.2)]
        width = h
    layers.append(nn.Linear(width, num_out))
    return nn.Sequential(*layers)


def resolve_image_shape(num_features: int, image_shape: Sequence[int] = ()) -> tuple[int, int, int]:
    """``(channels, height, width)`` of rows with ``num_features`` values: ``image_shape`` when
    given as ``[C, H, W]`` or ``[H, W]`` (one channel), else a square grey image. Raises
    :class:`ConfigError` when the shape does not fit."""
    shape = tuple(int(s) for s in image_shape)
    if not shape:
        side = math.isqrt(num_features)
        if side * side != num_features:
            raise ConfigError(
                f"{num_features} features are not a square image: give image_shape as C,H,W"
            )
        shape = (1, side, side)
    elif len(shape) == 2:
        shape = (1, *shape)
    if len(shape) != 3 or min(shape) < 1 or math.prod(shape) != num_features:
        raise ConfigError(
            f"image_shape {list(image_shape)} does not describe rows of {num_features} features"
        )
    return shape  # type: ignore[return-value]


def downsampling_layers(height: int, width: int, most: int = 3) -> int:
    """How many k4 s2 p1 layers the image takes: halve while both sides stay even and at least
    2 after halving, at most ``most`` times (32x32 -> 3, leaving 4x4; 8x8 -> 2, leaving 2x2)."""
    n = 0
    while n < most and height % 2 == 0 and width % 2 == 0 and height >= 4 and width >= 4:
        height, width, n = height // 2, width // 2, n + 1
    return n


class DCGANDiscriminator(nn.Module):
    """The FedGO paper's discriminator (module docstring). Rows ``[B, C*H*W]`` (or images) in,
    logits ``[B, 1]`` out. ``head="conv"``: ``n`` stride-2 convolutions of widths
    ``width * 2**i``, then a convolution whose kernel covers the remaining map; ``head="linear"``
    (the paper's "CNN+MLP"): the first ``min(2, n)`` convolutions, then a bias-free linear
    layer."""

    def __init__(
        self, image_shape: Sequence[int], width: int = 64, head: str = "conv"
    ) -> None:
        super().__init__()
        if head not in ("conv", "linear"):
            raise ConfigError(f"discriminator head must be conv or linear, not {head!r}")
        c, h, w = (int(s) for s in image_shape)
        self.image_shape = (c, h, w)
        n = downsampling_layers(h, w)
        if n == 0:
            raise ConfigError(f"a convolutional discriminator needs images of at least 4x4, got {h}x{w}")
        if head == "linear":
            n = min(n, 2)
        layers: list[nn.Module] = []
        channels = c
        for i in range(n):
            layers += [
                nn.Conv2d(channels, width * 2**i, 4, 2, 1, bias=False),
                nn.LeakyReLU(0.2),
            ]
            channels = width * 2**i
        h, w = h // 2**n, w // 2**n
        if head == "conv":
            layers += [nn.Conv2d(channels, 1, (h, w), 1, 0, bias=False), nn.Flatten()]
        else:
            layers += [nn.Flatten(), nn.Linear(channels * h * w, 1, bias=False)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x.reshape(x.shape[0], *self.image_shape))


class ConvGenerator(nn.Module):
    """DCGAN-style generator: noise ``[B, noise_dim]`` -> rows ``[B, C*H*W]``. A linear layer
    to a ``(width * 2**(n-1), H/2**n, W/2**n)`` map, then ``n`` k4 s2 p1 transposed
    convolutions (BatchNorm and ReLU between them) halving the width each time, and
    ``output`` (``sigmoid`` for data in [0, 1], ``tanh`` for [-1, 1], or ``linear``)."""

    def __init__(
        self, noise_dim: int, image_shape: Sequence[int], width: int = 64, output: str = "sigmoid"
    ) -> None:
        super().__init__()
        c, h, w = (int(s) for s in image_shape)
        n = downsampling_layers(h, w)
        if n == 0:
            raise ConfigError(f"a convolutional generator needs images of at least 4x4, got {h}x{w}")
        self.num_features = c * h * w
        self.start = (width * 2 ** (n - 1), h // 2**n, w // 2**n)
        self.project = nn.Sequential(
            nn.Linear(noise_dim, math.prod(self.start)), nn.BatchNorm1d(math.prod(self.start)),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        channels = self.start[0]
        for i in range(n - 1, -1, -1):
            out = c if i == 0 else width * 2 ** (i - 1)
            layers.append(nn.ConvTranspose2d(channels, out, 4, 2, 1))
            if i > 0:
                layers += [nn.BatchNorm2d(out), nn.ReLU()]
            channels = out
        self.layers = nn.Sequential(*layers)
        self.output = output_activation(output)

    def forward(self, z: Tensor) -> Tensor:
        x = self.layers(self.project(z).view(z.shape[0], *self.start))
        return self.output(x.flatten(1))


class MLPGenerator(nn.Module):
    """Noise -> rows through an MLP (LeakyReLU 0.2), then ``output`` as in
    :class:`ConvGenerator`."""

    def __init__(
        self, noise_dim: int, num_features: int, hidden: Sequence[int] = (64, 64),
        output: str = "linear",
    ) -> None:
        super().__init__()
        self.body = mlp(noise_dim, hidden, num_features)
        self.output = output_activation(output)

    def forward(self, z: Tensor) -> Tensor:
        return self.output(self.body(z))


def output_activation(name: str) -> nn.Module:
    if name == "sigmoid":
        return nn.Sigmoid()
    if name == "tanh":
        return nn.Tanh()
    if name == "linear":
        return nn.Identity()
    raise ConfigError(f"generator output must be sigmoid, tanh or linear, not {name!r}")


def gradient_penalty(critic: nn.Module, real: Tensor, fake: Tensor, mix: Tensor) -> Tensor:
    r""":math:`\frac1B\sum_i (\lVert\nabla_{\hat x} D(\hat x_i)\rVert_2 - 1)^2` at
    :math:`\hat x_i = m_i x_i + (1 - m_i)\tilde x_i` (``mix``: ``[B]`` in [0, 1]). Differentiable
    in the critic's parameters (``create_graph``), as WGAN-GP needs."""
    if real.shape != fake.shape or mix.shape != real.shape[:1]:
        raise ValueError(
            f"gradient_penalty: real {tuple(real.shape)}, fake {tuple(fake.shape)} and mix "
            f"{tuple(mix.shape)} do not match ([B, ...], [B, ...], [B])"
        )
    m = mix.reshape(-1, *([1] * (real.dim() - 1)))
    x = (m * real + (1 - m) * fake).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    return ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()


def train_wgan_gp(
    generator: nn.Module,
    critic: nn.Module,
    data: Tensor,
    *,
    steps: int,
    noise_dim: int,
    seed: int,
    n_critic: int = 5,
    gp_weight: float = 10.0,
    lr: float = 2e-4,
    betas: tuple[float, float] = (0.0, 0.9),
    batch_size: int = 64,
) -> dict[str, float]:
    """WGAN-GP on ``data`` (module docstring): ``steps`` generator steps, each after
    ``n_critic`` critic steps on fresh real and generated minibatches of ``batch_size``.
    Returns the last critic loss, generator loss and Wasserstein estimate
    E[D(x)] - E[D(G(z))]; the generator is left in eval mode. Both networks must be on the
    device of ``data``; the random draws are made on the CPU from ``seed``."""
    if steps < 0 or n_critic < 1 or gp_weight < 0 or batch_size < 1:
        raise ValueError("train_wgan_gp: steps >= 0, n_critic >= 1, gp_weight >= 0, batch_size >= 1")
    stats = {"critic_loss": math.nan, "generator_loss": math.nan, "wasserstein": math.nan}
    g = torch.Generator(device="cpu").manual_seed(seed)
    opt_g = torch.optim.Adam(generator.parameters(), lr=lr, betas=betas)
    opt_d = torch.optim.Adam(critic.parameters(), lr=lr, betas=betas)
    generator.train()
    n, device = data.shape[0], data.device

    def draw(sample: Tensor) -> Tensor:  # drawn on the CPU: the same draws on every device
        return sample.to(device)

    for _ in range(steps):
        for _ in range(n_critic):
            real = data[draw(torch.randint(0, n, (batch_size,), generator=g, device="cpu"))]
            with torch.no_grad():
                fake = generator(draw(torch.randn(batch_size, noise_dim, generator=g,
                                                  device="cpu")))
            d_real, d_fake = critic(real).mean(), critic(fake).mean()
            mix = draw(torch.rand(batch_size, generator=g, device="cpu"))
            gp = gradient_penalty(critic, real, fake, mix)
            d_loss = d_fake - d_real + gp_weight * gp
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            opt_d.step()
        g_loss = -critic(generator(draw(torch.randn(batch_size, noise_dim, generator=g,
                                                    device="cpu")))).mean()
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
        last = (d_loss, g_loss, d_real - d_fake)
    if steps:  # one copy to the host at the end
        values = torch.stack([t.detach() for t in last]).tolist()
        stats = dict(zip(("critic_loss", "generator_loss", "wasserstein"), values))
    generator.eval()
    return stats


class ConditionalVAE(nn.Module):
    """MLP conditional VAE: encoder ``[x, onehot(y)] -> (mu, log_var)`` of a ``latent_dim``
    Gaussian, decoder ``[z, onehot(y)] -> x`` with ``output`` as in :class:`ConvGenerator`."""

    def __init__(
        self, num_features: int, num_classes: int, hidden: Sequence[int] = (128,),
        latent_dim: int = 8, output: str = "sigmoid",
    ) -> None:
        super().__init__()
        self.num_classes, self.latent_dim = num_classes, latent_dim
        self.encoder = mlp(num_features + num_classes, hidden, 2 * latent_dim)
        self.decoder = nn.Sequential(
            mlp(latent_dim + num_classes, list(hidden)[::-1], num_features), output_activation(output)
        )

    def decode(self, z: Tensor, y: Tensor) -> Tensor:
        return self.decoder(torch.cat([z, F.one_hot(y, self.num_classes).to(z.dtype)], 1))

    def loss(self, x: Tensor, y: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Mean over the batch of the summed squared reconstruction error plus
        KL(N(mu, sigma^2) || N(0, I)), with one reparameterised draw per sample."""
        h = self.encoder(torch.cat([x, F.one_hot(y, self.num_classes).to(x.dtype)], 1))
        mu, log_var = h.chunk(2, dim=1)
        # drawn on the CPU (``generator`` is a CPU generator): the same on every device
        eps = torch.randn(mu.shape, generator=generator, dtype=mu.dtype,
                          device="cpu").to(mu.device)
        recon = self.decode(mu + torch.exp(0.5 * log_var) * eps, y)
        rec = ((recon - x) ** 2).sum(1)
        kl = 0.5 * (mu**2 + log_var.exp() - 1 - log_var).sum(1)
        return (rec + kl).mean()

    @torch.no_grad()
    def sample(self, y: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One decoded sample per label of ``y``, from z ~ N(0, I) drawn on the CPU from
        ``generator`` (a CPU generator)."""
        z = torch.randn(len(y), self.latent_dim, generator=generator, device="cpu")
        return self.decode(z.to(y.device), y)
