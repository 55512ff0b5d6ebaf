"""The `specpack` command line: thin commands that parse, call one library function, print.

Commands live in one module per family (artifact, runtime, publish, train); each registers on `cli`.
The package hands on `cli` and `main` (main.py)."""

from __future__ import annotations

from specpack.cli._common import cli
from specpack.cli.main import main

__all__ = ["cli", "main"]
