"""The target step graph, for every target family (and a draft model's, which is the same graph)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specpack.exports.onnx import family as graph_family
from specpack.exports.onnx.layers import Batch, Graph, Rope, batch_inputs, cache_io, linear_params, param, rms


class TargetStep(nn.Module):
    """The target over T new tokens of B sequences (`layers.Batch`) with the whole cache passed in
    and the new slots returned (fp32).

    Outputs logits [K, V]; `aux` [T, n_aux*H] (the hidden states entering the `capture` layers) when
    there are any; `hidden` [T, H] when asked for, the state an MTP drafter reads: leaving the last
    layer ("last_layer_output") or after the final norm ("final_norm_output"); then the new slots."""

    def __init__(self, model, capture: Sequence[int] = (), hidden: str | None = None):
        super().__init__()
        s, seen, fam = model.spec, {}, graph_family.of(model.spec)
        self.capture, self.hidden, self.eps = tuple(capture), hidden, s.rms_norm_eps
        self.per_layer = len(fam.cache(s).names)
        self.embed = param(model.embed_tokens.weight, seen)
        self.layers = nn.ModuleList(fam.block(b, s, seen) for b in model.layers)
        self.norm = param(model.norm.weight, seen)
        self.lm_head = param(linear_params(model.lm_head)[0], seen)
        self.rope = Rope(*fam.rope_parameters(s))

    def forward(self, tokens, positions, logits_index, seq_rows, row_place, past_index, mask, *past):
        batch = Batch(seq_rows, row_place, past_index, mask)
        cos, sin = self.rope(positions)
        x = F.embedding(tokens, self.embed)  # [T, H]
        aux, new, n = [], [], self.per_layer
        for i, layer in enumerate(self.layers):
            if i in self.capture:
                aux.append(x)
            x, slots = layer(x, cos, sin, batch, past[n * i : n * (i + 1)])
            new += slots
        normed = rms(x, self.norm, self.eps)  # per row: the same for the selected rows as for all
        extra = [torch.cat(aux, dim=-1)] if aux else []
        if self.hidden is not None:
            extra.append(normed if self.hidden == "final_norm_output" else x)
        return (F.linear(normed.index_select(0, logits_index), self.lm_head), *extra, *new)


def target_io(s, aux: Sequence[int] = (), hidden: str | None = None) -> tuple[list[tuple], list[tuple]]:
    """(inputs, outputs) of the target step graph as (name, dtype, shape) with symbolic dims."""
    slot = graph_family.of(s).cache(s)
    outputs = [("logits", "float32", ["K", s.vocab_size])]
    if aux:
        outputs.append(("aux", "float32", ["T", len(aux) * s.hidden_size]))
    if hidden is not None:
        outputs.append(("hidden", "float32", ["T", s.hidden_size]))
    return (batch_inputs() + cache_io("past", s.num_layers, slot, "N"),
            outputs + cache_io("new", s.num_layers, slot, "T"))


def graph(model, aux: Sequence[int] = (), hidden: str | None = None) -> Graph:
    """The target's step graph."""
    s = model.spec
    return Graph("target.onnx", "target_step", TargetStep(model, aux, hidden), target_io(s, aux, hidden), s.num_layers)


def draft_graphs(drafter) -> list[Graph]:
    """A draft model's own target step graph (no aux)."""
    s = drafter.model.spec
    return [Graph("draft_model.onnx", "draft_model_step", TargetStep(drafter.model), target_io(s), s.num_layers)]
