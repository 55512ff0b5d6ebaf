"""What every drafter implements, and what the engine hands it.

A drafter drafts for many sequences at once, each in a slot of its own state:

    capture_layers            target hidden states it reads (input of layer i; the number of target
                              layers = the last layer's output), captured by the verification forward
    reserve(slots, max_len)   make room for `slots` sequences of `max_len` positions; empty them
    start(slot)               a new sequence takes `slot`
    draft(jobs) -> [Draft]    one draft per `DraftJob`, in one batched pass where it can; a tree
                              when the job asks for one and the drafter can branch (`tree_drafts`)

and may say how the engine prices its drafts: `free_drafts` (n-gram: nothing), `parallel_drafts`
(block drafters: one forward drafts every position; else a forward per position), and
`estimates_acceptance` (its drafts carry Draft.confidence, which cuts them before verification).

and, for single-sequence use (tests, references), `reset(max_len)` (one slot) and
`propose(context, feats, k, sampler) -> Draft` (slot 0).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Draft(NamedTuple):
    """A chain of tokens, or a tree of them: node i's token is tokens[i], its parent parents[i]
    (-1: the sequence's last committed token, the root; nodes in topological order, so a parent
    comes before its children)."""

    tokens: Tensor  # [k] target ids: a chain of k <= the draft length asked for, or k tree nodes
    # [k] the drafter's own estimate that each position is accepted given the ones before it were
    # (a DSpark confidence head); None when it has none. The engine may verify fewer positions.
    confidence: Tensor | None = None
    parents: Tensor | None = None  # [k] a tree's parent indices; None: a chain
    # [k] a tree node's probability under the drafter along its whole path (cumulative): how the
    # engine ranks the nodes it verifies; None: no estimate
    scores: Tensor | None = None


class TreeShape(NamedTuple):
    """The tree a drafter may propose: its depth is the draft length; at most `topk` children per
    node (1: a chain) and `nodes` nodes in all."""

    topk: int
    nodes: int


class DraftJob(NamedTuple):
    """What a drafter needs to draft for one sequence."""

    slot: int  # the sequence's cache slot (the drafter keeps its own state per slot)
    context: Tensor  # [n] every token so far
    feats: Tensor | None  # [r, F] the drafter's target features (capture_layers) of the r positions
    #                       committed since its last job for this slot: the tokens after them are
    #                       the last r of `context`
    k: int  # tokens to draft (a tree: its depth)
    sampler: object | None  # sampling.Sampler of the sequence, None when greedy
    tree: TreeShape | None = None  # None: a chain; drafters that cannot branch draft a chain anyway
