"""Writing GGUF files as the pinned llama.cpp's converter writes them (LLAMACPP: the llama.cpp the
llama-cpp-python 0.3.36 sdist vendors, `conversion/base.py` and `conversion/llama.py`):

    writer = open_writer(path, arch)                        # general.* keys
    add_llama_hparams(writer, arch, config, gguf_type)      # {arch}.* sizes, as TextModel / LlamaModel write them
    add_tokenizer(writer, target_dir, pre=None)             # tokenizer.ggml.* (BPE), SpecialVocab
    tensors = Tensors(gguf_type)                            # planned: name, shape, how to make it
    tensors.add(name, shape, make)                          # the converter's type rule (norms / 1-D: F32)
    tensors.write(writer)                                   # header, then one tensor at a time

Rules followed: 1-D tensors and `*_norm.weight` are F32, every other weight takes the file type, a
row that does not split into Q8_0 blocks falls back to F16 (base.py prepare_tensors); q/k rows are
permuted for llama.cpp's rotary pairing (LlamaModel.permute); the tokenizer's tokens and types come
from transformers' tokenizer as `get_vocab_base` reads them, its pre-tokenizer name from the hash of
the converter's check text (`get_vocab_base_pre`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from hashlib import sha256
from math import prod
from pathlib import Path
from typing import Callable

import numpy as np

from specpack.errors import InputError, UnsupportedError

LLAMACPP = "llama.cpp vendored by llama-cpp-python 0.3.36"
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py --outtype, as specpack writes them

# conversion/base.py get_vocab_base_pre: the text it tokenizes, and the hashes of the tokenizers this
# export names (a tokenizer it does not know is refused there too; `--gguf-pre` states one)
CHKTXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 '
          '33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
          '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
          '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE = {"855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
       "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
       "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
       "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2"}  # Qwen/Qwen1.5-7B
# src/llama-vocab.cpp: the pre-tokenizer names it reads (a subset: the ones a byte-level BPE maps to)
KNOWN_PRE = ("default", "llama-bpe", "gpt-2", "qwen2", "smollm")


def _gguf():
    import gguf

    return gguf


def open_writer(path: Path, arch: str, name: str):
    writer = _gguf().GGUFWriter(str(path), arch)
    writer.add_name(name)
    return writer


def file_type(gguf_type: str):
    F = _gguf().LlamaFileType
    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0}[gguf_type]


def add_llama_hparams(writer, arch: str, cfg: dict, gguf_type: str, layers: int | None = None,
                      key_length: bool = False) -> None:
    """The sizes llama.cpp's TextModel.set_gguf_parameters and LlamaModel write, under `arch` (`key_length`:
    state the head width always, as Qwen3Model does)."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = {"context_length": cfg.get("max_position_embeddings") or 4096, "embedding_length": cfg["hidden_size"],
          "block_count": layers if layers is not None else cfg["num_hidden_layers"],
          "feed_forward_length": cfg["intermediate_size"], "attention.head_count": heads,
          "attention.head_count_kv": cfg.get("num_key_value_heads") or heads,
          "rope.freq_base": float(cfg.get("rope_theta", 10000.0)),
          "attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
          "vocab_size": cfg["vocab_size"], "rope.dimension_count": head_dim}
    if key_length or head_dim != cfg["hidden_size"] // heads:
        kv.update({"attention.key_length": head_dim, "attention.value_length": head_dim})
    for key, value in kv.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_file_type(file_type(gguf_type))


def tokenizer_pre(tokenizer, stated: str | None) -> str:
    """The pre-tokenizer llama.cpp names this tokenizer by (the converter's hash rule), or `stated`."""
    digest = sha256(str(tokenizer.encode(CHKTXT)).encode()).hexdigest()
    known = PRE.get(digest)
    if stated is not None:
        if stated not in KNOWN_PRE:
            raise InputError(f"--gguf-pre {stated!r} is not a pre-tokenizer this export writes",
                             hint=f"one of: {', '.join(KNOWN_PRE)}")
        if known is not None and known != stated:
            raise InputError(f"--gguf-pre {stated!r}, but this tokenizer hashes as llama.cpp's {known!r}",
                             hint="omit --gguf-pre")
        return stated
    if known is None:
        raise UnsupportedError(f"llama.cpp's converter does not know this tokenizer's pre-tokenizer (check hash "
                               f"{digest[:16]}…): {LLAMACPP} would refuse it too",
                               hint=f"if you know how it splits text, state it with --gguf-pre ({', '.join(KNOWN_PRE)}); "
                                    "a byte-level BPE with the GPT-2 split pattern is gpt-2")
    return known


def add_tokenizer(writer, target: Path, pre: str | None = None) -> str:
    """A byte-level BPE tokenizer as `_set_vocab_gpt2` writes it; the pre-tokenizer name written."""
    import json

    from transformers import AutoTokenizer

    gguf = _gguf()
    spec = json.loads((target / "tokenizer.json").read_text()) if (target / "tokenizer.json").is_file() else {}
    if spec.get("model", {}).get("type") != "BPE":
        raise UnsupportedError(f"the target's tokenizer ({spec.get('model', {}).get('type', 'no tokenizer.json')}) is "
                               "not a byte-level BPE: this export writes llama.cpp's gpt2-model tokenizers only",
                               hint=f"convert the target with {LLAMACPP}'s convert_hf_to_gguf.py")
    tok = AutoTokenizer.from_pretrained(target)
    name = tokenizer_pre(tok, pre)
    vocab = json.loads((target / "config.json").read_text())
    vocab_size = (vocab.get("text_config") or vocab).get("vocab_size", len(tok.vocab))
    reverse = {i: t for t, i in tok.vocab.items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(name)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(target, load_merges=True)
    ids = tok("a").input_ids  # what the tokenizer itself adds, stated (llama.cpp's default differs per pre)
    special.add_special_token.update(bos=bool(ids) and ids[0] == tok.bos_token_id and tok.bos_token_id is not None,
                                     eos=bool(ids) and ids[-1] == tok.eos_token_id and tok.eos_token_id is not None)
    special.add_to_gguf(writer)
    return name


def load_f32(file: Path, name: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        return f.get_tensor(name).float().numpy()


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's rotary pairing (LlamaModel.permute; converters/gguf.py undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class Tensors:
    """The tensors of one GGUF, planned by name and shape and made one at a time while they are written:
    memory holds one tensor, not the model (GGUFWriter.add_tensor would keep every array until the end)."""

    gguf_type: str
    planned: list = field(default_factory=list)  # (name, shape, GGML type name, make)

    def add(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray], integer: bool = False) -> str:
        """Plan `name` (`make()` gives its float32 array, or int64 ids when `integer`); its GGML type."""
        qtype = "I64" if integer else self.type_of(name, shape)
        self.planned.append((name, tuple(shape), qtype, make))
        return qtype

    def type_of(self, name: str, shape: tuple[int, ...]) -> str:
        """base.py prepare_tensors: 1-D tensors and norms F32, the rest the file type, Q8_0 falling back
        to F16 where a row does not split into its 32-value blocks."""
        if len(shape) <= 1 or name.endswith(("_norm.weight", ".ffn_gate_inp.weight")) or not name.endswith(".weight"):
            return "F32"  # (routers too: in base.py's list of tensors always kept in float32)
        kind = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[self.gguf_type]
        return "F16" if kind == "Q8_0" and shape[-1] % 32 else kind

    def write(self, writer) -> None:
        gguf = _gguf()
        T = gguf.GGMLQuantizationType
        for name, shape, qtype, _ in self.planned:
            t = T[qtype]
            if qtype in ("F32", "I64"):
                writer.add_tensor_info(name, shape, np.dtype(np.float32 if qtype == "F32" else np.int64),
                                       prod(shape) * 4 * (2 if qtype == "I64" else 1))
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, t)
                writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), prod(byte_shape), raw_dtype=t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, qtype, make in self.planned:
            w = make()
            if tuple(w.shape) != shape:
                raise AssertionError(f"{name}: planned {shape}, made {tuple(w.shape)}")
            data = np.ascontiguousarray(w, dtype=np.int64) if qtype == "I64" else \
                gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), T[qtype])
            writer.write_tensor_data(data)
        writer.close()
