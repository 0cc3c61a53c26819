"""How a config key is declared, once, and the help text derived from the declaration.

A section of the worker's config is a frozen dataclass whose TOML keys are fields carrying a
``Key``: ``setting(32, INT, "help", min=1)``, or ``field(metadata=key(...))`` for a required
key. Reading (worker/config/table.py), ``--help-config`` and the reference check derive from
them. One rule for defaults: a key without one is required; a ``None`` default is optional.

Plain dataclasses, not a validation library: pydantic or msgspec would be one more dependency
on every worker box and word errors their own way (ours name the dotted key, the value and the
fix, and tests pin them), while the checks that need care here (a Redis URL as redis-py reads
it, paths relative to the config file, provider tables, one-sided bounds) stay ours anyway.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

__all__ = [
    "BOOL",
    "INT",
    "NUMBER",
    "STR",
    "STR_LIST",
    "Key",
    "Kind",
    "declared",
    "describe",
    "key",
    "kind",
    "one_of",
    "setting",
]

#: What is wrong with a value, as the fix to print ("Use an integer."), or None if it is good.
Problem = Callable[[Any], str | None]


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True, slots=True)
class Kind:
    """What a key's TOML value must be (``problem``) and how it becomes the field's value."""

    name: str  # for --help-config: "integer", "list of strings"
    problem: Problem
    convert: Callable[[Any], Any] = _same


def kind(
    name: str, good: Callable[[Any], Any], fix: str, convert: Callable[[Any], Any] = _same
) -> Kind:
    """A kind whose values are ``good``; ``fix`` is what any other value prints."""
    return Kind(name, lambda value: None if good(value) else fix, convert)


@dataclass(frozen=True, slots=True)
class Key:
    """One TOML key as its section's field declares it.

    ``default`` and ``required`` are the field's, filled in by ``declared``. ``example``
    is what configs/reference.toml shows instead of the default; ``shown`` is the TOML spelling
    of a default that is not a TOML value.
    """

    kind: Kind
    help: str
    min: float | None = None
    max: float | None = None
    example: Any = None
    shown: Any = None
    default: Any = None
    required: bool = False

    @property
    def toml_default(self) -> Any:
        """The default as TOML writes it; None when required, or optional and unset."""
        return self.default if self.shown is None else self.shown

    def problem(self, value: Any) -> str | None:
        """What is wrong with TOML ``value`` for this key, as the fix to print, or None."""
        wrong = self.kind.problem(value)
        if wrong is not None:
            return wrong
        if self.min is not None and value < self.min:
            return f"It must be >= {self.min}."
        if self.max is not None and value > self.max:
            return f"It must be <= {self.max}."
        return None

    def bounds(self) -> str:
        """The valid range in words: "1 to 256", ">= 0", or "" for none."""
        if self.min is not None and self.max is not None:
            return f"{self.min} to {self.max}"
        if self.min is not None:
            return f">= {self.min}"
        return "" if self.max is None else f"<= {self.max}"


def key(kind: Kind, help: str, **details: Any) -> dict[str, Key]:
    """Field metadata declaring a TOML key: ``field(metadata=key(STR, "..."))``."""
    return {"key": Key(kind, help, **details)}


def setting(default: Any, kind: Kind, help: str, **details: Any) -> Any:
    """A dataclass field declaring a TOML key with a default (None: an optional key)."""
    return field(default=default, metadata=key(kind, help, **details))


def declared(cls: type) -> dict[str, Key]:
    """The TOML keys that dataclass ``cls`` declares, in field order, with their defaults."""
    found = {}
    for f in fields(cls):
        if "key" not in f.metadata:
            continue
        if f.default_factory is not MISSING:
            found[f.name] = replace(f.metadata["key"], default=f.default_factory())
        elif f.default is MISSING:
            found[f.name] = replace(f.metadata["key"], required=True)
        else:
            found[f.name] = replace(f.metadata["key"], default=f.default)
    return found


def describe(sections: Mapping[str, Mapping[str, Key]]) -> str:
    """Every key with its kind, bounds and help, as TOML: set to its default where it has one,
    to an example where it is required, commented out where it is optional."""
    lines = ["# The worker's config keys; configs/reference.toml explains each at length."]
    for section, keys in sections.items():
        lines += ["", f"[{section}]"]
        for name, k in keys.items():
            need = "required" if k.required else "optional" if k.toml_default is None else ""
            about = ", ".join(filter(None, [k.kind.name, k.bounds(), need]))
            lines.append(f"# {k.help} ({about})")
            value = k.example if k.toml_default is None else k.toml_default
            lines.append(f"{'# ' if need == 'optional' else ''}{name} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    """A default or example as TOML: JSON spells them alike, but for booleans."""
    return str(value).lower() if isinstance(value, bool) else json.dumps(value)


def _number(value: Any) -> str | None:
    if type(value) not in (int, float):
        return "Use a number."
    return None if math.isfinite(value) else "Use a finite number."


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


BOOL = kind("true or false", lambda v: isinstance(v, bool), "Use true or false.")
INT = kind("integer", lambda v: type(v) is int, "Use an integer.")
NUMBER = Kind("number", _number, float)
STR = kind("string", lambda v: isinstance(v, str), "Use a string.")
STR_LIST = kind("list of strings", _is_str_list, "Use a list of strings.", list)


def one_of(*values: str) -> Kind:
    """A string from ``values``."""
    listed = ", ".join(values)
    return kind(f"one of {listed}", lambda v: v in values, f"Valid values: {listed}.")
