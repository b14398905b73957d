"""Tiny data sets written in their publishers' exact on-disk formats.

Each writer takes a folder (``data.root``) and returns what it wrote (the arrays, in the order
the loader stacks them), so that a test can compare the loaded rows with the source. Sizes are a
few dozen samples: the formats (headers, magic numbers, pickle keys, folder names) are real, the
contents random. The loader tests use them, and so does ``fedkernels run --smoke``
(:mod:`fedkernels.sim.smoke`), which runs a configuration on such files instead of the real
data set.
"""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from pathlib import Path

import numpy as np

LABELS_MAGIC = 0x00000801
IMAGES_MAGIC = 0x00000803


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    """An IDX file: the big-endian magic number, one big-endian 32-bit count per dimension,
    then the uint8 values in C order."""
    assert array.dtype == np.uint8 and array.ndim == magic & 0xFF
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write_file(path: Path, content: bytes, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(content))
    else:
        path.write_bytes(content)
    return path


def write_mnist(
    folder: Path,
    *,
    prefix: str = "",
    test_stem: str = "t10k",
    num_train: int = 30,
    num_test: int = 20,
    num_classes: int = 10,
    first_label: int = 0,
    gz: bool = True,
    side: int = 28,
    seed: int = 0,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The four IDX files of MNIST (``prefix`` ``emnist-<split>-`` and ``test_stem`` ``test``
    for EMNIST's names) in ``folder``; returns ``{part: (images, labels)}``."""
    rng = np.random.default_rng(seed)
    written = {}
    for part, stem, n in (("train", "train", num_train), ("test", test_stem, num_test)):
        images = rng.integers(0, 256, (n, side, side), dtype=np.uint8)
        labels = (np.arange(n) % num_classes + first_label).astype(np.uint8)
        write_file(folder / f"{prefix}{stem}-images-idx3-ubyte", idx_bytes(images, IMAGES_MAGIC), gz)
        write_file(folder / f"{prefix}{stem}-labels-idx1-ubyte", idx_bytes(labels, LABELS_MAGIC), gz)
        written[part] = (images, labels)
    return written


def write_pickle(path: Path, content: dict) -> None:
    """A pickle of protocol 2, the protocol of the publisher's Python 2 files (its ``bytes``
    keys load as ``b'...'`` with ``encoding='bytes'``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as stream:
        pickle.dump(content, stream, protocol=2)


CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                 "truck"]


def write_cifar10(root: Path, per_batch: int = 6, num_test: int = 10, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``cifar-10-batches-py/`` with five training batches, ``test_batch`` and
    ``batches.meta``; returns all images ``[n, 3072]`` and labels, training rows first."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    xs, ys = [], []
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = num_test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        write_pickle(folder / name, {
            b"batch_label": f"{name} of 6".encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"image_{i}.png".encode() for i in range(n)],
        })
        xs.append(data)
        ys.append(np.asarray(labels))
    write_pickle(folder / "batches.meta", {
        b"num_cases_per_batch": per_batch,
        b"label_names": [n.encode() for n in CIFAR10_NAMES],
        b"num_vis": 3072,
    })
    return np.concatenate(xs), np.concatenate(ys)


def write_cifar100(root: Path, num_train: int = 25, num_test: int = 15, seed: int = 0
                   ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``cifar-100-python/`` with ``train``, ``test`` and ``meta``; returns
    ``{part: (data, fine, coarse)}``."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    written = {}
    for part, n in (("train", num_train), ("test", num_test)):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        fine = [int(v) for v in rng.integers(0, 100, n)]
        coarse = [f // 5 for f in fine]
        write_pickle(folder / part, {
            b"filenames": [f"img_{i}.png".encode() for i in range(n)],
            b"batch_label": f"{part} batch".encode(),
            b"fine_labels": fine,
            b"coarse_labels": coarse,
            b"data": data,
        })
        written[part] = (data, np.asarray(fine), np.asarray(coarse))
    write_pickle(folder / "meta", {
        b"fine_label_names": [f"fine_{i}".encode() for i in range(100)],
        b"coarse_label_names": [f"coarse_{i}".encode() for i in range(20)],
    })
    return written


def write_svhn(folder: Path, parts: dict[str, int], seed: int = 0
               ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``<part>_32x32.mat`` files (MATLAB 5, as published) with ``X`` ``[32, 32, 3, n]`` uint8
    and ``y`` ``[n, 1]`` in 1..10; returns ``{part: (X, y)}``."""
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for part, n in parts.items():
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = (np.arange(n) % 10 + 1).astype(np.uint8).reshape(n, 1)
        savemat(folder / f"{part}_32x32.mat", {"X": x, "y": y})
        written[part] = (x, y)
    return written


def write_images(folder: Path, names: list[str], side: int, rng: np.random.Generator,
                 grey_first: bool = False) -> list[np.ndarray]:
    """Random RGB images (the first one greyscale when ``grey_first``) named ``names`` in
    ``folder`` (PNG or JPEG by the suffix); returns their ``[3, side, side]`` pixels as the
    loader should read them."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, name in enumerate(names):
        path = folder / name
        if grey_first and i == 0:
            picture = Image.fromarray(rng.integers(0, 256, (side, side), dtype=np.uint8), mode="L")
        else:
            picture = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        picture.save(path, **({"format": "JPEG", "quality": 95} if name.endswith(".JPEG") else {}))
        with Image.open(path) as saved:  # JPEG is lossy, and grey becomes RGB: as loaded
            out.append(np.asarray(saved.convert("RGB")).transpose(2, 0, 1))
    return out


def write_cinic10(root: Path, classes: tuple[str, ...] = ("airplane", "bird", "cat"),
                  per_class: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """``cinic-10/{train,valid,test}/<class>/*.png`` (32x32, the publisher's file names);
    returns each part's pixels in the loader's order (classes sorted, files by name)."""
    rng = np.random.default_rng(seed)
    written = {}
    for part in ("train", "valid", "test"):
        pixels = []
        for name in sorted(classes):
            files = [f"n0153282900000{i}.png" if i % 2 else f"cifar10-{part}-{i}.png"
                     for i in range(per_class)]
            pixels += write_images(root / "cinic-10" / part / name, sorted(files), 32, rng,
                                   grey_first=part == "train" and name == sorted(classes)[0])
        written[part] = np.stack(pixels)
    return written


def write_tiny_imagenet(root: Path, wnids: tuple[str, ...] = ("n02124075", "n01443537"),
                        per_class: int = 2, num_val: int = 3, seed: int = 0
                        ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``tiny-imagenet-200/`` with ``wnids.txt``, ``words.txt``, ``train/<wnid>/images`` and
    ``<wnid>_boxes.txt``, ``val/images`` with ``val_annotations.txt``, and an unlabelled
    ``test/images``; returns ``{part: (pixels, labels)}`` in the loader's order."""
    rng = np.random.default_rng(seed)
    folder = root / "tiny-imagenet-200"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wnids.txt").write_text("".join(f"{w}\n" for w in wnids))
    (folder / "words.txt").write_text("".join(f"{w}\tsome words\n" for w in wnids))
    order = sorted(wnids)
    train_pixels, train_labels = [], []
    for label, wnid in enumerate(order):
        names = [f"{wnid}_{i}.JPEG" for i in range(per_class)]
        train_pixels += write_images(folder / "train" / wnid / "images", names, 64, rng,
                                     grey_first=label == 0)
        (folder / "train" / wnid / f"{wnid}_boxes.txt").write_text(
            "".join(f"{name}\t0\t0\t63\t63\n" for name in names))
        train_labels += [label] * per_class
    names = [f"val_{i}.JPEG" for i in range(num_val)]
    val_pixels = write_images(folder / "val" / "images", names, 64, rng)
    val_labels = [(i + 1) % len(order) for i in range(num_val)]
    (folder / "val" / "val_annotations.txt").write_text("".join(
        f"{name}\t{order[label]}\t1\t2\t60\t61\n" for name, label in zip(names, val_labels)))
    write_images(folder / "test" / "images", ["test_0.JPEG"], 64, rng)
    return {"train": (np.stack(train_pixels), np.asarray(train_labels)),
            "val": (np.stack(val_pixels), np.asarray(val_labels))}


def write_leaf(folder: Path, files: dict[str, dict[str, dict[str, list]]]) -> None:
    """LEAF's JSON files: ``files`` maps ``train/<name>.json`` (or ``test/...``) to
    ``{user: {"x": [...], "y": [...]}}``."""
    for relative, users in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        names = list(users)
        path.write_text(json.dumps({
            "users": names,
            "num_samples": [len(users[u]["y"]) for u in names],
            "user_data": users,
        }))


def femnist_user(n: int, rng: np.random.Generator, label_offset: int = 0) -> dict[str, list]:
    return {"x": [[float(v) for v in np.round(rng.random(784), 4)] for _ in range(n)],
            "y": [int((i + label_offset) % 62) for i in range(n)]}


def shakespeare_user(text: str, n: int) -> dict[str, list]:
    """``n`` windows of 80 characters of ``text`` and the character after each."""
    assert len(text) >= n + 80
    return {"x": [text[i:i + 80] for i in range(n)], "y": [text[i + 80] for i in range(n)]}


# processed.<site>.data of the UCI heart data: codes each category column may hold
HEART_CODES = {"sex": (0, 1), "cp": (1, 2, 3, 4), "fbs": (0, 1), "restecg": (0, 1, 2),
               "exang": (0, 1), "slope": (1, 2, 3), "thal": (3, 6, 7)}
HEART_SITE_FILES = ("processed.cleveland.data", "processed.hungarian.data",
                    "processed.switzerland.data", "processed.va.data")


def write_heart(folder: Path, per_site: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    """The four ``processed.<site>.data`` files of the UCI heart data (comma separated, no
    header, ``?`` for a gap, categories as codes), ``per_site`` random patients each, half of
    them ill (``num`` 1-4), with a few gaps; returns each file's label column ``num``."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in HEART_SITE_FILES:
        num = np.where(np.arange(per_site) % 2 == 0, 0, rng.integers(1, 5, per_site))
        lines = []
        for i in range(per_site):
            row = {
                "age": f"{rng.integers(28, 78)}", "trestbps": f"{rng.integers(90, 190)}",
                "chol": f"{rng.integers(120, 400)}", "thalach": f"{rng.integers(70, 200)}",
                "oldpeak": f"{rng.uniform(-1, 5):.1f}", "ca": f"{rng.integers(0, 4)}",
                **{c: f"{rng.choice(codes)}" for c, codes in HEART_CODES.items()},
                "num": f"{num[i]}",
            }
            if i % 5 == 3:  # a gap, as the files have many
                row[("chol", "ca", "thal", "slope")[i % 4]] = "?"
            lines.append(",".join(row[c] for c in ("age", "sex", "cp", "trestbps", "chol",
                                                   "fbs", "restecg", "thalach", "exang",
                                                   "oldpeak", "slope", "ca", "thal", "num")))
        (folder / name).write_text("\n".join(lines) + "\n")
        written[name] = num
    return written
