"""Each config section is declared once (worker/config/settings.py): reading follows one rule
for defaults, and configs/reference.toml and ``--help-config`` are checked against it."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from worker.cli import main
from worker.config import PROVIDERS, ProviderConfig, ProviderOptions, sections
from worker.config.keys import INT, STR, Key, declared, key, setting
from worker.config.table import Table
from worker.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class _Section:
    name: str = field(metadata=key(STR, "Required: no default."))
    size: int | None = setting(None, INT, "Optional: None when left out.", min=1)
    count: int = setting(3, INT, "Defaulted.", min=0, max=9)


def test_a_key_without_default_is_required_and_a_none_default_is_optional() -> None:
    assert Table({"name": "a"}, "s").build(_Section) == _Section("a", None, 3)
    assert Table({"name": "a", "size": 2}, "s").build(_Section).size == 2
    with pytest.raises(ConfigError, match=r"^Config needs 's.name'\.$"):
        Table({"size": 2}, "s").build(_Section)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "a", "sise": 2}, "Config key 's.sise' is not known. Valid keys in [s]: count"),
        ({"name": 1}, "Config 's.name' has value 1. Use a string."),
        ({"name": "a", "size": 0}, "Config 's.size' has value 0. It must be >= 1."),
        ({"name": "a", "count": 10}, "Config 's.count' has value 10. It must be <= 9."),
        ({"name": "a", "count": True}, "Config 's.count' has value True. Use an integer."),
    ],
)
def test_a_bad_key_or_value_names_the_dotted_key_and_the_fix(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Table(data, "s").build(_Section)
    assert str(info.value).startswith(message)


def test_every_provider_key_is_declared() -> None:
    keys = {*declared(ProviderConfig), *declared(ProviderOptions)}
    assert set().union(*PROVIDERS.values()) == keys
    assert all("require" in allowed for allowed in PROVIDERS.values())


def _reference_entries() -> list[tuple[str, str, Any]]:
    """(table, key, value) for each key the reference sets, or shows commented out.

    A commented-out ``[table]`` or ``key = value`` counts as shown; a table header whose last
    part is a key of its parent (``[pipeline.options]``) shows that key."""
    known = sections()
    entries: list[tuple[str, str, Any]] = []
    table = ""
    for line in (ROOT / "configs" / "reference.toml").read_text().splitlines():
        code = line.removeprefix("# ")
        if header := re.fullmatch(r"\[([\w.]+)\]", code):
            table = header[1]
            parent, _, name = table.rpartition(".")
            if name in known.get(parent, {}):
                entries.append((parent, name, None))
        elif assignment := re.fullmatch(r"(\w+) = (.*)", code):
            entries.append((table, assignment[1], tomllib.loads(f"v = {assignment[2]}")["v"]))
    return entries


def _section(table: str) -> str:
    """The declared section a reference table belongs to: ``inputs.features`` is inputs.NAME."""
    head, _, rest = table.partition(".")
    return f"{head}.NAME" if head in ("inputs", "outputs") and rest else table


def _shown(spec: Key) -> Any:
    """What the reference must show: the declared example, else the default."""
    return spec.example if spec.example is not None else spec.toml_default


def test_reference_lists_exactly_the_declared_keys_with_their_defaults() -> None:
    known = sections()
    seen = set()
    for table, name, value in _reference_entries():
        if table == "pipeline.options":
            continue  # the handler's own keyword arguments
        section = _section(table)
        assert name in known.get(section, {}), f"reference.toml shows undeclared {table}.{name}"
        if value is not None:
            shown = _shown(known[section][name])
            assert value == shown, f"reference.toml shows {table}.{name} = {value!r}, not {shown!r}"
        # a provider table shows the keys that every provider's table may take
        seen.add(("model.PROVIDER" if table.startswith("model.") else section, name))
    wanted = {
        ("model.PROVIDER" if section.startswith("model.") else section, name)
        for section, keys in known.items()
        for name in keys
    }
    assert sorted(wanted - seen) == [], "reference.toml leaves out declared keys"


def test_provider_tables_in_the_reference_take_only_their_providers_keys() -> None:
    for table, name, _ in _reference_entries():
        if table.startswith("model."):
            assert name in PROVIDERS[table.removeprefix("model.")], f"{table}.{name}"


def test_every_required_or_optional_key_has_an_example() -> None:
    for section, declared_keys in sections().items():
        for name, spec in declared_keys.items():
            assert _shown(spec) is not None, f"{section}.{name} needs an example"


def test_help_config_prints_every_key_with_default_bounds_and_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help-config"])  # no --config needed, as with --help
    assert exited.value.code == 0
    out = capsys.readouterr().out
    printed = tomllib.loads(out)  # valid TOML: keys with defaults set, optional ones commented
    for section, declared_keys in sections().items():
        table = printed
        for part in section.split("."):
            table = table[part]
        for name, spec in declared_keys.items():
            assert f"# {spec.help} (" in out
            assert spec.bounds() in out
            if spec.required:
                assert table[name] == spec.example
            elif spec.toml_default is None:
                assert name not in table
                assert f"# {name} = " in out
            else:
                assert table[name] == spec.toml_default


def test_help_config_shows_bounds_as_declared(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help-config"])
    out = capsys.readouterr().out
    assert "(integer, 1 to 1000000)\nmax_batch_size = 32\n" in out
    assert "(integer, 100 to 86400000)\nclaim_idle_ms = 30000\n" in out
    assert "optional)\n# sha256 = " in out
