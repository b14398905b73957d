"""The former path of :mod:`fedkernels.privacy.mechanism` (clipped, noised aggregation),
kept so that ``fedkernels.private.private_aggregate`` and its siblings still import."""

from .privacy.mechanism import (
    adaptive_clip_norm,
    adaptive_noise_params,
    clip_factors,
    private_aggregate,
    update_norms,
)

__all__ = ["update_norms", "clip_factors", "private_aggregate", "adaptive_clip_norm",
           "adaptive_noise_params"]
