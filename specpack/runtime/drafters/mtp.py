"""MTP drafter: the target's own multi-token-prediction layers (converters/mtp.py gives their canonical form).

Layer k at row i reads the hidden state h^{k-1}_i (h^{-1} = the target's) and the embedding of token
x_{i+k+1}, and predicts x_{i+k+2} through the target's lm_head (DeepSeek-V3 §2.2). Each layer keeps its
own KV cache over its rows, so draft step k runs layer k over the rows it has not seen: the committed
ones (their tokens are known) plus k rows whose tokens are the drafts d_1..d_k. Draft rows are dropped
before `propose` returns. With `allow_layer_reuse`, steps past the last layer reuse layer k mod n,
each appending one row fed by the previous step's output (how vLLM and SGLang chain a single MTP layer).

The target hidden state is the state leaving the target's last decoder layer, which the engine
captures with the verification forward (capture id = the number of target layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specpack.errors import InputError
from specpack.runtime.kernels.argmax import argmax_rows
from specpack.runtime.models.dense import Block, KVCache, RMSNorm
from specpack.runtime.models.rows import Rows, Segment
from specpack.runtime.drafters.base import Draft, DraftJob
from specpack.runtime.drafters.tree import Branches, argmax_only

FUSION = ("embed_norm.weight", "hidden_norm.weight", "proj.weight", "final_norm.weight")


@dataclass(frozen=True)
class MtpSpec:
    num_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    norm_offset: float  # 1.0: zero-centred norms (Qwen3-Next), the weight + 1 scales
    concat_order: str  # "embedding_first" | "hidden_first"
    target_hidden_state: str  # "final_norm_output" | "last_layer_output"
    chain_hidden_state: str  # "pre_norm" | "post_norm"
    allow_layer_reuse: bool

    def check_draft_len(self, draft_len: int) -> None:
        if draft_len > self.num_layers and not self.allow_layer_reuse:
            raise InputError(f"{draft_len} draft tokens asked for, but the MTP drafter has {self.num_layers} "
                             "layer(s) and layer reuse is not allowed",
                             hint=f"use a draft length <= {self.num_layers}, or allow reuse (step k then uses "
                                  "layer k mod n): build with --mtp-allow-reuse, or load with "
                                  "params {'allow_layer_reuse': True}")


_CHOICES = {"concat_order": ("embedding_first", "hidden_first"),
            "target_hidden_state": ("final_norm_output", "last_layer_output"),
            "chain_hidden_state": ("pre_norm", "post_norm"), "weights": ("target", "drafter")}


def mtp_spec_from_config(cfg: dict) -> MtpSpec:
    problems = [f"missing field {k}" for k in ("num_layers", "hidden_size", "vocab_size", *_CHOICES) if k not in cfg]
    problems += [f"{k} {cfg[k]!r} (expected one of {', '.join(v)})" for k, v in _CHOICES.items()
                 if k in cfg and cfg[k] not in v]
    if cfg.get("kind", "mtp") != "mtp":
        problems.append(f"kind is {cfg.get('kind')!r}, expected 'mtp'")
    if problems:
        raise InputError("the MTP drafter config is not usable", problems=problems,
                         hint="re-run the build on the target")
    return MtpSpec(num_layers=int(cfg["num_layers"]), hidden_size=int(cfg["hidden_size"]),
                   vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   norm_offset=float(cfg.get("norm_offset", 0.0)), concat_order=cfg["concat_order"],
                   target_hidden_state=cfg["target_hidden_state"], chain_hidden_state=cfg["chain_hidden_state"],
                   allow_layer_reuse=bool(cfg.get("allow_layer_reuse", False)))


class _DenseKit:
    """Blocks, caches and weight names of our Llama/Qwen2-style `Transformer`."""

    def __init__(self, target):
        self.target, self.spec = target, target.spec

    def block(self, k: int) -> nn.Module:
        return Block(self.spec)

    def shapes(self, prefix: str, k: int) -> dict:
        from specpack.runtime.models.weights import target_tensor_shapes

        return {prefix + n[len("model.layers.0."):]: shape for n, shape in target_tensor_shapes(self.spec).items()
                if n.startswith("model.layers.0.")}

    def state(self, t: dict, prefix: str) -> dict:
        from specpack.runtime.models.weights import fuse_layer

        return fuse_layer(t, prefix, prefix)

    def cache(self, max_len: int, slots: int = 1) -> KVCache:
        # the model's dtype and device from its final norm: a GGUF-block embedding's `weight` is a whole fp32 copy
        s, w = self.spec, self.target.norm.weight
        return KVCache(1, s.num_kv_heads, s.head_dim, max_len, w.dtype, w.device, slots)


class _DeepseekKit(_DenseKit):
    """The same for `DeepseekTransformer` (MLA + MoE blocks, latent caches)."""

    def block(self, k: int) -> nn.Module:
        from specpack.runtime.models.deepseek import DeepseekBlock

        return DeepseekBlock(self.spec, self.spec.is_moe(self.spec.num_layers + k))

    def shapes(self, prefix: str, k: int) -> dict:
        from specpack.families.deepseek import layer_tensor_shapes

        return layer_tensor_shapes(self.spec, prefix, self.spec.is_moe(self.spec.num_layers + k))

    def state(self, t: dict, prefix: str) -> dict:
        from specpack.runtime.models.deepseek import layer_state

        return layer_state(t, prefix, prefix)

    def cache(self, max_len: int, slots: int = 1):
        return self.target.new_cache(1, max_len, slots)


def _kit(target) -> _DenseKit:
    from specpack.runtime.models.deepseek import DeepseekTransformer

    return _DeepseekKit(target) if isinstance(target, DeepseekTransformer) else _DenseKit(target)


class MtpLayer(nn.Module):
    """proj(cat(norm(embedding), norm(h))) (order per config) → a target-style decoder block → final norm."""

    def __init__(self, s: MtpSpec, block: nn.Module):
        super().__init__()
        H = s.hidden_size
        self.embedding_first = s.concat_order == "embedding_first"
        self.chain_pre_norm = s.chain_hidden_state == "pre_norm"
        self.embed_norm, self.hidden_norm = RMSNorm(H, s.rms_norm_eps), RMSNorm(H, s.rms_norm_eps)
        self.proj = nn.Linear(2 * H, H, bias=False)
        self.block = block
        self.final_norm = RMSNorm(H, s.rms_norm_eps)

    def forward(self, emb: Tensor, h: Tensor, cos: Tensor, sin: Tensor, cache, rows: Rows) -> tuple[Tensor, Tensor]:
        # emb, h: [R, H] -> (hidden handed to the next step [R, H], normed output for the lm_head [R, H])
        e, hn = self.embed_norm(emb), self.hidden_norm(h)
        x = self.proj(torch.cat([e, hn] if self.embedding_first else [hn, e], dim=-1))
        y = self.block(x, cos, sin, cache.k[0], None if cache.v is None else cache.v[0], rows)
        normed = self.final_norm(y)
        return (y if self.chain_pre_norm else normed), normed


class MtpDrafter(nn.Module):
    """Drafts for many sequences at once; greedy, or sampled from its distribution over the target vocab.

    Per slot it keeps, for every layer, the rows computed with committed tokens (`done`) and the
    hidden states each layer hands the next (`outs`, [slots, layers + 1, max_len, H]; `outs[:, 0]`
    is the target's state, from the features the engine captures: the last layer's output)."""

    kind = "mtp"
    tree_drafts = True  # each step's top-k alternatives branch off the drafted chain (DraftJob.tree)
    # vLLM's DeepSeek MTP zeroes the embedding its row at position 0 reads ("not needed by MTP",
    # deepseek_mtp.py :123); the training forward does not, and neither does specpack. On: drafts as
    # vLLM does, so the engine suite can compare acceptance with vLLM's on equal terms.
    zero_position_zero = False

    def __init__(self, spec: MtpSpec, target, kit: _DenseKit):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(MtpLayer(spec, kit.block(k)) for k in range(spec.num_layers))
        object.__setattr__(self, "target", target)  # shared, not a submodule: no second copy in state_dict
        object.__setattr__(self, "kit", kit)
        self.capture_layers = (target.spec.num_layers,)  # the state leaving the target's last layer
        self.caches: list = []
        self.done: list[list[int]] = []  # per slot, per layer: rows computed with committed tokens
        self.absorbed: list[int] = []  # per slot: target rows copied into outs[slot, 0]

    def check_draft_len(self, draft_len: int) -> None:
        self.spec.check_draft_len(draft_len)

    @torch.inference_mode()
    def reserve(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of `max_len` rows per layer; empties every slot."""
        w = self.layers[0].final_norm.weight  # fp32 (proj may keep fp16/int8 panels)
        if not self.caches or self.caches[0].max_len < max_len or self.caches[0].slots < slots:
            self.caches = []
            self.caches = [self.kit.cache(max_len, slots) for _ in self.layers]
            self.outs = w.new_zeros(slots, self.spec.num_layers + 1, max_len, self.spec.hidden_size)
        self.done = [[0] * self.spec.num_layers for _ in range(self.caches[0].slots)]
        self.absorbed = [0] * self.caches[0].slots

    def start(self, slot: int) -> None:
        self.done[slot] = [0] * self.spec.num_layers
        self.absorbed[slot] = 0

    def _target_state(self, h: Tensor) -> Tensor:
        """The state layer 0 reads, from what left the target's last layer."""
        return self.target.norm(h) if self.spec.target_hidden_state == "final_norm_output" else h

    def _run_layer(self, k: int, h: Tensor, tokens: Tensor, rows: Rows,
                   jobs: list[DraftJob] = ()) -> tuple[Tensor, Tensor]:
        """Layer k over `rows` (inputs h [R, H], tokens [R]; segment i is jobs[i]'s) -> (chain hidden
        [R, H], logits [J, V] of each segment's last row, fp32; every logit without `jobs`)."""
        cos, sin = self.target.cos[rows.pos, None], self.target.sin[rows.pos, None]
        embedded = self.target.embed_tokens(tokens)
        if self.zero_position_zero:
            embedded = embedded.masked_fill((rows.pos == 0)[:, None], 0)
        chain, normed = self.layers[k](embedded, h, cos, sin, self.caches[k], rows)
        # greedy chain jobs' rows through the target's greedy screen, when it has one
        return chain, self.target.head(normed[rows.last_rows()], argmax_only(jobs))

    def _choose(self, logits: Tensor, jobs: list[DraftJob], step: int) -> list[int]:
        greedy = argmax_rows(logits)
        return [greedy[i] if j.sampler is None
                else j.sampler.race(j.sampler.probs(logits[i : i + 1])[0], len(j.context) + step)
                for i, j in enumerate(jobs)]

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[Draft]:
        """Every layer runs on every call, so all stay in step whatever the draft length: step k
        runs layer k over each job's rows it has not computed with committed tokens (the tokens
        of its last k rows are the drafts d_1..d_k). Steps past the last layer (reuse) append one
        row per job to layer k mod n, fed by the previous step."""
        for j in jobs:
            self.check_draft_len(j.k)
            self._absorb(j)
        dev, n_layers = self.outs.device, self.spec.num_layers
        P = [len(j.context) - 1 for j in jobs]  # committed rows per job
        seqs = [j.context for j in jobs]
        drafts: list[list[int]] = [[] for _ in jobs]
        branches = Branches(jobs)  # jobs that ask for a tree get each step's alternatives as leaves
        for k in range(n_layers):
            starts = [self.done[j.slot][k] for j in jobs]
            rows = Rows.of([Segment(j.slot, s, p - s) for j, s, p in zip(jobs, starts, P)], dev)
            h = torch.cat([self.outs[j.slot, k, s:p] for j, s, p in zip(jobs, starts, P)])
            tokens = torch.cat([q[s + k + 1 : p + k + 1] for q, s, p in zip(seqs, starts, P)])
            chain, logits = self._run_layer(k, h, tokens, rows, jobs)
            for (seg, a), j in zip(rows.segments, jobs):
                self.outs[j.slot, k + 1, seg.start : seg.start + seg.T] = chain[a : a + seg.T]
            for i, t in enumerate(self._choose(logits, jobs, k)):
                drafts[i].append(t)
                branches.add(i, k, logits[i], t)
                seqs[i] = torch.cat([seqs[i], torch.tensor([t], device=seqs[i].device)])
        self._reuse(jobs, P, drafts, branches)
        for j, p in zip(jobs, P):
            self.done[j.slot] = [max(p - k, 0) for k in range(n_layers)]  # draft rows are recomputed
        return branches.drafts(drafts)

    def _absorb(self, j: DraftJob) -> None:
        """Copy the target states of the job's newly committed rows into outs[slot, 0]."""
        if j.feats is None:
            return
        lo = self.absorbed[j.slot]
        self.outs[j.slot, 0, lo : lo + len(j.feats)] = self._target_state(j.feats)
        self.absorbed[j.slot] = lo + len(j.feats)
        if self.absorbed[j.slot] != len(j.context) - 1:
            raise RuntimeError(f"MTP drafter: slot {j.slot} has target states for {self.absorbed[j.slot]} "
                               f"rows, its context commits {len(j.context) - 1}")

    def _reuse(self, jobs: list[DraftJob], P: list[int], drafts: list[list[int]], branches: Branches) -> None:
        """Draft steps past the last layer: layer j mod n appends one row per job still drafting."""
        n_layers, dev = self.spec.num_layers, self.outs.device
        h = torch.stack([self.outs[j.slot, n_layers, p - 1] for j, p in zip(jobs, P)])  # [J, H]
        ends = [[p] * n_layers for p in P]  # rows per layer so far (layer k ran up to P)
        for step in range(n_layers, max(j.k for j in jobs)):
            k = step % n_layers
            live = [i for i, j in enumerate(jobs) if j.k > step]
            rows = Rows.of([Segment(jobs[i].slot, ends[i][k], 1) for i in live], dev)
            tokens = torch.tensor([drafts[i][-1] for i in live], device=dev)
            chain, logits = self._run_layer(k, h[live], tokens, rows, [jobs[i] for i in live])
            h[live] = chain
            for n, (i, t) in enumerate(zip(live, self._choose(logits, [jobs[i] for i in live], step))):
                drafts[i].append(t)
                branches.add(i, step, logits[n], t)
                ends[i][k] += 1

    def reset(self, max_len: int) -> None:
        """One sequence (slot 0), for `propose`."""
        self.reserve(1, max_len)

    def propose(self, context: Tensor, feats: Tensor | None, draft_len: int, sampler=None) -> Draft:
        """One sequence's draft (slot 0): context [n] every token so far, feats [r, H] the target's
        last-layer output at the r positions committed since the last call."""
        return self.draft([DraftJob(0, context, feats, draft_len, sampler)])[0]


def mtp_tensor_names(spec: MtpSpec, kit: _DenseKit) -> dict[str, tuple]:
    """Every canonical tensor with its shape."""
    H, shapes = spec.hidden_size, {}
    for k in range(spec.num_layers):
        shapes.update({f"layers.{k}.{n}": ((H, 2 * H) if n == "proj.weight" else (H,)) for n in FUSION})
        shapes.update(kit.shapes(f"layers.{k}.block.", k))
    return shapes


def load_mtp(params: dict | None, drafter_dir, target) -> MtpDrafter:
    """Load a canonical MTP drafter for `target`. Its tensors live in the artifact's target files
    (config `weights: target`, with a name map) or in drafter/model.safetensors. `params` override
    config fields (e.g. {'allow_layer_reuse': True})."""
    from specpack.runtime.models.weights import assign_weights, check_shapes, checkpoint_files, read_tensors, tensor_shapes

    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / "config.json").is_file():
        raise InputError(f"no config.json in drafter dir {drafter_dir}")
    cfg = {**json.loads((drafter_dir / "config.json").read_text()), **(params or {})}
    spec, kit = mtp_spec_from_config(cfg), _kit(target)
    problems = [f"{name} is {mine}, the target's is {theirs}" for name, mine, theirs in [
        ("hidden_size", spec.hidden_size, target.spec.hidden_size),
        ("vocab_size", spec.vocab_size, target.spec.vocab_size)] if mine != theirs]
    if problems:
        raise InputError(f"drafter {drafter_dir} does not fit this target", problems=problems)
    expected = mtp_tensor_names(spec, kit)
    in_target = cfg["weights"] == "target"  # canonical name -> tensor name in the target's files
    names = (cfg.get("tensors") or {}) if in_target else {n: n for n in expected}
    files = checkpoint_files(drafter_dir.parent if in_target else drafter_dir)
    files = {names[c]: files[names[c]] for c in names if names[c] in files}
    shapes = tensor_shapes(files)
    check_shapes({c: shapes[s] for c, s in names.items() if s in shapes}, expected, f"MTP drafter {drafter_dir}")
    raw = read_tensors(files, {names[c] for c in expected})
    t = {c: raw[names[c]] for c in expected}
    state = {}
    for k in range(spec.num_layers):
        p = f"layers.{k}."
        state.update({p + n: t[p + n] + spec.norm_offset if "norm" in n and spec.norm_offset else t[p + n]
                      for n in FUSION})
        state.update(kit.state(t, p + "block."))
    with torch.device("meta"):
        drafter = MtpDrafter(spec, target, kit)
    drafter = assign_weights(drafter, state, target.device, target.dtype)
    from specpack.runtime.models.moe import keep_routers_fp32

    return keep_routers_fp32(drafter)
