"""All CLI printing goes through here: human text on stdout, or one JSON object with --json."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import click


def emit(data: Any, json_mode: bool, human: Callable[[Any], str] | None = None) -> None:
    """Print `data` as JSON (for scripts) or through `human` (for people)."""
    if json_mode:
        click.echo(json.dumps(data, indent=2, default=str))
    elif human is not None:
        click.echo(human(data))


def error(err, json_mode: bool) -> None:
    """Print a user error: one JSON object on stdout with --json, else text on stderr."""
    from specpack._redact import redact

    if json_mode:
        click.echo(redact(json.dumps(err.to_dict(), indent=2)))
    else:
        click.echo(click.style("error: ", fg="red", bold=True) + redact(str(err)), err=True)


def progress_enabled(json_mode: bool) -> bool:
    return not json_mode and sys.stderr.isatty()


def table(rows: list[tuple[str, Any]]) -> str:
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
