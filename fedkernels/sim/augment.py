r"""Data augmentation of training minibatches of images (``client.augment``), as tensor ops on
the batch's own device.

``crop_flip`` is the CIFAR papers' pipeline (torchvision's ``RandomCrop(H, padding=4)`` then
``RandomHorizontalFlip()``, per image): the image is zero-padded by 4 pixels on every side and
an ``H x W`` window at a uniform offset :math:`(i, j) \in \{0, \dots, 8\}^2` is kept, then the
columns are reversed with probability 1/2. ``crop`` and ``flip`` are each step alone.

The offsets and coin flips are drawn on the CPU from torch's default generator, which the
trainers seed per client and round (:func:`fedkernels.sim.seeding.torch_stream`): a run draws
the same augmentations on any device and when resumed. Only the small index tensors move to
the batch's device; the crop and flip there are two ``gather`` calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import AUGMENTATIONS, ConfigError

CROP_PADDING = 4


def crop_flip_images(
    images: Tensor,
    *,
    crop: bool = True,
    flip: bool = True,
    padding: int = CROP_PADDING,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Randomly cropped (from the image zero-padded by ``padding``) and horizontally flipped
    copies of ``images`` ``[B, C, H, W]`` (module docstring), drawn from ``generator`` (torch's
    default CPU generator when ``None``)."""
    if images.dim() != 4:
        raise ValueError(f"crop_flip_images: images must be [B, C, H, W], got {tuple(images.shape)}")
    if padding < 0:
        raise ValueError(f"crop_flip_images: padding must be >= 0, got {padding}")
    b, c, h, w = images.shape
    device = images.device
    pad = padding if crop else 0
    host = torch.device("cpu")
    offsets = torch.randint(0, 2 * pad + 1, (b, 2), generator=generator, device=host) if crop \
        else torch.zeros(b, 2, dtype=torch.int64, device=host)
    mirrored = (torch.randint(0, 2, (b,), generator=generator, device=host) == 1) if flip else (
        torch.zeros(b, dtype=torch.bool, device=host))
    rows = offsets[:, :1] + torch.arange(h, device=host)  # [B, H]: rows of the padded image kept
    cols = offsets[:, 1:] + torch.arange(w, device=host)  # [B, W]
    cols = torch.where(mirrored[:, None], cols.flip(1), cols)  # a flip reads the columns backwards
    rows, cols = rows.to(device), cols.to(device)
    padded = F.pad(images, (pad, pad, pad, pad)) if pad else images
    picked = padded.gather(2, rows[:, None, :, None].expand(b, c, h, padded.shape[3]))
    return picked.gather(3, cols[:, None, None, :].expand(b, c, h, w))


class Augmentation:
    """``client.augment`` on rows ``[N, C*H*W]`` viewed as ``image_shape`` images."""

    def __init__(self, kind: str, image_shape: tuple[int, ...]) -> None:
        self.kind = kind
        self.image_shape = tuple(image_shape)

    def __call__(self, rows: Tensor) -> Tensor:
        images = rows.reshape(rows.shape[0], *self.image_shape)
        out = crop_flip_images(images, crop=self.kind in ("crop_flip", "crop"),
                               flip=self.kind in ("crop_flip", "flip"))
        return out.reshape(rows.shape)


def build_augmentation(kind: str, image_shape: tuple[int, ...] | None) -> Augmentation | None:
    """The augmentation ``client.augment`` names for rows of ``image_shape`` (``None`` for
    ``none``); ConfigError when the rows are not ``(channels, height, width)`` images."""
    if kind not in AUGMENTATIONS:
        raise ConfigError(f"client.augment must be one of {', '.join(AUGMENTATIONS)}, got {kind!r}")
    if kind == "none":
        return None
    if image_shape is None or len(image_shape) != 3:
        raise ConfigError(
            f"client.augment={kind} needs image data and a model that views rows as (channels, "
            f"height, width) images (cnn, twocnn, resnet18, ...), got "
            f"{'no image shape' if image_shape is None else f'the shape {tuple(image_shape)}'}"
        )
    return Augmentation(kind, image_shape)
