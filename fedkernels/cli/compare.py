"""``fedkernels compare``: one table and one figure over several runs, the seeds of each
configuration grouped; the runs are either finished already, or a sweep it runs itself.

Finished runs: ``fedkernels compare RUN_DIR...`` reads each folder's ``results.json`` (a folder
without one is searched for runs below it; a quoted glob is expanded), groups the runs whose
configurations differ only in the seed (and the device), and labels each group by what sets it
apart from the others (``fedprox, client.lr=0.05``).

A sweep: ``fedkernels compare [run's flags] --sweep KEY=V1,V2 ... --seeds 0-4 --out DIR`` runs
every combination of the swept values (any key of the configuration: ``algorithm``, a section's
field, an algorithm's parameter such as ``fedprox.mu``) for every seed, each with ``fedkernels
run``'s own code into its own folder ``DIR/runs/<label>-seed<k>/`` (config.json, results.json,
metrics.csv, checkpoint). The other flags are ``fedkernels run``'s, and set the base of every
run; an algorithm's flag applies to that algorithm's runs. An ``--out`` that holds a comparison
is refused unless ``--resume`` (keep its finished runs, continue the others from their
checkpoints) or ``--overwrite`` (start again); Ctrl-C keeps the finished runs and tables them.

The older spelling still works: ``--algorithms NAME[:key=value;key=value][@label],...`` and
``--set section.field=value`` (it is a sweep over the algorithm).

The tables (:mod:`.compare_tables`) report each metric as mean ± std over the seeds;
``compare.json`` holds every run's summary, per-client accuracies, curve, resolved
configuration, environment and folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import itertools
import json
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedkernels.sim.config import SECTIONS, ConfigError, ExperimentConfig, from_dict, set_dotted

from .compare_plots import plot
from .compare_tables import (
    AUROC_METRICS,
    COUNTS,
    GLOBAL_AS_PERSONAL,
    METRICS,
    PERSONALIZED_METRICS,
    REFERENCE_SPLITS,
    add_reference_comparison,
    find_reference,
    has_auroc,
    has_personal_models,
    markdown_table,
    reference_changes,
    seed_statistics,
)
from .config_file import load_config_file
from .flags import HelpFormatter, Parser, add_algorithm_flags, add_config_flags
from .parsing import (
    algorithm_name,
    check_writable,
    data_warnings,
    missing_extra,
    one_line,
    require_extra,
    set_threads,
)

__all__ = [
    "AUROC_METRICS", "COUNTS", "GLOBAL_AS_PERSONAL", "METRICS", "PERSONALIZED_METRICS",
    "REFERENCE_SPLITS", "add_reference_comparison", "compare", "compare_runs", "find_reference",
    "has_auroc", "has_personal_models", "main", "markdown_table", "parse_algorithm", "plot",
    "reference_changes", "seed_statistics", "split_algorithms",
]

OUTPUT_NAMES = ("compare.json", "compare.md", "compare.png", "compare.pdf", "compare.svg")
RUNS_DIR = "runs"  # a sweep's runs, one folder each
# configuration keys in which two runs of one method may differ
NOT_A_METHOD = ("seed", "device", "checkpoint_every")
DEFAULT_SEEDS = "0,1,2"


# ---------------------------------------------------------------- the older --algorithms spelling


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


def split_algorithms(text: str) -> list[str]:
    """Splits on commas that start a new algorithm (parameters use ';' or follow ':')."""
    items: list[str] = []
    for piece in text.split(","):
        if items and "=" in piece and ":" not in piece and "@" not in piece.split("=")[0]:
            items[-1] += "," + piece  # a further key=value of the previous algorithm
        else:
            items.append(piece)
    return [i.strip() for i in items if i.strip()]


def base_tree(config_file: str | None, overrides: list[str]) -> dict[str, Any]:
    """``--config`` and ``--set section.field=value`` as a configuration tree."""
    tree: dict[str, Any] = {}
    if config_file:
        tree = load_config_file(config_file)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        set_dotted(tree, key.strip(), value.strip())
    return tree


# ---------------------------------------------------------------- seeds and sweeps


def parse_seeds(text: str) -> list[int]:
    """``"0-4"``, ``"0,2,5"``, ``"0-2,7"``: the seeds, in order, each once."""
    seeds: list[int] = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", item)
        if match is None:
            raise ConfigError(f"--seeds: expected seeds and ranges such as 0,3 or 0-4, got "
                              f"{text!r}")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise ConfigError(f"--seeds: the range {item} runs backwards")
        if last - first >= 10_000:
            raise ConfigError(f"--seeds: the range {item} holds over 10000 seeds")
        seeds += range(first, last + 1)
    if not seeds:
        raise ConfigError(f"--seeds: no seed given ({text!r})")
    return list(dict.fromkeys(seeds))


def split_values(text: str) -> list[str]:
    """The values of ``--sweep KEY=V1,V2``: split at commas outside brackets; a bracketed value
    is a list (``[64,64]`` -> ``64,64``, the list flag's spelling)."""
    values, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            values.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current += char
    values.append(current)
    values = [v.strip() for v in values]
    return [v[1:-1].strip() if v.startswith("[") and v.endswith("]") else v for v in values]


def parse_sweep(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``--sweep KEY=V1,V2`` items as ``(key, values)``, keys in the order given."""
    sweeps: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().removeprefix("--")
        values = split_values(text) if sep else []
        if not key or not sep or not any(values) or not all(values):
            raise ConfigError(f"--sweep {item!r}: expected KEY=VALUE,VALUE,... (a list value in "
                              "brackets: model.hidden=[64,64],[128])")
        if key == "seed":
            raise ConfigError("--sweep seed=...: give the seeds with --seeds (0-4, or 0,3,7)")
        if key in [k for k, _ in sweeps]:
            raise ConfigError(f"--sweep {key} is given twice; list all its values in one")
        if len(set(values)) < len(values):
            raise ConfigError(f"--sweep {item!r}: a value is given twice")
        sweeps.append((key, values))
    return sweeps


# ---------------------------------------------------------------- one run's record


def run_record(results: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """What the comparison keeps of one run's ``results.json``: its summary (the global
    model's figures standing in for personal ones where a method keeps none), per-client
    accuracies, AUROCs and test sizes, the accuracy curve, the resolved configuration, the
    environment and the folder."""
    raw = results["summary"]
    summary = {
        k: v for k, v in raw.items()
        if k.startswith(("test_", "client_accuracy_", "client_auroc_", "client_ece_",
                         "client_mce_", "personalized_"))
        and (v is None or isinstance(v, (int, float)))
    }
    personal = "personalized_accuracy" in summary
    if not personal:
        for key, source in GLOBAL_AS_PERSONAL.items():
            summary[key] = summary.get(source)
    rounds = results["rounds"]
    summary["seconds"] = float(sum(r.get("wall_time_s", 0.0) for r in rounds))
    shift = 1 if rounds and rounds[0].get("round") == 0 else 0  # results.json counted from 0
    config = results["config"]
    return {
        "seed": config.get("seed", 0),
        "personal_models": personal,
        # results.json's flags of a run that blew up, kept out of the averaged summary
        "diverged": bool(raw.get("diverged", False)),
        "non_finite": list(raw.get("non_finite", [])),
        "caveats": list(raw.get("caveats", [])),
        "summary": summary,
        "client_accuracy": [c["test_accuracy"] for c in results["clients"]],
        "client_auroc": [c.get("test_auroc") for c in results["clients"]],
        "client_test_size": [c["num_test"] for c in results["clients"]],
        "curve": [(r["round"] + shift, r["test_accuracy"]) for r in rounds
                  if "test_accuracy" in r],
        "config": config,
        "dataset": results.get("dataset"),
        "environment": results.get("environment", {}),
        "path": None if path is None else str(path),
    }


def method_entry(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of the tables: the runs of one configuration over their seeds."""
    runs = sorted(runs, key=lambda r: r["seed"])
    mean, std = seed_statistics([r["summary"] for r in runs])
    config = runs[0]["config"]
    return {
        "label": label, "algorithm": config.get("algorithm"),
        "params": config.get("algorithm_params", {}), "runs": runs, "mean": mean, "std": std,
        "diverged_seeds": [r["seed"] for r in runs if r["diverged"]],
        "caveats": sorted({c for r in runs for c in r["caveats"]}),
    }


def method_key(config: dict[str, Any]) -> str:
    """The configuration without the keys in which runs of one method differ (the seed)."""
    return json.dumps({k: v for k, v in config.items() if k not in NOT_A_METHOD},
                      sort_keys=True, default=str)


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    """``section.field`` -> value; an algorithm's parameters as ``<algorithm>.<field>``."""
    out = {}
    for key, value in config.items():
        if key in NOT_A_METHOD:
            continue
        if key == "algorithm_params" and isinstance(value, dict):
            for name, v in value.items():
                out[f"{config.get('algorithm')}.{name}"] = v
        elif isinstance(value, dict):
            for name, v in value.items():
                out[f"{key}.{name}"] = v
        else:
            out[key] = value
    return out


def _text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def group_labels(configs: list[dict[str, Any]]) -> list[str]:
    """A label per configuration: the keys whose values set it apart from the others
    (``fedprox, client.lr=0.05``; the algorithm by its name), or its algorithm alone."""
    flats = [_flat(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flats for k in f))

    def varies(key: str) -> bool:
        # an algorithm's parameter, among the runs of that algorithm only
        among = [f for f in flats if key in f] if _is_parameter(key, flats) else flats
        return len({json.dumps(f.get(key), default=str) for f in among}) > 1

    varying = [k for k in keys if varies(k)]
    labels = []
    for config, flat in zip(configs, flats):
        parts = [_text(flat["algorithm"]) if k == "algorithm" else f"{k}={_text(flat.get(k, '—'))}"
                 for k in varying if k == "algorithm" or k in flat]
        labels.append(", ".join(parts) if parts else str(config.get("algorithm")))
    return labels


def _is_parameter(key: str, flats: list[dict[str, Any]]) -> bool:
    return key.split(".", 1)[0] in {str(f.get("algorithm")) for f in flats} and "." in key


# ---------------------------------------------------------------- finished runs


def find_runs(paths: Sequence[str]) -> list[Path]:
    """The run folders ``paths`` name: folders holding results.json, folders searched for
    them below, and globs the shell did not expand."""
    found: list[Path] = []
    for text in paths:
        matches = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
        if not matches:
            raise ConfigError(f"{text}: matches no folder")
        for match in map(Path, matches):
            if (match / "results.json").is_file():
                found.append(match)
                continue
            if not match.is_dir():
                raise ConfigError(f"{match}: no such run folder")
            below = sorted(p.parent for p in match.rglob("results.json"))
            if not below:
                waiting = (match / "checkpoint.pt").is_file()
                raise ConfigError(f"{match}: no results.json in it or below" + (
                    " (the run has not finished: fedkernels run --resume --out "
                    f"{match} finishes it)" if waiting else ""))
            found += below
    return list(dict.fromkeys(p.resolve() for p in found))


def read_run(path: Path) -> dict[str, Any]:
    try:
        results = json.loads((path / "results.json").read_text())
        return run_record(results, path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path / 'results.json'}: not a run's results "
                          f"({type(err).__name__}: {one_line(err)})") from None


def entries_of(records: list[dict[str, Any]],
               labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The records grouped by configuration (in order of first appearance), one entry each;
    ``labels``: a label per method key (default: :func:`group_labels`)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(method_key(record["config"]), []).append(record)
    for runs in groups.values():
        seeds = [r["seed"] for r in runs]
        twice = next((s for k, s in enumerate(seeds) if s in seeds[:k]), None)
        if twice is not None:
            where = [r["path"] for r in runs if r["seed"] == twice]
            raise ConfigError(f"two runs of one configuration with seed {twice}: "
                              f"{' and '.join(map(str, where))}; compare one of them")
    if labels is None:
        names = group_labels([runs[0]["config"] for runs in groups.values()])
        labels = dict(zip(groups, names))
    return [method_entry(labels[key], runs) for key, runs in groups.items()]


def compare_runs(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The entries of the finished runs ``paths`` name (:func:`find_runs`)."""
    return entries_of([read_run(p) for p in find_runs(paths)])


# ---------------------------------------------------------------- planning a sweep


@dataclass
class Planned:
    """One run of a sweep: its method's label, seed, checked configuration and folder."""

    label: str
    seed: int
    config: ExperimentConfig
    folder: str
    tree: dict[str, Any] = dataclasses.field(default_factory=dict)  # as config.json holds it


def _folder_name(label: str, seed: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9._=+-]+", "_", label.replace(", ", "_")).strip("_.") or "run"
    return f"{slug[:100]}-seed{seed}"


def _finish(plans: list[Planned]) -> list[Planned]:
    """Checks every plan (the algorithm and its parameters, now rather than hours later) and
    gives each a folder of its own."""
    from .run import resolved_tree

    labels: dict[str, str] = {}
    for plan in plans:
        plan.tree = resolved_tree(plan.config)
        key = method_key(plan.tree)
        if labels.setdefault(key, plan.label) != plan.label:
            raise ConfigError(f"{labels[key]} and {plan.label} are the same configuration")
    folders: dict[str, int] = {}
    for plan in plans:
        name = _folder_name(plan.label, plan.seed)
        folders[name] = folders.get(name, 0) + 1
        plan.folder = name if folders[name] == 1 else f"{name}-{folders[name]}"
    return plans


def plan_algorithms(algorithms: list[str], seeds: list[int],
                    tree: dict[str, Any]) -> list[Planned]:
    """The older spelling: each ``NAME[:params][@label]`` on the configuration ``tree``."""
    specs = [(algorithm_name(name), params, label)
             for name, params, label in map(parse_algorithm, algorithms)]
    if not specs:
        raise ConfigError("--algorithms: no algorithm given")
    labels = [label for _, _, label in specs]
    twice = next((label for k, label in enumerate(labels) if label in labels[:k]), None)
    if twice is not None:  # two rows of one name, and --reference could not tell them apart
        raise ConfigError(f"--algorithms: the label {twice!r} is given twice; give each entry "
                          "its own (ALGORITHM@LABEL)")
    plans = []
    for name, params, label in specs:
        for seed in seeds:
            run_tree = json.loads(json.dumps(tree))
            run_tree.update(seed=seed, algorithm=name, algorithm_params=params)
            plans.append(Planned(label, seed, from_dict(ExperimentConfig, run_tree), ""))
    return _finish(plans)


def plan_sweep(base: dict[str, Any], sweeps: list[tuple[str, list[str]]],
               seeds: list[int], file_tree: dict[str, Any] | None = None) -> list[Planned]:
    """Every combination of the swept values for every seed, on the base flags ``base``
    (``fedkernels run``'s configuration flags, ``{"partition.alpha": 0.3}``) over the
    ``--config`` file's tree ``file_tree``."""
    from fedkernels.algorithms.registry import strategy_class

    from .run import resolve_config

    combos = list(itertools.product(*[values for _, values in sweeps])) or [()]
    algorithms_used: set[str] = set()
    plans = []
    for combo in combos:
        flags = {**base, **{key: value for (key, _), value in zip(sweeps, combo)}}
        tree = json.loads(json.dumps(file_tree or {}))
        chosen = flags.get("algorithm", tree.get("algorithm", "fedavg"))
        algorithm = strategy_class(algorithm_name(str(chosen))).name
        algorithms_used.add(algorithm)
        for key, value in flags.items():
            head, _, param = key.partition(".")
            if param and head not in SECTIONS:
                if head == algorithm:  # an algorithm's flags apply to its runs only
                    tree.setdefault("algorithm_params", {})[param] = value
                continue
            set_dotted(tree, key, value)
        config = resolve_config(tree)
        label = ", ".join((_text(value) if key == "algorithm" else f"{key}={value}")
                          for (key, _), value in zip(sweeps, combo)) or algorithm
        plans += [Planned(label, seed, dataclasses.replace(config, seed=seed), "")
                  for seed in seeds]
    for key in list(base) + [k for k, _ in sweeps]:
        head = key.split(".", 1)[0]
        if "." in key and head not in SECTIONS and head not in algorithms_used:
            raise ConfigError(f"--{key} is a parameter of {head}, which none of the runs uses "
                              f"(their algorithms: {', '.join(sorted(algorithms_used))})")
    return _finish(plans)


# ---------------------------------------------------------------- running a sweep


def _progress_line(label: str, record: dict[str, Any], note: str = "") -> str:
    s = record["summary"]
    personal = (f" personalized {s['personalized_accuracy']:.3f}"
                if record["personal_models"] else "")
    flag = " DIVERGED" if record["diverged"] else ""
    return (f"{label:>28s} seed {record['seed']}: avg {s['client_accuracy_mean']:.3f} worst10 "
            f"{s['client_accuracy_worst10']:.3f}{personal} ({s['seconds']:.1f}s){note}{flag}")


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in dict.fromkeys([*a, *b])
                for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def run_planned(plan: Planned, folder: Path, resume: bool) -> tuple[dict[str, Any], str]:
    """Runs ``plan`` into ``folder`` (with ``resume``: reuses a finished run of the same
    configuration there, continues one from its checkpoint); returns its results and a note
    for the progress line."""
    from .run import run_experiment

    saved = folder / "config.json"
    if resume and saved.is_file():
        try:
            tree = json.loads(saved.read_text())
        except (OSError, ValueError):
            tree = None
        changed = _differences(tree, plan.tree) if isinstance(tree, dict) else ["config.json"]
        if changed and ((folder / "results.json").is_file()
                        or (folder / "checkpoint.pt").is_file()):
            raise ConfigError(f"--resume: {folder} holds a run of another configuration (it "
                              f"differs in {', '.join(changed[:3])}): --overwrite starts the "
                              "comparison again")
        if (folder / "results.json").is_file():
            return json.loads((folder / "results.json").read_text()), " (finished before)"
        if (folder / "checkpoint.pt").is_file():
            return run_experiment(plan.config, folder, resume=True, progress=False,
                                  plots=False), " (continued)"
    return run_experiment(plan.config, folder, overwrite=True, progress=False, plots=False), ""


def run_sweep(plans: list[Planned], out: Path, *, resume: bool = False,
              progress: bool = True) -> list[dict[str, Any]]:
    """Runs every plan into ``out/runs/<folder>``; returns the records of those that finished.
    On Ctrl-C, :class:`Interrupted` carries the records finished so far."""
    records = []
    try:
        for plan in plans:
            results, note = run_planned(plan, out / RUNS_DIR / plan.folder, resume)
            record = run_record(results, out / RUNS_DIR / plan.folder)
            record["label"] = plan.label
            records.append(record)
            if progress:
                print(_progress_line(plan.label, record, note), file=sys.stderr)
    except KeyboardInterrupt as stop:
        raise Interrupted(records, len(plans)) from stop
    return records


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep, with the records of the runs finished before it."""

    def __init__(self, records: list[dict[str, Any]], planned: int) -> None:
        super().__init__()
        self.records, self.planned = records, planned


def sweep_entries(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of a sweep's records, labelled as planned."""
    labels = {method_key(r["config"]): r["label"] for r in records}
    return entries_of(records, labels)


# ---------------------------------------------------------------- the output folder


def check_out(out: Path, *, resume: bool = False, overwrite: bool = False,
              sweep: bool = True) -> None:
    """Refuses an --out that cannot be a folder, or that holds a comparison when neither
    ``resume`` (a sweep's) nor ``overwrite`` says what to do with it."""
    if resume and overwrite:
        raise ConfigError("--resume keeps the comparison in --out and --overwrite replaces it: "
                          "give one of them")
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            what = "" if path == out else f": {path}"
            raise ConfigError(f"--out {out}{what} exists and is not a folder")
    taken = [n for n in (*OUTPUT_NAMES, RUNS_DIR) if (out / n).exists()] if out.is_dir() else []
    if taken and not (overwrite or (resume and sweep)):
        how = ("add --resume to keep its finished runs and run the others, or --overwrite to "
               "start again") if sweep else "add --overwrite to replace its table and figures"
        raise ConfigError(f"--out {out} already holds a comparison ({', '.join(taken)}): {how}")
    if resume and not sweep:
        raise ConfigError("--resume continues a sweep; finished runs are only read")


def clear_out(out: Path, *, runs: bool) -> None:
    """``--overwrite``: removes the comparison's files (and, for a sweep, its runs)."""
    for name in OUTPUT_NAMES:
        (out / name).unlink(missing_ok=True)
    if runs:
        shutil.rmtree(out / RUNS_DIR, ignore_errors=True)


def default_out() -> Path:
    """``runs/compare``, or the first free ``runs/compare-N``."""
    base = Path("runs") / "compare"
    count = 1
    while True:
        out = base if count == 1 else base.with_name(f"compare-{count}")
        if not out.exists():
            return out
        count += 1


# ---------------------------------------------------------------- writing


def write_outputs(entries: list[dict[str, Any]], out: Path, *, title: str = "",
                  reference: str | None = None, reference_split: str = "median",
                  sweep: list[tuple[str, list[str]]] | None = None,
                  plots: bool = True) -> None:
    """``compare.json``, ``compare.md`` and the figure into ``out``."""
    if reference is not None:
        specs = [(e["algorithm"], e["params"], e["label"]) for e in entries]
        add_reference_comparison(entries, entries[find_reference(specs, reference)],
                                 reference_split)
    seeds = sorted({r["seed"] for e in entries for r in e["runs"]})
    meta = {"title": title, "seeds": seeds, "sweep": sweep, "reference": reference,
            "reference_split": reference_split, "entries": entries}
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    table = markdown_table(entries)
    (out / "compare.md").write_text((f"**{title}**\n\n" if title else "") + table)
    if plots:
        plot(entries, out / "compare.png", title)


# ---------------------------------------------------------------- the Python entry point


def compare(
    algorithms: list[str],
    seeds: list[int],
    tree: dict[str, Any],
    out: Path,
    title: str = "",
    progress: bool = True,
    reference: str | None = None,
    reference_split: str = "median",
    resume: bool = False,
) -> list[dict[str, Any]]:
    """Runs every algorithm (``NAME[:key=value;...][@label]``) on every seed of the
    configuration ``tree``, each run in ``out/runs/<label>-seed<k>``, and writes
    ``compare.{json,md,png}`` into ``out``; returns the entries. A previous comparison in
    ``out`` is replaced, or, with ``resume``, its finished runs are kept. Every algorithm, the
    reference and the output folder are checked before the first run."""
    if not seeds:
        raise ConfigError("--seeds: no seed given")
    plans = plan_algorithms(algorithms, seeds, tree)
    if reference_split not in REFERENCE_SPLITS:
        raise ConfigError(f"--reference-split: expected one of {', '.join(REFERENCE_SPLITS)}, "
                          f"got {reference_split!r}")
    if reference is not None:  # now, not after hours of runs
        labels = list(dict.fromkeys(p.label for p in plans))
        names = {p.label: p.config.algorithm for p in plans}
        find_reference([(names[label], {}, label) for label in labels], reference)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot create the folder: {err.strerror or err}") from None
    if not resume:
        clear_out(out, runs=True)
    records = run_sweep(plans, out, resume=resume, progress=progress)
    entries = sweep_entries(records)
    write_outputs(entries, out, title=title, reference=reference,
                  reference_split=reference_split)
    return entries


# ---------------------------------------------------------------- the command line

def build_parser(help_only: bool = False) -> Parser:
    """``fedkernels compare``'s parser: its own options, and every configuration flag of
    ``fedkernels run`` (not listed; ``help_only``: from the saved algorithm options)."""
    parser = Parser(
        prog="fedkernels compare",
        usage="%(prog)s RUN_DIR... [--out DIR]\n"
        "       %(prog)s [RUN FLAGS] --sweep KEY=V1,V2 ... [--seeds 0-4] [--out DIR] "
        "[--resume | --overwrite]",
        description="Table and plot finished runs, grouping the seeds of each configuration; "
        "or run a sweep (every combination of the --sweep values, every seed, each run in its "
        "own folder under --out/runs) and table it.",
        epilog="Every configuration flag of fedkernels run (--rounds, --partition.alpha, "
        "--fedprox.mu, ...; see fedkernels run --help) sets the base of a sweep's runs; an "
        "algorithm's flag applies to its runs. The older spelling --algorithms "
        "NAME[:key=value;...][@label],... with --set KEY=VALUE still works.",
        formatter_class=CompareHelpFormatter,
    )
    parser.add_argument("runs", nargs="*", metavar="RUN_DIR",
                        help="finished runs: folders holding results.json, or folders and globs "
                        "searched for them")
    parser.add_argument("--sweep", action="append", metavar="KEY=V1,V2",
                        help="run every value of KEY (any configuration key: algorithm, "
                        "client.lr, fedprox.mu, ...; a list value in brackets, [64,64]); "
                        "repeat for a grid")
    parser.add_argument("--seeds", metavar="SEEDS",
                        help=f"seeds of every configuration: 0-4, 0,3,7 (default: {DEFAULT_SEEDS})")
    parser.add_argument("--out", metavar="DIR",
                        help="output folder (default: runs/compare, -2, -3, ... if taken)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished runs of the sweep in --out, run the others")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the comparison in --out")
    parser.add_argument("--title", default="", help="title of the table and figure "
                        "(default: what the runs share)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--no-plots", action="store_true", help="no figure")
    parser.add_argument("--no-progress", action="store_true", help="no line per run")
    parser.add_argument("--reference", metavar="METHOD",
                        help="label or algorithm name of the method every other one is compared "
                        "with client by client, seed by seed: how many clients below its median "
                        "accuracy improve and how many above it degrade")
    parser.add_argument("--reference-split", choices=REFERENCE_SPLITS, default="median",
                        help="split the reference's clients at its median (default) or mean "
                        "accuracy (the Semi-VRed paper's 'suffering' clients are below the mean)")
    parser.add_argument("--config", metavar="FILE", help="YAML/JSON base configuration")
    parser.add_argument("--algorithms", help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", help=argparse.SUPPRESS)
    # --seed is --seeds here; a misspelled --seed gets that hint
    add_config_flags(parser, skip=("seed",), hidden=True)
    if help_only:  # the help lists none of them
        return parser
    import fedkernels.algorithms  # noqa: F401  (registers the built-in algorithms)
    from fedkernels.algorithms.registry import registered, strategy_class

    for name in registered():
        add_algorithm_flags(parser, name, strategy_class(name).config_class, hidden=True)
    return parser


class CompareHelpFormatter(HelpFormatter):
    """The epilog wrapped (the run's help lays its own out)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def _fail(message: object) -> int:
    print(f"fedkernels compare: error: {one_line(message)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """``fedkernels compare ...`` (``argv`` holds what follows the word ``compare``)."""
    argv = sys.argv[2:] if argv is None else list(argv)
    out: Path | None = None
    args = None
    try:
        parser = build_parser(help_only=any(f in argv for f in ("-h", "--help")))
        try:
            args, given = parser.parse_given(argv)
        except SystemExit as done:  # --help
            return done.code if isinstance(done.code, int) else 0
        args.sweep, args.set = args.sweep or [], args.set or []
        if args.threads is not None:
            set_threads(args.threads)
        base = {parser.shown_key(dest): value for dest, value in given.items()}
        sweep_mode = bool(args.sweep or args.algorithms or base or args.set or args.config
                          or args.seeds)
        if not args.runs and not sweep_mode:
            raise ConfigError("nothing to compare: give finished runs (fedkernels compare "
                              "RUN_DIR...) or a sweep (--sweep KEY=V1,V2 with run's flags)")
        if args.runs and args.seeds:
            raise ConfigError("--seeds chooses the seeds of a sweep; finished runs bring their "
                              "own")
        if args.runs and sweep_mode:
            raise ConfigError("give finished runs (RUN_DIR...) or a sweep's flags, not both")
        out = Path(args.out) if args.out else default_out()
        check_out(out, resume=args.resume, overwrite=args.overwrite, sweep=sweep_mode)
        check_writable(out)
        if not args.no_plots:
            require_extra("matplotlib", "plotting", "--no-plots")
        if not sweep_mode:
            entries = compare_runs(args.runs)
            if args.reference is not None:
                find_reference([(e["algorithm"], e["params"], e["label"]) for e in entries],
                               args.reference)
            if args.overwrite:
                clear_out(out, runs=False)
            title = args.title or default_title(entries)
            write_outputs(entries, out, title=title, reference=args.reference,
                          reference_split=args.reference_split, plots=not args.no_plots)
            print((out / "compare.md").read_text() + f"-> {out}")
            return 0
        seeds = parse_seeds(args.seeds or DEFAULT_SEEDS)
        sweeps = parse_sweep(args.sweep)
        keys = [parser.shown_key(dest) for dest in parser.field_types]
        for key, _ in sweeps:
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(f"--sweep {key}: not a key of the configuration{hint}")
        if args.algorithms is not None:
            if args.sweep or base:
                raise ConfigError("--algorithms (the older spelling) goes with --set; with "
                                  "--sweep and run's flags, sweep the algorithm: "
                                  "--sweep algorithm=fedavg,fedprox")
            plans = plan_algorithms(split_algorithms(args.algorithms), seeds,
                                    base_tree(args.config, args.set))
        else:
            if args.set:
                raise ConfigError("--set goes with --algorithms (the older spelling); with "
                                  "--sweep, give run's flags: --partition.alpha 0.3")
            file_tree = load_config_file(args.config) if args.config else None
            plans = plan_sweep(base, sweeps, seeds, file_tree)
        if args.reference is not None:
            labels = list(dict.fromkeys(p.label for p in plans))
            names = {p.label: p.tree["algorithm"] for p in plans}
            find_reference([(names[label], {}, label) for label in labels], args.reference)
        out.mkdir(parents=True, exist_ok=True)
        if args.overwrite:
            clear_out(out, runs=True)
        with data_warnings("fedkernels compare"):
            try:
                records = run_sweep(plans, out, resume=args.resume,
                                    progress=not args.no_progress)
            except Interrupted as stop:
                if stop.records:
                    entries = sweep_entries(stop.records)
                    write_outputs(entries, out, title=args.title or default_title(entries),
                                  sweep=sweeps or None, plots=not args.no_plots)
                    done = "the table holds those"
                else:
                    done = "no table was written"
                command = " ".join(["fedkernels", "compare", *_without(argv, "--overwrite"),
                                    *(["--out", str(out)] if not args.out else []),
                                    *([] if args.resume else ["--resume"])])
                print(f"\ninterrupted after {len(stop.records)} of {stop.planned} runs; {done}; "
                      f"continue with: {command}" if stop.records
                      else "\ninterrupted; no table was written", file=sys.stderr)
                return 130
        entries = sweep_entries(records)
        write_outputs(entries, out, title=args.title or default_title(entries),
                      reference=args.reference, reference_split=args.reference_split,
                      sweep=sweeps or None, plots=not args.no_plots)
    except KeyboardInterrupt:
        print("\ninterrupted; no table was written", file=sys.stderr)
        return 130
    except ConfigError as err:
        return _fail(err)
    except ModuleNotFoundError as err:
        message = missing_extra(err)
        if message is None:
            raise
        return _fail(message)
    print((out / "compare.md").read_text() + f"-> {out}")
    return 0


def _without(argv: list[str], flag: str) -> list[str]:
    import shlex

    return [shlex.quote(a) for a in argv if a != flag]


def default_title(entries: list[dict[str, Any]]) -> str:
    """What every compared run shares, in words: the method when there is one, the model and
    data, the split, clients, participation and rounds (the differences are the labels)."""
    from fedkernels.sim.plots import describe_method, describe_setting

    runs = [r for e in entries for r in e["runs"]]
    if not runs:
        return ""
    settings = [describe_setting(r["config"], r.get("dataset"), len(r["client_accuracy"]))
                for r in runs]
    shared = [v for k, v in settings[0].items() if v and all(s[k] == v for s in settings)]
    methods = {describe_method(r["config"]) for r in runs}
    return ", ".join(([methods.pop()] if len(methods) == 1 else []) + shared)
