"""bench/render_results.py: the committed result pages and the README's headline table are what
the committed bench/results/*.json give, and the check catches a number edited by hand."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "render_results.py"


@pytest.fixture(scope="module")
def render():
    return load_script(SCRIPT)


@pytest.fixture
def copy_root(tmp_path):
    """The pages and the JSON the script reads, in a scratch repository root."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    (tmp_path / "bench").mkdir()
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "bench" / "results",
                    ignore=shutil.ignore_patterns("runs", "compare_*"))
    return tmp_path


def test_committed_pages_are_up_to_date(render):
    status, messages = render.run(ROOT, check=True)
    assert status == 0, "\n".join(messages)


def test_the_check_runs_from_the_command_line():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def measured_digit(text: str) -> int:
    """The offset of the last digit of the first decimal number in a table row of the first
    generated block (a measured figure, not a label)."""
    start = text.index("<!-- generated:")
    end = text.index("<!-- end generated -->", start)
    table_start = text.index("\n|", start)
    number = re.compile(r"\d+\.\d+").search(text, table_start, end)
    assert number is not None
    return number.end() - 1


@pytest.mark.parametrize("page", ["README.md", "docs/results/bench_aggregate.md"])
def test_a_number_edited_by_hand_fails_the_check(render, copy_root, page):
    path = copy_root / page
    text = path.read_text()
    at = measured_digit(text)
    path.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])
    status, messages = render.run(copy_root, check=True)
    assert status == 1 and page in "\n".join(messages)
    assert render.run(copy_root, check=False)[0] == 0
    assert path.read_text() == text
    assert render.run(copy_root, check=True)[0] == 0


def test_a_rerun_benchmark_makes_the_page_stale(render, copy_root):
    results = copy_root / "bench" / "results" / "fedlab-cpu-amd-epyc-avx2.json"
    results.write_text(results.read_text().replace('"speedup": 18.6', '"speedup": 28.6', 1))
    status, messages = render.run(copy_root, check=True)
    assert status == 1 and "bench_frameworks.md" in "\n".join(messages)


def test_a_marker_that_names_no_block_is_refused(render, copy_root):
    path = copy_root / "docs" / "results" / "simulation.md"
    path.write_text(path.read_text() + "\n<!-- generated: no/such-block -->\n<!-- end generated -->\n")
    status, messages = render.run(copy_root, check=True)
    assert status == 2 and "no/such-block" in messages[0]


def test_a_block_that_no_page_holds_is_refused(render, copy_root):
    path = copy_root / "docs" / "results" / "simulation.md"
    text = path.read_text()
    start = text.index("<!-- generated: vmap/")
    end = text.index("<!-- end generated -->", start) + len("<!-- end generated -->")
    path.write_text(text[:start] + text[end:])
    status, messages = render.run(copy_root, check=True)
    assert status == 2 and "vmap/intel-xeon-avx512" in messages[0]


def test_an_unclosed_block_is_refused(render, copy_root):
    path = copy_root / "docs" / "results" / "simulation.md"
    # the page's last block left open (an earlier one would start a block inside it)
    head, _, tail = path.read_text().rpartition("<!-- end generated -->")
    path.write_text(head + tail)
    status, messages = render.run(copy_root, check=True)
    assert status == 2 and "no '<!-- end generated -->'" in messages[0]


def test_a_missing_results_file_is_named(render, copy_root):
    (copy_root / "bench" / "results" / "fedml-cpu-amd-epyc-avx512.json").unlink()
    status, messages = render.run(copy_root, check=True)
    assert status == 2 and "fedml-cpu-amd-epyc-avx512.json" in messages[0]


@pytest.mark.parametrize("value, text", [(0.0123456, "0.0123"), (12.3456, "12.3"),
                                         (1234.56, "1,235"), (0, "0"), (None, "—")])
def test_three_significant_figures(render, value, text):
    assert render.sig(value) == text


def test_the_gpu_robust_summary_finds_every_baseline(render):
    """Each op of the summary is compared with a PyTorch variant the bench names; a renamed
    variant would leave its cells without a ratio."""
    text = render.robust_summary_block(ROOT, render.H200)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "K = " not in line]
    assert len(rows) == len(render.ROBUST_BASELINES)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert cells and all(c.endswith("×)") for c in cells), row
