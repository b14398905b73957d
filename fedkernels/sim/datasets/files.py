"""Finding a publisher's files under ``data.root``, reading them, and saying what is wrong.

Every problem is a :class:`~fedkernels.sim.config.ConfigError` of one line that names the file
or folder at fault, so the command line reports it as a usage error without a traceback.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Sequence
from pathlib import Path

from ..config import ConfigError


class MissingFiles(ConfigError):
    """A data set's files are not under ``data.root`` (``data.download`` may fetch some)."""


def data_error(path: Path | str, problem: str) -> ConfigError:
    """``path: problem``, the form of every complaint about a file's content."""
    return ConfigError(f"{path}: {problem}")


def root_folder(root: str | Path) -> Path:
    """``data.root`` as a path; it must be an existing folder."""
    folder = Path(root).expanduser()
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise MissingFiles(f"data.root {folder} {what}")
    return folder


def find_file(root: Path, folders: Sequence[str], name: str, gzipped: bool = True) -> Path:
    """The first of ``root/folder/name`` (then ``name.gz`` when ``gzipped``) that is a file;
    :class:`MissingFiles` lists the places looked at."""
    names = [name, f"{name}.gz"] if gzipped else [name]
    for folder in folders:
        for candidate in names:
            path = root / folder / candidate
            if path.is_file():
                return path
    places = ", ".join(str(root / f) for f in folders)
    spelled = f"{name}[.gz]" if gzipped else name
    raise MissingFiles(f"no {spelled} in {places}")


def find_folder(root: Path, folders: Sequence[str], marker: str) -> Path:
    """The first ``root/folder`` that holds ``marker`` (a file or folder name)."""
    for folder in folders:
        if (root / folder / marker).exists():
            return root / folder
    places = ", ".join(str(root / f) for f in folders)
    raise MissingFiles(f"no {marker} in {places}")


def read_bytes(path: Path) -> bytes:
    """The content of ``path``, decompressed when its name ends in ``.gz``."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as stream:
                return stream.read()
        return path.read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise data_error(path, f"is not a complete gzip file ({_reason(err)})") from None
    except OSError as err:
        raise data_error(path, f"cannot be read ({err.strerror or err})") from None


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__
