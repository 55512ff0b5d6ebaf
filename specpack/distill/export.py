"""Write a trained head in a published layout, which `specpack build --drafter` imports.

EAGLE-3: the SGLang / SpecForge layout
    config.json         LlamaForCausalLMEagle3, flat Llama fields + draft_vocab_size, target_hidden_size,
                        eagle_config.eagle_aux_hidden_state_layer_ids (counted as *output* of layer i,
                        SGLang's convention: our input-of-layer ids minus one)
    model.safetensors   fc, midlayer.*, norm, lm_head, d2t (int64), t2d (bool)
DSpark: DeepSpec's `Qwen3DSparkModel` (deepspec/modeling/dspark/qwen3/config.py @ afdfa7c: the
target's geometry + block_size, target_layer_ids counted as *output* of layer i, mask_token_id,
num_anchors, markov_rank / markov_head_type, enable_confidence_head, confidence_head_with_markov),
with vLLM's reduced-vocabulary fields (draft_vocab_size, d2t: qwen3_dspark.py @ 0302ff40)
    model.safetensors   fc, hidden_norm, layers.*, norm, lm_head, markov_head.*, confidence_head.proj.*, d2t
                        (no embed_tokens: the target's is shared, as vLLM does when it is absent)
Both: training.json     how it was trained: target, data, vocab, options, time, figures
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specpack._atomic import save_safetensors
from specpack.distill.dspark import DSparkConfig
from specpack.distill.head import HeadConfig
from specpack.distill.vocab import DraftVocab

CONFIG, WEIGHTS, RECORD = "config.json", "model.safetensors", "training.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def sglang_config(c: HeadConfig, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": None, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.target_vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size, "tie_word_embeddings": False, "torch_dtype": dtype,
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layer_ids],
                         "use_aux_hidden_state": True},
    }


def sglang_tensors(state: dict, vocab: DraftVocab, dtype: str) -> dict:
    """Canonical names (layers.0.*) -> SGLang's (midlayer.*), floats cast to `dtype`."""
    out = {}
    for name, t in state.items():
        out[name.replace("layers.0.", "midlayer.", 1)] = t.detach().to(DTYPES[dtype]).contiguous()
    out["d2t"], out["t2d"] = vocab.d2t.contiguous(), vocab.t2d
    return out


def write_head(out: Path, c: HeadConfig, state: dict, vocab: DraftVocab, record: dict, dtype: str) -> None:
    """An EAGLE-3 head in the SGLang layout."""
    _write(out, sglang_tensors(state, vocab, dtype), sglang_config(c, dtype), record)


def deepspec_config(c: DSparkConfig, dtype: str, anchors: int) -> dict:
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "num_hidden_layers": c.num_layers, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": None, "max_position_embeddings": c.max_position_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "layer_types": ["full_attention"] * c.num_layers,
        "vocab_size": c.target_vocab_size, "draft_vocab_size": c.draft_vocab_size, "torch_dtype": dtype,
        "num_target_layers": c.num_target_layers, "target_layer_ids": [i - 1 for i in c.aux_layer_ids],
        "block_size": c.block_size, "sample_from_anchor": True, "mask_token_id": c.mask_token_id,
        "num_anchors": anchors, "markov_rank": c.markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
    }


def write_dspark(out: Path, c: DSparkConfig, state: dict, vocab: DraftVocab, record: dict, dtype: str,
                 anchors: int) -> None:
    """A DSpark head in DeepSpec's layout (plus d2t for the reduced vocabulary)."""
    tensors = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in state.items()}
    tensors["d2t"] = vocab.d2t.contiguous()
    _write(out, tensors, deepspec_config(c, dtype, anchors), record)


def _write(out: Path, tensors: dict, config: dict, record: dict) -> None:
    """Weights, config and record; each lands by rename, so a reader never sees a half-written one."""

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    save_safetensors(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    _write_json(out / CONFIG, config)
    _write_json(out / RECORD, record)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
