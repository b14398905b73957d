"""experiments/personalized_digits.py: the long personalized table from a compare.json (per-seed
values, SuPerFed-only columns left empty for the others, seed and method filters)."""

from __future__ import annotations

import json
from pathlib import Path

from script_modules import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "personalized_digits.py"


def load():
    return load_script(SCRIPT)


def run(seed, personal, **summary):
    return {"seed": seed, "personal_models": personal, "summary": {"seconds": 10.0, **summary}}


def test_table(tmp_path):
    data = {"entries": [
        {"label": "fedavg", "runs": [
            run(0, False, personalized_accuracy=0.5, client_accuracy_mean=0.5),
            run(1, False, personalized_accuracy=0.7, client_accuracy_mean=0.7),
        ]},
        {"label": "MM", "runs": [
            run(0, True, personalized_accuracy=0.8, personalized_accuracy_oracle=0.9,
                personalized_lambda_mean=0.25, client_accuracy_mean=0.4),
            run(1, True, personalized_accuracy=0.6, personalized_accuracy_oracle=0.7,
                personalized_lambda_mean=0.75, client_accuracy_mean=0.6),
        ]},
    ]}
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(data))
    module = load()
    lines = module.table(path, {"personalized_accuracy"}).splitlines()
    assert "SuPerFed: λ on test (paper, oracle)" in lines[0]
    assert "λ on train" not in lines[0]  # no run reports it
    assert lines[2] == "| fedavg (global model) | 60.0 ± 10.0 [50.0, 70.0] | – | – | 60.0 ± 10.0 | 10 |"
    assert lines[3] == ("| MM | 70.0 ± 10.0 [80.0, 60.0] | 80.0 ± 10.0 | 0.50 ± 0.25 | "
                        "50.0 ± 10.0 | 10 |")
    one = module.table(path, set(), {1}, ["MM"]).splitlines()
    assert len(one) == 3 and one[2].startswith("| MM | 60.0 ± 0.0 | 70.0 ± 0.0 | 0.75 ± 0.00")


def test_merge_pools_seeds_across_files_and_refuses_a_seed_twice(tmp_path):
    first = {"entries": [{"label": "L=0", "runs": [run(0, True, personalized_accuracy=0.5)]}]}
    second = {"entries": [{"label": "L=0", "runs": [run(3, True, personalized_accuracy=0.7)]},
                          {"label": "L=1", "runs": [run(3, True, personalized_accuracy=0.9)]}]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    module = load()
    pooled = module.merged([a, b])
    assert [e["label"] for e in pooled["entries"]] == ["L=0", "L=1"]
    assert [r["seed"] for r in pooled["entries"][0]["runs"]] == [0, 3]
    row = next(line for line in module.table([a, b], {"personalized_accuracy"}).splitlines()
               if line.startswith("| L=0 "))
    assert "60.0 ± 10.0 [50.0, 70.0]" in row
    try:
        module.merged([a, a])
    except SystemExit as e:
        assert "seeds [0] already given" in str(e)
    else:
        raise AssertionError("a seed given twice must be refused")
