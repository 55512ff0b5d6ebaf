"""The heads a block drafter puts on its backbone's output: DSpark's Markov correction and
confidence head, and LiLiCorr's candidate lattice. Module and tensor names are the canonical ones.

Sources (read for this code):
- DSpark: deepseek-ai/DeepSpec @ afdfa7c9382a3341a3e6f17756dd816da79f132c,
  deepspec/modeling/dspark/markov_head.py (VanillaMarkov, GatedMarkovHead, RNNHead),
  deepspec/modeling/dspark/common.py (AcceptRatePredictor) and qwen3/modeling.py
  (predict_confidence_step: [hidden, markov_w1[prev]]); vllm-project/vllm
  vllm/model_executor/models/qwen3_dspark.py @ 0302ff40439493d0db2e3bbfd509211703375d08
  (markov_w1 over the input vocab in target ids, markov_w2 onto the draft vocab; the confidence
  projection in fp32, sigmoid = the per-position acceptance probability).
- LiLiCorr: vllm-project/vllm vllm/model_executor/models/lilicorr.py @
  08f95fe5616661c4f8547a46ebdaa1ed22736edb (LiLiCorrHead.score / forward) and sgl-project/sglang
  python/sglang/srt/models/lilicorr.py @ 085551a8ab14ae3bc807c5104c92436b1845f04d (the same head;
  every projection a biased linear, the MLPs up -> SiLU -> down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpack.runtime.drafters.block_spec import BlockSpec, LiLiCorrSpec
from specpack.runtime.models.dense import RMSNorm, embedding


class MarkovHead(nn.Module):
    """DSpark's sequential correction: step i adds markov_w2 · f(e_i) to the base logits, where
    e_i = markov_w1[prev_i] embeds the token before position i (the anchor, then each draft).
    f: vanilla e; gated σ(gate_proj[h_i, e_i]) ⊙ e_i; rnn tanh(o) of a GRU-like state s over
    [s, e_i, h_i] that starts at zero for every block."""

    def __init__(self, s: BlockSpec):
        super().__init__()
        r, H = s.markov.rank, s.hidden_size
        self.type = s.markov.type
        self.markov_w1 = embedding(s.vocab_size, r)
        self.markov_w2 = nn.Linear(r, s.draft_vocab_size, bias=False)
        if self.type == "gated":
            self.gate_proj = nn.Linear(H + r, r)
        elif self.type == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r)

    def step(self, prev: Tensor, h: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """prev [J] target ids, h [J, H] the positions' hidden states, state [J, r] (rnn) ->
        (e [J, r], bias [J, Vd], the next state)."""
        e = self.markov_w1(prev)
        if self.type == "gated":
            latent = torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e
        elif self.type == "rnn":
            state = torch.zeros_like(e) if state is None else state
            gate, candidate, out = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, -1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            latent = torch.tanh(out)
        else:
            latent = e
        return e, self.markov_w2(latent), state


class ConfidenceHead(nn.Module):
    """σ(proj([h_i, e_i])) (or σ(proj(h_i))): DSpark's estimate that draft position i is accepted
    given the positions before it were. Kept and run in fp32."""

    def __init__(self, s: BlockSpec):
        super().__init__()
        self.with_markov = bool(s.confidence_with_markov)
        self.proj = nn.Linear(s.hidden_size + (s.markov.rank if self.with_markov else 0), 1)

    def forward(self, h: Tensor, e: Tensor | None) -> Tensor:
        x = torch.cat([h, e], -1) if self.with_markov else h
        return torch.sigmoid(self.proj(x.float()).squeeze(-1))


class _MLP(nn.Module):
    """up -> SiLU -> down, both biased (vLLM NemotronHMLP with hidden_act silu; SGLang LiLiCorrMLP)."""

    def __init__(self, dim_in: int, hidden: int, dim_out: int):
        super().__init__()
        self.up_proj = nn.Linear(dim_in, hidden)
        self.down_proj = nn.Linear(hidden, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class _LatticeAttention(nn.Module):
    """nn.MultiheadAttention's parameter layout, with an additive per-head bias and no mask."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        # x: [J, L, h]; bias: [1, heads, L, L]
        J, L, h = x.shape
        q, k, v = (t.view(J, L, self.heads, h // self.heads).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # [J, heads, L, h/heads]
        return self.out_proj(out.transpose(1, 2).reshape(J, L, h))


class _LatticeLayer(nn.Module):
    def __init__(self, c: LiLiCorrSpec, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, eps)
        self.attn = _LatticeAttention(c.hidden_size, c.num_heads)
        self.mlp_norm = RMSNorm(c.hidden_size, eps)
        self.mlp = _MLP(c.hidden_size, c.mlp_size, c.hidden_size)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """Scores the top-k candidates of every slot jointly: the n·k candidates attend each other
    (per-head bias by slot distance), then each candidate gets unit out/in vectors and the anchor an
    out vector; score(anchor -> j in slot 0) and score(i in slot s -> j in slot s+1) are their
    scaled dot products. The draft log-probs enter only as features (vLLM adds no unary term)."""

    def __init__(self, s: BlockSpec):
        super().__init__()
        c, H = s.lilicorr, s.hidden_size
        h, k, self.block_size, self.spec = c.hidden_size, c.candidate_topk, s.block_size, c
        self.token_proj = nn.Linear(H, h) if h != H else None
        self.pass_hidden_proj = nn.Linear(H, h)
        self.context_proj = nn.Linear(H, h)
        self.feature_norm = nn.LayerNorm(5)
        self.feature_mlp = _MLP(5, h, h)
        self.slot_embedding = nn.Parameter(torch.empty(1, 1, s.block_size - 1, 1, h))
        self.rank_embedding = nn.Parameter(torch.empty(1, 1, 1, k, h))
        self.relative_slot_bias = nn.Parameter(torch.empty(c.num_heads, 2 * s.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.empty(c.num_heads))
        self.layers = nn.ModuleList(_LatticeLayer(c, s.rms_norm_eps) for _ in range(c.num_layers))
        self.output_norm = RMSNorm(h, s.rms_norm_eps)
        self.anchor_norm = RMSNorm(h, s.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head = nn.Linear(h, c.factor_dim)
        self.in_head = nn.Linear(h, c.factor_dim)
        self.anchor_out_head = nn.Linear(h, c.factor_dim)

    def forward(self, emb: Tensor, log_probs: Tensor, pass_hidden: Tensor, anchor: Tensor) -> Tensor:
        """emb [J, n, k, H] the candidates' target embeddings, log_probs [J, n, k] their draft
        log-probs (rank order), pass_hidden [J, n, H] the slots' backbone outputs, anchor [J, H]
        hidden_norm(fc(features)) of the row that predicted the anchor -> scores [J, n, k, k] fp32:
        row i of slot s scores slot s's candidates after candidate i of slot s-1 (slot 0: every
        row is the anchor's)."""
        J, n, k = log_probs.shape
        x = self._lattice(emb, log_probs, pass_hidden)  # [J, n, k, h]
        a = self.anchor_norm(self.context_proj(anchor))[:, None, None, :]  # [J, 1, 1, h]
        phi = F.silu(self.factor_input_proj(torch.cat([x, a.expand_as(x), x * a], -1)))
        eps = self.spec.vector_eps
        out = F.normalize(self.out_head(phi), dim=-1, eps=eps)
        into = F.normalize(self.in_head(phi), dim=-1, eps=eps)
        anchor_out = F.normalize(self.anchor_out_head(a[:, 0, 0]), dim=-1, eps=eps)  # [J, F]
        start = (anchor_out[:, None, :] * into[:, 0]).sum(-1)  # [J, k]
        pairs = out[:, :-1] @ into[:, 1:].transpose(-1, -2)  # [J, n-1, k, k]
        scores = torch.cat([start[:, None, None, :].expand(J, 1, k, k), pairs], 1)
        return self.spec.logit_scale * scores.float()

    def _lattice(self, emb: Tensor, log_probs: Tensor, pass_hidden: Tensor) -> Tensor:
        J, n, k = log_probs.shape
        x = emb if self.token_proj is None else self.token_proj(emb)
        x = x + self.pass_hidden_proj(pass_hidden)[:, :, None, :]
        lp = log_probs.float()
        rank = torch.arange(k, device=lp.device, dtype=torch.float32) / max(k - 1, 1)
        top1 = (torch.arange(k, device=lp.device) == 0).float()
        features = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values,
                                rank.expand_as(lp), top1.expand_as(lp)], -1)  # [J, n, k, 5]
        x = x + self.feature_mlp(self.feature_norm(features.to(x.dtype)))
        x = (x + self.slot_embedding[:, 0, :n] + self.rank_embedding[:, 0]).reshape(J, n * k, -1)
        bias = self._attention_bias(n, k).to(x.dtype)
        for layer in self.layers:
            x = layer(x, bias)
        return self.output_norm(x).view(J, n, k, -1)

    def _attention_bias(self, n: int, k: int) -> Tensor:
        """[1, heads, n·k, n·k]: relative_slot_bias[slot(q) - slot(k) + B - 1] + same_slot_bias on
        the diagonal slots (the trained offset B - 1 also for drafts shorter than the block)."""
        slot = torch.arange(n, device=self.same_slot_bias.device).repeat_interleave(k)
        rel = slot[:, None] - slot[None, :]
        bias = self.relative_slot_bias[:, rel + self.block_size - 1]
        return (bias + (rel == 0).to(bias.dtype) * self.same_slot_bias[:, None, None])[None]
