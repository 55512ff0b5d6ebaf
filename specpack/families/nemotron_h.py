"""Nemotron-H / Nemotron 3 (`nemotron_h`): one mixer per layer as `hybrid_override_pattern` (or v5's
`layers_block_type` list) states it: `M` Mamba-2, `*` attention (no positional encoding), `-` a
non-gated relu² MLP, `E` a mixture of non-gated experts (sigmoid router with correction bias, shared
experts, optional latent projections). Tensors under `backbone.` (`embeddings`, `layers.{i}.mixer.*`,
`norm_f`); MTP modules at `mtp.layers.{k}` following `mtp_hybrid_override_pattern` (enorm, hnorm,
eh_proj [H, 2H]: embedding first; final_layernorm on a step's last layer). Sources: transformers
models/nemotron_h (configuration :98-282, modeling :615-833, :1106-1107), vLLM models/nemotron_h.py
:197-306, :549-554, nemotron_h_mtp.py :70-291, layers/mamba/mamba_utils.py :195-220."""

from __future__ import annotations

from specpack.errors import InputError
from specpack.families.base import (Arch, Experts, Layer, Mtp, Tensor, architecture_of, check_sizes, geometry,
                                    linear, vector)

MODEL_TYPES = ("nemotron_h",)
ARCHITECTURES = ("NemotronHForCausalLM",)
KINDS = {"M": Layer("mamba", "none"), "*": Layer("full", "none"), "-": Layer("none", "dense"),
         "E": Layer("none", "moe")}
V5_NAMES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
MAMBA = ("mamba_num_heads", "mamba_head_dim", "ssm_state_size")


def pattern(text: dict, n: int | None = None) -> str:
    """The layer pattern as a string of M * - E, from either form; its length checked against `n`."""
    stated = text.get("hybrid_override_pattern") or text.get("layers_block_type")
    if isinstance(stated, list):
        stated = "".join(V5_NAMES.get(k, "?") for k in stated)
    if not isinstance(stated, str) or not stated or set(stated) - set(KINDS) or (n is not None and len(stated) != n):
        raise InputError("config.json hybrid_override_pattern must give one of M * - E per layer",
                         problems=[f"hybrid_override_pattern = {str(stated)[:120]} for {n} layers"])
    return stated


def describe(config: dict, text: dict) -> Arch:
    text = {"num_hidden_layers": len(pattern(text)), **text}
    sizes = text.get("intermediate_size")  # one per `-` layer when a list
    g = geometry({k: v for k, v in text.items() if k != "intermediate_size"})
    g["intermediate_size"] = sizes[0] if isinstance(sizes, list) and sizes else sizes or 0
    check_sizes(text, MAMBA, ("n_groups", "conv_kernel"))
    layout = pattern(text, g["num_layers"])
    experts = None
    if "E" in layout:
        shared = text.get("n_shared_experts") or 0
        experts = Experts(text.get("n_routed_experts") or 0, text.get("num_experts_per_tok") or 0,
                          text.get("moe_intermediate_size") or 0, shared,
                          shared * (text.get("moe_shared_expert_intermediate_size") or 0))
    nh, hd, N = (text[k] for k in MAMBA)
    G, K = text.get("n_groups") or text.get("mamba_n_groups") or 8, text.get("conv_kernel") or text.get("mamba_d_conv") or 4
    conv = nh * hd + 2 * G * N
    n = text.get("num_nextn_predict_layers") or 0
    mtp_layout = pattern({"hybrid_override_pattern": text.get("mtp_hybrid_override_pattern") or
                          text.get("mtp_layers_block_type") or "*E"}) if n else ""
    mtp = Mtp(n, "mtp-nemotron-h", "mtp.layers.", "num_nextn_predict_layers", "embedding_first") if n else None
    return Arch("nemotron_h", architecture_of(config), config.get("model_type", "nemotron_h"),
                layers=tuple(KINDS[c] for c in layout), experts=experts, mtp=mtp, prefix="backbone.",
                embed="backbone.embeddings.weight", norm="backbone.norm_f.weight",
                lm_head=None if config.get("tie_word_embeddings") else "lm_head.weight",
                kv_width=2 * g["num_kv_heads"] * g["head_dim"], conv_state=conv * (K - 1), ssm_state=nh * hd * N,
                ssm_bytes=0 if text.get("mamba_ssm_cache_dtype", "float32") in ("bfloat16", "float16") else 4,
                details={"mamba": (nh, hd, N, G, K), "conv_bias": text.get("use_conv_bias", True),
                         "mlp_sizes": text.get("intermediate_size"), "latent": text.get("moe_latent_size"),
                         "pattern": layout, "mtp_pattern": mtp_layout}, **g)


def mixer_tensors(arch: Arch, p: str, kind: str, mlp_index: int) -> dict[str, Tensor]:
    H, m = arch.hidden_size, p + "mixer."
    if kind == "M":
        nh, hd, N, G, K = arch.details["mamba"]
        inner, conv = nh * hd, nh * hd + 2 * G * N
        out = {m + "in_proj.weight": linear(inner + conv + nh, H), m + "conv1d.weight": Tensor((conv, 1, K)),
               m + "A_log": vector(nh), m + "D": vector(nh), m + "dt_bias": vector(nh), m + "norm.weight": vector(inner),
               m + "out_proj.weight": linear(H, inner)}
        return {**out, **({m + "conv1d.bias": vector(conv)} if arch.details["conv_bias"] else {})}
    if kind == "*":
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return {m + "q_proj.weight": linear(q, H), m + "k_proj.weight": linear(kv, H),
                m + "v_proj.weight": linear(kv, H), m + "o_proj.weight": linear(H, q)}
    if kind == "-":
        sizes = arch.details["mlp_sizes"]
        width = sizes[mlp_index] if isinstance(sizes, list) else sizes
        return {m + "up_proj.weight": linear(width, H), m + "down_proj.weight": linear(H, width)}
    return _moe_tensors(arch, m)


def _moe_tensors(arch: Arch, m: str) -> dict[str, Tensor]:
    H, e, X = arch.hidden_size, arch.experts, arch.details["latent"] or arch.hidden_size
    out = {m + "gate.weight": Tensor((e.routed, H)), m + "gate.e_score_correction_bias": vector(e.routed)}
    for j in range(e.routed):
        out.update({f"{m}experts.{j}.up_proj.weight": linear(e.size, X), f"{m}experts.{j}.down_proj.weight": linear(X, e.size)})
    if e.shared:
        out.update({m + "shared_experts.up_proj.weight": linear(e.shared_size, H),
                    m + "shared_experts.down_proj.weight": linear(H, e.shared_size)})
    if arch.details["latent"]:
        out.update({m + "fc1_latent_proj.weight": linear(X, H), m + "fc2_latent_proj.weight": linear(H, X)})
    return out


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    H = arch.hidden_size
    out = {arch.embed: Tensor((arch.vocab_size, H)), arch.norm: vector(H)}
    if arch.lm_head:
        out[arch.lm_head] = linear(arch.vocab_size, H)
    layout = arch.details["pattern"]
    for i, kind in enumerate(layout):
        p = f"{arch.prefix}layers.{i}."
        out.update({p + "norm.weight": vector(H), **mixer_tensors(arch, p, kind, layout[: i + 1].count("-") - 1)})
    return out


def mtp_fusion(arch: Arch, k: int) -> dict[str, str]:
    """Step k's first layer holds enorm, hnorm, eh_proj [H, 2H] (embedding first), its last layer the
    final norm (vLLM nemotron_h_mtp.py :70-131)."""
    n = len(arch.details["mtp_pattern"])
    first, last = f"mtp.layers.{k * n}.", f"mtp.layers.{k * n + n - 1}."
    return {"embed_norm": first + "enorm.weight", "hidden_norm": first + "hnorm.weight", "proj": first + "eh_proj.weight",
            "final_norm": last + "final_layernorm.weight"}


def mtp_block(arch: Arch, k: int, fused: bool = False) -> tuple[str, dict[str, Tensor]]:
    """Step k's layers, one per character of the MTP pattern (named `{j}.norm.weight`, `{j}.mixer.*`
    under `mtp.layers.`)."""
    layout, out = arch.details["mtp_pattern"], {}
    for j, kind in enumerate(layout):
        p = f"mtp.layers.{k * len(layout) + j}."
        out.update({p + "norm.weight": vector(arch.hidden_size), **mixer_tensors(arch, p, kind, 0)})
    return "mtp.layers.", out
