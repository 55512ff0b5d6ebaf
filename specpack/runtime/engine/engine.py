"""The batched engine: many sequences decode together, one target forward per step.

Each step:
  1. draft  — every decoding sequence that speculates gets a draft of its own length (one batched
              drafter call for all of them);
  2. verify — one target forward over every sequence's new rows: 1 + D_i rows per decoding
              sequence (its last token, then its drafts) plus a chunk of each prompt still being
              prefilled; the linear layers stream each weight once for all rows, attention runs
              per row against that row's own sequence (rows.Rows);
  3. accept — per sequence, the longest prefix of its draft equal to the target's own tokens
              (greedy, or its keyed sample: sampling.Sampler), plus the target's next token; a
              tree draft (root + nodes, each row attending its ancestors, at the position of its
              depth) gives the longest path of such tokens;
  4. roll back — per sequence, by lowering its length: the rejected drafts' cache positions are
              never attended and get overwritten. A tree's accepted path is not contiguous in
              the cache: its rows are first moved to the positions right after the prefix.

A sequence owns one cache slot (a static region of max_len positions) from `add` until it
finishes; the slot is free for the next request at once. Prompts are prefilled in chunks of at
most `prefill_chunk` rows per step, so a long prompt does not stall everyone else.

Invariant between steps, per decoding sequence: it holds n tokens, the target's cache the first
n-1 (the last token is the first row of its next verification), and `pending` holds the drafter
features of committed positions the drafter has not seen yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import Tensor

from specpack.errors import InputError
from specpack.runtime.drafters.base import DraftJob, TreeShape
from specpack.runtime.drafters.ngram import SuffixIndex
from specpack.runtime.drafters.tree import depths
from specpack.runtime.engine import cost as costs
from specpack.runtime.engine.sampling import Sampler, SamplingParams, accept, accept_tree
from specpack.runtime.engine.stats import (MAX_DRAFT_LEN, MAX_TREE_NODES, MAX_TREE_TOPK, DraftLength,
                                           GenerationResult, GenerationStats)
from specpack.runtime.engine.plan import Plan, Proposal
from specpack.runtime.models.rows import Rows

# Per-position acceptance a sequence starts from when nothing better is known (a profile's measured
# figures replace it): optimistic enough that a fresh sequence drafts, then its own record decides.
# One rate for every position: a position never tried is estimated as the deepest one tried so far
# (costs.Acceptance), so a head whose first positions keep being accepted is asked for more. A prior
# falling with depth (0.6 ... 0.4) held positions 3+ at its guess while drafts stopped at 2, so they
# were never tried and never learned (issue 43: a head with 0.9 per position drafted 1.75 a step).
DEFAULT_PRIOR = (0.6,)
# Suffix lengths a prompt-lookup draft (Request.lookup) must match, longest first. From 2, a chat turn's
# common word pairs hit twice as often (8% of steps against 3-4%) for no gain (BENCHMARKS.md).
LOOKUP_N = (3, 4)
# Per-position acceptance of a lookup's copy before a sequence has its own record: on HumanEval a third of
# the steps copy and keep ~4 of 8 tokens (BENCHMARKS.md, bench/lookup.py)
LOOKUP_PRIOR = (0.8, 0.8, 0.75, 0.75, 0.7, 0.7, 0.7, 0.7)


@dataclass
class Request:
    """One generation: a prompt (token ids) and how to continue it."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    eos: tuple[int, ...] = ()
    stop: tuple[tuple[int, ...], ...] = ()
    speculative: bool = True
    draft_len: int = 4  # the longest draft (a tree's depth)
    adaptive: bool = False  # follow acceptance (speculative.DraftLength) instead of drafting draft_len
    on_tokens: Callable[[list[int]], None] | None = None  # each step's new tokens (may raise to cancel)
    record: bool = False  # keep the captured states and the target's argmax at every committed position
    tree: TreeShape | None = None  # draft trees of this shape where the drafter can branch; None: chains
    # where the context's last LOOKUP_N tokens occurred before, draft up to max(draft_len, lookup) tokens
    # copied from what followed (free: no drafter call) instead of the drafter's; 0: never
    lookup: int = 0


def check_tree(tree: TreeShape | None) -> None:
    """Raise InputError when a request's tree shape is out of range."""
    if tree is None:
        return
    if not (all(isinstance(x, int) for x in tree) and 1 <= tree.topk <= MAX_TREE_TOPK
            and 1 <= tree.nodes <= MAX_TREE_NODES):
        raise InputError(f"draft tree of top-k {tree.topk!r} with {tree.nodes!r} nodes is out of range",
                         hint=f"use top-k 1..{MAX_TREE_TOPK} and 1..{MAX_TREE_NODES} nodes")


QUIET_STEPS = 4  # after a step where nobody drafts, draft lengths are chosen again every 4th step
PROBE_EVERY = 16  # steps nobody drafts in before one sequence drafts anyway (Engine._probe)
# How fast a sequence's record of its drafts' acceptance follows each verification and drifts back to its
# prior while undrafted (costs.Acceptance: weight, relax). A drafter that rates its own drafts (DSpark's
# confidence head) consults the record only to decide whether to draft its block at all, its confidences
# then cut the block: its record runs three times slower, as its acceptance does (the shipped SmolLM2
# DSpark head on HumanEval kept 0.41 tokens a step after three misses in a row, 0.80 on average; at 0.3
# four misses stopped its drafting; BENCHMARKS.md). A hopeless drafter is still dropped, after more misses
# (about ten from an optimistic prior, where four did), then probed as rarely as before.
RECORD_PACE, CONFIDENT_RECORD_PACE = (0.3, 0.05), (0.1, 0.05 / 3)


class Generation:
    """A request being decoded: its slot, tokens, stop rules, counters."""

    def __init__(self, req: Request, slot: int, capacity: int, vocab: int, device, prior=DEFAULT_PRIOR,
                 start=None, calibration=None, record_pace: tuple[float, float] = RECORD_PACE):
        self.req, self.slot = req, slot
        self.sampler = Sampler(req.params, req.seed, vocab)
        self.buf = torch.empty(capacity + 1, dtype=torch.long, device=device)
        self.buf[: len(req.prompt)] = torch.tensor(req.prompt, dtype=torch.long)
        self.n, self.capacity = len(req.prompt), capacity
        self.cached = 0  # positions in the target's cache
        self.new: list[int] = []
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.pending: list[Tensor] = []  # drafter features of committed positions not yet drafted from
        self.pending_rows = 0  # their positions, kept as a count (the cost model asks every step)
        self.recorded: list[tuple[Tensor, Tensor]] = []  # with req.record: (states, argmax) per commit
        self.drafted = False  # has had a draft (its drafter has seen the prompt)
        self.idle = 0  # decoding steps since its drafter's drafts were last verified
        self.probing = False  # this step's draft is a probe (Engine._probe): a tree is verified unpruned
        self.asked = 0  # draft tokens (a tree: levels) asked of the drafter this step, before any trimming
        self.length = DraftLength(req.draft_len, req.adaptive)
        self.acceptance = costs.Acceptance(prior, *record_pace, start=start)  # starts from the engine's record
        self.calibration = costs.Calibration(start=calibration)  # its tree drafts' probabilities vs acceptance
        self.lookup = SuffixIndex(*LOOKUP_N) if req.lookup and req.speculative else None
        self.copies = costs.Acceptance(LOOKUP_PRIOR) if self.lookup else None  # its copies' record
        self.stats = GenerationStats(prompt_tokens=len(req.prompt))
        self.started = time.perf_counter()

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.req.prompt)

    @property
    def budget(self) -> int:
        """How many more tokens may be emitted."""
        return min(self.req.max_new_tokens - len(self.new), self.capacity - self.n)

    def context(self) -> Tensor:
        return self.buf[: self.n]

    def catch_up_rows(self) -> int:
        """The head positions a draft this step must catch up on, as the cost model prices them. The
        prompt's catch-up is the price of speculating at all, bought once for every later step: a
        sequence that has not drafted yet gets the share of it that its remaining life will use free
        (all at its start; little near its end, where a first draft would buy it for a step or two)."""
        if self.drafted:
            return self.pending_rows
        life = len(self.new) + self.budget
        return self.pending_rows - len(self.req.prompt) * self.budget // max(1, life)

    def emit(self, tokens: list[int]) -> None:
        """Append tokens, cutting at the first EOS, stop sequence, token limit or context end."""
        taken = []
        for t in tokens[: self.budget]:
            taken.append(t)
            self.new.append(t)
            if t in self.req.eos:
                self.finish = "eos"
            elif any(s[-1] == t and self.new[-len(s):] == list(s) for s in self.req.stop if s):  # last first: cheap
                self.finish = "stop"
            if self.finish:
                break
        self.buf[self.n : self.n + len(taken)] = torch.tensor(taken, dtype=torch.long)
        self.n += len(taken)
        if not self.finish and self.budget <= 0:
            self.finish = "length" if len(self.new) >= self.req.max_new_tokens else "context"
        if self.req.on_tokens is not None and taken:
            self.req.on_tokens(taken)

    def result(self) -> GenerationResult:
        self.stats.new_tokens = len(self.new)
        self.stats.total_s = time.perf_counter() - self.started
        return GenerationResult(self.new, self.finish or "cancelled", self.stats)


class _Timer:
    """Wall-clock spans; waits for the GPU so each span holds its own work."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class Engine:
    """Decodes up to `slots` sequences together on `target` with `drafter` (None: no speculation).

    `max_len` is each slot's size in positions (prompt + new tokens); `prefill_chunk` caps the
    prompt rows one step takes (None: whole prompts). With a `cost` model (cost.CostModel) each
    step chooses every sequence's draft length from it and the sequence's acceptance record
    (starting from `prior`); without one, each sequence drafts what its DraftLength policy says.
    Without a drafter, `capture` names target layers whose states requests with `record` keep
    (distill's self-generation)."""

    def __init__(self, target, drafter=None, slots: int = 1, max_len: int = 2048,
                 prefill_chunk: int | None = 256, cost: costs.CostModel | None = None,
                 prior=DEFAULT_PRIOR, capture: tuple[int, ...] = ()):
        self.target, self.drafter = target, drafter
        self.slots, self.max_len, self.prefill_chunk = slots, max_len, prefill_chunk
        if cost is not None and getattr(drafter, "parallel_drafts", False):
            cost = replace(cost, parallel_drafts=True)  # a draft of any length is one head forward
        self.cost, self.prior = cost, tuple(prior)
        # where the learned drafter cost drifts back to while nobody drafts
        self.draft_prior = cost.draft_ratio if cost is not None else 0.0
        self.draft_call_prior = cost.draft_call_ms if cost is not None else 0.0
        self.draft_fit = costs.LinearFit()  # the drafter's call time, learned as it drafts
        measured = cost.key_ms_measured if cost is not None else 0.0  # attention is not other processes' load:
        self.step_fit = costs.LinearFit(b_range=(measured / 4, 4 * measured) if measured else (0.0, float("inf")))
        self._quiet: tuple = (None, 0)  # (the sequences and prompt rows of a step nobody drafted in, steps left)
        self._drafted, self._idle = False, 0  # anybody drafted yet; steps since anybody's draft was chosen (_probe)
        self.acceptance = costs.Acceptance(prior, weight=0.05)  # every sequence's record: where new ones start
        self.record_pace = (CONFIDENT_RECORD_PACE if getattr(drafter, "estimates_acceptance", False)
                            else RECORD_PACE)  # each sequence's own record's
        self.calibration = costs.Calibration(weight=0.05)  # likewise for tree drafts' probabilities
        self.speculate = True  # the scheduler turns drafting off for a step (load above a measured limit)
        self.last_rows = 0  # rows in the latest target forward
        self.last_forward_ms = self.last_draft_ms = 0.0  # the latest step's target forward and drafter call
        self.device = target.device
        self.clock = _Timer(self.device)
        target.setup_cache(max_len, slots)
        if drafter is not None:
            drafter.reserve(slots, max_len)
        if capture and drafter is not None:
            raise ValueError("extra capture layers are for engines without a drafter (recording)")
        self.capture = tuple(drafter.capture_layers) if drafter is not None else tuple(capture)
        self.free = list(range(slots - 1, -1, -1))
        self.running: list[Generation] = []

    # ---- admission -------------------------------------------------------------------------

    def check(self, req: Request) -> None:
        """Raise InputError when `req` can never run on this engine."""
        vocab = self.target.spec.vocab_size
        if not req.prompt:
            raise InputError("the prompt is empty", hint="give at least one token (e.g. BOS)")
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise InputError(f"prompt token ids outside the vocabulary of {vocab}: {bad[:10]}")
        if not (isinstance(req.max_new_tokens, int) and req.max_new_tokens >= 1):
            raise InputError(f"max_new_tokens {req.max_new_tokens!r} must be a positive integer")
        if len(req.prompt) >= self.max_len:
            raise InputError(f"the prompt has {len(req.prompt)} tokens but the context holds {self.max_len}",
                             hint="shorten the prompt: at least one new token needs room")
        if not (isinstance(req.draft_len, int) and 1 <= req.draft_len <= MAX_DRAFT_LEN):
            raise InputError(f"draft length {req.draft_len!r} is out of range", hint=f"use 1..{MAX_DRAFT_LEN}")
        if req.speculative and self.drafter is None:
            raise InputError("speculative decoding needs a drafter", hint="pass speculative=False or load one")
        if req.speculative and hasattr(self.drafter, "check_draft_len"):  # e.g. MTP: no more steps than layers
            self.drafter.check_draft_len(req.draft_len)
        check_tree(req.tree)
        if not (isinstance(req.lookup, int) and 0 <= req.lookup <= MAX_DRAFT_LEN):
            raise InputError(f"lookup draft length {req.lookup!r} is out of range",
                             hint=f"use 0 (off) or 1..{MAX_DRAFT_LEN}")

    @property
    def has_room(self) -> bool:
        return bool(self.free)

    def add(self, req: Request) -> Generation:
        """Start `req` in a free slot (checked first); it joins the next step."""
        self.check(req)
        if not self.free:
            raise RuntimeError("no free slot: check has_room before add")
        slot = self.free.pop()
        seq = Generation(req, slot, min(self.max_len, len(req.prompt) + req.max_new_tokens),
                         self.target.spec.vocab_size, self.device, self.prior, self.acceptance.rates(),
                         self.calibration.state(), self.record_pace)
        if self.drafter is not None:
            self.drafter.start(slot)
        self.running.append(seq)
        return seq

    def cancel(self, seq: Generation, reason: str = "cancelled") -> None:
        """Stop `seq` now and free its slot."""
        if seq in self.running:
            seq.finish = seq.finish or reason
            self._release(seq)

    def _release(self, seq: Generation) -> None:
        self.running.remove(seq)
        self.free.append(seq.slot)
        seq.pending, seq.pending_rows = [], 0
        seq.stats.new_tokens = len(seq.new)
        seq.stats.total_s = time.perf_counter() - seq.started

    # ---- one step --------------------------------------------------------------------------

    def step(self) -> list[Generation]:
        """Draft, verify, accept and roll back once for every running sequence; returns those that
        finished (their slots are free again)."""
        if not self.running:
            return []
        t0 = self.clock()
        decoding = [s for s in self.running if not s.prefilling]
        prefill = Plan()
        budget = self.prefill_chunk
        for s in (s for s in self.running if s.prefilling):
            if budget is not None and budget <= 0:
                break
            budget = prefill.prefill(s, budget)
        drafts = self._draft(decoding, len(prefill.tokens), prefill.keys())
        t1 = self.clock()
        plan = Plan()
        for s, d in zip(decoding, drafts):
            plan.verify(s, d)
        plan.extend(prefill)
        self.last_rows = len(plan.tokens)
        f0 = self.clock()
        res = self.target.forward_rows(torch.tensor(plan.tokens, dtype=torch.long, device=self.device),
                                       Rows.of(plan.segments, self.device), self.capture, plan.logit_rows,
                                       greedy_rows=plan.greedy_rows())
        self.last_forward_ms = (self.clock() - f0) * 1e3
        done = self._commit(plan, res)
        t2 = self.clock()
        if self.cost is not None:  # what the curve and the drafting do not explain: keys and the step's own work
            c = self.cost
            beyond = (t2 - t0) * 1e3 - self.last_draft_ms - c.step_ms(self.last_rows)
            self.cost = c.with_step(*self.step_fit.observe(c.overhead_ms, c.key_ms, plan.keys(), beyond))
        for s in decoding:
            s.stats.draft_s += t1 - t0
            s.stats.verify_s += t2 - t1
        for s in done:
            self._release(s)
        return done

    def _lengths(self, decoding: list[Generation], prefill_rows: int, prefill_keys: int = 0) -> list[int]:
        """How many tokens each decoding sequence drafts this step (a tree: its depth)."""
        if not self.speculate:
            return [0] * len(decoding)
        if self.cost is None:
            return [min(s.length.next(), s.budget - 1) if s.req.speculative else 0 for s in decoding]
        # after a step where nobody drafts, the same sequences (no prompt rows joining) are asked again
        # every QUIET_STEPS-th step only: what decides moves slowly then (the records' drift back to
        # their priors, contexts a token longer) and asking costs ~0.4 ms a step at 16 sequences
        key = (tuple(s.slot for s in decoding), prefill_rows)
        if self._quiet[0] == key and self._quiet[1] > 0:
            self._quiet = (key, self._quiet[1] - 1)
            return self._probe(decoding, [0] * len(decoding), prefill_rows)
        lengths = self._chosen(decoding, prefill_rows, prefill_keys)
        self._quiet = (key, QUIET_STEPS - 1) if not any(lengths) else (None, 0)
        return self._probe(decoding, lengths, prefill_rows)

    def _probe(self, decoding: list[Generation], lengths: list[int], prefill_rows: int) -> list[int]:
        """Where the cost model drafts for nobody, one sequence drafts its full length anyway: at
        the engine's first chance if nobody has drafted yet, then once every PROBE_EVERY such steps (the one idle longest): a
        chain is verified whole, a tree unpruned (a confidence head still cuts its own block, whose
        record is of what survives the cut). Its record, and the engine's, then hold what the drafter achieves rather
        than the prior they started from, so a decision not to draft rests on evidence (a head that
        never drafted was judged by its prior alone: issue 43), and acceptance that comes back (chat
        turning to code) is found again. At most one draft every PROBE_EVERY steps, whatever the load,
        and only once every running sequence decodes (a prompt still coming in makes the step dearer
        than the steady ones the probe is about)."""
        if any(lengths):
            self._drafted, self._idle = True, 0
            return lengths
        ready = [i for i, s in enumerate(decoding) if s.req.speculative and s.budget > 1]
        steady = not prefill_rows and len(decoding) == len(self.running)
        if not ready or not steady or (self._drafted and self._idle < PROBE_EVERY):
            self._idle += 1
            return lengths
        i = max(ready, key=lambda i: decoding[i].idle)
        s = decoding[i]
        s.probing, self._drafted, self._idle = True, True, 0
        return [min(s.req.draft_len, s.budget - 1) if j == i else 0 for j in range(len(decoding))]

    def _chosen(self, decoding: list[Generation], prefill_rows: int, prefill_keys: int) -> list[int]:
        """The cost model's draft lengths this step (see `_lengths`)."""
        pending = [s.catch_up_rows() for s in decoding]
        lengths = self._choose(decoding, pending, prefill_rows, prefill_keys)
        if not getattr(self.drafter, "free_drafts", False) and any(k and not s.drafted
                                                                  for s, k in zip(decoding, lengths)):
            # a sequence starts drafting only where drafts pay at this load once every running
            # sequence decodes: a step made cheap to draft in by a prefill chunk or by sequences still
            # prefilling would buy the catch-up for a draft or two that the next steps do not repeat
            steady = self._choose(self.running, [0] * len(self.running))
            starts = {s.slot for s, k in zip(self.running, steady) if k}
            lengths = [0 if k and not s.drafted and s.slot not in starts else k for s, k in zip(decoding, lengths)]
        return lengths

    def _choose(self, seqs: list[Generation], pending: list[int], prefill_rows: int = 0,
                prefill_keys: int = 0) -> list[int]:
        """The cost model's draft lengths for `seqs` decoding together (see `costs.choose`)."""
        limits = [min(s.req.draft_len, s.budget - 1) if s.req.speculative else 0 for s in seqs]
        contexts = [s.n for s in seqs]
        widths = [shape.topk if shape else 1 for shape in map(self._shape, seqs)]
        chosen = costs.choose(limits, [s.acceptance.survival(k) for s, k in zip(seqs, limits)],
                              len(seqs), self.cost, contexts, sum(contexts), pending=pending,
                              sunk_rows=prefill_rows, sunk_keys=prefill_keys, widths=widths)
        if self.cost.parallel_drafts and getattr(self.drafter, "estimates_acceptance", False):
            # a whole block costs what one position does, and the drafter's own estimates then cut
            # each draft to what is worth verifying (`_trim`): better informed than the record
            return [limit if k else 0 for k, limit in zip(chosen, limits)]
        return chosen

    def _shape(self, s: Generation) -> TreeShape | None:
        """The tree `s` asks for, its nodes within its slot (None: a chain)."""
        t = s.req.tree
        if t is None or t.topk < 2 or not getattr(self.drafter, "tree_drafts", False):
            return None
        return TreeShape(t.topk, min(t.nodes, self.max_len - s.n))

    def _draft(self, decoding: list[Generation], prefill_rows: int, prefill_keys: int = 0) -> list[Proposal]:
        """Each decoding sequence's draft (empty when it does not speculate this step)."""
        drafts = [Proposal([]) for _ in decoding]
        jobs, owners = [], []
        self.last_draft_ms = 0.0
        for i, (s, k) in enumerate(zip(decoding, self._lengths(decoding, prefill_rows, prefill_keys))):
            copied = self._copied(s, k)
            if copied is not None:  # its features stay pending: the drafter catches up when next asked
                drafts[i] = copied
            elif k > 0:
                feats = torch.cat(s.pending) if s.pending else None
                s.pending, s.pending_rows, s.drafted, s.asked = [], 0, True, k
                jobs.append(DraftJob(s.slot, s.context(), feats, k, None if s.sampler.greedy else s.sampler,
                                     self._shape(s)))
                owners.append(i)
        if not jobs:  # the drafter drafts for nobody: the records drift back to their priors (probe later)
            self.acceptance.update(0, 0)
            if self.cost is not None and not getattr(self.drafter, "free_drafts", False):
                self._relax_draft_cost()
            return self._trim_copies(decoding, drafts, prefill_rows, prefill_keys, 0.0)
        t0 = time.perf_counter()
        made = self.drafter.draft(jobs)
        seconds = time.perf_counter() - t0
        self.last_draft_ms = seconds * 1e3
        self._learn_draft_cost(seconds, max(j.k for j in jobs),
                               sum(j.tree.topk if j.tree else 1 for j in jobs),
                               sum(len(j.feats) for j in jobs if j.feats is not None))
        for i, d in zip(owners, made):
            drafts[i] = Proposal.of(d)
        drafts = self._trim(decoding, drafts, made, owners, prefill_rows, prefill_keys, seconds * 1e3)
        drafts = self._prune(decoding, drafts, prefill_rows, prefill_keys, seconds * 1e3)
        return self._trim_copies(decoding, drafts, prefill_rows, prefill_keys, seconds * 1e3)

    def _copied(self, s: Generation, k: int) -> Proposal | None:
        """`s`'s prompt-lookup draft this step (Request.lookup), None when it has none: no lookup,
        speculation off for the step, a drafter whose drafts are lookups already, no earlier occurrence,
        or no draft asked for (k = 0) where no cost model prices the copy (`_trim_copies`: with one, a
        copy is weighed even where the head's drafts are not worth making)."""
        if s.lookup is None or not self.speculate or getattr(self.drafter, "free_drafts", False):
            return None
        n = min(max(k, s.req.lookup), s.budget - 1) if k > 0 or self.cost is not None else 0
        found = s.lookup.lookup(s.context(), n) if n > 0 else ()
        return Proposal(found.tolist(), copied=True) if len(found) else None

    def _trim_copies(self, decoding, drafts: list[Proposal], prefill_rows: int, prefill_keys: int,
                     drafted_ms: float) -> list[Proposal]:
        """With a cost model, lookups' copies are cut to what is worth verifying as a confidence
        head's drafts are (`_trim`), by each sequence's record of its copies' acceptance: under load
        a copy of 8 is not 8 rows for every sequence."""
        copied = {i for i, d in enumerate(drafts) if d.copied}
        if self.cost is None or not copied:
            return drafts
        survival = [s.copies.survival(len(d)) if i in copied else [] for i, (s, d) in enumerate(zip(decoding, drafts))]
        keep = self._worth(decoding, drafts, survival, prefill_rows, prefill_keys, drafted_ms)
        return [(d.keep(range(k)) if k else Proposal([])) if i in copied else d
                for i, (d, k) in enumerate(zip(drafts, keep))]

    def _trim(self, decoding, drafts, made, owners, prefill_rows: int, prefill_keys: int,
              drafted_ms: float) -> list[Proposal]:
        """Drafters that estimate each position's acceptance (DSpark's confidence head) get their
        drafts cut to what the cost model says is worth verifying (the `drafted_ms` their drafting
        took is part of the step's time: costs.choose)."""
        confident = [(i, d.confidence) for i, d in zip(owners, made) if d.confidence is not None]
        if self.cost is None or not confident:
            return drafts
        survival = [[] for _ in decoding]
        for i, c in confident:
            survival[i] = torch.cumprod(c.float().cpu(), 0).tolist()
        keep = self._worth(decoding, drafts, survival, prefill_rows, prefill_keys, drafted_ms)
        return [d.keep(range(k)) if survival[i] else d for i, (d, k) in enumerate(zip(drafts, keep))]

    def _worth(self, decoding, drafts: list[Proposal], survival: list[list[float]], prefill_rows: int,
               prefill_keys: int, drafted_ms: float) -> list[int]:
        """How many tokens of each made draft with a survival estimate (`survival[i]`, one per token;
        empty: the draft stays as it is, carried by the step) the cost model says are worth verifying,
        the `drafted_ms` the drafting took counted in the step's time (costs.choose)."""
        cut = {i for i, surv in enumerate(survival) if surv}
        limits = [len(d) if i in cut else 0 for i, d in enumerate(drafts)]
        contexts = [s.n for s in decoding]
        return costs.choose(limits, survival, len(decoding), self.cost, contexts, sum(contexts), margin=0.0,
                            drafted=True, drafted_ms=drafted_ms,
                            **_sunk(decoding, drafts, cut, prefill_rows, prefill_keys))

    def _prune(self, decoding, drafts: list[Proposal], prefill_rows: int, prefill_keys: int,
               drafted_ms: float) -> list[Proposal]:
        """Trees (drafts with node probabilities) keep the nodes the cost model says are worth
        verifying, taken in order of estimated survival (each sequence's calibration of its
        drafter's probabilities) while tokens per millisecond, the drafting's `drafted_ms` included,
        keep rising."""
        ranked = [i for i, d in enumerate(drafts) if d.scores is not None and not decoding[i].probing]
        if self.cost is None or not ranked:
            return drafts
        survival, node_depths = [[] for _ in decoding], [[] for _ in decoding]
        for i in ranked:
            survival[i] = decoding[i].calibration.estimate(drafts[i].tree_parents(), drafts[i].scores)
            node_depths[i] = depths(drafts[i].tree_parents())
        contexts = [s.n for s in decoding]
        sunk = _sunk(decoding, drafts, set(ranked), prefill_rows, prefill_keys)
        keep = costs.choose_nodes(survival, node_depths, len(decoding), self.cost, contexts, sum(contexts),
                                  drafted_ms=drafted_ms, **sunk)
        return [d.keep(keep[i]) if i in ranked else d for i, d in enumerate(drafts)]

    def _learn_draft_cost(self, seconds: float, depth: int, rows: int, absorbed: int) -> None:
        """Refit a model drafter's call time (costs.LinearFit) on this call: `depth` levels (a block
        drafter: one pass whatever its depth, `CostModel.passes`) over `rows` rows each (one per
        chain, a tree's top-k per expanded level), after its catch-up on `absorbed` positions
        (n-gram drafts are free: nothing to learn)."""
        if self.cost is None or getattr(self.drafter, "free_drafts", False):
            return
        c = self.cost
        ms = max(seconds * 1e3 - c.absorb_ms() * absorbed, 0.0)
        call, ratio = self.draft_fit.observe(c.draft_call_ms, c.draft_ratio, c.passes(depth) * c.step_ms(rows), ms)
        self.cost = c.with_draft_ratio(ratio, call)

    def _relax_draft_cost(self, rate: float = 0.05) -> None:
        """While nobody drafts, the drafter's estimated cost drifts back to where it started (the
        ratio from above, the fixed part toward none), so a slow spell cannot switch speculation
        off for good: the engine probes again."""
        c = self.cost
        if not (self.draft_prior or self.draft_call_prior):  # nothing to drift back to
            return
        ratio = (1 - rate) * c.draft_ratio + rate * self.draft_prior if c.draft_ratio > self.draft_prior else c.draft_ratio
        call = (1 - rate) * c.draft_call_ms + rate * self.draft_call_prior
        self.cost = c.with_draft_ratio(ratio, call)
        self.draft_fit.moved(call, ratio)

    def _commit(self, plan: Plan, res) -> list[Generation]:
        """Accept, roll back and emit for every sequence of the step; the ones that finished."""
        done = []
        for s, kind, a, b, lrow, draft in plan.entries:
            try:
                if kind == "verify" and (draft.parents is not None or draft.scores is not None):
                    self._accept_tree(s, draft, res.logits[lrow : lrow + len(draft) + 1], res.aux, a)
                elif kind == "verify":
                    self._accept(s, draft, res.logits[lrow : lrow + len(draft) + 1], res.aux, a)
                else:
                    self._prefilled(s, a, b, res, lrow)
            except Exception as exc:  # noqa: BLE001 - a callback (client gone) ends only its sequence
                s.error, s.finish = exc, s.finish or "cancelled"
            if s.finish:
                done.append(s)
        return done

    def _accept(self, s: Generation, draft: Proposal, logits: Tensor, aux: Tensor | None, a: int) -> None:
        target = s.sampler.pick(logits, s.n)  # the target's tokens at positions n..n+k
        kept, tokens = accept(draft.tokens, target)
        s.cached += kept + 1  # roll back: the rejected drafts' positions are dropped
        self._keep_features(s, aux, slice(a, a + kept + 1))
        self._record(s, aux, slice(a, a + kept + 1), logits[: kept + 1])
        if draft.copied:  # the drafter's records (acceptance, draft length) are of its own drafts only
            s.copies.update(len(draft), kept)
            s.stats.count(len(draft), kept, copied=True)
        else:
            self._counted(s, len(draft), len(draft), kept)
        s.emit(tokens)

    def _accept_tree(self, s: Generation, draft: Proposal, logits: Tensor, aux: Tensor | None, a: int) -> None:
        """Row 0 is the root, row i + 1 node i (at position n - 1 + its depth): walk down while a
        child is the target's own token after its parent, then keep the path's rows only. Chains
        with node probabilities come here too (their calibration learns from them)."""
        parents = draft.tree_parents()
        depth = [0] + depths(parents)
        path, tokens = accept_tree(draft.tokens, parents,
                                   lambda node: s.sampler.pick(logits[node + 1 : node + 2], s.n + depth[node + 1])[0])
        rows = [0] + [n + 1 for n in path]  # the segment's rows the sequence keeps, in order
        moved = [(r, k) for k, r in enumerate(rows) if r != k]
        if moved:  # the path's cache rows go right after the prefix (the rest are dropped)
            self.target.compact(s.slot, [s.cached + r for r, _ in moved], [s.cached + k for _, k in moved])
        s.cached += len(rows)
        self._keep_features(s, aux, [a + r for r in rows])
        self._record(s, aux, [a + r for r in rows], logits[rows])
        if draft.scores is not None:
            for c in (s.calibration, self.calibration):
                c.update(depth[1:], draft.scores, len(path))
        self._counted(s, max(depth), len(draft), len(path))
        s.emit(tokens)

    def _counted(self, s: Generation, depth: int, proposed: int, accepted: int) -> None:
        """One verification of `proposed` draft tokens `depth` deep, `accepted` of them kept (a path)."""
        s.length.update(depth, accepted)
        # positions cut after drafting (a confidence head, pruning) count as not accepted: the record
        # says what drafting k yields, which is what the next step's choice to draft weighs
        tried, s.asked = max(depth, s.asked), 0
        s.acceptance.update(tried, accepted)
        if proposed or tried:
            self.acceptance.update(tried, accepted)
        s.stats.count(depth, accepted, proposed, probe=s.probing)
        s.idle, s.probing = 0 if depth else s.idle + 1, False

    def _prefilled(self, s: Generation, a: int, b: int, res, lrow: int | None) -> None:
        s.cached += b - a
        self._keep_features(s, res.aux, slice(a, b))
        if s.req.record:  # every prompt row has logits: see Plan.prefill
            self._record(s, res.aux, slice(a, b), res.logits[lrow : lrow + b - a])
            lrow = lrow + b - a - 1 if s.cached == len(s.req.prompt) else None
        if lrow is not None:  # the prompt is in: its last row gives the first token
            s.stats.prefill_s = time.perf_counter() - s.started
            s.emit(s.sampler.pick(res.logits[lrow : lrow + 1], s.n))

    def _record(self, s: Generation, aux: Tensor | None, rows, logits: Tensor) -> None:
        if s.req.record:
            s.recorded.append((aux[rows] if aux is not None else logits.new_empty(len(logits), 0),
                               logits.argmax(-1)))

    def _keep_features(self, s: Generation, aux: Tensor | None, rows) -> None:
        """The drafter features of the committed `rows` (a slice, or a tree path's rows in order)."""
        if aux is not None and s.req.speculative:
            # a copy (a tree path's list of rows gives one already): a view would keep the whole
            # step's aux alive as long as the sequence lives, so each step's new aux mapped fresh
            # memory (a 16-client EAGLE-3 server ran 5-13% behind one without a head)
            feats = aux[rows] if isinstance(rows, list) else aux[rows].clone()
            s.pending.append(feats)
            s.pending_rows += len(feats)

    # ---- whole generations -----------------------------------------------------------------

    def run(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Generate every request (admitted as slots free up); results in request order."""
        return [g.result() for g in self.generate_all(requests)]

    def generate_all(self, requests: Sequence[Request]) -> list[Generation]:
        """As `run`, returning the finished generations themselves (recorded states included)."""
        for r in requests:
            self.check(r)
        waiting, seqs = list(enumerate(requests)), {}
        while waiting or self.running:
            while waiting and self.has_room:
                i, r = waiting.pop(0)
                seqs[i] = self.add(r)
            for s in self.step():
                if s.error is not None:
                    raise s.error
        return [seqs[i] for i in range(len(requests))]


def _sunk(decoding: list[Generation], drafts: list[Proposal], chosen: set[int], prefill_rows: int,
          prefill_keys: int) -> dict:
    """What the step carries whatever is chosen for the sequences in `chosen`: the prefill chunk
    and every other sequence's draft (rows, and the keys they attend), as costs.choose takes it."""
    fixed = [(len(d), s.n) for i, (s, d) in enumerate(zip(decoding, drafts)) if i not in chosen]
    return {"sunk_rows": prefill_rows + sum(k for k, _ in fixed),
            "sunk_keys": prefill_keys + sum(k * n for k, n in fixed)}
