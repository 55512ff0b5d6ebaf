"""Draft-model drafter: a small causal LM (our decoder) with its own KV cache, sharing the target's tokenizer.

Each call feeds every sequence's context tokens the draft has not seen (one forward for the batch),
then their drafts one step at a time. Rows of drafts the target accepted stay in its cache; rejected
ones are overwritten. Greedy proposals are its argmax; sampled ones race its own distribution with
the target's noise (sampling.Sampler).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specpack.runtime.kernels.argmax import argmax_rows
from specpack.runtime.models.rows import Rows, Segment
from specpack.runtime.drafters.base import Draft, DraftJob
from specpack.runtime.drafters.tree import Branches, argmax_only


class DraftModelDrafter(nn.Module):
    kind = "draft_model"
    capture_layers: tuple[int, ...] = ()
    tree_drafts = True  # each step's top-k alternatives branch off the drafted chain (DraftJob.tree)

    def __init__(self, model: nn.Module, target_vocab: int):
        super().__init__()
        self.model = model
        self.target_vocab = target_vocab
        self.vocab = min(model.spec.vocab_size, target_vocab)  # rows past the tokenizer are padding
        self.seen: list[Tensor | None] = []  # per slot: the tokens whose rows are in the draft's cache

    @torch.inference_mode()
    def reserve(self, slots: int, max_len: int) -> None:
        self.model.setup_cache(max_len, slots)
        self.seen = [None] * slots

    def start(self, slot: int) -> None:
        self.seen[slot] = None

    def screen_head(self) -> bool:
        """Let greedy chain steps skip most of the draft model's head (kernels/screen.py) where it
        runs on the packed kernel and has no rows past the target's vocabulary (an argmax over a
        slice of a screened row is not the slice's argmax); True when they now do."""
        return self.vocab == self.model.spec.vocab_size and self.model.screen_head()

    def _valid_rows(self, slot: int, context: Tensor) -> int:
        """Cache rows still valid for `context`: the common prefix of what it saw and the context."""
        seen = self.seen[slot]
        if seen is None:
            return 0
        n = min(seen.shape[0], context.shape[0] - 1)  # always feed at least the last token
        differ = (seen[:n] != context[:n]).nonzero()
        return int(differ[0]) if len(differ) else n

    def _choose(self, logits: Tensor, jobs: list[DraftJob], step: int) -> list[int]:
        logits = logits[:, : self.vocab]  # [J, V]
        greedy = argmax_rows(logits)
        return [greedy[i] if j.sampler is None
                else j.sampler.race(j.sampler.probs(logits[i : i + 1])[0], len(j.context) + step)
                for i, j in enumerate(jobs)]

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[Draft]:
        """Feed each context's rows the draft has not seen (one forward for all jobs), then one
        draft token per job per forward."""
        dev = self.model.device
        keep = [self._valid_rows(j.slot, j.context) for j in jobs]
        rows = Rows.of([Segment(j.slot, k, len(j.context) - k) for j, k in zip(jobs, keep)], dev)
        tokens = torch.cat([j.context[k:] for j, k in zip(jobs, keep)])
        logits = self.model.forward_rows(tokens, rows, logits_rows=rows.last_rows(),
                                         greedy_rows=argmax_only(jobs)).logits
        branches = Branches(jobs)  # jobs that ask for a tree get each step's alternatives as leaves
        drafts = [[t] for t in self._choose(logits, jobs, 0)]
        for i, d in enumerate(drafts):
            branches.add(i, 0, logits[i, : self.vocab], d[0])
        for step in range(1, max(j.k for j in jobs)):
            live = [i for i, j in enumerate(jobs) if j.k > step]
            rows = Rows.of([Segment(jobs[i].slot, len(jobs[i].context) + step - 1, 1) for i in live], dev)
            last = torch.tensor([drafts[i][-1] for i in live], device=dev)
            logits = self.model.forward_rows(last, rows, greedy_rows=argmax_only([jobs[i] for i in live])).logits
            for n, (i, t) in enumerate(zip(live, self._choose(logits, [jobs[i] for i in live], step))):
                drafts[i].append(t)
                branches.add(i, step, logits[n, : self.vocab], t)
        for j, d in zip(jobs, drafts):  # the last draft was never fed
            self.seen[j.slot] = torch.cat([j.context, torch.tensor(d[:-1], dtype=torch.long, device=dev)])
        return branches.drafts(drafts)

    def reset(self, max_len: int) -> None:
        """One sequence (slot 0), for `propose`."""
        self.reserve(1, max_len)

    def propose(self, context: Tensor, feats, draft_len: int, sampler=None) -> Draft:
        """One sequence's draft (slot 0): context [n] every token so far."""
        return self.draft([DraftJob(0, context, None, draft_len, sampler)])[0]


def load_draft_model(params: dict | None, drafter_dir, target, weights: str | None = None) -> DraftModelDrafter:
    """The draft model in `drafter_dir` (a Hugging Face model dir) on the target's device and dtype; with
    `weights`, its linear layers packed in that format as they are read (models.weights.load_target)."""
    from specpack.runtime.models.weights import load_target

    model = load_target(drafter_dir, target.device, target.dtype, weights)
    return DraftModelDrafter(model, target.spec.vocab_size)
