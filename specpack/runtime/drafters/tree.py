"""Draft trees: growing one (candidates ranked by their cumulative draft probability, the best M
kept, as EAGLE-2/3 do), and the masks and depths a tree is verified with.

A tree is a list of nodes in topological order, node i holding a token and its parent's index
(-1: the root, the sequence's last committed token). Verified, the root is row 0 and node i row
i + 1; a row attends its ancestors and itself (`ancestor_mask`), at the RoPE position of its depth.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from specpack.runtime.drafters.base import Draft, DraftJob


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (the root's children are at depth 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def ancestor_mask(parents: Sequence[int]) -> Tensor:
    """[1+k, 1+k] bool over the root (row 0) and the k nodes (row i + 1): True where the column is
    the row itself or one of its ancestors."""
    k = len(parents)
    mask = torch.zeros(k + 1, k + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask


def fed_block(parents: Sequence[int], fed: Sequence[int], nodes: Sequence[int]) -> Tensor:
    """[T, F+T] bool: what draft rows for `nodes` (T of them, written after F rows already fed for
    the nodes `fed`) attend among those rows: their ancestors and themselves (a wide Segment.block;
    a fed node's ancestors were all fed before it)."""
    column = {n: c for c, n in enumerate([*fed, *nodes])}
    block = torch.zeros(len(nodes), len(column), dtype=torch.bool)
    for r, n in enumerate(nodes):
        while n >= 0:
            block[r, column[n]] = True
            n = parents[n]
    return block


def children(probs: Tensor, ks: Sequence[int], firsts: Sequence[int | None],
             ids: Tensor | None = None) -> list[list[tuple[int, float]]]:
    """For every row of probs [R, V]: up to ks[r] (token, probability) pairs, firsts[r] (a sampled
    choice) first when given, then the most probable others; zero-probability ones are left out.
    Tokens are `ids[index]` (a drafter's sub-vocabulary; None: the index)."""
    top = torch.topk(probs, min(max(ks) + 1, probs.shape[-1]))
    values, index = top.values.tolist(), top.indices.tolist()
    named = index if ids is None else ids[top.indices].tolist()  # the few picked ids, not the whole map
    name = (lambda i: i) if ids is None else (lambda i: int(ids[i]))
    out = []
    for r, (k, first) in enumerate(zip(ks, firsts)):
        kids = [] if first is None else [(name(first), float(probs[r, first]))]
        kids += [(t, p) for p, i, t in zip(values[r], index[r], named[r]) if p > 0 and i != first][: k - len(kids)]
        out.append(kids)
    return out


class Tree:
    """One sequence's candidate nodes while its tree grows: tokens, parents and cumulative
    log-probabilities under the drafter."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.logp: list[float] = []
        self.depth: list[int] = []
        self._kids: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, p: float) -> int:
        """Add `token` under `parent` (-1: the root) with conditional probability `p`; an existing
        sibling with the same token is returned instead."""
        key = (parent, token)
        if key in self._kids:
            return self._kids[key]
        base = self.logp[parent] if parent >= 0 else 0.0
        self.tokens.append(token)
        self.parents.append(parent)
        self.logp.append(base + (math.log(p) if p > 0 else -math.inf))
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self._kids[key] = len(self.tokens) - 1
        return self._kids[key]

    def best(self, depth: int, k: int) -> list[int]:
        """The `k` most probable nodes at `depth`, in node order."""
        level = [i for i, d in enumerate(self.depth) if d == depth]
        return sorted(sorted(level, key=lambda i: (-self.logp[i], i))[: max(k, 0)])

    def expandable(self, depth: int, k: int, budget: int) -> list[int]:
        """`best(depth, k)` less the nodes none of whose descendants could be among the `budget` nodes
        `draft` keeps: a child is never likelier than its parent and loses ties to every earlier node,
        so below a node no likelier than the budget-th likeliest so far nothing can enter. Skipping
        them leaves the draft as it is and saves the drafter their rows (all of a level's: a call)."""
        nodes = self.best(depth, k)
        if len(self) < budget or not nodes:
            return nodes
        cutoff = sorted(self.logp, reverse=True)[budget - 1]
        return [n for n in nodes if self.logp[n] > cutoff]

    def draft(self, budget: int) -> Draft:
        """The `budget` most probable nodes (a child is never likelier than its parent, and ties go
        to the earlier node, so they include every ancestor), renumbered in topological order;
        a chain when they form one."""
        keep = sorted(sorted(range(len(self)), key=lambda i: (-self.logp[i], i))[: max(budget, 0)])
        index = {n: i for i, n in enumerate(keep)}
        parents = [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in keep]
        tokens = torch.tensor([self.tokens[n] for n in keep], dtype=torch.long)
        scores = torch.tensor([math.exp(self.logp[n]) for n in keep], dtype=torch.float32)
        if is_chain(parents):
            return Draft(tokens, scores=scores)
        return Draft(tokens, parents=torch.tensor(parents, dtype=torch.long), scores=scores)


def branching(job: DraftJob) -> bool:
    """Whether `job` asks for a tree (more than one child per node)."""
    return job.tree is not None and job.tree.topk > 1


def argmax_only(jobs: Sequence[DraftJob]) -> list[int]:
    """The indices of the jobs whose draft logits only an argmax reads (greedy, drafting a chain):
    their rows may go through a greedy screen (kernels/screen.py)."""
    return [i for i, j in enumerate(jobs) if j.sampler is None and not branching(j)]


def draft_probs(logits: Tensor, jobs: Sequence[DraftJob]) -> Tensor:
    """The drafter's distributions [R, V] from logits [R, V], row r drafting for jobs[r]: its
    sampling settings, or the softmax when greedy."""
    probs = logits.float().softmax(-1)
    for r, j in enumerate(jobs):
        if j.sampler is not None:
            probs[r] = j.sampler.probs(logits[r : r + 1])[0]
    return probs


def branch(trees: Sequence["Tree"], parents: Sequence[int], logits: Tensor, jobs: Sequence[DraftJob], step: int,
           ks: Sequence[int], ids: Tensor | None = None) -> list[list[int]]:
    """Row r of logits [R, V] gives trees[r] up to ks[r] children of node parents[r] (-1: the root):
    jobs[r]'s draft distribution at draft position `step`, a sampled job's keyed choice first (as its
    chain would draft), then the likeliest others. Tokens are `ids[index]` (None: the index).
    Returns each row's added nodes."""
    probs = draft_probs(logits, jobs)
    firsts = [None if j.sampler is None else j.sampler.race_index(probs[r], len(j.context) + step, ids)
              for r, j in enumerate(jobs)]
    return [[tree.add(parent, token, p) for token, p in kids]
            for tree, parent, kids in zip(trees, parents, children(probs, ks, firsts, ids))]


class Branches:
    """Chain drafters (MTP layers, a draft model) grown into trees: each step's chosen token
    continues the chain, its top-k alternatives from the same distribution become leaves beside it
    (the chain is the only path that is fed further). Jobs that ask for no tree stay chains."""

    def __init__(self, jobs: Sequence[DraftJob]):
        self.jobs = list(jobs)
        self.trees = [Tree() if branching(j) else None for j in jobs]
        self.tips = [-1] * len(self.jobs)

    def add(self, i: int, step: int, logits: Tensor, token: int) -> None:
        """Job i chose `token` at draft step `step` from `logits` [V] (its vocabulary: target ids)."""
        tree, job = self.trees[i], self.jobs[i]
        if tree is None or step >= job.k:
            return
        probs = draft_probs(logits[None], [job])
        parent = self.tips[i]
        for n, (t, p) in enumerate(children(probs, [job.tree.topk], [token])[0]):
            node = tree.add(parent, t, p)
            if n == 0:
                self.tips[i] = node

    def drafts(self, chains: Sequence[Sequence[int]]) -> list[Draft]:
        """Each job's tree (its node budget), or its chain of the first k tokens."""
        return [tree.draft(j.tree.nodes) if tree is not None else Draft(torch.tensor(c[: j.k], dtype=torch.long))
                for j, c, tree in zip(self.jobs, chains, self.trees)]
