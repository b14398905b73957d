"""The README's Python snippets run as written (each in a fresh namespace, small tensors), so the
front door cannot drift from the API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_its_three_snippets():
    assert len(python_snippets()) >= 3


@pytest.mark.parametrize("index", range(len(python_snippets())))
def test_snippet_runs_as_written(index, capsys):
    code = python_snippets()[index]
    exec(compile(code, f"README.md, Python snippet {index + 1}", "exec"), {"__name__": "__readme__"})


def test_first_snippet_prints_what_its_comment_says(capsys):
    code = python_snippets()[0]
    exec(compile(code, "README.md, Python snippet 1", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out.strip()
    comment = re.search(r"print\(.*\)\s*#\s*(.+)", code).group(1).strip()
    assert printed == comment
