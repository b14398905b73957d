"""The source papers' models (``--model.name``): parameter counts against the papers and the
catalog, shapes, gradients, token inputs, norms, which models train on the vmap path, the
on-device augmentation, and the options each model refuses."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedkernels.algorithms import FedAvg
from fedkernels.algorithms.fedevg import EnergyMLP, FedEvg, FedEvgConfig
from fedkernels.sim import seeding
from fedkernels.sim.augment import build_augmentation, crop_flip_images
from fedkernels.sim.client import LocalTrainer
from fedkernels.sim.config import (
    ClientConfig,
    ConfigError,
    ExperimentConfig,
    ModelConfig,
    field_types,
    from_dict,
)
from fedkernels.sim.federation import ClientData
from fedkernels.sim.model_catalog import MODEL_CATALOG, MODEL_NAMES, model_name_help
from fedkernels.sim.models import (
    MNIST1DCNN,
    CharLSTM,
    FedEvgResNet10,
    ResNet18,
    SuPerFedMobileNet,
    build_model,
)
from fedkernels.sim.strategy import SetupInfo
from fedkernels.sim.vmap import BatchedTrainer, conv1d_as_matmul, convs_as_matmuls

# more than about a second to build and differentiate on a busy 2-core machine
LARGE = {"resnet18", "vgg11", "superfed_resnet9", "fedevg_resnet10", "superfed_mobilenet",
         "superfed_vgg9", "char_lstm", "superfed_char_lstm", "twocnn"}
# the counts the papers (or their code) state for the standard input
PAPER_COUNTS = {
    "twonn": 199_210,  # McMahan et al. 2017
    "twocnn": 1_663_370,  # McMahan et al. 2017
    "superfed_twonn": 238_800,
    "fedau_cnn_fashion_mnist": 211_690,
    "fedau_cnn_svhn": 273_706,
    "fedau_cnn_cifar10": 551_786,
    "fedau_cnn_cifar100": 1_216_260,
    "fedau_cnn_cinic10": 1_193_130,
    "mnist1d_cnn": 5_210,
}
# "about" counts: SuPerFed's ~723k, 1.72M, 5.05M, 0.36M, 0.82M; FedEvg's 4.98M; ResNet-18 11.2M
ROUNDED_COUNTS = {
    "superfed_twocnn": (723e3, 1e3),
    "superfed_vgg9": (1.72e6, 1e4),
    "superfed_resnet9": (5.05e6, 1e4),
    "superfed_mobilenet": (0.36e6, 1e4),
    "superfed_char_lstm": (0.82e6, 1e4),
    "fedevg_resnet10": (4.98e6, 1e4),
    "resnet18": (11.2e6, 1e5),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def standard_model(name: str, **options) -> tuple[nn.Module, torch.Tensor]:
    """The model on its standard input, and a batch of two such rows."""
    entry = MODEL_CATALOG[name]
    d = math.prod(entry.shape)
    image = entry.shape if len(entry.shape) >= 2 else None
    model = build_model(ModelConfig(name=name, **{**entry.standard, **options}), d, entry.classes,
                        image, seed=0, vocab_size=entry.vocab)
    gen = torch.Generator().manual_seed(1)
    if entry.vocab is not None:
        x = torch.randint(0, entry.vocab, (2, d), generator=gen)
    else:
        x = torch.rand(2, d, generator=gen)
    return model, x


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def mark(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in LARGE else n for n in names]


# ------------------------------------------------------------------ catalog and help


def test_model_name_choices_are_the_catalog():
    assert MODEL_NAMES == tuple(MODEL_CATALOG)
    assert field_types(ModelConfig)["name"].__args__ == MODEL_NAMES
    assert {"twonn", "twocnn", "resnet18", "vgg11", "char_lstm", "fedevg_resnet10",
            "mnist1d_cnn"} <= set(MODEL_NAMES)


def test_help_lists_each_model_with_its_count():
    text = model_name_help()
    for entry in MODEL_CATALOG.values():
        assert f"{entry.name} {entry.parameters():,}," in f"{text},"
    field = next(f for f in dataclasses.fields(ModelConfig) if f.name == "name")
    assert field.metadata["help"] == text


@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_catalog_counts_equal_the_papers(name):
    assert MODEL_CATALOG[name].parameters() == PAPER_COUNTS[name]


@pytest.mark.parametrize("name", sorted(ROUNDED_COUNTS))
def test_catalog_counts_round_to_the_papers(name):
    value, tolerance = ROUNDED_COUNTS[name]
    assert abs(MODEL_CATALOG[name].parameters() - value) <= tolerance


# ------------------------------------------------------------------ each model


@pytest.mark.parametrize("name", mark(MODEL_NAMES))
def test_model_count_shape_and_gradients_on_its_standard_input(name):
    entry = MODEL_CATALOG[name]
    model, x = standard_model(name)
    n = count(model)
    assert n == entry.parameters()
    if name not in ("logreg", "mlp", "cnn"):  # the paper models' docstrings state their count
        assert f"{n:,}" in type(model).__doc__
    model.train()
    logits = model(x)
    assert logits.shape == (2, entry.classes) and logits.dtype == torch.float32
    nn.functional.cross_entropy(logits, torch.tensor([0, 1])).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (2, entry.classes)


@pytest.mark.parametrize(
    "name, shape, classes",
    [("twocnn", (3, 32, 32), 10), ("superfed_twocnn", (1, 28, 28), 10),
     ("superfed_twocnn", (3, 32, 32), 10), ("fedau_cnn_cifar10", (1, 28, 28), 7),
     ("cnn", (3, 12, 12), 4), ("mlp", (20,), 3), ("mnist1d_cnn", (2, 50), 5),
     ("superfed_vgg9", (3, 32, 32), 10)],
)
def test_catalog_counts_on_other_inputs(name, shape, classes):
    entry = MODEL_CATALOG[name]
    model = build_model(ModelConfig(name=name, **entry.standard), math.prod(shape), classes,
                        shape if len(shape) >= 2 else None, seed=0)
    assert count(model) == entry.parameters(shape, classes)
    assert model(torch.rand(3, math.prod(shape))).shape == (3, classes)


def test_same_seed_same_initial_weights_and_paper_inits():
    a, _ = standard_model("superfed_twonn")
    b, _ = standard_model("superfed_twonn")
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q)
    assert all(m.bias is None for m in a.modules() if isinstance(m, nn.Linear))
    fedau, _ = standard_model("fedau_cnn_cifar10")
    convs = [m for m in fedau.modules() if isinstance(m, nn.Conv2d)]
    assert all(torch.count_nonzero(m.bias) == 0 for m in convs)  # He-normal, zero biases
    last = fedau.classifier[-1]
    assert torch.count_nonzero(last.bias) > 0  # the last layer keeps PyTorch's default


def test_fedau_cifar100_has_dropout_before_each_linear_layer():
    model, _ = standard_model("fedau_cnn_cifar100")
    kinds = [type(m).__name__ for m in model.classifier]
    assert kinds == ["Dropout", "Linear", "ReLU", "Dropout", "Linear", "ReLU", "Dropout", "Linear"]
    assert all(m.p == 0.2 for m in model.classifier if isinstance(m, nn.Dropout))


def test_mnist1d_cnn_reads_plain_rows_and_signal_shapes():
    plain = MNIST1DCNN(None, 40, 10)
    shaped = MNIST1DCNN((1, 40), 40, 10)
    assert count(plain) == count(shaped) == 5_210
    shaped.load_state_dict(plain.state_dict())
    x = torch.randn(4, 40)
    assert torch.equal(plain(x), shaped(x))
    with pytest.raises(ConfigError, match="1-D signals"):
        MNIST1DCNN((1, 8, 5), 40, 10)
    with pytest.raises(ConfigError, match="too short"):
        MNIST1DCNN(None, 2, 10)


# ------------------------------------------------------------------ the character LSTM


def test_char_lstm_reads_int64_tokens():
    torch.manual_seed(0)
    model = CharLSTM(vocab_size=12, num_classes=12, hidden=16)
    tokens = torch.randint(0, 12, (5, 80), dtype=torch.int64)
    logits = model(tokens)
    assert logits.shape == (5, 12)
    nn.functional.cross_entropy(logits, tokens[:, -1]).backward()
    assert model.embedding.weight.grad is not None
    # the logits of a row depend on its last step, and only on its own tokens
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 12
    out = model(changed)
    assert not torch.allclose(out[0], logits[0]) and torch.allclose(out[1:], logits[1:])
    with pytest.raises(TypeError, match="int64 character ids"):
        model(tokens.float())


def test_build_model_takes_the_vocabulary_of_token_data():
    model = build_model(ModelConfig(name="char_lstm"), 80, 60, None, seed=0, vocab_size=90)
    assert model.embedding.num_embeddings == 90 and model.head.out_features == 60
    default = build_model(ModelConfig(name="char_lstm"), 80, 60, None, seed=0)
    assert default.embedding.num_embeddings == 60  # next-character data: vocabulary = classes
    bias_free = build_model(ModelConfig(name="superfed_char_lstm"), 80, 100, None, seed=0)
    assert all("bias" not in n for n, _ in bias_free.named_parameters())


# ------------------------------------------------------------------ ResNet-18's norms


@pytest.mark.slow
def test_resnet18_batch_and_group_norm_variants():
    bn = ResNet18((3, 32, 32), 10, norm="batch")
    gn = ResNet18((3, 32, 32), 10, norm="group", groups=2)
    assert count(bn) == count(gn) == 11_173_962
    assert [n for n, _ in bn.named_parameters()] == [n for n, _ in gn.named_parameters()]
    assert any(isinstance(m, nn.BatchNorm2d) for m in bn.modules())
    norms = [m for m in gn.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 20 and all(m.num_groups == 2 for m in norms)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())
    assert len(dict(gn.named_buffers())) == 0 and len(dict(bn.named_buffers())) == 60
    x = torch.rand(3, 3 * 32 * 32)
    for model in (bn, gn):
        model.train()
        y = model(x)
        y.sum().backward()
        assert y.shape == (3, 10)
    # the stem is 3x3, stride 1, with no max-pool: a 32x32 image reaches layer4 as 4x4
    shapes = []
    gn.layer4.register_forward_hook(lambda module, inputs, output: shapes.append(output.shape))
    gn(x)
    assert shapes == [(3, 512, 4, 4)]
    with pytest.raises(ConfigError, match="must divide"):
        ResNet18((3, 32, 32), 10, norm="group", groups=3)


@pytest.mark.slow
def test_resnet18_maps_onto_torchvision_resnet18():
    tv = pytest.importorskip("torchvision")
    from functools import partial

    for norm, layer in (("batch", nn.BatchNorm2d), ("group", partial(nn.GroupNorm, 2))):
        reference = tv.models.resnet18(num_classes=10, norm_layer=layer)
        reference.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        reference.maxpool = nn.Identity()
        ours = ResNet18((3, 32, 32), 10, norm=norm)
        theirs = {k: v.shape for k, v in reference.state_dict().items()}
        assert {k: v.shape for k, v in ours.state_dict().items()} == theirs
        reference.load_state_dict(ours.state_dict())
        x = torch.rand(2, 3, 32, 32)
        ours.eval()
        reference.eval()
        torch.testing.assert_close(ours(x.flatten(1)), reference(x))


# ------------------------------------------------------------------ the vmap path


def client_data(x: torch.Tensor, y: torch.Tensor, sizes: list[int]) -> list[ClientData]:
    clients, start = [], 0
    for n in sizes:
        rows = np.arange(start, start + n)
        clients.append(ClientData(x[rows], y[rows], x[rows[:1]], y[rows[:1]], rows, rows[:1]))
        start += n
    return clients


def vmap_and_sequential(model: nn.Module, x, y, client: ClientConfig, sizes=(7, 5, 9)):
    clients = client_data(x, y, list(sizes))
    ids = list(range(len(clients)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batched = BatchedTrainer(model, client, FedAvg(), seed=3).train(state, clients, 2, ids)
    sequential = LocalTrainer(model, client, FedAvg(), seed=3)
    return batched, [sequential.train(state, c, 2, i) for c, i in zip(clients, ids)]


def image_rows(n: int, shape, classes: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, math.prod(shape), generator=gen), torch.randint(0, classes, (n,),
                                                                         generator=gen)


VMAP_EXACT = [  # (name, input shape, options): no dropout, so vmap equals the sequential path
    ("twonn", (30,), {}),
    ("superfed_twonn", (30,), {}),
    ("twocnn", (1, 8, 8), {}),
    ("superfed_twocnn", (1, 8, 8), {}),
    ("fedau_cnn_cifar10", (3, 8, 8), {}),
    ("fedau_cnn_svhn", (3, 8, 8), {}),
    ("mnist1d_cnn", (1, 40), {}),
    ("superfed_vgg9", (1, 16, 16), {}),
    pytest.param("superfed_resnet9", (3, 8, 8), {"norm": "group"}, marks=pytest.mark.slow),
    pytest.param("superfed_mobilenet", (3, 34, 34), {"norm": "group"}, marks=pytest.mark.slow),
    # 16x16: on 8x8 the untrained network's large gradients scale float rounding to 1e-3
    pytest.param("resnet18", (3, 16, 16), {"norm": "group"}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, shape, options", VMAP_EXACT)
def test_vmap_path_equals_sequential(name, shape, options):
    x, y = image_rows(21, shape, 4)
    model = build_model(ModelConfig(name=name, **options), x.shape[1], 4,
                        shape if len(shape) >= 2 else None, seed=0)
    client = ClientConfig(steps=2, batch_size=4, lr=0.05, momentum=0.5)
    batched, sequential = vmap_and_sequential(model, x, y, client)
    for b, s in zip(batched, sequential):
        for key, value in s.state.items():
            torch.testing.assert_close(b.state[key], value, rtol=1e-4, atol=1e-5)
        assert b.train_loss == pytest.approx(s.train_loss, rel=1e-4)


@pytest.mark.parametrize("channels, out_channels, length, width, stride, padding, bias", [
    (1, 25, 40, 5, 2, 1, True), (25, 25, 19, 3, 2, 1, True), (3, 4, 7, 7, 1, 0, False),
    (2, 3, 9, 3, 3, 4, True), (4, 2, 5, 1, 1, 0, True), (2, 2, 3, 5, 1, 1, True)])
def test_conv1d_as_matmul_equals_conv1d_in_values_and_gradients(
        channels, out_channels, length, width, stride, padding, bias):
    gen = torch.Generator().manual_seed(length * width)
    clients, batch = 3, 5
    x = torch.randn(clients, batch, channels, length, generator=gen)
    w = torch.randn(clients, out_channels, channels, width, generator=gen)
    b = torch.randn(clients, out_channels, generator=gen) if bias else None

    def per_client(conv):
        leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
        args = (*leaves, None) if b is None else leaves
        out = torch.func.vmap(lambda xi, wi, bi=None: conv(xi, wi, bi, stride, padding))(
            *[a for a in args if a is not None])
        grads = torch.autograd.grad((out * out.detach().sin()).sum(), leaves)
        return out, grads

    reference = per_client(torch.nn.functional.conv1d)
    batched = per_client(conv1d_as_matmul)
    torch.testing.assert_close(batched[0], reference[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(batched[1], reference[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_conv1d_as_matmul_refuses_shapes_it_cannot_convolve():
    with pytest.raises(ValueError, match="expected, got"):
        conv1d_as_matmul(torch.randn(4, 6), torch.randn(2, 4, 3), None, 1, 0)
    with pytest.raises(ValueError, match="expected, got"):
        conv1d_as_matmul(torch.randn(1, 4, 6), torch.randn(2, 3, 3), None, 1, 0)
    with pytest.raises(ValueError, match="no output position"):
        conv1d_as_matmul(torch.randn(1, 4, 2), torch.randn(2, 4, 5), None, 1, 1)
    with pytest.raises(ValueError, match="no output position"):
        conv1d_as_matmul(torch.randn(1, 4, 6), torch.randn(2, 4, 3), None, 0, 0)


def test_batched_trainer_runs_the_mnist1d_cnn_convs_as_matmuls_and_only_plain_convs():
    model = build_model(ModelConfig(name="mnist1d_cnn"), 40, 10, None, seed=0)
    trainer = BatchedTrainer(model, ClientConfig(steps=1, batch_size=4), FedAvg(), seed=0)
    assert all(type(m).__name__ == "_MatmulConv1d"
               for m in trainer.model.modules() if isinstance(m, nn.Conv1d))
    assert all(type(m) is nn.Conv1d for m in model.modules() if isinstance(m, nn.Conv1d))
    assert list(trainer.model.state_dict()) == list(model.state_dict())

    odd = nn.Sequential(nn.Conv1d(2, 4, 3, groups=2), nn.Conv1d(4, 4, 3, dilation=2),
                        nn.Conv1d(4, 4, 3, padding="same"),
                        nn.Conv1d(4, 4, 3, padding=1, padding_mode="reflect"),
                        nn.Conv1d(4, 4, 3, padding=1))
    convs_as_matmuls(odd)
    assert [type(m).__name__ for m in odd] == ["Conv1d"] * 4 + ["_MatmulConv1d"]
    # unbatched input and too-short signals take (and fail in) PyTorch's own path
    x = torch.randn(4, 6)
    torch.testing.assert_close(odd[4](x), nn.functional.conv1d(x, odd[4].weight, odd[4].bias,
                                                               padding=1))
    with pytest.raises(RuntimeError, match="Kernel size"):
        convs_as_matmuls(short := nn.Sequential(nn.Conv1d(1, 1, 5)))
        short(torch.randn(2, 1, 3))


def test_vmap_path_trains_the_lstm_on_tokens():
    torch.manual_seed(0)
    model = CharLSTM(vocab_size=9, num_classes=9, embedding_dim=4, hidden=8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 9, (21, 6), generator=gen)
    y = torch.randint(0, 9, (21,), generator=gen)
    client = ClientConfig(steps=2, batch_size=4, lr=0.1)
    # aten::lstm has no batching rule: the trainer leaves its autograd pass for
    # torch.func.grad, under which PyTorch loops over the clients
    with pytest.warns(UserWarning, match="batching rule"):
        batched, sequential = vmap_and_sequential(model, x, y, client)
    for b, s in zip(batched, sequential):
        for key, value in s.state.items():
            torch.testing.assert_close(b.state[key], value, rtol=1e-4, atol=1e-5)


def test_vmap_path_takes_one_autograd_pass_unless_an_op_has_no_batching_rule():
    """Gradients come from one autograd pass over the vmapped losses; a model with an op that
    has no batching rule (the LSTM) moves to torch.func.grad at its first step, with the same
    result as a trainer that starts there."""
    x, y = image_rows(21, (30,), 4)
    mlp = build_model(ModelConfig(name="twonn"), 30, 4, None, seed=0)
    client = ClientConfig(steps=2, batch_size=4, lr=0.05)
    clients = client_data(x, y, [7, 5, 9])
    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    trainer = BatchedTrainer(mlp, client, FedAvg(), seed=3)
    trainer.train(state, clients, 2, [0, 1, 2])
    assert trainer.autograd_batches

    torch.manual_seed(0)
    lstm = CharLSTM(vocab_size=9, num_classes=9, embedding_dim=4, hidden=8)
    gen = torch.Generator().manual_seed(0)
    tokens = client_data(torch.randint(0, 9, (21, 6), generator=gen),
                         torch.randint(0, 9, (21,), generator=gen), [7, 5, 9])
    state = {k: v.clone() for k, v in lstm.state_dict().items()}
    runs = []
    for start_with_autograd in (True, False):
        trainer = BatchedTrainer(lstm, client, FedAvg(), seed=3)
        trainer.autograd_batches = start_with_autograd
        with pytest.warns(UserWarning, match="batching rule"):
            runs.append(trainer.train(state, tokens, 2, [0, 1, 2]))
        assert not trainer.autograd_batches
    for a, b in zip(*runs):
        for key in a.state:
            assert torch.equal(a.state[key], b.state[key])


def test_vmap_path_with_dropout_and_augmentation_runs_and_repeats():
    x, y = image_rows(21, (3, 8, 8), 4)
    model = build_model(ModelConfig(name="fedau_cnn_cifar100"), x.shape[1], 4, (3, 8, 8), seed=0)
    client = ClientConfig(steps=2, batch_size=4, lr=0.05, augment="crop_flip")
    runs = [vmap_and_sequential(model, x, y, client)[0] for _ in range(2)]
    for a, b in zip(*runs):
        for key in a.state:
            assert torch.equal(a.state[key], b.state[key])
            assert torch.isfinite(a.state[key]).all()


@pytest.mark.parametrize(
    "name, options, reason",
    [pytest.param("resnet18", {}, "BatchNorm", marks=pytest.mark.slow),
     ("superfed_resnet9", {"norm": "batch"}, "BatchNorm"),
     ("fedevg_resnet10", {}, "spectral norm")],
)
def test_vmap_path_refuses_batch_norm_and_spectral_norm(name, options, reason):
    model = build_model(ModelConfig(name=name, **options), 3 * 32 * 32, 10, (3, 32, 32), seed=0)
    with pytest.raises(ConfigError, match=reason):
        BatchedTrainer(model, ClientConfig(), FedAvg(), seed=0)


# ------------------------------------------------------------------ augmentation


def test_flip_reverses_the_columns_of_the_images_it_picks():
    images = torch.arange(4 * 2 * 3 * 5, dtype=torch.float32).view(4, 2, 3, 5)
    gen = torch.Generator().manual_seed(0)
    out = crop_flip_images(images, crop=False, generator=gen)
    coins = torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(0)) == 1
    assert 0 < int(coins.sum()) < 4  # the seed flips some images and keeps others
    for i in range(4):
        expected = images[i].flip(-1) if coins[i] else images[i]
        assert torch.equal(out[i], expected)


def test_crop_takes_a_window_of_the_zero_padded_image():
    images = torch.arange(1, 1 + 6 * 1 * 4 * 4, dtype=torch.float32).view(6, 1, 4, 4)
    out = crop_flip_images(images, flip=False, padding=2, generator=torch.Generator().manual_seed(5))
    offsets = torch.randint(0, 5, (6, 2), generator=torch.Generator().manual_seed(5))
    padded = torch.zeros(6, 1, 8, 8)
    padded[:, :, 2:6, 2:6] = images
    for k, (i, j) in enumerate(offsets.tolist()):
        assert torch.equal(out[k], padded[k, :, i:i + 4, j:j + 4])
    assert len({tuple(o) for o in offsets.tolist()}) > 1


def test_crop_flip_by_hand_on_one_image():
    image = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])[None]  # [1, 1, 2, 2]
    seen = set()
    for seed in range(40):
        out = crop_flip_images(image, padding=1, generator=torch.Generator().manual_seed(seed))
        seen.add(tuple(out.flatten().tolist()))
    # every result is a 2x2 window of [[0,0,0,0],[0,1,2,0],[0,3,4,0],[0,0,0,0]], maybe mirrored
    padded = [[0, 0, 0, 0], [0, 1, 2, 0], [0, 3, 4, 0], [0, 0, 0, 0]]
    windows = set()
    for i in range(3):
        for j in range(3):
            w = [padded[i][j], padded[i][j + 1], padded[i + 1][j], padded[i + 1][j + 1]]
            windows.add(tuple(float(v) for v in w))
            windows.add(tuple(float(v) for v in (w[1], w[0], w[3], w[2])))
    assert seen <= windows and len(seen) > 5
    assert (1.0, 2.0, 3.0, 4.0) in seen and (2.0, 1.0, 4.0, 3.0) in seen


def test_augmentation_is_seeded_by_the_torch_stream_and_keeps_shapes():
    augment = build_augmentation("crop_flip", (3, 8, 8))
    rows = torch.rand(16, 3 * 8 * 8)
    with seeding.torch_stream(7, seeding.LOCAL_TRAINING, 1, 2):
        a = augment(rows)
    with seeding.torch_stream(7, seeding.LOCAL_TRAINING, 1, 2):
        b = augment(rows)
    with seeding.torch_stream(7, seeding.LOCAL_TRAINING, 1, 3):
        c = augment(rows)
    assert a.shape == rows.shape and a.dtype == rows.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)
    # every output value is a pixel of the input or the zero padding
    assert torch.isin(a, torch.cat([rows.flatten(), torch.zeros(1)])).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_augmentation_draws_the_same_on_the_gpu():
    images = torch.rand(8, 3, 32, 32)
    cpu = crop_flip_images(images, generator=torch.Generator().manual_seed(1))
    gpu = crop_flip_images(images.cuda(), generator=torch.Generator().manual_seed(1))
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)


def test_sequential_trainer_augments_its_minibatches():
    x, y = image_rows(12, (1, 6, 6), 3)
    model = build_model(ModelConfig(name="cnn", channels=[2, 3]), 36, 3, (1, 6, 6), seed=0)
    (data,) = client_data(x, y, [12])
    state = model.state_dict()

    def train(augment: str):
        trainer = LocalTrainer(model, ClientConfig(steps=3, batch_size=4, augment=augment),
                               FedAvg(), seed=1)
        return trainer.train(state, data, 0, 0).state

    plain, flipped, again = train("none"), train("flip"), train("flip")
    assert all(torch.equal(flipped[k], again[k]) for k in plain)
    assert any(not torch.equal(plain[k], flipped[k]) for k in plain)


# ------------------------------------------------------------------ options each model refuses


@pytest.mark.parametrize(
    "settings, message",
    [({"name": "resnet18", "hidden": [32]}, "model.hidden is not a setting of model.name=resnet18"),
     ({"name": "twonn", "norm": "group"}, "model.norm is not a setting of model.name=twonn"),
     ({"name": "mlp", "norm": "none"}, "model.norm is not a setting of model.name=mlp"),
     ({"name": "char_lstm", "channels": [4, 4]}, "model.channels is not a setting"),
     ({"name": "fedevg_resnet10", "batch_norm": True}, "model.batch_norm is not a setting"),
     ({"name": "resnet18", "groups": 4}, "model.groups is read only with model.norm=group"),
     ({"name": "resnet18", "norm": "group", "groups": 0}, "model.groups must be >= 1"),
     ({"name": "resnet50"}, "model.name: 'resnet50' is not one of")],
)
def test_options_a_model_does_not_read_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(ModelConfig, settings, "model")


def test_the_first_models_refuse_the_options_they_do_not_read_too():
    # they used to ignore them silently: --model.hidden 64,64 --model.name logreg trained a
    # logistic regression without a word
    with pytest.raises(ConfigError, match="model.hidden is not a setting of model.name=logreg"):
        ModelConfig(name="logreg", hidden=[8])
    with pytest.raises(ConfigError, match="model.channels is not a setting of model.name=mlp"):
        ModelConfig(name="mlp", channels=[4, 4])


@pytest.mark.parametrize(
    "name, num_features, image_shape, message",
    [("twocnn", 784, None, "needs image data"),
     ("resnet18", 3 * 32, (3, 32), "needs image data"),
     ("superfed_mobilenet", 3 * 32 * 32, (3, 32, 32), "too small"),
     ("vgg11", 3 * 16 * 16, (3, 16, 16), "too small"),
     ("mnist1d_cnn", 64, (1, 8, 8), "1-D signals"),
     ("cnn", 64, None, "needs image data")],
)
def test_models_refuse_data_they_cannot_read(name, num_features, image_shape, message):
    with pytest.raises(ConfigError, match=message):
        build_model(ModelConfig(name=name), num_features, 10, image_shape, seed=0)


def test_group_norm_groups_must_divide_the_channels():
    with pytest.raises(ConfigError, match=r"model.groups=3 must divide .* \(not 32, 64"):
        SuPerFedMobileNet((3, 64, 64), 10, norm="group", groups=3)


def test_augmentation_needs_images():
    model = build_model(ModelConfig(name="mlp"), 64, 10, None, seed=0)
    with pytest.raises(ConfigError, match="client.augment=crop_flip needs image data"):
        LocalTrainer(model, ClientConfig(augment="crop_flip"), FedAvg(), seed=0)
    with pytest.raises(ConfigError, match="augment"):
        from_dict(ClientConfig, {"augment": "cutout"}, "client")
    # an image shape given to the trainer is enough
    LocalTrainer(model, ClientConfig(augment="flip"), FedAvg(), seed=0, image_shape=(1, 8, 8))
    assert ExperimentConfig(client=ClientConfig(augment="crop")).client.augment == "crop"


# ------------------------------------------------------------------ FedEvg's energy model


def fedevg_with(model: nn.Module, **options) -> FedEvg:
    strategy = FedEvg(FedEvgConfig(**options))
    strategy.setup(SetupInfo(2, torch.tensor([5.0, 5.0]), 10, None,
                             [n for n, _ in model.named_parameters()], model=model, rounds=2,
                             seed=0))
    return strategy


def test_fedevg_energy_model_is_selectable():
    template = build_model(ModelConfig(name="cnn", channels=[2, 2]), 3 * 32 * 32, 10, (3, 32, 32),
                           seed=0)
    assert isinstance(fedevg_with(template).new_energy_model(3072), EnergyMLP)
    energy = fedevg_with(template, energy_model="resnet10").new_energy_model(3072)
    assert isinstance(energy, FedEvgResNet10) and energy.image_shape == (3, 32, 32)
    assert count(energy) == MODEL_CATALOG["fedevg_resnet10"].parameters((3, 32, 32), 10)
    assert nn.utils.parametrize.is_parametrized(energy.classifier, "weight")
    mlp = build_model(ModelConfig(name="mlp"), 1024, 10, None, seed=0)
    square = fedevg_with(mlp, energy_model="resnet10").new_energy_model(1024)
    assert square.image_shape == (1, 32, 32)
    with pytest.raises(ConfigError, match="hidden is the MLP energy model's"):
        FedEvgConfig(energy_model="resnet10", hidden=[16])


def test_models_guide_lists_every_model_with_its_count():
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "models.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in guide.splitlines()
            if line.startswith("| `")}
    for entry in MODEL_CATALOG.values():
        assert f"| {entry.parameters():,} |" in rows[entry.name], entry.name
