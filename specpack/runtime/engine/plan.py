"""One engine step's rows (`Plan`): per decoding sequence its last token and its draft (`Proposal`,
a chain or a tree), per prefilling one a chunk of its prompt; which rows need logits; and where
each sequence's rows sit, for the accept step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpack.runtime.drafters.base import Draft
from specpack.runtime.drafters.tree import ancestor_mask, depths, is_chain
from specpack.runtime.models.rows import Segment


@dataclass
class Proposal:
    """One sequence's draft as the engine verifies it: a chain of tokens, or a tree (each node's
    parent, -1 for the root; topological order); `scores` the drafter's probability of each node
    along its path, when it gives them."""

    tokens: list[int]
    parents: list[int] | None = None  # None: a chain
    scores: list[float] | None = None
    copied: bool = False  # copied from the context (Request.lookup), not the drafter's

    @classmethod
    def of(cls, d: Draft) -> "Proposal":
        parents = None if d.parents is None or is_chain(d.parents.tolist()) else d.parents.tolist()
        return cls(d.tokens.tolist(), parents, None if d.scores is None else d.scores.tolist())

    def __len__(self) -> int:
        return len(self.tokens)

    def tree_parents(self) -> list[int]:
        """Every node's parent (a chain's too)."""
        return self.parents if self.parents is not None else list(range(-1, len(self.tokens) - 1))

    def keep(self, nodes) -> "Proposal":
        """The given nodes only (ascending, every ancestor included), renumbered."""
        nodes = list(nodes)
        index, old = {n: i for i, n in enumerate(nodes)}, self.tree_parents()
        parents = [index[old[n]] if old[n] >= 0 else -1 for n in nodes]
        return Proposal([self.tokens[n] for n in nodes], None if is_chain(parents) else parents,
                        None if self.scores is None else [self.scores[n] for n in nodes], self.copied)


class Plan:
    """The rows of one step: segments, their tokens, which rows need logits (and which of those
    only a greedy pick reads), and per sequence (seq, kind, first row, end row, first logits row,
    drafts)."""

    def __init__(self):
        self.segments: list[Segment] = []
        self.tokens: list[int] = []
        self.logit_rows: list[int] = []
        self.greedy: list[bool] = []  # per logits row
        self.entries: list[tuple] = []

    def greedy_rows(self) -> list[int]:
        """The logits rows (indices into `logit_rows`) of greedy sequences."""
        return [i for i, g in enumerate(self.greedy) if g]

    def _logits(self, s, rows: range) -> None:
        self.logit_rows += rows
        self.greedy += [s.sampler.greedy] * len(rows)

    def verify(self, s, draft: Proposal) -> None:
        """Generation `s`'s last token (the root) and its draft: a chain, or a tree whose rows see
        their ancestors at the positions of their depths."""
        a, n = len(self.tokens), len(draft)
        if draft.parents is None:
            self.segments.append(Segment(s.slot, s.cached, 1 + n))
        else:
            at = s.cached + torch.tensor([0] + depths(draft.parents))
            self.segments.append(Segment(s.slot, s.cached, 1 + n, ancestor_mask(draft.parents), at))
        self.tokens += [int(s.buf[s.n - 1])] + draft.tokens
        self.entries.append((s, "verify", a, len(self.tokens), len(self.logit_rows), draft))
        self._logits(s, range(a, len(self.tokens)))

    def keys(self) -> int:
        """Keys the plan's rows attend in all (row j of a chain at `start` attends start + j + 1)."""
        return sum(seg.T * seg.start + (seg.T * (seg.T + 1) // 2 if seg.block is None else int(seg.block.sum()))
                   for seg in self.segments)

    def extend(self, other: "Plan") -> None:
        """Append `other`'s rows after these (row indices shifted)."""
        a, la = len(self.tokens), len(self.logit_rows)
        self.segments += other.segments
        self.tokens += other.tokens
        self.logit_rows += [r + a for r in other.logit_rows]
        self.greedy += other.greedy
        self.entries += [(s, kind, x + a, y + a, None if lr is None else lr + la, d)
                         for s, kind, x, y, lr, d in other.entries]

    def prefill(self, s, budget: int | None) -> int | None:
        """Up to `budget` prompt rows of generation `s`; returns the budget left."""
        prompt = s.req.prompt
        take = len(prompt) - s.cached if budget is None else min(budget, len(prompt) - s.cached)
        a = len(self.tokens)
        self.segments.append(Segment(s.slot, s.cached, take))
        self.tokens += prompt[s.cached : s.cached + take]
        last = s.cached + take == len(prompt)
        first_logit = len(self.logit_rows) if last or s.req.record else None
        self.entries.append((s, "prefill", a, len(self.tokens), first_logit, None))
        if s.req.record:  # recording keeps the target's argmax at every prompt row too
            self._logits(s, range(a, len(self.tokens)))
        elif last:
            self._logits(s, range(len(self.tokens) - 1, len(self.tokens)))
        return None if budget is None else budget - take
