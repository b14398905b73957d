"""What the commands share about their command lines: one-line error reports, the check that
the optional ``sim`` extra is installed, algorithm names, writable folders. (The configuration's
flags are :mod:`.flags`, which imports jsonargparse: only ``run`` and ``compare`` need it.)"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from fedkernels.sim.config import ConfigError

SIM_EXTRA_INSTALL = 'pip install "fedkernels[sim]"'
# import names of the packages of the ``sim`` extra (pyproject.toml)
SIM_EXTRA_MODULES = frozenset({"tqdm", "sklearn", "pandas", "matplotlib", "yaml", "jsonargparse"})
MAX_THREADS = 1024  # --threads: torch's thread pool size, far above any CPU's core count


def set_threads(threads: int) -> None:
    """``--threads``: torch's CPU threads, checked (a huge count overflowed inside torch)."""
    if not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"--threads must be in [1, {MAX_THREADS}], got {threads}")
    import torch

    torch.set_num_threads(threads)


class UsageError(ConfigError):
    """A malformed command line (unknown flag, missing value), reported like a bad value."""


def one_line(message: object) -> str:
    """``message`` on one line (some parsers' messages span several)."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def missing_extra(err: ModuleNotFoundError) -> str | None:
    """The message for ``err`` when it is a package of the ``sim`` extra, else ``None``."""
    name = (err.name or "").split(".")[0]
    if name not in SIM_EXTRA_MODULES:
        return None
    return f"no module named {name!r}, which the sim extra provides: {SIM_EXTRA_INSTALL}"


def require_extra(module: str, purpose: str, instead: str | None = None) -> None:
    """Raises :class:`ConfigError` with the install command when ``module`` (of the ``sim``
    extra) cannot be imported; ``instead`` names a flag that avoids needing it."""
    try:
        importlib.import_module(module)
    except ImportError:
        alternative = f" (or run with {instead})" if instead else ""
        raise ConfigError(
            f"{purpose} needs {module}, from the sim extra: {SIM_EXTRA_INSTALL}{alternative}"
        ) from None


@contextlib.contextmanager
def data_warnings(prog: str) -> Iterator[None]:
    """Prints each :class:`DataWarning` (a likely mistake in the data file) once, as one line
    ``prog: warning: ...``, instead of Python's two-line warning."""
    from fedkernels.sim.tabular import DataWarning

    def show(message, *_args, **_kwargs) -> None:
        print(f"{prog}: warning: {one_line(message)}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("default", DataWarning)  # once per message
        warnings.showwarning = show
        yield


def algorithm_name(name: str, names: list[str] | None = None) -> str:
    """``name`` as registered, matched regardless of letter case when that is unambiguous
    (``FedAvg`` -> ``fedavg``); an unknown name close to a known one is refused with it.
    ``names``: the known names (default: the registry's, which imports the algorithms)."""
    if names is None:
        from fedkernels.algorithms.registry import available

        names = available()
    if ":" in name or name in names:  # an import path package.module:Class
        return name
    same = [n for n in names if n.lower() == name.lower()]
    if len(same) == 1:
        return same[0]
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.6)
    if close:
        raise ConfigError(f"unknown algorithm {name!r}; did you mean {close[0]}? (available: "
                          f"{', '.join(names)})")
    return name  # the registry refuses it with the list of names


def check_writable(out: Path, flag: str = "--out") -> None:
    """Refuses an output folder this process cannot write into, before any work is done. It
    tries a file rather than trusting permission bits, which say yes to root even in /sys."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        where = "it" if existing == out else f"{existing}"
        raise ConfigError(f"{flag} {out}: cannot write into {where} "
                          f"({err.strerror or err})") from None
