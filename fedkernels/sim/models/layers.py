"""Pieces the paper models share: how a model views its input rows, its normalisation layer,
and the initialisations the papers' code uses."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from ..config import ConfigError

NormFactory = Callable[[int], nn.Module]


def image_view(model: str, image_shape: tuple[int, ...] | None) -> tuple[int, int, int]:
    """``(channels, height, width)`` of the rows ``model`` reads; ConfigError for other data."""
    if image_shape is None or len(image_shape) != 3:
        raise ConfigError(
            f"model.name={model} needs image data, rows with a (channels, height, width) shape "
            f"(e.g. digits, mnist, cifar10), got {'no image shape' if image_shape is None else image_shape}"
        )
    return tuple(int(s) for s in image_shape)  # type: ignore[return-value]


def require_side(model: str, image_shape: tuple[int, ...], height: int, width: int) -> None:
    """ConfigError when the image is too small for ``model``'s down-sampling."""
    if height < 1 or width < 1:
        raise ConfigError(
            f"model.name={model}: images of {image_shape} are too small for its down-sampling"
        )


def norm_factory(model: str, kind: str, groups: int, channels: Iterable[int]) -> NormFactory:
    """A 2-D normalisation layer per channel count: BatchNorm, GroupNorm with ``groups``
    groups (which must divide every count in ``channels``), or none."""
    if kind == "batch":
        return nn.BatchNorm2d
    if kind == "group":
        bad = sorted({c for c in channels if c % groups})
        if bad:
            raise ConfigError(
                f"model.groups={groups} must divide the channels of every normalised layer of "
                f"{model} (not {', '.join(map(str, bad))})"
            )
        return lambda c: nn.GroupNorm(groups, c)
    if kind == "none":
        return lambda c: nn.Identity()
    raise ConfigError(f"model.norm must be batch, group or none, got {kind!r}")


def _weighted(model: nn.Module) -> Iterable[nn.Module]:
    return (m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)))


def init_xavier_normal(model: nn.Module) -> None:
    """Xavier-normal weights and zero biases in every conv and linear layer (the
    initialisation of SuPerFed's and FedEvg's code)."""
    for m in _weighted(model):
        nn.init.xavier_normal_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def init_kaiming_fan_out(model: nn.Module) -> None:
    """He-normal conv weights over the fan-out, zero conv biases (torchvision's ResNet and the
    VGG code FedGO cites); linear layers and norms keep PyTorch's defaults."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
