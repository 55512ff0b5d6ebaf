"""EAGLE-3 head in specpack's canonical layout (docs/format.md), with its own one-layer KV cache.

Alignment (EAGLE reference): at position p the head reads f_p = fc(cat(aux features of target
position p)) and the embedding of token x_{p+1}, and predicts x_{p+2}. Later draft steps feed the
head's own output hidden state (before the final norm) in place of f.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specpack.errors import InputError
from specpack.runtime.kernels.argmax import argmax_rows
from specpack.families.dense import RopeScaling, rope_from_config
from specpack.runtime.models.dense import MLP, Attention, KVCache, RMSNorm, embedding, rope_inv_freq, rope_tables
from specpack.runtime.models.rows import Rows, Segment
from specpack.runtime.drafters.base import Draft, DraftJob
from specpack.runtime.drafters.tree import Tree, branch, branching, fed_block

REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "target_hidden_size", "aux_layer_ids", "draft_vocab_size", "target_vocab_size")


@dataclass(frozen=True)
class Eagle3Spec:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # convention: input of layer i == transformers hidden_states[i]
    draft_vocab_size: int
    target_vocab_size: int
    embedding: str  # "target" (the target's embed_tokens) or "drafter" (its own)
    norm_before_residual: bool

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """KV cache bytes one token takes in the head's one layer."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def eagle3_spec_from_config(cfg: dict) -> Eagle3Spec:
    """Read a canonical drafter config.json dict; InputError lists every missing or bad field."""
    problems = [f"missing field {k}" for k in REQUIRED if cfg.get(k) is None]
    if cfg.get("kind", "eagle3") != "eagle3":
        problems.append(f"kind is {cfg.get('kind')!r}, expected 'eagle3'")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("embedding", "target") not in ("target", "drafter"):
        problems.append(f"embedding {cfg['embedding']!r} (expected 'target' or 'drafter')")
    theta, scaling, rope_problems = rope_from_config(cfg)
    if problems or rope_problems:
        raise InputError("the EAGLE-3 drafter config is not usable", problems=problems + rope_problems,
                         hint="re-run the converter on the source drafter")
    heads = int(cfg["num_attention_heads"])
    return Eagle3Spec(
        hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads, num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg["rms_norm_eps"]), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        target_hidden_size=int(cfg["target_hidden_size"]), aux_layer_ids=tuple(int(i) for i in cfg["aux_layer_ids"]),
        draft_vocab_size=int(cfg["draft_vocab_size"]), target_vocab_size=int(cfg["target_vocab_size"]),
        embedding=cfg.get("embedding", "target"), norm_before_residual=bool(cfg.get("norm_before_residual", False)))


def eagle3_tensor_shapes(s: Eagle3Spec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the canonical safetensors file (t2d and embed_tokens handled separately)."""
    H, I, q, kv = s.hidden_size, s.intermediate_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    p = "layers.0."
    shapes = {"fc.weight": (H, len(s.aux_layer_ids) * s.target_hidden_size),
              p + "self_attn.q_proj.weight": (q, 2 * H), p + "self_attn.k_proj.weight": (kv, 2 * H),
              p + "self_attn.v_proj.weight": (kv, 2 * H), p + "self_attn.o_proj.weight": (H, q),
              p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
              p + "input_layernorm.weight": (H,), p + "hidden_norm.weight": (H,),
              p + "post_attention_layernorm.weight": (H,), "norm.weight": (H,),
              "lm_head.weight": (s.draft_vocab_size, H), "d2t": (s.draft_vocab_size,)}
    if s.embedding == "drafter":
        shapes["embed_tokens.weight"] = (s.target_vocab_size, H)
    return shapes


class Eagle3Layer(nn.Module):
    """The head's decoder layer: q/k/v read cat(norm(embedding), norm(h)) (embedding first)."""

    def __init__(self, s: Eagle3Spec):
        super().__init__()
        H = s.hidden_size
        self.norm_before_residual = s.norm_before_residual
        self.input_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, s.rms_norm_eps)
        self.self_attn = Attention(2 * H, H, s.num_heads, s.num_kv_heads, s.head_dim)
        self.post_attention_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.mlp = MLP(H, s.intermediate_size)
        self.fused = None  # kernels.layers.FusedEagle3Layer when it runs as C calls (see fuse_layers)

    def fuse_layers(self) -> bool:
        """Run as kernel calls (kernels/layers.py) when its linear layers run on the packed CPU
        kernel; True when it now does."""
        from specpack.runtime.kernels.layers import FusedEagle3Layer

        self.fused = FusedEagle3Layer.of(self)
        return self.fused is not None

    def forward(self, emb, h, cos, sin, k_cache, v_cache, rows: Rows):
        # emb, h: [T, H] -> [T, H]
        if self.fused is not None:
            return self.fused(emb, h, cos, sin, k_cache, v_cache, rows)
        normed = self.hidden_norm(h)
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [T, 2H]
        h = (normed if self.norm_before_residual else h) + self.self_attn(x, cos, sin, k_cache, v_cache, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """Drafts for many sequences at once, each from the target features of its positions committed
    since its last draft, with the head's own KV cache slot per sequence (`reserve`, `start`)."""

    kind = "eagle3"
    tree_drafts = True  # grows dynamic trees (DraftJob.tree)

    def __init__(self, spec: Eagle3Spec, target_embed: nn.Embedding | None = None):
        super().__init__()
        self.spec = spec
        self.capture_layers = spec.aux_layer_ids
        H = spec.hidden_size
        self.fc = nn.Linear(len(spec.aux_layer_ids) * spec.target_hidden_size, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(spec)])
        self.norm = RMSNorm(H, spec.rms_norm_eps)
        self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        if spec.embedding == "drafter":
            self.embed_tokens = embedding(spec.target_vocab_size, H)
        else:
            # the target's table, held outside the module tree so it is not a second copy in state_dict
            object.__setattr__(self, "embed_tokens", target_embed)
        self.cache: KVCache | None = None
        self.lengths: list[int] = []  # committed positions per slot
        self.register_buffer("cos", None, persistent=False)  # [max_len, hd] RoPE tables, with the cache
        self.register_buffer("sin", None, persistent=False)
        self.register_buffer("draft_to_target", None, persistent=False)  # [Vd] target id of each draft id

    @torch.inference_mode()
    def reserve(self, slots: int, max_len: int) -> None:
        """Room for `slots` sequences of `max_len` positions; empties every slot."""
        s, w = self.spec, self.norm.weight  # fp32 (lm_head may keep fp16/int8 panels)
        if self.cache is None or self.cache.max_len < max_len or self.cache.slots < slots:
            self.cache = None
            self.cache = KVCache(1, s.num_kv_heads, s.head_dim, max_len, w.dtype, w.device, slots)
            self.cos, self.sin = rope_tables(rope_inv_freq(s.head_dim, s.rope_theta, s.rope_scaling),
                                             max_len, w.dtype, w.device)
            self.draft_to_target = torch.arange(s.draft_vocab_size, device=w.device) + self.d2t
        self.lengths = [0] * self.cache.slots

    def start(self, slot: int) -> None:
        """A new sequence takes `slot`."""
        self.lengths[slot] = 0

    def _forward(self, h, tokens: Tensor, rows: Rows, logit_rows: list[int]) -> tuple[Tensor, Tensor]:
        """The head over `rows`: h [R, H] (`fc` output or its own hidden states), tokens [R] the
        target ids of the next positions -> (hidden states [R, H] before the final norm, draft-vocab
        logits [len(logit_rows), Vd])."""
        layer, args = self.layers[0], (self.cos[rows.pos, None], self.sin[rows.pos, None], self.cache.k[0],
                                       self.cache.v[0], rows)
        if layer.fused is not None and layer.fused.head_fuses(self.norm, self.lm_head):  # one C call
            return layer.fused.step(self.embed_tokens(tokens), h, *args, logit_rows, self.norm, self.lm_head)
        out = layer(self.embed_tokens(tokens), h, *args)
        return out, self.lm_head(self.norm(out[logit_rows])).float()

    def _choose(self, logits: Tensor, jobs: list[DraftJob], step: int) -> list[int]:
        """Draft-vocab logits [J, Vd] -> each job's target id for its draft position `step`."""
        greedy = self.draft_to_target[argmax_rows(logits)].tolist()
        if all(j.sampler is None for j in jobs):
            return greedy
        return [greedy[i] if j.sampler is None
                else j.sampler.race(j.sampler.probs(logits[i : i + 1])[0], len(j.context) + step,
                                    self.draft_to_target)
                for i, j in enumerate(jobs)]

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[Draft]:
        """Step 0 reads each job's new features (fc) with the tokens after them, appending those
        positions to its slot for good; steps 1.. feed the head's own output state and draft,
        their positions dropped afterwards."""
        dev = self.draft_to_target.device
        missing = [j.slot for j in jobs if j.feats is None or not len(j.feats)]
        if missing:
            raise RuntimeError(f"EAGLE-3 drafter: no new target features for slots {missing}")
        rows = Rows.of([Segment(j.slot, self.lengths[j.slot], len(j.feats)) for j in jobs], dev)
        tokens = torch.cat([j.context[-len(j.feats):] for j in jobs])
        out, logits = self._forward(self.fc(torch.cat([j.feats for j in jobs])), tokens, rows, rows.last_rows())
        for j in jobs:
            self.lengths[j.slot] += len(j.feats)
        h = out[rows.last_rows()]  # [J, H]: each job's latest state
        if any(branching(j) for j in jobs):
            return self._grow(jobs, h, logits)
        drafts = [[t] for t in self._choose(logits, jobs, 0)]
        if self._chain_in_c(jobs, h, drafts):
            return [Draft(torch.tensor(d, dtype=torch.long)) for d in drafts]
        for step in range(1, max(j.k for j in jobs)):
            live = [i for i, j in enumerate(jobs) if j.k > step]
            rows = Rows.of([Segment(jobs[i].slot, self.lengths[jobs[i].slot] + step - 1, 1) for i in live], dev)
            last = torch.tensor([drafts[i][-1] for i in live], device=dev)
            every = len(live) == len(jobs)
            out, logits = self._forward(h if every else h[live], last, rows, list(range(len(live))))
            if every:
                h = out
            else:
                h[live] = out
            for i, t in zip(live, self._choose(logits, [jobs[i] for i in live], step)):
                drafts[i].append(t)
        return [Draft(torch.tensor(d, dtype=torch.long)) for d in drafts]

    def _chain_in_c(self, jobs: list[DraftJob], h: Tensor, drafts: list[list[int]]) -> bool:
        """Greedy chains' later steps as one C call (kernels.layers.FusedEagle3Layer.chain) where the head runs
        fused with its lm_head and every job is greedy: the loop below, without its Python and torch ops between
        the steps (each 10-50 us right after the target's weight stream). False: the loop drafts instead
        (`SPECPACK_EAGLE3_CHAIN=0` keeps the loop, for comparison)."""
        fused = self.layers[0].fused
        if (fused is None or any(j.sampler is not None for j in jobs) or max(j.k for j in jobs) < 2
                or os.environ.get("SPECPACK_EAGLE3_CHAIN", "1") == "0"):
            return False
        return fused.chain([j.slot for j in jobs], [self.lengths[j.slot] for j in jobs], [j.k for j in jobs], h,
                           drafts, self.embed_tokens, self.draft_to_target, self.cos, self.sin, self.cache.k[0],
                           self.cache.v[0], self.norm, self.lm_head)

    def _grow(self, jobs: list[DraftJob], h: Tensor, logits: Tensor) -> list[Draft]:
        """Dynamic trees (EAGLE-2): from each job's root (state h [J, H], logits [J, Vd]) expand,
        level by level, the top-k likeliest nodes of the newest level by cumulative draft
        probability, each into its top-k children, down to the job's depth; keep its best `nodes`
        (nodes whose children could not make that cut are not expanded: Tree.expandable).
        One head forward per level for every job's expanded nodes, each row attending its
        ancestors' rows (a wide Segment.block); the rows are dropped afterwards, as a chain's are.
        Jobs without a tree grow a chain (one child per node)."""
        dev = self.draft_to_target.device
        trees = [Tree() for _ in jobs]
        states = [{-1: h[i]} for i in range(len(jobs))]  # node -> the head's state after it
        fed: list[list[int]] = [[] for _ in jobs]  # the node of each draft row, per job
        self._branch(trees, [-1] * len(jobs), logits, jobs, 0)
        for depth in range(1, max(j.k for j in jobs)):
            plan = [(i, trees[i].expandable(depth, min(j.tree.topk if branching(j) else 1,
                                                       self.cache.max_len - self.lengths[j.slot] - len(fed[i])),
                                            j.tree.nodes if branching(j) else j.k))
                    for i, j in enumerate(jobs) if j.k > depth]
            plan = [(i, nodes) for i, nodes in plan if nodes]
            if not plan:
                break
            segments, tokens, hs = [], [], []
            for i, nodes in plan:
                start = self.lengths[jobs[i].slot]
                segments.append(Segment(jobs[i].slot, start + len(fed[i]), len(nodes),
                                        fed_block(trees[i].parents, fed[i], nodes),
                                        torch.full((len(nodes),), start + depth - 1)))
                tokens += [trees[i].tokens[n] for n in nodes]
                hs += [states[i][trees[i].parents[n]] for n in nodes]
                fed[i] += nodes
            out, lg = self._forward(torch.stack(hs), torch.tensor(tokens, device=dev), Rows.of(segments, dev),
                                    list(range(len(tokens))))
            owners = [i for i, nodes in plan for _ in nodes]
            fed_now = [n for _, nodes in plan for n in nodes]
            for r, (i, n) in enumerate(zip(owners, fed_now)):
                states[i][n] = out[r]
            self._branch([trees[i] for i in owners], fed_now, lg, [jobs[i] for i in owners], depth)
        return [t.draft(j.tree.nodes if branching(j) else j.k) for t, j in zip(trees, jobs)]

    def _branch(self, trees: list[Tree], parents: list[int], logits: Tensor, jobs: list[DraftJob],
                step: int) -> None:
        """Row r of draft-vocab logits [R, Vd] gives trees[r] the children of node parents[r] (-1:
        the root): the top-k (a sampled job's race winner first, as its chain would draft)."""
        branch(trees, parents, logits, jobs, step, [j.tree.topk if branching(j) else 1 for j in jobs],
               self.draft_to_target)

    def reset(self, max_len: int) -> None:
        """One sequence (slot 0), for `propose`."""
        self.reserve(1, max_len)

    def propose(self, context: Tensor, feats: Tensor, draft_len: int, sampler=None) -> Draft:
        """One sequence's draft (slot 0; see `draft`): context [n] every token so far, feats [r, F]
        the features of the r positions committed since the last call."""
        return self.draft([DraftJob(0, context, feats, draft_len, sampler)])[0]


def _vocab_map_problems(d2t: Tensor, t2d: Tensor | None, s: Eagle3Spec) -> list[str]:
    ids = torch.arange(s.draft_vocab_size) + d2t
    problems = []
    if ((ids < 0) | (ids >= s.target_vocab_size)).any():
        problems.append(f"d2t maps draft ids outside the target vocab of {s.target_vocab_size}")
    elif len(torch.unique(ids)) != len(ids):
        problems.append("d2t maps two draft ids to the same target id")
    elif t2d is not None and (t2d.shape != (s.target_vocab_size,) or not bool(t2d[ids].all())
                              or int(t2d.sum()) != s.draft_vocab_size):
        problems.append("t2d does not mark exactly the target ids d2t maps to")
    return problems


def load_eagle3(params: dict | None, drafter_dir, target) -> Eagle3Drafter:
    """Load a canonical EAGLE-3 drafter dir for `target` (our Transformer), on its device and dtype.
    `params` entries override config.json fields. Every mismatch is reported at once."""
    from specpack.runtime.models.weights import assign_weights, check_shapes, checkpoint_files, read_tensors, tensor_shapes
    from specpack.runtime.models.weights import fuse_layer

    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / "config.json").is_file():
        raise InputError(f"no config.json in drafter dir {drafter_dir}")
    spec = eagle3_spec_from_config({**json.loads((drafter_dir / "config.json").read_text()), **(params or {})})
    t = target.spec
    problems = [f"{name} is {mine}, the target's is {theirs}" for name, mine, theirs in [
        ("target_hidden_size", spec.target_hidden_size, t.hidden_size),
        ("target_vocab_size", spec.target_vocab_size, t.vocab_size)] if mine != theirs]
    problems += [f"aux layer id {i} is not a layer of the {t.num_layers}-layer target"
                 for i in spec.aux_layer_ids if not 0 <= i < t.num_layers]
    if spec.embedding == "target" and spec.hidden_size != t.hidden_size:
        problems.append(f"the head (hidden {spec.hidden_size}) cannot use the target's embedding ({t.hidden_size})")
    files = checkpoint_files(drafter_dir)
    expected = eagle3_tensor_shapes(spec)
    identity = "d2t" not in files and spec.draft_vocab_size == spec.target_vocab_size
    if identity:  # a full-vocabulary head ships no map (manifest vocab_map: identity)
        expected.pop("d2t")
    try:
        check_shapes(tensor_shapes(files), expected, f"EAGLE-3 drafter {drafter_dir}")
    except InputError as e:
        problems += e.problems
    if problems:
        raise InputError(f"drafter {drafter_dir} does not fit this target", problems=problems,
                         hint="the drafter must be converted for exactly this target model")
    w = read_tensors(files, list(expected) + (["t2d"] if "t2d" in files else []))
    if identity:
        w["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
    vocab_problems = _vocab_map_problems(w["d2t"], w.get("t2d"), spec)
    if vocab_problems:
        raise InputError(f"drafter {drafter_dir} has a broken vocabulary map", problems=vocab_problems)
    state = {k: v for k, v in w.items() if not k.startswith("layers.") and k != "t2d"}
    state.update(fuse_layer(w, "layers.0.", "layers.0."))
    with torch.device("meta"):
        head = Eagle3Drafter(spec, target.embed_tokens)
    return assign_weights(head, state, target.device, target.dtype)
