"""MTP step graphs: one per MTP layer, each with its own cache (the target family's: key and value,
or MLA's latent), run by `runtime.mtp.MtpDrafter.propose` unchanged through the graph backends.

Layer k over the T new rows of B sequences (`layers.Batch`, over its whole cache buffer, as the
target graph): `hidden` [T, H] (the target's state for layer 0, the previous layer's chain
output after) and `tokens` [T] (the tokens one step ahead) -> proj(cat(norm(embedding), norm(hidden)))
-> the target-style block over its cache -> final norm. Outputs `hidden_out` (handed to the next
step: before or after the final norm, per the drafter's config), `logits` of the `logits_index`
rows through the target's lm_head, and the new slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpack.exports.onnx import family as graph_family
from specpack.exports.onnx.layers import Batch, Graph, Rope, batch_inputs, cache_io, linear_params, param, rms


class MtpStep(nn.Module):
    def __init__(self, drafter, k: int):
        super().__init__()
        layer, target, seen = drafter.layers[k], drafter.target, {}
        ts, fam = target.spec, graph_family.of(target.spec)
        self.eps, self.embedding_first, self.chain_pre_norm = (layer.embed_norm.eps, layer.embedding_first,
                                                               layer.chain_pre_norm)
        self.embed = param(target.embed_tokens.weight, seen)
        self.embed_norm = param(layer.embed_norm.weight, seen)
        self.hidden_norm = param(layer.hidden_norm.weight, seen)
        self.proj = param(linear_params(layer.proj)[0], seen)
        self.block = fam.block(layer.block, ts, seen)
        self.final_norm = param(layer.final_norm.weight, seen)
        self.lm_head = param(linear_params(target.lm_head)[0], seen)
        self.rope = Rope(*fam.rope_parameters(ts))

    def forward(self, hidden, tokens, positions, logits_index, seq_rows, row_place, cache_rows, mask, *past):
        batch = Batch(seq_rows, row_place, cache_rows, mask)
        cos, sin = self.rope(positions)
        e = rms(F.embedding(tokens, self.embed), self.embed_norm, self.eps)
        h = rms(hidden, self.hidden_norm, self.eps)
        x = F.linear(torch.cat([e, h] if self.embedding_first else [h, e], dim=-1), self.proj)
        y, new = self.block(x, cos, sin, batch, past)
        normed = rms(y, self.final_norm, self.eps)
        logits = F.linear(normed.index_select(0, logits_index), self.lm_head)
        return (y if self.chain_pre_norm else normed), logits, *new


def mtp_io(target_spec) -> tuple[list[tuple], list[tuple]]:
    H, slot = target_spec.hidden_size, graph_family.of(target_spec).cache(target_spec)
    inputs = [("hidden", "float32", ["T", H])] + batch_inputs() + cache_io("past", 1, slot, "N", True)
    outputs = [("hidden_out", "float32", ["T", H]), ("logits", "float32", ["K", target_spec.vocab_size])]
    return inputs, outputs + cache_io("new", 1, slot, "T", True)


def graphs(drafter) -> list[Graph]:
    io = mtp_io(drafter.target.spec)
    return [Graph(f"mtp.{k}.onnx", "mtp_step", MtpStep(drafter, k), io, 1, layer=k)
            for k in range(drafter.spec.num_layers)]
