"""The built-in algorithms' command-line options, saved so that ``fedkernels run --help``
lists them without importing the algorithms (and with them torch, seconds of start-up).

``algorithm_options.json`` beside this module holds, per built-in algorithm, each parameter of
its ``config_class`` as ``[name, type, default, help]`` (``null``: no parameters), from which
:func:`~fedkernels.cli.flags.saved_class` rebuilds the class for jsonargparse. Only help reads
it; a run parses its flags from the algorithms themselves. ``python_tests/test_cli_startup.py``
checks it against them; after changing an algorithm's parameters, write it again::

    python -m fedkernels.cli.algorithm_options
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

SAVED = Path(__file__).with_name("algorithm_options.json")
# fedkernels.algorithms.registry.ENTRY_POINT_GROUP, which cannot be imported without torch
ENTRY_POINT_GROUP = "fedkernels.algorithms"

# name -> [[field, type, default, help], ...], or None for an algorithm without parameters
Options = dict[str, "list[list[Any]] | None"]


def live(names: list[str] | None = None) -> Options:
    """The options of the registered algorithms (``names``; default: the built-in ones), read
    from their classes (imports them, and torch)."""
    import fedkernels.algorithms  # noqa: F401  (registers the built-in algorithms)
    from fedkernels.algorithms.registry import registered, strategy_class

    from .flags import describe

    if names is None:
        names = [n for n in registered()
                 if strategy_class(n).__module__.startswith("fedkernels.")]
    return {name: describe(strategy_class(name).config_class) for name in names}


def saved() -> Options:
    """The options saved in :data:`SAVED`."""
    return json.loads(SAVED.read_text(encoding="utf-8"))


def plugin_names() -> list[str]:
    """The names of the installed algorithm plugins (their entry points; nothing imported)."""
    return [ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]


def known_names() -> list[str]:
    """The built-in algorithms' and the installed plugins' names, without importing either."""
    return sorted(set(saved()) | set(plugin_names()))


def write() -> Path:
    """Writes the built-in algorithms' options to :data:`SAVED`."""
    SAVED.write_text(json.dumps(live(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return SAVED


if __name__ == "__main__":
    print(f"wrote {write()}")
