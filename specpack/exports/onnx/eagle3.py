"""The EAGLE-3 head's step graph: fc over target features, its one layer, norm and lm_head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpack.exports.onnx import dense
from specpack.exports.onnx.layers import MLP, Batch, Graph, Rope, batch_inputs, cache_io, linear_params, \
    param, rms


class Eagle3Step(nn.Module):
    """The head: fc over target features, its layer over cat(fc(feats), hidden), norm, lm_head; the
    rows of many sequences (`layers.Batch`) over the head's whole cache buffer, as the target graph."""

    def __init__(self, head):
        super().__init__()
        s, seen = head.spec, {}
        layer = head.layers[0]
        self.eps, self.norm_before_residual = s.rms_norm_eps, s.norm_before_residual
        self.fc = param(linear_params(head.fc)[0], seen)
        self.embed = param(head.embed_tokens.weight, seen)
        self.ln_in = param(layer.input_layernorm.weight, seen)
        self.ln_hidden = param(layer.hidden_norm.weight, seen)
        self.attn = dense.Attention(layer.self_attn, s.rms_norm_eps, seen)
        self.ln_post = param(layer.post_attention_layernorm.weight, seen)
        self.mlp = MLP(layer.mlp, seen)
        self.norm = param(head.norm.weight, seen)
        self.lm_head = param(linear_params(head.lm_head)[0], seen)
        self.rope = Rope(*dense.rope_parameters(s))

    def forward(self, feats, hidden, tokens, positions, logits_index, seq_rows, row_place, cache_rows, mask,
                past_k, past_v):
        batch = Batch(seq_rows, row_place, cache_rows, mask)
        cos, sin = self.rope(positions)
        h = torch.cat([F.linear(feats, self.fc), hidden], dim=0)  # [T, H]
        normed = rms(h, self.ln_hidden, self.eps)
        x = torch.cat([rms(F.embedding(tokens, self.embed), self.ln_in, self.eps), normed], dim=-1)
        a, (k, v) = self.attn(x, cos, sin, batch, (past_k, past_v))
        h = (normed if self.norm_before_residual else h) + a
        h = h + self.mlp(rms(h, self.ln_post, self.eps))
        logits = F.linear(rms(h.index_select(0, logits_index), self.norm, self.eps), self.lm_head)
        return h, logits, k, v


def eagle3_io(s) -> tuple[list[tuple], list[tuple]]:
    """feats [R, ...] and hidden [U, H] are the rows of T = R + U, in that order."""
    slot = dense.cache(s)
    inputs = [("feats", "float32", ["R", len(s.aux_layer_ids) * s.target_hidden_size]),
              ("hidden", "float32", ["U", s.hidden_size])] + batch_inputs()
    outputs = [("hidden_out", "float32", ["T", s.hidden_size]), ("logits", "float32", ["K", s.draft_vocab_size])]
    return inputs + cache_io("past", 1, slot, "N", True), outputs + cache_io("new", 1, slot, "T", True)


def graphs(head) -> list[Graph]:
    return [Graph("eagle3.onnx", "eagle3_step", Eagle3Step(head), eagle3_io(head.spec), 1)]
