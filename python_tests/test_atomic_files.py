"""Run files are written whole or not at all (fedkernels.sim.atomic_files)."""

from __future__ import annotations

import pytest

from fedkernels.sim.atomic_files import remove_leftovers, replacing, write_text


def test_a_finished_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old\n")
    write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_a_write_stopped_midway_keeps_the_old_file(tmp_path, stop):
    path = tmp_path / "config.json"
    path.write_text("old\n")
    with pytest.raises(stop):
        with replacing(path) as partial:
            partial.write_text("half")
            raise stop("stopped")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_two_writers_get_separate_temporaries(tmp_path):
    path = tmp_path / "checkpoint.pt"
    with replacing(path) as first, replacing(path) as second:
        assert first != second and first.parent == second.parent == tmp_path
        first.write_text("1")
        second.write_text("2")
    assert path.read_text() == "1"  # the outer block ends last
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_leftovers_of_killed_writers_are_removed_and_nothing_else(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_text("keep")
    for name in ("checkpoint.pt.123-abcdef01.partial", "checkpoint.pt.9-00000000.partial"):
        (tmp_path / name).write_text("half")
    (tmp_path / "results.json.1-ffffffff.partial").write_text("other file's")
    remove_leftovers(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.pt", "results.json.1-ffffffff.partial"]
