"""Token choice: greedy, or temperature / top-k / top-p sampling, and the accept rule.

Sampling draws the token at sequence position i as the target's own sample with noise keyed by
(seed, i): `argmax_v p(v) / E_i(v)` with E_i(v) ~ Exp(1) drawn from a generator seeded by the pair
(the exponential race, equivalent to Gumbel-max: v wins with probability p(v)). A draft token is
accepted when it equals that sample, so

  - the output is exactly the target's distribution, whatever the drafter proposes (lossless);
  - a position's token does not depend on whether it was drafted, on the draft length, or on
    which sequences share the step: seeded sampling gives the same tokens with or without
    speculation, alone or in any batch (the batched engine's invariance contract, with the
    row-exact kernels);
  - drafters that sample draw with the same noise on their own distribution q, which couples
    their proposal to the target's sample (they agree more often than independent draws would;
    an n-gram's point mass is accepted with probability p(draft), as in classic speculative
    sampling).

z-lab's DFlash reference verifies the same way (a draft is kept when it equals the target's own
sample at its position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specpack.errors import InputError
from specpack.runtime.kernels.argmax import argmax_rows

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature {self.temperature} (must be >= 0; 0 = greedy)")
        if self.top_k < 0:
            problems.append(f"top_k {self.top_k} (must be >= 0; 0 = off)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p {self.top_p} (must be in (0, 1]; 1 = off)")
        if problems:
            raise InputError("invalid sampling settings", problems=problems)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: Tensor, p: SamplingParams) -> Tensor:
    """logits [T, V] -> probabilities [T, V] after temperature, top-k and top-p (fp32)."""
    x = logits.float() / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def _mix(x: int) -> int:
    """splitmix64's finaliser: well-spread 64-bit keys from (seed, position)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Sampler:
    """One sequence's token choice: its settings, seed and the target's vocabulary size. Greedy
    ignores the seed."""

    CACHED = 40  # noise vectors kept: the positions one step drafts and verifies

    def __init__(self, params: SamplingParams, seed: int | None = None, vocab: int = 0):
        self.params, self.vocab = params, vocab
        self.seed = int(torch.randint(0, 2**63 - 1, ()).item()) if seed is None else int(seed)
        self._noise: dict[int, Tensor] = {}

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def probs(self, logits: Tensor) -> Tensor:
        return process_logits(logits, self.params)

    def noise(self, position: int) -> Tensor:
        """E(v) ~ Exp(1) over the target vocabulary, keyed by (seed, position): the same numbers
        every time, on the CPU."""
        if position not in self._noise:
            if len(self._noise) >= self.CACHED:
                self._noise.pop(min(self._noise))
            g = torch.Generator().manual_seed(_mix(self.seed ^ _mix(position)) >> 1)
            self._noise[position] = torch.empty(self.vocab).exponential_(generator=g)
        return self._noise[position]

    def pick(self, logits: Tensor, first_position: int) -> list[int]:
        """The target's token for each row of logits [T, V], row t at position first_position + t."""
        if self.greedy:
            return argmax_rows(logits)
        p = self.probs(logits)
        return [self.race(p[t], first_position + t) for t in range(p.shape[0])]

    def race(self, p: Tensor, position: int, ids: Tensor | None = None) -> int:
        """The sample at `position` from probabilities p [K] over the token ids `ids` [K] (None:
        ids 0..K-1), drawn with the target's noise on those ids: a drafter over a sub-vocabulary
        or a smaller vocabulary races its own tokens with the target's numbers."""
        k = self.race_index(p, position, ids)
        return k if ids is None else int(ids[k])

    def race_index(self, p: Tensor, position: int, ids: Tensor | None = None) -> int:
        """As `race`, the winner's index into p."""
        e = self.noise(position)
        e = e[ids.cpu()] if ids is not None else e[: p.shape[0]]
        return int((p.float().cpu() / e).argmax())


def accept(drafts: list[int], target: list[int]) -> tuple[int, list[int]]:
    """Keep the longest prefix of `drafts` equal to the target's own tokens (`target` has one more
    entry: the token after the last draft). Returns (drafts kept, tokens emitted): the kept drafts
    and the target's token after them."""
    a = next((i for i, (d, t) in enumerate(zip(drafts, target)) if d != t), len(drafts))
    return a, target[: a + 1]


def accept_tree(tokens: list[int], parents: list[int], target) -> tuple[list[int], list[int]]:
    """Walk a draft tree (node i: tokens[i] under parents[i], -1 the root) from its root: move to
    the child whose token is the target's own token after the current node (`target(node)`, -1 for
    the root), while there is one. Returns (the path's nodes, tokens emitted): the path's tokens and
    the target's token after its last node. With one child per node this is `accept`."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    path, node = [], -1
    while True:
        t = target(node)
        child = next((c for c in kids.get(node, ()) if tokens[c] == t), None)
        if child is None:
            return path, [tokens[n] for n in path] + [t]
        path.append(child)
        node = child
