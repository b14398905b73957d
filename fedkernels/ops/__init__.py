"""The native ops, one module per op family, each with its fake (``torch.compile``) and autograd
registrations, and the pure-PyTorch reference of every op (:mod:`.reference`).

Loading this package loads the native libraries (:mod:`.native`): the op schemas, the CPU
kernels built for this CPU's instruction set and, when built, the CUDA kernels. The ops never
fall back to the reference: without a build, the import fails with a message that says how to
build.
"""

from . import native

native.load()

# The modules below register fake and autograd implementations, so the schemas must exist first.
from . import (  # noqa: E402
    distill,
    mixing,
    mixing_sgd,
    output_pool,
    private,
    quantize,
    reference,
    robust,
    secagg,
    sgld,
    sparse,
    summation,
)
from .distill import distill_kl, ensemble_pseudo_labels  # noqa: E402
from .mixing import (  # noqa: E402
    cosine_orthogonality,
    mix_endpoints,
    mix_endpoints_with_stats,
    proximal_term,
    superfed_mix,
    superfed_regularizer,
    superfed_stats,
)
from .mixing_sgd import SuPerFedSGD, superfed_sgd_step_  # noqa: E402
from .output_pool import output_pool_stats, release_output_pool, set_output_pool_limit  # noqa: E402
from .private import private_sum, private_sum_, update_norms  # noqa: E402
from .quantize import (  # noqa: E402
    QuantizedTensors,
    aggregate_quantized,
    dequantize_fp8_weighted_sum,
    dequantize_int4_weighted_sum,
    dequantize_weighted_sum,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from .robust import (  # noqa: E402
    coordinate_median,
    median_window_mean,
    pairwise_sq_distances,
    trimmed_mean,
)
from .secagg import mask_seeds, secagg_decode, secagg_mask, secagg_unmask_sum  # noqa: E402
from .sgld import energy_from_logits, sgld_compose_step, sgld_step, sgld_step_  # noqa: E402
from .sparse import (  # noqa: E402
    SparseTensors,
    aggregate_sparse,
    aggregate_sparse_,
    sparse_weighted_sum,
    sparse_weighted_sum_,
    sparsify_topk,
)
from .summation import weighted_sum, weighted_sum_, weighted_sum_out  # noqa: E402

__all__ = [
    "native", "reference", "summation", "mixing", "distill", "sgld",
    "weighted_sum", "weighted_sum_out", "weighted_sum_",
    "mix_endpoints", "superfed_stats", "mix_endpoints_with_stats", "cosine_orthogonality",
    "proximal_term", "superfed_regularizer", "superfed_mix", "mixing_sgd", "SuPerFedSGD",
    "superfed_sgd_step_",
    "ensemble_pseudo_labels", "distill_kl",
    "energy_from_logits", "sgld_step", "sgld_step_", "sgld_compose_step",
    "robust", "private", "coordinate_median", "trimmed_mean", "median_window_mean",
    "pairwise_sq_distances", "update_norms", "private_sum", "private_sum_",
    "output_pool", "set_output_pool_limit", "release_output_pool", "output_pool_stats",
    "quantize", "QuantizedTensors", "quantize_int8", "dequantize_weighted_sum",
    "aggregate_quantized",
    "quantize_int4", "quantize_fp8", "dequantize_int4_weighted_sum", "dequantize_fp8_weighted_sum",
    # sparse updates
    "sparse", "SparseTensors", "sparsify_topk", "sparse_weighted_sum", "sparse_weighted_sum_",
    "aggregate_sparse", "aggregate_sparse_",
]
# Secure aggregation (ring masks).
__all__ += ["secagg", "secagg_mask", "secagg_unmask_sum", "secagg_decode", "mask_seeds"]
