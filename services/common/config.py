"""Typed config loading: TOML files and `--section.key=value` overrides into dataclasses.

Every component owns a dataclass of its own settings (a docstring under each field); a job
config is a dataclass whose fields are those sections. This module fills such a tree from
TOML tables and from command-line overrides, checks every value against the field's type
annotation (`int`, `float`, `bool`, `str`, `Literal[...]`, `X | None`, `list[X]`), and raises
`ConfigError` naming the key and what is allowed for an unknown key or a wrong type. It knows
nothing about which sections exist: the trainer's `config/sections.py` declares them.

Run `meshtrain train --help-config` to see every key with its documentation.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import textwrap
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import tomli_w

from meshtrain.services.common.errors import ConfigError


def _describe(tp: Any) -> str:
    """Human-readable name of a type annotation, for error messages."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp)
        return f"a list of {_describe(inner)}"
    if tp is type(None):
        return "none (omit the key)"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp` and return it in canonical form.

    Args:
        value: a value parsed from TOML or the command line.
        tp: the field's resolved type annotation.
        key: the dotted key, used in error messages.

    Returns:
        The value, with ints widened to float where a float is expected.

    Raises:
        ConfigError: naming `key`, the value and what the field allows.
    """
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: got {value!r}, expected {_describe(tp)}")
    if origin is Literal:
        if value in get_args(tp) and type(value) is type(get_args(tp)[0]):
            return value
        raise ConfigError(f"{key}: got {value!r}, expected {_describe(tp)}")
    if origin is list:
        (inner,) = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: got {value!r}, expected {_describe(tp)}")
        return [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value):  # compares false with every bound: no range check would see it
                raise ConfigError(f"{key}: got nan, expected a number")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{key}: unsupported field type {tp!r}")
    raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}), expected {_describe(tp)}")


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a dataclass (the string literal after it)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def _optional_section(tp: Any) -> Any:
    """The dataclass of an optional section (`X | None` with X a dataclass), else None."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and _is_section(args[0]) and len(get_args(tp)) == 2:
            return args[0]
    return None


def close_matches(word: str, candidates: list[str], n: int = 3) -> list[str]:
    """The candidates closest to a mistyped `word`, best first. A typo is the usual cause of an
    unknown key, and the one or two near names answer it where a list of every key buries it."""
    return difflib.get_close_matches(word, candidates, n=n, cutoff=0.6)


def build(cls: type, table: dict[str, Any], prefix: str = "") -> Any:
    """Instantiate dataclass `cls` from a (possibly nested) dict, checking every key and type.

    Args:
        cls: a dataclass; fields that are dataclasses are nested sections.
        table: values, e.g. parsed TOML.
        prefix: dotted path of `cls` inside the job config, for error messages.

    Returns:
        An instance of `cls`; keys absent from `table` keep their defaults.
    """
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            near = close_matches(key, list(fields))
            hint = (
                f"did you mean {' or '.join(repr(prefix + m) for m in near)}?"
                if near
                else "no key of this section is close (`meshtrain train --help-config` lists them)"
            )
            raise ConfigError(f"unknown key {dotted!r}; {hint}")
        tp = hints[key]
        tp = _optional_section(tp) if isinstance(value, dict) and _optional_section(tp) else tp
        if _is_section(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted}: expected a table [{dotted}], got {value!r}")
            kwargs[key] = build(tp, value, f"{dotted}.")
        else:
            kwargs[key] = coerce(value, tp, dotted)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # __post_init__ names the key relative to its section; make it absolute (a message that
        # names the section itself, "optim: ...", is absolute already).
        if prefix and not str(e).startswith((prefix, f"{prefix[:-1]}:")):
            raise ConfigError(f"{prefix}{e}") from None
        raise


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass tree as plain dicts, with None values left out (TOML has no null)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def dumps_toml(obj: Any) -> str:
    """Serialize a dataclass tree as TOML that `build` reads back to an equal object."""
    return tomli_w.dumps(to_dict(obj))


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None


def parse_value(text: str) -> Any:
    """Parse a command-line value as a TOML value, falling back to a bare string.

    `8` → 8, `3e-4` → 0.0003, `true` → True, `[1, 2]` → [1, 2], `gpt2` → "gpt2".
    """
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def set_dotted(table: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c = value` inside nested dicts, creating tables as needed."""
    *parents, leaf = dotted.split(".")
    node = table
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `extra` into a copy of `base` (extra wins)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


@functools.cache
def leaf_keys(cls: type) -> frozenset[str]:
    """Every leaf field's dotted key (what a `--section.key` flag may name), without reading
    the docstrings from source as `describe_keys` does: each config load checks its flags
    against these."""
    hints = get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        section = _optional_section(hints[f.name]) or hints[f.name]
        if _is_section(section):
            keys.update(f"{f.name}.{key}" for key in leaf_keys(section))
        else:
            keys.add(f.name)
    return frozenset(keys)


def describe_keys(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every leaf field, for `--help-config`."""
    rows = []
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp) or _optional_section(tp):
            rows.extend(describe_keys(_optional_section(tp) or tp, f"{prefix}{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append((f"{prefix}{f.name}", _describe(tp), default, docs.get(f.name, "")))
    return rows
