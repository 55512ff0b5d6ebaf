"""DeepSeek-V4.1 (`deepseek_v41`, `DeepseekV41ForCausalLM`): an image-text wrapper whose `text_config` is a
DeepSeek-V4-style decoder (one shared K = V head, grouped low-rank output, per-head attention sink,
hyper-connections, a mixture of experts with one shared expert in every layer) with three changes:

- **CSA2**: every layer keeps a sliding window; layers with `compress_ratios[i] > 0` also attend the
  compressed KV of their group, which only the `kv_source_layer_ids` layers project (their
  `attn.compressor`: `wkv`, `wgate` above ratio 1, `norm`; no `ape`); `index_source_layer_ids` layers
  run the indexer (`attn.indexer.wq_b`, `weights_proj`; on a KV source also `wk` and `k_norm`, the
  keys the group scores against). No hash-routed layers; no learned `hc_head` (the streams collapse
  with the last layer's mix).
- **Engram** conditional memory at `engram_layer_ids`: `engram.embed.weight` [rows, engram_head_dim]
  (FP8 rows with `engram.embed.scale`, one E8M0 scale per row per 32 channels), `engram.wkv`
  [H x (hc + 1), (engram_max_ngram_size - 1) x engram_n_heads x engram_head_dim], `engram.q_weight`
  and `engram.k_weight` [hc, H].
- The router carries `gate.bias_vl` [experts] beside `gate.bias` when the release has a vision tower.

Release names are DeepSeek-V4's (no `model.` prefix: `embed.weight`, `head.weight`, `norm.weight`,
`layers.{i}.…`, FP8 block scales under `.scale`); the vision tower (`vision.`, `aligner.`,
`image_{start,end,newline}`) is carried untouched, and the DSpark stages under `mtp.{k}.` are bound by
converters/release_dspark/deepseek_v41.py.

Sources: transformers models/deepseek_v41 (configuration: every field, its default and the schedule
rules of `__post_init__`; modeling: DeepseekV41Compressor, DeepseekV41Indexer, DeepseekV41Attention,
DeepseekV41TopKRouter, DeepseekV41Expert, DeepseekV41EngramEmbedding, DeepseekV41Engram,
DeepseekV41DecoderLayer, DeepseekV41TextModel / ForCausalLM); vLLM models/deepseek_v41/nvidia/model.py
(`_make_deepseek_v4_weights_mapper`: the release prefixes, `.scale` -> the scale parameter,
`engram.embed.scale`, the vision tensors dropped by the text model) and vl_model.py (the wrapper);
vLLM transformers_utils/configs/deepseek_v41.py (text_config and vision_config flattened)."""

from __future__ import annotations

from dataclasses import replace

from specpack.errors import InputError
from specpack.families import deepseek_v4
from specpack.families.base import Arch, Experts, Layer, Tensor, architecture_of, check_sizes, linear, mlp_tensors, vector

MODEL_TYPES = ("deepseek_v41",)
ARCHITECTURES = ("DeepseekV41ForCausalLM",)
REQUIRED = deepseek_v4.REQUIRED
OPTIONAL = ("hc_mult", "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "max_position_embeddings",
            "num_key_value_heads", "engram_head_dim", "engram_n_heads", "engram_max_ngram_size")
# transformers DeepseekV41TextConfig defaults and the released schedule it falls back to
DEFAULTS = {"hc_mult": 4, "index_n_heads": 32, "index_head_dim": 128, "sliding_window": 128, "engram_head_dim": 256,
            "engram_n_heads": 8, "engram_max_ngram_size": 4, "max_position_embeddings": 1048576}
RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20
RELEASED_KV_SOURCES = [2, 8, 14, 20]
RELEASED_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]
ENGRAM_BLOCK = 32  # DeepseekV41EngramEmbedding: one scale per row per 32 channels
NAMES = deepseek_v4.NAMES
CARRIED = ("vision.", "aligner.", "image_")  # the vision tower: carried untouched


def describe(config: dict, text: dict) -> Arch:
    if text is config:
        raise InputError("a DeepSeek-V4.1 config.json without its text_config is not a layout specpack can check",
                         hint="DeepSeek-V4.1 releases ship DeepseekV41ForCausalLM with text_config and vision_config")
    check_sizes(text, REQUIRED, OPTIONAL, "DeepSeek-V4.1")
    sizes = {k: text.get(k) or v for k, v in DEFAULTS.items()}
    n, H, heads, hd = (text[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim"))
    problems = deepseek_v4._problems(text)
    schedule = _schedule(text, n, problems)
    engram = _engram(text, n, problems)
    if problems:
        raise InputError("DeepSeek-V4.1 text_config states what this family cannot check", problems=problems,
                         hint="is this the release's own config.json?")
    layers = tuple(_layer(i, schedule, hd, sizes) for i in range(n))
    size = text["moe_intermediate_size"]
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    return Arch(
        "deepseek_v41", architecture_of(config), config.get("model_type", "deepseek_v41"), hidden_size=H, num_layers=n,
        num_heads=heads, num_kv_heads=1, head_dim=hd, intermediate_size=size, vocab_size=text["vocab_size"],
        max_position_embeddings=sizes["max_position_embeddings"], layers=layers, text_config=True,
        experts=Experts(text["n_routed_experts"], text["num_experts_per_tok"], size, 1, size),
        prefix="", embed="embed.weight", norm="norm.weight",
        lm_head=None if text.get("tie_word_embeddings") else "head.weight", kv_width=hd,
        details={"q_lora_rank": text["q_lora_rank"], "o_groups": text["o_groups"], "o_lora_rank": text["o_lora_rank"],
                 **sizes, **schedule, "engram": engram, "kv_norm": "kv_norm",
                 "vision": bool(vision.get("num_hidden_layers", 0)), "carried": CARRIED})


def _layer(i: int, s: dict, hd: int, sizes: dict) -> Layer:
    """Layer i: sliding only (ratio 0), or CSA2 (its group's compressed KV; a KV source caches it)."""
    ratio = s["ratios"][i]
    if not ratio:
        return Layer("sliding", "moe", window=sizes["sliding_window"], cache=hd)
    own = (hd + sizes["index_head_dim"]) / ratio if i in s["kv_sources"] else 0
    return Layer("csa2", "moe", window=sizes["sliding_window"], cache=hd + own)


def _schedule(text: dict, n: int, problems: list[str]) -> dict:
    """compress_ratios, kv_source_layer_ids and index_source_layer_ids as transformers' __post_init__
    settles and validates them (the released schedule where unstated)."""
    nextn = text.get("num_nextn_predict_layers", 3)
    ratios = text.get("compress_ratios")
    if ratios is None:
        ratios = RELEASED_RATIOS if n == len(RELEASED_RATIOS) else _scaled_ratios(n)
    if not (isinstance(ratios, list) and n <= len(ratios) <= n + (nextn if isinstance(nextn, int) else 0)
            and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios)):
        problems.append(f"compress_ratios must list one ratio (0, 1 or more) per layer ({n}, plus the "
                        f"{nextn} DSpark layers at most): {str(ratios)[:120]}")
        return {"ratios": [0] * n, "kv_sources": [], "index_sources": []}
    ratios = ratios[:n]
    kv = text.get("kv_source_layer_ids")
    if kv is None:
        kv = (RELEASED_KV_SOURCES if ratios == RELEASED_RATIOS[:n] else
              [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])])
    index = text.get("index_source_layer_ids")
    if index is None:
        index = RELEASED_INDEX_SOURCES if kv == RELEASED_KV_SOURCES else list(kv)
    for key, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            problems.append(f"{key} must list layer ids: {str(ids)[:120]}")
            return {"ratios": ratios, "kv_sources": [], "index_sources": []}
        problems += [f"{key} names layer {i}: not a layer (0..{n - 1})" for i in ids if not 0 <= i < n][:8]
        problems += [f"{key} names layer {i}, whose compress_ratios entry is 0 (no compressed branch)"
                     for i in ids if 0 <= i < n and ratios[i] == 0][:8]
    problems += [f"index_source_layer_ids names layer {i}, but no kv_source_layer_ids layer publishes keys before it"
                 for i in index if i not in kv and not any(s < i for s in kv)][:8]
    problems += [f"layer {i} compresses (ratio {ratios[i]}), but no kv_source_layer_ids layer comes at or before it"
                 for i in range(n) if ratios[i] > 0 and not any(s <= i for s in kv)][:8]
    return {"ratios": ratios, "kv_sources": sorted(set(kv)), "index_sources": sorted(set(index))}


def _scaled_ratios(n: int) -> list[int]:
    """transformers' released pattern scaled to `n` layers (2 sliding, a ratio-2 block, a ratio-1 block)."""
    slide = min(2, n)
    enc = max(0, (n - slide + 1) // 2)
    return [0] * slide + [2] * enc + [1] * max(0, n - slide - enc)


def _engram(text: dict, n: int, problems: list[str]) -> dict:
    """engram_layer_ids and the rows of each layer's table (engram_num_embeddings)."""
    ids, rows = text.get("engram_layer_ids") or [], text.get("engram_num_embeddings")
    if rows is None:
        rows = [0] * len(ids) if isinstance(ids, list) else []
    if not (isinstance(ids, list) and isinstance(rows, list) and len(ids) == len(rows)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in ids + rows)):
        problems.append(f"engram_layer_ids {str(ids)[:60]} and engram_num_embeddings {str(rows)[:60]} must be lists "
                        "of integers of one length (a table per engram layer)")
        return {}
    problems += [f"engram_layer_ids names layer {i}: not a layer (0..{n - 1})" for i in ids if not 0 <= i < n][:8]
    problems += [f"engram_num_embeddings[{k}] = {r}: not a row count" for k, r in enumerate(rows) if r <= 0][:8]
    return dict(zip(ids, rows))


def locate(arch: Arch, found: dict) -> Arch:
    """The attention's kv norm as the checkpoint names it (`attn.kv_norm`, or V4's `attn.norm`)."""
    return deepseek_v4.locate(arch, found)


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    out = {arch.embed: Tensor((arch.vocab_size, arch.hidden_size)), arch.norm: vector(arch.hidden_size)}
    if arch.lm_head:
        out[arch.lm_head] = linear(arch.vocab_size, arch.hidden_size)
    for i in range(arch.num_layers):
        out.update(layer_tensors(arch, f"{arch.prefix}layers.{i}.", i))
    return out


def layer_tensors(arch: Arch, p: str, i: int | None, experts: Experts | None = None) -> dict[str, Tensor]:
    """Layer i (None: a DSpark stage: sliding only, no engram) with `experts` (default the target's)."""
    d, H, hc = arch.details, arch.hidden_size, arch.details["hc_mult"]
    mix = (2 + hc) * hc
    out = {p + "attn_norm.weight": vector(H), p + "ffn_norm.weight": vector(H)}
    for block in ("attn", "ffn"):
        out.update({f"{p}hc_{block}_fn": Tensor((mix, hc * H)), f"{p}hc_{block}_base": vector(mix),
                    f"{p}hc_{block}_scale": vector(3)})
    out.update(deepseek_v4._attention(arch, p + "attn.", "sliding"))
    if i is not None:
        out.update(_compressed(arch, p + "attn.", i))
        if i in d["engram"]:
            out.update(_engram_tensors(arch, p + "engram.", d["engram"][i]))
    return {**out, **moe_tensors(arch, p + "ffn.", experts or arch.experts)}


def _compressed(arch: Arch, a: str, i: int) -> dict[str, Tensor]:
    """A KV source's compressor and an index source's indexer (the keys only on a KV source)."""
    d, H, hd = arch.details, arch.hidden_size, arch.head_dim
    ih, ihd, out = d["index_n_heads"], d["index_head_dim"], {}
    if i in d["kv_sources"]:
        c = a + "compressor."
        out.update({c + "wkv.weight": linear(hd, H), c + "norm.weight": vector(hd)})
        if d["ratios"][i] > 1:
            out[c + "wgate.weight"] = linear(hd, H)
    if i in d["index_sources"]:
        x = a + "indexer."
        out.update({x + "wq_b.weight": linear(ih * ihd, d["q_lora_rank"]), x + "weights_proj.weight": linear(ih, H)})
        if i in d["kv_sources"]:
            out.update({x + "wk.weight": linear(ihd, hd), x + "k_norm.weight": vector(ihd)})
    return out


def _engram_tensors(arch: Arch, e: str, rows: int) -> dict[str, Tensor]:
    d, H, hc = arch.details, arch.hidden_size, arch.details["hc_mult"]
    cols = (d["engram_max_ngram_size"] - 1) * d["engram_n_heads"] * d["engram_head_dim"]
    return {e + "embed.weight": Tensor((rows, d["engram_head_dim"]), row_block=ENGRAM_BLOCK),
            e + "wkv.weight": linear(H * (hc + 1), cols), e + "q_weight": Tensor((hc, H)), e + "k_weight": Tensor((hc, H))}


def moe_tensors(arch: Arch, m: str, e: Experts) -> dict[str, Tensor]:
    """The router (correction bias; `bias_vl` where the release has a vision tower), the routed experts
    and the shared one."""
    H = arch.hidden_size
    out = {m + "gate.weight": Tensor((e.routed, H)), m + "gate.bias": vector(e.routed)}
    if arch.details["vision"]:
        out[m + "gate.bias_vl"] = vector(e.routed)
    for k in range(e.routed):
        out.update(mlp_tensors(f"{m}experts.{k}.", H, e.size, NAMES))
    return {**out, **mlp_tensors(m + "shared_experts.", H, e.shared_size, NAMES)}


def stage_experts(arch: Arch, text: dict) -> Experts:
    """A DSpark stage's experts: dspark_n_routed_experts / dspark_num_experts_per_tok, else the target's
    (vLLM deepseek_v41 DeepseekV4MoE for layers past num_hidden_layers)."""
    e = arch.experts
    return replace(e, routed=text.get("dspark_n_routed_experts") or e.routed,
                   active=text.get("dspark_num_experts_per_tok") or e.active)
