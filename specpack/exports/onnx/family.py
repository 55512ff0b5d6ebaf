"""Which graph module family builds a target's layers: above them both, so neither imports it back."""

from __future__ import annotations

from specpack.exports.onnx import deepseek, dense
from specpack.runtime.models.deepseek import DeepseekSpec


def of(spec):
    """The graph module family of a target spec: `deepseek` (MLA + MoE) or `dense` (Llama and kin)."""
    return deepseek if isinstance(spec, DeepseekSpec) else dense
