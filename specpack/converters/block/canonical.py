"""From a `Reading` to the canonical block drafter: settle every binding, check everything against
the target (all problems at once), and write the canonical config and manifest entry
(docs/format.md). Tensors are only renamed; a shipped copy of a target tensor is compared
bit for bit and, when equal, not stored twice (its SHA-256 is recorded instead).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from specpack.converters.base import AuxOverride, BlockOverrides, ConvertedDrafter, mismatch_problems
from specpack.converters.block import lilicorr, tables
from specpack.converters.block.common import (CONFIDENCE, LAYER_BIASES, LAYER_WEIGHTS, MARKOV, SINK, Reading,
                                              check_target, dflash_config, flag_problems, id_problems, is_int,
                                              resolve, resolve_target_ids)
from specpack.converters import drafter_tensors
from specpack.converters.target_hf import Target, quantization_entry
from specpack.errors import ConversionError, InputError
from specpack.families.base import size_problems
from specpack.families.dense import SIZE_FIELDS, rope_from_config
from specpack.schemas import MadeFor

log = logging.getLogger(__name__)
_SLIDING = "sliding_attention"


@dataclass(frozen=True)
class Geometry:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    attention_bias: bool
    target_hidden: int
    vocab: int  # input embedding rows
    draft_vocab: int  # lm_head rows
    target_vocab: int


def build(r: Reading, target: Target, aux: AuxOverride | None, block: BlockOverrides | None,
          source, allow_mismatch: bool = False) -> ConvertedDrafter:
    """Settle, check and canonicalise the drafter `r` for `target`; ConversionError lists every problem."""
    check_target(target)
    block = block or BlockOverrides()
    r.problems += flag_problems(block)
    geo = _geometry(r, target)
    r.problems += mismatch_problems(r.made_for, allow_mismatch)
    bind = _bindings(r, block, geo, target, aux)
    q, stated, bad = drafter_tensors.scheme(r.path, r.raw)
    checked = _tensor_problems(r, geo, bind, q)
    r.problems += bad + checked.problems
    if not r.problems:
        bind.update(tables.sharing(r, geo, target, bind["algorithm"]))
    if r.problems:
        raise ConversionError(f"block drafter '{r.path}' ({r.layout}) cannot be bound to target '{target.root}'",
                              problems=r.problems,
                              hint="flags named above settle what the checkpoint leaves open (see `specpack build "
                                   "--help`); anything else means the drafter was made for another target or its "
                                   "config lost a field: fix or re-export it")
    converted = _canonical(r, geo, bind, source, q, stated, checked)
    features = converted.entry.target_features
    kinds = target.feature_kinds(features.layer_ids)
    return replace(converted, entry=converted.entry.model_copy(
        update={"target_features": features.model_copy(update={"produced_by": kinds})}))


# ---- geometry ----

def _geometry(r: Reading, target: Target) -> Geometry:
    cfg, t = r.config, target.info
    bad = size_problems(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"),
                        (*SIZE_FIELDS, "target_hidden_size", "draft_vocab_size"))
    bad += size_problems(r.raw, (), ("target_hidden_size", "draft_vocab_size")) if r.raw is not cfg else []
    if bad:
        raise InputError(f"block drafter '{r.path}': config sizes missing or not positive integers", problems=bad,
                         hint="is this the drafter's own config.json?")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    emb, head = r.tensors.get("embed_tokens.weight"), r.tensors.get("lm_head.weight")
    vocab = emb.shape[0] if emb is not None and emb.ndim == 2 else int(cfg.get("vocab_size") or t.vocab_size)
    draft_vocab = head.shape[0] if head is not None and head.ndim == 2 else \
        int(r.raw.get("draft_vocab_size") or cfg.get("draft_vocab_size") or vocab)
    geo = Geometry(hidden=hidden, layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or
                                                                                       hidden // heads),
                   intermediate=cfg["intermediate_size"], attention_bias=bool(cfg.get("attention_bias", False)),
                   target_hidden=int(r.raw.get("target_hidden_size") or cfg.get("target_hidden_size") or hidden),
                   vocab=vocab, draft_vocab=draft_vocab, target_vocab=t.vocab_size)
    r.problems += _geometry_problems(r, geo, target)
    return geo


def _geometry_problems(r: Reading, geo: Geometry, target: Target) -> list[str]:
    t, cfg, out = target.info, r.config, []
    if geo.target_hidden != t.hidden_size:
        out.append(f"the drafter reads target features of width {geo.target_hidden} (target_hidden_size, else its "
                   f"hidden size), the target's hidden size is {t.hidden_size}")
    if "vocab_size" in cfg and "embed_tokens.weight" in r.tensors and int(cfg["vocab_size"]) != geo.vocab:
        out.append(f"config vocab_size {cfg['vocab_size']} != the {geo.vocab} rows of its embed_tokens")
    if geo.vocab < geo.target_vocab:
        out.append(f"the drafter's input vocab ({geo.vocab}) is smaller than the target's ({geo.target_vocab}): "
                   "target token ids would index past its embedding")
    if geo.vocab > geo.target_vocab and "embed_tokens.weight" not in r.tensors:
        out.append(f"the drafter's vocab_size {geo.vocab} exceeds the target's {geo.target_vocab}, but it ships no "
                   "embed_tokens of its own (vLLM refuses such a checkpoint too: qwen3_dspark.py @ 0302ff40)")
    if geo.draft_vocab > geo.target_vocab:
        out.append(f"draft vocab {geo.draft_vocab} is larger than the target vocab {geo.target_vocab}")
    declared = r.raw.get("num_target_layers", dflash_config(r.raw).get("num_target_layers"))
    if declared is not None and not (isinstance(declared, int) and not isinstance(declared, bool) and declared > 0):
        out.append(f"num_target_layers = {str(declared)[:40]!s}: not a positive integer (a layer count)")
    elif declared is not None:
        r.made_for.append(MadeFor(stated_in="num_target_layers", value=declared, target=t.num_hidden_layers,
                                  matches=declared == t.num_hidden_layers))
    if cfg.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {cfg.get('hidden_act')!r}: only silu (every published block drafter uses it)")
    if dflash_config(r.raw).get("use_aux_hidden_state", r.raw.get("use_aux_hidden_state", True)) is False:
        out.append("use_aux_hidden_state is false (no fc; the last hidden state only): not a layout specpack runs")
    return out


# ---- bindings ----

def _bindings(r: Reading, block: BlockOverrides, geo: Geometry, target: Target, aux) -> dict:
    algorithm, alg_from = resolve(r, "algorithm", block.algorithm)
    layout, layout_from = resolve(r, "query_layout", block.layout)
    mask, mask_from = resolve(r, "mask_token_id", block.mask_token_id)
    size, size_from = resolve(r, "block_size")
    ids = resolve_target_ids(r, aux, target.info.num_hidden_layers)
    if ids is not None:
        r.problems += id_problems(ids[0], target.info.num_hidden_layers)
    bind = {"algorithm": algorithm, "query_layout": layout, "mask_token_id": mask, "block_size": size, "ids": ids,
            "resolved_from": {"algorithm": alg_from, "query_layout": layout_from, "mask_token_id": mask_from,
                              "block_size": size_from, "target_layer_ids": ids[3] if ids else None}}
    logit_scale = r.raw.get("logit_scale")
    bind.update(rms_norm_eps=float(r.config.get("rms_norm_eps", 1e-6)), mask_embedding="mask_embedding" in r.tensors,
                logit_scale=float(logit_scale) if isinstance(logit_scale, (int, float)) and logit_scale != 1 else None)
    bind.update(_heads(r, geo, algorithm))
    bind.update(_rope(r, target))
    bind.update(_attention(r, geo))
    r.problems += _binding_problems(r, geo, bind)
    return bind


def _optional(r: Reading, binding: str):
    if not r.says.get(binding):
        return None, None
    return resolve(r, binding)


def _heads(r: Reading, geo: Geometry, algorithm) -> dict:
    """Markov rank and type, confidence head: the config's statements and the tensors' evidence
    (added by the family module) must agree; an unmatched head is never dropped (vLLM drops it
    silently: qwen3_dspark.py @ 0302ff40)."""
    rank, rank_from = _optional(r, "markov_rank")
    kind, kind_from = _optional(r, "markov_type")
    conf, conf_from = _optional(r, "confidence")
    with_markov, wm_from = _optional(r, "confidence_with_markov") if conf else (None, None)
    if rank is not None and not (is_int(rank) and rank >= 0) or kind is not None and kind not in MARKOV:
        r.problems.append(f"Markov head: rank {rank!r} / type {kind!r} (rank a non-negative integer; type vanilla, "
                          "gated or rnn)")
        rank = None
    markov = {"rank": rank, "type": kind or "vanilla"} if rank else None
    out = {"markov": markov, "confidence": {"with_markov": bool(with_markov)} if conf else None,
           "lilicorr": r.lilicorr if algorithm == "lilicorr" else None}
    out["heads_from"] = {"markov": "; ".join(filter(None, (rank_from, kind_from))) or None,
                         "confidence": "; ".join(filter(None, (conf_from, wm_from))) or None}
    if algorithm == "dflash" and (markov or conf):
        r.problems.append("the checkpoint carries DSpark heads (Markov / confidence) but its algorithm is dflash: "
                          "they would be dropped; pass --block-algorithm dspark if it is a DSpark drafter")
    if algorithm == "lilicorr" and out["lilicorr"] is None:
        r.problems.append("LiLiCorr without its correlator geometry (dflash_config.lilicorr_*)")
    if conf and with_markov and not markov:
        r.problems.append("the confidence head reads the Markov embedding (confidence_head_with_markov) but there is "
                          "no Markov head")
    return out


def _rope(r: Reading, target: Target) -> dict:
    cfg = r.config
    theta, scaling, problems = rope_from_config(cfg)
    if "rope_theta" not in cfg and not cfg.get("rope_parameters"):
        problems = [*problems, "the drafter config states no RoPE base (rope_theta): engines would guess (vLLM "
                               f"assumes 1e6); add the target's, {target.info.rope_theta}"]
    elif theta != float(target.info.rope_theta):
        problems = [*problems, f"the drafter's RoPE base {theta} != the target's {target.info.rope_theta}: its "
                               "context K/V would be rotated unlike training (ModelOpt writes the target's: "
                               "hf_spec_export.py @ a2fbac7)"]
    style = "interleaved" if (r.raw.get("is_neox_style", cfg.get("is_neox_style", True)) is False) else "neox"
    if style != "neox":  # every target specpack decodes (Llama, Qwen2/3) rotates neox-style (rotate_half)
        problems = [*problems, "the drafter declares interleaved RoPE (is_neox_style false) but the target is "
                               "neox-style; vLLM revisions disagree on whose style applies (qwen3_dflash.py @ "
                               "036a00d1 vs dflash/utils.py @ 055e47c2)"]
    r.problems += [f"RoPE: {p}" for p in problems]
    return {"rope_theta": theta, "rope_scaling": cfg.get("rope_scaling") or
            ({**cfg["rope_parameters"]} if (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default"
             else None), "rope_style": style}


def _attention(r: Reading, geo: Geometry) -> dict:
    causal, windows = r.attention or vllm_attention(r.config, r.raw, geo.layers, r.problems)
    sinks, sinks_from = _optional(r, "attention_sinks")
    return {"layer_causal": causal, "sliding_window": windows, "attention_sinks": bool(sinks),
            "attention_from": sinks_from}


def vllm_attention(cfg: dict, raw: dict, layers: int, problems: list) -> tuple[list, list]:
    """Per-layer (causal, window) as vLLM resolves them (qwen3_dflash.py @ 036a00d1
    `_resolve_layer_attention` / `_dflash_layer_causal`): top-level is_causal, else
    dflash_config.causal, else causal iff the layer type is sliding_attention; use_swa makes every
    layer sliding; the window is dflash_config.swa_window_size or sliding_window."""
    dc = dflash_config(raw)
    types = cfg.get("layer_types") or raw.get("layer_types")
    if types is not None and len(types) != layers:
        problems.append(f"layer_types lists {len(types)} layers, the drafter has {layers}")
        types = None
    any_sliding = bool(types) and _SLIDING in types
    causal_all = raw.get("is_causal", cfg.get("is_causal"))
    causal_all = dc.get("causal") if causal_all is None else causal_all
    use_swa = bool(dc.get("use_swa", False))
    window = dc.get("swa_window_size", raw.get("sliding_window", cfg.get("sliding_window")))
    causal, windows = [], []
    for i in range(layers):
        sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == _SLIDING
        if sliding and not isinstance(window, int):
            problems.append(f"draft layer {i} uses sliding attention but no window is stated "
                            "(dflash_config.swa_window_size or sliding_window)")
        windows.append(window if sliding else None)
        causal.append(bool(causal_all) if causal_all is not None else bool(types) and types[i] == _SLIDING)
    return causal, windows


def _binding_problems(r: Reading, geo: Geometry, bind: dict) -> list[str]:
    out, layout = [], bind["query_layout"]
    for key in ("block_size", "mask_token_id"):
        if bind[key] is not None and not is_int(bind[key]):
            out.append(f"{key.replace('_', ' ')} {bind[key]!r} is not an integer")
            bind[key] = None
    size, mask = bind["block_size"], bind["mask_token_id"]
    if is_int(size) and (size < 2 if layout == "fill_in" else size < 1):
        out.append(f"block size {size} leaves no draft slot in the {layout} layout")
    if bind["algorithm"] == "lilicorr" and layout == "anchor_first":
        out.append("LiLiCorr scores B-1 fill-in slots (slot_embedding has B-1 rows); an anchor-first LiLiCorr "
                   "does not exist")
    if mask is not None and not 0 <= mask < geo.target_vocab:
        out.append(f"mask token id {mask} is outside the target vocab [0, {geo.target_vocab}) (SGLang refuses the "
                   "same: dspark_config.py @ 01f47623)")
    elif mask is not None and mask >= geo.vocab:
        out.append(f"mask token id {mask} is outside the drafter's embedding ({geo.vocab} rows)")
    ids = bind["ids"]
    fc = r.tensors.get("fc.weight")  # float; a packed quantized fc is checked against its scheme
    if ids and fc is not None and fc.ndim == 2 and fc.element_size() > 1 and \
            fc.shape[1] != len(ids[0]) * geo.target_hidden:
        out.append(f"fc.weight takes {fc.shape[1]} inputs, but {len(ids[0])} target layers × width "
                   f"{geo.target_hidden} = {len(ids[0]) * geo.target_hidden}")
    return out


# ---- tensors ----

def expected_shapes(geo: Geometry, bind: dict) -> dict[str, tuple]:
    """Every canonical tensor this drafter must hold, with its shape (optional ones: see `_OPTIONAL`)."""
    h, q, kv, hd, i = geo.hidden, geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim, geo.head_dim, geo.intermediate
    n = len(bind["ids"][0]) if bind.get("ids") else None
    shapes = {"fc.weight": (h, n * geo.target_hidden) if n else None, "hidden_norm.weight": (h,), "norm.weight": (h,)}
    layer = dict(zip(LAYER_WEIGHTS, ((q, h), (kv, h), (kv, h), (h, q), (hd,), (hd,), (i, h), (i, h), (h, i), (h,), (h,))))
    if geo.attention_bias:
        layer.update(zip(LAYER_BIASES, ((q,), (kv,), (kv,), (h,))))
    if bind.get("attention_sinks"):
        layer[SINK] = (geo.heads,)
    for k in range(geo.layers):
        shapes.update({f"layers.{k}.{name}": shape for name, shape in layer.items()})
    shapes.update(_head_shapes(geo, bind))
    return shapes


def _head_shapes(geo: Geometry, bind: dict) -> dict[str, tuple]:
    h, shapes = geo.hidden, {}
    markov, conf = bind.get("markov"), bind.get("confidence")
    if markov:
        r = markov["rank"]
        shapes.update(dict(zip(MARKOV["vanilla"], ((geo.vocab, r), (geo.draft_vocab, r)))))
        if markov["type"] == "gated":
            shapes.update(dict(zip(MARKOV["gated"], ((r, h + r), (r,)))))
        elif markov["type"] == "rnn":
            shapes.update(dict(zip(MARKOV["rnn"], ((3 * r, 2 * r + h), (3 * r,)))))
    if conf:
        width = h + (markov["rank"] if conf["with_markov"] and markov else 0)
        shapes.update(dict(zip(CONFIDENCE, ((1, width), (1,)))))
    if bind.get("lilicorr") and isinstance(bind.get("block_size"), int):
        shapes.update(lilicorr.shapes(bind["lilicorr"], h, bind["block_size"]))
    return shapes


def _linear(name: str) -> bool:
    """A weight a quantization scheme may pack: every projection, fc, the lm_head and the heads'
    output layers (never an embedding, a norm or a bias)."""
    return name.endswith("_proj.weight") or name in ("fc.weight", "lm_head.weight", MARKOV["vanilla"][1],
                                                     CONFIDENCE[0])


_OPTIONAL = {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "mask_embedding"}
_INTEGER = {"d2t", "t2d"}  # vocab maps: integer (d2t) and boolean (t2d) tables


def _tensor_problems(r: Reading, geo: Geometry, bind: dict, q) -> drafter_tensors.Checked:
    """Every tensor against its canonical shape, each linear weight float or as the scheme `q`
    stores it (drafter_tensors.check)."""
    expected = expected_shapes(geo, bind)
    expected.update({"embed_tokens.weight": (geo.vocab, geo.hidden), "lm_head.weight": (geo.draft_vocab, geo.hidden),
                     "d2t": (geo.draft_vocab,), "t2d": (geo.target_vocab,), "mask_embedding": (geo.hidden,)})
    return drafter_tensors.check(expected, r.tensors, q, _linear, _OPTIONAL, _INTEGER, r.source_name)


# ---- canonical ----

def _canonical(r: Reading, geo: Geometry, bind: dict, source, q, stated: dict | None,
               checked: drafter_tensors.Checked) -> ConvertedDrafter:
    from specpack.schemas import AuxLayers, BlockConfidence, BlockDrafter, BlockMarkov, LiLiCorrGeometry

    ids_in, src_ids, src_conv, _ = bind["ids"]
    slots = bind["block_size"] - 1 if bind["query_layout"] == "fill_in" else bind["block_size"]
    config = _config(geo, bind, slots)
    dtype = drafter_tensors.float_dtype(r.tensors, checked.held)
    if q:
        config["quantization_config"] = stated
    entry = BlockDrafter(
        source_layout=r.layout, source=source, dtype=dtype,
        parameters=drafter_tensors.parameters(checked.held, r.tensors, _INTEGER),
        quantization=quantization_entry(q, checked.counts), made_for=r.made_for,
        target_mismatch_allowed=any(m.matches is False for m in r.made_for),
        algorithm=bind["algorithm"], query_layout=bind["query_layout"], block_size=bind["block_size"],
        draft_slots=slots, hidden_size=geo.hidden, num_layers=geo.layers,
        target_features=AuxLayers(layer_ids=ids_in, source_ids=src_ids, source_convention=src_conv),
        mask_token_id=bind["mask_token_id"], mask_embedding="mask_embedding" in r.tensors,
        embedding_source=bind["embedding"], lm_head_source=bind["lm_head"],
        target_embedding_sha256=bind["target_embedding_sha256"], target_lm_head_sha256=bind["target_lm_head_sha256"],
        vocab_size=geo.vocab, draft_vocab_size=geo.draft_vocab, vocab_map="d2t" if "d2t" in r.tensors else "identity",
        rope_theta=bind["rope_theta"], rope_scaling=bind["rope_scaling"], rope_style=bind["rope_style"],
        layer_causal=bind["layer_causal"], sliding_window=bind["sliding_window"],
        attention_sinks=bind["attention_sinks"], logit_scale=config["logit_scale"],
        markov=BlockMarkov(**bind["markov"]) if bind["markov"] else None,
        confidence=BlockConfidence(**bind["confidence"]) if bind["confidence"] else None,
        lilicorr=LiLiCorrGeometry(**bind["lilicorr"]) if bind["lilicorr"] else None,
        resolved_from=_resolved_from(bind))
    kv = geo.layers * 2 * geo.kv_heads * geo.head_dim * drafter_tensors.FLOAT_BYTES.get(dtype, 2)
    return ConvertedDrafter(entry=entry, config=config, tensors=r.tensors, kv_bytes_per_token=kv)


def _config(geo: Geometry, bind: dict, slots: int) -> dict:
    ids_in, src_ids, src_conv, _ = bind["ids"]
    return {
        "kind": "block", "algorithm": bind["algorithm"], "query_layout": bind["query_layout"],
        "block_size": bind["block_size"], "draft_slots": slots, "hidden_size": geo.hidden,
        "intermediate_size": geo.intermediate, "num_layers": geo.layers, "num_attention_heads": geo.heads,
        "num_key_value_heads": geo.kv_heads, "head_dim": geo.head_dim, "rms_norm_eps": bind.get("rms_norm_eps"),
        "attention_bias": geo.attention_bias, "hidden_act": "silu", "target_hidden_size": geo.target_hidden,
        "target_layer_ids": ids_in, "target_layer_convention": "input_of_layer", "source_target_layer_ids": src_ids,
        "source_convention": src_conv, "vocab_size": geo.vocab, "target_vocab_size": geo.target_vocab,
        "draft_vocab_size": geo.draft_vocab, "mask_token_id": bind["mask_token_id"],
        "mask_embedding": bind.get("mask_embedding", False), "embedding": bind["embedding"], "lm_head": bind["lm_head"],
        "rope_theta": bind["rope_theta"], "rope_scaling": bind["rope_scaling"], "rope_style": bind["rope_style"],
        "layer_causal": bind["layer_causal"], "sliding_window": bind["sliding_window"],
        "logit_scale": bind.get("logit_scale"), "markov": bind["markov"], "confidence": bind["confidence"],
        "lilicorr": bind["lilicorr"], "conv": None}


def _resolved_from(bind: dict) -> dict[str, str]:
    found = {**bind["resolved_from"], **{f"{k}_head": v for k, v in bind["heads_from"].items()},
             "attention_sinks": bind.get("attention_from")}
    return {k: v for k, v in found.items() if v}
