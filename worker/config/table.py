"""One TOML table of the worker's config, with its dotted name, so every error names the key."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from worker.errors import ConfigError

__all__ = ["Table"]


class Table:
    """One TOML table with its dotted name, so every error names the exact key."""

    def __init__(self, data: Any, dotted: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"Config '{dotted}' must be a table, got {data!r}.")
        self.data = data
        self.dotted = dotted

    def where(self, key: str) -> str:
        return f"{self.dotted}.{key}" if self.dotted else key

    def check_keys(self, allowed: set[str] | frozenset[str]) -> None:
        for key in self.data:
            if key not in allowed:
                section = f"[{self.dotted}]" if self.dotted else "the top level"
                raise ConfigError(
                    f"Config key '{self.where(key)}' is not known. "
                    f"Valid keys in {section}: {', '.join(sorted(allowed))}."
                )

    def table(self, key: str, required: bool = False) -> Table:
        if key not in self.data:
            if required:
                raise ConfigError(f"Config needs a [{self.where(key)}] table.")
            return Table({}, self.where(key))
        return Table(self.data[key], self.where(key))

    def _value(self, key: str, default: Any) -> Any:
        """The key's value, else ``default``; a ``default`` of None makes the key required."""
        if key in self.data:
            return self.data[key]
        if default is None:
            raise ConfigError(f"Config needs '{self.where(key)}'.")
        return default

    def get_str(self, key: str, default: str | None) -> str:
        value = self._value(key, default)
        if not isinstance(value, str):
            raise ConfigError(f"Config '{self.where(key)}' has value {value!r}. Use a string.")
        return value

    def get_bool(self, key: str, default: bool | None) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"Config '{self.where(key)}' has value {value!r}. Use true or false.")
        return value

    def get_int(
        self,
        key: str,
        default: int | None,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int:
        value = self._value(key, default)
        if type(value) is not int:
            raise ConfigError(f"Config '{self.where(key)}' has value {value!r}. Use an integer.")
        self._check_range(key, value, minimum, maximum)
        return value

    def get_number(
        self,
        key: str,
        default: float | None,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        if key not in self.data:
            return default
        value = self.data[key]
        if type(value) not in (int, float):
            raise ConfigError(f"Config '{self.where(key)}' has value {value!r}. Use a number.")
        if not math.isfinite(value):
            raise ConfigError(
                f"Config '{self.where(key)}' has value {value!r}. Use a finite number."
            )
        self._check_range(key, value, minimum, maximum)
        return float(value)

    def get_str_list(self, key: str, default: list[str]) -> list[str]:
        value = self.data.get(key, default)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"Config '{self.where(key)}' has value {value!r}. Use a list of strings."
            )
        return value

    def _check_range(
        self, key: str, value: float, minimum: float | None, maximum: float | None
    ) -> None:
        if minimum is not None and value < minimum:
            raise ConfigError(
                f"Config '{self.where(key)}' has value {value!r}. It must be >= {minimum}."
            )
        if maximum is not None and value > maximum:
            raise ConfigError(
                f"Config '{self.where(key)}' has value {value!r}. It must be <= {maximum}."
            )

    def get_batch_axis(self) -> int | None:
        """``batch_axis``: the axis that holds the rows (default 0), or "none" for no rows."""
        value = self.data.get("batch_axis", 0)
        if value == "none":
            return None
        if type(value) is not int or not 0 <= value < 32:
            raise ConfigError(
                f"Config '{self.where('batch_axis')}' has value {value!r}. Use the axis that "
                'holds the rows (0 to 31; 0 is the default) or "none" for an input or output '
                "without rows."
            )
        return value

    def get_bound(self, key: str) -> float | None:
        """``inputs.NAME.min`` or ``.max``; left out, or infinite on its own side, is no bound."""
        value = self.data.get(key)
        if type(value) is float and not math.isfinite(value):
            no_bound = -math.inf if key == "min" else math.inf
            if value == no_bound:
                return None
            why = "would switch the range check off" if math.isnan(value) else "no value would pass"
            raise ConfigError(
                f"Config '{self.where(key)}' has value {value!r}: {why}. Use a finite number, or "
                f"leave it out (or set {no_bound}) for no bound."
            )
        result: float | None = self.get_number(key, None)
        return result
