"""The decoding loop: prefill, then {draft D -> verify D+1 in one target forward -> accept -> roll back}.

Invariant between steps: the sequence holds n tokens, the target's KV cache the first n-1 (the last
token is the first input of the next verification), and the drafter has seen target features for
those n-1 positions except the ones handed to it in `feats`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from specpack.runtime.sampling import Sampler, SamplingParams, accept_greedy, accept_sampled

MAX_DRAFT_LEN = 16


class Draft(NamedTuple):
    tokens: Tensor  # [k] target ids, k <= the draft length asked for
    probs: Tensor | None  # [k, V] the drafter's distribution over the target vocab; None = point masses


@dataclass
class GenerationStats:
    """Counters of one `generate` call (definitions as in FORMATS.md 'Metrics')."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forwards after the prefill (one per verification)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens the accept rule kept (before any EOS / max-token cut)
    position_tried: list[int] = field(default_factory=list)  # [k]: verified with all before it accepted
    position_accepted: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.steps if self.steps else 1.0

    @property
    def position_acceptance(self) -> list[float]:
        """Conditional rate that draft position k is accepted given positions < k were."""
        return [a / t if t else 0.0 for a, t in zip(self.position_accepted, self.position_tried)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second after the prefill (what llama-bench's tg measures)."""
        decode = self.total_s - self.prefill_s
        return (self.new_tokens - 1) / decode if decode > 0 else 0.0

    def count(self, k: int, a: int) -> None:
        """One verification of k drafts of which a were accepted."""
        self.steps += 1
        self.proposed += k
        self.accepted += a
        while len(self.position_tried) < k:
            self.position_tried.append(0)
            self.position_accepted.append(0)
        for j in range(min(a + 1, k)):
            self.position_tried[j] += 1
            self.position_accepted[j] += j < a

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_length": self.acceptance_length,
                "position_acceptance": self.position_acceptance, "tokens_per_s": self.tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only; a final EOS or stop sequence is included
    finish_reason: str  # "eos" | "stop" | "length" | "context"
    stats: GenerationStats


class _Timer:
    """Wall-clock spans; waits for the GPU so each span holds its own work."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class _Output:
    """The tokens so far (a preallocated buffer), plus the stop conditions."""

    def __init__(self, prompt: Tensor, size: int, max_new: int, context: int, eos, stop, on_tokens):
        self.buf = torch.empty(size, dtype=torch.long, device=prompt.device)
        self.buf[: len(prompt)] = prompt
        self.n, self.max_new, self.context = len(prompt), max_new, context
        self.eos, self.stop, self.on_tokens = set(eos), [list(s) for s in stop or () if s], on_tokens
        self.new: list[int] = []
        self.finish: str | None = None

    @property
    def budget(self) -> int:
        """How many more tokens may be emitted."""
        return min(self.max_new - len(self.new), self.context - self.n)

    def emit(self, tokens: list[int]) -> None:
        """Append tokens, cutting at the first EOS, stop sequence, token limit or context end."""
        taken = []
        for t in tokens[: self.budget]:
            taken.append(t)
            self.new.append(t)
            if t in self.eos:
                self.finish = "eos"
            elif any(s[-1] == t and self.new[-len(s):] == s for s in self.stop):  # last token first: cheap
                self.finish = "stop"
            if self.finish:
                break
        self.buf[self.n : self.n + len(taken)] = torch.tensor(taken, dtype=torch.long)
        self.n += len(taken)
        if not self.finish and self.budget <= 0:
            self.finish = "length" if len(self.new) >= self.max_new else "context"
        if self.on_tokens is not None and taken:
            self.on_tokens(taken)


class DraftLength:
    """How many tokens to draft next: up to `max_len`, adapted to what the target has been accepting.

    All drafts accepted → double (copying runs long); none accepted → halve; some → unchanged. After `patience` rejected single-token drafts it stops drafting for `cooldown`
    steps, then probes with one token again: when drafts keep failing (open chat with n-gram), a
    verify over extra tokens is pure cost. Lossless: only the number of proposed tokens changes.
    """

    def __init__(self, max_len: int, adaptive: bool = True, patience: int = 2, cooldown: int = 8):
        self.max_len, self.adaptive, self.patience, self.cooldown = max_len, adaptive, patience, cooldown
        self.current, self.misses, self.resting = max_len, 0, 0

    def next(self) -> int:
        if self.resting:
            self.resting -= 1
            self.current = 1 if not self.resting else 0
            return 0 if self.resting else 1
        return self.current

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if accepted == proposed:
            self.current, self.misses = min(self.max_len, 2 * proposed), 0
        elif accepted == 0:
            self.misses = self.misses + 1 if proposed == 1 else 0
            self.current = max(1, proposed // 2)
            if self.misses >= self.patience:
                self.misses, self.resting = 0, self.cooldown
        else:
            self.misses = 0


def generate(target, drafter, prompt: Tensor, max_new_tokens: int, draft_len: int, sampling: SamplingParams,
             seed: int | None, eos_ids: Sequence[int], stop: Sequence[Sequence[int]] | None,
             speculative: bool, on_tokens: Callable[[list[int]], None] | None, context: int,
             adaptive: bool = True) -> GenerationResult:
    """Generate after `prompt` [m] (inputs already validated by SpecModel.generate)."""
    clock, stats = _Timer(target.device), GenerationStats(prompt_tokens=len(prompt))
    t_start = clock()
    size = min(context, len(prompt) + max_new_tokens)
    target.setup_cache(size)
    capture = drafter.capture_layers if speculative else ()
    if speculative:
        drafter.reset(size)
    sampler = Sampler(sampling, target.device, seed)
    out = _Output(prompt, size + 1, max_new_tokens, context, eos_ids, stop, on_tokens)

    res = target(prompt, capture=capture, last_only=True)  # prefill
    feats = res.aux
    out.emit(sampler.pick(res.logits[-1:]).tolist())
    stats.prefill_s = clock() - t_start

    no_draft, length = Draft(out.buf[:0], None), DraftLength(draft_len, adaptive)
    while not out.finish:
        n, t0 = out.n, clock()
        k = min(length.next(), out.budget - 1)  # never draft past what may still be emitted
        draft = drafter.propose(out.buf[:n], feats, k, None if sampling.greedy else sampler) if speculative \
            else no_draft
        t1 = clock()
        start = target.cache.length  # n - 1: all but the last token
        res = target(torch.cat([out.buf[n - 1 : n], draft.tokens]), capture=capture)  # verify 1 + k positions
        if sampling.greedy:
            a, new = accept_greedy(draft.tokens, res.logits)
        else:
            a, new = accept_sampled(draft.tokens, draft.probs, sampler.probs(res.logits), sampler.generator)
        target.cache.length = start + a + 1  # roll back: the rejected drafts' slots are dropped
        feats = None if res.aux is None else res.aux[: a + 1]  # features of the newly committed positions
        out.emit(new)
        t2 = clock()
        length.update(len(draft.tokens), a)
        stats.count(len(draft.tokens), a)
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1

    stats.new_tokens = len(out.new)
    stats.total_s = clock() - t_start
    return GenerationResult(out.new, out.finish, stats)
