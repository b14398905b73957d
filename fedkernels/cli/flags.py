"""The configuration's command-line flags, which jsonargparse derives from the config
dataclasses: ``--FIELD`` (top level of :class:`~fedkernels.sim.config.ExperimentConfig`),
``--SECTION.FIELD`` and ``--ALGORITHM.FIELD`` (the chosen algorithm's ``config_class``), each
typed and checked by jsonargparse, with its field's help and default.

What stays ours: errors as one line with a hint (:meth:`Parser.explain`), and the command-line
spellings users write that jsonargparse reads otherwise (:meth:`Parser.normalize`). The layers
of one configuration (a saved run, a ``--config`` file, the flags) are parsed in that order by
:func:`parse_layers`, which returns the tree of the keys they set; the dataclasses
(:func:`~fedkernels.sim.config.from_dict`) fill in the rest and check the combination.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, get_args, get_origin, get_type_hints

from jsonargparse import ArgumentParser, DefaultHelpFormatter, Namespace

from fedkernels.sim.config import (
    SECTIONS,
    ConfigError,
    ExperimentConfig,
    convert,
    set_dotted,
    show,
)

from .parsing import UsageError, one_line

# argparse reads only -1 and -1.5 as negative numbers: "--term.tilt -1e-3" was "expected one
# argument"; exponents and -inf/-nan (refused by the value check, with its message) are values
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$",
                              re.IGNORECASE)
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_TYPE_ERROR = re.compile(r'Parser key "([^"]+)":')
_UNKNOWN_KEY = re.compile(r"(?:Group '([^']+)' does not accept|Option '?([^' ]+)'? is not "
                          r"accepted)(?: option '([^']+)')?")


class HelpFormatter(DefaultHelpFormatter):
    """Each option's help as written (a config field's carries its default once: some say it in
    words), and the description and epilog with their own line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help or ""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


class Parser(ArgumentParser):
    """A jsonargparse parser without abbreviated flags whose errors are one-line
    :class:`~.parsing.UsageError`\\ s with a hint. ``suggest``: further flags a misspelling may
    be close to (other algorithms' options, which are not flags of this parser)."""

    def __init__(self, *args, suggest: Iterable[str] = (), **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, exit_on_error=False, print_config=None, env_prefix=False,
                         **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER
        self.suggest = list(suggest)
        self.field_types: dict[str, Any] = {}  # dest -> type of each configuration flag
        self.given: Mapping[str, Any] = {}  # the values being parsed as given, for errors

    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]
        raise UsageError(self.explain(message, self.given)) from None

    def flag_action(self, token: str) -> argparse.Action | None:
        return self._option_string_actions.get(token.split("=", 1)[0])

    def normalize(self, argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        """``argv`` in jsonargparse's spelling, and each configuration flag's value as given
        (dest -> text, for error messages). Users write lists as ``A,B`` (or one value) and
        booleans as ``1``/``0`` too, where jsonargparse reads YAML (``[A, B]``, ``true``).
        A flag given twice keeps its last value, as argparse does, and only that one is parsed."""
        out: list[str | tuple[str, list[str]]] = []  # tokens, and (dest, tokens) of a flag
        given: dict[str, str] = {}
        tokens = list(argv)
        i = 0
        while i < len(tokens):
            token = tokens[i]
            action = self.flag_action(token) if token.startswith("--") else None
            if action is None or action.dest not in self.field_types:
                out.append(token)
                i += 1
                continue
            flag, sep, value = token.partition("=")
            if not sep:
                following = tokens[i + 1] if i + 1 < len(tokens) else None
                if following is None or (following.startswith("-")
                                         and not _NEGATIVE_NUMBER.match(following)):
                    if action.nargs == "?":  # a bare boolean flag: true
                        given[action.dest] = "true"
                    out.append((action.dest, [token]))  # else the error of a missing value
                    i += 1
                    continue
                value = following
                i += 1
            given[action.dest] = value
            out.append((action.dest, [flag, self._spelled(value, self.field_types[action.dest])]))
            i += 1
        last = {item[0]: n for n, item in enumerate(out) if isinstance(item, tuple)}
        tokens_out: list[str] = []
        for n, item in enumerate(out):
            if isinstance(item, str):
                tokens_out.append(item)
            elif last[item[0]] == n:
                tokens_out += item[1]
        return tokens_out, given

    def file_value(self, dest: str, value: Any) -> Any:
        """A file's ``value`` for the flag ``dest`` as the flag would read it: one number, or
        ``A,B``, for a list; YAML's 1 and 0 for a boolean."""
        tp = self.field_types.get(dest)
        if tp is None or isinstance(value, bool):
            return value
        if _listed(tp) and isinstance(value, (int, float, str)):
            return json.loads(self._spelled(str(value), tp)) if isinstance(value, str) \
                else [value]
        if bool in (tp, *get_args(tp)) and type(value) is int and value in (0, 1):
            return bool(value)
        return value

    @staticmethod
    def _spelled(value: str, tp: Any) -> str:
        low = value.strip().lower()
        if tp is bool and low in _TRUE | _FALSE:
            return "true" if low in _TRUE else "false"
        if type(None) in get_args(tp) and low in ("none", "~", ""):
            return "null"
        if _listed(tp) and not value.lstrip().startswith("["):
            # spaces inside a value belong to it ("heart disease"), only those around it go
            return json.dumps([v.strip() for v in value.split(",") if v.strip()])
        return value

    def parse_given(self, argv: Sequence[str], namespace: Namespace | None = None,
                    ) -> tuple[Namespace, dict[str, Any]]:
        """Parses ``argv`` (over ``namespace``); also returns the configuration flags given,
        as ``{dest: value}``, the values converted."""
        normalized, given = self.normalize(argv)
        self.given = given
        namespace = self.parse_args(normalized, namespace=namespace)
        for dest, text in given.items():
            if isinstance(namespace.get(dest), int):  # quoted as given when out of range
                convert(text, self.field_types[dest], self.shown_key(dest))
        return namespace, {dest: namespace.get(dest) for dest in given}

    def explain(self, message: str, given: Mapping[str, Any] | None = None) -> str:
        """jsonargparse's (several-line) ``message`` as one line with a hint; ``given``: the
        values as the user gave them, by dest (quoted as given, checked by
        :func:`~fedkernels.sim.config.convert` for the same message as a file's)."""
        first = message.strip().splitlines()[0] if message.strip() else message
        if first.startswith("unrecognized arguments: "):
            return self.unrecognized(first.split(": ", 1)[1].split()[0])
        match = _TYPE_ERROR.match(first)
        if match:
            key = match[1]
            tp = self.field_types.get(key)
            if tp is not None and given is not None and key in given:
                try:
                    convert(given[key], tp, self.shown_key(key))
                except ConfigError as err:
                    return str(err)
                return f"{self.shown_key(key)}: {show(given[key])} is not a valid value"
            got = message.rsplit("Got value: ", 1)[-1].strip() if "Got value: " in message \
                else ""
            return f"{self.shown_key(key)}: invalid value{' ' + got if got else ''}"
        match = _UNKNOWN_KEY.search(message)
        if match:
            return self.unknown_key(match[1], match[3] or match[2])
        return one_line(message)

    def shown_key(self, dest: str) -> str:
        """A dest as the flag spells it (``aaggff_d.cdf`` -> ``aaggff-d.cdf``)."""
        for action in self._actions:
            if action.dest == dest and action.option_strings:
                return action.option_strings[0].removeprefix("--")
        return dest

    def unrecognized(self, token: str) -> str:
        if not token.startswith("-"):
            return f"unexpected argument {token!r} (a flag takes one value; lists are A,B,...)"
        flag = token.split("=", 1)[0]
        known = [s for action in self._actions for s in action.option_strings
                 if action.help != argparse.SUPPRESS or action.dest in self.field_types]
        close = difflib.get_close_matches(flag, known + self.suggest, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"unrecognized argument {flag}{hint}"

    def unknown_key(self, group: str | None, key: str) -> str:
        prefix = f"{self.shown_key(group)}." if group else ""
        valid = sorted({k.removeprefix(prefix).split(".", 1)[0]
                        for k in map(self.shown_key, self.field_types) if k.startswith(prefix)})
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"; did you mean {prefix}{close[0]}?" if close else ""
        return f"unknown key {prefix}{key}{hint} (valid: {', '.join(valid)})"


def _listed(tp: Any) -> bool:
    """Whether ``tp`` is a list type, or an optional one."""
    return get_origin(tp) is list or any(get_origin(a) is list for a in get_args(tp))


def type_text(tp: Any) -> str:
    """A field's type as Python spells it (``float | None``), read back by :func:`type_of`."""
    return tp.__name__ if tp in (int, float, str, bool) else repr(tp).replace("typing.", "")


def type_of(text: str) -> Any:
    return eval(text, {"Literal": Literal, "Any": Any})  # noqa: S307 (our own saved file)


def _help(f: dataclasses.Field) -> str:
    text = f.metadata.get("help", "")
    if "(default:" not in text:  # some fields describe their default in words
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = f"{text} (default: {default})"
    return text


def _describe(parser: Parser, cls: type, prefix: str, hidden: bool) -> None:
    """Help, metavar and the optional value of a boolean, for the flags of ``cls``'s fields."""
    types = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        action = parser.flag_action(f"--{prefix}{f.name}")
        if action is None:
            continue
        tp = types[f.name]
        parser.field_types[action.dest] = tp
        action.help = argparse.SUPPRESS if hidden else _help(f)
        if tp is bool:
            action.nargs, action.const, action.metavar = "?", True, "BOOL"
        elif _listed(tp):
            action.metavar = "A,B,..."
            # jsonargparse's --FIELD+ (append to the list) still parses, but is not listed
            action.option_strings = [o for o in action.option_strings if not o.endswith("+")]
        elif get_origin(tp) is not Literal:  # INT, not --eval_every EVAL_EVERY: shorter help
            inner = next((a for a in get_args(tp) if a is not type(None)), tp)
            action.metavar = "BOOL" if inner is bool else getattr(inner, "__name__", "VALUE").upper()


def add_config_flags(parser: Parser, *, skip: Sequence[str] = (), hidden: bool = False) -> None:
    """``--FIELD`` and ``--SECTION.FIELD`` for every field of the configuration but the
    algorithm's parameters (``skip``: top-level fields left out; ``hidden``: none listed)."""
    parser.add_class_arguments(ExperimentConfig, skip={"algorithm_params", *skip})
    _describe(parser, ExperimentConfig, "", hidden)
    types = get_type_hints(ExperimentConfig)
    for section in SECTIONS:
        _describe(parser, types[section], f"{section}.", hidden)
    for action in parser._actions:
        if action.dest in SECTIONS:  # a section as one value: a file is --config's job
            action.help = argparse.SUPPRESS
    for name, group in (parser.groups or {}).items():
        group.title = "experiment" if name == "ExperimentConfig" else name
        group.description = None


def add_algorithm_flags(parser: Parser, name: str, config_class: type | None,
                        hidden: bool = False) -> None:
    """``--NAME.FIELD`` for each field of an algorithm's ``config_class``."""
    if config_class is None:
        if not hidden:
            parser.add_argument_group(f"algorithm {name}", f"{name} has no options of its own")
        return
    parser.add_class_arguments(config_class, nested_key=name)
    _describe(parser, config_class, f"{name}.", hidden)
    group = (parser.groups or {}).get(name)
    if group is not None:
        group.title, group.description = f"algorithm {name}", None


def saved_class(name: str, fields: list[list[Any]] | None) -> type | None:
    """The ``config_class`` an algorithm's saved options describe (``[field, type, default,
    help]`` each; see :mod:`.algorithm_options`), for help without importing the algorithm."""
    if fields is None:
        return None
    spec = []
    for field_name, tp, default, help_text in fields:
        value = (dataclasses.field(default_factory=lambda d=default: type(d)(d))
                 if isinstance(default, (list, dict)) else dataclasses.field(default=default))
        value.metadata = {"help": help_text}  # type: ignore[misc]
        spec.append((field_name, type_of(tp), value))
    return dataclasses.make_dataclass(f"{name}_options", spec)


def describe(config_class: type | None) -> list[list[Any]] | None:
    """An algorithm's ``config_class`` as :func:`saved_class` reads it back."""
    if config_class is None:
        return None
    types = get_type_hints(config_class)
    out = []
    for f in dataclasses.fields(config_class):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append([f.name, type_text(types[f.name]), default, f.metadata.get("help", "")])
    return out


def _dotted(tree: Mapping[str, Any], heads: Sequence[str], prefix: str = "") -> dict[str, Any]:
    """A tree as ``{"partition.alpha": 0.3, ...}``, down to the fields of the sections and of
    the algorithms ``heads`` (a field's own value may be a mapping or a list)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if not prefix and key in heads and isinstance(value, Mapping):
            out.update(_dotted(value, heads, f"{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def parse_layers(parser: Parser, argv: Sequence[str], *, file_tree: Mapping[str, Any] | None = None,
                 saved_tree: Mapping[str, Any] | None = None, algorithm: str | None = None,
                 ) -> tuple[Namespace, dict[str, Any], dict[str, Any]]:
    """Parses a saved run's tree, then a ``--config`` file's, then the flags ``argv``, each
    over the one before. Returns the namespace (the command's own options too), the
    configuration tree of every key some layer set (the
    flags ``--ALGORITHM.FIELD`` of ``algorithm`` as ``algorithm_params``; another's are
    dropped), and the tree of the section keys the file and the flags set (for the warnings
    about settings the run does not read)."""
    namespace = parser.get_defaults()
    heads = (*SECTIONS, *([algorithm] if algorithm else []))
    dests = {parser.shown_key(d): d for d in parser.field_types}
    set_keys: list[str] = []  # as the flags spell them
    asked: list[str] = []
    for tree, users in ((saved_tree, False), (file_tree, True)):
        if not tree:
            continue
        flat = _dotted(_as_flag_tree(tree, algorithm), heads)
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            flat[key] = parser.file_value(dests.get(key, key), value)
            set_dotted(nested, dests.get(key, key), flat[key])
        parser.given = {dests.get(k, k): v for k, v in flat.items()}
        namespace = parser.parse_object(nested, namespace=namespace)
        set_keys += flat
        asked += flat if users else []
    namespace, given = parser.parse_given(argv, namespace)
    set_keys += map(parser.shown_key, given)
    asked += map(parser.shown_key, given)
    tree: dict[str, Any] = {}
    for key in dict.fromkeys(set_keys):
        value = namespace.get(dests.get(key, key))
        head, _, param = key.partition(".")
        if param and head not in SECTIONS:
            if head == algorithm:
                tree.setdefault("algorithm_params", {})[param] = value
            continue
        set_dotted(tree, key, value)
    asked_tree: dict[str, Any] = {}
    for key in asked:
        if key.split(".", 1)[0] in SECTIONS and "." in key:
            set_dotted(asked_tree, key, True)
    return namespace, tree, asked_tree


def _as_flag_tree(tree: Mapping[str, Any], algorithm: str | None) -> dict[str, Any]:
    """A configuration tree with the algorithm's parameters under the algorithm's name, as its
    flags spell them."""
    out = dict(tree)
    params = out.get("algorithm_params")
    if isinstance(params, Mapping) and algorithm is not None:
        out[algorithm] = out.pop("algorithm_params")
    return out
