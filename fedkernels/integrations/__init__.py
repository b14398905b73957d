"""Entry points into other FL frameworks and scale-out paths. Each submodule imports its
framework only when it is imported itself, so ``import fedkernels`` never needs them:

- :mod:`.flower`: Flower strategies (``pip install 'fedkernels[flower]'``): drop-ins for the
  Message API (``flwr.serverapp.strategy``) and the legacy API (``flwr.server.strategy``),
  robust and DP variants, and fedkernels' own weighting strategies (``flower_robust``,
  ``flower_legacy`` and ``flower_legacy_robust`` are their former import paths);
- :mod:`.nvflare`: NVFlare's ``InTimeAccumulateWeightedAggregator`` and the FedAvg controller's
  aggregation (``pip install 'fedkernels[nvflare]'``);
- :mod:`.fedlab`: FedLab's ``Aggregators`` on serialized parameter vectors;
- :mod:`.fedml`: FedML's ``FedMLAggOperator.agg``, and ``install()`` into FedML's own class;
- :mod:`.distributed`: weighted aggregation across ``torch.distributed`` ranks;
- :mod:`.adapters`: conversions between modules, state_dicts, NumPy arrays and flat vectors.

No integration imports the simulator (:mod:`fedkernels.sim`) or the algorithms: what they
share with it lives in :mod:`fedkernels.rules`.
"""
