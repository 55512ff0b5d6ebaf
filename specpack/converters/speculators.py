"""EAGLE-3 heads in the vLLM speculators layout → the canonical EAGLE-3 head (converters/eagle3.py).

Speculators configs nest the head's decoder config (`transformer_layer_config`, written with
transformers' `to_diff_dict`, so fields equal to LlamaConfig's defaults may be absent) and name the
target they were trained for in `speculators_config.verifier`. Weights already use the canonical
names (`layers.0.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, optional `embed_tokens`). Aux layer ids
count "input of layer i", as in vLLM (default 2, L/2, L-3).
"""

from __future__ import annotations

import re
from pathlib import Path

from specpack.converters import eagle3
from specpack.converters.base import AuxOverride, ConvertedDrafter
from specpack.converters.target_hf import Target, read_config
from specpack.schemas import MadeFor, Source

KIND = "eagle3"
LAYOUT = "eagle3-speculators"
ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# the LlamaConfig defaults `to_diff_dict` leaves out (transformers LlamaConfig)
_LLAMA_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
                   "rms_norm_eps": 1e-6, "vocab_size": 32000, "rope_theta": 10000.0, "attention_bias": False,
                   "mlp_bias": False}


def detect(path: Path) -> str | None:
    """'eagle3-speculators' when `path` holds a speculators config, else None."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return None
    config = read_config(path / "config.json")
    archs = set(config.get("architectures") or [])
    return LAYOUT if "speculators_model_type" in config or archs & set(ARCHITECTURES) else None


def convert(path: Path, target: Target, aux: AuxOverride | None = None,
            source: Source | None = None, allow_mismatch: bool = False) -> ConvertedDrafter:
    """Check the speculators head at `path` (and that its verifier is `target`), then canonicalise it."""
    path = Path(path)
    config = read_config(path / "config.json")
    made_for, problems = verifier_statements(config, target)
    return eagle3.convert_tensors(LAYOUT, flat_config(config), eagle3.load_tensors(path), target, aux,
                                  source or Source.local(path), path, _unsupported(config) + problems,
                                  made_for, allow_mismatch)


def flat_config(config: dict) -> dict:
    """The head's config as the other EAGLE-3 layouts write it: the nested layer config (defaults
    restored, RoPE as rope_theta + rope_scaling) with the speculator's own fields on top."""
    layer = {**_LLAMA_DEFAULTS, **(config.get("transformer_layer_config") or {})}
    rope = layer.get("rope_parameters") or {}
    if rope:
        layer["rope_theta"] = rope.get("rope_theta", layer["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            layer["rope_scaling"] = rope
    flat = {**layer, "draft_vocab_size": config.get("draft_vocab_size") or layer["vocab_size"],
            "norm_before_residual": bool(config.get("norm_before_residual", False))}
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids", "quantization_config"):
        if config.get(key) is not None:
            flat[key] = config[key]
    return flat


def _unsupported(config: dict) -> list[str]:
    layer = config.get("transformer_layer_config") or {}
    checks = [
        (config.get("speculators_model_type", "eagle3") != "eagle3",
         f"speculators_model_type {config.get('speculators_model_type')!r} (only 'eagle3')"),
        (layer.get("model_type", "llama") != "llama",
         f"transformer_layer_config.model_type {layer.get('model_type')!r}: the canonical head is a Llama layer"),
        (int(layer.get("num_hidden_layers", 1)) != 1,
         f"{layer.get('num_hidden_layers')} decoder layers in the head (only 1)"),
        (bool(config.get("norm_before_fc")), "norm_before_fc (an input norm over the fused features)"),
        (bool(layer.get("attention_bias")) or bool(layer.get("mlp_bias")), "attention or MLP biases in the head")]
    return [f"unsupported: {text}" for bad, text in checks if bad]


def verifier_statements(config: dict, target: Target) -> tuple[list[MadeFor], list[str]]:
    """What the head's `speculators_config.verifier` states about the target it was trained for, each
    against this target (architectures: a list of names, compared exactly; hub id when it names one:
    the target's hub source, else its config's `_name_or_path`, else unchecked), and the problems of a
    head that states none or states them with the wrong types."""
    verifier = (config.get("speculators_config") or {}).get("verifier")
    if not isinstance(verifier, dict):
        return [], ["speculators_config.verifier is missing: nothing says which target the head was trained for"]
    where = "speculators_config.verifier."
    archs, name = verifier.get("architectures"), verifier.get("name_or_path")
    bad = [f"{where}architectures = {str(archs)[:80]}: not a list of architecture names"] \
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)) else []
    bad += [f"{where}name_or_path = {str(name)[:80]}: not a string"] if name is not None and not isinstance(name, str) \
        else []
    if bad:
        return [], bad
    out = [MadeFor(stated_in=where + "architectures", value=archs, target=target.info.architecture,
                   matches=target.info.architecture in archs)]
    mine = _target_name(target)
    if name and _HUB_ID.match(name):
        out.append(MadeFor(stated_in=where + "name_or_path", value=name, target=mine,
                           matches=None if mine is None else name.lower() == mine.lower()))
    return out, []


def _target_name(target: Target) -> str | None:
    if target.info.source.kind == "hub" and target.info.source.repo_id:
        return target.info.source.repo_id
    name = target.files_reader.json("config.json", "target config").get("_name_or_path")
    return name if name and _HUB_ID.match(str(name)) else None
