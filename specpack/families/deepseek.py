"""DeepSeek-V3-style decoders: MLA attention (q/kv LoRA, decoupled RoPE, YaRN) and mixtures of experts
(sigmoid + correction-bias grouped top-k router, shared experts), the first `first_k_dense_replace`
layers dense, MTP layers at `model.layers.{L+k}` (deepseek_mtp.py). Family members: DeepSeek-V3 / R1 /
V3.1 (`deepseek_v3`), Kimi-K2 (`kimi_k2`: DeepSeek-V3's architecture, no MTP), Kimi-K2.5 (`kimi_k25`,
its decoder in `text_config` under `language_model.`), and the sparse-attention ones whose layers
carry an indexer (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`). `DeepseekSpec` is what the
runtime builds its decoder from (runtime/models/deepseek.py; DeepSeek-V3 and Kimi-K2, unquantized).
Sources: transformers models/deepseek_v3, deepseek_v32, glm_moe_dsa (configuration and modeling),
vLLM models/deepseek_v2.py :327-387, :1138-1190, :1269-1297, deepseek_mtp.py."""

from __future__ import annotations

from dataclasses import dataclass

from specpack.errors import InputError, UnsupportedError
from specpack.families import deepseek_mtp
from specpack.families.base import (Arch, Experts, Layer, Mtp, Tensor, architecture_of, embedding_tensors, linear,
                                    mlp_tensors, sigmoid_moe_tensors, size_problems, vector)
from specpack.families.checks import read_config


@dataclass(frozen=True)
class Yarn:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class DeepseekSpec:
    """Shape and numerics of a DeepSeek-V3-style target (the fields SpecModel reads come first)."""

    architecture: str
    model_type: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool
    yarn: Yarn | None
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    dtype: str | None = None

    def is_moe(self, layer: int) -> bool:
        """Layer `layer` (MTP layers continue the numbering) has routed experts."""
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def experts_held(self) -> int:
        """Routed experts the target's layers must hold (none when every layer is dense)."""
        return self.n_routed_experts if self.num_layers > self.first_k_dense_replace else 0

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Latent cache bytes one token takes in every layer."""
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes


def _ids(value) -> list[int]:
    return [] if value is None else [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _rope(cfg: dict) -> tuple[float, Yarn | None, list[str]]:
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return theta, None, []
    if kind != "yarn" or "factor" not in params or "original_max_position_embeddings" not in params:
        return theta, None, [f"rope scaling {kind!r} (supported: default, or yarn with factor and "
                             "original_max_position_embeddings)"]
    fields = {k: params[k] for k in ("mscale", "mscale_all_dim", "attention_factor") if params.get(k) is not None}
    return theta, Yarn(factor=float(params["factor"]),
                       original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)), **fields), []


def deepseek_spec_from_config(cfg: dict, generation_config: dict | None = None) -> DeepseekSpec:
    """Read a DeepSeek-V3 `config.json` dict; UnsupportedError lists every feature we cannot run."""
    arch = (cfg.get("architectures") or [None])[0]
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
    bad = size_problems(cfg, required, ("max_position_embeddings", "q_lora_rank"))
    if bad:
        raise InputError("DeepSeek-V3 config.json lacks required fields or has sizes that are not positive "
                         "integers", problems=bad)
    theta, yarn, problems = _rope(cfg)
    checks = [(cfg.get("hidden_act", "silu") != "silu", f"hidden_act {cfg.get('hidden_act')!r} (only silu)"),
              (cfg.get("topk_method", "noaux_tc") != "noaux_tc", f"topk_method {cfg.get('topk_method')!r} "
               "(only V3's noaux_tc)"),
              (cfg.get("scoring_func", "sigmoid") != "sigmoid", f"scoring_func {cfg.get('scoring_func')!r} "
               "(only sigmoid)"),
              (int(cfg.get("moe_layer_freq", 1)) != 1, "moe_layer_freq != 1"),
              (cfg.get("quantization_config") is not None, "quantised weights (quantization_config): "
               "dequantise to bf16 first")]
    problems += [text for bad, text in checks if bad]
    experts, groups = int(cfg.get("n_routed_experts") or 0), int(cfg.get("n_group") or 1)
    if experts and experts % groups:
        problems.append(f"n_routed_experts {experts} is not a multiple of n_group {groups}")
    if problems:
        raise UnsupportedError(f"target {arch} uses features specpack cannot run yet", problems=problems,
                               hint="open an issue with the model id")
    max_pos = int(cfg.get("max_position_embeddings") or 4096)
    eos = _ids(cfg.get("eos_token_id")) + _ids((generation_config or {}).get("eos_token_id"))
    return DeepseekSpec(
        architecture=arch, model_type=cfg.get("model_type", "deepseek_v3"), vocab_size=int(cfg["vocab_size"]),
        context_length=max_pos, eos_token_ids=tuple(dict.fromkeys(eos)), hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
        intermediate_size=int(cfg["intermediate_size"]),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0), n_routed_experts=experts,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0), n_group=groups,
        topk_group=int(cfg.get("topk_group") or 1), routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_interleave=bool(cfg.get("rope_interleave", True)), yarn=yarn,
        attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), max_position_embeddings=max_pos,
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0), bos_token_id=cfg.get("bos_token_id"),
        dtype=cfg.get("dtype", cfg.get("torch_dtype")))


def layer_tensor_shapes(s: DeepseekSpec, prefix: str, moe: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of one decoder layer in the published (transformers) names."""
    H, n, r, rope = s.hidden_size, s.num_heads, s.kv_lora_rank, s.qk_rope_head_dim
    qk = s.qk_nope_head_dim + rope
    a = prefix + "self_attn."
    shapes = {a + "kv_a_proj_with_mqa.weight": (r + rope, H), a + "kv_a_layernorm.weight": (r,),
              a + "kv_b_proj.weight": (n * (s.qk_nope_head_dim + s.v_head_dim), r),
              a + "o_proj.weight": (H, n * s.v_head_dim),
              prefix + "input_layernorm.weight": (H,), prefix + "post_attention_layernorm.weight": (H,)}
    if s.q_lora_rank:
        shapes.update({a + "q_a_proj.weight": (s.q_lora_rank, H), a + "q_a_layernorm.weight": (s.q_lora_rank,),
                       a + "q_b_proj.weight": (n * qk, s.q_lora_rank)})
    else:
        shapes[a + "q_proj.weight"] = (n * qk, H)
    if s.attention_bias:
        shapes.update({a + "kv_a_proj_with_mqa.bias": (r + rope,), a + "o_proj.bias": (H,)})
        if s.q_lora_rank:
            shapes[a + "q_a_proj.bias"] = (s.q_lora_rank,)

    def mlp(p, width):
        return {p + "gate_proj.weight": (width, H), p + "up_proj.weight": (width, H),
                p + "down_proj.weight": (H, width)}

    m = prefix + "mlp."
    if not moe:
        return {**shapes, **mlp(m, s.intermediate_size)}
    shapes.update({m + "gate.weight": (s.n_routed_experts, H),
                   m + "gate.e_score_correction_bias": (s.n_routed_experts,)})
    for e in range(s.n_routed_experts):
        shapes.update(mlp(f"{m}experts.{e}.", s.moe_intermediate_size))
    if s.n_shared_experts:
        shapes.update(mlp(m + "shared_experts.", s.moe_intermediate_size * s.n_shared_experts))
    return shapes


def target_tensor_shapes(s: DeepseekSpec) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (s.vocab_size, s.hidden_size), "model.norm.weight": (s.hidden_size,)}
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, s.hidden_size)
    for i in range(s.num_layers):
        shapes.update(layer_tensor_shapes(s, f"model.layers.{i}.", s.is_moe(i)))
    return shapes


def load_deepseek_spec(model_dir) -> DeepseekSpec:
    """`deepseek_spec_from_config` for a model directory (config.json + optional generation_config.json)."""
    return deepseek_spec_from_config(*read_config(model_dir))


# ---- the family verbs (base.py) ----

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa", "kimi_k25")
ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                 "KimiK25ForConditionalGeneration")
RUNS = ("deepseek_v3", "kimi_k2")  # the runtime's decoder has no sparse-attention indexer
MLA = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")


def describe(config: dict, text: dict) -> Arch:
    bad = size_problems(text, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", *MLA),
                        ("q_lora_rank", "moe_intermediate_size", "max_position_embeddings", "index_n_heads",
                         "index_head_dim"))
    if bad:
        raise InputError("DeepSeek-style config.json lacks required fields or has sizes that are not positive "
                         "integers", problems=bad)
    model_type, nested = config.get("model_type", "deepseek_v3"), "text_config" in config
    sparse = "index_topk" in text  # vLLM's test for DSA (deepseek_v2.py :1138)
    routed, shared = text.get("n_routed_experts") or 0, text.get("n_shared_experts") or 0
    size = text.get("moe_intermediate_size") or 0
    dense, every = text.get("first_k_dense_replace") or 0, text.get("moe_layer_freq") or 1
    if not isinstance(every, int):
        raise InputError(f"DeepSeek-style config.json: moe_layer_freq = {str(every)[:80]}: not a positive integer "
                         "(this family places MoE layers every k-th layer)")
    n, H = text["num_hidden_layers"], text["hidden_size"]
    layers = tuple(Layer("mla_sparse" if sparse else "mla", "moe" if routed and i >= dense and i % every == 0 else "dense")
                   for i in range(n))
    mtp_n = text.get("num_nextn_predict_layers") or 0
    p = "language_model.model." if nested else "model."
    return Arch(
        "deepseek", architecture_of(config), model_type, hidden_size=H, num_layers=n,
        num_heads=text["num_attention_heads"], num_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
        head_dim=text["qk_nope_head_dim"] + text["qk_rope_head_dim"], intermediate_size=text["intermediate_size"],
        vocab_size=text["vocab_size"], max_position_embeddings=text.get("max_position_embeddings") or 4096,
        layers=layers, experts=Experts(routed, text.get("num_experts_per_tok") or 0, size, shared, shared * size) if routed
        else None, mtp=Mtp(mtp_n, "mtp-deepseek", "model.layers.{n}.", "num_nextn_predict_layers", "embedding_first")
        if mtp_n else None, text_config=nested, prefix=p, embed=p + "embed_tokens.weight", norm=p + "norm.weight",
        lm_head=None if text.get("tie_word_embeddings") else ("language_model.lm_head.weight" if nested else "lm_head.weight"),
        kv_width=text["kv_lora_rank"] + text["qk_rope_head_dim"], runs=model_type in RUNS and _runs(config),
        details={k: text.get(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "v_head_dim", "index_n_heads", "index_head_dim", "attention_bias")})


def _runs(config: dict) -> bool:
    try:
        deepseek_spec_from_config(config)
    except (UnsupportedError, InputError):
        return False
    return True


def layer_tensors(arch: Arch, p: str, moe: bool, fused: bool = False) -> dict[str, Tensor]:
    """One MLA layer (its indexer on a sparse-attention layer) and its MLP, in the published names."""
    d, H, n = arch.details, arch.hidden_size, arch.num_heads
    r, rope, nope, v, q = d["kv_lora_rank"], d["qk_rope_head_dim"], d["qk_nope_head_dim"], d["v_head_dim"], d["q_lora_rank"]
    a = p + "self_attn."
    out = {p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H),
           a + "kv_a_proj_with_mqa.weight": linear(r + rope, H), a + "kv_a_layernorm.weight": vector(r),
           a + "kv_b_proj.weight": linear(n * (nope + v), r), a + "o_proj.weight": linear(H, n * v)}
    if q:
        out.update({a + "q_a_proj.weight": linear(q, H), a + "q_a_layernorm.weight": vector(q),
                    a + "q_b_proj.weight": linear(n * (nope + rope), q)})
    else:
        out[a + "q_proj.weight"] = linear(n * (nope + rope), H)
    if arch.layers[0].attention == "mla_sparse":
        ih, idim, x = d["index_n_heads"], d["index_head_dim"], a + "indexer."
        out.update({x + "wq_b.weight": linear(ih * idim, q), x + "wk.weight": linear(idim, H),
                    x + "k_norm.weight": vector(idim), x + "k_norm.bias": vector(idim),
                    x + "weights_proj.weight": Tensor((ih, H))})
    m = p + "mlp."
    return {**out, **(sigmoid_moe_tensors(m, H, arch.experts) if moe else mlp_tensors(m, H, arch.intermediate_size))}


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    out = embedding_tensors(arch)
    for i, layer in enumerate(arch.layers):
        out.update(layer_tensors(arch, f"{arch.prefix}layers.{i}.", layer.mlp == "moe"))
    return out


def mtp_fusion(arch: Arch, k: int) -> dict[str, str]:
    return deepseek_mtp.fusion(arch, k)


def mtp_block(arch: Arch, k: int, fused: bool = False) -> tuple[str, dict[str, Tensor]]:
    """MTP module k's decoder layer: a MoE layer (its indexer on sparse-attention targets) at L + k."""
    p = deepseek_mtp.prefix(arch, k)
    return p, layer_tensors(arch, p, arch.experts is not None)
