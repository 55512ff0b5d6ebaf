"""Targets in the Hugging Face layout: config.json, tokenizer files, safetensors (single or sharded).

Reads configs and safetensors headers only: the build never loads the target's weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from specpack._paths import check_relpath, walk_files
from specpack.converters.safetensors_header import DTYPE_BYTES, TORCH_NAMES, TensorMeta, read_header
from specpack.errors import InputError, UnsupportedError
from specpack.runtime.models.config import (DEEPSEEK_ARCHITECTURES, SIZE_FIELDS, SUPPORTED_ARCHITECTURES,
                                     checked_tensor_shapes, size_problems, target_spec_from_config,
                                     target_tensor_shapes)
from specpack.schemas import Source, TargetInfo

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
RESERVED = ("specpack.json", "model.sig", "drafter/", "exports/", "engines/")
SHARD_RE = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """A checked target directory: what to carry into the artifact and what the manifest says."""

    root: Path
    files: list[str]
    info: TargetInfo
    tensors: dict[str, tuple[str, TensorMeta]]  # name -> (file, meta)

    @property
    def weight_bytes(self) -> int:
        return sum(m.end - m.start for _, m in self.tensors.values())

    def kv_bytes_per_token(self) -> int:
        i, latent = self.info, self.info.mla_latent_dim
        per_layer = latent if latent else 2 * i.num_key_value_heads * i.head_dim  # MLA caches one latent
        return i.num_hidden_layers * per_layer * _dtype_bytes(i.dtype)


def detect(path: Path) -> str | None:
    """'hf' when `path` looks like a Hugging Face model directory."""
    return "hf" if (Path(path) / "config.json").is_file() else None


def load(path: Path, source: Source | None = None) -> Target:
    """Check the target directory at `path` and describe it (configs and headers only)."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"target '{root}' is not a directory",
                         hint="pass a Hugging Face model directory (config.json + safetensors)")
    config = read_json(root / "config.json", "target config")
    files = [f for f in walk_files(root) if not f.endswith(PICKLE_SUFFIXES)]
    _check_reserved(root, files)
    weight_files = _weight_files(root, files)
    tensors = _read_tensors(root, weight_files)
    info = _target_info(root, config, files, weight_files, tensors,
                        source or Source.local(path))
    _check_sizes_against_weights(root, config, info, tensors)
    return Target(root=root, files=files, info=info, tensors=tensors)


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise InputError(f"{what} not found: {path}", hint="is this the right directory?")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{what} {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InputError(f"{what} {path} is nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise InputError(f"{what} {path} is not a JSON object")
    return data


def _check_reserved(root: Path, files: list[str]) -> None:
    clashes = [f for f in files if f in RESERVED or f.startswith(RESERVED[2:])]
    if clashes:
        raise InputError(f"target '{root}' holds files whose names the artifact reserves",
                         problems=clashes, hint="is this already a specpack artifact?")


def _weight_files(root: Path, files: list[str]) -> list[str]:
    if INDEX_NAME in files:
        return _indexed_files(root, files)
    shards = [f for f in files if SHARD_RE.match(f)]
    if shards:
        raise InputError(f"target '{root}' has sharded weights but no {INDEX_NAME}",
                         problems=shards, hint="copy the index file that came with the shards")
    if SINGLE_NAME in files:
        return [SINGLE_NAME]
    pickles = [p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES]
    raise InputError(f"target '{root}' has no safetensors weights",
                     problems=[f"found {', '.join(pickles)}"] if pickles else [],
                     hint="specpack ships safetensors only: save the model with "
                          "`save_pretrained(dir, safe_serialization=True)` first")


def _indexed_files(root: Path, files: list[str]) -> list[str]:
    """The shards the index names: each a plain relative path to a file that is carried."""
    index = read_json(root / INDEX_NAME, "weight index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{root / INDEX_NAME}: no 'weight_map'", hint="the index is corrupt")
    names = sorted({check_relpath(v if isinstance(v, str) else "", str(root / INDEX_NAME))
                    for v in weight_map.values()})
    problems = [f"{n} is named by the index but missing" for n in names if not (root / n).is_file()]
    problems += [f"{n} is named by the index but not carried (inside a skipped folder such as .git/ or "
                 ".cache/, or not safetensors)" for n in names if (root / n).is_file() and n not in files]
    problems += _missing_shard_numbers(names)
    if problems:
        raise InputError(f"target '{root}': weight shards are missing", problems=problems,
                         hint="download every shard listed in model.safetensors.index.json")
    return names


def _missing_shard_numbers(names: list[str]) -> list[str]:
    found = [SHARD_RE.match(n) for n in names]
    totals = {int(m.group(2)) for m in found if m}
    if len(totals) != 1:
        return []
    total, have = totals.pop(), {int(m.group(1)) for m in found if m}
    return [f"shard {k} of {total} is not in the index" for k in range(1, total + 1) if k not in have]


def _read_tensors(root: Path, weight_files: list[str]) -> dict[str, tuple[str, TensorMeta]]:
    tensors, problems = {}, []
    for rel in weight_files:
        for name, meta in read_header(root / rel).items():
            if name in tensors:
                problems.append(f"{name} is in both {tensors[name][0]} and {rel}")
            tensors[name] = (rel, meta)
    if (root / INDEX_NAME).is_file():
        weight_map = read_json(root / INDEX_NAME, "weight index")["weight_map"]
        problems += [f"{name}: the index says {file}, but its header does not hold it"
                     for name, file in weight_map.items() if tensors.get(name, ("",))[0] != file]
    if problems:
        raise InputError(f"target '{root}': weights disagree with their index", problems=problems,
                         hint="the index and the shards come from different exports")
    return tensors


def _target_info(root, config, files, weight_files, tensors, source) -> TargetInfo:
    text = _text_config(root, config)
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    mla = "kv_lora_rank" in text  # DeepSeek-V3-style multi-head latent attention
    fields = dict(
        hidden_size=hidden, num_hidden_layers=text["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text["qk_nope_head_dim"] + text["qk_rope_head_dim"] if mla else text.get("head_dim") or hidden // heads,
        mla_latent_dim=text["kv_lora_rank"] + text["qk_rope_head_dim"] if mla else None,
        intermediate_size=text["intermediate_size"], vocab_size=text["vocab_size"],
        max_position_embeddings=text.get("max_position_embeddings") or 2048)
    try:
        return TargetInfo(
            architecture=architecture(config),
            model_type=str(config.get("model_type", "unknown")), **fields,
            dtype=_dominant_dtype(tensors),
            rope_theta=text.get("rope_theta") or _rope_parameters(text).get("rope_theta", 10000.0),
            rope_scaling=text.get("rope_scaling"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            weight_files=weight_files, parameters=sum(m.numel for _, m in tensors.values()),
            config_sha256=_sha256(root / "config.json"),
            tokenizer_sha256=_tokenizer_digest(root, files), source=source)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise InputError(f"{root / 'config.json'}: fields of unusable type or value", problems=problems,
                         hint="the target config must state its decoder geometry") from None


def architecture(config: dict) -> str:
    """config.json's `architectures[0]`, or 'unknown'."""
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else "unknown"


def _rope_parameters(text: dict) -> dict:
    params = text.get("rope_parameters")
    return params if isinstance(params, dict) else {}


def _text_config(root: Path, config: dict) -> dict:
    """The decoder's config (a multimodal model's `text_config`), its sizes checked positive integers."""
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise InputError(f"{root / 'config.json'}: text_config is not a JSON object")
    mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim") if "kv_lora_rank" in text else ()
    problems = size_problems(text, ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "intermediate_size", "vocab_size", *mla), SIZE_FIELDS)
    if problems:
        raise InputError(f"{root / 'config.json'}: missing or invalid decoder sizes", problems=problems,
                         hint="the target config must state its decoder geometry")
    return text


def _check_sizes_against_weights(root: Path, config: dict, info: TargetInfo, tensors) -> None:
    """The config against the safetensors headers, in time and memory bounded by the headers whatever
    the config claims: plain bounds for every model, then every tensor's shape for the families the
    runtime runs (the layer count is compared before any per-layer expectation is built)."""
    n, weights = len(tensors), info.parameters
    problems = [f"{k} {v:,} > the {weights:,} weights in its safetensors files" for k, v in (
        ("hidden_size", info.hidden_size), ("intermediate_size", info.intermediate_size),
        ("vocab_size", info.vocab_size), ("num_attention_heads", info.num_attention_heads)) if v > weights]
    if info.num_hidden_layers > n:
        problems.append(f"num_hidden_layers {info.num_hidden_layers:,} > the {n:,} tensors in its weights")
    if problems:
        raise InputError(f"target '{root}': config.json claims sizes its weights cannot hold",
                         problems=problems, hint="the config and the safetensors files must come from "
                                                 "the same model")
    spec, shapes_of = _runtime_spec(config, info.architecture)
    if spec is not None:
        checked_tensor_shapes(spec, {name: m.shape for name, (_, m) in tensors.items()}, shapes_of,
                              f"target '{root}'")


def _runtime_spec(config: dict, arch: str):
    """(spec, tensor shapes of a spec) for a target the runtime runs, else (None, None)."""
    if config.get("quantization_config"):  # packed layouts (GPTQ, AWQ, ...) name and shape tensors otherwise
        return None, None
    try:
        if arch in SUPPORTED_ARCHITECTURES:
            return target_spec_from_config(config), target_tensor_shapes
        if arch in DEEPSEEK_ARCHITECTURES:
            from specpack.runtime.models import deepseek

            return deepseek.deepseek_spec_from_config(config), deepseek.target_tensor_shapes
    except UnsupportedError as exc:  # a feature the runtime lacks: the plain bounds still hold
        log.info("not checking every tensor shape of %s: %s", arch, exc.message)
    return None, None


def _dominant_dtype(tensors) -> str:
    counts: dict[str, int] = {}
    for _, meta in tensors.values():
        counts[meta.dtype] = counts.get(meta.dtype, 0) + meta.end - meta.start
    return TORCH_NAMES.get(max(counts, key=counts.get), "unknown") if counts else "unknown"


def _dtype_bytes(torch_name: str) -> int:
    by_name = {v: DTYPE_BYTES[k] for k, v in TORCH_NAMES.items()}
    return by_name.get(torch_name, 2)


def _tokenizer_digest(root: Path, files: list[str]) -> str | None:
    present = [f for f in TOKENIZER_FILES if f in files]
    if not present:
        return None
    lines = "".join(f"{f} {_sha256(root / f)}\n" for f in present)
    return hashlib.sha256(lines.encode()).hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
