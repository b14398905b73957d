"""What ``--config`` reads is bounded before anything looks at it: the file's size, the tree's
size with YAML aliases counted once per use, its depth, a tree that holds itself; errors quote
values in a bounded number of characters; a path that is not a file (a directory, a device)
is named as what it is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("yaml")

from fedkernels.cli import main  # noqa: E402
from fedkernels.cli.config_file import MAX_BYTES, MAX_DEPTH, MAX_VALUES, load_config_file  # noqa: E402
from fedkernels.sim.config import ConfigError, ExperimentConfig, from_dict, show  # noqa: E402


def _alias_bomb(levels: int = 9, width: int = 9, under: str = "x") -> str:
    """A few hundred bytes of YAML whose aliases expand to ``width ** levels`` strings."""
    lines = [f"{under}:", '  a: &a [' + ",".join(['"lol"'] * width) + "]"]
    previous = "a"
    for name in "bcdefghijklmnop"[:levels - 1]:
        lines.append(f"  {name}: &{name} [" + ",".join([f"*{previous}"] * width) + "]")
        previous = name
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("tail", ["", "data: *i\n", "rounds: *i\n", "algorithm: *i\n"])
def test_a_yaml_alias_bomb_is_refused_by_its_expanded_size(tmp_path, tail, capsys):
    text = _alias_bomb() + tail
    assert len(text.encode()) < 500
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"more than {MAX_VALUES} values"):
        load_config_file(path)
    assert main(["run", "--config", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"more than {MAX_VALUES} values" in err and len(err) < 1000


def test_aliases_within_the_budget_still_work(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("rounds: &r 3\neval_every: *r\nclient: &c {lr: 0.05}\n")
    assert load_config_file(path) == {"rounds": 3, "eval_every": 3, "client": {"lr": 0.05}}


def test_a_tree_that_holds_itself_is_refused(tmp_path):
    path = tmp_path / "cycle.yaml"
    path.write_text("x: &a [1, *a]\n")
    with pytest.raises(ConfigError, match="holds it; a configuration must be a finite tree"):
        load_config_file(path)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 5, 50_000])
def test_deep_nesting_is_refused(tmp_path, depth):
    path = tmp_path / "deep.json"
    path.write_text('{"x": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ConfigError, match="nested"):
        load_config_file(path)


def test_a_file_beyond_the_size_bound_is_refused(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"x": "y" * MAX_BYTES}))
    with pytest.raises(ConfigError, match="larger than 1024 KiB"):
        load_config_file(path)


def test_a_directory_or_a_device_is_named_as_such(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path), "--no-progress"]) == 2
    assert f"--config: {tmp_path} is a directory" in capsys.readouterr().err
    for device in ("/dev/zero", "/dev/null"):
        if Path(device).exists():
            with pytest.raises(ConfigError, match=f"{device} is a character device"):
                load_config_file(device)
    with pytest.raises(ConfigError, match="no such file"):
        load_config_file(tmp_path / "absent.yaml")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_pipe_is_read_like_a_file(tmp_path):
    """``--config <(generate)`` hands over a pipe: read, within the same size bound."""
    import threading

    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_text('{"rounds": 2}'))
    writer.start()
    try:
        assert load_config_file(pipe) == {"rounds": 2}
    finally:
        writer.join(10)


def test_errors_quote_values_in_bounded_length():
    bomb = ["lol"] * 6
    for _ in range(7):
        bomb = [bomb] * 6  # 6^8 strings held by reference: tens of megabytes spelled out
    for tree, where in [({"data": bomb}, "data: expected a mapping"),
                        ({"rounds": bomb}, "rounds: expected an integer"),
                        ({"client": {"lr": bomb}}, "client.lr: expected a number"),
                        ({"seed": "9" * 10**6 + "x"}, "seed: expected an integer"),
                        ({"k" * 10**6: 1}, "unknown key 'kkk")]:
        with pytest.raises(ConfigError) as info:
            from_dict(ExperimentConfig, tree)
        assert where in str(info.value) and len(str(info.value)) < 3000
    assert len(show(bomb)) < 3000 and len(show("x" * 10**6)) < 100
