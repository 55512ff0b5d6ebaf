"""Prompt-lookup drafter: no weights; copies what followed the latest earlier occurrence of the
context's longest matching suffix (n from max_n down to min_n)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specpack.errors import InputError
from specpack.runtime.drafters.base import Draft, DraftJob


def lookup(context: Tensor, min_n: int, max_n: int, k: int) -> Tensor:
    """k tokens that followed the most recent earlier occurrence of the longest suffix of `context`
    [size] of length max_n..min_n; empty when none occurred. When the copy reaches the end of the
    context it goes on copying its own output (as LZ77 does), so a repeating run is proposed in full."""
    size = context.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows start at 0..size-1-n: every occurrence except the suffix itself
        windows = context[:-1].unfold(0, n, 1)  # [size - n, n]
        hits = (windows == context[-n:]).all(-1).nonzero()
        if len(hits):
            s = int(hits[-1]) + n  # first token after the occurrence
            period = size - s  # tokens between it and the end of the context
            return context[s + torch.arange(k, device=context.device) % period]
    return context[:0]


class NgramDrafter(nn.Module):
    """Deterministic proposals (point masses for speculative sampling)."""

    kind = "ngram"
    capture_layers: tuple[int, ...] = ()
    # Drafts cost nothing and hit in runs (copying) or not at all: follow what the target accepts.
    adaptive_draft_len = True
    free_drafts = True  # the engine's cost model charges nothing for drafting

    def __init__(self, min_n: int = 2, max_n: int = 4):
        super().__init__()
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise InputError(f"invalid n-gram sizes min_n={min_n!r}, max_n={max_n!r}",
                             hint="use integers with 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n

    def reserve(self, slots: int, max_len: int) -> None:
        """Nothing to allocate: the context is all the state."""

    def start(self, slot: int) -> None:
        """Nothing to reset."""

    def draft(self, jobs: list[DraftJob]) -> list[Draft]:
        return [Draft(lookup(j.context, self.min_n, self.max_n, j.k)) for j in jobs]

    def reset(self, max_len: int) -> None:
        """Nothing to allocate (the single-sequence form of `reserve`)."""

    def propose(self, context: Tensor, feats: Tensor | None, draft_len: int, sampler=None) -> Draft:
        return Draft(lookup(context, self.min_n, self.max_n, draft_len))


def load_ngram(params: dict | None, drafter_dir=None, target=None) -> NgramDrafter:
    """An n-gram drafter from `params` {min_n, max_n} (else drafter_dir/config.json, else defaults)."""
    import json
    from pathlib import Path

    cfg = {}
    if drafter_dir is not None and (Path(drafter_dir) / "config.json").is_file():
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    cfg.update(params or {})
    return NgramDrafter(**{k: cfg[k] for k in ("min_n", "max_n") if k in cfg})
