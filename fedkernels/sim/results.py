"""The outcome of a run and its ``results.json`` form."""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .atomic_files import write_text
from .provenance import provenance


@dataclass
class RunResult:
    """``config`` (the resolved experiment), ``rounds`` (one metrics dict per round, evaluation
    keys only on evaluated rounds), ``clients`` (final per-client metrics), ``summary`` and
    ``data_preparation`` (what the data loader did: label mapping, encoded, imputed and
    standardised columns; empty for the built-in data sets)."""

    config: dict[str, Any]
    dataset: str
    rounds: list[dict[str, Any]]
    clients: list[dict[str, Any]]
    summary: dict[str, Any]
    data_preparation: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(
        default_factory=lambda: {
            **provenance(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
    )

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "dataset": self.dataset,
            "data_preparation": self.data_preparation,
            "summary": self.summary,
            "rounds": self.rounds,
            "clients": self.clients,
            "environment": self.environment,
        }

    def write_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path
