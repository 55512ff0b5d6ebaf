"""The counters of a generation, its result, and the draft length policy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MAX_DRAFT_LEN = 16
MAX_TREE_TOPK = 8  # children per draft tree node
MAX_TREE_NODES = 64  # nodes in one draft tree


@dataclass
class GenerationStats:
    """Counters of one `generate` call (definitions as in FORMATS.md 'Metrics')."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forwards after the prefill (one per verification)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens the accept rule kept (before any EOS / max-token cut)
    position_tried: list[int] = field(default_factory=list)  # [k]: verified with all before it accepted (the
    # drafter's drafts: a lookup copy's positions are counted in lookup_steps / lookup_accepted only)
    position_accepted: list[int] = field(default_factory=list)
    depth_steps: list[int] = field(default_factory=list)  # [d]: verifications whose accepted path was d deep
    lookup_steps: int = 0  # verifications of drafts copied from the context (Request.lookup)
    lookup_accepted: int = 0  # their draft tokens kept
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.steps if self.steps else 1.0

    @property
    def accepted_depth(self) -> float:
        """Mean depth of the accepted path per verification (a chain's accepted drafts)."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """Conditional rate that the drafter's draft position k is accepted given positions < k were
        (prompt lookup copies left out: this is what a profile hands the engine as its prior)."""
        return [a / t if t else 0.0 for a, t in zip(self.position_accepted, self.position_tried)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second after the prefill (what llama-bench's tg measures)."""
        decode = self.total_s - self.prefill_s
        return (self.new_tokens - 1) / decode if decode > 0 else 0.0

    def count(self, k: int, a: int, proposed: int | None = None, copied: bool = False) -> None:
        """One verification of k drafts (a tree: `proposed` nodes k deep) of which a were accepted
        (a tree: its accepted path's depth); `copied`: a prompt-lookup copy (Request.lookup), which
        counts in the acceptance length but not in the drafter's per-position acceptance."""
        self.steps += 1
        self.lookup_steps += copied
        self.lookup_accepted += a if copied else 0
        self.proposed += k if proposed is None else proposed
        self.accepted += a
        self.depth_steps += [0] * (a + 1 - len(self.depth_steps))
        self.depth_steps[a] += 1
        if copied:
            return
        while len(self.position_tried) < k:
            self.position_tried.append(0)
            self.position_accepted.append(0)
        for j in range(min(a + 1, k)):
            self.position_tried[j] += 1
            self.position_accepted[j] += j < a

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_length": self.acceptance_length, "accepted_depth": self.accepted_depth,
                "position_acceptance": self.position_acceptance, "tokens_per_s": self.tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only; a final EOS or stop sequence is included
    finish_reason: str  # "eos" | "stop" | "length" | "context"
    stats: GenerationStats


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


