"""One TOML table of the worker's config, read against a section's declared keys.

Every error names the dotted key: an unknown key with the known ones, a bad value with what it
holds and what would be valid.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any, TypeVar

from worker.config.keys import declared
from worker.errors import ConfigError

__all__ = ["Table"]

T = TypeVar("T")


class Table:
    """One TOML table with its dotted name, so every error names the exact key."""

    def __init__(self, data: Any, dotted: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"Config '{dotted}' must be a table, got {data!r}.")
        self.data = data
        self.dotted = dotted

    def where(self, key: str) -> str:
        return f"{self.dotted}.{key}" if self.dotted else key

    def check_keys(self, allowed: Collection[str]) -> None:
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

    def tables(self) -> Iterator[tuple[str, Table]]:
        """Each sub-table by name: ``[inputs.NAME]``."""
        for name in self.data:
            yield name, self.table(name)

    def read(self, cls: type) -> dict[str, Any]:
        """The keys ``cls`` declares that this table sets, checked and converted.

        Keys left out are not in the result, so the dataclass fills in its own defaults; a
        required key (a field without a default) left out is an error.
        """
        values = {}
        for name, key in declared(cls).items():
            if name not in self.data:
                if key.required:
                    raise ConfigError(f"Config needs '{self.where(name)}'.")
                continue
            value = self.data[name]
            problem = key.problem(value)
            if problem is not None:
                raise ConfigError(f"Config '{self.where(name)}' has value {value!r}. {problem}")
            values[name] = key.kind.convert(value)
        return values

    def build(self, cls: type[T], **fixed: Any) -> T:
        """A ``cls`` from this table, whose keys are exactly those ``cls`` declares."""
        self.check_keys(declared(cls))
        return cls(**fixed, **self.read(cls))
