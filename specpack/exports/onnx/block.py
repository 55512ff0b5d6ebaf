"""Block drafter graphs (DFlash, DSpark, LiLiCorr; runtime.drafters.block), run by
`BlockDrafter.draft` unchanged through the graph backends (backends.GraphBlock).

- `block_context`: the T newly committed positions of any number of sequences (rows are
  independent). Inputs `feats [T, F]` (the target features, `aux` of the target graph) and
  `positions [T]`; outputs `context [T, H]` = hidden_norm(fc(feats)) (LiLiCorr's anchor is a
  sequence's last row) and, per draft layer i, `new_key.{i}` / `new_value.{i}` [T, kv_heads,
  head_dim]: that layer's k_norm'd, roped keys and values of the context rows, which the runtime
  writes into each sequence's slots of the drafter's cache.
- `block_step`: the query blocks of B sequences, each [anchor, mask, ...] of `block_len` rows at its
  positions p..; inputs `tokens [T]`, `positions [T]` (T = B x block_len, sequence after
  sequence), `logits_index [K]` (the rows whose logits are wanted), `seq_rows [B, block_len]` (the
  rows of each block), `cache_rows [B, P]` (the cache buffer row of each sequence's committed
  positions, padded), `seen [B, P]` (False on the padding), then `past_key.{i}` / `past_value.{i}`
  [N, kv_heads, head_dim]: the whole buffer of every sequence slot. Every layer attends the
  sequence's context keys and its block itself (non-causally, or causally where `layer_causal`
  says so), as the target graph's attention (`layers.attend`). Outputs `hidden [T, H]`
  (final norm) and `logits [K, Vd]` (lm_head, before logit_scale); for LiLiCorr instead each row's
  top-k `candidates [K, k]` (target ids), `candidate_log_probs [K, k]` and `candidate_embeds
  [K, k, H]` (the target's embeddings). The blocks' own keys are scratch: nothing is written to
  the cache.

Why the heads stay on the host (BlockDrafter's own torch modules, fp32): DSpark's Markov
correction is sequential and interleaved with sampling (position q's bias embeds the token just
chosen at q-1 by the engine's keyed sampler) and its confidence reads the same pair; LiLiCorr's
walk is sequential too, over scores from a small correlator network (n·k candidates). In a graph
they would need one call per position or the sampler inside it; on the host they are the torch
drafter's code, so drafts agree by construction. The graphs keep what is large: the backbone, the
embedding and lm_head tables (the target's, usually) and, for LiLiCorr, the top-k over the vocab
and the candidates' embeddings, so the host never needs a copy of a vocabulary-sized table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpack.exports.onnx import dense
from specpack.exports.onnx.layers import (MLP, Batch, Block, Graph, Rope, attend, cache_io, linear_params,
                                                    param, rms)


class BlockAttention(dense.Attention):
    """The drafter's attention over the committed context and the query blocks (scratch keys)."""

    def forward(self, x, cos, sin, batch, past):
        past_k, past_v = past
        q, k, v = self.project(x, cos, sin)
        y = attend(q, k, v, past_k, past_v, batch)
        return F.linear(y, self.o_w, self.o_b), []


class BlockContext(nn.Module):
    """fc + hidden_norm over the new context rows, then each layer's keys and values of them
    (no input_layernorm: the context enters the attention projections as is)."""

    def __init__(self, drafter):
        super().__init__()
        s, seen = drafter.spec, {}
        self.eps = s.rms_norm_eps
        self.fc = param(linear_params(drafter.fc)[0], seen)
        self.hidden_norm = param(drafter.hidden_norm.weight, seen)
        self.attn = nn.ModuleList(dense.Attention(layer.self_attn, s.rms_norm_eps, seen) for layer in drafter.layers)
        self.rope = Rope(*dense.rope_parameters(s))

    def forward(self, feats, positions):
        cos, sin = self.rope(positions)
        ctx = rms(F.linear(feats, self.fc), self.hidden_norm, self.eps)  # [T, H]
        new = []
        for attn in self.attn:
            _, k, v = attn.project(ctx, cos, sin)
            new += [k, v]
        return (ctx, *new)


class BlockStep(nn.Module):
    """The query block through every draft layer, final norm, lm_head (and LiLiCorr's candidates)."""

    def __init__(self, drafter):
        super().__init__()
        s, seen = drafter.spec, {}
        self.eps, self.mask_token_id, self.causal = s.rms_norm_eps, s.mask_token_id, s.layer_causal
        self.embed = param(drafter.embed_tokens.weight, seen)
        self.mask_embedding = param(drafter.mask_embedding, seen)
        self.layers = nn.ModuleList(
            Block(layer, BlockAttention(layer.self_attn, s.rms_norm_eps, seen), MLP(layer.mlp, seen), s.rms_norm_eps,
                  seen) for layer in drafter.layers)
        self.norm = param(drafter.norm.weight, seen)
        self.lm_head = param(linear_params(drafter.lm_head)[0], seen)
        self.topk = s.lilicorr.candidate_topk if s.lilicorr is not None else None
        self.target_embed = param(drafter.target_embed.weight, seen) if self.topk else None
        self.rope = Rope(*dense.rope_parameters(s))

    def forward(self, tokens, positions, logits_index, seq_rows, cache_rows, seen, *past):
        cos, sin = self.rope(positions)
        x = F.embedding(tokens, self.embed)  # [T, H]
        if self.mask_embedding is not None:
            x = torch.where((tokens == self.mask_token_id)[:, None], self.mask_embedding, x)
        B, L = seq_rows.shape
        context = seen[:, None, :].expand(B, L, seen.shape[1])
        within = torch.ones(L, L, dtype=torch.bool).tril()  # the block, for causal layers
        masks = {causal: torch.cat([context, (within if causal else torch.ones_like(within)).expand(B, L, L)], -1)
                 for causal in set(self.causal)}
        row_place = seq_rows.reshape(-1)
        for i, layer in enumerate(self.layers):
            batch = Batch(seq_rows, row_place, cache_rows, masks[self.causal[i]])
            x, _ = layer(x, cos, sin, batch, past[2 * i : 2 * i + 2])
        h = rms(x, self.norm, self.eps)
        logits = F.linear(h.index_select(0, logits_index), self.lm_head)  # [K, Vd]
        if self.topk is None:
            return h, logits
        log_probs, candidates = logits.log_softmax(-1).topk(self.topk, -1)  # [K, k]
        return h, candidates, log_probs, F.embedding(candidates, self.target_embed)


def context_io(s) -> tuple[list[tuple], list[tuple]]:
    slot = dense.cache(s)
    inputs = [("feats", "float32", ["T", len(s.target_layer_ids) * s.target_hidden_size]),
              ("positions", "int64", ["T"])]
    return inputs, [("context", "float32", ["T", s.hidden_size])] + cache_io("new", s.num_layers, slot, "T")


def step_io(s) -> tuple[list[tuple], list[tuple]]:
    L, H = s.block_len, s.hidden_size
    inputs = [("tokens", "int64", ["T"]), ("positions", "int64", ["T"]), ("logits_index", "int64", ["K"]),
              ("seq_rows", "int64", ["B", L]), ("cache_rows", "int64", ["B", "P"]), ("seen", "bool", ["B", "P"])]
    outputs = [("hidden", "float32", ["T", H])]
    if s.lilicorr is None:
        outputs.append(("logits", "float32", ["K", s.draft_vocab_size]))
    else:
        k = s.lilicorr.candidate_topk
        outputs += [("candidates", "int64", ["K", k]), ("candidate_log_probs", "float32", ["K", k]),
                    ("candidate_embeds", "float32", ["K", k, H])]
    return inputs + cache_io("past", s.num_layers, dense.cache(s), "N"), outputs


def graphs(drafter) -> list[Graph]:
    s = drafter.spec
    return [Graph("block_context.onnx", "block_context", BlockContext(drafter), context_io(s), s.num_layers),
            Graph("block_step.onnx", "block_step", BlockStep(drafter), step_io(s), s.num_layers,
                  examples={"K": min(2, s.block_len), "B": 2, "T": 2 * s.block_len})]
