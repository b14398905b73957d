"""Data sets, partitions and per-client splits of fedkernels.sim."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import property_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from fedkernels.sim import seeding
from fedkernels.sim.config import ConfigError, DataConfig, PartitionConfig
from fedkernels.sim.data import (
    Dataset,
    gaussian_mixture,
    load_csv,
    load_dataset,
    load_digits,
    synthetic,
)
from fedkernels.sim.federation import build_federation, split_client
from fedkernels.sim.partition import dirichlet, iid, natural, partition, pathological


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n, "some samples are missing or shared"
    assert np.array_equal(np.sort(joined), np.arange(n)), "clients share samples or miss some"


def test_digits_is_the_real_bundled_data():
    d = load_digits()
    assert d.x.shape == (1797, 64) and d.num_classes == 10 and d.image_shape == (1, 8, 8)
    assert float(d.x.min()) == 0.0 and float(d.x.max()) == 1.0
    assert torch.bincount(d.y).min() >= 170


def test_synthetic_follows_the_fedprox_recipe():
    d = synthetic(1.0, 1.0, 12, np.random.default_rng(0), max_samples=300)
    sizes = np.bincount(d.groups)
    assert d.num_features == 60 and d.num_classes == 10 and len(sizes) == 12
    assert sizes.min() >= 50 and sizes.max() <= 300
    # Non-IID users have different label distributions; IID users share one model.
    iid_d = synthetic(0.0, 0.0, 12, np.random.default_rng(0), iid=True, max_samples=300)
    assert iid_d.groups is not None and iid_d.num_samples == iid_d.groups.size


def test_gaussian_mixture_is_separable_with_large_separation():
    d = gaussian_mixture(600, 5, 3, 8.0, np.random.default_rng(1))
    means = torch.stack([d.x[d.y == c].mean(0) for c in range(3)])
    nearest = torch.cdist(d.x, means).argmin(1)
    assert (nearest == d.y).double().mean() > 0.95


def test_load_dataset_is_seeded():
    cfg = DataConfig(name="gaussian_mixture", num_samples=50)
    a, b = load_dataset(cfg, 4, seed=3), load_dataset(cfg, 4, seed=3)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, load_dataset(cfg, 4, seed=4).x)


def test_csv_with_client_column(tmp_path):
    path = tmp_path / "data.csv"
    rows = ["f1,client,f2,label"] + [
        f"{i * 0.5},site{i % 3},{-i},{'cat' if i % 2 else 'dog'}" for i in range(12)
    ]
    path.write_text("\n".join(rows) + "\n")
    d = load_csv(path, "label", "client")
    assert d.x.shape == (12, 2) and d.num_classes == 2
    assert d.y.tolist() == [1 if i % 2 == 0 else 0 for i in range(12)]  # cat=0, dog=1
    parts = natural(d.groups)
    assert [p.tolist() for p in parts] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


@pytest.mark.parametrize(
    "content, message",
    [
        ("a,label\n1,0\n", "no column 'client'"),
        ("a,client,label\n1,1,0\nx,2,1\n2,1,1\n", "row 3: column 'a' value 'x' is not a number"),
        ("a,client,label\n", "at least one data row"),
    ],
)
def test_csv_errors_are_clear(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_csv(path)
    with pytest.raises(ConfigError, match="no such file"):
        load_csv(tmp_path / "missing.csv")


def test_from_tensors_images_and_checks():
    x = torch.rand(20, 1, 4, 4)
    d = Dataset.from_tensors(x, torch.arange(20) % 4, groups=torch.arange(20) % 5)
    assert d.image_shape == (1, 4, 4) and d.num_features == 16 and d.num_classes == 4
    with pytest.raises(ConfigError, match="labels must lie"):
        Dataset.from_tensors(torch.rand(3, 2), torch.tensor([0, 1, 5]), num_classes=3)
    with pytest.raises(ConfigError, match="non-finite"):
        Dataset.from_tensors(torch.tensor([[float("nan")]]), torch.tensor([0]))


# ---------------------------------------------------------------- partitions


@settings(max_examples=property_examples(40), deadline=None)
@given(
    n=st.integers(20, 400),
    clients=st.integers(1, 10),
    alpha=st.floats(0.05, 10.0),
    seed=st.integers(0, 2**31),
)
def test_partitions_are_disjoint_and_cover(n, clients, alpha, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 5, n)
    assert_disjoint_cover(iid(n, clients, rng), n)
    assert_disjoint_cover(dirichlet(labels, clients, alpha, rng, min_samples=0), n)
    classes = len(np.unique(labels))
    per_client = max(1, -(-classes // clients))
    if all(np.sum(labels == c) >= clients for c in np.unique(labels)):
        assert_disjoint_cover(pathological(labels, clients, per_client, rng), n)
    groups = rng.integers(0, clients, n)
    assert_disjoint_cover(natural(groups), n)


def test_dirichlet_skews_labels_and_respects_the_minimum():
    labels = load_digits().y.numpy()
    rng = np.random.default_rng(0)
    skewed = dirichlet(labels, 10, 0.1, rng, min_samples=20)
    flat = dirichlet(labels, 10, 100.0, rng, min_samples=20)
    assert min(len(p) for p in skewed) >= 20

    def label_entropy(parts):
        h = []
        for p in parts:
            q = np.bincount(labels[p], minlength=10) / len(p)
            h.append(-(q[q > 0] * np.log(q[q > 0])).sum())
        return np.mean(h)

    assert label_entropy(skewed) < 1.5 < 2.2 < label_entropy(flat)
    with pytest.raises(ConfigError, match="raise partition.alpha"):
        dirichlet(labels[:40], 10, 0.01, rng, min_samples=4)


def test_pathological_gives_exactly_n_classes():
    labels = load_digits().y.numpy()
    parts = pathological(labels, 10, 2, np.random.default_rng(0))
    assert [len(np.unique(labels[p])) for p in parts] == [2] * 10
    assert_disjoint_cover(parts, len(labels))
    with pytest.raises(ConfigError, match="cannot cover"):
        pathological(labels, 3, 2, np.random.default_rng(0))


def test_partition_dispatch_errors():
    labels = np.zeros(10, dtype=np.int64)
    with pytest.raises(ConfigError, match="needs a data set with its own clients"):
        partition(PartitionConfig(kind="natural"), labels, None, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="cannot give 10 clients"):
        partition(
            PartitionConfig(num_clients=10, min_samples=2), labels, None, np.random.default_rng(0)
        )


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "pathological"])
def test_federation_clients_never_share_a_sample(kind):
    data = load_digits()
    fed = build_federation(
        data, PartitionConfig(kind=kind, num_clients=15, alpha=0.3), 0.25, seed=5
    )
    rows = [np.concatenate([c.train_index, c.test_index]) for c in fed.clients]
    assert_disjoint_cover(rows, data.num_samples)
    for c in fed.clients:
        assert c.num_train >= 1 and c.num_test >= 1
        assert not set(c.train_index) & set(c.test_index)
        assert torch.equal(c.train_x, data.x[torch.from_numpy(c.train_index)])
        assert torch.equal(c.test_y, data.y[torch.from_numpy(c.test_index)])
    again = build_federation(
        data, PartitionConfig(kind=kind, num_clients=15, alpha=0.3), 0.25, seed=5
    )
    assert all(
        np.array_equal(a.test_index, b.test_index) for a, b in zip(fed.clients, again.clients)
    )


def test_split_is_seeded_per_client():
    rows = np.arange(100, 150)
    train, test = split_client(rows, 0.2, seeding.numpy_rng(0, seeding.SPLIT, 3))
    assert len(test) == 10 and len(train) == 40
    assert np.array_equal(np.sort(np.concatenate([train, test])), rows)
    train2, _ = split_client(rows, 0.2, seeding.numpy_rng(0, seeding.SPLIT, 3))
    assert np.array_equal(train, train2)
    assert split_client(np.array([7, 9]), 0.01, np.random.default_rng(0))[1].size == 1


# ---------------------------------------------------------------- BatchNorm and one-row batches


def test_batch_norm_model_trains_on_a_batch_of_one_row():
    # A client may hold a single training row: the MLP's BatchNorm normalises such a batch
    # with its running statistics (PyTorch's BatchNorm1d raises on it).
    from fedkernels.sim.models import MLP, RowBatchNorm

    torch.manual_seed(0)
    model = MLP(4, [8], 3, batch_norm=True)
    norm = next(m for m in model.modules() if isinstance(m, RowBatchNorm))
    norm.running_mean.uniform_()
    norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(1, 4)
    model.train()
    one_row = model(x)
    model.eval()
    torch.testing.assert_close(one_row, model(x))
    model.train()
    before = norm.running_mean.clone()
    batch = torch.randn(5, 4)
    reference = torch.nn.BatchNorm1d(8)
    reference.load_state_dict(norm.state_dict())
    hidden = model.layers[0](batch)
    torch.testing.assert_close(norm(hidden), reference(hidden))
    assert not torch.equal(norm.running_mean, before)  # larger batches: BatchNorm1d's own


def test_batch_norm_needs_batches_of_two_rows():
    from fedkernels.sim import ExperimentConfig
    from fedkernels.sim.config import ClientConfig, ModelConfig

    with pytest.raises(ConfigError, match="model.batch_norm needs client.batch_size >= 2"):
        ExperimentConfig(model=ModelConfig(batch_norm=True), client=ClientConfig(batch_size=1))
