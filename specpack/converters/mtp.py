"""MTP (multi-token prediction) layers in the DeepSeek-V3/GLM, Qwen3-Next and MiMo layouts → one
canonical MTP drafter.

Two sources, same checks: the target's own checkpoint (`--drafter mtp`; only safetensors headers are
read, plus DeepSeek's duplicated embedding/head, which are compared with the target's), or a separate
head directory holding the same published tensor names (for a target whose upload lost them).

Canonical names, per MTP layer k (runtime/mtp.py):
  layers.{k}.embed_norm.weight   norm of the next token's embedding   (enorm | pre_fc_norm_embedding | token_layernorm)
  layers.{k}.hidden_norm.weight  norm of the incoming hidden state    (hnorm | pre_fc_norm_hidden | hidden_layernorm)
  layers.{k}.proj.weight         [H, 2H] over the concatenation       (eh_proj | fc | input_proj)
  layers.{k}.final_norm.weight   norm before the target's lm_head     (shared_head.norm | norm | final_layernorm)
  layers.{k}.block.*             one decoder layer, named like the target's own layers

In-target MTP stays where it is: drafter/config.json maps each canonical name to its target tensor,
so nothing is stored twice. A separate head is written to drafter/model.safetensors.

Which target hidden state feeds layer 0, and what layer k hands to layer k+1, follow the serving code
that runs the released weights (vLLM `deepseek_v2.py`/`deepseek_mtp.py`, `qwen3_next_mtp.py`,
`mimo.py`/`mimo_mtp.py`): DeepSeek and Qwen3-Next read the target's final-norm output, MiMo the last
layer's output before the norm; DeepSeek chains the pre-norm block output, Qwen3-Next and MiMo the
normed one. Qwen3-Next's norms are zero-centred (weight + 1).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from specpack.converters.base import ConvertedDrafter
from specpack.converters.safetensors_header import TORCH_NAMES, TensorMeta, read_header
from specpack.converters.safetensors_header import data_start as _data_start
from specpack.converters.target_hf import INDEX_NAME, Target, _dtype_bytes, read_config, read_weight_map
from specpack.errors import ConversionError, InputError, UnsupportedError
from specpack.schemas import MtpDrafter, Source

log = logging.getLogger(__name__)
KIND = "mtp"
IN_TARGET = "in-target"
_FUSION = ("embed_norm.weight", "hidden_norm.weight", "proj.weight", "final_norm.weight")


@dataclass(frozen=True)
class Layout:
    name: str
    layer_prefix: str  # "{i}" = the index as written
    counts_after_target: bool  # DeepSeek numbers MTP layers after the target's: index = L + k
    fusion: tuple[str, str, str, str]  # sources of _FUSION; "{p}" = the layer's prefix
    duplicates: tuple[tuple[str, str], ...]  # (suffix under {p}, "embedding" | "lm_head")
    concat_order: str
    target_hidden_state: str
    chain_hidden_state: str
    norm_offset: float = 0.0

    def prefix(self, k: int, layers: int) -> str:
        return self.layer_prefix.format(i=k + layers if self.counts_after_target else k)

    def index(self, written: int, layers: int) -> int:
        return written - layers if self.counts_after_target else written


LAYOUTS = {
    "mtp-deepseek": Layout("mtp-deepseek", "model.layers.{i}.", True,
                           ("{p}enorm.weight", "{p}hnorm.weight", "{p}eh_proj.weight", "{p}shared_head.norm.weight"),
                           (("embed_tokens.weight", "embedding"), ("shared_head.head.weight", "lm_head")),
                           "embedding_first", "final_norm_output", "pre_norm"),
    "mtp-qwen3-next": Layout("mtp-qwen3-next", "mtp.layers.{i}.", False,
                             ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                              "mtp.norm.weight"), (), "embedding_first", "final_norm_output", "post_norm", 1.0),
    "mtp-mimo": Layout("mtp-mimo", "model.mtp_layers.{i}.", False,
                       ("{p}token_layernorm.weight", "{p}hidden_layernorm.weight", "{p}input_proj.weight",
                        "{p}final_layernorm.weight"), (), "hidden_first", "last_layer_output", "post_norm"),
    # Nemotron 3: a step's layers follow mtp_hybrid_override_pattern (families/nemotron_h.py names them);
    # vLLM nemotron_h_mtp.py feeds it norm_f's output and hands on the final_layernorm's
    "mtp-nemotron-h": Layout("mtp-nemotron-h", "mtp.layers.{i}.", False,
                             ("{p}enorm.weight", "{p}hnorm.weight", "{p}eh_proj.weight", "{p}final_layernorm.weight"),
                             (), "embedding_first", "final_norm_output", "post_norm"),
}
_SIGNATURES = (("mtp-qwen3-next", re.compile(r"^mtp\.(fc\.weight|layers\.\d+\.)")),
               ("mtp-mimo", re.compile(r"^model\.mtp_layers\.\d+\.")),
               ("mtp-deepseek", re.compile(r"^model\.layers\.\d+\.(eh_proj|enorm|hnorm|shared_head)\.")))


@dataclass(frozen=True)
class _Source:
    """Tensor headers of where MTP tensors are read from, and the file holding each."""

    meta: dict[str, TensorMeta]
    files: dict[str, Path]
    config: dict  # its config.json (the target's, or the head's; {} when absent)
    source: Source
    location: str  # "target" | "drafter"


def detect(path: Path) -> str | None:
    """The MTP layout of a separate head directory at `path`, or None when it holds no MTP tensors."""
    path = Path(path)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        return None
    return _layout_of(_head_files(path))


def convert_in_target(target: Target, allow_reuse: bool = False) -> ConvertedDrafter:
    """The MTP modules inside `target`'s own checkpoint, every tensor checked as its family names and
    shapes it (quantized ones per the checkpoint's scheme), as a drafter pointing into its files."""
    checked = target.checked
    if checked is None:
        raise UnsupportedError(f"target architecture {target.info.architecture} is not a family specpack reads, so "
                               "its MTP layers cannot be found", hint="use an EAGLE-3 head, a draft model or 'ngram'")
    arch = checked.arch
    if arch.mtp is None:
        advertised = arch.details.get("advertised_mtp")
        raise ConversionError(
            f"target '{target.files_reader.label()}' ({arch.family}) has no MTP modules: its config states none"
            + (f" (it advertises {advertised}, {arch.details.get('mtp_why', 'whose weights were never published')})"
               if advertised else ""),
            hint="use an EAGLE-3 head, a draft model or 'ngram' for this target")
    files = target.files_reader  # the release's files, local or on the hub (release_files)
    config = _text_config(files.json("config.json", "target config"))
    if checked.mtp_held == 0:
        raise _absent(f"target '{files.label()}'", arch.mtp.layers, files.json("config.json", "target"))
    n = arch.mtp.layers or checked.mtp_held
    meta = {name: m for name, (_, m) in target.tensors.items()}
    mapping, problems = {}, []
    if arch.mtp.layers and checked.mtp_held < n:
        problems.append(f"the config states {n} MTP module(s) ({arch.mtp.count_key}), the checkpoint holds "
                        f"{checked.mtp_held}")
    for k in range(n):
        m, p = _family_module(arch, k, meta, checked)
        mapping, problems = {**mapping, **m}, problems + p
    layout = LAYOUTS[arch.mtp.layout]
    duplicates = {name: role for k in range(n) for suffix, role in layout.duplicates
                  if (name := layout.prefix(k, target.info.num_hidden_layers) + suffix) in meta}
    src = _Source(meta, {name: target.root / f for name, (f, _) in target.tensors.items()}, config,
                  target.info.source, "target")
    problems += _duplicate_problems(duplicates, src, target)
    if problems:
        raise ConversionError(f"the MTP layers of target '{target.root}' ({layout.name}) are incomplete or do not fit "
                              "it", problems=problems, hint="use the original checkpoint, or a head made for exactly "
                                                            "this target")
    return _canonical(layout, src, target, config, mapping, sorted(duplicates), n, allow_reuse)


def _family_module(arch, k: int, meta: dict, checked) -> tuple[dict, list[str]]:
    """(canonical -> target tensor, problems) for MTP module k, as its family names it."""
    from specpack import families
    from specpack.families import quant

    module = families.FAMILIES[arch.family]
    expected = families.mtp_tensors(arch, k, checked.fused_experts)
    if not any(name in meta for name in expected):
        return {}, [f"MTP layer {k} ({families.FAMILIES[arch.family].mtp_block(arch, k)[0]}*): none of its "
                    f"{len(expected)} tensors is present"]
    problems = [p for name, t in expected.items() for p in quant.check(name, t, meta, checked.quant)[0]]
    mapping = {f"layers.{k}.{_ROLES[role]}": name for role, name in module.mtp_fusion(arch, k).items()}
    prefix, block = module.mtp_block(arch, k, checked.fused_experts)
    mapping.update({f"layers.{k}.block.{name[len(prefix):]}": name for name in block})
    return mapping, problems


_ROLES = dict(zip(("embed_norm", "hidden_norm", "proj", "final_norm"), _FUSION))


def convert(path: Path, target: Target, allow_reuse: bool = False, source: Source | None = None,
            label: str | None = None) -> ConvertedDrafter:
    """A separate MTP head directory (published tensor names) for `target`, checked and copied (`label`: how
    errors name it, where it was read from elsewhere: a GGUF's nextn block)."""
    path = Path(path)
    files = _head_files(path)
    layout = _layout_of(files)
    if layout is None:
        raise InputError(f"'{path}' holds no MTP tensors in a known layout", hint="known: " + ", ".join(LAYOUTS))
    meta = {}
    for file in sorted(set(files.values())):
        meta.update({n: m for n, m in read_header(file).items() if files.get(n) == file})
    has_config = (path / "config.json").is_file()
    config = _text_config(read_config(path / "config.json", "MTP head config")) if has_config else {}
    src = _Source(meta, files, config, source or Source.local(path), "drafter")
    return _convert(LAYOUTS[layout], src, target, allow_reuse, label or f"MTP head '{path}'")


# ---- shared by both sources ----

def _convert(layout: Layout, src: _Source, target: Target, allow_reuse: bool, where: str) -> ConvertedDrafter:
    L = target.info.num_hidden_layers
    found = _found_layers(layout, src.meta, L)
    declared = _declared(src.config)
    if not found:
        raise _absent(where, declared, src.config)
    n = declared or max(found) + 1
    target_config = _text_config(target.files_reader.json("config.json", "target config"))
    template = _template(target, target_config)
    mapping, duplicates, problems = {}, {}, _config_problems(src.config, target)
    for k in range(n):
        m, d, p = _check_layer(layout, k, L, src.meta, template, target.info.hidden_size)
        mapping, duplicates, problems = {**mapping, **m}, {**duplicates, **d}, problems + p
    problems += [f"MTP layer {k} ({layout.prefix(k, L)}*) is beyond the {n} layer(s) the config declares"
                 for k in sorted(found) if k >= n]
    problems += _duplicate_problems(duplicates, src, target)
    if problems:
        raise ConversionError(f"the MTP layers of {where} ({layout.name}) are incomplete or do not fit the target",
                              problems=problems, hint="use the original (unquantised) checkpoint, or a head made "
                                                      "for exactly this target")
    return _canonical(layout, src, target, target_config, mapping, sorted(duplicates), n, allow_reuse)


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def _declared(config: dict) -> int:
    return int(config.get("num_nextn_predict_layers") or config.get("mtp_num_hidden_layers") or 0)


def _absent(where: str, declared: int, config: dict) -> ConversionError:
    if declared:
        quantised = " (this is a quantised checkpoint)" if config.get("quantization_config") else ""
        return ConversionError(
            f"{where} declares {declared} MTP layer(s) but holds no MTP tensors: they were stripped{quantised}",
            hint="quantised re-uploads often drop MTP layers: build from the original checkpoint, or pass the "
                 "MTP layers as a separate head directory (--drafter DIR)")
    return ConversionError(f"{where} has no MTP layers (num_nextn_predict_layers is 0 or absent)",
                           hint="this model was released without MTP; use an EAGLE-3 head, a draft model or 'ngram'")


def _found_layers(layout: Layout, meta: dict, layers: int) -> set[int]:
    pattern = re.compile("^" + re.escape(layout.layer_prefix).replace(r"\{i\}", r"(\d+)"))
    found = {layout.index(int(m.group(1)), layers) for m in map(pattern.match, meta) if m}
    found = {k for k in found if k >= 0}
    if not found and any(f in meta for f in layout.fusion if "{p}" not in f):
        found = {0}  # shared fusion tensors without any layer: report the layer as missing
    return found


def _template(target: Target, config: dict) -> dict[str, tuple]:
    """Suffix -> shape of the target layer the MTP block must equal: the last one, or the last
    full-attention one in hybrid stacks (Qwen3-Next), whose MTP layer is a full-attention layer."""
    L = target.info.num_hidden_layers
    types = config.get("layer_types") or []
    full = [i for i, t in enumerate(types[:L]) if t == "full_attention"]
    if not types and config.get("full_attention_interval"):
        full = [i for i in range(L) if (i + 1) % int(config["full_attention_interval"]) == 0]
    prefix = f"model.layers.{full[-1] if full else L - 1}."
    return {n[len(prefix):]: m.shape for n, (_, m) in target.tensors.items() if n.startswith(prefix)}


def _check_layer(layout: Layout, k: int, L: int, meta: dict, template: dict, H: int):
    """(canonical -> source name, duplicate source -> role, problems) for MTP layer k."""
    p = layout.prefix(k, L)
    mapping, problems = {}, []
    for canonical, source in zip(_FUSION, layout.fusion):
        source = source.format(p=p)
        want = (H, 2 * H) if canonical == "proj.weight" else (H,)
        problems += _shape_problem(meta, source, want)
        mapping[f"layers.{k}.{canonical}"] = source
    duplicates = {p + s: role for s, role in layout.duplicates if p + s in meta}
    skip = set(mapping.values()) | set(duplicates)
    block = {n[len(p):]: m for n, m in meta.items() if n.startswith(p) and n not in skip}
    if not block and not any(s in meta for s in skip):
        return {}, {}, [f"MTP layer {k} ({p}*): none of its {len(template) + 4} tensors is present"]
    for suffix, shape in template.items():
        problems += _shape_problem(meta, p + suffix, shape)
        mapping[f"layers.{k}.block.{suffix}"] = p + suffix
    problems += [f"tensor '{p + s}' maps to no canonical name (the target's layers have no such tensor)"
                 for s in sorted(set(block) - set(template))]
    return mapping, duplicates, problems


def _shape_problem(meta: dict, name: str, want: tuple) -> list[str]:
    if name not in meta:
        return [f"missing tensor '{name}'"]
    got = tuple(meta[name].shape)
    return [] if got == tuple(want) else [f"{name}: shape {list(got)}, expected {list(want)}"]


def _config_problems(config: dict, target: Target) -> list[str]:
    t = target.info
    return [f"the head's config says {key} {config[key]}, the target has {mine}: made for another target?"
            for key, mine in (("num_hidden_layers", t.num_hidden_layers), ("hidden_size", t.hidden_size),
                              ("vocab_size", t.vocab_size)) if key in config and int(config[key]) != mine]


def _target_tensor(target: Target, role: str) -> str:
    return target.lm_head_name if role == "lm_head" else target.embed_name


def _duplicate_problems(duplicates: dict, src: _Source, target: Target) -> list[str]:
    problems = []
    for name, role in sorted(duplicates.items()):
        theirs = _target_tensor(target, role)
        if theirs not in target.tensors:
            problems.append(f"{name} duplicates the target's {role}, but the target has no {theirs}")
        elif not _same_tensor(src.files[name], src.meta[name], target.root / target.tensors[theirs][0],
                              target.tensors[theirs][1], name, theirs):
            problems.append(f"{name} differs from the target's {theirs}: the MTP layer was trained with another "
                            f"{role.replace('_', ' ')} (a fine-tune of the target without its MTP layers?)")
    return problems


def _same_tensor(path_a: Path, a: TensorMeta, path_b: Path, b: TensorMeta, name_a: str, name_b: str) -> bool:
    """Equal shape and values; raw bytes compared in chunks when the dtypes match (no full load)."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    if a.dtype != b.dtype:
        return _same_values(path_a, name_a, path_b, name_b, a.shape[0])
    chunk, size = 1 << 24, a.end - a.start
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        fa.seek(_data_start(path_a) + a.start)
        fb.seek(_data_start(path_b) + b.start)
        for done in range(0, size, chunk):
            step = min(chunk, size - done)
            if fa.read(step) != fb.read(step):
                return False
    return True


def _same_values(path_a: Path, name_a: str, path_b: Path, name_b: str, rows: int) -> bool:
    from safetensors import safe_open

    with safe_open(path_a, "pt") as fa, safe_open(path_b, "pt") as fb:
        sa, sb = fa.get_slice(name_a), fb.get_slice(name_b)
        for i in range(0, rows, 4096):
            if not sa[i : i + 4096].float().equal(sb[i : i + 4096].float()):
                return False
    return True


def _canonical(layout, src, target, target_config, mapping, duplicates, n, allow_reuse) -> ConvertedDrafter:
    t = target.info
    metas = [src.meta[s] for s in mapping.values()]
    nbytes = sum(m.end - m.start for m in metas)
    counts: dict[str, int] = {}
    for m in metas:
        counts[m.dtype] = counts.get(m.dtype, 0) + m.end - m.start
    config = {"kind": KIND, "layout": layout.name, "num_layers": n, "hidden_size": t.hidden_size,
              "vocab_size": t.vocab_size, "rms_norm_eps": float(target_config.get("rms_norm_eps") or 1e-6),
              "norm_offset": layout.norm_offset, "concat_order": layout.concat_order,
              "target_hidden_state": layout.target_hidden_state, "chain_hidden_state": layout.chain_hidden_state,
              "allow_layer_reuse": bool(allow_reuse), "weights": src.location}
    shared = [target.embed_name, target.lm_head_name]
    shared += [target.norm_name] if layout.target_hidden_state == "final_norm_output" else []
    entry = MtpDrafter(
        source_layout=layout.name, source=src.source, location=src.location,
        weights="drafter/model.safetensors" if src.location == "drafter" else None,
        dtype=TORCH_NAMES.get(max(counts, key=counts.get), "unknown"), parameters=sum(m.numel for m in metas),
        num_layers=n, concat_order=layout.concat_order, target_hidden_state=layout.target_hidden_state,
        chain_hidden_state=layout.chain_hidden_state, shared_tensors=list(dict.fromkeys(shared)),
        duplicates_checked=duplicates, allow_layer_reuse=bool(allow_reuse))
    kv = n * _kv_width(target_config, t) * _dtype_bytes(t.dtype)
    if src.location == "target":
        return ConvertedDrafter(entry=entry, config={**config, "tensors": mapping}, kv_bytes_per_token=kv,
                                extra_weight_bytes=nbytes)
    return ConvertedDrafter(entry=entry, config=config, tensors=_read(src, mapping), kv_bytes_per_token=kv)


def _kv_width(config: dict, t) -> int:
    """Cached values per token and layer: MLA's latent + rope key, else keys and values."""
    if config.get("kv_lora_rank"):
        return int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
    return 2 * t.num_key_value_heads * t.head_dim


def _read(src: _Source, mapping: dict) -> dict:
    from safetensors import safe_open

    out = {}
    for file in sorted({src.files[s] for s in mapping.values()}):
        with safe_open(file, "pt") as f:
            out.update({c: f.get_tensor(s) for c, s in mapping.items() if src.files[s] == file})
    return out


def _head_files(path: Path) -> dict[str, Path]:
    """tensor name -> file, for a head directory (an index, else every *.safetensors in it)."""
    if (path / INDEX_NAME).is_file():
        weight_map = read_weight_map(path)
        return {n: path / f for n, f in weight_map.items()}
    files = {}
    for file in sorted(path.glob("*.safetensors")):
        files.update({n: file for n in read_header(file)})
    return files


def _layout_of(names) -> str | None:
    for layout, pattern in _SIGNATURES:
        if any(pattern.match(n) for n in names):
            return layout
    return None
