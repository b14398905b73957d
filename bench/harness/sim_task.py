"""The federated task that bench_simulation.py gives every method: MNIST-1D split IID among
100 clients, an MLP 40-64-10 or the MNIST-1D CNN, plain local SGD. Built with fedkernels' own
builders and cached per process, so that a Flower Ray actor builds it once, as Flower's examples
keep their data in a module global.
"""

from __future__ import annotations

import functools

MODELS = {"mlp": "MLP 40-64-10", "cnn": "MNIST-1D CNN (3 conv1d, 25 channels)"}
NUM_CLIENTS = 100
LR = 0.05
BATCH = 32
SEED = 0


@functools.cache
def build_task(model_name: str, num_samples: int):
    """The federation and the initial model that every method trains (fedkernels' builders,
    the same seeds as ``fedkernels run``)."""
    from fedkernels.sim.config import DataConfig, PartitionConfig
    from fedkernels.sim.data import load_dataset
    from fedkernels.sim.federation import build_federation
    from fedkernels.sim.models import build_model

    dataset = load_dataset(DataConfig(name="mnist1d", num_samples=num_samples), NUM_CLIENTS,
                           SEED)
    fed = build_federation(dataset, PartitionConfig(kind="iid", num_clients=NUM_CLIENTS), 0.2,
                           SEED)
    model = build_model(model_config(model_name), fed.num_features, fed.num_classes,
                        fed.image_shape, SEED, vocab_size=fed.vocab_size)
    return fed, model


def model_config(name: str):
    from fedkernels.sim.config import ModelConfig

    if name == "mlp":
        return ModelConfig(name="mlp", hidden=[64])
    return ModelConfig(name="mnist1d_cnn")


def model_flags(name: str) -> list[str]:
    return ["--model.name", "mlp", "--model.hidden", "64"] if name == "mlp" else [
        "--model.name", "mnist1d_cnn"]


def pooled_accuracy(model, fed) -> float:
    import torch

    x = torch.cat([c.test_x for c in fed.clients])
    y = torch.cat([c.test_y for c in fed.clients])
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def local_sgd(model, x, y, epochs: int, generator) -> None:
    """Plain local training: ``epochs`` shuffled passes of SGD, batch 32, cross-entropy."""
    import torch
    import torch.nn.functional as F

    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    n = len(y)
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, BATCH):
            rows = order[start:start + BATCH]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()




@functools.cache
def generator(seed: int):
    """One shuffling stream per client (per seed) in this process."""
    import torch

    return torch.Generator().manual_seed(SEED + seed % 2**31)
