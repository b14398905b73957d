"""The registry of algorithms: name -> :class:`~fedkernels.sim.strategy.Strategy` subclass.

An algorithm module registers its strategy with ``@register``; the CLI's ``--algorithm``
chooses among :func:`available` names, and :func:`build_strategy` builds one from a mapping of
parameters (validated against the strategy's ``config_class``).
"""

from __future__ import annotations

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


def available() -> list[str]:
    """Registered algorithm names, sorted."""
    return sorted(_REGISTRY)


def strategy_class(name: str) -> type[Strategy]:
    """The strategy registered as ``name``."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown algorithm {name!r} (available: {', '.join(available())})")
    return _REGISTRY[name]


def build_strategy(name: str, params: Mapping[str, Any] | None = None) -> Strategy:
    """A new strategy ``name`` with parameters ``params`` (strings are converted)."""
    cls = strategy_class(name)
    params = dict(params or {})
    if cls.config_class is None:
        if params:
            raise ConfigError(f"algorithm {name!r} takes no parameters (got {', '.join(params)})")
        return cls()
    return cls(from_dict(cls.config_class, params, name))
