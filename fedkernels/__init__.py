"""fedkernels: fused aggregation ops for federated learning, as real torch ops.

>>> import fedkernels
>>> global_sd = fedkernels.aggregate([sd_a, sd_b, sd_c], [30, 50, 20], normalize=True)
"""

from . import _native

_native.load()

from . import ops, reference  # noqa: E402  (the ops must be registered first)
from .aggregate import Accumulator, aggregate  # noqa: E402
from .mixing import (  # noqa: E402,F401
    cosine_orthogonality, mix_endpoints, proximal_term, superfed_mix, superfed_regularizer,
)
from .distill import distill_kl, ensemble_pseudo_labels  # noqa: E402,F401
from .sgld import energy_from_logits, sgld_compose_step, sgld_step, sgld_step_  # noqa: E402,F401

__version__ = "0.1.0"
__all__ = ["aggregate", "Accumulator", "ops", "reference"]
