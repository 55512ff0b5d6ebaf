"""A trainable DSpark head for `distill --head dspark`: DeepSpec's `Qwen3DSparkModel` (anchor-first
block, vanilla Markov head, confidence head) on the EAGLE-3 trainer's cached data.

Written from deepseek-ai/DeepSpec @ afdfa7c9382a3341a3e6f17756dd816da79f132c:
- deepspec/modeling/dspark/qwen3/modeling.py: Qwen3DSparkAttention (the context's keys and values
  are k_proj / v_proj of hidden_norm(fc(target features)), without input_layernorm; k_norm over
  context and block keys alike; RoPE at absolute positions); Qwen3DSparkModel.forward (label
  offsets 1..B: slot q of the block anchored at p predicts x_{p+q+1}; teacher-forced Markov input
  prev = [anchor, labels[:-1]]; confidence from [h, markov_w1[prev]]);
- deepspec/modeling/dspark/common.py: create_dspark_attention_mask (a block sees the context
  positions < its anchor and its own block, non-causally), create_position_ids (anchor + 0..B-1),
  create_noise_embed ([anchor, mask x (B-1)] embedded with the target's frozen table);
- deepspec/modeling/dspark/markov_head.py: VanillaMarkov (logits + markov_w2(markov_w1[prev])).
The runtime's BlockDrafter (runtime/drafters/block.py) computes exactly this at inference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpack.distill.head import FromTarget, HeadConfig, HeadMLP
from specpack.runtime.models.dense import RMSNorm, apply_rope, rope_inv_freq, rope_tables

CONFIDENCE_TARGETS = ("greedy", "overlap")


@dataclass(frozen=True)
class DSparkOptions:
    """DeepSpec's recipe (config/dspark/dspark_qwen3_4b.py: block 7, 5 layers for a 36-layer target,
    Markov rank 256, loss_decay_gamma 4, CE 0.1 + L1 0.9, confidence 1.0, 512 anchors per 4096
    tokens) sized for a CPU: 3 layers (one block forward costs about what EAGLE-3's chain of 3
    one-layer steps does) and a block of 5 (at the acceptance a 135M target's head reaches, slots
    past 5 are rarely reached, and every slot is a row of training compute)."""

    block_size: int = 5  # B draft slots (anchor-first: N = B)
    layers: int = 3  # K DFlash-backbone (Qwen3) layers
    markov_rank: int = 64  # r of the vanilla Markov head
    anchors: int = 64  # blocks sampled per window of seq_len positions per step
    loss_decay_gamma: float = 4.0  # slot q's loss weight exp(-q / gamma)
    ce_alpha: float = 0.1  # cross-entropy against the target's argmax
    l1_alpha: float = 0.9  # L1 distance to the target's distribution (on the draft vocab)
    soft_ce_alpha: float = 0.0  # cross-entropy against the target's distribution (EAGLE-3's loss; not DeepSpec's)
    confidence_alpha: float = 1.0  # BCE of the confidence head
    confidence_target: str = "greedy"  # greedy: argmax match (what greedy decoding accepts); overlap: sum min(p, q)
    mask_token_id: int | None = None  # None: the highest token id the data never shows (an unused row)

    @classmethod
    def from_dict(cls, options: dict | None) -> tuple["DSparkOptions", list[str]]:
        """(options, problems): unknown keys are problems, not errors one at a time."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        problems = [f"unknown DSpark option {k!r} (known: {', '.join(sorted(known))})"
                    for k in options if k not in known]
        return cls(**{k: v for k, v in options.items() if k in known}), problems

    def problems(self, vocab_size: int) -> list[str]:
        out = [f"DSpark {name} {getattr(self, name)!r} must be a positive integer"
               for name in ("block_size", "layers", "markov_rank", "anchors")
               if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0)]
        out += [f"DSpark {name} {getattr(self, name)!r} must be a number >= 0"
                for name in ("ce_alpha", "l1_alpha", "soft_ce_alpha", "confidence_alpha")
                if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0)]
        if not out and self.ce_alpha + self.l1_alpha + self.soft_ce_alpha <= 0:
            out.append("DSpark ce_alpha + l1_alpha + soft_ce_alpha is 0: nothing would train the draft tokens")
        if not (isinstance(self.loss_decay_gamma, (int, float)) and self.loss_decay_gamma > 0):
            out.append(f"DSpark loss_decay_gamma {self.loss_decay_gamma!r} must be positive")
        if self.confidence_target not in CONFIDENCE_TARGETS:
            out.append(f"DSpark confidence_target {self.confidence_target!r} (use {' or '.join(CONFIDENCE_TARGETS)})")
        mask = self.mask_token_id
        if mask is not None and not (isinstance(mask, int) and 0 <= mask < vocab_size):
            out.append(f"mask token id {mask!r} is not a token of the target's {vocab_size}-token vocabulary")
        return out

    def objective(self) -> dict:
        """The training-only options (the head's geometry is in DSparkConfig)."""
        return {k: v for k, v in asdict(self).items() if k not in ("block_size", "layers", "markov_rank",
                                                                  "mask_token_id")}


@dataclass(frozen=True)
class DSparkConfig(HeadConfig):
    """The head's geometry: the target's layer shapes (DeepSpec copies the target config, as the
    EAGLE-3 head does), K layers over blocks of `block_size`."""

    num_target_layers: int
    num_layers: int
    block_size: int
    markov_rank: int
    mask_token_id: int

    @classmethod
    def for_target(cls, spec, draft_vocab: int, aux_layer_ids, options: DSparkOptions, mask: int) -> "DSparkConfig":
        head = HeadConfig.for_target(spec, draft_vocab, tuple(aux_layer_ids))
        return cls(**asdict(head), num_target_layers=spec.num_layers, num_layers=options.layers,
                   block_size=options.block_size, markov_rank=options.markov_rank, mask_token_id=mask)


def unused_token(tokens: Tensor, pred: Tensor, vocab_size: int) -> int:
    """DeepSpec's mask token is a row no text uses (Qwen3's 151669): the highest id that neither
    occurs in the data nor is predicted by the target there (else the rarest one)."""
    seen = torch.bincount(tokens, minlength=vocab_size) + torch.bincount(pred, minlength=vocab_size)
    unused = torch.nonzero(seen == 0).flatten()
    return int(unused[-1]) if len(unused) else vocab_size - 1 - int(seen.flip(0).argmin())


class DSparkAttention(nn.Module):
    """Qwen3 attention of block rows over [the context before their anchor | their own block]."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        H, hd = c.hidden_size, c.head_dim
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, hd
        self.q_proj = nn.Linear(H, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., H] -> k (k_norm, RoPE), v: [..., heads, hd], kv heads repeated for the query heads."""
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        groups = self.heads // self.kv_heads
        return k.repeat_interleave(groups, -2), self.v_proj(x).view(shape).repeat_interleave(groups, -2)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: tuple[Tensor, Tensor], seen: Tensor) -> Tensor:
        """x [W, A, B, H] blocks (cos, sin [W, A, B, 1, hd]); ctx (k, v) [W, T, heads, hd] of the
        window's context rows; seen [W, A, T]: which context rows each block's anchor comes after."""
        W, A, B, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(W, A, B, self.heads, self.head_dim)), cos, sin)
        k, v = self.keys(x, cos, sin)  # [W, A, B, heads, hd]
        scale = self.head_dim ** -0.5
        s_ctx = torch.einsum("wabhd,wthd->wahbt", q, ctx[0]) * scale  # [W, A, heads, B, T]
        s_ctx = s_ctx.masked_fill(~seen[:, :, None, None, :], float("-inf"))
        s_blk = torch.einsum("wabhd,wakhd->wahbk", q, k) * scale  # [W, A, heads, B, B]: non-causal
        p = torch.cat([s_ctx, s_blk], -1).softmax(-1)
        T = ctx[0].shape[1]
        y = torch.einsum("wahbt,wthd->wabhd", p[..., :T], ctx[1]) + torch.einsum("wahbk,wakhd->wabhd", p[..., T:], v)
        return self.o_proj(y.reshape(W, A, B, self.heads * self.head_dim))


class DSparkLayer(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DSparkAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = HeadMLP(c)

    def forward(self, x: Tensor, rope: tuple, ctx: Tensor, ctx_rope: tuple, seen: Tensor) -> Tensor:
        context = self.self_attn.keys(ctx, *ctx_rope)  # this layer's own k/v of the context, no input norm
        x = x + self.self_attn(self.input_layernorm(x), *rope, context, seen)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Vanilla: markov_w1 [Vt, r] embeds the previous token (target ids), markov_w2 [Vd, r] maps it to
    a logit bias. w2 starts at zero, so training starts from the backbone's own logits."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(c.target_vocab_size, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, c.draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)  # transformers' initializer_range (DeepSpec post_init)
        nn.init.zeros_(self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.proj = nn.Linear(c.hidden_size + c.markov_rank, 1)  # [h, markov_w1[prev]] (with_markov)


class DSparkHead(FromTarget, nn.Module):
    """The head's parameters under their canonical (= DeepSpec) names; the target's embedding stays
    outside (frozen, not in the state dict)."""

    def __init__(self, c: DSparkConfig, embed: Tensor):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.markov_head = MarkovHead(c)
        self.confidence_head = ConfidenceHead(c)
        self.register_buffer("aux_scale", torch.ones(len(c.aux_layer_ids) * c.target_hidden_size))
        object.__setattr__(self, "embed", embed.detach())  # [Vt, H], shared with the target
        cos, sin = rope_tables(rope_inv_freq(c.head_dim, c.rope_theta, None),
                               c.max_position_embeddings + c.block_size + 16, torch.float32, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, aux: Tensor, ctx_pos: Tensor, anchors: Tensor, anchor_pos: Tensor,
                prev: Tensor) -> tuple[Tensor, Tensor]:
        """aux [W, T, n_aux·Ht] the features of a window's positions (ctx_pos [W, T] absolute);
        anchors [W, A] each block's anchor as a window index (its context: window rows before it),
        anchor_pos [W, A] its absolute position; prev [W, A, B] target ids: the anchor, then the true
        tokens after it (teacher forcing). -> draft-vocab logits [W, A, B, Vd] (base + Markov bias)
        and confidence logits [W, A, B] (fp32)."""
        c = self.config
        ctx = self.hidden_norm(self.fc(aux / self.aux_scale))  # [W, T, H]
        seen = torch.arange(aux.shape[1]) < anchors[..., None]  # [W, A, T]
        block = torch.where(torch.arange(c.block_size) == 0, prev, c.mask_token_id)  # [anchor, MASK, ...]
        x = F.embedding(block, self.embed)  # [W, A, B, H]
        pos = anchor_pos[..., None] + torch.arange(c.block_size)  # [W, A, B]
        rope, ctx_rope = (self.cos[pos, None], self.sin[pos, None]), (self.cos[ctx_pos, None], self.sin[ctx_pos, None])
        for layer in self.layers:
            x = layer(x, rope, ctx, ctx_rope, seen)
        h = self.norm(x)
        e = self.markov_head.markov_w1(prev)  # [W, A, B, r]
        logits = self.lm_head(h) + self.markov_head.markov_w2(e)
        confidence = self.confidence_head.proj(torch.cat([h, e], -1).float()).squeeze(-1)
        return logits.float(), confidence
