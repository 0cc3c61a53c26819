"""What the ``redbatch`` commands share, so each rule and message exists once: argument types,
the usage error, the exit statuses and the way an error is printed."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from importlib import metadata

from producer.protocol import keys
from producer.protocol.codec import WIRE_DTYPES
from producer.protocol.errors import UsageError

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
    "dtype_specs",
    "model_name",
    "non_negative_float",
    "package_version",
    "positive_float",
    "positive_int",
    "prefix",
    "print_error",
    "require_cli_extra",
    "watermark",
]

#: Every row succeeded; some rows failed; the command could not run as asked; Ctrl-C.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def require_cli_extra(module: str, command: str) -> None:
    """Refuse, in one line, a command whose module comes with ``redbatch[cli]`` when the package
    was installed without it (``pip install redbatch`` is the library alone)."""
    if importlib.util.find_spec(module) is None:
        raise UsageError(
            f"{command} needs {module}, which comes with the CLI extra: pip install 'redbatch[cli]'"
        )


def package_version() -> str:
    """redbatch's installed version, or ``unknown`` in a checkout never installed."""
    try:
        return metadata.version("redbatch")
    except metadata.PackageNotFoundError:
        return "unknown"


def print_error(message: str) -> None:
    """``redbatch: error: MESSAGE`` on stderr, as argparse prints its own usage errors."""
    print(f"redbatch: error: {message}", file=sys.stderr)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a timeout or an interval: infinity would wait forever)."""
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def non_negative_float(text: str) -> float:
    """A number of seconds that may be 0 (turning the feature off)."""
    value = _number(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def dtype_specs(text: str) -> list[tuple[str, str]]:
    """``NAME=DTYPE[,NAME=DTYPE...]``: wire dtypes for named inputs (numeric, string, bytes)."""
    specs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, dtype = part.partition("=")
        if not name.strip() or dtype.strip() not in WIRE_DTYPES:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not NAME=DTYPE with DTYPE one of {', '.join(WIRE_DTYPES)}"
            )
        specs.append((name.strip(), dtype.strip()))
    if not specs:
        raise argparse.ArgumentTypeError("give at least one NAME=DTYPE")
    return specs


def model_name(text: str) -> str:
    """A model name as the contract allows it."""
    if not keys.is_valid_model_name(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not match [A-Za-z0-9_.-]{{1,64}}")
    return text


def worker_name(text: str) -> str:
    """A worker (consumer) name as the contract allows it."""
    if not keys.is_valid_name(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not match [A-Za-z0-9_.:-]{{1,128}}")
    return text


def prefix(text: str) -> str:
    """A key prefix: non-empty, without the braces of hash tags or spaces."""
    if not keys.is_valid_prefix(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a key prefix: use a non-empty name without braces or spaces"
        )
    return text


def watermark(text: str) -> float | None:
    """A fraction of Redis ``maxmemory`` in (0, 1], or ``off``."""
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'off'") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in (0, 1], or 'off'")
    return value
