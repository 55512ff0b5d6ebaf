"""The entry point: run a command; a user's error printed with its hint and exit code, no traceback."""

from __future__ import annotations

import os
import sys

import click

from specpack._output import error
from specpack.cli import artifact, publish, runtime, train  # noqa: F401  (register the commands)
from specpack.cli._common import cli
from specpack.errors import SpecpackError


def main() -> None:
    json_mode = "--json" in sys.argv
    try:
        cli.main(standalone_mode=False)
    except SpecpackError as exc:
        if os.environ.get("SPECPACK_TRACEBACK"):
            raise
        error(exc, json_mode)
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted: nothing was left behind", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
