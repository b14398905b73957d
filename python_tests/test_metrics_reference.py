"""``fedkernels compare --reference``: the Semi-VRed paper's client-by-client comparison with a
reference method (improved clients below its median, degraded clients above it), the
statistics over seeds, and the AUROC and weighted columns of the tables."""

from __future__ import annotations

import json

import pytest

from fedkernels.cli import main
from fedkernels.cli.compare import (
    add_reference_comparison,
    find_reference,
    markdown_table,
    reference_changes,
    seed_statistics,
)
from fedkernels.sim.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_reference_changes_by_hand():
    reference = [0.2, 0.4, 0.6, 0.8, 1.0]  # median 0.6: clients 0, 1 below; 3, 4 above
    method = [0.3, 0.4, 0.9, 0.7, 1.0]
    c = reference_changes(method, reference)
    assert (c["below"], c["improved"], c["above"], c["degraded"]) == (2, 1, 2, 1)
    assert c["improved_fraction"] == 0.5 and c["degraded_fraction"] == 0.5  # ties: neither
    assert c["below_change"] == pytest.approx(0.05)
    assert c["above_change"] == pytest.approx(-0.05)
    assert c["mean_change"] == pytest.approx(0.06)
    assert c["split_value"] == 0.6


def test_reference_split_at_the_mean():
    reference = [0.1, 0.2, 0.3, 1.0]  # mean 0.4, median 0.25
    method = [0.2, 0.2, 0.2, 0.9]
    by_mean = reference_changes(method, reference, "mean")
    assert (by_mean["below"], by_mean["improved"], by_mean["above"], by_mean["degraded"]) == (
        3, 1, 1, 1)
    by_median = reference_changes(method, reference)
    assert (by_median["below"], by_median["improved"], by_median["above"]) == (2, 1, 2)
    assert by_median["degraded"] == 2


def test_empty_groups_and_mismatched_clients():
    c = reference_changes([0.5, 0.6], [0.7, 0.7])  # every client at the median
    assert c["below"] == c["above"] == 0
    assert c["improved_fraction"] is None and c["above_change"] is None
    assert c["mean_change"] == pytest.approx(-0.15)
    with pytest.raises(ConfigError, match="same clients"):
        reference_changes([0.5, 0.6, 0.7], [0.7, 0.7])
    with pytest.raises(ConfigError, match="median, mean"):
        reference_changes([0.5], [0.7], "quantile")


def test_seed_statistics_skip_undefined_values():
    mean, std = seed_statistics([{"a": 0.2, "b": None, "c": None}, {"a": 0.4, "b": 0.5,
                                                                      "c": None}])
    assert mean["a"] == pytest.approx(0.3) and std["a"] == pytest.approx(0.1)
    assert (mean["b"], std["b"]) == (0.5, None)  # one value: no spread
    assert mean["c"] is None and std["c"] is None


def _entry(label: str, runs: list[tuple[int, list[float]]]) -> dict:
    return {"label": label, "runs": [
        {"seed": seed, "client_accuracy": acc, "client_test_size": [10] * len(acc)}
        for seed, acc in runs]}


def test_comparison_is_per_seed_against_the_same_seed():
    reference = _entry("fedavg", [(0, [0.2, 0.5, 0.8]), (1, [0.9, 0.5, 0.1])])
    method = _entry("semi", [(1, [0.8, 0.5, 0.3]), (0, [0.3, 0.5, 0.7])])
    add_reference_comparison([reference, method], reference)
    assert "versus_reference" not in reference
    v = method["versus_reference"]
    assert v["reference"] == "fedavg" and v["split"] == "median"
    seeds = {s["seed"]: s for s in v["seeds"]}
    # seed 0: client 0 (below) improves, client 2 (above) degrades
    assert (seeds[0]["improved"], seeds[0]["degraded"]) == (1, 1)
    # seed 1: reference [0.9, 0.5, 0.1]; client 2 (below) improves, client 0 (above) degrades
    assert (seeds[1]["improved"], seeds[1]["degraded"]) == (1, 1)
    assert v["mean"]["improved_fraction"] == 1.0
    assert v["mean"]["below_change"] == pytest.approx((0.1 + 0.2) / 2)
    other = _entry("other", [(0, [0.3, 0.5])])
    other["runs"][0]["client_test_size"] = [10, 10]
    with pytest.raises(ConfigError, match="same clients"):
        add_reference_comparison([reference, other], reference)


def test_find_reference_by_label_or_name():
    specs = [("fedavg", {}, "FedAvg"), ("vred", {"beta": "0.5"}, "VRed"),
             ("semi-vred", {}, "a"), ("semi-vred", {"beta": "1"}, "b")]
    assert find_reference(specs, "FedAvg") == 0
    assert find_reference(specs, "fedavg") == 0
    assert find_reference(specs, "vred") == 1
    assert find_reference(specs, "b") == 3
    with pytest.raises(ConfigError, match="several methods"):
        find_reference(specs, "semi-vred")
    with pytest.raises(ConfigError, match="not one of the compared methods"):
        find_reference(specs, "qffl")


def test_tables_show_weighted_auroc_and_reference_columns():
    def entry(label, acc, auroc):
        keys = {"test_accuracy": acc, "client_accuracy_mean": acc,
                "client_accuracy_mean_weighted": acc, "test_auroc": auroc,
                "client_auroc_mean": auroc, "client_auroc_clients": 3.0 if auroc else None}
        return {"label": label, "runs": [], "mean": keys,
                "std": {k: 0.0 if v is not None else None for k, v in keys.items()}}

    entries = [entry("fedavg", 0.5, 0.75), entry("semi", 0.6, None)]
    entries[1]["versus_reference"] = {
        "reference": "fedavg", "split": "median",
        "mean": {"improved_fraction": 0.5, "improved": 1.0, "below": 2.0, "below_change": 0.01,
                 "degraded_fraction": None, "degraded": 0.0, "above": 0.0,
                 "above_change": None, "mean_change": 0.02},
        "std": {"improved_fraction": 0.0, "below_change": 0.0, "degraded_fraction": None,
                "above_change": None, "mean_change": 0.0},
    }
    text = markdown_table(entries)
    assert "| avg (w) |" in text and "| worst |" in text and "| gap |" in text
    assert "pooled AUROC" in text and "| fedavg | 75.0 ± 0.0 |" in text
    assert "| 3.0 |" in text  # clients with an AUROC: a count, not a percentage
    assert "| semi | — |" in text.split("pooled AUROC")[1]  # no AUROC: a dash
    assert "| fedavg (reference) |" in text
    assert "| semi | 50 ± 0% (1.0 of 2.0) | +1.00 ± 0.00 | — | — | +2.00 ± 0.00 |" in text


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    code = main([
        "compare", "--algorithms", "fedavg,semi-vred:beta=0.5@semi", "--seeds", "0,1",
        "--set", "rounds=2", "--set", "partition.num_clients=4", "--set", "model.name=logreg",
        "--reference", "fedavg", "--out", str(out), "--threads", "1",
    ])
    assert code == 0
    return out


def test_compare_reference_end_to_end(compared):
    data = json.loads((compared / "compare.json").read_text())
    assert data["reference"] == "fedavg" and data["reference_split"] == "median"
    fedavg, semi = data["entries"]
    assert "versus_reference" not in fedavg
    seeds = semi["versus_reference"]["seeds"]
    assert [s["seed"] for s in seeds] == [0, 1]
    for s, run, ref in zip(seeds, semi["runs"], fedavg["runs"]):
        assert s == {"seed": run["seed"], **reference_changes(run["client_accuracy"],
                                                                ref["client_accuracy"])}
    run = semi["runs"][0]
    assert len(run["client_auroc"]) == len(run["client_accuracy"]) == 4
    for key in ("test_auroc", "client_auroc_mean", "client_accuracy_worst10_weighted",
                "client_accuracy_min", "client_accuracy_gap"):
        assert key in run["summary"] and key in semi["mean"]
    table = (compared / "compare.md").read_text()
    assert "pooled AUROC" in table and "| fedavg (reference) |" in table


def test_bad_reference_fails_before_any_run(tmp_path, capsys):
    out = tmp_path / "never"
    code = main(["compare", "--algorithms", "fedavg,afl", "--reference", "qffl",
                 "--set", "rounds=2", "--out", str(out)])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "--reference qffl: not one of the compared methods (fedavg, afl)" in err
    assert main(["compare", "--algorithms", "fedavg", "--reference-split", "mode",
                 "--out", str(out)]) == 2
    assert main(["compare", "--algorithms", "fedavg,nope", "--out", str(out)]) == 2
    assert not out.exists()
