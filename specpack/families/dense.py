"""The dense decoders specpack runs itself: Llama (SmolLM, SmolLM2), Mistral, Qwen2, Qwen3 and MiMo
(a Qwen2 decoder with MTP layers at `model.mtp_layers.{k}`), and Mistral 3's decoder inside its
multimodal wrapper. `TargetSpec` is what the runtime builds its model from; `describe` / `tensors`
are the family verbs every family module shares (base.py). Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specpack.errors import InputError, UnsupportedError
from specpack.families.base import (Arch, Layer, Mtp, Tensor, architecture_of, attention_tensors, embedding_tensors,
                                    geometry, is_moe, layer_types, mlp_tensors, size_problems, vector)
from specpack.families.checks import read_config

# architecture -> the model_type transformers writes for it
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # also SmolLM / SmolLM2
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MiMoForCausalLM": "qwen2",  # Xiaomi MiMo: a Qwen2 decoder (+ MTP layers, see runtime/mtp.py)
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3 attention, routed experts (families/qwen3_moe.py)
}
# loaded by runtime/deepseek.py (MLA + MoE), not by `target_spec_from_config`
DEEPSEEK_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# config.json sizes that must be positive integers wherever a config sets them
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` 'llama3' uses all fields, 'linear' only `factor`."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TargetSpec:
    """The shape and numerics of a supported decoder-only target."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2 always; Llama when attention_bias)
    o_proj_bias: bool  # Llama's attention_bias also puts one on o_proj
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int
    context_length: int  # positions we can run exactly (a sliding window, if any, clips it)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's declared dtype
    experts: int = 0  # Qwen3-MoE: routed experts per MoE layer (softmax router, no shared expert)
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top k routing weights renormalized to sum 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts (the rest dense)

    def is_moe(self, i: int) -> bool:
        return i in self.moe_layers

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """KV cache bytes one token takes (keys and values of every layer)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def rope_from_config(cfg: dict) -> tuple[float, RopeScaling | None, list[str]]:
    """(theta, scaling, problems) from either the transformers v5 `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling`. Problems name what we cannot run exactly."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    problems = []
    if kind not in SUPPORTED_ROPE_TYPES:
        problems.append(f"rope scaling type '{kind}' (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        return theta, None, problems
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        problems.append("partial_rotary_factor != 1")
    if kind == "default":
        return theta, None, problems
    fields = {k: params[k] for k in ("low_freq_factor", "high_freq_factor",
                                     "original_max_position_embeddings") if k in params}
    if kind == "llama3" and len(fields) < 3:
        problems.append("llama3 rope scaling needs low_freq_factor, high_freq_factor and "
                        "original_max_position_embeddings")
        return theta, None, problems
    return theta, RopeScaling(kind=kind, factor=float(params.get("factor", 1.0)), **fields), problems


def _sliding_window(cfg: dict) -> int | None:
    """The attention window if any layer uses one (Mistral v0.1, Qwen with use_sliding_window)."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") is False and "sliding_attention" not in layer_types:
        return None
    return int(window) if window else None


def target_spec_from_config(cfg: dict, generation_config: dict | None = None) -> TargetSpec:
    """Read a Hugging Face `config.json` dict (and optionally `generation_config.json`, whose EOS
    ids are added) into a `TargetSpec`. Raises UnsupportedError / InputError listing every problem.
    A multimodal wrapper of one of these decoders (WRAPPERS) reads as its text_config's decoder."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch in WRAPPERS and isinstance(cfg.get("text_config"), dict):
        return target_spec_from_config(_unwrapped(cfg, WRAPPERS[arch]), generation_config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(
            f"target architecture {arch!r} is not supported",
            hint="supported: " + ", ".join((*SUPPORTED_ARCHITECTURES, *DEEPSEEK_ARCHITECTURES))
                 + " (SmolLM/SmolLM2 are Llama)")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size")
    bad = size_problems(cfg, required, SIZE_FIELDS)
    if bad:
        raise InputError("target config.json lacks required fields or has sizes that are not positive "
                         "integers", problems=bad, hint="is this a Hugging Face model config.json?")
    theta, scaling, problems = rope_from_config(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act '{cfg['hidden_act']}' (only silu)")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias")
    if problems:
        raise UnsupportedError(f"target {arch} uses features specpack cannot run yet",
                               problems=problems, hint="open an issue with the model id")

    model_type = SUPPORTED_ARCHITECTURES[arch]
    heads = int(cfg["num_attention_heads"])
    max_pos = int(cfg.get("max_position_embeddings") or 4096)
    window = _sliding_window(cfg)
    eos = _ids(cfg.get("eos_token_id")) + _ids((generation_config or {}).get("eos_token_id"))
    llama_bias = bool(cfg.get("attention_bias", False)) and model_type in ("llama", "mistral", "qwen3", "qwen3_moe")
    return TargetSpec(
        architecture=arch,
        model_type=cfg.get("model_type", model_type),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or llama_bias,
        o_proj_bias=llama_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=max_pos,
        context_length=min(max_pos, window) if window else max_pos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=cfg.get("bos_token_id"),
        dtype=cfg.get("dtype", cfg.get("torch_dtype")),
        **(_experts(cfg) if model_type == "qwen3_moe" else {}),
    )


def _experts(cfg: dict) -> dict:
    """Qwen3-MoE's routing as the spec states it (transformers Qwen3MoeSparseMoeBlock)."""
    routed = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    bad = size_problems({**cfg, "num_experts": routed}, ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
                        ())
    if not bad and cfg["num_experts_per_tok"] > routed:
        bad = [f"num_experts_per_tok {cfg['num_experts_per_tok']} > num_experts {routed}"]
    if bad:
        raise InputError("Qwen3-MoE config.json lacks its routing or states it inconsistently", problems=bad)
    return dict(experts=routed, experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob")),
                moe_layers=tuple(i for i in range(int(cfg["num_hidden_layers"])) if is_moe(cfg, i, routed)))


# multimodal wrappers whose text_config is a decoder above: the vision tower is carried, never run
WRAPPERS = {"Mistral3ForConditionalGeneration": "MistralForCausalLM"}


def _unwrapped(cfg: dict, arch: str) -> dict:
    """The wrapped decoder's config: text_config, with the token ids and dtype a wrapper states at the
    top where its text_config does not, and the wrapper's tying (`_tied`)."""
    top = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "dtype", "torch_dtype") if k in cfg}
    text = {**top, **cfg["text_config"], "architectures": [arch]}
    return {**text, "tie_word_embeddings": _tied(cfg, cfg["text_config"])}


def target_tensor_shapes(s: TargetSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a transformers checkpoint of this target must hold, with its shape."""
    H, hd, q, kv = s.hidden_size, s.head_dim, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes = {"model.embed_tokens.weight": (s.vocab_size, H), "model.norm.weight": (H,)}
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, H)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "mlp.gate_proj.weight": (s.intermediate_size, H),
                       p + "mlp.up_proj.weight": (s.intermediate_size, H),
                       p + "mlp.down_proj.weight": (H, s.intermediate_size),
                       p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
        if s.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if s.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if s.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if s.is_moe(i):
            for name in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"{p}mlp.{name}.weight"]
            shapes.update(_expert_shapes(s, p + "mlp."))
    return shapes


def _expert_shapes(s: TargetSpec, p: str) -> dict[str, tuple[int, ...]]:
    """A Qwen3-MoE layer's router and experts, one MLP each (as Qwen3-MoE checkpoints are published)."""
    H, inter = s.hidden_size, s.moe_intermediate_size
    shapes = {p + "gate.weight": (s.experts, H)}
    for e in range(s.experts):
        q = f"{p}experts.{e}."
        shapes.update({q + "gate_proj.weight": (inter, H), q + "up_proj.weight": (inter, H),
                       q + "down_proj.weight": (H, inter)})
    return shapes


def load_target_spec(model_dir) -> TargetSpec:
    """`target_spec_from_config` for a model directory (config.json + optional generation_config.json)."""
    return target_spec_from_config(*read_config(model_dir))


# ---- the family verbs (base.py) ----

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mimo", "mistral3")
ARCHITECTURES = (*(a for a, t in SUPPORTED_ARCHITECTURES.items() if t in MODEL_TYPES),
                 "Mistral3ForConditionalGeneration")
PREFIXES = ("language_model.model.", "model.language_model.")  # Mistral 3: published, then v5 re-saves


def describe(config: dict, text: dict) -> Arch:
    g = geometry(text, ("intermediate_size",))
    nested = "text_config" in config
    kind = text.get("model_type") or SUPPORTED_ARCHITECTURES.get(architecture_of(config), "llama")
    window = _sliding_window(text)
    kinds = layer_types(text, g["num_layers"], lambda i: "sliding_attention" if window else "full_attention")
    layers = tuple(Layer("sliding", "dense", window) if k == "sliding_attention" else Layer("full", "dense")
                   for k in kinds)
    n = text.get("num_nextn_predict_layers") or 0
    mtp = Mtp(n, "mtp-mimo", "model.mtp_layers.{k}.", "num_nextn_predict_layers", "hidden_first") if n else None
    p = PREFIXES[0] if nested else "model."
    head = "language_model.lm_head.weight" if nested else "lm_head.weight"
    llama_bias = bool(text.get("attention_bias")) and kind in ("llama", "mistral", "qwen3")
    return Arch("dense", architecture_of(config), config.get("model_type", kind), layers=layers, mtp=mtp,
                text_config=nested, prefix=p, embed=p + "embed_tokens.weight", norm=p + "norm.weight",
                lm_head=None if _tied(config, text) else head,
                kv_width=2 * g["num_kv_heads"] * g["head_dim"], runs=runs(config),
                details={"bias": kind in ("qwen2", "mimo") or llama_bias, "o_bias": llama_bias,
                         "qk_norm": kind == "qwen3", "prefixes": PREFIXES if nested else ("model.",)}, **g)


def _tied(config: dict, text: dict) -> bool:
    """A wrapper's top-level `tie_word_embeddings` decides where it is stated (transformers v5 ties by it)."""
    if "text_config" in config and "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def runs(config: dict) -> bool:
    """The runtime's dense decoder (runtime/models/dense.py, Qwen3-MoE's experts included) decodes this
    config: `target_spec_from_config` takes it."""
    try:
        target_spec_from_config(config)
    except (UnsupportedError, InputError):
        return False
    return True


def layer_tensors(arch: Arch, p: str) -> dict[str, Tensor]:
    H, d = arch.hidden_size, arch.details
    out = {p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H)}
    out.update(attention_tensors(p + "self_attn.", H, arch.num_heads, arch.num_kv_heads, arch.head_dim, bias=d["bias"],
                                 o_bias=d["o_bias"], qk_norm="head" if d["qk_norm"] else None))
    return {**out, **mlp_tensors(p + "mlp.", H, arch.intermediate_size)}


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    out = embedding_tensors(arch)
    for i in range(arch.num_layers):
        out.update(layer_tensors(arch, f"{arch.prefix}layers.{i}."))
    return out


def mtp_fusion(arch: Arch, k: int) -> dict[str, str]:
    """MiMo's MTP layer k: input_proj [H, 2H] over cat(hidden_layernorm(h), token_layernorm(embedding))
    (hidden first), a final norm (vLLM mimo_mtp.py)."""
    p = f"model.mtp_layers.{k}."
    return {"embed_norm": p + "token_layernorm.weight", "hidden_norm": p + "hidden_layernorm.weight",
            "proj": p + "input_proj.weight", "final_norm": p + "final_layernorm.weight"}


def mtp_block(arch: Arch, k: int, fused: bool = False) -> tuple[str, dict[str, Tensor]]:
    """MiMo's MTP layer k: a Qwen2 decoder layer under the same prefix."""
    p = f"model.mtp_layers.{k}."
    return p, layer_tensors(arch, p)
