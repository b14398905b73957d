"""``fedkernels compare``: several strategies over several seeds, one table and one plot.

Every run is a :class:`~fedkernels.sim.run.Simulation` of the same experiment (``--config``
file and ``--set section.field=value`` overrides, as ``fedkernels run`` reads them) with a
different algorithm and seed. For each run the global model is evaluated on every client's
own test split; per run we keep the pooled accuracy and AUROC and the statistics over clients
of the per-client accuracies and AUROCs (:func:`fedkernels.sim.metrics.evaluation_metrics`:
mean, test-size-weighted mean, worst-10%, worst client, best-10%, gap, std, Gini), and the
tables report each as mean ± std over the seeds. A client whose test split holds one class has
no AUROC and is left out of the AUROC statistics; the AUROC table says how many clients remain.

When a method keeps personal models (the personalized baselines, SuPerFed), a further table
reports what it is judged by: each client's own model on the client's own test split
(``personalized_accuracy``, its worst-10%, and the models' ECE and MCE, mean over clients);
methods without personal models appear there with their global model. For SuPerFed the
personalized figure is at the lambda each client picks on its validation rows, and the paper's
test-chosen (oracle) figure is shown beside it.

``--reference NAME`` adds the comparison of the Semi-VRed paper, per seed and client by client
against that method's run with the same seed (hence the same clients): of the clients below the
reference's median accuracy (``--reference-split mean``: its mean), how many the method
improves, and of those above it, how many it degrades (:func:`reference_changes`).

An algorithm is ``NAME`` or ``NAME:key=value,key=value`` (its parameters), optionally with
``@label``::

    fedkernels compare --algorithms fedavg,term:tilt=1,afl:step=0.1 --seeds 0,1,2 \\
        --set partition.kind=dirichlet --set partition.alpha=0.1 --out runs/compare

writes ``compare.json``, ``compare.md`` and ``compare.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedkernels.sim.config import ConfigError, ExperimentConfig, from_dict, set_dotted

from .config_file import load_config_file
from .parsing import (
    Parser,
    algorithm_name,
    check_writable,
    data_warnings,
    missing_extra,
    one_line,
    require_extra,
    set_threads,
)

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


def parse_algorithm(text: str) -> tuple[str, dict[str, str], str]:
    """``"term:tilt=1@TERM"`` -> ``("term", {"tilt": "1"}, "TERM")``."""
    spec, _, label = text.partition("@")
    name, _, params_text = spec.partition(":")
    params = {}
    for item in filter(None, params_text.split(";" if ";" in params_text else ",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--algorithms: parameter {item!r} of {name} needs key=value")
        params[key.strip()] = value.strip()
    return name.strip(), params, label or spec


def base_tree(config_file: str | None, overrides: list[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    if config_file:
        tree = load_config_file(config_file)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        set_dotted(tree, key.strip(), value.strip())
    return tree


def run_one(tree: dict[str, Any], name: str, params: dict[str, str], seed: int) -> dict[str, Any]:
    """One simulation; returns its summary and per-client accuracies."""
    from fedkernels.algorithms import build_strategy
    from fedkernels.sim.run import Simulation

    run_tree = json.loads(json.dumps(tree))
    run_tree["seed"] = seed
    run_tree["algorithm"] = name
    config = from_dict(ExperimentConfig, run_tree)
    start = time.perf_counter()
    result = Simulation(config, build_strategy(name, params)).run()
    summary = {
        k: v for k, v in result.summary.items()
        if k.startswith(("test_", "client_accuracy_", "client_auroc_", "client_ece_",
                         "client_mce_", "personalized_"))
        and (v is None or isinstance(v, (int, float)))
    }
    personal = "personalized_accuracy" in summary
    if not personal:
        for key, source in GLOBAL_AS_PERSONAL.items():
            summary[key] = summary.get(source)
    summary["seconds"] = time.perf_counter() - start
    return {
        "seed": seed,
        "personal_models": personal,
        # results.json's flags of a run that blew up, kept out of the averaged summary
        "diverged": bool(result.summary.get("diverged", False)),
        "non_finite": list(result.summary.get("non_finite", [])),
        "caveats": list(result.summary.get("caveats", [])),
        "summary": summary,
        "client_accuracy": [c["test_accuracy"] for c in result.clients],
        "client_auroc": [c.get("test_auroc") for c in result.clients],
        "client_test_size": [c["num_test"] for c in result.clients],
        "curve": [
            (r["round"], r["test_accuracy"]) for r in result.rounds if "test_accuracy" in r
        ],
    }


def seed_statistics(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Mean and std over seeds of every key of ``rows`` (one dict per seed); a key whose value
    is None in some seeds (an undefined AUROC) is averaged over the others, None in all -> None."""
    mean: dict[str, Any] = {}
    std: dict[str, Any] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = np.array([r[key] for r in rows if r.get(key) is not None], dtype=np.float64)
        mean[key] = float(values.mean()) if len(values) else None
        std[key] = float(values.std()) if len(values) else None
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
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


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
        return (f"{100 * m:.0f} ± {100 * s:.0f}% ({v['mean'][count]:.1f} of "
                f"{v['mean'][group]:.1f})")

    def change(v: dict[str, Any], key: str) -> str:
        m, s = v["mean"].get(key), v["std"].get(key)
        return "—" if m is None else f"{100 * m:+.2f} ± {100 * s:.2f}"

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


def plot(entries: list[dict[str, Any]], path: Path, title: str):
    """Bars of worst-10%/avg/best-10% client accuracy per method, the pooled test accuracy per
    round (mean over seeds; one distinct colour/line style/marker per method, integer round
    ticks), and, when the methods have AUROCs, bars of worst-10%/avg/best-10% client AUROC.
    Returns the (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    auroc = has_auroc(entries)
    fig, axes = plt.subplots(1, 3 if auroc else 2, figsize=(19 if auroc else 13, 4.5))
    bars, curves = axes[0], axes[1]
    x = np.arange(len(entries))
    width = 0.27

    def tail_bars(ax, metric: str, ylabel: str) -> None:
        keys = [(f"{metric}_worst10", "worst-10%"), (f"{metric}_mean", "avg"),
                (f"{metric}_best10", "best-10%")]
        for i, (key, label) in enumerate(keys):
            means = [e["mean"].get(key) for e in entries]
            stds = [e["std"].get(key) for e in entries]
            ax.bar(x + (i - 1) * width, [np.nan if m is None else 100 * m for m in means], width,
                   yerr=[0.0 if s is None else 100 * s for s in stds], label=label, capsize=2)
        ax.set_xticks(x, [e["label"] for e in entries], rotation=40, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)

    tail_bars(bars, "client_accuracy", "client test accuracy (%)")
    if auroc:
        tail_bars(axes[2], "client_auroc", "client test AUROC (%)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    line_styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D", "v", "P"]
    for i, e in enumerate(entries):
        rounds = np.array([[r for r, _ in run["curve"]] for run in e["runs"]])
        acc = np.array([[a for _, a in run["curve"]] for run in e["runs"]])
        curves.plot(rounds[0], 100 * acc.mean(0), label=e["label"],
                    color=colors[i % len(colors)],
                    linestyle=line_styles[(i // len(colors)) % len(line_styles)],
                    marker=markers[i % len(markers)], markersize=3,
                    markevery=max(1, rounds.shape[1] // 10))
    curves.set_xlabel("round")
    curves.xaxis.set_major_locator(MaxNLocator(integer=True))
    curves.set_ylabel("pooled test accuracy (%)")
    curves.legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def compare(
    algorithms: list[str],
    seeds: list[int],
    tree: dict[str, Any],
    out: Path,
    title: str = "",
    progress: bool = True,
    reference: str | None = None,
    reference_split: str = "median",
) -> list[dict[str, Any]]:
    """Runs every algorithm on every seed and writes ``compare.{json,md,png}`` into ``out``.
    ``reference`` (a label or algorithm name among ``algorithms``) adds the client-by-client
    comparison with that method (:func:`add_reference_comparison`). Every algorithm, the
    reference and the output folder are checked (and the folder created) before the first
    run."""
    from fedkernels.algorithms import build_strategy

    specs = [(algorithm_name(name), params, label)
             for name, params, label in map(parse_algorithm, algorithms)]
    if not specs:
        raise ConfigError("--algorithms: no algorithm given")
    labels = [label for _, _, label in specs]
    twice = next((label for k, label in enumerate(labels) if label in labels[:k]), None)
    if twice is not None:  # two rows of one name, and --reference could not tell them apart
        raise ConfigError(f"--algorithms: the label {twice!r} is given twice; give each entry "
                          "its own (ALGORITHM@LABEL)")
    if not seeds:
        raise ConfigError("--seeds: no seed given")
    for name, params, _ in specs:
        build_strategy(name, params)  # an unknown name or parameter fails now, not hours later
    if reference_split not in REFERENCE_SPLITS:
        raise ConfigError(f"--reference-split: expected one of {', '.join(REFERENCE_SPLITS)}, "
                          f"got {reference_split!r}")
    reference_index = None if reference is None else find_reference(specs, reference)
    try:  # now, not after hours of runs
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot create the folder: {err.strerror or err}") from None
    entries = []
    for name, params, label in specs:
        runs = []
        for seed in seeds:
            run = run_one(tree, name, params, seed)
            runs.append(run)
            if progress:
                s = run["summary"]
                personal = (f" personalized {s['personalized_accuracy']:.3f}"
                            if run["personal_models"] else "")
                flag = " DIVERGED" if run["diverged"] else ""
                print(
                    f"{label:>28s} seed {seed}: avg {s['client_accuracy_mean']:.3f} worst10 "
                    f"{s['client_accuracy_worst10']:.3f}{personal} ({s['seconds']:.1f}s){flag}",
                    file=sys.stderr,
                )
        mean, std = seed_statistics([r["summary"] for r in runs])
        entries.append({
            "label": label, "algorithm": name, "params": params, "runs": runs,
            "mean": mean, "std": std,
            "diverged_seeds": [r["seed"] for r in runs if r["diverged"]],
            "caveats": sorted({c for r in runs for c in r["caveats"]}),
        })
    if reference_index is not None:
        add_reference_comparison(entries, entries[reference_index], reference_split)
    meta = {"title": title, "seeds": seeds, "config": tree, "reference": reference,
            "reference_split": reference_split, "entries": entries}
    (out / "compare.json").write_text(json.dumps(meta, indent=1) + "\n")
    table = markdown_table(entries)
    (out / "compare.md").write_text((f"**{title}**\n\n" if title else "") + table)
    plot(entries, out / "compare.png", title)
    return entries


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fedkernels compare",
        description="Run several strategies over several seeds; write a table and a plot.",
    )
    parser.add_argument("--algorithms", required=True,
                        help="comma-separated NAME[:key=value;key=value][@label]")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--config", metavar="FILE", help="YAML/JSON experiment configuration")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one configuration field (repeatable)")
    parser.add_argument("--out", default="runs/compare", help="output folder")
    parser.add_argument("--title", default="", help="title of the table and plot")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--reference", metavar="METHOD",
                        help="label or algorithm name of the method every other one is compared "
                        "with client by client, seed by seed: how many clients below its median "
                        "accuracy improve and how many above it degrade")
    parser.add_argument("--reference-split", choices=REFERENCE_SPLITS, default="median",
                        help="split the reference's clients at its median (default) or mean "
                        "accuracy (the Semi-VRed paper's 'suffering' clients are below the mean)")
    return parser


def split_algorithms(text: str) -> list[str]:
    """Splits on commas that start a new algorithm (parameters use ';' or follow ':')."""
    items: list[str] = []
    for piece in text.split(","):
        if items and "=" in piece and ":" not in piece and "@" not in piece.split("=")[0]:
            items[-1] += "," + piece  # a further key=value of the previous algorithm
        else:
            items.append(piece)
    return [i.strip() for i in items if i.strip()]


def main(argv: list[str] | None = None) -> int:
    """``fedkernels compare ...`` (``argv`` holds what follows the word ``compare``)."""
    argv = sys.argv[2:] if argv is None else list(argv)
    try:
        try:
            args = build_parser().parse_strict(argv)
        except SystemExit as done:  # --help
            return done.code if isinstance(done.code, int) else 0
        if args.threads is not None:
            set_threads(args.threads)
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            raise ConfigError(
                f"--seeds: expected comma-separated integers, got {args.seeds!r}"
            ) from None
        if not seeds:
            raise ConfigError(f"--seeds: no seed given ({args.seeds!r})")
        out = Path(args.out)
        for path in (out, *out.parents):
            if path.exists() and not path.is_dir():
                what = "" if path == out else f": {path}"
                raise ConfigError(f"--out {out}{what} exists and is not a folder")
        check_writable(out)
        require_extra("matplotlib", "plotting")
        tree = base_tree(args.config, args.set)
        with data_warnings("fedkernels compare"):
            entries = compare(split_algorithms(args.algorithms), seeds, tree, out, args.title,
                              reference=args.reference, reference_split=args.reference_split)
    except KeyboardInterrupt:
        print("\ninterrupted; no table was written", file=sys.stderr)
        return 130
    except ConfigError as err:
        print(f"fedkernels compare: error: {one_line(err)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        message = missing_extra(err)
        if message is None:
            raise
        print(f"fedkernels compare: error: {message}", file=sys.stderr)
        return 2
    print(markdown_table(entries))
    return 0

