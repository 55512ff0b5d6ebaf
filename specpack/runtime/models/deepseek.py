"""Our DeepSeek-V3-style decoder: MLA attention (q/kv LoRA, decoupled RoPE, YaRN) and MoE layers
(shared experts, sigmoid + bias grouped top-k router), the first `first_k_dense_replace` layers dense.

Same interface as `model.Transformer`: `setup_cache(max_len)`, then `forward` over T new tokens with an
explicit mask and aux capture, so the speculative loop runs unchanged. The KV cache holds MLA's
compressed latent (kv_lora_rank + rope dims per token, shared by all heads); attention runs on it
directly by absorbing kv_b_proj's key half into the queries and its value half into the output
(the "weight absorption" of DeepSeek-V2 §2.1.2). Logits are checked against transformers'
`DeepseekV3ForCausalLM`.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpack.families.deepseek import DeepseekSpec
from specpack.runtime.models.dense import MLP, Decoder, KVCache, RMSNorm, apply_rope
from specpack.runtime.models.moe import Fp32Router, dispatch
from specpack.runtime.models.rows import Rows, attend

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: fixed eps in DeepSeek's code and transformers'


# ---- RoPE: YaRN as transformers' `_compute_yarn_parameters`, softmax scale as DeepSeek's ----

def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(s: DeepseekSpec) -> tuple[Tensor, float]:
    """(inv_freq [rope_dim/2] fp32, factor multiplying cos and sin)."""
    dim, base = s.qk_rope_head_dim, s.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    y = s.yarn
    if y is None:
        return 1.0 / pos_freqs, 1.0
    attention_factor = y.attention_factor
    if attention_factor is None:
        attention_factor = (_yarn_mscale(y.factor, y.mscale) / _yarn_mscale(y.factor, y.mscale_all_dim)
                            if y.mscale and y.mscale_all_dim else _yarn_mscale(y.factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate (divide by factor)
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(s: DeepseekSpec) -> float:
    scale = (s.qk_nope_head_dim + s.qk_rope_head_dim) ** -0.5
    if s.yarn is not None and s.yarn.mscale_all_dim:
        scale *= _yarn_mscale(s.yarn.factor, s.yarn.mscale_all_dim) ** 2
    return scale


def _deinterleave(x: Tensor) -> Tensor:
    """DeepSeek's rope dims come as pairs (x0, x1), (x2, x3)...: regroup them as halves for apply_rope."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


# ---- modules ----

class LatentCache(KVCache):
    """MLA's cache: per layer, slot and token the normed latent c_kv [kv_lora_rank] and the roped
    k_pe [rope_dim], stored together as `k`: [layers, slots, 1, max_len, r + rope]. No separate
    values (`v` is None): the values are the latent itself."""

    def __init__(self, layers: int, width: int, max_len: int, dtype, device, slots: int = 1):
        nn.Module.__init__(self)
        self.register_buffer("k", torch.zeros(layers, slots, 1, max_len, width, dtype=dtype, device=device),
                             persistent=False)
        self.v = None
        self.length = 0


class Weight(nn.Module):
    """A matrix read whole, never applied as a layer: not an nn.Linear, so `use_cpu_kernels` leaves
    it unpacked (it packs every fp32 CPU nn.Linear into panels that only its kernel can read)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MLA(nn.Module):
    """Multi-head latent attention with transformers' parameter names."""

    def __init__(self, s: DeepseekSpec):
        super().__init__()
        self.s, H, n = s, s.hidden_size, s.num_heads
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank:
            self.q_a_proj = nn.Linear(H, s.q_lora_rank, bias=s.attention_bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(s.q_lora_rank, n * qk, bias=False)
        else:
            self.q_proj = nn.Linear(H, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, s.kv_lora_rank + s.qk_rope_head_dim, bias=s.attention_bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Weight(n * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)  # absorbed, see forward
        self.o_proj = nn.Linear(n * s.v_head_dim, H, bias=s.attention_bias)
        self.scale = softmax_scale(s)
        self.heads: list[tuple] | None = None  # the absorbed products per head on the packed kernel

    def pack_products(self) -> None:
        """Run the absorbed products on the packed kernel, one layer per head, as exact as the weight
        (its rows' bits then do not depend on the batch, as every nn.Linear's under the kernel)."""
        from specpack.runtime.kernels.accelerate import pack_exact

        n, nope = self.s.num_heads, self.s.qk_nope_head_dim
        w = self.kv_b_proj.weight.view(n, nope + self.s.v_head_dim, -1)
        self.heads = [(pack_exact(w[h, :nope].T), pack_exact(w[h, nope:])) for h in range(n)]

    def _absorbed(self, x: Tensor, which: int, w: Tensor) -> Tensor:
        """x [R, n, in] through each head's absorbed product `w` [n, out, in] -> [R, n, out]."""
        if self.heads is None:
            return torch.einsum("tni,noi->tno", x, w)
        return torch.stack([pair[which](x[:, h]) for h, pair in enumerate(self.heads)], 1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Tensor, rows: Rows) -> Tensor:
        # x: [R, H]; cos, sin: [R, 1, rope]; cache: [slots, 1, max_len, r + rope] (this layer's slice)
        s, R, n = self.s, x.shape[0], self.s.num_heads
        nope, rope, r, v = s.qk_nope_head_dim, s.qk_rope_head_dim, s.kv_lora_rank, s.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if s.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(R, n, nope + rope).split([nope, rope], -1)  # [R, n, nope], [R, n, rope]
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([r, rope], -1)  # [R, r], [R, rope]
        if s.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe[:, None], cos, sin)[:, 0]
        cache[rows.slot, 0, rows.write] = torch.cat([self.kv_a_layernorm(c_kv), k_pe], -1)
        w = self.kv_b_proj.weight.view(n, nope + v, r)
        q_latent = self._absorbed(q_nope, 0, w[:, :nope].transpose(1, 2))  # [R, n, r]: q_nope · W_UK
        query = torch.cat([q_latent, q_pe], -1)  # [R, n, r + rope]
        # one latent "head" shared by all query heads: keys are the whole entry, values its latent part
        y = attend(query, cache, cache, rows, scale=self.scale, dv=r)  # [R, n, r]
        out = self._absorbed(y, 1, w[:, nope:])  # [R, n, v]: latent · W_UV
        return self.o_proj(out.reshape(R, n * v))


class Router(Fp32Router):
    """V3 router: sigmoid scores; top-2-sum group scores pick `topk_group` groups; the bias-corrected
    scores pick experts inside them; the uncorrected scores weight them. Runs in fp32."""

    def __init__(self, s: DeepseekSpec):
        super().__init__()
        self.s = s
        self.weight = nn.Parameter(torch.zeros(s.n_routed_experts, s.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(s.n_routed_experts))
        self.packed = None  # the scores' product on the packed kernel

    def pack_products(self) -> None:
        """Score on the packed kernel at the weight's own precision (never the model's narrower
        format: routing decides which experts run), row-exact as every other product."""
        from specpack.runtime.kernels.accelerate import pack_exact

        self.packed = pack_exact(self.weight)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        # x: [T, H] -> expert ids [T, k], weights [T, k] (fp32)
        s, T = self.s, x.shape[0]
        x = x.float()
        scores = _sigmoid_by_row(F.linear(x, self.weight.float()) if self.packed is None else self.packed(x))  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(T, s.n_group, -1).topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(s.topk_group, dim=-1, sorted=False).indices, 1)
        keep = keep.bool()[:, :, None].expand(T, s.n_group, s.n_routed_experts // s.n_group).reshape(T, -1)
        ids = choice.masked_fill(~keep, float("-inf")).topk(s.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * s.routed_scaling_factor


def _sigmoid_by_row(x: Tensor) -> Tensor:
    """x.sigmoid() whose every row has the same bits whatever the other rows: torch's CPU loop runs
    a flat tensor in chunks of two vectors and finishes the remainder with the scalar function,
    whose last bits differ, so a width that is not a multiple of the chunk (8 experts) would leave a
    row's bits to its place in the batch. Widths padded to a multiple of 64 fill whole chunks."""
    pad = -x.shape[-1] % 64
    return F.pad(x, (0, pad)).sigmoid()[..., : x.shape[-1]] if pad else x.sigmoid()


class MoE(nn.Module):
    def __init__(self, s: DeepseekSpec):
        super().__init__()
        self.gate = Router(s)
        self.experts = nn.ModuleList(MLP(s.hidden_size, s.moe_intermediate_size) for _ in range(s.n_routed_experts))
        self.shared_experts = MLP(s.hidden_size, s.moe_intermediate_size * s.n_shared_experts) \
            if s.n_shared_experts else None

    def forward(self, x: Tensor) -> Tensor:
        out = dispatch(x, *self.gate(x), self.experts)
        return out + self.shared_experts(x) if self.shared_experts is not None else out


class DeepseekBlock(nn.Module):
    """A decoder layer. Same call as `model.Block`; `v_cache` is unused (MLA caches one latent)."""

    def __init__(self, s: DeepseekSpec, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = MLA(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MoE(s) if moe else MLP(s.hidden_size, s.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, rows: Rows):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekTransformer(Decoder):
    """The DeepSeek-V3-style target. Call `setup_cache(max_len)` before `forward`."""

    def __init__(self, spec: DeepseekSpec):
        super().__init__(spec)
        self.layers = nn.ModuleList(DeepseekBlock(spec, spec.is_moe(i)) for i in range(spec.num_layers))

    def new_cache(self, layers: int, max_len: int, slots: int = 1) -> LatentCache:
        s = self.spec
        return LatentCache(layers, s.kv_lora_rank + s.qk_rope_head_dim, max_len, self.dtype, self.device, slots)

    def _rope_tables(self, max_len: int) -> tuple[Tensor, Tensor]:
        inv_freq, factor = rope_parameters(self.spec)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], -1)  # [S, rope]
        return (emb.cos() * factor).to(self.device, self.dtype), (emb.sin() * factor).to(self.device, self.dtype)

    def _layer(self, i: int, layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, rows: Rows) -> Tensor:
        return layer(x, cos, sin, self.cache.k[i], None, rows)


# ---- loading ----

def layer_state(t: dict[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
    """One layer's tensors `src*` (published names) as our parameters `dst*`: every gate/up pair
    (dense MLP, each expert, shared experts) fused into one `gate_up_proj`; the rest renamed only."""
    out = {}
    for name, value in t.items():
        if not name.startswith(src) or name.endswith("up_proj.weight"):
            continue
        rel = name[len(src):]
        if rel.endswith("gate_proj.weight"):
            base = rel[: -len("gate_proj.weight")]
            out[dst + base + "gate_up_proj.weight"] = torch.cat([value, t[src + base + "up_proj.weight"]])
        else:
            out[dst + rel] = value
    return out
