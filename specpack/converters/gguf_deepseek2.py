"""llama.cpp's `deepseek2` GGUF layout (DeepSeek-V2/V3; GLM-4.7-Flash with its nextn block), as the
llama.cpp the llama-cpp-python 0.3.36 sdist vendors names it: tensor names from `gguf-py/gguf/
constants.py` (MODEL_ARCH.DEEPSEEK2's tensors) and `tensor_mapping.py` (the Hugging Face names each is
converted from), the conversion rules from `conversion/deepseek.py` DeepseekV2Model (experts stacked
into one 3-D tensor per projection; `kv_b_proj` split into `attn_k_b`, transposed, and `attn_v_b`;
`e_score_correction_bias` as `exp_probs_b.bias`; one MQA KV head) and `conversion/glm.py`
Glm4MoeLiteModel (the nextn block kept as `blk.{L+k}.nextn.*` after the L trunk blocks, with
`{arch}.nextn_predict_layers`), and what `src/models/deepseek2.cpp` loads.

GGUF leaf -> Hugging Face leaf under `model.layers.{i}.` (weights, `.weight` on both sides), read both
ways: the llama.cpp export writes with it inverted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

ARCH = "deepseek2"
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
         "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
         "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
         "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
         "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
# the nextn (MTP) block's own tensors; its attention and MoE use BLOCK's names
NEXTN = {"nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
         "nextn.embed_tokens": "embed_tokens", "nextn.shared_head_head": "shared_head.head",
         "nextn.shared_head_norm": "shared_head.norm"}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
ROUTER_BIAS = ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias")  # (GGUF leaf, HF leaf): no .weight
KV_B = ("attn_k_b", "attn_v_b", "self_attn.kv_b_proj")


def split_kv_b(kv_b: np.ndarray, heads: int, nope: int, v_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj [heads * (nope + v), lora] -> (k_b [heads, lora, nope], v_b [heads, v, lora]), as
    DeepseekV2Model.modify_tensors splits it for MLA's absorbed form."""
    if kv_b.shape[0] != heads * (nope + v_dim):
        raise ValueError(f"kv_b_proj has {kv_b.shape[0]} rows, expected heads {heads} x (nope {nope} + v {v_dim})")
    per_head = kv_b.reshape(heads, nope + v_dim, kv_b.shape[-1])
    return np.ascontiguousarray(per_head[:, :nope].swapaxes(1, 2)), np.ascontiguousarray(per_head[:, nope:])


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """The inverse of split_kv_b: (k_b [heads, lora, nope], v_b [heads, v, lora]) -> kv_b_proj."""
    per_head = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
    return per_head.reshape(-1, per_head.shape[-1])


# ---- reading a deepseek2 GGUF back as a DeepSeek-V3 checkpoint (import-gguf) ----------------------

@dataclass(frozen=True)
class Part:
    """One Hugging Face tensor made from GGUF tensors: `make(arrays of sources, torch order)`."""

    hf_name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    make: Callable[[list[np.ndarray]], np.ndarray]


def read_config(get, names: set[str], path) -> dict:
    """DeepseekV3Config keyword arguments from a deepseek2 GGUF's keys (`get(key, default)` without the
    arch prefix), as load_arch_hparams reads them; the MTP layers are the last nextn_predict_layers blocks."""
    from specpack.errors import InputError, UnsupportedError

    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.kv_lora_rank", "attention.key_length_mla", "attention.value_length_mla",
                "rope.dimension_count", "expert_feed_forward_length", "attention.layer_norm_rms_epsilon",
                "context_length")
    missing = [f"{ARCH}.{k}" for k in required if get(k) is None]
    if missing:
        raise InputError(f"{path} lacks metadata a deepseek2 model needs", problems=missing,
                         hint="a GGUF without key_length_mla predates llama.cpp's split attn_k_b / attn_v_b: "
                              "convert the model again")
    blocks, nextn = get("block_count"), get("nextn_predict_layers", 0)
    layers, vocab = blocks - nextn, get("vocab_size")
    lite = layers in (26, 27) or (layers == 48 and vocab == 128256)
    gating = get("expert_gating_func") or (2 if layers in (47, 48) and vocab == 154880 else 1)
    groups = get("expert_group_count", 1) or 1
    if gating not in (1, 2):
        raise UnsupportedError(f"{path}: expert gating function {gating} (1 softmax, 2 sigmoid are read)")
    if gating == 1 and groups > 1:
        raise UnsupportedError(f"{path}: softmax routing in {groups} expert groups: llama.cpp ranks groups by their "
                               "top-2 scores, which no DeepSeek checkpoint with softmax routing does")
    rope, nope = get("rope.dimension_count"), get("attention.key_length_mla") - get("rope.dimension_count")
    return dict(
        vocab_size=vocab, hidden_size=get("embedding_length"), intermediate_size=get("feed_forward_length"),
        moe_intermediate_size=get("expert_feed_forward_length"), num_hidden_layers=layers,
        num_nextn_predict_layers=nextn, num_attention_heads=get("attention.head_count"),
        num_key_value_heads=get("attention.head_count"), n_routed_experts=get("expert_count"),
        n_shared_experts=get("expert_shared_count", 0), num_experts_per_tok=get("expert_used_count"),
        n_group=groups, topk_group=get("expert_group_used_count", 1) or 1,
        first_k_dense_replace=get("leading_dense_block_count", 0),
        q_lora_rank=None if lite else get("attention.q_lora_rank"), kv_lora_rank=get("attention.kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=get("attention.value_length_mla"),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)), norm_topk_prob=bool(get("expert_weights_norm", False)),
        scoring_func="sigmoid" if gating == 2 else "softmax", topk_method="noaux_tc" if gating == 2 else "greedy",
        max_position_embeddings=get("context_length"), rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_parameters=_rope(get, path),
        rope_interleave=True, tie_word_embeddings="output.weight" not in names,
        architectures=["DeepseekV3ForCausalLM"])


def _rope(get, path) -> dict:
    """transformers' rope_parameters for the file's rope: plain, or YaRN as DeepseekV2Model writes it (mscale and
    mscale_all_dim both the multiplier / 0.1: llama.cpp's deepseek2 scales attention as if they were equal)."""
    from specpack.errors import UnsupportedError

    rope, kind = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}, get("rope.scaling.type", "none")
    if kind == "none":
        return rope
    if kind != "yarn" or get("rope.scaling.factor") is None or get("rope.scaling.original_context_length") is None:
        raise UnsupportedError(f"{path}: rope scaling {kind!r} (deepseek2 files are read with YaRN, its factor and "
                               "original context length, or none)")
    mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    return {**rope, "rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)), "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale}


def check_nextn(config: dict, names: set[str], path) -> None:
    """`nextn_predict_layers` against the blocks that hold nextn tensors: the last ones, all of them."""
    from specpack.errors import ConversionError

    L, n = config["num_hidden_layers"], config["num_nextn_predict_layers"]
    held = sorted({int(m[1]) for name in names if (m := re.match(r"blk\.(\d+)\.nextn\.", name))})
    if held != list(range(L, L + n)):
        raise ConversionError(f"{path}: {ARCH}.nextn_predict_layers is {n}, but its nextn tensors are in blocks "
                              f"{held or 'none'}", problems=[f"expected the nextn block(s) {list(range(L, L + n)) or 'none'} "
                                                              f"after the {L} trunk blocks"],
                              hint="the metadata and the tensors must describe one model; convert it again")


class _Plan:
    """Parts planned against a file's tensors (`shapes`: GGUF name -> torch-order shape): what each Hugging Face
    tensor is made from, the problems met, and which GGUF tensors were claimed."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes, self.out, self.problems, self.used = shapes, [], [], set()

    def take(self, name: str) -> bool:
        self.used.add(name)
        return name in self.shapes

    def one(self, gguf: str, hf: str, want: tuple) -> None:
        """`hf` is the GGUF tensor `gguf` as it is, of shape `want`."""
        if not self.take(gguf):
            self.problems.append(f"{gguf}: missing")
        elif self.shapes[gguf] != want:
            self.problems.append(f"{gguf}: shape {list(self.shapes[gguf])}, expected {list(want)}")
        else:
            self.out.append(Part(hf, want, (gguf,), lambda a: a[0]))

    def done(self, what: str) -> tuple[list[Part], list[str]]:
        left = [f"{name}: not a tensor of {what}" for name in self.shapes if name not in self.used]
        return self.out, self.problems + left


def parts(config: dict, shapes: dict[str, tuple[int, ...]]) -> tuple[list[Part], list[str]]:
    """Every Hugging Face tensor of `config`'s DeepseekV3ForCausalLM (its nextn blocks as DeepSeek's
    `model.layers.{L+k}.*`) and the GGUF tensors each is made from (`shapes`: GGUF name -> torch-order
    shape); the problems: GGUF tensors left over, missing, or of the wrong shape."""
    c, plan = config, _Plan(shapes)
    H, V = c["hidden_size"], c["vocab_size"]
    plan.one("token_embd.weight", "model.embed_tokens.weight", (V, H))
    plan.one("output_norm.weight", "model.norm.weight", (H,))
    if not c["tie_word_embeddings"]:
        plan.one("output.weight", "lm_head.weight", (V, H))
    for i in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        _layer(c, i, plan)
    return plan.done("this deepseek2 model")


def nextn_parts(config: dict, shapes: dict[str, tuple[int, ...]]) -> tuple[list[Part], list[str]]:
    """The MTP layers alone (`model.layers.{L+k}.*`) from a file's nextn blocks (llama.cpp's `--mtp` output
    holds nothing else but the shared embedding, norm and head), without DeepSeek's copies of the embedding
    and head (the target's own are used, as llama.cpp uses token_embd / output where they are absent)."""
    L, n = config["num_hidden_layers"], config["num_nextn_predict_layers"]
    copies = {f"blk.{i}.nextn.{leaf}.weight" for i in range(L, L + n) for leaf in ("embed_tokens", "shared_head_head")}
    plan = _Plan({k: v for k, v in shapes.items()
                  if k not in copies and any(k.startswith(f"blk.{i}.") for i in range(L, L + n))})
    for i in range(L, L + n):
        _layer(config, i, plan)
    return plan.done("this deepseek2 model's nextn block")


def _layer(c: dict, i: int, plan: _Plan) -> None:
    one, take, shapes = plan.one, plan.take, plan.shapes
    H, heads, lora, rope = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v, q = c["qk_nope_head_dim"], c["v_head_dim"], c["q_lora_rank"]
    g, p = f"blk.{i}.", f"model.layers.{i}."
    one(g + "attn_norm.weight", p + "input_layernorm.weight", (H,))
    if q:
        one(g + "attn_q_a.weight", p + "self_attn.q_a_proj.weight", (q, H))
        one(g + "attn_q_a_norm.weight", p + "self_attn.q_a_layernorm.weight", (q,))
        one(g + "attn_q_b.weight", p + "self_attn.q_b_proj.weight", (heads * (nope + rope), q))
    else:
        one(g + "attn_q.weight", p + "self_attn.q_proj.weight", (heads * (nope + rope), H))
    one(g + "attn_kv_a_mqa.weight", p + "self_attn.kv_a_proj_with_mqa.weight", (lora + rope, H))
    one(g + "attn_kv_a_norm.weight", p + "self_attn.kv_a_layernorm.weight", (lora,))
    kb, vb = g + "attn_k_b.weight", g + "attn_v_b.weight"
    if (take(kb) & take(vb)) and shapes[kb] == (heads, lora, nope) and shapes[vb] == (heads, v, lora):
        plan.out.append(Part(p + "self_attn.kv_b_proj.weight", (heads * (nope + v), lora), (kb, vb), lambda a: join_kv_b(*a)))
    else:
        plan.problems.append(f"{kb} / {vb}: missing or not of shapes {[heads, lora, nope]} / {[heads, v, lora]}")
    one(g + "attn_output.weight", p + "self_attn.o_proj.weight", (H, heads * v))
    one(g + "ffn_norm.weight", p + "post_attention_layernorm.weight", (H,))
    if i < c["first_k_dense_replace"]:
        for leaf, shape in (("gate", (c["intermediate_size"], H)), ("up", (c["intermediate_size"], H)),
                            ("down", (H, c["intermediate_size"]))):
            one(g + f"ffn_{leaf}.weight", p + f"mlp.{leaf}_proj.weight", shape)
    else:
        _moe(c, g, p, plan)
    if i >= c["num_hidden_layers"]:
        for gguf, hf in NEXTN.items():
            shape = {"eh_proj": (H, 2 * H), "embed_tokens": (c["vocab_size"], H),
                     "shared_head.head": (c["vocab_size"], H)}.get(hf, (H,))
            if hf in ("embed_tokens", "shared_head.head") and g + gguf + ".weight" not in shapes:
                continue  # optional: llama.cpp uses token_embd / output (deepseek2.cpp TENSOR_NOT_REQUIRED)
            one(g + gguf + ".weight", p + hf + ".weight", shape)


def _moe(c: dict, g: str, p: str, plan: _Plan) -> None:
    one, take, shapes, out, problems = plan.one, plan.take, plan.shapes, plan.out, plan.problems
    H, E, ff = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    one(g + "ffn_gate_inp.weight", p + "mlp.gate.weight", (E, H))
    if take(g + ROUTER_BIAS[0]):
        one(g + ROUTER_BIAS[0], p + ROUTER_BIAS[1], (E,))
    elif c["scoring_func"] == "sigmoid":
        problems.append(f"{g}{ROUTER_BIAS[0]}: missing (sigmoid routing reads its score-correction bias)")
    fused = g + "ffn_gate_up_exps.weight"
    for gguf, proj in EXPERTS.items():
        shape = (H, ff) if proj == "down_proj" else (ff, H)
        name = g + gguf + ".weight"
        if proj != "down_proj" and take(fused):  # conversion/base.py fuse_gate_up_exps: gate rows, then up rows
            if shapes[fused] != (E, 2 * ff, H):
                problems.append(f"{fused}: shape {list(shapes[fused])}, expected {[E, 2 * ff, H]}")
                continue
            half = 0 if proj == "gate_proj" else 1
            out += [Part(p + f"mlp.experts.{e}.{proj}.weight", shape, (fused,),
                         lambda a, e=e, half=half: a[0][e, half * ff:(half + 1) * ff]) for e in range(E)]
        elif not take(name) or shapes[name] != (E, *shape):
            problems.append(f"{name}: missing or not of shape {[E, *shape]}")
        else:
            out += [Part(p + f"mlp.experts.{e}.{proj}.weight", shape, (name,), lambda a, e=e: a[0][e]) for e in range(E)]
    shared = c["n_shared_experts"] * ff
    if shared:
        for leaf, shape in (("gate", (shared, H)), ("up", (shared, H)), ("down", (H, shared))):
            one(g + f"ffn_{leaf}_shexp.weight", p + f"mlp.shared_experts.{leaf}_proj.weight", shape)
