"""The 1-D CNN of MNIST-1D's published results."""

from __future__ import annotations

from torch import Tensor, nn

from ..config import ConfigError
from ..model_catalog import MNIST1D_CHANNELS, out_size


class MNIST1DCNN(nn.Module):
    """The ``ConvBase`` model of the ``mnist1d`` package (Greydanus and Kobak 2020), behind
    the data set's published 94 % test accuracy: three stride-2 1-D convs with 25 channels
    and padding 1 (kernels 5, 3, 3), each with a ReLU, then a linear layer on the flattened
    features. 5,210 parameters on rows of 40 values (1x40, 10 classes). Rows are read as
    ``signal_shape`` ``(channels, length)``, or as one channel when it is ``None``. The
    published MLP is ``mlp`` with ``model.hidden 100,100`` (15,210 parameters)."""

    # With --vmap on the CPU its convolutions run as matrix products (vmap.conv1d_as_matmul),
    # faster than the grouped convolution vmap makes of them at these sizes only
    # (docs/guide/models.md, the vmap path).
    stacked_conv_as_matmul = True

    def __init__(
        self, signal_shape: tuple[int, ...] | None, num_features: int, num_classes: int
    ) -> None:
        super().__init__()
        shape = (1, num_features) if signal_shape is None else tuple(signal_shape)
        if len(shape) != 2:
            raise ConfigError(
                f"model.name=mnist1d_cnn needs 1-D signals (rows of values, or a (channels, "
                f"length) shape), got an image shape {shape}"
            )
        self.signal_shape = shape
        k = MNIST1D_CHANNELS
        self.conv1 = nn.Conv1d(shape[0], k, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(k, k, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(k, k, 3, stride=2, padding=1)
        length = out_size(out_size(out_size(shape[1], 5, 2, 1), 3, 2, 1), 3, 2, 1)
        if length < 1:
            raise ConfigError(f"model.name=mnist1d_cnn: signals of {shape} are too short")
        self.relu = nn.ReLU()
        self.linear = nn.Linear(k * length, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], *self.signal_shape)
        x = self.relu(self.conv3(self.relu(self.conv2(self.relu(self.conv1(x))))))
        return self.linear(x.flatten(1))
