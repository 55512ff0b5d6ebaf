"""EAGLE-3 heads written in each published layout, with the exact published key names."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LAYER_KEYS = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + \
    [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")] + \
    [f"{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]


def random_head(cfg, draft_vocab: int | None = None, seed: int = 0, n_aux: int = 3) -> dict:
    """Canonical-named tensors of a random head for target config `cfg` (a transformers config)."""
    g = torch.Generator().manual_seed(seed)
    h, vt = cfg.hidden_size, cfg.vocab_size
    vd = draft_vocab or vt
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    inter = cfg.intermediate_size

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    t = {"fc.weight": w(h, n_aux * h), "norm.weight": 1 + w(h), "lm_head.weight": w(vd, h),
         "layers.0.self_attn.q_proj.weight": w(heads * hd, 2 * h),
         "layers.0.self_attn.k_proj.weight": w(kv * hd, 2 * h),
         "layers.0.self_attn.v_proj.weight": w(kv * hd, 2 * h),
         "layers.0.self_attn.o_proj.weight": w(h, heads * hd),
         "layers.0.mlp.gate_proj.weight": w(inter, h), "layers.0.mlp.up_proj.weight": w(inter, h),
         "layers.0.mlp.down_proj.weight": w(h, inter)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"layers.0.{n}.weight"] = 1 + w(h)
    if vd < vt:
        target_ids = torch.randperm(vt, generator=g)[:vd].sort().values
        t["d2t"] = target_ids - torch.arange(vd)
        t["t2d"] = torch.zeros(vt, dtype=torch.bool)
        t["t2d"][target_ids] = True
    return t


def _llama_config(cfg, vd: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "num_hidden_layers": 1,
            "vocab_size": cfg.vocab_size, "draft_vocab_size": vd, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu",
            "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


def _official_names(t: dict) -> dict:
    return {(k.replace("layers.0.", "midlayer.") if k.startswith("layers.0.") else k): v
            for k, v in t.items()}


def write_official(out: Path, t: dict, cfg) -> Path:
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B style: flat Llama config + pytorch_model.bin."""
    out.mkdir(parents=True, exist_ok=True)
    vd = t["lm_head.weight"].shape[0]
    (out / "config.json").write_text(json.dumps(_llama_config(cfg, vd), indent=2))
    torch.save(_official_names(t), out / "pytorch_model.bin")
    return out


def write_sglang(out: Path, t: dict, cfg, embed: torch.Tensor | None = None,
                 aux_ids: list[int] | None = None) -> Path:
    """SGLang / SpecForge: LlamaForCausalLMEagle3, safetensors, midlayer names, embed copy."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**_llama_config(cfg, t["lm_head.weight"].shape[0]),
              "architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": cfg.hidden_size}
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = _official_names(t)
    if embed is not None:
        tensors["embed_tokens.weight"] = embed.clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out


def write_narrow(out: Path, cfg, hidden: int, embed: bool = False, seed: int = 0) -> Path:
    """An SGLang-layout head of width `hidden` for a wider target `cfg` (same attention heads and head
    dim, `fc` over three target-width states), with an embedding of its own [V, hidden] when `embed`."""
    narrow = copy.deepcopy(cfg)
    narrow.hidden_size = hidden
    narrow.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    t = random_head(narrow, 256, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t["fc.weight"] = torch.randn(hidden, 3 * cfg.hidden_size, generator=g) * 0.05
    own = torch.randn(cfg.vocab_size, hidden, generator=g) * 0.05 if embed else None
    path = write_sglang(out, t, narrow, embed=own)
    config = json.loads((path / "config.json").read_text())
    config.update(target_hidden_size=cfg.hidden_size, head_dim=narrow.head_dim)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def modelopt_names(t: dict) -> dict:
    rename = {"layers.0.hidden_norm.weight": "hidden_norm.weight",
              "layers.0.input_layernorm.weight": "input_embeds_norm.weight",
              "lm_head.weight": "eagle_lm_head.weight"}
    return {rename.get(k, k): v for k, v in t.items() if k != "t2d"}


def write_modelopt(out: Path, t: dict, cfg, aux_ids: list[int] | None = None) -> Path:
    """ModelOpt HF export: model.safetensors, layers.0.*, input_embeds_norm, eagle_lm_head, no t2d."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**_llama_config(cfg, t["lm_head.weight"].shape[0]),
              "architectures": ["LlamaForCausalLMEagle3"],
              "eagle_config": {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                               "use_last_layernorm": True, "use_mtp_layernorm": False}}
    if aux_ids is not None:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux_ids
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in modelopt_names(t).items()}, out / "model.safetensors")
    return out


WRITERS = {"eagle3-official": write_official, "eagle3-sglang": write_sglang,
           "eagle3-modelopt": write_modelopt}
