"""DeepSeek-V3 layers (runtime.deepseek) as graph modules: MLA over the latent cache, and MoE with
its routing exported as it runs.

Cache: one `latent` [kv_lora_rank + rope_dim] per layer and token (the normed c_kv and the roped
k_pe), read as past slots and returned for the new ones, attended with kv_b_proj absorbed into the
queries and the output exactly as the runtime does.

MoE: the router's grouped top-k is in the graph (TopK, ScatterElements, GatherElements); then each
expert, unrolled in expert order, runs on only the tokens routed to it (NonZero, Gather) and adds
its weighted output back (ScatterElements with add), as the runtime's index_add_ loop. The work is
that of the routed tokens, nothing dense over all experts; the graph has a copy of those few nodes
per expert (DeepSeek-V3's 256 experts × 58 layers make a large but ordinary graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpack.exports.onnx.layers import MLP, Block, CacheSlot, RoutedExperts, attend, linear, param, rms, rope


def cache(spec) -> CacheSlot:
    return CacheSlot(("latent",), (spec.kv_lora_rank + spec.qk_rope_head_dim,))


def rope_parameters(spec):
    """(inv_freq, factor) of the runtime's RoPE tables (YaRN-scaled)."""
    from specpack.runtime.models.deepseek import rope_parameters as runtime_rope

    return runtime_rope(spec)


def block(layer, spec, seen: dict) -> Block:
    from specpack.runtime.models.deepseek import MoE as RuntimeMoE

    mlp = MoE(layer.mlp, spec, seen) if isinstance(layer.mlp, RuntimeMoE) else MLP(layer.mlp, seen)
    return Block(layer, MLA(layer.self_attn, spec, seen), mlp, spec.rms_norm_eps, seen)


class MLA(nn.Module):
    """Multi-head latent attention on the latent cache. -> (y [T, H], [latent [T, r + rope]])"""

    def __init__(self, attn, s, seen: dict):
        super().__init__()
        from specpack.runtime.models.deepseek import LATENT_NORM_EPS

        self.n, self.nope, self.rope_dim, self.r, self.v = (s.num_heads, s.qk_nope_head_dim, s.qk_rope_head_dim,
                                                            s.kv_lora_rank, s.v_head_dim)
        self.interleave, self.scale, self.latent_eps = s.rope_interleave, attn.scale, LATENT_NORM_EPS
        self.q_lora = bool(s.q_lora_rank)
        if self.q_lora:
            self.q_a_w, self.q_a_b = linear(attn.q_a_proj, seen)
            self.q_a_norm = param(attn.q_a_layernorm.weight, seen)
            self.q_b_w = linear(attn.q_b_proj, seen)[0]
        else:
            self.q_w = linear(attn.q_proj, seen)[0]
        self.kv_a_w, self.kv_a_b = linear(attn.kv_a_proj_with_mqa, seen)
        self.kv_a_norm = param(attn.kv_a_layernorm.weight, seen)
        w = attn.kv_b_proj.weight.detach().view(self.n, self.nope + self.v, self.r)
        self.w_uk = param(w[:, : self.nope].contiguous(), seen)  # [n, nope, r]
        self.w_uv = param(w[:, self.nope :].transpose(1, 2).contiguous(), seen)  # [n, r, v]
        self.o_w, self.o_b = linear(attn.o_proj, seen)

    def forward(self, x, cos, sin, mask, past):
        from specpack.runtime.models.deepseek import _deinterleave

        (past_latent,) = past  # [P, r + rope]
        T, n, nope, r = x.shape[0], self.n, self.nope, self.r
        q = F.linear(rms(F.linear(x, self.q_a_w, self.q_a_b), self.q_a_norm, self.latent_eps), self.q_b_w) \
            if self.q_lora else F.linear(x, self.q_w)
        q = q.reshape(T, n, nope + self.rope_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]  # [T, n, nope], [T, n, rope]
        kv = F.linear(x, self.kv_a_w, self.kv_a_b)
        c_kv, k_pe = kv[:, :r], kv[:, r:]  # [T, r], [T, rope]
        if self.interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = rope(q_pe, cos, sin), rope(k_pe[:, None], cos, sin)[:, 0]
        latent = torch.cat([rms(c_kv, self.kv_a_norm, self.latent_eps), k_pe], -1)  # [T, r + rope]: new slots
        # [T, n, r]: q_nope · W_UK
        q_latent = _two_rows(lambda a: (a.transpose(0, 1) @ self.w_uk).transpose(0, 1), q_nope)
        query = torch.cat([q_latent, q_pe], -1)  # [T, n, r + rope]
        # one latent "head" shared by all query heads: keys are the whole latent, values its first r dims
        y = attend(query, latent[:, None], latent[:, None], past_latent[:, None], past_latent[:, None], mask,
                   self.scale).reshape(T, n, -1)[..., :r]  # [T, n, r]
        out = _two_rows(lambda a: (a.transpose(0, 1) @ self.w_uv).transpose(0, 1), y)  # [T, n, v]: latent · W_UV
        return F.linear(out.reshape(T, n * self.v), self.o_w, self.o_b), [latent]


class MoE(RoutedExperts):
    """Shared experts plus the routed ones, routed as `runtime.deepseek.Router` (see the module docstring)."""

    def __init__(self, moe, s, seen: dict):
        super().__init__(moe, seen)
        self.groups, self.topk_group, self.k = s.n_group, s.topk_group, s.num_experts_per_tok
        self.norm_topk_prob, self.scaling = s.norm_topk_prob, s.routed_scaling_factor
        self.bias = param(moe.gate.e_score_correction_bias, seen)

    def route(self, x):
        """x [T, H] -> expert ids [T, k], their weights [T, k]."""
        E = len(self.experts)
        scores = F.linear(x, self.router).sigmoid()  # [T, E]
        choice = scores + self.bias
        groups = choice.reshape(-1, self.groups, E // self.groups).topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(groups).scatter(1, groups.topk(self.topk_group, dim=-1).indices, 1.0) > 0
        keep = keep[:, :, None].expand(-1, -1, E // self.groups).reshape(-1, E)
        ids = choice.masked_fill(~keep, float("-inf")).topk(self.k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


def _two_rows(f, x):
    """f(x) for x [T, ...] computed over x and one row of zeros, the extra row dropped: ONNX Runtime
    takes another path for a batched (3-D) product of one row, whose last bits differ from the same
    row's in a longer one, so a row's result would depend on how many rows share its call. (Its 2-D
    products, every linear layer and expert here, give the same bits at any row count.)"""
    return f(torch.cat([x, x.new_zeros((1, *x.shape[1:]))]))[: x.shape[0]]
