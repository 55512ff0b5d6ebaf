"""The counters of a generation, its result, and the draft length policy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

MAX_DRAFT_LEN = 16
MAX_TREE_TOPK = 8  # children per draft tree node
MAX_TREE_NODES = 64  # nodes in one draft tree


@dataclass
class GenerationStats:
    """Counters of one `generate` call (definitions as in docs/running.md, 'What the figures mean').

    The drafter's figures count only the verifications that carried its drafts: a step that drafted
    nothing (the cost model said drafts would not pay, a request's last token, speculation turned off
    under load) or verified a prompt-lookup copy says nothing of the drafter, so it is counted in
    `steps` and `tokens_per_step`, never in `acceptance_length`."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forwards after the prefill (one per verification, drafted or not)
    drafted_steps: int = 0  # of those, verifications of the drafter's own drafts (a lookup copy is not one)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens the accept rule kept (before any EOS / max-token cut), copies included
    position_tried: list[int] = field(default_factory=list)  # [k]: verified with all before it accepted (the
    # drafter's drafts: a lookup copy's positions are counted in lookup_steps / lookup_accepted only)
    position_accepted: list[int] = field(default_factory=list)
    depth_steps: list[int] = field(default_factory=list)  # [d]: verifications whose accepted path was d deep
    draft_len_steps: list[int] = field(default_factory=list)  # [k]: verifications of k drafter tokens deep
    probe_steps: int = 0  # drafted verifications the cost model had not asked for (Engine._probe)
    lookup_steps: int = 0  # verifications of drafts copied from the context (Request.lookup)
    lookup_accepted: int = 0  # their draft tokens kept
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """The drafter's: 1 + its accepted draft tokens / the verifications of its drafts (1.0 when it
        drafted nothing; `drafted_steps` says so)."""
        if not self.drafted_steps:
            return 1.0
        return 1 + (self.accepted - self.lookup_accepted) / self.drafted_steps

    @property
    def tokens_per_step(self) -> float:
        """Tokens each target forward after the prefill gained, every step counted (undrafted steps and
        lookup copies included): what the speed follows."""
        return 1 + self.accepted / self.steps if self.steps else 1.0

    @property
    def undrafted_steps(self) -> int:
        """Verifications that carried no draft at all (neither the drafter's nor a lookup copy)."""
        return self.steps - self.drafted_steps - self.lookup_steps

    @property
    def accepted_depth(self) -> float:
        """Mean depth of the accepted path per drafted verification (a chain's accepted drafts)."""
        return self.acceptance_length - 1

    @property
    def mean_draft_len(self) -> float:
        """Drafter tokens deep per verification of its drafts (a tree: its depth)."""
        total = sum(k * n for k, n in enumerate(self.draft_len_steps))
        return total / self.drafted_steps if self.drafted_steps else 0.0

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

    def count(self, k: int, a: int, proposed: int | None = None, copied: bool = False, probe: bool = False) -> None:
        """One verification of k drafts (a tree: `proposed` nodes k deep; k = 0: no draft) of which a
        were accepted (a tree: its accepted path's depth); `copied`: a prompt-lookup copy
        (Request.lookup), which counts in the step figures but not in the drafter's; `probe`: a
        draft the cost model had not asked for."""
        self.steps += 1
        self.probe_steps += probe and k > 0
        self.lookup_steps += copied
        self.lookup_accepted += a if copied else 0
        self.proposed += k if proposed is None else proposed
        self.accepted += a
        _bump(self.depth_steps, a)
        if copied:
            return
        _bump(self.draft_len_steps, k)
        self.drafted_steps += k > 0
        while len(self.position_tried) < k:
            self.position_tried.append(0)
            self.position_accepted.append(0)
        for j in range(min(a + 1, k)):
            self.position_tried[j] += 1
            self.position_accepted[j] += j < a

    def add(self, other: "GenerationStats") -> None:
        """Add `other`'s counters into these (per-position and per-depth lists padded to the longer)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                mine += [0] * (len(theirs) - len(mine))
                for i, n in enumerate(theirs):
                    mine[i] += n
            else:
                setattr(self, f.name, mine + theirs)

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_length": self.acceptance_length, "tokens_per_step": self.tokens_per_step,
                "undrafted_steps": self.undrafted_steps, "accepted_depth": self.accepted_depth,
                "mean_draft_len": self.mean_draft_len, "position_acceptance": self.position_acceptance,
                "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}


def _bump(counts: list[int], i: int) -> None:
    counts += [0] * (i + 1 - len(counts))
    counts[i] += 1


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


