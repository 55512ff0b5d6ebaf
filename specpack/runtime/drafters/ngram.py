"""Prompt-lookup drafter: no weights; copies what followed an earlier occurrence of the context's
longest matching suffix (n from max_n down to min_n). Asked for a tree, it merges what followed
several earlier occurrences (branches where they differ).

Which occurrence (the manifest's `match`): `latest`, the most recent, its copy going on past the end
of the context as LZ77 does (specpack's rule), or `earliest`, the first, its copy stopping at the
context's end (vLLM's ngram proposer, v1/spec_decode/ngram_proposer.py). Lossless either way; the
acceptance differs, so an artifact states its rule and an export says where the engine's differs."""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor, nn

from specpack.errors import InputError
from specpack.runtime.drafters.base import Draft, DraftJob
from specpack.runtime.drafters.tree import Tree, branching


MATCHES = ("latest", "earliest")


def lookup(context: Tensor, min_n: int, max_n: int, k: int, match: str = "latest") -> Tensor:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `context` [size] of
    length max_n..min_n (`match`: the most recent or the first); empty when none occurred. `latest`
    copies on past the end of the context (its own output, as LZ77 does), so a repeating run is
    proposed in full; `earliest` stops there, as vLLM does."""
    found = continuations(context, min_n, max_n, k, 1, match)
    return found[0] if found else context[:0]


def continuations(context: Tensor, min_n: int, max_n: int, k: int, count: int, match: str = "latest") -> list[Tensor]:
    """Up to `count` continuations (copied as `lookup` does) of distinct earlier occurrences of the
    context's suffix: longer suffixes first, then the occurrence `match` prefers first."""
    size, out, starts = context.shape[0], [], set()
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows start at 0..size-1-n: every occurrence except the suffix itself
        windows = context[:-1].unfold(0, n, 1)  # [size - n, n]
        hits = (windows == context[-n:]).all(-1).nonzero().flatten().tolist()
        for hit in (hits if match == "earliest" else reversed(hits)):
            s = hit + n  # first token after the occurrence
            if s in starts:
                continue
            starts.add(s)
            out.append(_copy(context, s, k, match))
            if len(out) >= count:
                return out
    return out


def _copy(context: Tensor, s: int, k: int, match: str) -> Tensor:
    """k tokens from position s on: `earliest` stops at the context's end, `latest` wraps around."""
    size = context.shape[0]
    if match == "earliest":
        return context[s: s + k]
    return context[s + torch.arange(k, device=context.device) % (size - s)]


class SuffixIndex:
    """`lookup` for one growing context without scanning it: for each n, where every n-gram last
    occurred with a token after it, in a dictionary updated with the tokens added since the previous
    call (a draft step costs ~8 us a sequence, not 15-40 us of tensor scans: at 8 chat sequences the
    scans were 2% of a server's step time). A context that is not the one indexed (shorter, or its
    last indexed token differs) is indexed afresh."""

    def __init__(self, min_n: int, max_n: int, match: str = "latest"):
        self.min_n, self.max_n, self.earliest = min_n, max_n, match == "earliest"
        self._clear()

    def _clear(self) -> None:
        self.tokens: list[int] = []
        # ends[n][gram]: where the gram's latest (`earliest`: first) occurrence ends
        self.ends: list[dict[tuple, int]] = [{} for _ in range(self.max_n + 1)]

    def lookup(self, context: Tensor, k: int) -> Tensor:
        """Exactly `lookup(context, min_n, max_n, k, match)`."""
        self._extend(context)
        t, size = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            s = self.ends[n].get(tuple(t[size - n:]))
            if s is not None:  # s: the first token after the occurrence
                copied = t[s: s + k] if self.earliest else [t[s + i % (size - s)] for i in range(k)]
                return torch.tensor(copied, dtype=context.dtype, device=context.device)
        return context[:0]

    def _extend(self, context: Tensor) -> None:
        done, size = len(self.tokens), context.shape[0]
        if size < done or (done and int(context[done - 1]) != self.tokens[-1]):
            self._clear()
            done = 0
        self.tokens += context[done:].tolist()
        t = self.tokens
        for e in range(max(done, 1), size):  # occurrences ending at e, a token after them (e <= size - 1)
            for n in range(self.min_n, min(self.max_n, e) + 1):
                if self.earliest:
                    self.ends[n].setdefault(tuple(t[e - n: e]), e)
                else:
                    self.ends[n][tuple(t[e - n: e])] = e


def trie(branches: list[Tensor], budget: int) -> Draft:
    """The continuations merged into a tree (shared prefixes once), each node scored by the share
    of continuations through it; the `budget` best nodes (ties: the most recent occurrence's)."""
    seqs = [b.tolist() for b in branches]
    through = Counter(tuple(q[:d]) for q in seqs for d in range(len(q) + 1))
    tree = Tree()
    for q in seqs:
        node = -1
        for d in range(1, len(q) + 1):
            node = tree.add(node, q[d - 1], through[tuple(q[:d])] / through[tuple(q[: d - 1])])
    return tree.draft(budget)


class NgramDrafter(nn.Module):
    """Deterministic proposals (point masses for speculative sampling)."""

    kind = "ngram"
    capture_layers: tuple[int, ...] = ()
    # Drafts cost nothing and hit in runs (copying) or not at all: follow what the target accepts.
    adaptive_draft_len = True
    free_drafts = True  # the engine's cost model charges nothing for drafting
    tree_drafts = True  # several earlier occurrences' continuations as branches (DraftJob.tree)

    def __init__(self, min_n: int = 2, max_n: int = 4, match: str = "latest"):
        super().__init__()
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise InputError(f"invalid n-gram sizes min_n={min_n!r}, max_n={max_n!r}",
                             hint="use integers with 1 <= min_n <= max_n")
        if match not in MATCHES:
            raise InputError(f"unknown n-gram match rule {match!r}", hint="use " + " or ".join(MATCHES))
        self.min_n, self.max_n, self.match = min_n, max_n, match
        self._index: dict[int, SuffixIndex] = {}  # per cache slot

    def reserve(self, slots: int, max_len: int) -> None:
        """Nothing to allocate: each slot's suffix index grows with its context."""
        self._index = {}

    def start(self, slot: int) -> None:
        """A new sequence in `slot`: its index starts empty."""
        self._index.pop(slot, None)

    def draft(self, jobs: list[DraftJob]) -> list[Draft]:
        """A chain per job (from the slot's suffix index); a job that asks for a tree gets up to
        `topk` continuations (from distinct earlier occurrences) merged into one."""
        return [self._tree(j) if branching(j) else Draft(self._slot_index(j.slot).lookup(j.context, j.k))
                for j in jobs]

    def _slot_index(self, slot: int) -> SuffixIndex:
        if slot not in self._index:
            self._index[slot] = SuffixIndex(self.min_n, self.max_n, self.match)
        return self._index[slot]

    def _tree(self, job: DraftJob) -> Draft:
        found = continuations(job.context, self.min_n, self.max_n, job.k, job.tree.topk, self.match)
        if len(found) <= 1:
            return Draft(found[0] if found else job.context[:0])
        return trie(found, job.tree.nodes)

    def reset(self, max_len: int) -> None:
        """Nothing to allocate (the single-sequence form of `reserve`)."""

    def propose(self, context: Tensor, feats: Tensor | None, draft_len: int, sampler=None) -> Draft:
        return Draft(lookup(context, self.min_n, self.max_n, draft_len, self.match))


def load_ngram(params: dict | None, drafter_dir=None, target=None) -> NgramDrafter:
    """An n-gram drafter from `params` {min_n, max_n} (else drafter_dir/config.json, else defaults)."""
    import json
    from pathlib import Path

    cfg = {}
    if drafter_dir is not None and (Path(drafter_dir) / "config.json").is_file():
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    cfg.update(params or {})
    return NgramDrafter(**{k: cfg[k] for k in ("min_n", "max_n", "match") if k in cfg})
