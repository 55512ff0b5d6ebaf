"""DSpark's objective for the distill training loop (train.py): anchor blocks from the cached
windows, DeepSpec's losses, and the tally.

From deepseek-ai/DeepSpec @ afdfa7c9382a3341a3e6f17756dd816da79f132c:
- deepspec/modeling/dspark/common.py: sample_anchor_positions (anchors drawn at random without
  replacement among the positions whose first target is supervised), build_eval_mask (slot q
  counts while its target lies inside the sequence);
- deepspec/modeling/dspark/loss.py: loss weights exp(-q / loss_decay_gamma) on the valid slots;
  ce_alpha · CE(labels) + l1_alpha · ||softmax(draft) - softmax(target)||_1 + confidence_alpha ·
  BCE-with-logits(confidence, accept_rate = 1 - L1 / 2, detached); tau = 1 + sum of cumprods.
  `soft_ce_alpha` adds what the EAGLE-3 head trains on (not in DeepSpec): the cross-entropy against
  the target's whole distribution, a denser signal for the argmax that greedy decoding accepts.
Here the labels are the target's argmax at every position (DeepSpec trains on the target's own
text, so its labels are the same thing), the target's distribution is restricted to the draft
vocabulary (the EAGLE-3 trainer's soft labels), and the confidence target is, by default, what
greedy decoding accepts: the draft's argmax equals the target's (option `confidence_target`).
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor

from specpack.distill.data import Features
from specpack.distill.dspark import DSparkConfig, DSparkOptions
from specpack.distill.train import Batches, Objective, Tally, TrainConfig, Window
from specpack.distill.vocab import DraftVocab


class DSparkBatches(Batches):
    """Windows of cached features, each with anchor blocks: the anchors are the positions the runtime
    drafts from (the target's own text, with at least one context row before them)."""

    def __init__(self, feats: Features, wins: list[Window], teacher_w: Tensor, cfg: TrainConfig, head: DSparkConfig,
                 options: DSparkOptions, t2d: Tensor):
        wins = [w for w in wins if int(feats.starts[w.seq]) - w.start <= w.length]  # not wholly inside a prompt
        super().__init__(feats, wins, teacher_w, cfg)
        self.head, self.options, self.t2d = head, options, t2d

    def batch(self, wins: list[Window], step: int | None = None) -> dict:
        """Tensors [W, ...] for `wins`: `options.anchors` anchors per window drawn for `step` (a pure
        function of seed and step), or every anchor when `step` is None (validation)."""
        parts = [self._window(w, b, step) for b, w in enumerate(wins)]
        A = max([1] + [len(p["anchors"]) for p in parts])
        out = {}
        for key, pad in (("aux", 0), ("ctx_pos", 0), ("anchors", 0), ("anchor_pos", 0), ("prev", 0), ("label", -1),
                         ("valid", False), ("teacher", 0.0)):
            out[key] = torch.stack([_pad(p[key], A if key not in ("aux", "ctx_pos") else self.cfg.seq_len, pad)
                                    for p in parts])
        return out

    def _window(self, w: Window, b: int, step: int | None) -> dict:
        f, B, T = self.feats, self.head.block_size, self.cfg.seq_len
        s = f.sequence(w.seq)
        p0, last = s.start + w.start, s.stop - 1  # flat indices: the window's first position, the sequence's last
        anchors = torch.arange(max(int(f.starts[w.seq]) - w.start, 1), w.length + 1)  # window indices
        if step is not None and len(anchors) > self.options.anchors:
            g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step) * 1024 + b)
            anchors = anchors[torch.randperm(len(anchors), generator=g)[: self.options.anchors]].sort().values
        at = p0 + anchors[:, None] + torch.arange(B)  # [a, B] slot q: its Markov input and its label's position
        valid = at <= last
        at = at.clamp(max=last)
        hi = int(at.max()) + 1 if len(anchors) else p0
        teacher = F.softmax(f.final[p0:hi].float() @ self.teacher_w.T, -1)  # the target's p on the draft vocab
        return {"aux": f.aux[p0 : p0 + w.length].float(), "ctx_pos": w.start + torch.arange(T),
                "anchors": anchors, "anchor_pos": w.start + anchors, "prev": f.tokens[at],
                "label": self.t2d[f.pred[at]], "valid": valid, "teacher": teacher[at - p0]}


def _pad(x: Tensor, n: int, value) -> Tensor:
    """x padded along its first dimension to n rows of `value`."""
    out = torch.full((n, *x.shape[1:]), value, dtype=x.dtype)
    out[: len(x)] = x
    return out


class DSparkObjective(Objective):
    def __init__(self, head: DSparkConfig, options: DSparkOptions, vocab: DraftVocab):
        self.head, self.options = head, options
        self.t2d = torch.full((vocab.target_size,), -1, dtype=torch.long)
        self.t2d[vocab.ids] = torch.arange(vocab.size)  # target id -> draft id (-1: outside the draft vocab)

    def batches(self, feats: Features, wins: list[Window], teacher_w: Tensor, cfg: TrainConfig) -> DSparkBatches:
        return DSparkBatches(feats, wins, teacher_w, cfg, self.head, self.options, self.t2d)

    def losses(self, head, b: dict, cfg: TrainConfig, draft_ids: Tensor) -> tuple[Tensor, Tally]:
        logits, confidence = head(b["aux"], b["ctx_pos"], b["anchors"], b["anchor_pos"], b["prev"])
        o, B = self.options, logits.shape[-2]
        w = b["valid"] * torch.exp(-torch.arange(B) / o.loss_decay_gamma)  # [W, A, B]
        w_ce = w * (b["label"] >= 0)
        log_q = logits.log_softmax(-1)
        ce = -log_q.gather(-1, b["label"].clamp(min=0)[..., None]).squeeze(-1)
        l1 = (log_q.exp() - b["teacher"]).abs().sum(-1)
        soft = -(b["teacher"] * log_q).sum(-1)
        hit = logits.detach().argmax(-1) == b["label"]
        target = hit.float() if o.confidence_target == "greedy" else (1 - l1.detach() / 2).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(confidence, target, reduction="none")
        den = w.sum().clamp(min=1e-6)
        loss = (o.ce_alpha * (ce * w_ce).sum() / w_ce.sum().clamp(min=1e-6)
                + (o.l1_alpha * l1 + o.soft_ce_alpha * soft + o.confidence_alpha * bce).mul(w).sum() / den)
        return loss, _tally(hit, confidence.detach(), b["valid"])

    def tally(self, head, b: dict, cfg: TrainConfig, draft_ids: Tensor) -> Tally:
        logits, confidence = head(b["aux"], b["ctx_pos"], b["anchors"], b["anchor_pos"], b["prev"])
        return _tally(logits.argmax(-1) == b["label"], confidence, b["valid"])

    def extra(self) -> dict:
        return {"objective": {"family": "dspark", **self.options.objective()}}

    def record(self, cfg: TrainConfig) -> dict:
        keep = {k: v for k, v in asdict(cfg).items() if k not in ("ttt_steps", "step_decay")}  # EAGLE-3's only
        return {**keep, **self.options.objective()}


def _tally(hit: Tensor, confidence: Tensor, valid: Tensor) -> Tally:
    """Teacher-forced agreement per slot, the run of leading correct slots of the blocks whose every
    slot lies in the text (mean + 1 = the acceptance length at draft length B), and the summed
    predicted acceptance per slot (calibration)."""
    hit = hit & valid
    full = valid.all(-1)
    run = hit.long().cumprod(-1).sum(-1)
    c = torch.sigmoid(confidence) * valid
    B = hit.shape[-1]
    per_slot = [(float(hit[..., q].sum()), float(valid[..., q].sum()), float(c[..., q].sum())) for q in range(B)]
    hits, counts, confidences = (list(x) for x in zip(*per_slot))
    return Tally(hits=hits, counts=counts, run=float(run[full].sum()), bases=float(full.sum()), confidence=confidences)
