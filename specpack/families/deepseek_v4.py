"""DeepSeek-V4-Flash / -Pro (`deepseek_v4`): one shared key/value head (K = V) with a grouped low-rank
output projection and a per-head attention sink; every layer keeps a sliding window, and compressed
layers add entries that each fold `compress_rate` tokens (CSA, m=4, with a lightning indexer choosing
`index_topk` of them; HCA, m'=128); manifold-constrained hyper-connections (`hc_mult` residual streams
mixed before and after each block, collapsed by `hc_head`); every layer a mixture of experts with one
shared expert, the first `num_hash_layers` routing by a frozen token-id table (`tid2eid`), the rest by
`scoring_func` (sqrtsoftplus) with a correction bias. Published FP8 e4m3 with ue8m0 block scales under
`.scale`, routed experts fp4 (`expert_dtype`, quant.py).

Tensor names are the release's (no `model.` prefix): `embed.weight`, `head.weight`, `norm.weight`,
`hc_head_{fn,base,scale}`, `layers.{i}.{attn_norm,ffn_norm,hc_attn_*,hc_ffn_*}`,
`layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,kv_norm|norm,wo_a,wo_b,attn_sink}`, `attn.compressor.{wkv,wgate,
ape,norm}`, `attn.indexer.{wq_b,weights_proj}` and `attn.indexer.compressor.*`, `layers.{i}.ffn.{gate.
weight, gate.bias | gate.tid2eid, experts.{e}.w1/w2/w3, shared_experts.w1/w2/w3}`. The DSpark stages and
the legacy MTP layer a release keeps under `mtp.{k}.` are not part of the decoder (bundled.py).

Sources: transformers 5.25 models/deepseek_v4/configuration_deepseek_v4.py (fields, defaults, the
legacy `compress_ratios` / `num_hash_layers` / `qk_rope_head_dim` folding :215-279), modeling_deepseek_v4.py
(shapes: attention :795-809, compressors :398-401 / :510-516 / :626-631, hyper-connections :942-949 /
:1006-1008, routers :1082-1111, experts and shared expert :1017-1045, caches: "sliding, sliding+CSA,
sliding+HCA" :775), conversion_mapping.py "deepseek_v4" (release names -> transformers names; both
`attn.norm` and `attn.kv_norm` load as the attention's kv_norm)."""

from __future__ import annotations

from dataclasses import replace

from specpack.errors import InputError, UnsupportedError
from specpack.families.base import (Arch, Experts, Layer, Tensor, architecture_of, check_sizes, linear,
                                    mlp_tensors, vector)

MODEL_TYPES = ("deepseek_v4",)
ARCHITECTURES = ("DeepseekV4ForCausalLM",)
ATTENTION = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
             "heavily_compressed_attention": "hca"}
DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
NAMES = ("w1", "w3", "w2")  # gate, up, down
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "head_dim", "q_lora_rank",
            "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
OPTIONAL = ("hc_mult", "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "max_position_embeddings",
            "num_key_value_heads")


def describe(config: dict, text: dict) -> Arch:
    if "text_config" in config:
        raise UnsupportedError("a DeepSeek-V4 config.json with a text_config is not a layout specpack knows",
                               hint="DeepSeek-V4.1 releases state model_type deepseek_v41 (families/deepseek_v41.py)")
    check_sizes(text, REQUIRED, OPTIONAL, "DeepSeek-V4")
    n, H, heads, hd = (text[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim"))
    problems = _problems(text)
    rates = _rates(text, problems)
    kinds = _layer_types(text, n, rates, problems)
    mlps = _mlp_types(text, n, problems)
    if problems:
        raise InputError("DeepSeek-V4 config.json states what this family cannot check", problems=problems,
                         hint="is this the release's own config.json?")
    ihd, window = text.get("index_head_dim") or 128, text.get("sliding_window") or 128
    cache = {"sliding": hd, "csa": hd + (hd + ihd) / rates["compressed_sparse_attention"],
             "hca": hd + hd / rates["heavily_compressed_attention"]}
    layers = tuple(Layer(ATTENTION[k], "hash_moe" if m == "hash_moe" else "moe", window=window,
                         cache=cache[ATTENTION[k]]) for k, m in zip(kinds, mlps))
    size = text["moe_intermediate_size"]
    return Arch(
        "deepseek_v4", architecture_of(config), config.get("model_type", "deepseek_v4"), hidden_size=H, num_layers=n,
        num_heads=heads, num_kv_heads=1, head_dim=hd, intermediate_size=size, vocab_size=text["vocab_size"],
        max_position_embeddings=text.get("max_position_embeddings") or 1048576, layers=layers,
        experts=Experts(text["n_routed_experts"], text["num_experts_per_tok"], size, 1, size),
        prefix="", embed="embed.weight", norm="norm.weight",
        lm_head=None if text.get("tie_word_embeddings") else "head.weight", kv_width=hd,
        details={"q_lora_rank": text["q_lora_rank"], "o_groups": text["o_groups"], "o_lora_rank": text["o_lora_rank"],
                 "hc_mult": text.get("hc_mult") or 4, "index_n_heads": text.get("index_n_heads") or 64,
                 "index_head_dim": ihd, "rates": rates, "kv_norm": "norm"})


def _problems(text: dict) -> list[str]:
    """What transformers' DeepseekV4 model could not build from this config."""
    heads, groups = text["num_attention_heads"], text["o_groups"]
    checks = [(text.get("scoring_func", "sqrtsoftplus") not in SCORING,
               f"scoring_func {text.get('scoring_func')!r}: not one of {', '.join(SCORING)}"),
              (text.get("hidden_act", "silu") != "silu", f"hidden_act {text.get('hidden_act')!r} (only silu)"),
              (text.get("n_shared_experts", 1) != 1, f"n_shared_experts {text.get('n_shared_experts')!r}: the "
               "model has one shared expert of moe_intermediate_size"),
              (text.get("num_key_value_heads", 1) != 1, f"num_key_value_heads {text.get('num_key_value_heads')!r}: "
               "DeepSeek-V4 shares one key/value head"),
              ((heads * text["head_dim"]) % groups != 0, f"o_groups {groups} does not divide the "
               f"{heads * text['head_dim']} attention outputs")]
    return [message for bad, message in checks if bad]


def _rates(text: dict, problems: list[str]) -> dict[str, int]:
    """Tokens per compressed entry, per layer type (`compress_rates`, or the legacy scalar keys)."""
    rates = dict(DEFAULT_RATES)
    stated = text.get("compress_rates")
    if stated is not None and not isinstance(stated, dict):
        problems.append(f"compress_rates = {stated!r}: not a JSON object")
        stated = None
    rates.update(stated or {})
    for key, legacy in (("compressed_sparse_attention", "compress_rate_csa"),
                        ("heavily_compressed_attention", "compress_rate_hca")):
        rates[key] = text.get(legacy) or rates[key]
    problems += [f"compress rate {k} = {v!r}: not a positive integer" for k, v in rates.items()
                 if not (isinstance(v, int) and v > 0)]
    problems += [f"compress_rates names {k!r}: not one of {', '.join(DEFAULT_RATES)}" for k in rates
                 if k not in DEFAULT_RATES]
    return rates


def _layer_types(text: dict, n: int, rates: dict, problems: list[str]) -> list[str]:
    """`layer_types`, else the legacy per-layer `compress_ratios` (0: sliding only), else V4-Pro's
    default (two HCA layers, then CSA and HCA in turn). A list longer than the layers is cut to them,
    as transformers does (a release may list its MTP layer too)."""
    stated, ratios = text.get("layer_types"), text.get("compress_ratios")
    if stated is None and ratios is not None:
        by_rate = {0: "sliding_attention", **{r: k for k, r in rates.items()}}
        if not (isinstance(ratios, list) and len(ratios) >= n and all(isinstance(r, int) for r in ratios)):
            problems.append(f"compress_ratios must list one integer per layer ({n}): {str(ratios)[:120]}")
            return ["sliding_attention"] * n
        problems += [f"compress_ratios[{i}] = {r}: no layer type compresses by it (rates {rates})"
                     for i, r in enumerate(ratios[:n]) if r not in by_rate]
        return [by_rate.get(r, "sliding_attention") for r in ratios[:n]]
    if stated is None:
        return ["heavily_compressed_attention"] * min(n, 2) + ["compressed_sparse_attention" if i % 2 else
                                                               "heavily_compressed_attention" for i in range(n - 2)]
    return _listed(stated, n, "layer_types", tuple(ATTENTION), problems)


def _mlp_types(text: dict, n: int, problems: list[str]) -> list[str]:
    """`mlp_layer_types`, else the first `num_hash_layers` (default 3) hash-routed, the rest top-k."""
    stated = text.get("mlp_layer_types")
    if stated is None:
        hashed = text.get("num_hash_layers", 3)
        return ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    return _listed(stated, n, "mlp_layer_types", ("hash_moe", "moe"), problems)


def _listed(stated, n: int, key: str, known: tuple[str, ...], problems: list[str]) -> list[str]:
    if not (isinstance(stated, list) and len(stated) >= n and all(isinstance(t, str) for t in stated)):
        problems.append(f"{key} must list one type per layer ({n}): {str(stated)[:120]}")
        return [known[0]] * n
    problems += [f"{key}[{i}] = {t!r}: not one of {', '.join(known)}" for i, t in enumerate(stated[:n])
                 if t not in known]
    return [t if t in known else known[0] for t in stated[:n]]


def locate(arch: Arch, found: dict) -> Arch:
    """The attention's kv norm as the checkpoint names it (`attn.norm` or `attn.kv_norm`: both load)."""
    kv = "kv_norm" if f"{arch.prefix}layers.0.attn.kv_norm.weight" in found else "norm"
    return replace(arch, details={**arch.details, "kv_norm": kv})


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    d, H = arch.details, arch.hidden_size
    hc = d["hc_mult"]
    out = {arch.embed: Tensor((arch.vocab_size, H)), arch.norm: vector(H), "hc_head_fn": Tensor((hc, hc * H)),
           "hc_head_base": vector(hc), "hc_head_scale": vector(1)}
    if arch.lm_head:
        out[arch.lm_head] = linear(arch.vocab_size, H)
    for i, layer in enumerate(arch.layers):
        out.update(layer_tensors(arch, f"{arch.prefix}layers.{i}.", layer))
    return out


def layer_tensors(arch: Arch, p: str, layer: Layer) -> dict[str, Tensor]:
    """One decoder layer: its hyper-connections, its attention (with its compressor and indexer) and
    its mixture of experts."""
    H, hc = arch.hidden_size, arch.details["hc_mult"]
    mix = (2 + hc) * hc  # pre, post and the hc x hc combination, per stream
    out = {p + "attn_norm.weight": vector(H), p + "ffn_norm.weight": vector(H)}
    for block in ("attn", "ffn"):
        out.update({f"{p}hc_{block}_fn": Tensor((mix, hc * H)), f"{p}hc_{block}_base": vector(mix),
                    f"{p}hc_{block}_scale": vector(3)})
    return {**out, **_attention(arch, p + "attn.", layer.attention), **_moe(arch, p + "ffn.", layer.mlp)}


def _attention(arch: Arch, a: str, kind: str) -> dict[str, Tensor]:
    d, H, n, hd = arch.details, arch.hidden_size, arch.num_heads, arch.head_dim
    q, g, o = d["q_lora_rank"], d["o_groups"], d["o_lora_rank"]
    out = {a + "wq_a.weight": linear(q, H), a + "q_norm.weight": vector(q), a + "wq_b.weight": linear(n * hd, q),
           a + "wkv.weight": linear(hd, H), f"{a}{d['kv_norm']}.weight": vector(hd),
           a + "wo_a.weight": linear(g * o, n * hd // g), a + "wo_b.weight": linear(H, g * o), a + "attn_sink": vector(n)}
    if kind == "sliding":
        return out
    rate = d["rates"]["compressed_sparse_attention" if kind == "csa" else "heavily_compressed_attention"]
    out.update(_compressor(a + "compressor.", H, hd, rate, overlap=kind == "csa"))
    if kind == "csa":
        ih, ihd, x = d["index_n_heads"], d["index_head_dim"], a + "indexer."
        out.update(_compressor(x + "compressor.", H, ihd, rate, overlap=True))
        out.update({x + "wq_b.weight": linear(ih * ihd, q), x + "weights_proj.weight": linear(ih, H)})
    return out


def _compressor(c: str, H: int, hd: int, rate: int, overlap: bool) -> dict[str, Tensor]:
    """A compressor folding `rate` tokens into one entry of width `hd` (CSA's overlapping windows
    project to 2 x hd)."""
    width = 2 * hd if overlap else hd
    return {c + "wkv.weight": linear(width, H), c + "wgate.weight": linear(width, H),
            c + "ape": Tensor((rate, width)), c + "norm.weight": vector(hd)}


def _moe(arch: Arch, m: str, kind: str) -> dict[str, Tensor]:
    H, e = arch.hidden_size, arch.experts
    out = {m + "gate.weight": Tensor((e.routed, H))}
    if kind == "hash_moe":
        out[m + "gate.tid2eid"] = Tensor((arch.vocab_size, e.active), integer=True)
    else:
        out[m + "gate.bias"] = vector(e.routed)
    for k in range(e.routed):
        out.update(mlp_tensors(f"{m}experts.{k}.", H, e.size, NAMES))
    return {**out, **mlp_tensors(m + "shared_experts.", H, e.shared_size, NAMES)}
