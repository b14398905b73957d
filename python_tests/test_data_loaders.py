"""The publishers' data sets (fedkernels.sim.datasets), on tiny files in their exact formats.

For each format: the files a publisher ships (and torchvision's folders), loaded and compared
with what was written (shapes, labels, value ranges, the publisher's train/test split, natural
clients), and damaged files that must give a one-line ConfigError naming the file.
"""

from __future__ import annotations

import gzip
import json
import pickle
import random
import sys
import types

import numpy as np
import pytest
import torch

from fedkernels.sim.config import ConfigError, DataConfig, ExperimentConfig, PartitionConfig, from_dict
from fedkernels.sim.data import load_dataset
from fedkernels.sim.dataset import Dataset
from fedkernels.sim.datasets.leaf import LEAF_CHARACTERS
from fedkernels.sim.datasets.tiny_files import (
    CIFAR10_NAMES,
    IMAGES_MAGIC,
    LABELS_MAGIC,
    femnist_user,
    idx_bytes,
    shakespeare_user,
    write_cifar10,
    write_cifar100,
    write_cinic10,
    write_file,
    write_images,
    write_leaf,
    write_mnist,
    write_pickle,
    write_svhn,
    write_tiny_imagenet,
)
from fedkernels.sim.federation import build_federation


def load(name: str, root, **options) -> Dataset:
    return load_dataset(DataConfig(name=name, root=str(root), **options), 3, 0)


def one_line_error(name: str, root, fragment: str, **options) -> str:
    """Loading fails with a ConfigError of one line holding ``fragment`` (a file name), with
    no chained exception to print."""
    with pytest.raises(ConfigError) as caught:
        load(name, root, **options)
    message = str(caught.value)
    assert "\n" not in message, message
    assert fragment in message, message
    err = caught.value
    assert err.__cause__ is None and (err.__suppress_context__ or err.__context__ is None), \
        "the error chains another exception, which a traceback would print"
    return message


def assert_pixels(d: Dataset, shape: tuple[int, ...], num_classes: int) -> None:
    assert d.x.dtype == torch.uint8 and d.input_kind == "pixels"
    assert d.image_shape == shape and d.num_features == int(np.prod(shape))
    assert d.num_classes == num_classes
    rows = d.rows(torch.arange(d.num_samples))
    assert rows.dtype == torch.float32 and 0.0 <= float(rows.min()) and float(rows.max()) <= 1.0
    assert torch.equal(rows, d.x.float() / 255)


# ---------------------------------------------------------------- MNIST, Fashion-MNIST, EMNIST

@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("layout", ["root", "torchvision"])
def test_mnist_reads_idx_files_gzipped_or_not_in_both_layouts(tmp_path, gz, layout):
    folder = tmp_path if layout == "root" else tmp_path / "MNIST" / "raw"
    written = write_mnist(folder, gz=gz)
    d = load("mnist", tmp_path)
    assert d.num_samples == 50 and d.name == "mnist"
    assert_pixels(d, (1, 28, 28), 10)
    train_images, train_labels = written["train"]
    test_images, test_labels = written["test"]
    assert np.array_equal(d.x[:30].numpy(), train_images.reshape(30, -1))
    assert np.array_equal(d.x[30:].numpy(), test_images.reshape(20, -1))
    assert np.array_equal(d.y.numpy(), np.concatenate([train_labels, test_labels]))
    assert d.official_test is not None and d.official_test.sum() == 20
    assert not d.official_test[:30].any() and d.official_test[30:].all()
    assert d.info["parts"] == {"train": 30, "test": 20} and d.info["classes"][9] == "9"


def test_fashion_mnist_reads_torchvision_folder(tmp_path):
    write_mnist(tmp_path / "FashionMNIST" / "raw", gz=False, seed=3)
    d = load("fashion_mnist", tmp_path)
    assert_pixels(d, (1, 28, 28), 10)
    assert d.info["classes"][0] == "T-shirt/top" and d.info["classes"][9] == "Ankle boot"
    # an MNIST folder beside it is not Fashion-MNIST's
    with pytest.raises(ConfigError, match="no train-images-idx3-ubyte"):
        load("mnist", tmp_path)


@pytest.mark.parametrize("split, num_classes, first", [
    ("byclass", 62, 0), ("bymerge", 47, 0), ("balanced", 47, 0), ("letters", 26, 1),
    ("digits", 10, 0), ("mnist", 10, 0)])
def test_emnist_splits(tmp_path, split, num_classes, first):
    written = write_mnist(tmp_path / "EMNIST" / "raw", prefix=f"emnist-{split}-", test_stem="test",
                          num_train=70, num_test=12, num_classes=num_classes, first_label=first,
                          gz=split == "letters")
    d = load("emnist", tmp_path, split=split)
    assert d.name == f"emnist-{split}" and len(d.info["classes"]) == num_classes
    assert_pixels(d, (1, 28, 28), num_classes)
    labels = np.concatenate([written["train"][1], written["test"][1]]).astype(np.int64) - first
    assert np.array_equal(d.y.numpy(), labels) and int(d.y.min()) == 0
    # the files store each image transposed: it is loaded upright
    assert np.array_equal(d.x[0].numpy().reshape(28, 28), written["train"][0][0].T)


def test_emnist_reads_the_publishers_gzip_folder(tmp_path):
    write_mnist(tmp_path / "gzip", prefix="emnist-digits-", test_stem="test", gz=True)
    assert load("emnist", tmp_path, split="digits").num_samples == 50


def test_emnist_split_must_match_the_files(tmp_path):
    write_mnist(tmp_path / "EMNIST" / "raw", prefix="emnist-letters-", test_stem="test")
    one_line_error("emnist", tmp_path, "emnist-byclass-train-images-idx3-ubyte")


def test_idx_truncated_file(tmp_path):
    write_mnist(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    message = one_line_error("mnist", tmp_path, str(path))
    assert "truncated" in message and "30x28x28" in message


def test_idx_wrong_magic(tmp_path):
    write_mnist(tmp_path, gz=True)
    labels = np.zeros((30, 28, 28), dtype=np.uint8)
    # an images file where the training labels belong
    write_file(tmp_path / "train-labels-idx1-ubyte", idx_bytes(labels, IMAGES_MAGIC), gz=True)
    message = one_line_error("mnist", tmp_path, "train-labels-idx1-ubyte.gz")
    assert "0x00000803 is not 0x00000801" in message


def test_idx_damaged_gzip_and_short_header(tmp_path):
    write_mnist(tmp_path, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:40])
    assert "not a complete gzip file" in one_line_error("mnist", tmp_path, str(path))
    path.write_bytes(gzip.compress(struct_header()))
    assert "truncated inside its header" in one_line_error("mnist", tmp_path, str(path))


def struct_header() -> bytes:
    return IMAGES_MAGIC.to_bytes(4, "big") + (5).to_bytes(4, "big")


def test_idx_label_count_and_range(tmp_path):
    write_mnist(tmp_path, gz=False)
    write_file(tmp_path / "t10k-labels-idx1-ubyte",
               idx_bytes(np.zeros(19, dtype=np.uint8), LABELS_MAGIC), gz=False)
    assert "19 labels for the 20 images" in one_line_error("mnist", tmp_path, "t10k-labels")
    write_file(tmp_path / "t10k-labels-idx1-ubyte",
               idx_bytes(np.full(20, 10, dtype=np.uint8), LABELS_MAGIC), gz=False)
    assert "label 10 is outside 0..9" in one_line_error("mnist", tmp_path, "t10k-labels")


def test_missing_files_say_where_they_were_looked_for(tmp_path):
    message = one_line_error("mnist", tmp_path, str(tmp_path / "MNIST" / "raw"))
    assert "docs/guide/datasets.md" in message and "--data.download" in message
    assert "does not exist" in one_line_error("mnist", tmp_path / "nope", "nope")


# ---------------------------------------------------------------- CIFAR

@pytest.mark.parametrize("nested", [True, False])
def test_cifar10_reads_the_python_batches(tmp_path, nested):
    x, y = write_cifar10(tmp_path)
    root = tmp_path if nested else tmp_path / "cifar-10-batches-py"
    d = load("cifar10", root)
    assert d.num_samples == 40 and d.info["parts"] == {"train": 30, "test": 10}
    assert_pixels(d, (3, 32, 32), 10)
    assert np.array_equal(d.x.numpy(), x) and np.array_equal(d.y.numpy(), y)
    assert d.official_test[30:].all() and not d.official_test[:30].any()
    assert d.info["classes"] == CIFAR10_NAMES
    # the first pixel of the green plane of image 0 is byte 1024 of its row
    image = d.x[0].view(3, 32, 32)
    assert int(image[1, 0, 0]) == int(x[0, 1024]) and int(image[2, 31, 31]) == int(x[0, 3071])


def test_cifar10_missing_batch(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    assert "is missing" in one_line_error("cifar10", tmp_path, "data_batch_3")


def test_cifar_batch_damage(tmp_path):
    write_cifar10(tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:200])
    assert "not a CIFAR batch pickle" in one_line_error("cifar10", tmp_path, str(batch))
    write_pickle(batch, {b"data": np.zeros((2, 3072), np.uint8)})
    assert "has no key b'labels'" in one_line_error("cifar10", tmp_path, str(batch))
    write_pickle(batch, {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]})
    assert "outside 0..9" in one_line_error("cifar10", tmp_path, str(batch))
    write_pickle(batch, {b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]})
    assert "not uint8 rows of 3072" in one_line_error("cifar10", tmp_path, str(batch))


class RunsCode:
    """A pickle that calls a function when loaded: the loader must refuse it."""

    def __reduce__(self):
        return (print, ("pickle ran code",))


def test_cifar_pickle_cannot_run_code(tmp_path, capsys):
    write_cifar10(tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    batch.write_bytes(pickle.dumps({b"data": RunsCode()}, protocol=2))
    assert "names __builtin__.print" in one_line_error("cifar10", tmp_path, str(batch))
    assert "pickle ran code" not in capsys.readouterr().out


@pytest.mark.parametrize("coarse", [False, True])
def test_cifar100_fine_and_coarse(tmp_path, coarse):
    written = write_cifar100(tmp_path)
    d = load("cifar100", tmp_path, coarse=coarse)
    assert_pixels(d, (3, 32, 32), 20 if coarse else 100)
    column = 2 if coarse else 1
    expected = np.concatenate([written["train"][column], written["test"][column]])
    assert np.array_equal(d.y.numpy(), expected)
    assert np.array_equal(d.x.numpy(), np.concatenate([written["train"][0], written["test"][0]]))
    assert d.info["classes"][0] == ("coarse_0" if coarse else "fine_0")
    assert d.official_test.sum() == 15


def test_cifar100_missing_meta(tmp_path):
    write_cifar100(tmp_path)
    (tmp_path / "cifar-100-python" / "meta").unlink()
    one_line_error("cifar100", tmp_path, "no meta in")


# ---------------------------------------------------------------- SVHN

@pytest.mark.parametrize("extra", [False, True])
def test_svhn_reads_the_mat_files(tmp_path, extra):
    written = write_svhn(tmp_path, {"train": 12, "test": 7, "extra": 5})
    d = load("svhn", tmp_path, extra=extra)
    assert_pixels(d, (3, 32, 32), 10)
    parts = ["train", "extra", "test"] if extra else ["train", "test"]
    assert d.info["parts"] == {p: len(written[p][1]) for p in parts}
    x = np.concatenate([written[p][0].transpose(3, 2, 0, 1).reshape(-1, 3072) for p in parts])
    y = np.concatenate([written[p][1].reshape(-1) for p in parts]) % 10  # 10 is the digit 0
    assert np.array_equal(d.x.numpy(), x) and np.array_equal(d.y.numpy(), y)
    assert int(d.y.max()) == 9 and (d.y == 0).any()
    assert d.official_test.sum() == 7 and d.official_test[-7:].all()


def test_svhn_mat_without_x(tmp_path):
    from scipy.io import savemat

    write_svhn(tmp_path, {"train": 4, "test": 3})
    savemat(tmp_path / "test_32x32.mat", {"y": np.ones((3, 1), np.uint8)})
    assert "has no variable 'X'" in one_line_error("svhn", tmp_path, "test_32x32.mat")
    (tmp_path / "test_32x32.mat").write_bytes(b"not a MATLAB file at all" * 10)
    assert "not a MATLAB file" in one_line_error("svhn", tmp_path, "test_32x32.mat")
    savemat(tmp_path / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 3), np.uint8),
                                         "y": np.zeros((3, 1), np.uint8)})
    assert "labels in 1..10" in one_line_error("svhn", tmp_path, "test_32x32.mat")


# ---------------------------------------------------------------- CINIC-10, Tiny-ImageNet

def test_cinic10_reads_the_image_folders(tmp_path):
    written = write_cinic10(tmp_path)
    d = load("cinic10", tmp_path)
    assert_pixels(d, (3, 32, 32), 3)
    assert d.info["parts"] == {"train": 6, "valid": 6, "test": 6}
    assert d.info["classes"] == ["airplane", "bird", "cat"]
    expected = np.concatenate([written[p] for p in ("train", "valid", "test")])
    assert np.array_equal(d.x.numpy(), expected.reshape(18, -1))
    assert np.array_equal(d.y.numpy(), np.tile(np.repeat(np.arange(3), 2), 3))
    assert d.official_test.sum() == 6 and d.official_test[12:].all()
    # the greyscale PNG became three equal planes
    first = d.x[0].view(3, 32, 32)
    assert torch.equal(first[0], first[1]) and torch.equal(first[1], first[2])


def test_cinic10_empty_class_folder(tmp_path):
    write_cinic10(tmp_path)
    for image in (tmp_path / "cinic-10" / "valid" / "bird").iterdir():
        image.unlink()
    assert "holds no .png images" in one_line_error(
        "cinic10", tmp_path, str(tmp_path / "cinic-10" / "valid" / "bird"))


def test_cinic10_unreadable_and_odd_sized_images(tmp_path):
    write_cinic10(tmp_path)
    bad = tmp_path / "cinic-10" / "test" / "cat" / "cifar10-test-0.png"
    bad.write_bytes(b"\x89PNG broken")
    assert "not an image Pillow can read" in one_line_error("cinic10", tmp_path, str(bad))
    write_images(bad.parent, [bad.name], 16, np.random.default_rng(0))
    assert "16x16 pixels, not 32x32" in one_line_error("cinic10", tmp_path, str(bad))


def test_tiny_imagenet_reads_train_and_val(tmp_path):
    written = write_tiny_imagenet(tmp_path)
    d = load("tiny_imagenet", tmp_path)
    assert_pixels(d, (3, 64, 64), 2)
    assert d.info["classes"] == ["n01443537", "n02124075"]
    assert d.info["parts"] == {"train": 4, "val": 3} and d.info["official_test"] == ["val"]
    x = np.concatenate([written["train"][0], written["val"][0]]).reshape(7, -1)
    assert np.array_equal(d.x.numpy(), x)
    assert np.array_equal(d.y.numpy(), np.concatenate([written["train"][1], written["val"][1]]))
    assert d.official_test.tolist() == [False] * 4 + [True] * 3


def test_tiny_imagenet_damage(tmp_path):
    write_tiny_imagenet(tmp_path)
    folder = tmp_path / "tiny-imagenet-200"
    annotations = folder / "val" / "val_annotations.txt"
    annotations.write_text(annotations.read_text() + "val_9.JPEG\tn01443537\t0\t0\t1\t1\n")
    assert "line 4" in one_line_error("tiny_imagenet", tmp_path, str(annotations))
    annotations.write_text("val_0.JPEG\tn99999999\t0\t0\t1\t1\n")
    assert "'n99999999' is not in wnids.txt" in one_line_error("tiny_imagenet", tmp_path,
                                                                 "val_annotations.txt")
    images = folder / "train" / "n02124075" / "images"
    for image in images.iterdir():
        image.unlink()
    assert "holds no .jpeg images" in one_line_error("tiny_imagenet", tmp_path, str(images))


# ---------------------------------------------------------------- LEAF

def test_femnist_users_are_natural_clients(tmp_path):
    rng = np.random.default_rng(0)
    users = {"f0000_14": femnist_user(4, rng), "f0001_41": femnist_user(3, rng, 60),
             "f0002_02": femnist_user(5, rng, 7)}
    tests = {u: femnist_user(2, rng, 30) for u in users}
    folder = tmp_path / "femnist" / "data"
    write_leaf(folder, {
        "train/all_data_0_niid_0_keep_0_train_9.json": {u: users[u] for u in ("f0001_41", "f0000_14")},
        "train/all_data_1_niid_0_keep_0_train_9.json": {"f0002_02": users["f0002_02"]},
        "test/all_data_0_niid_0_keep_0_test_9.json": tests,
    })
    d = load("femnist", tmp_path)
    assert d.x.dtype == torch.float32 and d.input_kind == "features"
    assert d.num_classes == 62 and d.image_shape == (1, 28, 28) and d.info["users"] == 3
    assert d.info["parts"] == {"train": 12, "test": 6}
    # train rows in file order, then test rows; groups number the users in sorted order
    assert d.groups.tolist() == [1] * 3 + [0] * 4 + [2] * 5 + [0] * 2 + [1] * 2 + [2] * 2
    assert np.allclose(d.x[0].numpy(), users["f0001_41"]["x"][0])
    assert d.y[:3].tolist() == [60, 61, 0]
    assert d.official_test.sum() == 6
    fed = build_federation(d, PartitionConfig(kind="natural", min_samples=2), 0.2, 0)
    assert fed.num_clients == 3 and [c.num_train + c.num_test for c in fed.clients] == [6, 5, 7]
    # LEAF's own split: each writer's rows of test/ are its test rows
    fed = build_federation(d, PartitionConfig(kind="natural", min_samples=2), 0.2, 0,
                           use_official_split=True)
    assert [(c.num_train, c.num_test) for c in fed.clients] == [(4, 2), (3, 2), (5, 2)]
    assert all(d.official_test[c.test_index].all() for c in fed.clients)


def test_femnist_without_user_data(tmp_path):
    path = tmp_path / "train" / "part.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"users": ["a"], "num_samples": [1]}))
    assert "has no 'user_data'" in one_line_error("femnist", tmp_path, str(path))
    path.write_text('{"users": [')
    assert "is not valid JSON" in one_line_error("femnist", tmp_path, str(path))
    write_leaf(tmp_path, {"train/part.json": {"a": femnist_user(2, np.random.default_rng(0))}})
    content = json.loads(path.read_text())
    content["num_samples"] = [3]
    path.write_text(json.dumps(content))
    assert "has 2 samples, 'num_samples' says 3" in one_line_error("femnist", tmp_path, "part.json")
    content["num_samples"] = [2]
    content["user_data"]["a"]["x"][0][5] = 3.0
    path.write_text(json.dumps(content))
    assert "[0, 1]" in one_line_error("femnist", tmp_path, "part.json")


TEXT = ("ROMEO. But soft! What light through yonder window breaks?\nIt is the east, and Juliet "
        "is the sun. Arise, fair sun, and kill the envious moon;")


def test_shakespeare_is_int64_tokens_of_the_leaf_vocabulary(tmp_path):
    assert len(LEAF_CHARACTERS) == 80 and len(set(LEAF_CHARACTERS)) == 80
    write_leaf(tmp_path / "shakespeare" / "data", {
        "train/all_data_niid_0_keep_0_train_9.json": {
            "THE_TRAGEDY_OF_ROMEO_AND_JULIET_ROMEO": shakespeare_user(TEXT, 6),
            "THE_TRAGEDY_OF_ROMEO_AND_JULIET_JULIET": shakespeare_user(TEXT[10:], 4)},
        "test/all_data_niid_0_keep_0_test_9.json": {
            "THE_TRAGEDY_OF_ROMEO_AND_JULIET_ROMEO": shakespeare_user(TEXT[30:], 2)},
    })
    d = load("shakespeare", tmp_path)
    assert d.x.dtype == torch.int64 and d.x.shape == (12, 80) and d.input_kind == "tokens"
    assert d.vocab_size == 80 and d.num_classes == 80 and d.image_shape is None
    assert d.groups.tolist() == [1] * 6 + [0] * 4 + [1] * 2
    decoded = "".join(LEAF_CHARACTERS[i] for i in d.x[0].tolist())
    assert decoded == TEXT[:80] and LEAF_CHARACTERS[int(d.y[0])] == TEXT[80]
    assert torch.equal(d.rows(torch.tensor([1, 2])), d.x[1:3])
    fed = build_federation(d, PartitionConfig(kind="natural", min_samples=2), 0.25, 0)
    assert fed.vocab_size == 80 and fed.clients[0].train_x.dtype == torch.int64


def test_shakespeare_unknown_character(tmp_path):
    user = shakespeare_user(TEXT, 2)
    user["x"][1] = "é" + user["x"][1][1:]
    write_leaf(tmp_path, {"train/a.json": {"HAMLET": user}})
    message = one_line_error("shakespeare", tmp_path, "a.json")
    assert "'é' is not in LEAF's 80-character vocabulary" in message
    user["x"][1] = user["x"][1][:79]
    write_leaf(tmp_path, {"train/a.json": {"HAMLET": user}})
    assert "string of 80 characters" in one_line_error("shakespeare", tmp_path, "a.json")


def test_leaf_without_train_folder(tmp_path):
    (tmp_path / "test").mkdir()
    one_line_error("shakespeare", tmp_path, "no LEAF train/ folder")


# ---------------------------------------------------------------- MNIST-1D

@pytest.mark.slow  # importing mnist1d imports matplotlib.pyplot and requests: 1.5 s
def test_mnist1d_is_generated_offline_and_keeps_global_random_state():
    pytest.importorskip("mnist1d")
    np.random.seed(7)
    random.seed(7)
    before = (np.random.random(), random.random())
    np.random.seed(7)
    random.seed(7)
    d = load_dataset(DataConfig(name="mnist1d", num_samples=300), 3, 0)
    assert (np.random.random(), random.random()) == before
    assert d.x.shape == (300, 40) and d.x.dtype == torch.float32 and d.image_shape == (1, 40)
    assert d.num_classes == 10 and torch.bincount(d.y).tolist() == [30] * 10
    assert d.info["parts"] == {"train": 240, "test": 60} and d.official_test.sum() == 60
    assert abs(float(d.x.mean())) < 0.05 and abs(float(d.x.std()) - 1) < 0.05  # standardised
    again = load_dataset(DataConfig(name="mnist1d", num_samples=300), 3, 5)
    assert torch.equal(d.x, again.x)  # the package's seed, not the run's


# ---------------------------------------------------------------- Dataset, config, download

def test_dataset_checks_tokens_and_pixels():
    y = torch.tensor([0, 1])
    with pytest.raises(ConfigError, match="needs vocab_size"):
        Dataset(torch.zeros(2, 3, dtype=torch.int64), y, 2)
    with pytest.raises(ConfigError, match=r"tokens must lie in \[0, 4\)"):
        Dataset(torch.tensor([[0, 4], [1, 2]]), y, 2, vocab_size=4)
    with pytest.raises(ConfigError, match="vocab_size is for int64 tokens"):
        Dataset(torch.zeros(2, 3), y, 2, vocab_size=4)
    with pytest.raises(ConfigError, match="2-D float, uint8"):
        Dataset(torch.zeros(2, 3, dtype=torch.int32), y, 2)
    with pytest.raises(ConfigError, match="non-finite"):
        Dataset(torch.tensor([[0.0, float("nan")], [1, 2]]), y, 2)
    with pytest.raises(ConfigError, match="official_test must be a boolean mask"):
        Dataset(torch.zeros(2, 3), y, 2, official_test=np.array([0, 1]))
    pixels = Dataset(torch.tensor([[0, 255], [51, 102]], dtype=torch.uint8), y, 2)
    assert torch.equal(pixels.rows(torch.tensor([1])), torch.tensor([[51.0, 102.0]]) / 255)


@pytest.mark.parametrize("options, message", [
    ({"name": "mnist"}, "data.name=mnist needs data.root"),
    ({"name": "digits", "root": "/data"}, "data.root is a setting of mnist"),
    ({"name": "mnist", "root": "/d", "split": "letters"}, "data.split is a setting of emnist"),
    ({"name": "cifar10", "root": "/d", "coarse": True}, "data.coarse is a setting of cifar100"),
    ({"name": "cinic10", "root": "/d", "download": True}, "data.download is a setting of mnist"),
    ({"name": "mnist", "root": "/d", "extra": True}, "data.extra is a setting of svhn"),
    ({"name": "digits", "num_samples": 100}, "data.num_samples is a setting of gaussian_mixture"),
    ({"name": "emnist", "root": "/d", "split": "letter"}, "is not one of"),
])
def test_config_rejects_options_of_other_data_sets(options, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(DataConfig, options, "data")


def test_gaussian_mixture_keeps_its_default_size():
    d = load_dataset(DataConfig(name="gaussian_mixture"), 3, 0)
    assert d.num_samples == 3000


def fake_torchvision(monkeypatch, calls: list) -> None:
    """A ``torchvision.datasets`` whose MNIST writes the tiny files where torchvision would."""

    class MNIST:
        def __init__(self, root, train=True, download=False):
            calls.append((root, train, download))
            if train:
                from pathlib import Path

                write_mnist(Path(root) / "MNIST" / "raw", gz=False)

    datasets = types.ModuleType("torchvision.datasets")
    datasets.MNIST = MNIST
    package = types.ModuleType("torchvision")
    package.datasets = datasets
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", datasets)


def test_download_passes_through_to_torchvision_only_for_missing_files(tmp_path, monkeypatch):
    calls: list = []
    fake_torchvision(monkeypatch, calls)
    root = tmp_path / "new"
    d = load("mnist", root, download=True)
    assert d.num_samples == 50
    assert calls == [(str(root), True, True), (str(root), False, True)]
    load("mnist", root, download=True)
    assert len(calls) == 2, "files already there were fetched again"


def test_download_without_torchvision_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import fails
    message = one_line_error("cifar10", tmp_path, "fedkernels[vision]", download=True)
    assert "torchvision" in message


# ---------------------------------------------------------------- simulation and command line

def test_pixels_reach_clients_as_float_rows(tmp_path):
    write_mnist(tmp_path, gz=True)
    d = load("mnist", tmp_path)
    fed = build_federation(d, PartitionConfig(num_clients=3), 0.2, 0, server_fraction=0.2)
    for client in fed.clients:
        assert client.train_x.dtype == torch.float32 and client.test_x.dtype == torch.float32
        index = torch.from_numpy(client.train_index)
        assert torch.equal(client.train_x, d.x[index].float() / 255)
    assert fed.server_x.dtype == torch.float32 and float(fed.server_x.max()) <= 1.0
    assert fed.image_shape == (1, 28, 28) and fed.vocab_size is None


@pytest.mark.parametrize("vmap", [False, True])
def test_token_rows_train_on_both_paths(tmp_path, vmap):
    from torch import nn

    from fedkernels.algorithms import build_strategy
    from fedkernels.sim.run import Simulation

    write_leaf(tmp_path, {"train/a.json": {"ROMEO": shakespeare_user(TEXT, 8),
                                           "JULIET": shakespeare_user(TEXT[20:], 8)}})
    config = from_dict(ExperimentConfig, {
        "rounds": 1, "vmap": vmap, "data": {"name": "shakespeare", "root": str(tmp_path)},
        "partition": {"kind": "natural"}, "client": {"batch_size": 4}})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(80, 4), nn.Flatten(), nn.Linear(320, 80))
    result = Simulation(config, build_strategy("fedavg"), model=model).run()
    assert np.isfinite(result.rounds[-1]["train_loss"])


def test_cli_run_on_mnist_files(tmp_path, capsys):
    from fedkernels.cli import main

    write_mnist(tmp_path / "data" / "MNIST" / "raw", gz=True)
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flags = ["run", "--data.name", "mnist", "--data.root", str(tmp_path / "data"),
                 "--rounds", "1", "--model.name", "logreg", "--partition.num_clients", "3",
                 "--no-progress", "--no-plots"]
        code = main([*flags, "--out", str(out)])
        official = main([*flags, "--data.official_split", "--out", str(tmp_path / "official")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0 and official == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["data_preparation"]["parts"] == {"train": 30, "test": 20}
    config = json.loads((tmp_path / "official" / "config.json").read_text())
    assert config["data"]["official_split"] is True
    assert main(["run", "--data.name", "cifar10", "--data.root", str(tmp_path / "data"),
                 "--no-progress", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no batches.meta in" in err[0], err


@pytest.mark.slow
def test_fedkernels_command_on_mnist_files(tmp_path):
    from cli_process import FAST, assert_one_line_error, assert_success, fedkernels

    write_mnist(tmp_path / "data", gz=False)
    done = fedkernels("run", "--data.name", "mnist", "--data.root", str(tmp_path / "data"),
                      "--rounds", "1", *FAST, "--out", str(tmp_path / "run"))
    assert_success(done)
    assert (tmp_path / "run" / "results.json").is_file()
    truncated = tmp_path / "data" / "train-labels-idx1-ubyte"
    truncated.write_bytes(truncated.read_bytes()[:20])
    done = fedkernels("run", "--data.name", "mnist", "--data.root", str(tmp_path / "data"),
                      "--rounds", "1", *FAST, "--out", str(tmp_path / "run2"))
    assert_one_line_error(done, str(truncated), "truncated")


def test_official_split_gives_clients_the_publishers_test_rows(tmp_path):
    write_mnist(tmp_path, gz=False, num_train=60, num_test=30)
    d = load("mnist", tmp_path)
    fed = build_federation(d, PartitionConfig(num_clients=3), 0.2, 0, use_official_split=True)
    for client in fed.clients:
        assert (client.train_index < 60).all() and (client.test_index >= 60).all()
    assert sum(c.num_test for c in fed.clients) == 30
    # a client without test rows of the publisher's split is refused, naming it
    groups = (np.arange(90) >= 60).astype(np.int64)  # client 0 holds no test rows
    natural = Dataset(d.x, d.y, 10, groups, official_test=d.official_test)
    with pytest.raises(ConfigError, match="client 0 has 60 training and 0 test rows"):
        build_federation(natural, PartitionConfig(kind="natural"), 0.2, 0, use_official_split=True)
    digits = load_dataset(DataConfig(), 3, 0)
    with pytest.raises(ConfigError, match="needs a data set with the publisher's test split"):
        build_federation(digits, PartitionConfig(num_clients=3), 0.2, 0, use_official_split=True)
    with pytest.raises(ConfigError, match="data.official_split is a setting of mnist"):
        DataConfig(official_split=True)
    with pytest.raises(ConfigError, match="test_fraction is not read with data.official_split"):
        DataConfig(name="mnist", root="/d", official_split=True, test_fraction=0.3)
