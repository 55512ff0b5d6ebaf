"""Targets in the Hugging Face layout: config.json, tokenizer files, safetensors (single or sharded).

Reads configs and safetensors headers only: the build never loads the target's weights. Every family
specpack knows (families/) has every tensor checked, quantized or not; a target of another family
is packaged with plain bounds only, and refused when it is quantized (nothing could check it).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from specpack._paths import check_relpath
from specpack.converters.release_files import LocalFiles, read_json
from specpack.converters.safetensors_header import DTYPE_BYTES, TORCH_NAMES, TensorMeta
from specpack import families
from specpack.errors import InputError, UnsupportedError
from specpack.families import quant
from specpack.families.base import size_problems
from specpack.families.dense import SIZE_FIELDS
from specpack.schemas import Source, TargetArch, TargetExperts, TargetInfo, TargetMtp, TargetQuantization

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HF_QUANT = "hf_quant_config.json"  # ModelOpt's own quantization config, beside config.json
RESERVED = ("specpack.json", "model.sig", "drafter/", "exports/", "engines/")
SHARD_RE = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """A checked target directory: what to carry into the artifact and what the manifest says."""

    root: Path | None  # None: a release read remotely (converters/hub_files), not downloaded
    files: list[str]
    info: TargetInfo
    tensors: dict[str, tuple[str, TensorMeta]]  # name -> (file, meta)
    checked: families.Checked | None = None  # None: a family specpack does not know (plain bounds only)
    reader: object = None  # the release reader it was read through (release_files; None: LocalFiles(root))

    @property
    def files_reader(self):
        """How its files are read: a directory, or a hub repository by range requests (release_files)."""
        return self.reader if self.reader is not None else LocalFiles(self.root)

    @property
    def embed_name(self) -> str:
        """The token embedding's tensor name (its family's: `model.language_model.`, `backbone.`, ...)."""
        return self.checked.arch.embed if self.checked else "model.embed_tokens.weight"

    @property
    def norm_name(self) -> str:
        return self.checked.arch.norm if self.checked else "model.norm.weight"

    @property
    def lm_head_name(self) -> str:
        """The lm_head's tensor name, or the embedding's when they are tied."""
        if self.checked:
            return self.checked.arch.lm_head or self.checked.arch.embed
        return "lm_head.weight" if "lm_head.weight" in self.tensors else "model.embed_tokens.weight"

    def feature_kinds(self, ids_in: list[int]) -> list[str] | None:
        """The kind of the layer whose output each 'input of layer i' id captures (None: family unknown)."""
        if self.checked is None:
            return None
        kinds = self.checked.arch.layer_kinds
        return ["embedding" if i == 0 else kinds[i - 1] if 0 < i <= len(kinds) else "out of range" for i in ids_in]

    @property
    def weight_bytes(self) -> int:
        """The real bytes on disk (packed, for a quantized checkpoint)."""
        return sum(m.end - m.start for _, m in self.tensors.values())

    def kv_bytes_per_token(self) -> int:
        """Attention layers only (linear attention and Mamba hold a fixed state instead)."""
        if self.info.arch is not None:
            return self.info.arch.kv_bytes_per_token
        i, latent = self.info, self.info.mla_latent_dim
        per_layer = latent if latent else 2 * i.num_key_value_heads * i.head_dim  # MLA caches one latent
        return i.num_hidden_layers * per_layer * _dtype_bytes(i.dtype)


def detect(path: Path) -> str | None:
    """'hf' when `path` looks like a Hugging Face model directory."""
    return "hf" if (Path(path) / "config.json").is_file() else None


def load(path: Path, source: Source | None = None, only: tuple[str, ...] | None = None) -> Target:
    """Check the target directory at `path` and describe it (configs and headers only); `only`: the files
    of it that the target is (what `build hf://` fetched into a hub cache snapshot)."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"target '{root}' is not a directory",
                         hint="pass a Hugging Face model directory (config.json + safetensors)")
    return check(LocalFiles(root, only), source or Source.local(path), root)


def check(reader, source: Source, root: Path | None = None) -> Target:
    """Check the target a release reader holds (release_files: a directory, or a hub repository read by
    range requests) and describe it; `root`: its directory (None for a remote one: nothing to carry yet)."""
    where = reader.label()
    config = reader.json("config.json", "target config")
    listed = reader.list()
    files = [f for f in listed if not f.endswith(PICKLE_SUFFIXES)]
    _check_reserved(where, files)
    weight_files = _weight_files(reader, files, listed)
    tensors = _read_tensors(reader, weight_files)
    try:
        families.check_config(config, tensors=len(tensors), weights=sum(m.numel for _, m in tensors.values()))
    except InputError as exc:
        raise InputError(f"target '{where}': {exc.message}", problems=exc.problems, hint=exc.hint) from None
    arch, q = _describe(reader, config, files)
    info = _target_info(reader, config, files, weight_files, tensors, source, arch, q)
    remote = None if root is not None else reader
    if arch is None:
        return Target(root=root, files=files, info=info, tensors=tensors, reader=remote)
    try:
        checked = families.check(arch, {name: m for name, (_, m) in tensors.items()}, q)
    except InputError as exc:
        raise InputError(f"target '{where}': {exc.message}", problems=exc.problems, hint=exc.hint) from None
    info = info.model_copy(update={"arch": _arch_info(checked, tensors)})
    return Target(root=root, files=files, info=info, tensors=tensors, checked=checked, reader=remote)


def weight_headers(root: Path) -> tuple[list[str], dict[str, tuple[str, TensorMeta]]]:
    """(the files under `root`, name -> (file, header entry) of its safetensors weights): headers only."""
    return headers_of(LocalFiles(root))


def headers_of(reader) -> tuple[list[str], dict[str, tuple[str, TensorMeta]]]:
    """weight_headers through a release reader (release_files: a directory, or a hub repository read by
    range requests): the index and every shard's header checked the same way."""
    listed = reader.list()
    files = [f for f in listed if not f.endswith(PICKLE_SUFFIXES)]
    return files, _read_tensors(reader, _weight_files(reader, files, listed))


def read_config(path: Path, what: str = "drafter config") -> dict:
    """A drafter's config.json, every field a reader takes type-checked (families.fields: the same
    table the targets' configs are checked against, numbers finite)."""
    return checked_config(read_json(path, what), what, str(path))


def checked_config(config: dict, what: str, where: str) -> dict:
    """`config` with every field a reader takes type-checked (read_config, for any release reader)."""
    try:
        families.check_config(config)
    except InputError as exc:
        raise InputError(f"{what} {where}: {exc.message.removeprefix('config.json: ')}", problems=exc.problems,
                         hint=exc.hint) from None
    return config


def _check_reserved(root: Path, files: list[str]) -> None:
    clashes = [f for f in files if f in RESERVED or f.startswith(RESERVED[2:])]
    if clashes:
        raise InputError(f"target '{root}' holds files whose names the artifact reserves",
                         problems=clashes, hint="is this already a specpack artifact?")


def _weight_files(reader, files: list[str], listed: list[str]) -> list[str]:
    """The safetensors files that hold the weights (`files`: the carried ones, `listed`: all)."""
    if INDEX_NAME in files:
        return _indexed_files(reader, files)
    shards = [f for f in files if SHARD_RE.match(f)]
    if shards:
        raise InputError(f"target '{reader.label()}' has sharded weights but no {INDEX_NAME}",
                         problems=shards, hint="copy the index file that came with the shards")
    if SINGLE_NAME in files:
        return [SINGLE_NAME]
    pickles = [f for f in listed if "/" not in f and f.endswith(PICKLE_SUFFIXES)]
    raise InputError(f"target '{reader.label()}' has no safetensors weights",
                     problems=[f"found {', '.join(pickles)}"] if pickles else [],
                     hint="specpack ships safetensors only: save the model with "
                          "`save_pretrained(dir, safe_serialization=True)` first")


def read_weight_map(root: Path) -> dict[str, str]:
    """`root`'s safetensors index as tensor name -> shard file, checked: a JSON object of strings."""
    return weight_map_of(LocalFiles(root))


def weight_map_of(reader) -> dict[str, str]:
    """The release's safetensors index (through its reader: release_files), checked as read_weight_map."""
    where = reader.label(INDEX_NAME)
    weight_map = reader.json(INDEX_NAME, "weight index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{where}: 'weight_map' is {'missing' if weight_map is None else 'not an object'}"
                         f" ({str(weight_map)[:40]})", hint="the index is corrupt; restore the release's own")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
    if bad:
        raise InputError(f"{where}: weight_map entries that name no file", problems=[
            f"{k[:80]} -> {str(weight_map[k])[:40]}" for k in bad[:10]], hint="the index is corrupt")
    return weight_map


def _indexed_files(reader, files: list[str]) -> list[str]:
    """The shards the index names: each a plain relative path to a file that is carried."""
    weight_map = weight_map_of(reader)
    names = sorted({check_relpath(v, reader.label(INDEX_NAME)) for v in weight_map.values()})
    problems = [f"{n} is named by the index but missing" for n in names if not reader.exists(n)]
    problems += [f"{n} is named by the index but not carried (inside a skipped folder such as .git/ or "
                 ".cache/, or not safetensors)" for n in names if reader.exists(n) and n not in files]
    problems += _missing_shard_numbers(names)
    if problems:
        raise InputError(f"target '{reader.label()}': weight shards are missing", problems=problems,
                         hint="download every shard listed in model.safetensors.index.json")
    return names


def _missing_shard_numbers(names: list[str]) -> list[str]:
    found = [SHARD_RE.match(n) for n in names]
    totals = {int(m.group(2)) for m in found if m}
    if len(totals) != 1:
        return []
    total, have = totals.pop(), {int(m.group(1)) for m in found if m}
    return [f"shard {k} of {total} is not in the index" for k in range(1, total + 1) if k not in have]


def _read_tensors(reader, weight_files: list[str]) -> dict[str, tuple[str, TensorMeta]]:
    tensors, problems = {}, []
    for rel in weight_files:
        for name, meta in reader.header(rel).items():
            if name in tensors:
                problems.append(f"{name} is in both {tensors[name][0]} and {rel}")
            tensors[name] = (rel, meta)
    if reader.exists(INDEX_NAME):
        weight_map = weight_map_of(reader)
        problems += [f"{name}: the index says {file}, but its header does not hold it"
                     for name, file in weight_map.items() if tensors.get(name, ("",))[0] != file]
    if problems:
        raise InputError(f"target '{reader.label()}': weights disagree with their index", problems=problems,
                         hint="the index and the shards come from different exports")
    return tensors


def _target_info(reader, config, files, weight_files, tensors, source, arch=None, q=None) -> TargetInfo:
    fields = _geometry(arch) if arch is not None else _text_geometry(reader.label(), config)
    text = families.text_config(config)[0]
    # GGUF blocks (import-gguf) are bytes: the target's dtype is its float tensors', its size the logical one
    blocks = q is not None and q.scheme == "gguf"
    try:
        return TargetInfo(
            architecture=architecture(config),
            model_type=str(config.get("model_type", "unknown")), **fields,
            dtype=_dominant_dtype({n: v for n, v in tensors.items() if not blocks or v[1].dtype != "U8"}),
            rope_theta=text.get("rope_theta") or _rope_parameters(text).get("rope_theta", 10000.0),
            rope_scaling=stated_rope_scaling(text),
            tie_word_embeddings=arch.lm_head is None if arch else bool(config.get("tie_word_embeddings", False)),
            weight_files=weight_files,
            parameters=sum(_values(name, m, q if blocks else None) for name, (_, m) in tensors.items()),
            config_sha256=reader.sha256("config.json"),
            tokenizer_sha256=_tokenizer_digest(reader, files), source=source)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise InputError(f"{reader.label('config.json')}: fields of unusable type or value", problems=problems,
                         hint="the target config must state its decoder geometry") from None


def _geometry(a: families.Arch) -> dict:
    mla = any(layer.attention.startswith("mla") for layer in a.layers)
    return dict(hidden_size=a.hidden_size, num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
                num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, mla_latent_dim=a.kv_width if mla else None,
                intermediate_size=a.intermediate_size or (a.experts.size if a.experts else 0) or a.hidden_size,
                vocab_size=a.vocab_size, max_position_embeddings=a.max_position_embeddings)


def _text_geometry(root, config: dict) -> dict:
    """A family specpack does not know: the sizes every decoder config states."""
    text = _text_config(root, config)
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    return dict(hidden_size=hidden, num_hidden_layers=text["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=text.get("num_key_value_heads") or heads,
                head_dim=text.get("head_dim") or hidden // heads, intermediate_size=text["intermediate_size"],
                vocab_size=text["vocab_size"], max_position_embeddings=text.get("max_position_embeddings") or 2048)


def architecture(config: dict) -> str:
    """config.json's `architectures[0]`, or 'unknown'."""
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else "unknown"


def stated_rope_scaling(text: dict) -> dict | None:
    """config.json's `rope_scaling`, or transformers v5's `rope_parameters` where they scale (a rope_type other
    than default, at the top or for a layer type): v5 writes no `rope_scaling`, and a reader of the manifest
    must not take a yarn or llama3 target for an unscaled one."""
    if text.get("rope_scaling"):
        return text["rope_scaling"]
    params = _rope_parameters(text)
    kinds = [params.get("rope_type")] + [v.get("rope_type") for v in params.values() if isinstance(v, dict)]
    return params if any(k not in (None, "default") for k in kinds) else None


def _rope_parameters(text: dict) -> dict:
    params = text.get("rope_parameters")
    return params if isinstance(params, dict) else {}


def _text_config(root, config: dict) -> dict:
    """The decoder's config (a multimodal model's `text_config`), its sizes checked positive integers."""
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise InputError(f"{Path(root) / 'config.json'}: text_config is not a JSON object")
    problems = size_problems(text, ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "intermediate_size", "vocab_size"), SIZE_FIELDS)
    if problems:
        raise InputError(f"{Path(root) / 'config.json'}: missing or invalid decoder sizes", problems=problems,
                         hint="the target config must state its decoder geometry")
    return text


def _describe(reader, config: dict, files: list[str]) -> tuple[families.Arch | None, quant.Quant | None]:
    """(the decoder as its family reads it, the quantization scheme): (None, None) for a family specpack
    does not know, unless the target is quantized (refused: nothing could check its tensors)."""
    root, where = reader.label(), reader.label("config.json")
    hf_quant = reader.json(HF_QUANT, "ModelOpt quantization config") if HF_QUANT in files else None
    try:
        q = quant.scheme(config, hf_quant)
        families.family_of(config)
    except UnsupportedError as exc:
        if config.get("quantization_config") or hf_quant:
            raise UnsupportedError(f"target '{root}' is quantized, and its architecture is not a family specpack "
                                   "knows: no tensor of it could be checked", hint=exc.hint) from None
        log.info("not checking every tensor of %s: %s", root, exc.message)
        return None, None
    except InputError as exc:
        raise InputError(f"{where}: {exc.message}", problems=exc.problems, hint=exc.hint) from None
    try:
        return families.describe(config), q
    except (InputError, UnsupportedError) as exc:
        raise type(exc)(f"{where}: {exc.message}", problems=exc.problems, hint=exc.hint) from None


def _arch_info(c: families.Checked, tensors) -> TargetArch:
    """The manifest's account of the decoder (layer kinds, experts, MTP, quantization, sizes)."""
    a, q = c.arch, c.quant
    total = sum(_numel(t.shape) for t in c.expected.values())
    expert = sum(_numel(t.shape) for name, t in c.expected.items() if ".experts." in name)
    active = total - (expert - expert * a.experts.active // a.experts.routed if a.experts and a.experts.routed else 0)
    kv_bytes = 1 if q and q.kv_cache == "fp8" else _float_bytes(tensors)
    return TargetArch(
        family=a.family, text_config=a.text_config, tensor_prefix=a.prefix, layer_kinds=a.layer_kinds,
        experts=TargetExperts(routed=a.experts.routed, active=a.experts.active, size=a.experts.size,
                              shared=a.experts.shared, shared_size=a.experts.shared_size,
                              layout="fused" if c.fused_experts else "per_expert") if a.experts else None,
        total_parameters=total, active_parameters=active, kv_bytes_per_token=a.kv_bytes_per_token(kv_bytes),
        state_bytes_per_sequence=a.state_bytes_per_sequence(_float_bytes(tensors)),
        draft_len_start=a.draft_len_start,
        mtp=TargetMtp(layout=a.mtp.layout, count_key=a.mtp.count_key, stated=a.mtp.layers, held=c.mtp_held)
        if a.mtp else None,
        quantization=quantization_entry(q, {True: c.quantized, False: c.unquantized}),
        # the runtime reads experts one MLP each, and of quantized checkpoints GGUF blocks
        runs=a.runs and (q is None or q.scheme == "gguf") and not c.fused_experts)


def quantization_entry(q: quant.Quant | None, counts: dict[bool, int]) -> TargetQuantization | None:
    """The manifest's account of a checkpoint's scheme (a target's or a drafter's), with what its
    check counted: {True: linear weights stored quantized, False: stored unquantized}."""
    if q is None:
        return None
    return TargetQuantization(scheme=q.scheme, quant_method=q.quant_method, block=list(q.block) if q.block else None,
                              group=q.group, kv_cache=q.kv_cache, scale_format=q.scale_fmt,
                              expert_dtype=q.expert_dtype, quantized_linear=counts[True],
                              unquantized_linear=counts[False])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _float_bytes(tensors) -> int:
    """Bytes per element of the checkpoint's dominant float dtype (what its caches hold; 2 when none)."""
    floats = {k: v for k, v in DTYPE_BYTES.items() if k in ("F32", "F16", "BF16")}
    counts: dict[str, int] = {}
    for _, meta in tensors.values():
        if meta.dtype in floats:
            counts[meta.dtype] = counts.get(meta.dtype, 0) + meta.end - meta.start
    return floats[max(counts, key=counts.get)] if counts else 2


def _values(name: str, meta, q) -> int:
    """The values a tensor holds: its elements, or, for GGUF blocks (U8 [rows, row bytes]), what they decode to."""
    from specpack.families.gguf_blocks import columns

    kind = q.layer_algos.get(name) if q is not None else None
    if kind is None or meta.dtype != "U8" or len(meta.shape) != 2:
        return meta.numel
    return meta.shape[0] * columns(kind, meta.shape[1])


def _dominant_dtype(tensors) -> str:
    counts: dict[str, int] = {}
    for _, meta in tensors.values():
        counts[meta.dtype] = counts.get(meta.dtype, 0) + meta.end - meta.start
    return TORCH_NAMES.get(max(counts, key=counts.get), "unknown") if counts else "unknown"


def _dtype_bytes(torch_name: str) -> int:
    by_name = {v: DTYPE_BYTES[k] for k, v in TORCH_NAMES.items()}
    return by_name.get(torch_name, 2)


def _tokenizer_digest(reader, files: list[str]) -> str | None:
    present = [f for f in TOKENIZER_FILES if f in files]
    if not present:
        return None
    lines = "".join(f"{f} {reader.sha256(f)}\n" for f in present)
    return hashlib.sha256(lines.encode()).hexdigest()
