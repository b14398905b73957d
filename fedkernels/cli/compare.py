"""``fedkernels compare``: several strategies over several seeds, one table and one plot.

Every run is a :class:`~fedkernels.sim.run.Simulation` of the same experiment (``--config``
file and ``--set section.field=value`` overrides, as ``fedkernels run`` reads them) with a
different algorithm and seed. For each run the global model is evaluated on every client's
own test split; per run we keep the pooled accuracy, the mean, std, worst-10%, best-10% and
Gini coefficient of the per-client accuracies (:func:`fedkernels.sim.metrics.distribution_summary`),
and the table reports each as mean ± std over the seeds.

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
from .parsing import Parser, missing_extra, one_line, require_extra

METRICS = [
    ("test_accuracy", "pooled acc"),
    ("client_accuracy_mean", "avg"),
    ("client_accuracy_worst10", "worst-10%"),
    ("client_accuracy_best10", "best-10%"),
    ("client_accuracy_std", "std"),
    ("client_accuracy_gini", "Gini"),
]


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
    summary = {k: result.summary[k] for k, _ in METRICS}
    summary["seconds"] = time.perf_counter() - start
    return {
        "seed": seed,
        "summary": summary,
        "client_accuracy": [c["test_accuracy"] for c in result.clients],
        "curve": [
            (r["round"], r["test_accuracy"]) for r in result.rounds if "test_accuracy" in r
        ],
    }


def markdown_table(entries: list[dict[str, Any]]) -> str:
    header = "| method | " + " | ".join(label for _, label in METRICS) + " |"
    lines = [header, "|" + "---|" * (len(METRICS) + 1)]
    for entry in entries:
        cells = []
        for key, _ in METRICS:
            mean, std = entry["mean"][key], entry["std"][key]
            cells.append(f"{100 * mean:.1f} ± {100 * std:.1f}")
        lines.append(f"| {entry['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(entries: list[dict[str, Any]], path: Path, title: str):
    """Bars of worst-10%/avg/best-10% client accuracy per method, and the pooled test accuracy
    per round (mean over seeds), one distinct colour/line style/marker per method and integer
    round ticks. Returns the (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.5))
    keys = [("client_accuracy_worst10", "worst-10%"), ("client_accuracy_mean", "avg"),
            ("client_accuracy_best10", "best-10%")]
    x = np.arange(len(entries))
    width = 0.27
    for i, (key, label) in enumerate(keys):
        bars.bar(x + (i - 1) * width, [100 * e["mean"][key] for e in entries], width,
                 yerr=[100 * e["std"][key] for e in entries], label=label, capsize=2)
    bars.set_xticks(x, [e["label"] for e in entries], rotation=40, ha="right", fontsize=8)
    bars.set_ylabel("client test accuracy (%)")
    bars.legend(fontsize=8)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    line_styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D", "v", "P"]
    for i, e in enumerate(entries):
        rounds = np.array([[r for r, _ in run["curve"]] for run in e["runs"]])
        acc = np.array([[a for _, a in run["curve"]] for run in e["runs"]])
        curves.plot(rounds[0] + 1, 100 * acc.mean(0), label=e["label"],
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
) -> list[dict[str, Any]]:
    """Runs every algorithm on every seed and writes ``compare.{json,md,png}`` into ``out``."""
    entries = []
    for text in algorithms:
        name, params, label = parse_algorithm(text)
        runs = []
        for seed in seeds:
            run = run_one(tree, name, params, seed)
            runs.append(run)
            if progress:
                s = run["summary"]
                print(
                    f"{label:>28s} seed {seed}: avg {s['client_accuracy_mean']:.3f} worst10 "
                    f"{s['client_accuracy_worst10']:.3f} ({s['seconds']:.1f}s)",
                    file=sys.stderr,
                )
        values = {k: np.array([r["summary"][k] for r in runs]) for k, _ in METRICS}
        entries.append({
            "label": label, "algorithm": name, "params": params, "runs": runs,
            "mean": {k: float(v.mean()) for k, v in values.items()},
            "std": {k: float(v.std()) for k, v in values.items()},
        })
    out.mkdir(parents=True, exist_ok=True)
    meta = {"title": title, "seeds": seeds, "config": tree, "entries": entries}
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
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            raise ConfigError(
                f"--seeds: expected comma-separated integers, got {args.seeds!r}"
            ) from None
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out}: exists and is not a folder")
        require_extra("matplotlib", "plotting")
        tree = base_tree(args.config, args.set)
        entries = compare(split_algorithms(args.algorithms), seeds, tree, out, args.title)
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

