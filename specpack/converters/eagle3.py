"""EAGLE-3 heads: the official, SGLang/SpecForge and ModelOpt layouts → one canonical head.

Canonical weights (drafter/model.safetensors): `fc.weight`, `layers.0.{self_attn,mlp}.*`,
`layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`, and `embed_tokens.weight` only when the head's embedding differs
from the target's. Tensors are carried bit for bit; only names change.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

from specpack.converters import drafter_tensors
from specpack.converters.base import AuxOverride, ConvertedDrafter, mismatch_problems
from specpack.converters.target_hf import Target, quantization_entry, read_config, read_json
from specpack.errors import ConversionError, InputError
from specpack.families.base import size_problems
from specpack.families.fields import check_config
from specpack.schemas import AuxLayers, Eagle3Drafter, Source

log = logging.getLogger(__name__)

SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "draft_vocab_size", "vocab_size", "target_hidden_size")
_LAYER = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + \
    [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")] + \
    [f"{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
_TOP = ["fc.weight", "norm.weight", "lm_head.weight"]
REQUIRED = _TOP + [f"layers.0.{k}" for k in _LAYER]
OPTIONAL = ["d2t", "t2d", "embed_tokens.weight"]

_MIDLAYER = {f"midlayer.{k}": f"layers.0.{k}" for k in _LAYER}
_SAME = {k: k for k in _TOP + OPTIONAL}
_MODELOPT = {**{f"layers.0.{k}": f"layers.0.{k}" for k in _LAYER
                if k not in ("input_layernorm.weight", "hidden_norm.weight")},
             "hidden_norm.weight": "layers.0.hidden_norm.weight",
             "input_embeds_norm.weight": "layers.0.input_layernorm.weight",
             "eagle_lm_head.weight": "lm_head.weight",
             **{k: k for k in ("fc.weight", "norm.weight", "d2t", "t2d")}}

# layout -> (source name -> canonical name, how explicit aux ids in its config count)
LAYOUTS = {
    "eagle3-official": ({**_MIDLAYER, **_SAME}, None),
    "eagle3-sglang": ({**_MIDLAYER, **_SAME}, "output_of_layer"),
    "eagle3-modelopt": (_MODELOPT, "output_of_layer"),
    # vLLM speculators (converters/speculators.py reads its nested config): canonical names already
    "eagle3-speculators": ({k: k for k in REQUIRED + OPTIONAL}, "input_of_layer"),
    # llama.cpp's drafter GGUF (converters/eagle3_gguf.py renames to canonical; speculative.cpp: input of layer i)
    "eagle3-llamacpp": ({k: k for k in REQUIRED + OPTIONAL}, "input_of_layer"),
}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class _Geometry:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    target_vocab: int
    target_hidden: int
    layers: int


def detect(path: Path) -> str | None:
    """The layout name of the EAGLE-3 head at `path`, or None when it is not one."""
    path = Path(path)
    if not (path / "config.json").is_file() or not any((path / w).is_file() for w in WEIGHT_FILES):
        return None
    config = read_config(path / "config.json")
    return _layout(config, _tensor_names(path))


def convert(path: Path, target: Target, aux: AuxOverride | None = None,
            source: Source | None = None, allow_mismatch: bool = False) -> ConvertedDrafter:
    """Check the head at `path` against `target` and map it to the canonical layout."""
    path = Path(path)
    config = read_config(path / "config.json")
    raw = load_tensors(path)
    layout = _layout(config, set(raw))
    if layout is None:
        raise InputError(f"'{path}' is not an EAGLE-3 head in a known layout",
                         hint="known layouts: " + ", ".join(LAYOUTS))
    return convert_tensors(layout, config, raw, target, aux, source or Source.local(path), path,
                           allow_mismatch=allow_mismatch)


def convert_tensors(layout: str, config: dict, raw: dict, target: Target, aux: AuxOverride | None,
                    source: Source, path: Path, problems: list[str] | None = None, made_for: list | None = None,
                    allow_mismatch: bool = False) -> ConvertedDrafter:
    """Check a head's tensors `raw` (named as in `layout`) and its flat Llama-style `config` against
    `target`, and map them to the canonical head; `problems` found by the caller are reported along,
    with its statements about the target it was made for (`made_for`) this target contradicts."""
    try:  # a flat config's fields typed, its counts bounded by the head's own tensors
        check_config(config, tensors=len(raw))
    except InputError as exc:
        raise InputError(f"EAGLE-3 head '{path}': {exc.message}", problems=exc.problems, hint=exc.hint) from None
    bad = size_problems(config, optional=SIZE_FIELDS)
    if bad:
        raise InputError(f"EAGLE-3 head '{path}': config sizes that are not positive integers", problems=bad,
                         hint="is this the head's own config.json?")
    tensors, name_problems = _map_names(layout, raw)
    geo, geo_problems = _geometry(config, target, tensors)
    q, stated, quant_problems = drafter_tensors.scheme(path, config)
    made_for = list(made_for or [])
    problems = list(problems or []) + mismatch_problems(made_for, allow_mismatch) + name_problems + geo_problems + \
        quant_problems
    aux_layers, aux_problems = _aux_layers(layout, config, geo, tensors, aux)
    aux_layers = aux_layers.model_copy(update={"produced_by": target.feature_kinds(aux_layers.layer_ids)})
    checked = _check_tensors(layout, tensors, geo, aux_layers, q)
    problems += aux_problems + checked.problems + _embedding_problems(tensors, geo, target)
    t2d_source, map_problems = _check_vocab_map(tensors, geo)
    problems += map_problems
    if problems:
        raise ConversionError(f"EAGLE-3 head '{path}' ({layout}) does not fit target "
                              f"'{target.root}'", problems=problems,
                              hint="is this head made for this target? Fix or re-export the head")
    embedding = _embedding_source(tensors, target)
    converted = _canonical(layout, config, tensors, geo, aux_layers, t2d_source, embedding, source, checked)
    if q:
        converted.config["quantization_config"] = stated
    return replace(converted, entry=converted.entry.model_copy(update={
        "quantization": quantization_entry(q, checked.counts), "made_for": made_for,
        "target_mismatch_allowed": any(m.matches is False for m in made_for)}))


def _tensor_names(path: Path) -> set[str]:
    """Names only: from the safetensors header when there is one (no weights loaded)."""
    if (path / "model.safetensors").is_file():
        from specpack.converters.safetensors_header import read_header

        return set(read_header(path / "model.safetensors"))
    return set(load_tensors(path))


def load_tensors(path: Path) -> dict:
    """The head's tensors: model.safetensors, else a weights-only `pytorch_model.bin`."""
    stray = [p.name for p in path.iterdir() if p.suffix in (".pt", ".pth", ".ckpt", ".pkl", ".gguf")]
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        return _load_pickle(path / "pytorch_model.bin")
    raise InputError(f"'{path}' has no model.safetensors or pytorch_model.bin",
                     problems=[f"found {s}" for s in stray],
                     hint="EAGLE-3 heads are read from safetensors or the official pickle layout")


def _load_pickle(file: Path) -> dict:
    """A weights-only pickle that must hold a dict of tensors (a state dict) and nothing else."""
    import torch

    hint = "only weights-only pickles of a state dict are read; re-save as safetensors"
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise InputError(f"{file} is not a plain tensor checkpoint: {str(exc).splitlines()[0]}",
                         hint=hint) from None
    if not isinstance(state, dict):
        raise InputError(f"{file} is not a plain tensor checkpoint: it holds a Python {type(state).__name__}, "
                         "not a dict of tensors", hint=hint)
    bad = [f"{k!r}: {type(v).__name__}" for k, v in state.items()
           if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise InputError(f"{file} is not a plain tensor checkpoint: entries that are not named tensors",
                         problems=bad, hint=hint)
    return state


def _layout(config: dict, names: set[str]) -> str | None:
    archs = config.get("architectures") or []
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3-sglang" if "LlamaForCausalLMEagle3" in archs else "eagle3-official"
    if {"eagle_lm_head.weight", "input_embeds_norm.weight"} & names:
        return "eagle3-modelopt"
    if "layers.0.self_attn.q_proj.weight" in names and "fc.weight" in names \
            and "speculators_model_type" not in config:
        return "eagle3-modelopt"
    return None


def _map_names(layout: str, raw: dict) -> tuple[dict, list[str]]:
    """The head's tensors under canonical names: a quantized weight's scales (`X.weight_scale`) follow
    their weight's name; what is missing is found by `_check_tensors`."""
    mapping = LAYOUTS[layout][0]
    tensors, problems = {}, []
    for k, v in raw.items():
        name = mapping.get(k) or _scale_name(k, mapping)
        if name is None:
            problems.append(f"tensor '{k}' maps to no canonical name")
        else:
            tensors[name] = v
    return tensors, problems


def _scale_name(name: str, mapping: dict) -> str | None:
    """`X.<suffix>` beside a mapped `X.weight` -> the canonical stem with the same suffix."""
    stem, _, suffix = name.rpartition(".")
    weight = mapping.get(f"{stem}.weight")
    return f"{weight.removesuffix('.weight')}.{suffix}" if weight and weight.endswith(".weight") and suffix else None


def source_names(layout: str) -> dict:
    return {v: k for k, v in LAYOUTS[layout][0].items()}


def _geometry(config: dict, target: Target, tensors: dict) -> tuple[_Geometry, list[str]]:
    t = target.info
    hidden = int(config.get("hidden_size", t.hidden_size))
    heads = int(config.get("num_attention_heads", t.num_attention_heads))
    lm_head = tensors.get("lm_head.weight")
    draft_vocab = int(config.get("draft_vocab_size") or
                      (lm_head.shape[0] if lm_head is not None else config.get("vocab_size", 0)))
    geo = _Geometry(hidden=hidden, heads=heads,
                    kv_heads=int(config.get("num_key_value_heads", heads)),
                    head_dim=int(config.get("head_dim") or hidden // heads),
                    intermediate=int(config.get("intermediate_size", t.intermediate_size)),
                    draft_vocab=draft_vocab, target_vocab=t.vocab_size,
                    target_hidden=int(config.get("target_hidden_size") or t.hidden_size),
                    layers=t.num_hidden_layers)
    problems = []
    if "vocab_size" in config and int(config["vocab_size"]) != t.vocab_size:
        problems.append(f"drafter config vocab_size {config['vocab_size']} != target vocab "
                        f"{t.vocab_size}")
    if geo.target_hidden != t.hidden_size:
        problems.append(f"drafter target_hidden_size {geo.target_hidden} != target hidden size "
                        f"{t.hidden_size}")
    if "target_hidden_size" not in config and hidden != t.hidden_size:
        problems.append(f"drafter hidden_size {hidden} != target hidden size {t.hidden_size} "
                        "(and the config states no target_hidden_size)")
    theirs = (t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    # the head's attention is its own layer; specpack's runtime decodes heads shaped as its dense targets'
    # attention (other families' heads, e.g. a Llama-shaped head on an MLA target, are bound as stated)
    dense = t.arch is None or t.arch.family == "dense"
    if dense and (geo.heads, geo.kv_heads, geo.head_dim) != theirs:
        problems.append("drafter attention geometry (heads {}, KV heads {}, head dim {}) != target's "
                        "(heads {}, KV heads {}, head dim {})".format(geo.heads, geo.kv_heads,
                                                                      geo.head_dim, *theirs))
    if geo.draft_vocab > t.vocab_size:
        problems.append(f"draft vocab {geo.draft_vocab} is larger than the target vocab {t.vocab_size}")
    return geo, problems


def _configured_ids(config: dict) -> list | None:
    eagle = config.get("eagle_config") or {}
    return eagle.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")


def _aux_layers(layout, config, geo, tensors, override) -> tuple[AuxLayers, list[str]]:
    fc = tensors.get("fc.weight")
    width = fc.shape[1] if fc is not None and fc.ndim == 2 else 0
    n_aux = width // geo.target_hidden if width and width % geo.target_hidden == 0 else 3
    ids, convention = _source_ids(layout, config, override)
    if ids is None:
        ids_in = [2, geo.layers // 2, geo.layers - 3] if n_aux == 3 else []
        problems = [] if n_aux == 3 else [
            f"fc.weight fuses {n_aux} hidden states and no aux layer ids are given: there is no "
            "default for that; pass --aux-layer-ids and --aux-convention"]
        return AuxLayers(layer_ids=ids_in, source_convention="default"), problems
    shift = 1 if convention == "output_of_layer" else 0
    ids_in = [int(i) + shift for i in ids]
    return (AuxLayers(layer_ids=ids_in, source_ids=[int(i) for i in ids], source_convention=convention),
            _check_ids(ids, ids_in, convention, geo.layers))


def _source_ids(layout, config, override) -> tuple[list | None, str | None]:
    if override is not None:
        return list(override.ids), override.convention
    ids = _configured_ids(config)
    if ids is None:
        return None, None
    convention = LAYOUTS[layout][1]
    if convention is None:
        raise InputError(f"the {layout} layout defines no aux layer id convention, but its config "
                         f"lists ids {ids}",
                         hint="say how they count: --aux-layer-ids "
                              f"{','.join(map(str, ids))} --aux-convention input|output")
    return ids, convention


def _check_ids(ids, ids_in, convention, layers) -> list[str]:
    problems = []
    if len(set(ids)) != len(ids):
        problems.append(f"aux layer ids {list(ids)} contain duplicates")
    lo, hi = (0, layers - 1) if convention == "input_of_layer" else (-1, layers - 2)
    problems += [f"aux layer id {i} ({convention}) is out of range [{lo}, {hi}] for a "
                 f"{layers}-layer target" for i, j in zip(ids, ids_in) if not 0 <= j <= layers - 1]
    return problems


def _expected_shapes(geo: _Geometry, n_aux: int) -> dict[str, tuple]:
    h, q, kv = geo.hidden, geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim
    shapes = {"fc.weight": (h, n_aux * geo.target_hidden), "norm.weight": (h,),
              "lm_head.weight": (geo.draft_vocab, h), "d2t": (geo.draft_vocab,),
              "t2d": (geo.target_vocab,), "embed_tokens.weight": (geo.target_vocab, h)}
    layer = {"self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
             "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (geo.intermediate, h), "mlp.up_proj.weight": (geo.intermediate, h),
             "mlp.down_proj.weight": (h, geo.intermediate), "input_layernorm.weight": (h,),
             "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    return {**shapes, **{f"layers.0.{k}": v for k, v in layer.items()}}


def _check_tensors(layout: str, tensors: dict, geo: _Geometry, aux: AuxLayers, q) -> drafter_tensors.Checked:
    """Every tensor, float or as the scheme `q` stores it (drafter_tensors.check), and fc's width
    against the aux layers (named first: its usual cause is a wrong aux layer count)."""
    n_aux = len(aux.layer_ids) or 3
    expected = _expected_shapes(geo, n_aux)
    fc, problems = tensors.get("fc.weight"), []
    if fc is not None and fc.ndim == 2 and fc.element_size() > 1:  # a packed fc is checked by its scheme
        if fc.shape[1] != n_aux * geo.target_hidden:
            problems.append(f"fc.weight takes {fc.shape[1]} inputs, but {n_aux} aux layers × target "
                            f"hidden {geo.target_hidden} = {n_aux * geo.target_hidden}")
        if fc.shape[0] != geo.hidden:
            problems.append(f"fc.weight: {fc.shape[0]} outputs, expected hidden size {geo.hidden}")
        expected["fc.weight"] = None if problems else expected["fc.weight"]
    names = source_names(layout)
    checked = drafter_tensors.check(expected, tensors, q, _linear, OPTIONAL, ("d2t", "t2d"),
                                    lambda n: names.get(n, n))
    checked.problems[:0] = problems
    return checked


def _linear(name: str) -> bool:
    return name.endswith("_proj.weight") or name in ("fc.weight", "lm_head.weight")


def check_vocab_map(tensors: dict, draft_vocab: int, target_vocab: int) -> tuple[str, list[str]]:
    """The d2t/t2d checks below for another converter (block drafters): (t2d source, problems)."""
    from types import SimpleNamespace

    return _check_vocab_map(tensors, SimpleNamespace(draft_vocab=draft_vocab, target_vocab=target_vocab))


def _check_vocab_map(tensors: dict, geo: _Geometry) -> tuple[str, list[str]]:
    """Check d2t/t2d; derive t2d when only d2t came (ModelOpt). Returns (t2d source, problems)."""
    import torch

    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if geo.draft_vocab == geo.target_vocab and d2t is None:
        tensors.pop("t2d", None)
        return "none", []
    if d2t is None:
        return "none", [f"draft vocab {geo.draft_vocab} < target vocab {geo.target_vocab} but the "
                        "head has no d2t map: its tokens cannot be mapped to target ids"]
    if tuple(d2t.shape) != (geo.draft_vocab,) or d2t.dtype not in (torch.int64, torch.int32):
        return "none", [f"d2t must be int64 [{geo.draft_vocab}], got {d2t.dtype} {list(d2t.shape)}"]
    ids = torch.arange(geo.draft_vocab) + d2t.long()
    bad = ((ids < 0) | (ids >= geo.target_vocab)).nonzero().flatten()
    if len(bad):
        return "none", [f"d2t maps draft ids {bad[:5].tolist()} outside the target vocab "
                        f"[0, {geo.target_vocab}) ({len(bad)} in all)"]
    if ids.unique().numel() != ids.numel():
        return "none", [f"d2t is not injective: {ids.numel() - ids.unique().numel()} draft ids map "
                        "to a target id another draft id already has"]
    derived = torch.zeros(geo.target_vocab, dtype=torch.bool)
    derived[ids] = True
    if t2d is None:
        tensors["t2d"] = derived
        return "derived", []
    if t2d.dtype != torch.bool or not torch.equal(t2d, derived):
        return "checkpoint", ["t2d disagrees with d2t: it must mark exactly the target ids d2t maps to"]
    return "checkpoint", []


def _embedding_problems(tensors: dict, geo: _Geometry, target: Target) -> list[str]:
    """A head of another width than the target cannot take the target's token embeddings: without
    its own it cannot run (engines would run it with an embedding it was never trained with)."""
    width = target.info.hidden_size
    if "embed_tokens.weight" in tensors or geo.hidden == width:
        return []
    return [f"the head's hidden size is {geo.hidden} but the target's is {width}, and the head has no "
            f"embed_tokens of its own: its layer needs token embeddings of width {geo.hidden}, which the "
            f"target's [{geo.target_vocab}, {width}] embedding cannot give; export the head with its "
            f"embed_tokens.weight [{geo.target_vocab}, {geo.hidden}]"]


def _embedding_source(tensors: dict, target: Target) -> str:
    emb = tensors.get("embed_tokens.weight")
    if emb is None:
        return "target"
    from safetensors import safe_open

    file, _ = target.tensors.get(target.embed_name, (None, None))
    if file is not None:
        with safe_open(target.root / file, "pt") as f:
            if emb.equal(f.get_tensor(target.embed_name).to(emb.dtype)):
                del tensors["embed_tokens.weight"]  # a copy of the target's: not stored twice
                return "target"
    log.warning("the head's embed_tokens differs from the target's embedding: keeping the head's")
    return "drafter"


def _canonical(layout, config, tensors, geo, aux, t2d_source, embedding, source, checked) -> ConvertedDrafter:
    dtype = drafter_tensors.float_dtype(tensors, checked.held)
    norm_before_residual = bool(config.get("norm_before_residual", False))
    canonical_config = {
        "kind": "eagle3", "hidden_size": geo.hidden, "intermediate_size": geo.intermediate,
        "num_attention_heads": geo.heads, "num_key_value_heads": geo.kv_heads,
        "head_dim": geo.head_dim, "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(config.get("rope_theta", 10000.0)),
        "rope_scaling": config.get("rope_scaling"),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "hidden_act": config.get("hidden_act", "silu"), "target_hidden_size": geo.target_hidden,
        "aux_layer_ids": aux.layer_ids, "draft_vocab_size": geo.draft_vocab,
        "target_vocab_size": geo.target_vocab, "embedding": embedding,
        "norm_before_residual": norm_before_residual}
    params = drafter_tensors.parameters(checked.held, tensors, ("d2t", "t2d"))
    entry = Eagle3Drafter(
        source_layout=layout, source=source, dtype=dtype, parameters=params, hidden_size=geo.hidden,
        aux_hidden_states=aux, draft_vocab_size=geo.draft_vocab,
        vocab_map="d2t" if "d2t" in tensors else "identity", t2d_source=t2d_source,
        embedding_source=embedding, norm_before_residual=norm_before_residual)
    kv = 2 * geo.kv_heads * geo.head_dim * drafter_tensors.FLOAT_BYTES.get(dtype, 2)
    return ConvertedDrafter(entry=entry, config=canonical_config, tensors=tensors,
                            kv_bytes_per_token=kv)
