"""fedkernels: fused aggregation ops for federated learning, as real torch ops.

>>> import fedkernels
>>> global_sd = fedkernels.aggregate([sd_a, sd_b, sd_c], [30, 50, 20], normalize=True)

The layers, bottom up: :mod:`fedkernels.ops` (the native ops and their reference), the public
APIs :mod:`fedkernels.aggregate` (with :mod:`fedkernels.checkpoint_files` for checkpoints held
as files), :mod:`fedkernels.robust` and :mod:`fedkernels.privacy`,
:mod:`fedkernels.rules` (weight rules and server optimizers), :mod:`fedkernels.sim` (the
simulation loop), :mod:`fedkernels.algorithms` (strategies on that loop), and the entry points
:mod:`fedkernels.cli` and :mod:`fedkernels.integrations`. This module only re-exports the
public names of the two lowest layers, plus :func:`check` (the installation self-check), which
is imported on first use: ``import fedkernels`` stays light.
"""

# ruff: noqa: F401  (the imports of _load are its re-exports, bound through locals())

import importlib
import os
import sys


def _started_by_the_command() -> bool:
    """Whether this process is the ``fedkernels`` console script (or ``python -m
    fedkernels.cli``). It imports what each command
    needs itself, so ``import fedkernels`` there leaves torch and the ops until first use:
    ``fedkernels --help`` and ``--version`` answer without torch's seconds of import."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    if os.path.basename(script) in ("fedkernels", "fedkernels.exe", "fedkernels-script.py"):
        return True
    argv = getattr(sys, "orig_argv", [])  # python -m fedkernels.cli, the same command
    return any(a == "-m" and b in ("fedkernels.cli", "fedkernels.cli.__main__")
               for a, b in zip(argv, argv[1:]))


def _load() -> None:
    """The public names of the two lowest layers (importing them registers the torch ops)."""
    from .aggregate import Accumulator, aggregate
    from .checkpoint_files import aggregate_files
    from .ops import native, reference
    from .ops.distill import distill_kl, ensemble_pseudo_labels
    from .ops.mixing import (
        cosine_orthogonality,
        mix_endpoints,
        proximal_term,
        superfed_mix,
        superfed_regularizer,
    )
    from .ops.mixing_sgd import SuPerFedSGD
    from .ops.output_pool import output_pool_stats, release_output_pool, set_output_pool_limit
    from .ops.quantize import (
        QuantizedTensors,
        aggregate_quantized,
        quantize_fp8,
        quantize_int4,
        quantize_int8,
    )
    from .ops.sgld import energy_from_logits, sgld_compose_step, sgld_step, sgld_step_
    from .ops.sparse import SparseTensors, aggregate_sparse, aggregate_sparse_, sparsify_topk
    from .privacy.mechanism import (
        adaptive_clip_norm,
        adaptive_noise_params,
        private_aggregate,
        update_norms,
    )
    from .robust import (
        bulyan,
        coordinate_median,
        krum,
        nearest_to_median_mean,
        pairwise_sq_distances,
        trimmed_mean,
    )
    globals().update({k: v for k, v in locals().items() if k in __all__})


__version__ = "0.1.0"
__all__ = [
    "aggregate", "Accumulator", "aggregate_files", "ops", "reference", "native",
    "mix_endpoints", "cosine_orthogonality", "proximal_term", "superfed_mix",
    "superfed_regularizer", "SuPerFedSGD", "ensemble_pseudo_labels", "distill_kl", "energy_from_logits",
    "sgld_step", "sgld_step_", "sgld_compose_step", "check",
    "coordinate_median", "trimmed_mean", "pairwise_sq_distances", "krum", "bulyan",
    "nearest_to_median_mean",
    "set_output_pool_limit", "release_output_pool", "output_pool_stats",
    "update_norms", "private_aggregate", "adaptive_clip_norm", "adaptive_noise_params",
    "quantize_int8", "aggregate_quantized", "QuantizedTensors",
    "quantize_int4", "quantize_fp8",
    # sparse updates
    "sparsify_topk", "aggregate_sparse", "aggregate_sparse_", "SparseTensors",
]

# Loaded on first use: the self-check is large and rarely needed, and fedkernels.private is the
# deprecated former path of fedkernels.privacy.mechanism (left out of dir(): it warns).
_LAZY_MODULES = ("selfcheck", "private")


_LOADED = False


def _ensure_loaded() -> None:
    """Loads the public names now (the console script calls it before any command that
    computes, so that a plugin's ``fedkernels.aggregate(...)`` finds the function)."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        _load()


if not _started_by_the_command():
    _ensure_loaded()


def __getattr__(name: str):
    if name in __all__ and not _LOADED:  # the console script: loaded on first use
        _ensure_loaded()
        if name in globals():
            return globals()[name]
    if name == "check":
        return importlib.import_module(".selfcheck", __name__).check
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"check", "selfcheck"})
