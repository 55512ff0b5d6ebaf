"""Tiny GGUF files written in code, the way llama.cpp's `convert_hf_to_gguf.py` writes a Llama."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

# HF name pattern -> GGUF name, as llama.cpp's tensor map spells them for arch "llama".
HF_TO_GGUF = [
    (r"^model\.embed_tokens\.weight$", "token_embd.weight"),
    (r"^model\.norm\.weight$", "output_norm.weight"),
    (r"^lm_head\.weight$", "output.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"blk.\1.attn_norm.weight"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"blk.\1.ffn_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.weight$", r"blk.\1.attn_q.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.weight$", r"blk.\1.attn_k.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.weight$", r"blk.\1.attn_v.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.weight$", r"blk.\1.attn_output.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.weight$", r"blk.\1.ffn_gate.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.weight$", r"blk.\1.ffn_up.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$", r"blk.\1.ffn_down.weight"),
]

# Byte offsets of the f16 scale fields inside one block of each quantized type, so random blocks
# can be made that decode to finite, moderate values.
HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,),
}


def gguf_name(hf_name: str) -> str:
    for pattern, replacement in HF_TO_GGUF:
        if re.match(pattern, hf_name):
            return re.sub(pattern, replacement, hf_name)
    raise KeyError(hf_name)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: interleaved rotary halves -> GGML's rope layout."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes of `qtype` blocks whose f16 scales are small and finite."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype.name]:
        scale = rng.uniform(1e-3, 2e-2, size=(rows, cols // block)).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def encode(weights: np.ndarray, qtype) -> np.ndarray:
    """`weights` (fp32) stored as `qtype`; types gguf cannot quantize get random blocks instead."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    if qtype in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        return quants.quantize(weights.astype(np.float32), qtype)
    return random_blocks(qtype, weights.shape[0], weights.shape[1], seed=weights.size)


def tokenizer_metadata(tokenizer_dir: Path) -> dict:
    """Tokens, types and merges of a saved byte-level BPE tokenizer, as GGUF spells them."""
    data = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    specials = {added["id"] for added in data["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if i in specials else 1 for i in range(len(tokens))]
    return {"tokens": tokens, "types": types, "merges": merges}


def sentencepiece_metadata(vocab_size: int, corpus: list[str]) -> dict:
    """A Llama-2-style vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces scored by rank."""
    words = sorted({"\u2581" + w for text in corpus for w in text.split()}, key=lambda w: (len(w), w))
    chars = sorted({c for text in corpus for c in text if not c.isspace()}) + ["\u2581"]
    pieces = list(dict.fromkeys(chars + [w[:2] for w in words] + words))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += pieces[:vocab_size - len(tokens)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    return {"model": "llama", "tokens": tokens, "types": types, "add_bos": True,
            "scores": [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]}


def write_llama_gguf(path: Path, model, tokenizer_dir: Path | None = None, types: dict | None = None,
                     chat_template: str | None = None, arch: str = "llama", extra_tensors=(),
                     vocab: dict | None = None, metadata: dict | None = None) -> Path:
    """Write `model` (an HF Llama) as a GGUF the way llama.cpp's converter does: names, q/k permute,
    metadata. `types` maps a regex over GGUF names to a GGMLQuantizationType (default F32). The
    vocabulary comes from a saved byte-level BPE tokenizer, or `vocab` (see `sentencepiece_metadata`)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    cfg = model.config
    tok = vocab or tokenizer_metadata(tokenizer_dir)
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny llama")
    sizes = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
             "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
             "head_count": cfg.num_attention_heads, "head_count_kv": cfg.num_key_value_heads}
    for key, value in {**sizes, **(metadata or {})}.items():
        getattr(writer, f"add_{key}")(value)  # `metadata` lets a test make the header lie
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model(tok.get("model", "gpt2"))
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    if "merges" in tok:
        writer.add_token_merges(tok["merges"])
    if "scores" in tok:
        writer.add_token_scores(tok["scores"])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_add_bos_token(tok.get("add_bos", False))
    if chat_template:
        writer.add_chat_template(chat_template)

    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(hf_name)
        weights = tensor.detach().float().numpy()
        if ".attn_q." in name:
            weights = llama_cpp_permute(weights, cfg.num_attention_heads, cfg.num_attention_heads)
        elif ".attn_k." in name:
            weights = llama_cpp_permute(weights, cfg.num_attention_heads, cfg.num_key_value_heads)
        qtype = next((t for pattern, t in (types or {}).items() if re.search(pattern, name)), T.F32)
        if weights.ndim == 1:
            qtype = T.F32  # llama.cpp keeps norms in f32
        data = encode(weights, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    return _finish(writer, extra_tensors, Path(path))


# llama.cpp's EAGLE-3 drafter GGUF (convert_hf_to_gguf.py / conversion/llama.py `is_eagle3` in the llama.cpp the
# llama-cpp-python 0.3.36 sdist vendors): canonical head name -> GGUF name
EAGLE3_NAMES = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
                "embed_tokens.weight": "token_embd.weight",
                "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
                "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
                "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
                "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
                "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
                "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
                "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
                "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
                "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
                "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight"}


def write_eagle3_gguf(path: Path, head: dict, cfg, target_layers: list[int], target_vocab: int, arch: str = "eagle3",
                      metadata: dict | None = None, extra_tensors=(), drop=()) -> Path:
    """An EAGLE-3 head (canonical names, `head`) written as llama.cpp's converter writes it: `eagle3.*`
    metadata (target_layers as the converter copies them, counted as input of layer i by
    common/speculative.cpp), q/k rows permuted (LlamaModel.permute), d2t as absolute target ids (I64)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = GGUFWriter(str(path), arch)
    fields = {"block_count": 1, "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
              "feed_forward_length": cfg.intermediate_size, "attention.head_count": heads,
              "attention.head_count_kv": kv, "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
              "rope.freq_base": float(cfg.rope_parameters["rope_theta"]), "rope.dimension_count": head_dim,
              "vocab_size": target_vocab, "target_hidden_size": cfg.hidden_size, "target_layers": target_layers,
              "norm_before_residual": False, "norm_before_fc": False, **(metadata or {})}
    for key, value in fields.items():
        name = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    for name, tensor in head.items():
        if name in drop or name == "t2d":
            continue
        if name == "d2t":
            ids = tensor.numpy().astype(np.int64)
            writer.add_tensor("d2t", ids + np.arange(ids.size, dtype=np.int64), raw_dtype=T.I64)
            continue
        w = tensor.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, heads, heads)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, heads, kv)
        writer.add_tensor(EAGLE3_NAMES[name], np.ascontiguousarray(w))
    return _finish(writer, extra_tensors, path)


def _finish(writer, extra_tensors, path):
    """Add the raw `extra_tensors` (name, data, GGML type), write the file and return its path."""
    for name, data, qtype in extra_tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rewrite_gguf(src: Path, dst: Path, keys: dict | None = None, drop: tuple = ()) -> Path:
    """A copy of the GGUF `src` with metadata `keys` changed (a value None removes the key; a new key is
    written as uint32) and the tensors named in `drop` left out; every other key and tensor byte for byte."""
    import gguf

    keys = dict(keys or {})
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = keys.pop(name) if name in keys else f.contents()
        if value is not None:
            vtype = f.types[0]
            writer.add_key_value(name, value, vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for name, value in keys.items():
        if value is not None:
            writer.add_uint32(name, value)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    return _finish(writer, (), dst)
