"""The parameter shapes of the models the benchmarks aggregate: ResNet-18, a transformer
encoder, a LoRA adapter, the small CNN of FedAvg's paper. Shapes only: each benchmark makes
its own clients of them."""

from __future__ import annotations


def resnet18_shapes() -> list[tuple[int, ...]]:
    """The 62 parameter tensors of torchvision's ResNet-18 (11.69 M parameters)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    c_in = 64
    for c_out, first_stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        for block in range(2):
            cin = c_in if block == 0 else c_out
            shapes += [(c_out, cin, 3, 3), (c_out,), (c_out,), (c_out, c_out, 3, 3), (c_out,), (c_out,)]
            if block == 0 and (first_stride != 1 or cin != c_out):
                shapes += [(c_out, cin, 1, 1), (c_out,), (c_out,)]
        c_in = c_out
    return shapes + [(1000, 512), (1000,)]


def transformer_shapes(layers: int = 16, d: int = 256, ff: int = 1024,
                       vocab: int = 8000) -> list[tuple[int, ...]]:
    """A pre-norm transformer encoder: 12 tensors per layer, embeddings and a final norm
    (196 tensors, 14.7 M parameters with the defaults)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (512, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),
                   (d,), (d,), (ff, d), (ff,), (d, ff), (d,)]
    return shapes + [(d,), (d,)]


def lora_shapes(pairs: int = 128, rank: int = 16, width: int = 4096) -> dict[str, tuple[int, ...]]:
    """A LoRA adapter: an A (rank x width) and a B (width x rank) matrix per adapted layer;
    256 tensors of 64 Ki elements with the defaults."""
    shapes = {}
    for i in range(pairs):
        shapes[f"layers.{i}.lora_A.weight"] = (rank, width)
        shapes[f"layers.{i}.lora_B.weight"] = (width, rank)
    return shapes


def cnn_shapes() -> list[tuple[int, ...]]:
    """The two-convolution CNN of McMahan et al. (2017) on 28x28 images, 10 classes
    (8 tensors, 1.66 M parameters): a small model, the size many FL experiments train."""
    return [(32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (512, 64 * 7 * 7), (512,),
            (10, 512), (10,)]
