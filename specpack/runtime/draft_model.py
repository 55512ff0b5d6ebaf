"""Draft-model drafter: a small causal LM (our decoder) with its own KV cache, sharing the target's tokenizer.

Each call feeds the context tokens the draft has not seen, then its own drafts one at a time. Rows of
drafts the target accepted stay in its cache; rejected ones are dropped by lowering the cache length.
Greedy proposals are its argmax; sampled ones come with its distribution q (over the target vocab) for
the speculative-sampling accept rule.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specpack.runtime.speculative import Draft


class DraftModelDrafter(nn.Module):
    kind = "draft_model"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, model: nn.Module, target_vocab: int):
        super().__init__()
        self.model = model
        self.target_vocab = target_vocab
        self.vocab = min(model.spec.vocab_size, target_vocab)  # rows past the tokenizer are padding
        self.seen: Tensor | None = None  # tokens whose rows are in the draft's cache

    @torch.inference_mode()
    def reset(self, max_len: int) -> None:
        self.model.setup_cache(max_len)
        self.seen = None

    def _valid_rows(self, context: Tensor) -> int:
        """Cache rows still valid for `context`: the common prefix of what it saw and the context."""
        if self.seen is None:
            return 0
        n = min(self.seen.shape[0], context.shape[0] - 1)  # always feed at least the last token
        differ = (self.seen[:n] != context[:n]).nonzero()
        return int(differ[0]) if len(differ) else n

    def _choose(self, logits: Tensor, sampler) -> tuple[Tensor, Tensor | None]:
        logits = logits[:, : self.vocab]  # [1, V]
        if sampler is None:
            return logits.argmax(-1), None
        q = sampler.probs(logits)
        q_target = q.new_zeros(1, self.target_vocab)
        q_target[:, : self.vocab] = q
        return sampler.sample(q), q_target

    @torch.inference_mode()
    def propose(self, context: Tensor, feats, draft_len: int, sampler=None) -> Draft:
        """context: [n] all tokens so far. Returns up to `draft_len` target ids (and q when sampling)."""
        if draft_len < 1:
            return Draft(context[:0], None)
        keep = self._valid_rows(context)
        self.model.cache.length = keep
        logits = self.model(context[keep:], last_only=True).logits
        tokens, probs = [], []
        for i in range(draft_len):
            if i:
                logits = self.model(tokens[-1], last_only=True).logits
            tok, q = self._choose(logits, sampler)
            tokens.append(tok)
            probs.append(q)
        drafts = torch.cat(tokens)
        self.seen = torch.cat([context, drafts[:-1]])  # the last draft was never fed
        return Draft(drafts, torch.cat(probs) if sampler is not None else None)


def load_draft_model(params: dict | None, drafter_dir, target) -> DraftModelDrafter:
    """The draft model in `drafter_dir` (a Hugging Face model dir) on the target's device and dtype."""
    from specpack.runtime.weights import load_target

    model = load_target(drafter_dir, target.device, target.dtype)
    return DraftModelDrafter(model, target.spec.vocab_size)
