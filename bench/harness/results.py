"""Where results go. Every run writes a new file
``bench/results/runs/<time>-<device>-<name>.json`` (git-ignored; a CPU ``<device>`` names the
model and the fedkernels CPU build, as in ``cpu-amd-epyc-avx512``), so a quick or partial run
never replaces the committed table; ``--save`` also merges the run into the committed
``bench/results/<device>.json``, and ``--out FILE`` writes the run to FILE instead of
``runs/``. Such a file maps each benchmark's name to its run, ``{name: payload}``. The
comparisons with other frameworks write files of their own (harness.peer_comparisons).
"""

from __future__ import annotations

import datetime
import json
import os

import torch

from .machine import device_name

# bench/results/, beside this package
RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "results")
RUNS_DIR = os.path.join(RESULTS_DIR, "runs")


# Set in the environment of a run that confirms --check's flags
# (harness.regression_check.rerun_ratios): the file to which that run writes its fresh ratios
# instead of checking them. Such a run writes no results.
RECHECK_ENV = "FEDKERNELS_BENCH_RECHECK_TO"


def _merge_into(path: str, name: str, payload: dict) -> None:
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[name] = payload
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def new_run_path(label: str, suffix: str = ".json") -> str:
    """A path under bench/results/runs/ that no earlier run used: ``<UTC time>-<label>``."""
    os.makedirs(RUNS_DIR, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(RUNS_DIR, f"{stamp}-{label}{suffix}")
    count = 2
    while os.path.exists(path):
        path = os.path.join(RUNS_DIR, f"{stamp}-{label}-{count}{suffix}")
        count += 1
    return path


def write_results(name: str, device: torch.device, payload: dict, save: bool = False,
                  out: str | None = None) -> str:
    """Writes ``{name: payload}`` to ``out``, or to a new file under bench/results/runs/; with
    ``save`` also merges it under key ``name`` into the committed bench/results/<device>.json.
    Returns the paths written, joined by " and ". A --check confirmation run (RECHECK_ENV)
    writes nothing."""
    if os.environ.get(RECHECK_ENV):
        return "nothing (a run confirming --check's flags)"
    written = []
    if out:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        path = out
    else:
        path = new_run_path(f"{device_name(device)}-{name}")
    with open(path, "w") as f:
        json.dump({name: payload}, f, indent=1)
        f.write("\n")
    written.append(path)
    if save:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        committed = committed_path(device)
        _merge_into(committed, name, payload)
        written.append(committed)
    return " and ".join(written)


def committed_path(device: torch.device) -> str:
    """The committed results file of this device, bench/results/<device>.json."""
    return os.path.join(RESULTS_DIR, device_name(device) + ".json")
