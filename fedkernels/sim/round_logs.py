"""Per-round metrics outside results.json: a CSV table (``metrics.csv``) and, on request,
TensorBoard event files.

The CSV has one row per round and one column per metric any round recorded, ``round`` first;
a round that did not record a metric (evaluation keys between ``eval_every`` rounds) leaves
its cell empty. Lists (``non_finite``) are written as ``a;b``.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .atomic_files import write_text
from .config import ConfigError

TENSORBOARD_INSTALL = 'pip install "fedkernels[tensorboard]"'


def metric_columns(rounds: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every key of ``rounds`` in order of first appearance, ``round`` first."""
    columns = dict.fromkeys(["round"])
    for record in rounds:
        columns.update(dict.fromkeys(record))
    return list(columns)


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ";".join(map(str, value))
    return value


def metrics_csv(rounds: list[Mapping[str, Any]]) -> str:
    """The CSV text of ``rounds`` (results.json's ``rounds``)."""
    buffer = io.StringIO()
    columns = metric_columns(rounds)
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for record in rounds:
        writer.writerow({k: _cell(v) for k, v in record.items()})
    return buffer.getvalue()


def write_metrics_csv(rounds: list[Mapping[str, Any]], path: str | Path) -> Path:
    """Writes :func:`metrics_csv` to ``path`` (atomically, as results.json)."""
    path = Path(path)
    write_text(path, metrics_csv(rounds))
    return path


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics of one round (booleans, text and lists left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


def require_tensorboard() -> None:
    """Raises :class:`ConfigError` with the install command when torch's TensorBoard writer
    cannot be imported (it needs the ``tensorboard`` package, which torch does not require)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(f"--log tensorboard needs the tensorboard package: {TENSORBOARD_INSTALL}"
                          ) from None


class TensorBoardLog:
    """Writes each round's numeric metrics as TensorBoard scalars (step: the round number)
    into ``folder``; a resumed run adds its rounds to the same folder."""

    def __init__(self, folder: str | Path) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def __call__(self, record: Mapping[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=int(record["round"]))
        self.writer.flush()  # a run stopped later keeps the rounds logged so far

    def close(self) -> None:
        self.writer.close()
