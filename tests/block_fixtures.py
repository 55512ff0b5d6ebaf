"""Canonical block drafter dirs (docs/format.md) with random weights, built in code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from specpack.runtime.drafters.block_spec import block_spec_from_config, block_tensor_shapes

H, HEADS, KV, HD, INTER = 64, 4, 2, 16, 128
LAYER_IDS = (1, 3, 5)  # input of layers 1, 3, 5 of the 6-layer tiny targets


def block_config(target_cfg: dict, algorithm: str = "dflash", layout: str = "fill_in", block_size: int = 4,
                 layers: int = 2, layer_ids=LAYER_IDS, draft_vocab: int | None = None, **over) -> dict:
    """A canonical config for a tiny target (transformers config dict). `over` replaces any field."""
    Vt = target_cfg["vocab_size"]
    cfg = {"kind": "block", "algorithm": algorithm, "query_layout": layout, "block_size": block_size,
           "draft_slots": block_size - 1 if layout == "fill_in" else block_size,
           "hidden_size": H, "intermediate_size": INTER, "num_layers": layers, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "head_dim": HD, "rms_norm_eps": 1e-6, "attention_bias": False,
           "hidden_act": "silu", "target_hidden_size": target_cfg["hidden_size"], "target_layer_ids": list(layer_ids),
           "target_layer_convention": "input_of_layer", "source_target_layer_ids": [i - 1 for i in layer_ids],
           "source_convention": "output_of_layer", "vocab_size": Vt, "target_vocab_size": Vt,
           "draft_vocab_size": draft_vocab or Vt, "mask_token_id": Vt - 1, "mask_embedding": False,
           "embedding": "target", "lm_head": "target" if not draft_vocab else "drafter", "rope_theta": 10000.0,
           "rope_scaling": None, "rope_style": "neox", "layer_causal": [False] * layers,
           "sliding_window": [None] * layers, "logit_scale": None, "markov": None, "confidence": None,
           "lilicorr": None, "conv": None}
    if algorithm == "dspark":
        cfg.update(markov={"rank": 16, "type": "vanilla"}, confidence={"with_markov": True})
    if algorithm == "lilicorr":
        cfg["lilicorr"] = {"candidate_topk": 4, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "mlp_ratio": 2.0,
                           "factor_dim": 16, "vector_eps": 1e-6, "logit_scale": 8.0}
    return {**cfg, **over}


def random_weights(cfg: dict, seed: int = 0) -> dict:
    """Every tensor the config implies, with O(1) activations (std 1/sqrt(fan_in)); the head's
    logits scaled up so its distributions are peaked; d2t a random sorted subset of the target vocab."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in block_tensor_shapes(block_spec_from_config(cfg)).items():
        weights[name] = _random(name, shape, g)
    if "d2t" in weights:
        Vd = cfg["draft_vocab_size"]
        ids = torch.randperm(cfg["target_vocab_size"], generator=g)[:Vd].sort().values
        weights["d2t"] = ids - torch.arange(Vd)
    return weights


def _random(name: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":  # RMSNorm / LayerNorm scales
        return 1 + 0.1 * torch.randn(shape, generator=g)
    if leaf in ("bias", "in_proj_bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith("slot_bias"):  # LiLiCorr's attention biases by slot distance
        return torch.randn(shape, generator=g)
    if name in ("embed_tokens.weight", "markov_head.markov_w1.weight") or len(shape) != 2:
        return torch.randn(shape, generator=g)  # tables, mask embedding, slot / rank embeddings
    scale = 4.0 if name == "lm_head.weight" else 1.0
    return torch.randn(shape, generator=g) * scale / math.sqrt(shape[1])


def write_block(out: Path, cfg: dict, weights: dict) -> Path:
    """A canonical drafter dir: config.json + model.safetensors."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def random_block(out: Path, target_cfg: dict, seed: int = 0, **over) -> Path:
    cfg = block_config(target_cfg, **over)
    return write_block(out, cfg, random_weights(cfg, seed))


def load_head(head_dir: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    return load_file(str(head_dir / "model.safetensors")), json.loads((head_dir / "config.json").read_text())
