"""A trainable EAGLE-3 head with EAGLE-3's training-time test (TTT) forward.

Same tensors and names as the canonical head (runtime/eagle3.py), unfused and batched, without a
KV cache. Alignment as at inference: at base position p, step 0 reads f_p = fc(aux features of p)
and the embedding of x_{p+1} at position p and predicts x_{p+2}; step k reads the head's own
step k-1 output at p and the embedding of x_{p+k+1} at position p+k and predicts x_{p+k+2}. Its
query sees the step-0 keys of positions <= p (the committed context) and the keys of steps 1..k
of the same base (the earlier drafts), exactly what the runtime's cache holds at that draft step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpack.runtime.models.dense import RMSNorm, apply_rope, rope_inv_freq, rope_tables


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # input of layer i (transformers hidden_states[i])
    draft_vocab_size: int
    target_vocab_size: int

    @classmethod
    def for_target(cls, spec, draft_vocab: int, aux_layer_ids=None) -> "HeadConfig":
        """The published geometry: the target's hidden size, heads and MLP width; aux ids by default
        (2, L//2, L-3), counted as input of layer i."""
        L = spec.num_layers
        return cls(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                   num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
                   max_position_embeddings=spec.context_length, target_hidden_size=spec.hidden_size,
                   aux_layer_ids=tuple(aux_layer_ids or default_aux_ids(L)), draft_vocab_size=draft_vocab,
                   target_vocab_size=spec.vocab_size)

    def to_dict(self) -> dict:
        return {**asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}


def default_aux_ids(layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high features: the inputs of layers 2, L//2 and L-3."""
    return (2, layers // 2, layers - 3)


class HeadAttention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: list[tuple[Tensor, Tensor]]) -> Tensor:
        """x: [B, T, 2H]; cos, sin: [B, T, 1, hd]; `past` holds (k, v) [B, kv, T, hd] of the earlier
        TTT steps and gets this step's appended. Returns [B, T, H]."""
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.heads, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        past.append((k, self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)))
        keys = torch.cat([kv[0] for kv in past], dim=2)  # [B, kv, (k+1)·T, hd]
        values = torch.cat([kv[1] for kv in past], dim=2)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=ttt_mask(T, len(past), x.device),
                                           enable_gqa=self.heads != self.kv_heads)  # [B, heads, T, hd]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


def ttt_mask(T: int, steps: int, device=None) -> Tensor:
    """[T, steps·T]: base p sees step-0 keys of bases <= p, and each later step's key of base p only."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (steps - 1), dim=1)


class HeadMLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = HeadAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = HeadMLP(c)

    def forward(self, emb: Tensor, h: Tensor, cos: Tensor, sin: Tensor, past: list) -> Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)  # embedding first
        h = h + self.self_attn(x, cos, sin, past)
        return h + self.mlp(self.post_attention_layernorm(h))


class FromTarget:
    """What every distilled head shares (EAGLE-3's and DSpark's): `fc` over the target's features,
    a final `norm` and an `lm_head` on the draft vocabulary, started in the target's space.

    `aux_scale` preconditions fc: target hidden states carry a few huge channels (~1e4 in
    SmolLM2), and Adam moves every weight by about the learning rate, so fc columns on those
    channels would swing h wildly. Training sees aux / scale; export folds the scale into fc.weight,
    so the exported head reads raw features exactly as the published architecture does."""

    @torch.no_grad()
    def init_from_target(self, target, vocab_ids: Tensor, aux: Tensor) -> None:
        """Start the output side in the target's space (its final norm and lm_head rows), and set
        `aux_scale` to each feature channel's RMS over `aux` [N, n_aux·Ht]."""
        self.norm.weight.copy_(target.norm.weight.float())
        self.lm_head.weight.copy_(target.lm_head.weight[vocab_ids].float())
        sq = torch.zeros_like(self.aux_scale, dtype=torch.float64)
        for chunk in aux.split(4096):
            sq += chunk.double().pow(2).sum(0)
        self.aux_scale.copy_((sq / max(len(aux), 1)).sqrt().clamp(min=1e-2).float())

    def canonical_state(self) -> dict[str, Tensor]:
        """The weights as the runtime reads them: aux_scale folded into fc.weight."""
        state = {k: v.detach() for k, v in self.state_dict().items() if k != "aux_scale"}
        state["fc.weight"] = state["fc.weight"] / self.aux_scale
        return state


class TrainableHead(FromTarget, nn.Module):
    """The head's parameters under their canonical names; the target's embedding stays outside
    (frozen, not part of the state dict). Feature scaling and the start from the target: FromTarget."""

    def __init__(self, c: HeadConfig, embed: Tensor):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([HeadLayer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("aux_scale", torch.ones(len(c.aux_layer_ids) * c.target_hidden_size))
        object.__setattr__(self, "embed", embed.detach())  # [Vt, H], shared with the target
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, None)
        cos, sin = rope_tables(inv_freq, c.max_position_embeddings + 16, torch.float32, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, aux: Tensor, tokens: Tensor, positions: Tensor, steps: int) -> list[Tensor]:
        """aux: [B, T, n_aux·Ht] target features of bases p; tokens: [B, T] x_{p+1}; positions: [B, T].
        Returns the draft-vocab logits [B, T, Vd] of each of `steps` TTT steps (step k at base p
        predicts x_{p+k+2}; positions whose inputs run past the window are garbage, mask them)."""
        h, past, logits = self.fc(aux / self.aux_scale), [], []
        for k in range(steps):
            tok = F.pad(tokens[:, k:], (0, k))  # x_{p+k+1}
            pos = (positions + k).clamp(max=self.cos.shape[0] - 1)
            h = self.layers[0](F.embedding(tok, self.embed), h, self.cos[pos, None], self.sin[pos, None], past)
            logits.append(self.lm_head(self.norm(h)).float())
        return logits
