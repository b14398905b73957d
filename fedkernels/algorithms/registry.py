"""The registry of algorithms: name -> :class:`~fedkernels.sim.strategy.Strategy` subclass.

An algorithm module registers its strategy with ``@register``; the CLI's ``--algorithm``
chooses among :func:`available` names, and :func:`build_strategy` builds one from a mapping of
parameters (validated against the strategy's ``config_class``).

Algorithms from outside the package come in two ways, both resolved by :func:`strategy_class`:

- an import path ``package.module:Class`` (the module is imported, the class registered under
  its ``name``);
- an entry point of an installed distribution in the group ``fedkernels.algorithms``
  (``loss_weighted = my_pkg.strategies:LossWeighted``). Entry points are listed when the
  registry is first asked for names, and a plugin's module is imported only when it is chosen,
  so a broken plugin affects nobody who does not use it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

from fedkernels.sim.config import ConfigError, from_dict
from fedkernels.sim.strategy import Strategy

_REGISTRY: dict[str, type[Strategy]] = {}

S = TypeVar("S", bound=type[Strategy])


def register(cls: S) -> S:
    """Class decorator: adds a strategy under its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name to be registered")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"algorithm {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


ENTRY_POINT_GROUP = "fedkernels.algorithms"

_entry_points: dict[str, importlib.metadata.EntryPoint] | None = None


def plugin_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed ``fedkernels.algorithms`` entry points by name (listed once; nothing is
    imported)."""
    global _entry_points
    if _entry_points is None:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        _entry_points = {ep.name: ep for ep in found}
    return _entry_points


def available() -> list[str]:
    """Algorithm names, sorted: the registered ones and the installed plugins' entry points."""
    return sorted(set(_REGISTRY) | set(plugin_entry_points()))


def registered() -> list[str]:
    """Names of the strategies imported and registered so far, sorted."""
    return sorted(_REGISTRY)


def is_import_path(name: str) -> bool:
    """Whether ``name`` is a ``package.module:Class`` import path rather than a name."""
    return ":" in name


def _check_strategy(obj: Any, origin: str) -> type[Strategy]:
    if not (inspect.isclass(obj) and issubclass(obj, Strategy)):
        what = getattr(obj, "__qualname__", type(obj).__name__)
        raise ConfigError(f"{origin} is {what}, not a subclass of fedkernels.sim.Strategy")
    if not obj.name:
        raise ConfigError(f"{origin}: {obj.__name__} has no name (set the class attribute name)")
    try:
        return register(obj)
    except ValueError as err:
        raise ConfigError(f"{origin}: {err}") from None


def _import_error(origin: str, err: BaseException) -> ConfigError:
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return ConfigError(f"{origin} failed to import: {type(err).__name__}: {detail}".rstrip(": "))


def _load_import_path(path: str) -> type[Strategy]:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"algorithm {path!r}: expected package.module:Class")
    # like ``python -m``, a module in the current folder can be named
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any error of a user's module: report it as one line
        raise _import_error(f"algorithm {path!r}: module {module_name}", err) from err
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"algorithm {path!r}: {module_name} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return _check_strategy(obj, f"algorithm {path!r}")


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> type[Strategy]:
    dist = getattr(ep, "dist", None)
    source = f" (from {dist.name})" if dist is not None and getattr(dist, "name", None) else ""
    origin = f"algorithm plugin {ep.name!r} = {ep.value}{source}"
    try:
        obj = ep.load()
    except Exception as err:  # any error of a plugin's module: report it as one line
        raise _import_error(origin, err) from err
    cls = _check_strategy(obj, origin)
    if cls.name != ep.name:
        raise ConfigError(f"{origin}: the class is named {cls.name!r}, not {ep.name!r}")
    return cls


def strategy_class(name: str) -> type[Strategy]:
    """The strategy ``name``: a registered name, an installed plugin's entry point (imported
    now), or an import path ``package.module:Class``. Raises :class:`ConfigError` for an
    unknown name and for a plugin that fails to import."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if is_import_path(name):
        return _load_import_path(name)
    ep = plugin_entry_points().get(name)
    if ep is None:
        raise ConfigError(
            f"unknown algorithm {name!r} (available: {', '.join(available())}; or "
            "package.module:Class)"
        )
    return _load_entry_point(ep)


def build_strategy(name: str, params: Mapping[str, Any] | None = None) -> Strategy:
    """A new strategy ``name`` with parameters ``params`` (strings are converted)."""
    cls = strategy_class(name)
    params = dict(params or {})
    if cls.config_class is None:
        if params:
            raise ConfigError(f"algorithm {name!r} takes no parameters (got {', '.join(params)})")
        return cls()
    return cls(from_dict(cls.config_class, params, cls.name))
