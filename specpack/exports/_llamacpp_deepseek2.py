"""A DeepSeek-V3 target as llama.cpp's `deepseek2` GGUF, with the artifact's MTP layer as its nextn block
(the layout converters/gguf_deepseek2.py names, read in the pinned llama.cpp).

llama.cpp's own converter writes DeepSeek-V3 without its MTP layer (conversion/deepseek.py
DeepseekV2Model: `skip_mtp = True`, "remove this when we support MTP for deepseek models"), but writes the
same block for GLM-4.7-Flash, a DeepSeek-V3-shaped model (Glm4MoeLiteModel: arch deepseek2, `blk.{L}.nextn.*`,
`deepseek2.nextn_predict_layers`), and `src/models/deepseek2.cpp` graph_mtp runs any deepseek2 GGUF that
holds it: `llama-server --spec-type draft-mtp` with no draft model drafts from the target file itself
(common/speculative.cpp). That graph fixes the bindings (EngineMtp below): cat(enorm(embedding),
hnorm(h)) embedding first; h = the target's final-norm output (`h_nextn` after output_norm); one nextn
block ("GLM4 MTP currently only supports a single MTP block"), with MLA (q_lora_rank > 0) and an MoE FFN;
each draft step hands the next the block's output after shared_head_norm.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from specpack.converters import gguf_deepseek2 as ds
from specpack.errors import UnsupportedError
from specpack.exports import _gguf, _mtp
from specpack.exports._common import target_tensors

# how llama.cpp runs each published MTP layout, or why it cannot here
MTP = {"mtp-deepseek": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "first", max_layers=1,
                                      separate_weights=True),
       "mtp-qwen3-next": "llama.cpp runs Qwen3-Next / Qwen3.5 MTP in its qwen3next / qwen35 archs, whose gated "
                         "delta-net targets this export does not write",
       "mtp-mimo": "llama.cpp has no MTP for MiMo-7B (MiMoForCausalLM); its mimo2 arch is MiMo-V2's",
       "mtp-nemotron-h": "llama.cpp runs Nemotron 3 MTP in its nemotron_h archs (Mamba-2 layers), which this export "
                         "does not write"}
_GLOBAL = {hf: g for g, hf in ds.GLOBAL.items()}
_BLOCK = {hf: g for g, hf in ds.BLOCK.items()}
_NEXTN = {hf: g for g, hf in ds.NEXTN.items()}
_EXPERTS = {hf: g for g, hf in ds.EXPERTS.items()}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(\w+)\.weight$")


def target_problems(config: dict) -> list[str]:
    """What the pinned llama.cpp's deepseek2 loader (src/models/deepseek2.cpp) would read otherwise."""
    L, vocab = config["num_hidden_layers"], config["vocab_size"]
    lite = L in (26, 27) or (L == 48 and vocab == 128256)  # load_arch_hparams: "lite variants"
    problems = []
    if lite != (config.get("q_lora_rank") is None):
        problems.append(f"llama.cpp takes a deepseek2 GGUF of {L} layers{' and vocabulary ' + str(vocab) if L == 48 else ''} "
                        f"for a {'Lite model without' if lite else 'model with'} q_lora_rank, but this target has "
                        f"q_lora_rank {config.get('q_lora_rank')}")
    if config.get("n_group", 1) > 1 and config.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method {config['topk_method']!r} with {config['n_group']} groups: llama.cpp ranks groups "
                        "by their top-2 scores (noaux_tc) only (llama-graph.cpp build_moe_ffn)")
    if config.get("scoring_func", "softmax") not in ("softmax", "sigmoid"):
        problems.append(f"scoring_func {config['scoring_func']!r}: not written by this export")
    return problems


def rope_problems(rope: dict | None) -> list[str]:
    """Why llama.cpp would rotate or scale this target's attention otherwise. It reads YaRN (conversion/base.py:
    factor, original context, betas; DeepseekV2Model: yarn_log_multiplier = 0.1 * mscale_all_dim) and, in
    llama-context.cpp, takes `mscale` to be 1, or mscale_all_dim where that is not 1 ("here we assume
    mscale == 1.0f"): its rotary tables then carry no attention factor, and transformers' DeepSeek-V3 does the
    same only where mscale equals mscale_all_dim (get_mscale(f, mscale) / get_mscale(f, mscale_all_dim))."""
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return []
    if kind != "yarn":
        return [f"the target's rope scaling {kind!r}: llama.cpp's deepseek2 reads YaRN only"]
    mscale, all_dim = rope.get("mscale", 1.0), rope.get("mscale_all_dim", 0.0)
    if not all_dim or float(mscale) != float(all_dim):
        return [f"YaRN with mscale {mscale} and mscale_all_dim {all_dim or 'unset'}: llama.cpp scales attention as if "
                "they were equal (llama-context.cpp \"here we assume mscale == 1.0f\"), which would change the logits"]
    return []


def nextn_problems(config: dict) -> list[str]:
    """What deepseek2.cpp graph_mtp asserts of the nextn block that this target's MTP layer lacks."""
    problems = []
    if config["num_hidden_layers"] < config.get("first_k_dense_replace", 0):
        problems.append(f"first_k_dense_replace {config['first_k_dense_replace']} makes the MTP layer dense; llama.cpp "
                        "runs it with an MoE FFN (\"GLM4 MTP block expected to use MoE FFN\")")
    if not config.get("q_lora_rank"):
        problems.append("no q_lora_rank: llama.cpp's MTP graph runs the low-rank query path only (GGML_ASSERT n_lora_q > 0)")
    return problems


def write_target(ctx, config: dict) -> tuple[Path, str]:
    """target-T.gguf: the trunk, and the artifact's MTP layer as `blk.{L}.nextn.*` when its drafter is MTP."""
    d = ctx.manifest.drafter
    nextn = d.num_layers if d.kind == "mtp" else 0
    if nextn and nextn_problems(config):
        raise UnsupportedError("llama.cpp's deepseek2 MTP graph cannot run this MTP layer", problems=nextn_problems(config))
    path = ctx.out / f"target-{ctx.gguf_type}.gguf"
    writer = _gguf.open_writer(path, ds.ARCH, ctx.artifact.name)
    _hparams(writer, config, ctx.manifest.target.rope_scaling or {}, nextn, ctx.gguf_type)
    pre = _gguf.add_tokenizer(writer, ctx.artifact, ctx.gguf_pre)
    _plan(ctx, config, nextn).write(writer)
    return path, pre


def _hparams(writer, config: dict, rope: dict, nextn: int, gguf_type: str) -> None:
    """What TextModel.set_gguf_parameters and DeepseekV2Model.set_gguf_parameters write (+ nextn_predict_layers,
    as Glm4MoeLiteModel adds it); `rope`: the scaling the manifest states (rope_problems has passed it)."""
    c, lora, rope_dim = config, config["kv_lora_rank"], config["qk_rope_head_dim"]
    ints = {"context_length": c["max_position_embeddings"], "embedding_length": c["hidden_size"],
            "block_count": c["num_hidden_layers"] + nextn, "feed_forward_length": c["intermediate_size"],
            "attention.head_count": c["num_attention_heads"], "attention.head_count_kv": 1,  # MLA as MQA
            "expert_count": c["n_routed_experts"], "expert_used_count": c["num_experts_per_tok"],
            "expert_group_count": c.get("n_group") or 1, "expert_group_used_count": c.get("topk_group") or 1,
            "expert_gating_func": 2 if c.get("scoring_func") == "sigmoid" else 1,  # ExpertGatingFuncType
            "leading_dense_block_count": c.get("first_k_dense_replace", 0), "vocab_size": c["vocab_size"],
            "attention.kv_lora_rank": lora, "attention.key_length": lora + rope_dim, "attention.value_length": lora,
            "attention.key_length_mla": c["qk_nope_head_dim"] + rope_dim, "attention.value_length_mla": c["v_head_dim"],
            "expert_feed_forward_length": c["moe_intermediate_size"], "expert_shared_count": c.get("n_shared_experts") or 0,
            "rope.dimension_count": rope_dim}
    if c.get("q_lora_rank") is not None:
        ints["attention.q_lora_rank"] = c["q_lora_rank"]
    if nextn:
        ints["nextn_predict_layers"] = nextn
    for key, value in ints.items():
        writer.add_uint32(f"{ds.ARCH}.{key}", int(value))
    writer.add_float32(f"{ds.ARCH}.rope.freq_base", float(c["rope_theta"]))
    if rope.get("rope_type", rope.get("type")) == "yarn":  # as base.py + DeepseekV2Model write it
        writer.add_string(f"{ds.ARCH}.rope.scaling.type", "yarn")
        writer.add_float32(f"{ds.ARCH}.rope.scaling.factor", float(rope["factor"]))
        writer.add_uint32(f"{ds.ARCH}.rope.scaling.original_context_length", int(rope["original_max_position_embeddings"]))
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                writer.add_float32(f"{ds.ARCH}.rope.scaling.yarn_{key}", float(rope[key]))
        writer.add_float32(f"{ds.ARCH}.rope.scaling.yarn_log_multiplier", 0.1 * float(rope["mscale_all_dim"]))
    writer.add_float32(f"{ds.ARCH}.attention.layer_norm_rms_epsilon", float(c.get("rms_norm_eps", 1e-6)))
    if c.get("routed_scaling_factor") is not None:
        writer.add_float32(f"{ds.ARCH}.expert_weights_scale", float(c["routed_scaling_factor"]))
    if c.get("norm_topk_prob"):
        writer.add_bool(f"{ds.ARCH}.expert_weights_norm", True)
    writer.add_file_type(_gguf.file_type(gguf_type))


def _sources(ctx, nextn: int) -> list[tuple[Path, str, str, tuple]]:
    """(file, name in it, Hugging Face name, shape) of every tensor to write: the target's trunk, and its first
    `nextn` MTP layers from the target shards or, where the artifact stores them, drafter/model.safetensors."""
    L = ctx.manifest.target.num_hidden_layers
    out = []
    for name, (file, meta) in sorted(target_tensors(ctx).items()):
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < L + (nextn if ctx.manifest.drafter.location == "target" else 0):
            out.append((file, name, name, tuple(meta.shape)))
    if nextn and ctx.manifest.drafter.location == "drafter":
        located = _mtp.canonical_tensors(ctx)
        names = _mtp.layout_names("mtp-deepseek", list(located), lambda k: f"model.layers.{L + k}.")
        out += [(path, canonical, names[canonical], tuple(meta.shape)) for canonical, (path, meta) in located.items()]
    return out


def _plan(ctx, config: dict, nextn: int) -> _gguf.Tensors:
    L, plan = config["num_hidden_layers"], _gguf.Tensors(ctx.gguf_type)
    experts, unknown = defaultdict(dict), []
    for file, name, hf, shape in _sources(ctx, nextn):
        load = (lambda file=file, name=name: _gguf.load_f32(file, name))
        if hf in _GLOBAL:
            if not (hf == "lm_head.weight" and config.get("tie_word_embeddings")):
                plan.add(_GLOBAL[hf], shape, load)
            continue
        m = _LAYER.match(hf)
        i, leaf = (int(m.group(1)), m.group(2)) if m else (None, hf)
        e = _EXPERT.match(leaf)
        if e:
            experts[(i, e.group(2))][int(e.group(1))] = (file, name, shape)
        elif leaf == ds.ROUTER_BIAS[1]:
            plan.add(f"blk.{i}.{ds.ROUTER_BIAS[0]}", shape, load)
        elif leaf == ds.KV_B[2] + ".weight":
            _plan_kv_b(plan, i, config, shape, load)
        elif leaf.removesuffix(".weight") in _BLOCK:
            plan.add(f"blk.{i}.{_BLOCK[leaf.removesuffix('.weight')]}.weight", shape, load)
        elif i is not None and i >= L and leaf.removesuffix(".weight") in _NEXTN:
            plan.add(f"blk.{i}.{_NEXTN[leaf.removesuffix('.weight')]}.weight", shape, load)
        else:
            unknown.append(hf)
    if unknown:
        raise UnsupportedError("tensors of this DeepSeek-V3 target have no name in llama.cpp's deepseek2 GGUF",
                               problems=unknown[:8], hint="export an artifact of a float DeepSeek-V3 checkpoint")
    for (i, proj), by_expert in sorted(experts.items()):
        _plan_experts(plan, i, proj, by_expert, config["n_routed_experts"])
    return plan


def _plan_kv_b(plan: _gguf.Tensors, i: int, config: dict, shape: tuple, load) -> None:
    """k_b and v_b from one read of kv_b_proj (written one after the other: the split is kept for the second)."""
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    lora, halves = shape[-1], {}

    def half(k: int):  # each half is handed out once; both out, nothing is kept
        if not halves:
            halves.update(enumerate(ds.split_kv_b(load(), heads, nope, v)))
        return halves.pop(k)

    plan.add(f"blk.{i}.{ds.KV_B[0]}.weight", (heads, lora, nope), lambda: half(0))
    plan.add(f"blk.{i}.{ds.KV_B[1]}.weight", (heads, v, lora), lambda: half(1))


def _plan_experts(plan: _gguf.Tensors, i: int, proj: str, by_expert: dict, n: int) -> None:
    """The routed experts' `proj` of layer i stacked into one [experts, out, in] tensor, expert 0 first."""
    if sorted(by_expert) != list(range(n)) or proj not in _EXPERTS:
        raise UnsupportedError(f"layer {i}'s routed experts ({proj}): expected experts 0..{n - 1}, found "
                               f"{len(by_expert)}", hint="export an artifact of a complete checkpoint")
    shape = (n, *by_expert[0][2])
    plan.add(f"blk.{i}.{_EXPERTS[proj]}.weight", shape,
             lambda: np.stack([_gguf.load_f32(f, name) for f, name, _ in (by_expert[e] for e in range(n))]))
