"""The ``redbatch`` command line: argument parsing, exit statuses, and each command's reports."""

from producer.cli.main import main

__all__ = ["main"]
