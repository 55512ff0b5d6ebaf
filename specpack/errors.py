"""Errors a user can cause. Each carries what is wrong and a hint of what to do.

The CLI prints these without a traceback (set SPECPACK_TRACEBACK=1 to see one); any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

MAX_PROBLEMS = 50  # shown; the rest are counted, so no error prints megabytes whatever the input
MAX_PROBLEM_CHARS = 500


class SpecpackError(Exception):
    """Base of every error a user can cause: `message` says what and where, `hint` what to do.

    `problems` keeps every problem; what is printed (`str`, `to_dict`) is the first `MAX_PROBLEMS`,
    each cut to `MAX_PROBLEM_CHARS`, then "... and N more"."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None, problems: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.problems = list(problems or [])

    def __str__(self) -> str:
        lines = [self.message]
        lines += [f"  - {p}" for p in self.shown_problems()]
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"error": type(self).__name__, "message": self.message,
                "problems": self.shown_problems(), "hint": self.hint}

    def shown_problems(self) -> list[str]:
        """The problems as printed: the first MAX_PROBLEMS (each cut short), then how many more."""
        shown = [_cut(str(p)) for p in self.problems[:MAX_PROBLEMS]]
        if len(self.problems) > MAX_PROBLEMS:
            shown.append(f"... and {len(self.problems) - MAX_PROBLEMS} more")
        return shown


def _cut(text: str) -> str:
    return text if len(text) <= MAX_PROBLEM_CHARS else text[:MAX_PROBLEM_CHARS] + f"... ({len(text)} chars)"


class InputError(SpecpackError):
    """A target, drafter or option that cannot be used as given."""


class ConversionError(SpecpackError):
    """A drafter or target whose tensors or config do not check out."""


class VerificationError(SpecpackError):
    """An artifact whose signature or digests do not match: it is never loaded."""

    exit_code = 3


class OutputError(SpecpackError):
    """The output location cannot be written (exists, unwritable, disk full)."""


class UnsupportedError(SpecpackError):
    """A model family, tensor type or backend specpack does not support (yet)."""


class MissingDependencyError(SpecpackError):
    """An optional dependency is not installed; the hint names the extra."""

    @classmethod
    def for_module(cls, module: str, extra: str) -> "MissingDependencyError":
        return cls(f"the optional dependency '{module}' is not installed",
                   hint=f"pip install 'specpack[{extra}]'")
