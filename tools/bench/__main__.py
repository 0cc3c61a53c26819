"""``python -m tools.bench``: the load test, run from a checkout (docs/benchmarks.md).

It is a tool of the checkout, as Triton's ``perf_analyzer`` is a tool apart from its client
library: it starts workers and redis-servers, builds synthetic models and measures ceilings, none
of which a producer installs or needs. To test a live deployment, run it from a checkout with
``--no-start`` against the workers already serving there.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from producer.client.blocking import DEFAULT_URL
from producer.jobs.job import UsageError, one_line
from producer.protocol.errors import ConnectionFailed, RedbatchError
from tools.bench.cli import add_arguments, run_command

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the load test; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.redis_url = os.environ.get("REDIS_URL", DEFAULT_URL)  # --no-start without --redis-url
    try:
        return run_command(args)
    except (UsageError, ConnectionFailed) as exc:
        _fail(one_line(exc))
        return EXIT_USAGE
    except RedbatchError as exc:
        _fail(one_line(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED


def _fail(message: str) -> None:
    print(f"bench: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
