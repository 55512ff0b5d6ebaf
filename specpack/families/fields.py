"""The type of every config.json field a family reads, checked before any family reads one, and the
counts a config states bounded by the checkpoint's own tensor list (so a config claiming 10^9 layers
costs nothing before it is refused).

    check_config(config, tensors=len(header), weights=parameters)   # one InputError naming every field

Fields are checked in the config, in its `text_config` and in its RoPE dicts (`rope_parameters`,
`rope_scaling`, and v5's per-layer-type dicts inside them). `null` is always allowed: it reads as
unstated, and a family that needs the value says it is missing. Numbers anywhere in the config must
be finite (Python's json reads `NaN` and `Infinity`), except where a published config writes `Infinity`
for "no limit" (UNLIMITED). A value a published release holds is never refused: tests/published_configs
holds each family's published config.json, and a test builds every one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from specpack.errors import InputError


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
    return (_int(v) or isinstance(v, float)) and math.isfinite(v)


@dataclass(frozen=True)
class Kind:
    """What a field must hold: `ok(value)`, and the words an error uses for it."""

    words: str
    ok: Callable[[object], bool]


SIZE = Kind("a positive integer", lambda v: _int(v) and v > 0)
COUNT = Kind("a non-negative integer", lambda v: _int(v) and v >= 0)
SIZES = Kind("a positive integer or a list of them",
             lambda v: SIZE.ok(v) or (isinstance(v, list) and all(SIZE.ok(x) for x in v)))
POSITIVE = Kind("a finite number above 0", lambda v: _real(v) and v > 0)
FRACTION = Kind("a number in (0, 1]", lambda v: _real(v) and 0 < v <= 1)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
STR = Kind("a string", lambda v: isinstance(v, str))
STRS = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
STR_OR_STRS = Kind("a string or a list of strings", lambda v: STR.ok(v) or STRS.ok(v))
INTS = Kind("a list of non-negative integers", lambda v: isinstance(v, list) and all(COUNT.ok(x) for x in v))
IDS = Kind("a token id or a list of them", lambda v: COUNT.ok(v) or INTS.ok(v))
LAYER_IDS = Kind("a list of integers", lambda v: isinstance(v, list) and all(_int(x) for x in v))
OBJECT = Kind("a JSON object", lambda v: isinstance(v, dict))


def _no_limit(v) -> bool:
    """+Infinity as JSON configs spell it: `Infinity` (json), `{"__float__": "Infinity"}` (transformers 5)."""
    return v == math.inf or v == {"__float__": "Infinity"}


# Mamba-2's clamp on dt: transformers' default and the published Nemotron-H configs are [0.0, Infinity]
TIME_LIMIT = Kind("[lower, upper] with 0 <= lower <= upper (upper Infinity: no limit)",
                  lambda v: isinstance(v, list) and len(v) == 2 and _real(v[0]) and v[0] >= 0
                  and (_no_limit(v[1]) or (_real(v[1]) and v[0] <= v[1])))

_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "vocab_size", "max_position_embeddings", "moe_intermediate_size", "num_experts_per_tok",
          "experts_per_token", "n_routed_experts", "num_experts", "num_local_experts",
          "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank",
          "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "sliding_window",
          "sliding_window_pattern", "attention_chunk_size", "conv_kernel", "mamba_d_conv", "n_groups",
          "mamba_n_groups", "moe_latent_size", "full_attention_interval", "interleave_moe_layer_step",
          "decoder_sparse_step", "no_rope_layer_interval", "intermediate_size_mlp",
          "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
          "original_max_position_embeddings", "draft_vocab_size",
          # DeepSeek-V4
          "hc_mult", "hc_sinkhorn_iters", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
          "compress_rate_csa", "compress_rate_hca", "dspark_block_size", "dspark_markov_rank",
          # DeepSeek-V4.1
          "engram_head_dim", "engram_n_heads", "engram_max_ngram_size", "engram_vocab_size", "candidate_topk_blocks",
          "candidate_block_size", "dspark_n_routed_experts",
          # MiniMax-M3
          "dense_intermediate_size", "rotary_dim", "index_block_size", "index_topk_blocks",
          "index_local_blocks")
_COUNTS = ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers", "num_mtp_modules",
           "mtp_num_hidden_layers", "num_hash_layers", "dspark_noise_token_id",
           "shared_intermediate_size", "dspark_num_experts_per_tok", "n_mtp_layers", "engram_pad_id")  # MiniMax-M2 / M1 publish 0: no shared expert
_BOOLS = ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window", "norm_topk_prob",
          "rope_interleave", "use_conv_bias", "use_mtp", "use_qk_norm", "truncate")
_STRS = ("model_type", "hidden_act", "dtype", "torch_dtype", "scoring_func", "topk_method", "hybrid_override_pattern",
         "mtp_hybrid_override_pattern", "mamba_ssm_dtype", "mamba_ssm_cache_dtype", "rope_type", "type",
         "expert_dtype")
_POSITIVE = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "low_freq_factor", "high_freq_factor", "hc_eps",
             "swiglu_limit", "compress_rope_theta", "swiglu_alpha")

FIELDS: dict[str, Kind] = {
    **dict.fromkeys(_SIZES, SIZE), **dict.fromkeys(_COUNTS, COUNT), **dict.fromkeys(_BOOLS, BOOL),
    **dict.fromkeys(_STRS, STR), **dict.fromkeys(_POSITIVE, POSITIVE),
    "intermediate_size": SIZES, "partial_rotary_factor": FRACTION,
    "architectures": STRS, "layer_types": STRS, "layers_block_type": STRS, "mtp_layers_block_type": STR_OR_STRS,
    "mlp_only_layers": INTS, "no_rope_layers": INTS, "moe_layers": INTS, "compress_ratios": INTS, "compress_rates": OBJECT,
    "kv_source_layer_ids": INTS, "index_source_layer_ids": INTS, "engram_layer_ids": INTS,
    "engram_num_embeddings": INTS, "vision_config": OBJECT,
    "mlp_layer_types": STRS, "dspark_target_layer_ids": LAYER_IDS, "sparse_attention_config": OBJECT,
    "moe_layer_freq": Kind("a positive integer (every k-th layer) or one 0 / 1 per layer",
                           lambda v: SIZE.ok(v) or INTS.ok(v)), "eos_token_id": IDS, "bos_token_id": COUNT,
    "text_config": OBJECT, "rope_parameters": OBJECT, "rope_scaling": OBJECT, "quantization_config": OBJECT,
    # drafters' configs (EAGLE-3 official and speculators layouts)
    "eagle_config": OBJECT, "transformer_layer_config": OBJECT, "speculators_config": OBJECT,
    "eagle_aux_hidden_state_layer_ids": LAYER_IDS, "time_step_limit": TIME_LIMIT,
}
# fields whose published values use Infinity for "no limit": their Kind checks them, not the finiteness rule
UNLIMITED = ("time_step_limit",)
ROPE = ("rope_parameters", "rope_scaling")
# counts that size a loop before the tensors are checked: each needs one tensor of the checkpoint at least
LOOPED = ("num_hidden_layers", "num_nextn_predict_layers", "num_mtp_modules", "mtp_num_hidden_layers")
# sizes no checkpoint holding fewer weights could have
BOUNDED = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads")


def check_config(config: dict, tensors: int | None = None, weights: int | None = None) -> None:
    """Raise one InputError naming every field of the wrong type, every number that is not finite,
    then every count above what `tensors` tensors (`weights` elements) could hold."""
    problems = _non_finite(config, "") + type_problems(config)
    if problems:
        raise InputError("config.json: fields of the wrong type or value", problems=problems,
                         hint="is this the model's own config.json? Each problem names the field and what it "
                              "must hold")
    problems = _bound_problems(config, tensors, weights)
    if problems:
        raise InputError("config.json claims sizes its weights cannot hold", problems=problems,
                         hint="the config and the safetensors files must come from the same model")


def type_problems(config: dict) -> list[str]:
    """`config`'s fields, its text_config's and its RoPE dicts', each against FIELDS."""
    problems = _fields(config, "")
    text = config.get("text_config")
    if isinstance(text, dict):
        problems += _fields(text, "text_config.")
    return problems


def _fields(obj: dict, where: str) -> list[str]:
    problems = [f"{where}{k} = {_show(v)}: not {FIELDS[k].words}"
                for k, v in obj.items() if k in FIELDS and v is not None and not FIELDS[k].ok(v)]
    for key in ROPE:
        rope = obj.get(key)
        if isinstance(rope, dict):
            problems += _fields({k: v for k, v in rope.items() if not isinstance(v, dict)}, f"{where}{key}.")
            for sub, inner in rope.items():  # v5: one dict per layer type
                if isinstance(inner, dict):
                    problems += _fields(inner, f"{where}{key}.{sub}.")
    return problems


def _non_finite(value, where: str) -> list[str]:
    """Every NaN or infinite number anywhere in `value` (iteratively: a config may nest deeply)."""
    problems, stack = [], [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            problems.append(f"{path or 'config'} = {v}: not a finite number")
        elif isinstance(v, dict):
            stack += [(f"{path}.{k}" if path else str(k), x) for k, x in v.items() if k not in UNLIMITED]
        elif isinstance(v, list):
            stack += [(f"{path}[{i}]", x) for i, x in enumerate(v)]
    return sorted(problems)


def _bound_problems(config: dict, tensors: int | None, weights: int | None) -> list[str]:
    problems = []
    for where, obj in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(obj, dict):
            continue
        if tensors is not None:
            problems += [f"{where}{k} {obj[k]:,} > the {tensors:,} tensors in its weights" for k in LOOPED
                         if _int(obj.get(k)) and obj[k] > tensors]
        if weights is not None:
            problems += [f"{where}{k} {v:,} > the {weights:,} weights in its safetensors files" for k in BOUNDED
                         for v in _ints(obj.get(k)) if v > weights]
    return problems


def _ints(v) -> list[int]:
    return [v] if _int(v) else [x for x in v if _int(x)] if isinstance(v, list) else []


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def field(obj: dict, key: str, kind: Kind, where: str, default=None):
    """`obj[key]` checked to be `kind` (`default` when absent or null), else an InputError naming
    `where + key`: how the quantization configs are read."""
    if not isinstance(obj, dict):
        raise InputError(f"{where.rstrip('.')} = {_show(obj)}: not a JSON object")
    value = obj.get(key)
    if value is None:
        return default
    if not kind.ok(value):
        raise InputError(f"{where}{key} = {_show(value)}: not {kind.words}")
    return value
