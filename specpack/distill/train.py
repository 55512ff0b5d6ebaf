"""The training loop: windows of cached features -> a head family's objective (EAGLE-3's here: TTT
forward -> soft cross-entropy against the target's distribution on the draft vocab; DSpark's in
dspark_train.py) -> AdamW. Resumable and deterministic: batch order and learning rate are functions
of (seed, step); checkpoints hold weights, optimizer and RNG state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specpack.distill.data import Features
from specpack.distill.head import TrainableHead
from specpack.distill.vocab import DraftVocab
from specpack.errors import InputError

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 4  # windows per step
    seq_len: int = 256  # bases per window
    lr: float = 2e-3  # peak; linear warm-up, cosine decay to 10%
    warmup: int = 50
    weight_decay: float = 0.0
    ttt_steps: int = 3  # unrolled draft steps trained (EAGLE-3's training-time test)
    step_decay: float = 0.8  # loss weight of TTT step k: decay**k
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    val_fraction: float = 0.05  # sequences held out for the final agreement figures
    train_lm_head: bool = True  # False: keep the target's rows (fewer weights to fit on little data)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


@dataclass
class Tally:
    """Greedy top-1 agreement with the target at the bases the runtime drafts from: per TTT step
    (teacher-forced, so step k assumes the earlier drafts were right), and the run of leading
    correct steps, whose mean + 1 estimates the acceptance length at draft length = TTT steps."""

    hits: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    run: float = 0.0
    bases: float = 0.0
    confidence: list[float] = field(default_factory=list)  # summed predicted acceptance per step (DSpark)

    def add(self, other: "Tally", keep: float = 1.0) -> None:
        """self = keep * self + other (keep < 1: a running average that forgets old batches)."""
        if not self.hits:
            self.hits, self.counts = [0.0] * len(other.hits), [0.0] * len(other.hits)
        self.hits = [keep * a + b for a, b in zip(self.hits, other.hits)]
        self.counts = [keep * a + b for a, b in zip(self.counts, other.counts)]
        if other.confidence:
            mine = self.confidence or [0.0] * len(other.confidence)
            self.confidence = [keep * a + b for a, b in zip(mine, other.confidence)]
        self.run, self.bases = keep * self.run + other.run, keep * self.bases + other.bases

    @property
    def agreement(self) -> list[float]:
        return [h / c if c else 0.0 for h, c in zip(self.hits, self.counts)]

    @property
    def acceptance_length(self) -> float:
        return 1 + self.run / self.bases if self.bases else 1.0

    def to_dict(self) -> dict:
        out = {"agreement": [round(a, 4) for a in self.agreement], "drafted_positions": int(self.counts[0]),
               "estimated_acceptance_length": round(self.acceptance_length, 3), "draft_len": len(self.hits)}
        if self.confidence:  # calibration: the mean predicted acceptance beside the observed agreement
            out["mean_confidence"] = [round(c / n, 4) if n else 0.0 for c, n in zip(self.confidence, self.counts)]
        return out


def tally(logits: list[Tensor], b: dict, draft_ids: Tensor) -> Tally:
    K = len(logits)
    hit = torch.stack([draft_ids[lg.argmax(-1)] == shift(b["pred"], k) for k, lg in enumerate(logits)])  # [K, B, T]
    masks = [shift(b["valid"], k) & b["drafted"] for k in range(K)]
    run = hit.long().cumprod(0).sum(0)  # leading correct steps at each base [B, T]
    return Tally(hits=[float((hit[k] & m).sum()) for k, m in enumerate(masks)],
                 counts=[float(m.sum()) for m in masks], run=float(run[masks[-1]].sum()),
                 bases=float(masks[-1].sum()))


# ---- data windows ----

@dataclass(frozen=True)
class Window:
    seq: int
    start: int  # first base position
    length: int  # bases in the window (each has a next token)


def windows(feats: Features, seqs: list[int], seq_len: int) -> list[Window]:
    out = []
    for i in seqs:
        s = feats.sequence(i)
        bases = s.stop - s.start - 1  # the last token has no next token
        out += [Window(i, a, min(seq_len, bases - a)) for a in range(0, bases, seq_len)]
    return out


def split(feats: Features, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, validation) sequence indices, holding out whole groups (every continuation of a seed
    prompt: siblings share their prompt and often their first tokens); at least one group trains."""
    groups = feats.groups.unique()
    order = groups[torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed))]
    n_val = min(int(len(groups) * fraction), len(groups) - 1)
    held = torch.isin(feats.groups, order[:n_val])
    return torch.nonzero(~held).flatten().tolist(), torch.nonzero(held).flatten().tolist()


class Batches:
    """Batch `step` is a pure function of (seed, step): epoch e visits the windows in the order of
    randperm(seed, e), so a resumed run sees the same batches as an uninterrupted one."""

    def __init__(self, feats: Features, wins: list[Window], teacher_w: Tensor, cfg: TrainConfig):
        self.feats, self.wins, self.cfg = feats, wins, cfg
        self.teacher_w = teacher_w  # [Vd, H] the target's lm_head rows of the draft vocab
        self._perm: tuple[int, list[int]] | None = None

    def indices(self, step: int) -> list[int]:
        n, B = len(self.wins), self.cfg.batch_size
        out = []
        for g in range(step * B, step * B + B):
            epoch, i = divmod(g, n)
            if self._perm is None or self._perm[0] != epoch:
                gen = torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch)
                self._perm = (epoch, torch.randperm(n, generator=gen).tolist())
            out.append(self._perm[1][i])
        return out

    def batch(self, wins: list[Window], step: int | None = None) -> dict:
        """Tensors [B, T(, ·)] for a list of windows, zero-padded; `valid` marks real bases, `drafted`
        the bases the runtime drafts from (the last prompt position on: the agreement figures)."""
        f, T = self.feats, self.cfg.seq_len
        B = len(wins)
        aux = torch.zeros(B, T, f.aux.shape[1])
        final = torch.zeros(B, T, f.final.shape[1])
        tokens = torch.zeros(B, T, dtype=torch.long)
        pred = torch.zeros(B, T, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        drafted = torch.zeros(B, T, dtype=torch.bool)
        positions = torch.arange(T).repeat(B, 1)
        for b, w in enumerate(wins):
            p = f.sequence(w.seq).start + w.start  # absolute index of the first base
            n = w.length
            aux[b, :n] = f.aux[p : p + n].float()
            tokens[b, :n] = f.tokens[p + 1 : p + n + 1]  # x_{p+1}
            pred[b, :n] = f.pred[p + 1 : p + n + 1]  # the target's x_{p+2}
            final[b, :n] = f.final[p + 1 : p + n + 1].float()
            valid[b, :n] = True
            drafted[b, max(0, int(f.starts[w.seq]) - 1 - w.start) : n] = True
            positions[b] += w.start
        with torch.no_grad():
            teacher = F.softmax(final @ self.teacher_w.T, dim=-1)  # [B, T, Vd] target's p on the draft vocab
        return {"aux": aux, "tokens": tokens, "positions": positions, "pred": pred, "valid": valid,
                "drafted": drafted, "teacher": teacher}


def shift(x: Tensor, k: int) -> Tensor:
    """x[:, i + k] at i (zero past the end): the label / mask of TTT step k at base i."""
    return F.pad(x[:, k:], (0, 0) * (x.dim() - 2) + (0, k)) if k else x


def step_losses(head: TrainableHead, b: dict, cfg: TrainConfig, draft_ids: Tensor) -> tuple[Tensor, Tally]:
    """Weighted soft cross-entropy over the TTT steps (at every position) and the batch's tally."""
    logits = head(b["aux"], b["tokens"], b["positions"], cfg.ttt_steps)
    total = 0.0
    for k, lg in enumerate(logits):
        mask = shift(b["valid"], k)
        ce = -(shift(b["teacher"], k) * F.log_softmax(lg, -1)).sum(-1)
        total = total + cfg.step_decay ** k * (ce * mask).sum() / mask.sum().clamp(min=1)
    return total, tally([lg.detach() for lg in logits], b, draft_ids)


class Objective:
    """What a head family trains: `batches(feats, windows, teacher_w, cfg)` (its Batches), `losses(head,
    batch, cfg, draft_ids) -> (loss, Tally)` and `tally(head, batch, cfg, draft_ids)`; `extra()` joins the
    fingerprint, `record(cfg)` is training.json's "training". This one is EAGLE-3's."""

    def batches(self, feats: Features, wins: list[Window], teacher_w: Tensor, cfg: TrainConfig) -> Batches:
        return Batches(feats, wins, teacher_w, cfg)

    def losses(self, head, b: dict, cfg: TrainConfig, draft_ids: Tensor) -> tuple[Tensor, Tally]:
        return step_losses(head, b, cfg, draft_ids)

    def tally(self, head, b: dict, cfg: TrainConfig, draft_ids: Tensor) -> Tally:
        return tally(head(b["aux"], b["tokens"], b["positions"], cfg.ttt_steps), b, draft_ids)

    def extra(self) -> dict:
        return {}

    def record(self, cfg: TrainConfig) -> dict:
        return asdict(cfg)


EAGLE3 = Objective()


# ---- the loop ----

def fingerprint(cfg: TrainConfig, extra: dict) -> str:
    """What a checkpoint must share with the run that resumes it (everything but the step count)."""
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("steps", "checkpoint_every")}
    return hashlib.sha256(json.dumps({**keep, **extra}, sort_keys=True).encode()).hexdigest()[:16]


def train(head: torch.nn.Module, feats: Features, vocab: DraftVocab, teacher_w: Tensor, cfg: TrainConfig,
          work: Path, resume: bool, progress: bool, extra: dict, stop_after: int | None = None,
          objective: Objective = EAGLE3) -> dict:
    """Train `head` in place up to `cfg.steps` (or `stop_after`) with `objective` and return the
    training record. teacher_w: [Vd, H] the target's lm_head rows of the draft vocab (its soft labels)."""
    train_seqs, val_seqs = split(feats, cfg.val_fraction, cfg.seed)
    data = objective.batches(feats, windows(feats, train_seqs, cfg.seq_len), teacher_w, cfg)
    head.lm_head.weight.requires_grad_(cfg.train_lm_head)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    state = _State(fingerprint(cfg, extra))
    ckpt = work / CHECKPOINT
    if resume and ckpt.is_file():
        state.load(ckpt, head, opt)
        log.info("resumed from %s at step %d", ckpt, state.step)
    end = min(cfg.steps, cfg.steps if stop_after is None else stop_after)
    _loop(head, opt, params, data, cfg, state, end, ckpt, progress, vocab.ids, objective)
    head.eval()
    record = {"steps_done": state.step, "train_seconds": round(state.seconds, 1),
              "train_sequences": len(train_seqs), "train_windows": len(data.wins),
              "final_running_loss": round(state.loss, 4), "running": state.running.to_dict()}
    if state.step == cfg.steps and val_seqs:
        record["validation"] = {"sequences": len(val_seqs),
                                **evaluate(head, feats, val_seqs, vocab, teacher_w, cfg, objective).to_dict()}
    return record


def _loop(head, opt, params, data: Batches, cfg: TrainConfig, state: "_State", end: int, ckpt: Path,
          progress: bool, draft_ids: Tensor, objective: Objective) -> None:
    from tqdm import tqdm

    bar = tqdm(total=cfg.steps, initial=state.step, desc="distill", unit="step", disable=not progress,
               dynamic_ncols=True, leave=False)
    head.train()
    t0 = time.perf_counter() - state.seconds
    for step in range(state.step, end):
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        batch = data.batch([data.wins[i] for i in data.indices(step)], step)
        loss, batch_tally = objective.losses(head, batch, cfg, draft_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        state.update(step + 1, loss.item(), batch_tally, time.perf_counter() - t0)
        bar.update(1)
        bar.set_postfix(loss=f"{state.loss:.3f}", acc=",".join(f"{a:.2f}" for a in state.running.agreement[:2]),
                        AL=f"{state.running.acceptance_length:.2f}")
        if state.step % cfg.checkpoint_every == 0 or state.step == end:
            state.save(ckpt, head, opt)
    bar.close()


@torch.no_grad()
def evaluate(head: torch.nn.Module, feats: Features, seqs: list[int], vocab: DraftVocab, teacher_w: Tensor,
             cfg: TrainConfig, objective: Objective = EAGLE3) -> Tally:
    """The tally of `head` over the sequences `seqs` (held out from training)."""
    data = objective.batches(feats, windows(feats, seqs, cfg.seq_len), teacher_w, cfg)
    total = Tally()
    for i in range(0, len(data.wins), cfg.batch_size):
        total.add(objective.tally(head, data.batch(data.wins[i : i + cfg.batch_size]), cfg, vocab.ids))
    return total


@dataclass
class _State:
    """What a checkpoint carries besides weights and optimizer: step, time, running figures."""

    fingerprint: str
    step: int = 0
    seconds: float = 0.0
    loss: float = 0.0
    running: Tally = field(default_factory=Tally)
    forget: float = 0.95  # running figures: about the last 20 steps

    def update(self, step: int, loss: float, batch: Tally, seconds: float) -> None:
        self.loss = loss if self.step == 0 else self.forget * self.loss + (1 - self.forget) * loss
        self.running.add(batch, keep=self.forget)
        self.step, self.seconds = step, seconds

    def save(self, path: Path, head, opt) -> None:
        state = {"step": self.step, "seconds": self.seconds, "fingerprint": self.fingerprint, "loss": self.loss,
                 "running": asdict(self.running), "model": head.state_dict(), "optimizer": opt.state_dict(),
                 "rng": torch.get_rng_state()}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)

    def load(self, path: Path, head, opt) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("fingerprint") != self.fingerprint:
            raise InputError(f"the checkpoint {path} was made with other settings or data",
                             hint="use the same options to resume, or --no-resume to start over")
        head.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.step, self.seconds, self.loss = int(state["step"]), float(state["seconds"]), float(state["loss"])
        self.running = Tally(**state["running"])
