"""Token choice: greedy, or temperature / top-k / top-p sampling; and the two accept rules.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) keeps the target's distribution
exactly, whatever the drafter proposes: q is the drafter's distribution for each proposed token, or a
point mass for deterministic proposals (n-gram).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specpack.errors import InputError


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


class Sampler:
    """Sampling settings plus a seeded generator on the model's device."""

    def __init__(self, params: SamplingParams, device, seed: int | None = None):
        self.params = params
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def probs(self, logits: Tensor) -> Tensor:
        return process_logits(logits, self.params)

    def sample(self, probs: Tensor) -> Tensor:
        """probs [T, V] -> token ids [T]."""
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def pick(self, logits: Tensor) -> Tensor:
        """logits [T, V] -> token ids [T]: argmax when greedy, else a sample."""
        return logits.argmax(-1) if self.params.greedy else self.sample(self.probs(logits))


def accept_greedy(draft: Tensor, logits: Tensor) -> tuple[int, list[int]]:
    """Keep the longest prefix of `draft` [k] equal to the target's argmax; logits [k+1, V].
    Returns (accepted, emitted): the emitted tokens are that prefix plus the target's next token."""
    k = draft.shape[0]
    both = torch.cat([logits.argmax(-1), draft]).tolist()  # one device sync
    pred, proposed = both[: k + 1], both[k + 1 :]
    a = next((i for i in range(k) if proposed[i] != pred[i]), k)
    return a, pred[: a + 1]


def accept_sampled(draft: Tensor, q: Tensor | None, p: Tensor, generator: torch.Generator) -> tuple[int, list[int]]:
    """Speculative sampling. draft [k]; q [k, V] the drafter's distributions (None: point masses);
    p [k+1, V] the target's processed distributions. Returns (accepted, emitted tokens)."""
    k = draft.shape[0]
    rows = torch.arange(k, device=p.device)
    px = p[rows, draft]
    qx = q[rows, draft] if q is not None else torch.ones_like(px)
    # accept draft i with probability min(1, p(x)/q(x)), stopping at the first rejection;
    # on rejection sample from norm(max(0, p - q)); if all k are accepted, sample a bonus from p.
    ok = torch.rand(k, device=p.device, generator=generator) * qx < px
    a = int(ok.cumprod(0).sum()) if k else 0
    if a < k:
        qa = q[a] if q is not None else torch.nn.functional.one_hot(draft[a], p.shape[-1]).to(p.dtype)
        residual = (p[a] - qa).clamp_min(0)
        dist = residual if residual.sum() > 0 else p[a]  # p == q up to rounding: nothing to correct
    else:
        dist = p[k]
    nxt = torch.multinomial(dist, 1, generator=generator)
    return a, draft[:a].tolist() + nxt.tolist()
