"""The tables of ``fedkernels compare``: per method, each metric as mean ± std over seeds
(:func:`seed_statistics`), the AUROC and personalized tables when they apply, and the Semi-VRed
paper's client-by-client comparison with a reference method (:func:`reference_changes`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedkernels.sim.config import ConfigError

METRICS = [  # the accuracy table
    ("test_accuracy", "pooled acc"),
    ("client_accuracy_mean", "avg"),
    ("client_accuracy_mean_weighted", "avg (w)"),
    ("client_accuracy_worst10", "worst-10%"),
    ("client_accuracy_worst10_weighted", "worst-10% (w)"),
    ("client_accuracy_min", "worst"),
    ("client_accuracy_best10", "best-10%"),
    ("client_accuracy_gap", "gap"),
    ("client_accuracy_std", "std"),
    ("client_accuracy_gini", "Gini"),
]
AUROC_METRICS = [  # the AUROC table, over the clients whose AUROC is defined
    ("test_auroc", "pooled AUROC"),
    ("client_auroc_mean", "avg"),
    ("client_auroc_mean_weighted", "avg (w)"),
    ("client_auroc_worst10", "worst-10%"),
    ("client_auroc_worst10_weighted", "worst-10% (w)"),
    ("client_auroc_min", "worst"),
    ("client_auroc_best10", "best-10%"),
    ("client_auroc_gap", "gap"),
    ("client_auroc_clients", "clients"),
]
PERSONALIZED_METRICS = [  # each client's own model on its own test split
    ("personalized_accuracy", "personalized acc"),
    ("personalized_accuracy_worst10", "worst-10%"),
    ("personalized_ece", "ECE ×100"),
    ("personalized_mce", "MCE ×100"),
    ("personalized_accuracy_oracle", "λ chosen on test (SuPerFed's oracle)"),
    ("client_accuracy_mean", "global model avg"),
]
# the global model's figures stand in for a method without personal models
GLOBAL_AS_PERSONAL = {
    "personalized_accuracy": "client_accuracy_mean",
    "personalized_accuracy_worst10": "client_accuracy_worst10",
    "personalized_ece": "client_ece_mean",
    "personalized_mce": "client_mce_mean",
}
COUNTS = {"client_auroc_clients"}  # shown as numbers, not percentages
REFERENCE_SPLITS = ("median", "mean")


def seed_statistics(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Mean and std over seeds of every key of ``rows`` (one dict per seed); a key whose value
    is None in some seeds (an undefined AUROC) is averaged over the others, None in all -> None.
    The std of a single value is None: one seed says nothing about the spread."""
    mean: dict[str, Any] = {}
    std: dict[str, Any] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = np.array([r[key] for r in rows if r.get(key) is not None], dtype=np.float64)
        mean[key] = float(values.mean()) if len(values) else None
        std[key] = float(values.std()) if len(values) > 1 else None
    return mean, std


def reference_changes(
    accuracy: list[float], reference: list[float], split: str = "median"
) -> dict[str, Any]:
    """One seed of the Semi-VRed paper's comparison with a reference method, client by client.

    With r_k the reference's accuracy on client k, a_k the method's and c the median of the r_k
    (``split="mean"``: their mean), the clients with r_k < c are "below" (the suffering clients)
    and those with r_k > c "above" (clients at c are in neither). Returns ``below``/``above``
    (counts), ``improved`` (below with a_k > r_k), ``degraded`` (above with a_k < r_k), their
    ``_fraction``s, ``below_change``/``above_change`` (mean a_k − r_k over each group) and
    ``mean_change`` (over all clients); a fraction or change over an empty group is None."""
    if split not in REFERENCE_SPLITS:
        raise ConfigError(f"reference split must be one of {', '.join(REFERENCE_SPLITS)}, "
                          f"got {split!r}")
    a = np.asarray(accuracy, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if a.shape != r.shape or a.ndim != 1 or len(a) == 0:
        raise ConfigError(
            f"reference comparison needs the same clients: {a.size} against {r.size} accuracies"
        )
    cut = float(np.median(r)) if split == "median" else float(r.mean())
    below, above = r < cut, r > cut
    diff = a - r
    improved, degraded = int((diff[below] > 0).sum()), int((diff[above] < 0).sum())

    def ratio(count: int, group) -> float | None:
        return count / int(group.sum()) if group.any() else None

    return {
        "split_value": cut,
        "below": int(below.sum()),
        "improved": improved,
        "improved_fraction": ratio(improved, below),
        "below_change": float(diff[below].mean()) if below.any() else None,
        "above": int(above.sum()),
        "degraded": degraded,
        "degraded_fraction": ratio(degraded, above),
        "above_change": float(diff[above].mean()) if above.any() else None,
        "mean_change": float(diff.mean()),
    }


def add_reference_comparison(
    entries: list[dict[str, Any]], reference: dict[str, Any], split: str = "median"
) -> None:
    """Adds ``versus_reference`` (per seed :func:`reference_changes`, with mean and std over
    the seeds) to every entry but the reference itself, matching runs by seed."""
    by_seed = {run["seed"]: run for run in reference["runs"]}
    for entry in entries:
        if entry is reference:
            continue
        seeds = []
        for run in entry["runs"]:
            ref = by_seed.get(run["seed"])
            if ref is None:
                raise ConfigError(f"reference {reference['label']} has no run with seed {run['seed']}")
            if run.get("client_test_size") != ref.get("client_test_size"):
                raise ConfigError(
                    f"{entry['label']} and the reference {reference['label']} do not have the same "
                    f"clients in seed {run['seed']}"
                )
            seeds.append({"seed": run["seed"],
                          **reference_changes(run["client_accuracy"], ref["client_accuracy"],
                                              split)})
        mean, std = seed_statistics([{k: v for k, v in s.items() if k != "seed"} for s in seeds])
        entry["versus_reference"] = {"reference": reference["label"], "split": split,
                                     "seeds": seeds, "mean": mean, "std": std}


def find_reference(specs: list[tuple[str, dict[str, str], str]], reference: str) -> int:
    """The index of the method ``reference`` names: a label, else a unique algorithm name."""
    labels = [label for _, _, label in specs]
    if reference in labels:
        return labels.index(reference)
    named = [i for i, (name, _, _) in enumerate(specs) if name == reference]
    if len(named) == 1:
        return named[0]
    if named:
        raise ConfigError(f"--reference {reference}: several methods run {reference} "
                          f"({', '.join(labels[i] for i in named)}); name one by its label")
    raise ConfigError(f"--reference {reference}: not one of the compared methods "
                      f"({', '.join(labels)})")


def _cell(entry: dict[str, Any], key: str) -> str:
    mean, std = entry["mean"].get(key), entry["std"].get(key)
    if mean is None:
        return "—"
    if key in COUNTS:
        return f"{mean:.1f}"
    return f"{100 * mean:.1f}" + ("" if std is None else f" ± {100 * std:.1f}")


def _table(entries: list[dict[str, Any]], metrics: list[tuple[str, str]]) -> list[str]:
    lines = ["| method | " + " | ".join(label for _, label in metrics) + " |",
             "|" + "---|" * (len(metrics) + 1)]
    for entry in entries:
        cells = [_cell(entry, key) for key, _ in metrics]
        lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    return lines


def _reference_table(entries: list[dict[str, Any]]) -> list[str]:
    compared = [e for e in entries if "versus_reference" in e]
    first = compared[0]["versus_reference"]
    where = f"the {first['reference']} {first['split']}"
    lines = [
        f"Client by client against {first['reference']} with the same seed (mean ± std over "
        f"seeds): clients below / above {where} accuracy, the share of them the method improves "
        "/ degrades (mean count in brackets), and mean accuracy changes in points.",
        "",
        "| method | below: improved | below: Δ acc | above: degraded | above: Δ acc | Δ avg |",
        "|---|---|---|---|---|---|",
    ]

    def share(v: dict[str, Any], key: str, count: str, group: str) -> str:
        m, s = v["mean"].get(key), v["std"].get(key)
        if m is None:
            return "—"
        spread = "" if s is None else f" ± {100 * s:.0f}"
        return f"{100 * m:.0f}{spread}% ({v['mean'][count]:.1f} of {v['mean'][group]:.1f})"

    def change(v: dict[str, Any], key: str) -> str:
        m, s = v["mean"].get(key), v["std"].get(key)
        if m is None:
            return "—"
        return f"{100 * m:+.2f}" + ("" if s is None else f" ± {100 * s:.2f}")

    for entry in entries:
        v = entry.get("versus_reference")
        if v is None:
            lines.append(f"| {entry['label']} (reference) | — | — | — | — | — |")
            continue
        lines.append(
            f"| {entry['label']} | {share(v, 'improved_fraction', 'improved', 'below')} | "
            f"{change(v, 'below_change')} | {share(v, 'degraded_fraction', 'degraded', 'above')}"
            f" | {change(v, 'above_change')} | {change(v, 'mean_change')} |"
        )
    return lines


def has_auroc(entries: list[dict[str, Any]]) -> bool:
    """Whether any method has a pooled or per-client AUROC to show."""
    return any(e["mean"].get(k) is not None for e in entries
               for k in ("test_auroc", "client_auroc_mean"))


def has_personal_models(entries: list[dict[str, Any]]) -> bool:
    """Whether any method keeps personal models (its runs report ``personalized_accuracy``)."""
    return any(run.get("personal_models") for e in entries for run in e.get("runs", ()))


def _personalized_table(entries: list[dict[str, Any]]) -> list[str]:
    rows = [
        {**e, "label": e["label"] if any(r.get("personal_models") for r in e["runs"])
         else f"{e['label']} (global model)"}
        for e in entries
    ]
    return [
        "Personalized (%, mean ± std over seeds): each client's own model on its own test split, "
        "mean over clients; ECE and MCE of those models (15 equal-width confidence bins, mean "
        "over clients); a method without personal models is shown with its global model.",
        "",
        *_table(rows, PERSONALIZED_METRICS),
    ]


def markdown_table(entries: list[dict[str, Any]]) -> str:
    """The accuracy table (% , mean ± std over seeds; ``(w)``: weighted by test size), then
    the AUROC table when there is an AUROC, the personalized table when a method keeps
    personal models, then the comparison with ``--reference``."""
    lines = _table(entries, METRICS)
    if has_auroc(entries):
        lines += ["", "AUROC (%; the clients whose test split holds one class are left out, "
                  "'clients' counts the others):", "", *_table(entries, AUROC_METRICS)]
    if has_personal_models(entries):
        lines += ["", *_personalized_table(entries)]
    if any("versus_reference" in e for e in entries):
        lines += ["", *_reference_table(entries)]
    diverged = [f"{e['label']} (seeds {', '.join(map(str, e['diverged_seeds']))})"
                for e in entries if e.get("diverged_seeds")]
    if diverged:
        lines += ["", "Diverged (a global model with NaN/inf entries or an infinite test loss; "
                  f"its numbers above are not those of a trained model): {'; '.join(diverged)}"]
    caveats = [f"{e['label']}: {c}" for e in entries for c in e.get("caveats", [])]
    if caveats:
        lines += ["", "Caveats: " + "; ".join(caveats)]
    return "\n".join(lines) + "\n"
