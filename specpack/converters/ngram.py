"""n-gram (prompt lookup) drafters: no weights, three parameters."""

from __future__ import annotations

from specpack.converters.base import ConvertedDrafter
from specpack.errors import InputError
from specpack.schemas import NgramDrafter

MAX_N = 16


def detect(spec: str) -> str | None:
    return "ngram" if str(spec) == "ngram" else None


def convert(min_n: int = 1, max_n: int = 4, draft_len: int = 5, match: str = "latest") -> ConvertedDrafter:
    """Check the lookup parameters and describe the drafter."""
    problems = []
    if not 1 <= min_n <= max_n:
        problems.append(f"need 1 <= min n ({min_n}) <= max n ({max_n})")
    if max_n > MAX_N:
        problems.append(f"max n {max_n} is above {MAX_N}")
    if draft_len < 1:
        problems.append(f"draft length {draft_len} must be at least 1")
    if match not in ("latest", "earliest"):
        problems.append(f"match rule {match!r} is neither 'latest' nor 'earliest'")
    if problems:
        raise InputError("invalid n-gram drafter parameters", problems=problems,
                         hint="e.g. --ngram-min 1 --ngram-max 4 --draft-len 5")
    return ConvertedDrafter(entry=NgramDrafter(min_n=min_n, max_n=max_n, draft_len=draft_len,
                                                   match=match))
