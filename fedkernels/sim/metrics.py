r"""Evaluation of a model on many clients at once, and the statistics over clients.

For per-client values :math:`a_1..a_N` (each on the client's own test split; accuracy or
AUROC) with test sizes :math:`n_1..n_N`:

- mean and standard deviation (population, ``ddof = 0``);
- worst-10% / best-10%: the mean of the :math:`m = \max(1, \lfloor 0.1 N \rfloor)` smallest /
  largest values (``docs/algorithms/fairness.md``, "12. Evaluation metrics"); ties are broken
  by client order;
- the ``_weighted`` forms weight by test size: :math:`\sum_k n_k a_k / \sum_k n_k`, and for the
  tails the same m clients averaged with weights :math:`n_k` (the AAggFF authors' evaluation);
- minimum (the worst client), maximum, ``gap`` = max − min (the accuracy-parity gap, best
  minus worst client) and ``gap10`` = best-10% − worst-10%;
- Gini coefficient :math:`G = \sum_i\sum_j |a_i - a_j| / (2 N^2 \bar a)` (0 when all are
  equal or the mean is 0).

AUROC is the probability that a random positive sample scores above a random negative one,
ties counting one half; it equals the Mann–Whitney statistic
:math:`(R_+ - n_+(n_+ + 1)/2) / (n_+ n_-)` with :math:`R_+` the sum of the positives' mid-ranks
(:func:`auroc_by_group`). Binary tasks score class 1; with C > 2 classes it is the macro
average of the one-vs-rest AUROCs (class c scored by :math:`\log p_c`) over the classes that
occur in the split. A split with a single class has no AUROC: the value is NaN in tensors,
``null`` in ``results.json``, and such clients are left out of every statistic over clients,
never silently: ``client_auroc_clients`` counts the others and ``client_auroc_excluded`` lists
the clients left out (each statistic over clients has its ``_clients`` count).

Calibration (:func:`calibration_errors`): each prediction's confidence is its largest softmax
probability; the confidences are put into ``B`` equal-width bins :math:`((b-1)/B, b/B]` and,
with :math:`n_b` samples, accuracy :math:`acc_b` and mean confidence :math:`conf_b` in bin b,
ECE :math:`= \sum_b (n_b/n)\,|acc_b - conf_b|` and MCE :math:`= \max_{n_b > 0} |acc_b - conf_b|`
(``docs/algorithms/personalized.md``, "Calibration"). ``client_ece``/``client_mce`` average the
per-client values over the clients, ``test_ece``/``test_mce`` pool every client's test samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

EVAL_CHUNK = 8192
CALIBRATION_BINS = 15  # SuPerFed's paper reports ECE and MCE with 15 bins


@dataclass
class ClientEvaluation:
    """Per-client mean cross-entropy ``loss``, ``accuracy`` and sample ``count`` (``[K]``);
    with ``auroc=True`` also each client's ``auroc`` (``[K]``, NaN where undefined) and the
    AUROC of the pooled test samples, ``auroc_pooled`` (None where undefined). Every per-client
    tensor is on the CPU, whatever the device of the evaluation."""

    loss: Tensor
    accuracy: Tensor
    count: Tensor
    auroc: Tensor | None = None
    auroc_pooled: float | None = None
    ece: Tensor | None = None
    mce: Tensor | None = None
    calibration_pooled: tuple[float, float] | None = None  # (ECE, MCE) of the pooled samples

    def pooled_loss(self) -> float:
        """Mean loss over all samples of all clients."""
        return float((self.loss * self.count).sum() / self.count.sum())

    def pooled_accuracy(self) -> float:
        """Accuracy over all samples of all clients."""
        return float((self.accuracy * self.count).sum() / self.count.sum())


@torch.no_grad()
def evaluate_clients(
    model: nn.Module,
    xs: list[Tensor],
    ys: list[Tensor],
    *,
    auroc: bool = False,
    calibration: bool = False,
) -> ClientEvaluation:
    """Evaluates ``model`` (in eval mode) on each client's ``(xs[k], ys[k])`` with one forward
    pass over their concatenation, reduced per client. ``auroc`` adds the per-client and
    pooled AUROC (:func:`client_auroc`), ``calibration`` the per-client and pooled ECE and MCE
    (:func:`calibration_errors`). The forward pass and the reductions run on the data's device;
    the per-client results come back on the CPU."""
    was_training = model.training
    model.eval()
    try:
        x, y = torch.cat(xs), torch.cat(ys)
        device = y.device
        count = torch.tensor([len(t) for t in ys], dtype=torch.float64, device=device)
        owner = torch.repeat_interleave(torch.arange(len(ys), device=device), count.long())
        logits = torch.cat([model(chunk) for chunk in x.split(EVAL_CHUNK)])
        losses = F.cross_entropy(logits, y, reduction="none").double()
        correct = (logits.argmax(dim=1) == y).double()
        k = len(ys)
        per_client = torch.zeros(2, k, dtype=torch.float64, device=device)
        per_client[0].index_add_(0, owner, losses)
        per_client[1].index_add_(0, owner, correct)
        loss, accuracy = (per_client / count).cpu()  # one copy to the host
        evaluation = ClientEvaluation(loss, accuracy, count.cpu())
        if auroc:
            evaluation.auroc, evaluation.auroc_pooled = client_auroc(logits, y, owner, k)
        if calibration:
            ece, mce = calibration_errors(logits, y, owner, k)
            evaluation.ece, evaluation.mce = ece.cpu(), mce.cpu()
            ece, mce = calibration_errors(logits, y)
            evaluation.calibration_pooled = (float(ece[0]), float(mce[0]))
        return evaluation
    finally:
        model.train(was_training)


def calibration_errors(
    logits: Tensor,
    y: Tensor,
    owner: Tensor | None = None,
    num_groups: int = 1,
    bins: int = CALIBRATION_BINS,
) -> tuple[Tensor, Tensor]:
    """Expected and maximum calibration error (module docstring) of ``logits`` (``[M, C]``)
    for labels ``y``, per group: sample i belongs to group ``owner[i]`` (all to group 0 when
    ``owner`` is None). Returns two float64 ``[num_groups]`` tensors, NaN for a group without
    samples, on the device of ``logits``. A confidence of exactly ``b/B`` falls into bin b
    (right-closed bins)."""
    if bins < 1:
        raise ValueError(f"calibration_errors: bins must be >= 1, got {bins}")
    if logits.dim() != 2 or y.shape != logits.shape[:1]:
        raise ValueError(
            f"calibration_errors: logits must be [M, C] and y [M], got "
            f"{tuple(logits.shape)} and {tuple(y.shape)}"
        )
    probs = torch.softmax(logits.double(), dim=1)
    confidence, predicted = probs.max(dim=1)
    correct = (predicted == y).double()
    group = torch.zeros_like(y) if owner is None else owner.long()
    # bin b covers ((b-1)/B, b/B]; index 0..B-1
    index = (torch.ceil(confidence * bins).long() - 1).clamp(0, bins - 1)
    cell = group * bins + index
    size = num_groups * bins
    zeros = logits.new_zeros(size, dtype=torch.float64)
    count = zeros.clone().index_add_(0, cell, torch.ones_like(correct))
    hits = zeros.clone().index_add_(0, cell, correct)
    conf = zeros.index_add_(0, cell, confidence)
    count, hits, conf = (t.view(num_groups, bins) for t in (count, hits, conf))
    gap = (hits - conf).abs() / count.clamp(min=1)  # |acc_b - conf_b|, 0 for an empty bin
    total = count.sum(dim=1)
    ece = (gap * count).sum(dim=1) / total
    mce = torch.where(count > 0, gap, torch.zeros_like(gap)).max(dim=1).values
    empty = total == 0
    return ece.masked_fill(empty, float("nan")), mce.masked_fill(empty, float("nan"))


def auroc_by_group(
    scores: np.ndarray, positive: np.ndarray, groups: np.ndarray, num_groups: int
) -> np.ndarray:
    """The AUROC of ``scores`` for the binary labels ``positive`` within each group
    (``groups[i]`` in ``[0, num_groups)``), from mid-ranks so that tied scores count one half.
    NaN for a group without positives or without negatives, or with a non-finite score."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    groups = np.asarray(groups, dtype=np.int64)
    order = np.lexsort((scores, groups))
    s, g, pos = scores[order], groups[order], positive[order]
    counts = np.bincount(groups, minlength=num_groups).astype(np.float64)
    start = np.concatenate([[0.0], np.cumsum(counts)[:-1]])
    n = len(s)
    auc = np.full(num_groups, np.nan)
    if n == 0:
        return auc
    # runs of equal (group, score) share the mean of their positions: the mid-rank
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = (g[1:] != g[:-1]) | (s[1:] != s[:-1])
    run = np.cumsum(new_run) - 1
    first = np.flatnonzero(new_run)
    last = np.append(first[1:], n) - 1
    rank = (first[run] + last[run]) / 2.0 - start[g] + 1.0
    n_pos = np.bincount(g, weights=pos.astype(np.float64), minlength=num_groups)
    n_neg = counts - n_pos
    rank_sum = np.bincount(g, weights=rank * pos, minlength=num_groups)
    finite = np.bincount(g, weights=(~np.isfinite(s)).astype(np.float64), minlength=num_groups) == 0
    ok = (n_pos > 0) & (n_neg > 0) & finite
    auc[ok] = (rank_sum[ok] - n_pos[ok] * (n_pos[ok] + 1) / 2) / (n_pos[ok] * n_neg[ok])
    return auc


def client_auroc(
    logits: Tensor, y: Tensor, owner: Tensor, num_clients: int
) -> tuple[Tensor, float | None]:
    """Per-client AUROC (``[num_clients]`` float64, NaN where undefined) and the pooled AUROC
    (None where undefined) of a classifier's ``logits`` (``[M, C]``) for labels ``y``, sample i
    belonging to client ``owner[i]``. Binary: the score of class 1. C > 2: macro one-vs-rest
    over the classes present in the split (module docstring)."""
    log_p = torch.log_softmax(logits.double(), dim=1).cpu().numpy()
    labels = y.cpu().numpy()
    owners = owner.cpu().numpy()
    num_classes = log_p.shape[1]
    classes = [1] if num_classes == 2 else list(range(num_classes))

    def per_group(groups: np.ndarray, num_groups: int) -> np.ndarray:
        table = np.stack(
            [auroc_by_group(log_p[:, c], labels == c, groups, num_groups) for c in classes],
            axis=1,
        )  # [groups, classes]
        defined = ~np.isnan(table)
        total = np.where(defined, table, 0.0).sum(axis=1)
        count = defined.sum(axis=1)
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)

    per_client = per_group(owners, num_clients)
    pooled = float(per_group(np.zeros(len(labels), dtype=np.int64), 1)[0])
    return torch.from_numpy(per_client), (None if np.isnan(pooled) else pooled)


def gini(values: Tensor) -> float:
    """Gini coefficient of non-negative values (module docstring)."""
    v = values.double()
    mean = v.mean()
    if v.numel() == 0 or mean <= 0:
        return 0.0
    return float((v[:, None] - v[None, :]).abs().sum() / (2 * v.numel() ** 2 * mean))


def distribution_summary(
    values: Tensor, tail: float = 0.1, weights: Tensor | None = None
) -> dict[str, float]:
    """``mean``, ``std``, ``worst10``, ``best10``, ``min``, ``max``, ``gap``, ``gap10``, ``gini``
    of per-client values (the tail is ``tail`` of the clients, at least one; ties broken by
    client order); with ``weights`` (test sizes) also ``mean_weighted``, ``worst10_weighted``
    and ``best10_weighted`` (module docstring). ``values`` must not be empty or NaN."""
    v = values.double()
    order = torch.sort(v, stable=True).indices
    v = v[order]
    m = max(1, int(v.numel() * tail))
    label = f"{round(tail * 100)}"
    worst, best = float(v[:m].mean()), float(v[-m:].mean())
    out = {
        "mean": float(v.mean()),
        "std": float(v.std(correction=0)),
        f"worst{label}": worst,
        f"best{label}": best,
        "min": float(v[0]),
        "max": float(v[-1]),
        "gap": float(v[-1] - v[0]),
        f"gap{label}": best - worst,
        "gini": gini(v),
    }
    if weights is not None:
        w = weights.double()[order]
        out["mean_weighted"] = float((w * v).sum() / w.sum())
        out[f"worst{label}_weighted"] = float((w[:m] * v[:m]).sum() / w[:m].sum())
        out[f"best{label}_weighted"] = float((w[-m:] * v[-m:]).sum() / w[-m:].sum())
    return out


SUMMARY_KEYS = (
    "mean", "std", "worst10", "best10", "min", "max", "gap", "gap10", "gini",
    "mean_weighted", "worst10_weighted", "best10_weighted",
)


def evaluation_metrics(evaluation: ClientEvaluation) -> dict[str, Any]:
    """The metrics a run records for one evaluation of the global model: ``test_accuracy``,
    ``test_loss`` (pooled test samples), ``client_accuracy_<stat>`` over the clients (every
    key of :func:`distribution_summary`, test sizes as weights) and ``client_accuracy_clients``
    (every client), and when the evaluation has AUROC, ``test_auroc`` (pooled),
    ``client_auroc_<stat>`` over the clients whose AUROC is defined (None for all when no
    client's is), ``client_auroc_clients``, their number, and ``client_auroc_excluded``, the
    others (client indices); when it has calibration, ``test_ece``/``test_mce`` (pooled) and
    ``client_ece_mean``/``client_mce_mean`` over the ``client_ece_clients`` clients with test
    samples."""
    out: dict[str, Any] = {
        "test_accuracy": evaluation.pooled_accuracy(),
        "test_loss": evaluation.pooled_loss(),
    }
    summary = distribution_summary(evaluation.accuracy, weights=evaluation.count)
    out.update({f"client_accuracy_{k}": v for k, v in summary.items()})
    out["client_accuracy_clients"] = len(evaluation.accuracy)
    if evaluation.auroc is not None:
        out["test_auroc"] = evaluation.auroc_pooled
        defined = ~torch.isnan(evaluation.auroc)
        out["client_auroc_clients"] = int(defined.sum())
        out["client_auroc_excluded"] = torch.nonzero(~defined).flatten().tolist()
        if defined.any():
            summary = distribution_summary(
                evaluation.auroc[defined], weights=evaluation.count[defined]
            )
        else:
            summary = dict.fromkeys(SUMMARY_KEYS)
        out.update({f"client_auroc_{k}": v for k, v in summary.items()})
    if evaluation.ece is not None:
        out["test_ece"], out["test_mce"] = evaluation.calibration_pooled
        out["client_ece_mean"] = _nanmean(evaluation.ece)
        out["client_mce_mean"] = _nanmean(evaluation.mce)
        out["client_ece_clients"] = int((~evaluation.ece.isnan()).sum())
    return out


def _nanmean(values: Tensor) -> float | None:
    finite = values[~values.isnan()]
    return float(finite.mean()) if finite.numel() else None
