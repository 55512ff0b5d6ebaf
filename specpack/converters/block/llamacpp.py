"""llama.cpp's DFlash / DSpark drafter GGUFs (`general.architecture` "dflash") → a block-drafter Reading,
settled and checked against the target as every block layout is (canonical.build).

Every name and key follows the llama.cpp the llama-cpp-python 0.3.36 sdist vendors (eagle3_gguf.LLAMACPP):
`conversion/qwen.py` DFlashModel / DSparkModel write Qwen3 layers (`blk.N.attn_{q,k,v,output,q_norm,
k_norm}`, `blk.N.ffn_{gate,up,down}`, `attn_norm`, `ffn_norm`), `fc`, the context `hidden_norm` as
`enc.output_norm`, `output_norm`, `output` when the head scores with its own lm_head, `token_embd` when it
has its own embedding, the Markov head as `markov_w1` / `markov_w2` and the confidence head as
`conf_proj`, `d2t` as absolute target ids; metadata `dflash.target_layers` (the source's output-of-layer
ids + 1: layer i's *input*, as `common/speculative.cpp` extracts it), `dflash.block_size`,
`dflash.sample_from_anchor` (true: anchor-first), `dflash.attention.causal` (default false: the block
attends to itself) and `tokenizer.ggml.mask_token_id`. `src/models/dflash.cpp`: the draft's own
`n_embd` is the width of each target feature (fc reads len(ids) x n_embd); a head without `output` and
`token_embd` scores and embeds with the target's (its `ctx_other`).
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters.block.common import Reading
from specpack.converters.eagle3_gguf import FLOAT_TYPES, LLAMACPP
from specpack.converters.gguf import gguf_architecture, open_gguf
from specpack.errors import InputError

ARCH = "dflash"
LAYOUT = "llamacpp-dflash"
LAYOUTS = (LAYOUT,)
NAMES = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight",
         "output.weight": "lm_head.weight", "token_embd.weight": "embed_tokens.weight", "d2t": "d2t",
         "markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight",
         "conf_proj.weight": "confidence_head.proj.weight", "conf_proj.bias": "confidence_head.proj.bias"}
LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
         "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}
UNREAD = ("sliding_window", "attention.sliding_window", "conv_kernel_size", "selector_rank", "hyper_connection_count",
          "logit_scale", "final_logit_softcapping", "embedding_scale", "attention.value_scale")


def detect(path: Path) -> str | None:
    """LAYOUT for a llama.cpp DFlash / DSpark drafter GGUF; None for any other file."""
    path = Path(path)
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    return LAYOUT if gguf_architecture(open_gguf(path)) == ARCH else None


def read(path: Path) -> Reading:
    """The drafter GGUF at `path` as a Reading: its geometry, canonical tensors and every binding it states."""
    from specpack.converters.gguf import _field, drafter_tensors

    path, reader = Path(path), open_gguf(Path(path))

    def key(name, default=None):
        return _field(reader, f"{ARCH}.{name}", default)

    config = {"hidden_size": key("embedding_length"), "num_hidden_layers": key("block_count"),
              "num_attention_heads": key("attention.head_count"), "intermediate_size": key("feed_forward_length"),
              "num_key_value_heads": key("attention.head_count_kv"), "head_dim": key("attention.key_length"),
              "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": key("rope.freq_base"),
              "vocab_size": key("vocab_size"), "hidden_act": "silu", "attention_bias": False}
    missing = [f"{ARCH}.{k}" for k, v in (("embedding_length", config["hidden_size"]), ("block_count",
               config["num_hidden_layers"]), ("attention.head_count", config["num_attention_heads"]),
               ("feed_forward_length", config["intermediate_size"]), ("rope.freq_base", config["rope_theta"]))
               if v is None]
    if missing:
        raise InputError(f"{path}: DFlash GGUF metadata missing", problems=missing,
                         hint=f"write the drafter with {LLAMACPP}'s convert_hf_to_gguf.py --target-model-dir")
    config = {k: v for k, v in config.items() if v is not None}
    config["target_hidden_size"] = config["hidden_size"]  # dflash.cpp: fc reads len(ids) x the draft's n_embd
    tensors, problems = drafter_tensors(reader, _canonical, {}, FLOAT_TYPES, f"{LLAMACPP}'s DFlash layout")
    r = Reading(LAYOUT, path, config, config, tensors, {v: k for k, v in NAMES.items()})
    r.problems += problems + [f"{ARCH}.{k} is set: not a binding specpack's block drafter holds"
                              for k in UNREAD if key(k) is not None]
    _state(r, key, _field(reader, "tokenizer.ggml.mask_token_id"))
    return r


def _canonical(name: str) -> str | None:
    if name in NAMES:
        return NAMES[name]
    head, _, rest = name.partition(".")
    i, _, leaf = rest.partition(".")
    return f"layers.{i}.{LAYER[leaf]}" if head == "blk" and i.isdigit() and leaf in LAYER else None


def _state(r: Reading, key, mask) -> None:
    """What the GGUF states: the algorithm (a Markov head makes it DSpark), the query layout, block size,
    mask token, target layers, the heads, and one causality for every layer."""
    where = f"{r.path.name} ({LLAMACPP})"
    markov = r.tensors.get("markov_head.markov_w1.weight")
    r.say("algorithm", "dspark" if markov is not None else "dflash",
          f"{where}: {'markov_w1 present' if markov is not None else 'no Markov head'}")
    anchor = key("sample_from_anchor")
    if isinstance(anchor, bool):
        r.say("query_layout", "anchor_first" if anchor else "fill_in", f"{ARCH}.sample_from_anchor = {str(anchor).lower()}")
    r.say("block_size", key("block_size"), f"{ARCH}.block_size")
    r.say("mask_token_id", mask, "tokenizer.ggml.mask_token_id")
    ids = key("target_layers")
    if ids is not None:
        r.ids.append(([int(i) for i in ids], "input_of_layer", f"{ARCH}.target_layers"))
    if markov is not None:
        r.say("markov_rank", int(markov.shape[1]), "markov_w1's rank")
        r.say("markov_type", "vanilla", f"{LLAMACPP} reads the vanilla Markov head only")
    conf = r.tensors.get("confidence_head.proj.weight")
    if conf is not None:
        r.say("confidence", True, "conf_proj present")
        r.say("confidence_with_markov", conf.shape[-1] > r.config["hidden_size"], "conf_proj's input width")
    causal = bool(key("attention.causal", False))
    r.attention = ([causal] * r.config["num_hidden_layers"], [None] * r.config["num_hidden_layers"])
