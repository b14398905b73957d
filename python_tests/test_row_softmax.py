"""The backward formulas' softmax and log-softmax over the last dimension (fedkernels/ops/
row_softmax.py) against PyTorch's, on short rows (the composed path) and long ones."""

from __future__ import annotations

import pytest
import torch

from fedkernels.ops.row_softmax import SHORT_ROW, log_softmax_last, softmax_last

inf, nan = float("inf"), float("nan")


@pytest.mark.parametrize("C", [1, 2, 10, SHORT_ROW - 1, SHORT_ROW, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch(C, dtype):
    g = torch.Generator().manual_seed(C)
    x = (5 * torch.randn(3, 7, C, generator=g)).to(dtype)
    torch.testing.assert_close(softmax_last(x), torch.softmax(x, -1))
    torch.testing.assert_close(log_softmax_last(x), torch.log_softmax(x, -1))


def test_special_values_as_torch():
    x = torch.tensor([[inf, 0.0, 1.0], [-inf, -inf, -inf], [nan, 1.0, 2.0], [1e30, -1e30, 0.0],
                      [-inf, 0.0, 3.0]])
    torch.testing.assert_close(softmax_last(x), torch.softmax(x, -1), equal_nan=True)
    torch.testing.assert_close(log_softmax_last(x), torch.log_softmax(x, -1), equal_nan=True)


def test_empty_rows_and_batches():
    assert softmax_last(torch.empty(4, 0)).shape == (4, 0)
    assert log_softmax_last(torch.empty(0, 10)).shape == (0, 10)


@pytest.mark.parametrize("fn,ref", [(softmax_last, torch.softmax),
                                    (log_softmax_last, torch.log_softmax)])
def test_second_derivative_as_torch(fn, ref):
    x = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 10, dtype=torch.float64)

    def hvp(f):
        (g,) = torch.autograd.grad((f(x) * w).sum(), x, create_graph=True)
        return torch.autograd.grad((g * w).sum(), x)[0]

    torch.testing.assert_close(hvp(fn), hvp(lambda t: ref(t, -1)))
