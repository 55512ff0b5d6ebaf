"""MiniMax-M3 / M3.1 (`minimax_m3_vl`, `MiniMaxM3SparseForConditionalGeneration`): a vision-language
wrapper whose text decoder mixes full-attention and block-sparse layers (`minimax_m3_sparse`: a
lightning indexer scores blocks of `index_block_size` keys and each query attends to the top
`index_topk_blocks` and its local blocks), per-head q/k RMSNorm, partial RoPE; dense MLP layers
(`dense_intermediate_size`) and MoE layers (`num_local_experts` routed by sigmoid with a correction
bias, one shared expert of `shared_intermediate_size`), SwiGLU-OAI. Its config advertises MTP modules
(`num_mtp_modules`) whose tensor names no public source states: they are counted as advertised, not
bound. MiniMax-M3.1 ships its DSpark drafter in the repo's `dspark/` folder (bundled.py, layout C).

Release names (`language_model.model.`, `language_model.lm_head.weight`, the vision tower and
projector carried untouched): `layers.{i}.self_attn.{q,k,v,o}_proj`, `{q,k}_norm`, on sparse layers
`self_attn.index_{q,k}_proj` and `index_{q,k}_norm`; dense layers `mlp.{gate,up,down}_proj`; MoE layers
`block_sparse_moe.gate.weight`, `block_sparse_moe.e_score_correction_bias`, `block_sparse_moe.experts.
{e}.w1/w2/w3`, `block_sparse_moe.shared_experts.{gate,up,down}_proj`. transformers v5 re-saves under
`model.language_model.` with a top-level `lm_head`: both read.

Sources: transformers 5.25 models/minimax_m3_vl/configuration_minimax_m3_vl.py (fields, defaults, the
legacy `sparse_attention_config.sparse_attention_freq` / `moe_layer_freq` folding), modeling (attention
:422-427, indexer :548-551, dense MLP :175-182, router / MoE :234-262, decoder layer :640-653, the sparse
cache keeps one indexer key per token :57-67), conversion_mapping.py "minimax_m3_vl" (release names ->
transformers names)."""

from __future__ import annotations

from specpack.errors import InputError, UnsupportedError
from specpack.families.base import (Arch, Experts, Layer, Tensor, architecture_of, attention_tensors, geometry,
                                    linear, mlp_tensors, vector)

MODEL_TYPES = ("minimax_m3_vl",)
ARCHITECTURES = ("MiniMaxM3SparseForConditionalGeneration",)
ATTENTION = {"full_attention": "full", "minimax_m3_sparse": "block_sparse"}
MLP = {"dense": "dense", "sparse": "moe"}
PREFIXES = ("language_model.model.", "model.language_model.")
EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down
DEFAULTS = {"dense_intermediate_size": 12288, "shared_intermediate_size": 3072, "num_local_experts": 128,
            "num_experts_per_tok": 4, "index_n_heads": 4, "index_head_dim": 128}  # transformers' config defaults
SPARSE_KEYS = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim"}


def describe(config: dict, text: dict) -> Arch:
    if text is config:
        raise UnsupportedError("a MiniMax-M3 checkpoint without its text_config is not a layout specpack can check",
                               hint="MiniMax-M3 releases ship MiniMaxM3SparseForConditionalGeneration with text_config")
    g = geometry(text, ("intermediate_size",), tuple(DEFAULTS))
    n = g["num_layers"]
    problems: list[str] = []
    sparse = text.get("sparse_attention_config") if isinstance(text.get("sparse_attention_config"), dict) else {}
    sizes = _sizes(text, sparse, problems)
    attention = _listed(text, "layer_types", n, ATTENTION, problems,
                        legacy=[("minimax_m3_sparse" if f else "full_attention") for f in sparse["sparse_attention_freq"]]
                        if isinstance(sparse.get("sparse_attention_freq"), list) else None, default="full_attention")
    freq = text.get("moe_layer_freq")
    mlps = _listed(text, "mlp_layer_types", n, MLP, problems,
                   legacy=[("sparse" if f else "dense") for f in freq] if isinstance(freq, list) else None,
                   default="sparse")
    rotary = text.get("rotary_dim")
    if isinstance(rotary, int) and rotary > g["head_dim"]:
        problems.append(f"rotary_dim {rotary} > head_dim {g['head_dim']}: RoPE rotates part of a head, never more")
    if problems:
        raise InputError("MiniMax-M3 config.json states what this family cannot check", problems=problems,
                         hint="is this the release's own config.json?")
    kv = 2 * g["num_kv_heads"] * g["head_dim"]
    layers = tuple(Layer(ATTENTION[a], MLP[m], cache=kv + sizes["index_head_dim"] if a == "minimax_m3_sparse" else None)
                   for a, m in zip(attention, mlps))
    p = PREFIXES[0]
    return Arch("minimax_m3", architecture_of(config), config.get("model_type", "minimax_m3_vl"), layers=layers,
                experts=Experts(sizes["num_local_experts"], sizes["num_experts_per_tok"], g["intermediate_size"],
                                int(sizes["shared_intermediate_size"] > 0), sizes["shared_intermediate_size"]), kv_width=kv, text_config=True, prefix=p,
                embed=p + "embed_tokens.weight", norm=p + "norm.weight",
                lm_head=None if text.get("tie_word_embeddings") else "language_model.lm_head.weight",
                details={"prefixes": PREFIXES, **sizes,
                         "advertised_mtp": text.get("num_mtp_modules") or config.get("num_mtp_modules") or 0,
                         "mtp_why": "whose tensor names no public source states"}, **g)


def _sizes(text: dict, sparse: dict, problems: list[str]) -> dict:
    """DEFAULTS as the config states them: a flat key, else (the indexer's) in the release's nested
    sparse_attention_config (vLLM minimax_m3.py reads `sparse_num_index_heads` / `sparse_index_dim`
    there; transformers folds them the same way), else transformers' default. 0 shared: none."""
    sizes = {k: v if text.get(k) is None else text[k] for k, v in DEFAULTS.items()}
    for flat, nested in SPARSE_KEYS.items():
        value = sparse.get(nested)
        if text.get(flat) is not None or value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            sizes[flat] = value
        else:
            problems.append(f"text_config.sparse_attention_config.{nested} = {str(value)[:40]}: not a positive integer")
    return sizes


def _listed(text: dict, key: str, n: int, known: dict, problems: list[str], legacy, default: str) -> list[str]:
    """A per-layer type list as stated (else its legacy form, else `default` everywhere), each checked."""
    stated = text.get(key) if text.get(key) is not None else legacy
    if stated is None:
        return [default] * n
    if not (isinstance(stated, list) and len(stated) == n and all(isinstance(t, str) for t in stated)):
        problems.append(f"{key} must list one type per layer ({n}): {str(stated)[:120]}")
        return [default] * n
    problems += [f"{key}[{i}] = {t!r}: not one of {', '.join(known)}" for i, t in enumerate(stated) if t not in known]
    return [t if t in known else default for t in stated]


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    H, d = arch.hidden_size, arch.details
    out = {arch.embed: Tensor((arch.vocab_size, H)), arch.norm: vector(H)}
    if arch.lm_head:
        out[arch.lm_head] = linear(arch.vocab_size, H)
    for i, layer in enumerate(arch.layers):
        p = f"{arch.prefix}layers.{i}."
        out.update({p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H)})
        a = p + "self_attn."
        out.update(attention_tensors(a, H, arch.num_heads, arch.num_kv_heads, arch.head_dim, qk_norm="head"))
        if layer.attention == "block_sparse":
            ih, ihd = d["index_n_heads"], d["index_head_dim"]
            out.update({a + "index_q_proj.weight": linear(ih * ihd, H), a + "index_k_proj.weight": linear(ihd, H),
                        a + "index_q_norm.weight": vector(ihd), a + "index_k_norm.weight": vector(ihd)})
        out.update(_mlp(arch, p, layer.mlp))
    return out


def _mlp(arch: Arch, p: str, kind: str) -> dict[str, Tensor]:
    H, e = arch.hidden_size, arch.experts
    if kind == "dense":
        return mlp_tensors(p + "mlp.", H, arch.details["dense_intermediate_size"])
    m = p + "block_sparse_moe."
    out = {m + "gate.weight": Tensor((e.routed, H)), m + "e_score_correction_bias": vector(e.routed)}
    for k in range(e.routed):
        out.update(mlp_tensors(f"{m}experts.{k}.", H, e.size, EXPERT_NAMES))
    return {**out, **mlp_tensors(m + "shared_experts.", H, e.shared_size)} if e.shared else out
