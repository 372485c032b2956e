"""Command-line flags and environment variables derived from a settings class's fields (engine and gateway).

A settings class is a msgspec Struct (or a dataclass nested in one) whose defaults are written once, on its
fields. A field that may be set from the command line or the environment says so in its annotation::

    port: Annotated[int, Flag("port to listen on", env="KVSCOPE_GATEWAY_PORT")] = 4000

:func:`add_flags` turns every such field into an argparse option (``--port``, ``type=int``, the help with the
default appended; ``choices`` from a ``Literal``; ``store_const`` for a bool, ``--no-NAME`` for a negated
one; ``append`` for a repeatable flag); fields of nested settings classes are looked at too.
:func:`given` and :func:`from_env` read the flags that were given and the variables that are set back in the
settings' own nested shape (the shape of a YAML/TOML config file), so that :func:`merge` can layer
``file < env < CLI`` and :func:`load` validates the result once, with msgspec. Precedence and error messages
are those of the gateway's loader before this module existed (gateway/settings.py). An empty value (flag or
variable) counts as not set.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

import msgspec

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one settings field is set from the command line and the environment (put it in ``Annotated``)."""

    help: str = ""
    """The flag's help; `` (default: …)`` is appended for a scalar default unless the help names one."""
    name: str | None = None
    """The option, e.g. ``--keepalive``; default ``--`` + the field name with ``-`` for ``_`` (``--no-…``
    with :attr:`negate`)."""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    """One command-line or environment string → the value (argparse ``type``; an error is argparse's usage
    error). Default: the field's type (``int``, ``float``, ``str``)."""
    item: Callable[[Any], Any] | None = None
    """The parsed value (each item of a repeated flag) → the settings' shape, e.g. ``URL → {"url": URL}``;
    it may raise ValueError (reported by the caller, not argparse)."""
    negate: bool = False
    """A bool flag that sets False (``--no-NAME``), for a field that defaults to True."""
    repeat: bool = False
    """May be given several times (``action="append"``); the list replaces the config file's list. In the
    environment the items are comma-separated."""
    env: str | Callable[[Mapping[str, str]], Any] | None = None
    """The environment variable, or a function of the environment returning the value (None: unset) for a
    field that several variables set."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    path: tuple[str, ...]
    flag: Flag
    kind: Any
    choices: tuple[Any, ...] | None
    default: Any

    @property
    def dest(self) -> str:
        return ".".join(self.path)

    @property
    def option(self) -> str:
        if self.flag.name:
            return self.flag.name
        leaf = self.path[-1].replace("_", "-")
        return f"--no-{leaf}" if self.flag.negate else f"--{leaf}"

    @property
    def parse(self) -> Callable[[str], Any]:
        """The string → value function (argparse names it in its error: ``invalid int value: 'x'``)."""
        if self.flag.parse is not None:
            return self.flag.parse
        return self.kind if self.kind in (int, float, str) else str

    def shaped(self, value: Any) -> Any:
        if self.flag.repeat:
            return [self.flag.item(v) if self.flag.item else v for v in value]
        return self.flag.item(value) if self.flag.item else value


def flag_fields(cls: type, prefix: tuple[str, ...] = ()) -> list[_Field]:
    """The fields of ``cls`` (and of its nested settings classes) annotated with a :class:`Flag`, in order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out: list[_Field] = []
    for name, default in _defaults(cls):
        hint = hints[name]
        flags = (
            [m for m in get_args(hint)[1:] if isinstance(m, Flag)] if get_origin(hint) is Annotated else []
        )
        kind = _bare(hint)
        if flags:
            choices = get_args(kind) if get_origin(kind) is Literal else None
            kind = type(choices[0]) if choices else kind
            out.append(_Field((*prefix, name), flags[0], kind, choices, default))
        elif isinstance(kind, type) and (issubclass(kind, msgspec.Struct) or dataclasses.is_dataclass(kind)):
            out.extend(flag_fields(kind, (*prefix, name)))
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """Add an option to ``parser`` for every :class:`Flag` field of ``cls``; every argparse default is None
    (the settings class holds the defaults), so :func:`given` can tell what was given. Returns ``parser``."""
    for field in flag_fields(cls):
        kwargs: dict[str, Any] = {"dest": field.dest, "default": None, "help": _help(field)}
        if field.kind is bool and not field.flag.repeat:
            kwargs.update(action="store_const", const=not field.flag.negate)
        else:
            metavar = field.flag.metavar or (
                None if field.choices else field.option[2:].replace("-", "_").upper()
            )
            kwargs.update(type=field.parse, metavar=metavar, choices=field.choices)
            if field.flag.repeat:
                kwargs["action"] = "append"
        parser.add_argument(field.option, **kwargs)
    return parser


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags of ``cls`` given on the command line, in the settings' nested shape. Raises ValueError from a
    :attr:`Flag.item` function."""
    out: dict[str, Any] = {}
    for field in flag_fields(cls):
        value = getattr(args, field.dest, None)
        if value is not None and value != "":
            _put(out, field.path, field.shaped(value))
    return out


def from_env(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields of ``cls`` set in ``environ``, in the settings' nested shape: a bool is true for ``1``,
    ``true``, ``yes`` (any case), a repeatable flag's items are comma-separated. Raises ValueError for a value
    that does not parse."""
    out: dict[str, Any] = {}
    for field in flag_fields(cls):
        source = field.flag.env
        if source is None:
            continue
        if callable(source):
            if (value := source(environ)) is not None:
                _put(out, field.path, value)
            continue
        if not (text := environ.get(source)):
            continue
        if field.kind is bool:
            value = text.lower() in ("1", "true", "yes")
        elif field.flag.repeat:
            value = [field.parse(part.strip()) for part in text.split(",") if part.strip()]
        else:
            value = field.parse(text)
        _put(out, field.path, field.shaped(value))
    return out


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: mappings merge key by key, anything else (lists too) is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def load(cls: type[T], *layers: Mapping[str, Any]) -> T:
    """``cls`` from ``layers`` merged in order (later wins), validated by msgspec. Raises ValueError
    (msgspec.ValidationError, naming the path, e.g. ``… - at `$.port```; the class's own checks' messages)."""
    raw: dict[str, Any] = {}
    for layer in layers:
        raw = merge(raw, layer)
    return msgspec.convert(raw, cls)


def _defaults(cls: type) -> list[tuple[str, Any]]:
    if dataclasses.is_dataclass(cls):
        return [
            (f.name, f.default if f.default is not dataclasses.MISSING else None)
            for f in dataclasses.fields(cls)
        ]
    return [
        (f.name, f.default if f.default is not msgspec.NODEFAULT else None)
        for f in msgspec.structs.fields(cls)
    ]


def _bare(hint: Any) -> Any:
    """The type without ``Annotated`` and ``| None``."""
    if get_origin(hint) is Annotated:
        hint = get_args(hint)[0]
    options = [a for a in get_args(hint) if a is not type(None)]
    if type(None) in get_args(hint) and len(options) == 1:
        return options[0]
    return hint


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _help(field: _Field) -> str:
    """The flag's help with its default appended: a scalar as it is, a non-empty tuple of numbers (histogram
    bounds) as its first and last value and its length, e.g. ``(default: 0.001 … 1800.0, 26 values)``."""
    default = field.default
    if "default" in field.flag.help:
        return field.flag.help
    if isinstance(default, tuple) and default and all(_number(v) for v in default):
        shown = f"{default[0]} … {default[-1]}, {len(default)} values"
    elif _number(default) or isinstance(default, str):
        shown = str(default)
    else:
        return field.flag.help
    text = f"(default: {shown})"
    return f"{field.flag.help} {text}" if field.flag.help else text


def _put(out: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        out = out.setdefault(key, {})
    out[path[-1]] = value
