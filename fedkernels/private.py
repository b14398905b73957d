"""The former path of :mod:`fedkernels.privacy.mechanism` (clipped, noised aggregation),
kept so that ``fedkernels.private.private_aggregate`` and its siblings still import; deprecated."""

import warnings

from .privacy.mechanism import (
    adaptive_clip_norm,
    adaptive_noise_params,
    clip_factors,
    private_aggregate,
    update_norms,
)

__all__ = ["update_norms", "clip_factors", "private_aggregate", "adaptive_clip_norm",
           "adaptive_noise_params"]

warnings.warn(f"{__name__} is deprecated and will be removed in fedkernels 0.2: "
              "import from fedkernels.privacy.mechanism", DeprecationWarning, stacklevel=2)
