"""Entry points into other FL frameworks and scale-out paths. Each submodule imports its
framework only when it is imported itself, so ``import fedkernels`` never needs them:

- :mod:`.flower`: drop-in strategies for Flower's Message API (``flwr.serverapp.strategy``);
- :mod:`.flower_legacy`: drop-ins for Flower's legacy API (``flwr.server.strategy``) and
  ``aggregate_ndarrays``/``aggregate_inplace`` (``pip install 'fedkernels[flower]'``);
- :mod:`.nvflare`: NVFlare's ``InTimeAccumulateWeightedAggregator`` and the FedAvg controller's
  aggregation (``pip install 'fedkernels[nvflare]'``);
- :mod:`.fedlab`: FedLab's ``Aggregators`` on serialized parameter vectors;
- :mod:`.fedml`: FedML's ``FedMLAggOperator.agg``, and ``install()`` into FedML's own class;
- :mod:`.distributed`: weighted aggregation across ``torch.distributed`` ranks;
- :mod:`.adapters`: conversions between modules, state_dicts, NumPy arrays and flat vectors.
"""
