"""The personalized tables of docs/results/superfed.md from ``fedkernels compare`` results.

``fedkernels compare`` runs the experiments and its personalized table gives mean ± std over
seeds. This script reads one or more of its ``compare.json`` files and prints the longer table
of docs/results/superfed.md: per-seed values of the personalized accuracy, SuPerFed's lambda choices
side by side (validation rows, the rows it trains on, the test split itself), ECE and MCE, the
global model, and the measured seconds per run::

    python experiments/personalized_digits.py experiments/personalized_digits_clean.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

COLUMNS = [  # (summary key, header, scale): scale 100 shows percent / ECE x100
    ("personalized_accuracy", "personalized (λ on validation for SuPerFed)", 100),
    ("personalized_accuracy_worst10", "worst-10%", 100),
    ("personalized_ece", "ECE ×100", 100),
    ("personalized_mce", "MCE ×100", 100),
    ("personalized_accuracy_train_selected", "SuPerFed: λ on train", 100),
    ("personalized_accuracy_oracle", "SuPerFed: λ on test (paper, oracle)", 100),
    ("personalized_lambda_mean", "mean λ", 1),
    ("client_accuracy_mean", "global model", 100),
]


def cell(values: list[float], scale: float, seeds: bool) -> str:
    """``mean ± std`` (population std over seeds), with the per-seed values in brackets."""
    if not values:
        return "–"
    a = scale * np.asarray(values, dtype=np.float64)
    digits = 1 if scale == 100 else 2
    text = f"{a.mean():.{digits}f} ± {a.std():.{digits}f}"
    if seeds:
        text += " [" + ", ".join(f"{v:.{digits}f}" for v in a) + "]"
    return text


def merged(paths: list[Path]) -> dict:
    """One compare result from several (e.g. seeds run in separate batches): entries with the
    same label pool their runs, in file order; a seed that appears twice for a label is an
    error, not a silent duplicate."""
    data = json.loads(paths[0].read_text())
    by_label = {e["label"]: e for e in data["entries"]}
    for path in paths[1:]:
        for e in json.loads(path.read_text())["entries"]:
            if e["label"] not in by_label:
                by_label[e["label"]] = e
                data["entries"].append(e)
                continue
            seen = {run["seed"] for run in by_label[e["label"]]["runs"]}
            again = seen & {run["seed"] for run in e["runs"]}
            if again:
                raise SystemExit(f"{path}: {e['label']} seeds {sorted(again)} already given")
            by_label[e["label"]]["runs"] += e["runs"]
    return data


def table(
    path: Path | list[Path], seeds_for: set[str], only_seeds: set[int] | None = None,
    labels: list[str] | None = None,
) -> str:
    """The markdown table of one compare.json (or of several pooled, see :func:`merged`);
    per-seed values for the keys in ``seeds_for``; only the runs with a seed in ``only_seeds``
    and the methods in ``labels`` when given."""
    data = merged(path) if isinstance(path, list) else json.loads(path.read_text())
    if labels is not None:
        data["entries"] = [e for e in data["entries"] if e["label"] in labels]
    if only_seeds is not None:
        for e in data["entries"]:
            e["runs"] = [run for run in e["runs"] if run["seed"] in only_seeds]
    columns = [c for c in COLUMNS if any(
        c[0] in run["summary"] and (c[0] in GLOBAL_KEYS or run.get("personal_models"))
        for e in data["entries"] for run in e["runs"])]
    lines = ["| method | " + " | ".join(h for _, h, _ in columns) + " | s per run |",
             "|" + "---|" * (len(columns) + 2)]
    for e in data["entries"]:
        personal = all(run.get("personal_models") for run in e["runs"])
        cells = []
        for key, _, scale in columns:
            shown = personal or key in GLOBAL_KEYS
            values = [run["summary"][key] for run in e["runs"] if key in run["summary"]]
            cells.append(cell(values, scale, key in seeds_for) if shown else "–")
        seconds = np.mean([run["summary"]["seconds"] for run in e["runs"]])
        label = e["label"] if personal else f"{e['label']} (global model)"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {seconds:.0f} |")
    return "\n".join(lines)


# shown for a method without personal models too (its global model stands in)
GLOBAL_KEYS = {"personalized_accuracy", "personalized_accuracy_worst10", "personalized_ece",
               "personalized_mce", "client_accuracy_mean"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="compare.json files")
    parser.add_argument("--seeds", default="personalized_accuracy",
                        help="comma-separated keys shown with per-seed values")
    parser.add_argument("--only-seeds", help="comma-separated seeds: leave the other runs out")
    parser.add_argument("--labels", help="comma-separated method labels: leave the others out")
    parser.add_argument("--merge", action="store_true",
                        help="one table: pool the runs of methods with the same label across files")
    args = parser.parse_args()
    only = None if args.only_seeds is None else {int(s) for s in args.only_seeds.split(",")}
    labels = None if args.labels is None else args.labels.split(",")
    if args.merge:
        names = " + ".join(str(p) for p in args.files)
        print(f"{names}:\n\n{table(args.files, set(args.seeds.split(',')), only, labels)}\n")
        return
    for path in args.files:
        print(f"{path}:\n\n{table(path, set(args.seeds.split(',')), only, labels)}\n")


if __name__ == "__main__":
    main()
