"""EAGLE-3 heads as llama.cpp writes them (a drafter GGUF, `general.architecture` "eagle3") → the
canonical EAGLE-3 head (converters/eagle3.py checks it against the target as any head).

    detect(path)                          -> "eagle3-llamacpp" or None (a .gguf file)
    convert(path, target, aux=None, ...)  -> ConvertedDrafter

Every name and key follows the llama.cpp the llama-cpp-python 0.3.36 sdist vendors
(LLAMACPP): `convert_hf_to_gguf.py` / `conversion/llama.py` (LlamaModel with `is_eagle3`) writes `fc`,
`enc.output_norm` (a head's `input_norm`, norm_before_fc), the one layer as `blk.0.*` with the head's
`hidden_norm` as `blk.0.attn_norm_2`, q/k rows permuted for rotary (LlamaModel.permute), `output_norm`,
`output` (the draft lm_head), optional `token_embd`, and `d2t` as absolute target token ids (I64);
metadata `eagle3.target_layers`, `eagle3.target_hidden_size`, `eagle3.norm_before_residual`,
`eagle3.norm_before_fc` (gguf-py constants.py). `common/speculative.cpp` extracts target layer i as the
*input* of layer i (`llama_set_embeddings_layer_inp`; i = n_layer: the final pre-norm state) and takes
exactly three: specpack's own convention, so the ids are kept as they are.
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters.base import AuxOverride, ConvertedDrafter
from specpack.converters.gguf import gguf_architecture, open_gguf
from specpack.errors import InputError, UnsupportedError
from specpack.schemas import Source

LAYOUT = "eagle3-llamacpp"
ARCH = "eagle3"
LLAMACPP = "llama.cpp vendored by llama-cpp-python 0.3.36"
# GGUF name -> canonical name (converters/eagle3.py)
NAMES = {"fc.weight": "fc.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight",
         "token_embd.weight": "embed_tokens.weight", "d2t": "d2t",
         "blk.0.attn_norm.weight": "layers.0.input_layernorm.weight",
         "blk.0.attn_norm_2.weight": "layers.0.hidden_norm.weight",
         "blk.0.ffn_norm.weight": "layers.0.post_attention_layernorm.weight",
         "blk.0.attn_q.weight": "layers.0.self_attn.q_proj.weight",
         "blk.0.attn_k.weight": "layers.0.self_attn.k_proj.weight",
         "blk.0.attn_v.weight": "layers.0.self_attn.v_proj.weight",
         "blk.0.attn_output.weight": "layers.0.self_attn.o_proj.weight",
         "blk.0.ffn_gate.weight": "layers.0.mlp.gate_proj.weight",
         "blk.0.ffn_up.weight": "layers.0.mlp.up_proj.weight",
         "blk.0.ffn_down.weight": "layers.0.mlp.down_proj.weight"}
FLOAT_TYPES = ("F32", "F16", "BF16", "Q8_0")  # what llama.cpp writes a head in (--outtype), all read exactly


def detect(path: Path) -> str | None:
    """LAYOUT for a llama.cpp EAGLE-3 drafter GGUF; None for any other file."""
    path = Path(path)
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    return LAYOUT if gguf_architecture(open_gguf(path)) == ARCH else None


def convert(path: Path, target, aux: AuxOverride | None = None, allow_mismatch: bool = False) -> ConvertedDrafter:
    """The head in `path`, in canonical names, checked against `target` by converters/eagle3.py."""
    from specpack.converters import eagle3

    path = Path(path)
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    if arch != ARCH:
        raise UnsupportedError(f"{path} is a llama.cpp '{arch}' GGUF, not an EAGLE-3 drafter",
                               hint="specpack reads llama.cpp's eagle3 drafter GGUFs (dflash and dspark ones not "
                                    "yet); a target GGUF goes through `specpack import-gguf`")
    config, problems = _config(reader, path)
    raw, tensor_problems = _tensors(reader, config)
    return eagle3.convert_tensors(LAYOUT, config, raw, target, aux, Source.local(path), path,
                                  problems=problems + tensor_problems, allow_mismatch=allow_mismatch)


def _config(reader, path: Path) -> tuple[dict, list[str]]:
    """A flat Llama-style head config from the GGUF's metadata, and what the head states that specpack's
    canonical head cannot hold."""
    from specpack.converters.gguf import _field

    def key(name, default=None):
        return _field(reader, f"{ARCH}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    output = next((t for t in reader.tensors if t.name == "output.weight"), None)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": key("attention.head_count_kv", heads),
              "head_dim": key("attention.key_length") or key("rope.dimension_count"),
              "intermediate_size": key("feed_forward_length"), "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
              "rope_theta": key("rope.freq_base", 10000.0), "vocab_size": key("vocab_size"),
              "draft_vocab_size": int(output.shape[-1]) if output is not None else None,
              "target_hidden_size": key("target_hidden_size", hidden),
              "eagle_aux_hidden_state_layer_ids": key("target_layers"),
              "norm_before_residual": bool(key("norm_before_residual", False))}
    missing = [f"{ARCH}.{k}" for k, v in (("embedding_length", hidden), ("attention.head_count", heads),
                                           ("feed_forward_length", config["intermediate_size"]),
                                           ("vocab_size", config["vocab_size"]), ("target_layers",
                                           config["eagle_aux_hidden_state_layer_ids"])) if v is None]
    if missing:
        raise InputError(f"{path}: EAGLE-3 GGUF metadata missing", problems=missing,
                         hint=f"write the head with {LLAMACPP}'s convert_hf_to_gguf.py --target-model-dir")
    problems = []
    if config["norm_before_residual"]:
        problems.append(f"{ARCH}.norm_before_residual is true: specpack's canonical EAGLE-3 head adds the raw hidden "
                        "state to the attention output (the EAGLE-3 reference), so it would run another head")
    if key("norm_before_fc", False):
        problems.append(f"{ARCH}.norm_before_fc is true (an RMSNorm over the fused target features): specpack's "
                        "canonical EAGLE-3 head has none")
    return {k: v for k, v in config.items() if v is not None}, problems


def _tensors(reader, config: dict) -> tuple[dict, list[str]]:
    """The head's tensors in canonical names, dequantized to float32 (q/k rows un-permuted, d2t back to
    offsets), and every tensor the layout does not know or whose type it does not read."""
    from specpack.converters.gguf import drafter_tensors

    heads = {"blk.0.attn_q.weight": config["num_attention_heads"], "blk.0.attn_k.weight": config["num_key_value_heads"]}
    return drafter_tensors(reader, NAMES, heads, FLOAT_TYPES, f"{LLAMACPP}'s EAGLE-3 layout")
