"""Tiny checkpoints of every family specpack reads (families/), built in code: transformers' own model
classes at tiny sizes, saved with `save_pretrained` (the tensor names transformers and vLLM load),
plus what transformers does not write, spelled out here from the published checkpoints: MTP modules
(DeepSeek / GLM `model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head}`, Qwen3-Next / 3.5 `mtp.*`,
Nemotron-H `mtp.layers.*`), multimodal wrappers' published prefixes (`language_model.model.`), and
quantized forms (FP8 128x128 blocks with `weight_scale_inv`, compressed-tensors FP8 per channel and
NVFP4, ModelOpt NVFP4, gpt-oss MXFP4 `_blocks`/`_scales`): every one written from the published
format's description, not from specpack's own rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tiny

V = tiny.VOCAB


def _save(model, out: Path, config_updates: dict | None = None) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(config_updates or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tiny.make_tokenizer(out)
    return out


def _configs():
    from transformers import (DeepseekV3Config, DeepseekV4Config, DeepseekV32Config, Gemma3Config, Glm4MoeConfig, GlmMoeDsaConfig,
                              GptOssConfig, Llama4Config, MiniMaxM2Config, MiniMaxM3VLConfig, Mistral3Config, NemotronHConfig,
                              Qwen3_5Config, Qwen3_5MoeConfig, Qwen3MoeConfig, Qwen3NextConfig)

    mla = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    moe = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=24)
    gdn = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4)
    common = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    return {
        "deepseek_v3": lambda: DeepseekV3Config(**common, intermediate_size=96, num_hidden_layers=3, first_k_dense_replace=1,
                                                n_group=2, topk_group=1, **mla, **moe),
        "deepseek_v32": lambda: DeepseekV32Config(**common, intermediate_size=96, num_hidden_layers=3,
                                                  first_k_dense_replace=1, n_group=2, topk_group=1, index_n_heads=2,
                                                  index_head_dim=16, index_topk=8, **mla, **moe),
        # every attention kind (sliding, CSA, HCA), a hash-routed layer, two hyper-connection streams
        "deepseek_v4": lambda: DeepseekV4Config(vocab_size=V, hidden_size=64, num_attention_heads=4, head_dim=32,
                                                q_lora_rank=32, partial_rotary_factor=0.25, num_hidden_layers=4,
                                                moe_intermediate_size=24, n_routed_experts=4, n_shared_experts=1,
                                                num_experts_per_tok=2, hc_mult=2, o_groups=2, o_lora_rank=16,
                                                index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
                                                layer_types=["sliding_attention", "compressed_sparse_attention",
                                                             "heavily_compressed_attention",
                                                             "compressed_sparse_attention"],
                                                mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                                                compress_rates={"compressed_sparse_attention": 4,
                                                                "heavily_compressed_attention": 8}),
        "glm_moe_dsa": lambda: GlmMoeDsaConfig(**common, intermediate_size=96, num_hidden_layers=3,
                                               first_k_dense_replace=1, index_n_heads=2, index_head_dim=16,
                                               index_topk=8, **mla, **moe),
        "glm4_moe": lambda: Glm4MoeConfig(**common, head_dim=16, intermediate_size=96, num_hidden_layers=3,
                                          first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, **moe),
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96, num_hidden_layers=3,
                                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                            mlp_only_layers=[0]),
        "qwen3_next": lambda: Qwen3NextConfig(**common, head_dim=16, intermediate_size=96, num_hidden_layers=4,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=32, **gdn),
        "qwen3_5": lambda: Qwen3_5Config(text_config=dict(**common, head_dim=16, intermediate_size=96,
                                                          num_hidden_layers=4, mtp_num_hidden_layers=1, **gdn),
                                         vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64,
                                                            intermediate_size=64, num_heads=2)),
        "qwen3_5_moe": lambda: Qwen3_5MoeConfig(text_config=dict(**common, head_dim=16, num_hidden_layers=4,
                                                                 num_experts=4, num_experts_per_tok=2,
                                                                 moe_intermediate_size=24,
                                                                 shared_expert_intermediate_size=32,
                                                                 mtp_num_hidden_layers=1, **gdn),
                                                vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64,
                                                                   intermediate_size=64, num_heads=2)),
        "minimax_m2": lambda: MiniMaxM2Config(**common, head_dim=16, intermediate_size=24, num_hidden_layers=3,
                                              num_local_experts=4, num_experts_per_tok=2),
        # a dense layer, MoE layers, full and block-sparse attention (widths multiples of MXFP8's 32); transformers
        # saves the release names
        "minimax_m3_vl": lambda: MiniMaxM3VLConfig(
            text_config=dict(**common, head_dim=16, intermediate_size=32, num_hidden_layers=4, num_local_experts=4,
                             num_experts_per_tok=2, dense_intermediate_size=64, shared_intermediate_size=32,
                             rotary_dim=8, index_n_heads=2, index_head_dim=16, index_block_size=8, index_topk_blocks=2,
                             bos_token_id=1, eos_token_id=2,
                             layer_types=["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
                             mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
            vision_config=dict(**vision, image_size=56, patch_size=14), projector_hidden_size=32),
        "gpt_oss": lambda: GptOssConfig(**common, head_dim=16, intermediate_size=64, num_hidden_layers=3,
                                        num_local_experts=4, num_experts_per_tok=2),
        "nemotron_h": lambda: NemotronHConfig(**common, head_dim=16, hybrid_override_pattern="M*-E",
                                              intermediate_size=80, mamba_num_heads=4, mamba_head_dim=8,
                                              ssm_state_size=6, n_groups=2, conv_kernel=4, n_routed_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=24,
                                              moe_shared_expert_intermediate_size=40),
        "llama4": lambda: Llama4Config(text_config=dict(**common, head_dim=16, intermediate_size=48,
                                                        intermediate_size_mlp=80, num_hidden_layers=4,
                                                        num_local_experts=4, interleave_moe_layer_step=2,
                                                        attention_chunk_size=32),
                                       vision_config=dict(**vision, image_size=28, patch_size=14, vision_output_dim=48,
                                                          projector_input_dim=48, projector_output_dim=48)),
        "gemma3": lambda: Gemma3Config(text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                                        vocab_size=V, sliding_window=16),
                                       vision_config=dict(**vision, image_size=56, patch_size=14), mm_tokens_per_image=4),
        "mistral3": lambda: Mistral3Config(text_config=dict(model_type="mistral", **common, head_dim=16,
                                                            intermediate_size=96, num_hidden_layers=3,
                                                            sliding_window=None),
                                           vision_config=dict(model_type="pixtral", **vision, head_dim=16,
                                                              image_size=56, patch_size=14)),
    }


FAMILIES = ("deepseek_v3", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "glm4_moe", "qwen3_moe", "qwen3_next", "qwen3_5",
            "qwen3_5_moe", "minimax_m2", "minimax_m3_vl", "gpt_oss", "nemotron_h", "llama4", "gemma3", "mistral3")


def make(family: str, out: Path, seed: int = 0) -> Path:
    """A target directory of `family` (see FAMILIES) saved by transformers, with a tokenizer."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = _configs()[family]()
    wrapped = hasattr(config, "text_config") and family not in ("deepseek_v3",)
    factory = AutoModelForImageTextToText if wrapped else AutoModelForCausalLM
    try:
        model = factory.from_config(config, dtype=torch.float32)
    except ValueError:
        model = AutoModel.from_config(config, dtype=torch.float32)
    # the DeepSeek family's published configs state their routing (transformers' classes do not write it)
    routing = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"} if family in ("deepseek_v3", "deepseek_v32",
                                                                                     "glm_moe_dsa") else {}
    out = _save(model.eval(), out, routing)
    return deepseek_v4_release(out) if family == "deepseek_v4" else out


def deepseek_v4_release(path: Path) -> Path:
    """DeepSeek-V4 in the names its release ships (no `model.` prefix, `embed.weight`, `hc_head_fn`):
    transformers 5.25's save keeps `model.` and its own names for the embedding and hc_head; its
    loader reads the release names (conversion_mapping "deepseek_v4": `^embed.weight`, `^hc_head_fn`),
    which test_families checks by loading this fixture back with transformers."""
    top = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
           "hc_head.hc_scale": "hc_head_scale"}
    t = load_file(str(path / "model.safetensors"))
    t = {top.get(k.removeprefix("model."), k.removeprefix("model.")): v for k, v in t.items()}
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path


# ---- what transformers does not write ------------------------------------------------------------

def edit(path: Path, add: dict | None = None, drop=(), rename: dict | None = None, config: dict | None = None) -> Path:
    """Rewrite a target's single safetensors file and config in place."""
    t = load_file(str(path / "model.safetensors"))
    for prefix_from, prefix_to in (rename or {}).items():
        t = {(prefix_to + k[len(prefix_from):] if k.startswith(prefix_from) else k): v for k, v in t.items()}
    t = {k: v for k, v in t.items() if k not in drop}
    t.update(add or {})
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    if config:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config)
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def deepseek_v4_dspark(path: Path, stages: int = 3, ids=(1, 2, 3), rank: int = 8, block: int = 5, noise: int = 7,
                       inference: bool = True) -> Path:
    """DeepSeek-V4-Flash-DSpark (layout B, docs/families.md) from a DeepSeek-V4 fixture, written from vLLM's
    DeepSeek-V4 DSpark draft module (models/deepseek_v4/dspark.py, "parameter names and weight loading
    matching the DSpark checkpoint"): stage k under `mtp.{k}.` is a DeepseekV4DecoderLayer (sliding-window
    attention `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}`, `ffn.{gate.weight,gate.bias,
    experts.{e}.w1/w2/w3,shared_experts.w1/w2/w3}`, `attn_norm`, `ffn_norm`, `hc_{attn,ffn}_{fn,base,
    scale}`: here the fixture's layer 1 without its compressor and indexer); stage 0 adds `main_proj`
    [H, H x len(ids)] and `main_norm` [H]; the last stage adds `norm` [H], `markov_head.markov_w1/w2`
    [V, rank], `confidence_head.proj` [1, H + rank] (bias=False) and `hc_head_{fn,base,scale}`. The config
    keeps the legacy `num_nextn_predict_layers: 1` beside the dspark_* keys; `inference/` holds DeepSeek's
    reference code and its config.json with `n_mtp_layers` (what `_read_dspark_num_layers` reads)."""
    t = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    H, V, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    layer = {k[len("layers.1."):].replace("attn.norm.", "attn.kv_norm."): v for k, v in t.items()
             if k.startswith("layers.1.") and ".compressor." not in k and ".indexer." not in k}
    add = {f"mtp.{k}.{n}": v.clone() for k in range(stages) for n, v in layer.items()}
    last = f"mtp.{stages - 1}."
    add.update({"mtp.0.main_proj.weight": torch.randn(H, H * len(ids)) * 0.02, "mtp.0.main_norm.weight": torch.ones(H),
                last + "norm.weight": torch.ones(H), last + "markov_head.markov_w1.weight": torch.randn(V, rank),
                last + "markov_head.markov_w2.weight": torch.randn(V, rank) * 0.02,
                last + "confidence_head.proj.weight": torch.randn(1, H + rank) * 0.02,
                last + "hc_head_fn": torch.randn(hc, hc * H) * 0.02, last + "hc_head_base": torch.zeros(hc),
                last + "hc_head_scale": torch.ones(1)})
    if inference:
        (path / "inference").mkdir()
        (path / "inference" / "config.json").write_text(json.dumps({"n_mtp_layers": stages, "dim": H}))
        (path / "inference" / "model.py").write_text("# DeepSeek's reference inference code: carried, never run\n")
    return edit(path, add=add, config={"num_nextn_predict_layers": 1, "dspark_block_size": block,
                                       "dspark_noise_token_id": noise, "dspark_target_layer_ids": list(ids),
                                       "dspark_markov_rank": rank})


V41_TEXT = dict(vocab_size=V, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                head_dim=32, q_lora_rank=32, qk_rope_head_dim=16, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus", hc_mult=4,
                hc_sinkhorn_iters=20, hc_eps=1e-6, sliding_window=8, compress_ratios=[0, 0, 2, 2, 1, 1, 0, 0, 0],
                kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 5], candidate_source_layer_id=4,
                index_n_heads=2, index_head_dim=16, index_topk=4, engram_layer_ids=[1], engram_num_embeddings=[97],
                engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32, engram_vocab_size=50,
                num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=7,
                dspark_target_layer_ids=[3, 4, 5], dspark_markov_rank=8, dspark_n_routed_experts=2,
                dspark_num_experts_per_tok=1, rms_norm_eps=1e-20, max_position_embeddings=4096, eos_token_id=1)


def deepseek_v41(path: Path, vision: bool = True, stages: int = 3, confidence: bool = True, **text) -> Path:
    """DeepSeek-V4.1-Flash (`DeepseekV41ForCausalLM`, layout B) at tiny sizes, every tensor written here from
    the public sources, not from specpack's rules: config.json with `text_config` (transformers
    configuration_deepseek_v41.py DeepseekV41TextConfig: the CSA2 schedule `compress_ratios` with the 3
    DSpark entries, `kv_source_layer_ids`, `index_source_layer_ids`, engram and dspark_* keys) and
    `vision_config` (DeepseekV41VisionConfig); release names (vLLM deepseek_v41/nvidia/model.py
    `_make_deepseek_v4_weights_mapper`: no `model.` prefix, `embed.weight`, `head.weight`, `norm.weight`,
    `layers.{i}.`; no `hc_head`: "v4.1 has no learned hc_head"). Each layer, from transformers
    modeling_deepseek_v41.py: DeepseekV41DecoderLayer (`attn_norm`, `ffn_norm`, `hc_{attn,ffn}_{fn,base,
    scale}`), DeepseekV41Attention (`wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`, `wo_a` [g x o, n x hd / g],
    `wo_b`, `attn_sink`), DeepseekV41Compressor on KV sources (`wkv`, `wgate` above ratio 1, `norm`),
    DeepseekV41Indexer on index sources (`wq_b`, `weights_proj`; `wk`, `k_norm` on a KV source),
    DeepseekV41TopKRouter (`weight`, `bias`, `bias_vl`), DeepseekV41Expert (`w1`, `w2`, `w3`), the engram
    at `engram_layer_ids` (DeepseekV41EngramEmbedding `embed.weight` + `embed.scale` [rows, hd / 32],
    DeepseekV41Engram `wkv`, `q_weight`, `k_weight`). The vision part: `image_{start,end,newline}` [H] and
    the aligner's `w1` (vl_model.py), carried untouched. The DSpark stages (vLLM deepseek_v41/nvidia/dspark.py
    `load_weights`, `_remap_dspark_name`): `mtp.{k}.` sliding-only V4.1 layers with dspark_n_routed_experts,
    `mtp.0.main_proj` [H, H x 3] + `main_norm`; the last stage `norm`, `markov_head.embed` / `markov_head.head`
    [V, rank], `confidence_head.proj` [1, H + rank]."""
    cfg = {**V41_TEXT, **text}
    H, hd, n, hc, q = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"], cfg["hc_mult"], cfg["q_lora_rank"]
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    def layer(p, i, experts):
        heads, mix = cfg["num_attention_heads"], (2 + hc) * hc
        t = {p + "attn_norm.weight": torch.ones(H), p + "ffn_norm.weight": torch.ones(H)}
        for b in ("attn", "ffn"):
            t.update({f"{p}hc_{b}_fn": w(mix, hc * H), f"{p}hc_{b}_base": torch.zeros(mix), f"{p}hc_{b}_scale": torch.ones(3)})
        a = p + "attn."
        t.update({a + "wq_a.weight": w(q, H), a + "q_norm.weight": torch.ones(q), a + "wq_b.weight": w(heads * hd, q),
                  a + "wkv.weight": w(hd, H), a + "kv_norm.weight": torch.ones(hd),
                  a + "wo_a.weight": w(cfg["o_groups"] * cfg["o_lora_rank"], heads * hd // cfg["o_groups"]),
                  a + "wo_b.weight": w(H, cfg["o_groups"] * cfg["o_lora_rank"]), a + "attn_sink": torch.zeros(heads)})
        ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
        if i in cfg["kv_source_layer_ids"]:
            t.update({a + "compressor.wkv.weight": w(hd, H), a + "compressor.norm.weight": torch.ones(hd)})
            if cfg["compress_ratios"][i] > 1:
                t[a + "compressor.wgate.weight"] = w(hd, H)
        if i in cfg["index_source_layer_ids"]:
            t.update({a + "indexer.wq_b.weight": w(ih * ihd, q), a + "indexer.weights_proj.weight": w(ih, H)})
            if i in cfg["kv_source_layer_ids"]:
                t.update({a + "indexer.wk.weight": w(ihd, hd), a + "indexer.k_norm.weight": torch.ones(ihd)})
        if i in cfg["engram_layer_ids"]:
            e, rows, ehd = p + "engram.", cfg["engram_num_embeddings"][cfg["engram_layer_ids"].index(i)], cfg["engram_head_dim"]
            cols = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"] * ehd
            t.update({e + "embed.weight": w(rows, ehd).to(torch.float8_e4m3fn),
                      e + "embed.scale": torch.full((rows, ehd // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
                      e + "wkv.weight": w(H * (hc + 1), cols), e + "q_weight": torch.ones(hc, H),
                      e + "k_weight": torch.ones(hc, H)})
        f, inter = p + "ffn.", cfg["moe_intermediate_size"]
        t.update({f + "gate.weight": w(experts, H), f + "gate.bias": torch.zeros(experts)})
        if vision:
            t[f + "gate.bias_vl"] = torch.zeros(experts)
        for m in [f"experts.{k}." for k in range(experts)] + ["shared_experts."]:
            t.update({f + m + "w1.weight": w(inter, H), f + m + "w3.weight": w(inter, H), f + m + "w2.weight": w(H, inter)})
        return t

    t = {"embed.weight": w(V, H), "head.weight": w(V, H), "norm.weight": torch.ones(H)}
    for i in range(n):
        t.update(layer(f"layers.{i}.", i, cfg["n_routed_experts"]))
    rank, last = cfg["dspark_markov_rank"], f"mtp.{stages - 1}."
    for k in range(stages):
        t.update(layer(f"mtp.{k}.", None, cfg["dspark_n_routed_experts"]))
    t.update({"mtp.0.main_proj.weight": w(H, H * len(cfg["dspark_target_layer_ids"])), "mtp.0.main_norm.weight": torch.ones(H),
              last + "norm.weight": torch.ones(H), last + "markov_head.embed.weight": w(V, rank),
              last + "markov_head.head.weight": w(V, rank)})
    if confidence:
        t[last + "confidence_head.proj.weight"] = w(1, H + rank)
    if vision:
        t.update({"image_start": w(H), "image_end": w(H), "image_newline": w(H), "aligner.w1.weight": w(H, 16)})
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": cfg,
              "vision_config": {"num_hidden_layers": 1 if vision else 0, "hidden_size": 16, "num_attention_heads": 2,
                                "patch_size": 14}, "image_token_id": 129264, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tiny.make_tokenizer(path)
    return path


DSPARK_M31 = "language_model.model.dspark."


def minimax_m31_dspark(path: Path, layers: int = 2, ids=(0, 2, 3), rank: int = 8, block: int = 7, noise: int = 380,
                       mxfp8: bool = True) -> Path:
    """MiniMax-M3.1 with its published `dspark/` draft (layout C, docs/families.md) beside a MiniMax-M3 fixture,
    written from the public schema validator of the released checkpoint (minimax_m31_dspark_checkpoint.py
    `validate_schema`, schema `minimax_m31_dspark_preview2`) at tiny sizes: `dspark/config.json` with
    architectures ["DSparkMiniMaxDraftModel"], quantization_config mxfp8 [1, 32] and the DSpark keys in
    `text_config` (sliding layers, moe_layer_freq all 0, no sparse attention, use_gemma_norm, vanilla
    Markov head, confidence head with Markov); tensors under `language_model.model.dspark.`: `fc` [H, H x
    len(ids)], `hidden_norm`, `final_norm`, `markov_head.markov_w1/w2` [V, rank], `confidence_head.proj`
    weight [1, H + rank] and bias [1] (BF16), and per layer `layers.{i}.decoder_layer.` norms (BF16) with
    q/k/v/o and gate/up/down projections F8_E4M3 + `weight_scale_inv` U8 [rows, cols / 32]; sharded with
    its index. The embedding and lm_head are the target's (absent here). The decoder keys the SGLang port
    reads (minimax_m3_dspark.py: gemma norms, per-head q/k norm, partial rotary, swigluoai) are the
    target's own values."""
    cfg = json.loads((path / "config.json").read_text())["text_config"]
    H, V, heads, kv, hd = (cfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                                            "head_dim"))
    inter = 64
    text = {"num_hidden_layers": layers, "hidden_size": H, "vocab_size": V, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": hd, "dense_intermediate_size": inter, "dspark_ffn_hidden_size": inter,
            "dspark_markov_rank": rank, "dspark_markov_head_type": "vanilla", "dspark_block_size": block,
            "dspark_noise_token_id": noise, "dspark_target_layer_ids": list(ids), "sliding_window": 16,
            "layer_types": ["sliding_attention"] * layers, "moe_layer_freq": [0] * layers,
            "sparse_attention_config": None, "dspark_use_dense_ffn": True, "dspark_hybrid_context_fusion": False,
            "dspark_config": {"hybrid_context_fusion": False}, "enable_confidence_head": True,
            "confidence_head_with_markov": True, "use_gemma_norm": True, "rms_norm_eps": 1e-6,
            "hidden_act": "swigluoai", "rotary_dim": cfg["rotary_dim"],
            "rope_parameters": cfg.get("rope_parameters"), "qk_norm_type": "per_head"}
    config = {"architectures": ["DSparkMiniMaxDraftModel"], "text_config": text}
    if mxfp8:
        config["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    bf16 = torch.bfloat16
    t = {"fc.weight": torch.randn(H, H * len(ids)).to(bf16) * 0.02, "hidden_norm.weight": torch.zeros(H, dtype=bf16),
         "final_norm.weight": torch.zeros(H, dtype=bf16),
         "markov_head.markov_w1.weight": torch.randn(V, rank).to(bf16),
         "markov_head.markov_w2.weight": (torch.randn(V, rank) * 0.02).to(bf16),
         "confidence_head.proj.weight": (torch.randn(1, H + rank) * 0.02).to(bf16),
         "confidence_head.proj.bias": torch.zeros(1, dtype=bf16)}
    shapes = {"self_attn.q_proj": (heads * hd, H), "self_attn.k_proj": (kv * hd, H), "self_attn.v_proj": (kv * hd, H),
              "self_attn.o_proj": (H, heads * hd), "mlp.gate_proj": (inter, H), "mlp.up_proj": (inter, H),
              "mlp.down_proj": (H, inter)}
    for i in range(layers):
        root = f"layers.{i}.decoder_layer."
        t.update({root + n + ".weight": torch.zeros(H, dtype=bf16) for n in ("input_layernorm", "post_attention_layernorm")})
        t.update({root + f"self_attn.{n}.weight": torch.zeros(hd, dtype=bf16) for n in ("q_norm", "k_norm")})
        for name, (rows, cols) in shapes.items():
            w = torch.randn(rows, cols) * 0.02
            if mxfp8:
                t[root + name + ".weight"] = w.to(torch.float8_e4m3fn)
                t[root + name + ".weight_scale_inv"] = torch.full((rows, cols // 32), 127, dtype=torch.uint8)
            else:
                t[root + name + ".weight"] = w.to(bf16)
    d = path / "dspark"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config, indent=1))
    shard = "model-00001-of-00001.safetensors"
    save_file({DSPARK_M31 + k: v.contiguous() for k, v in t.items()}, str(d / shard))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in t.values())},
         "weight_map": {DSPARK_M31 + k: shard for k in t}}))
    return path


def kimi_k25(path: Path) -> Path:
    """Kimi-K2.5 as published, from a DeepSeek-V3 fixture: `KimiK25ForConditionalGeneration` /
    `kimi_k25` wrapping a `kimi_k2` text_config (its compressed-tensors INT4 routed experts stated there,
    not at the top), the decoder under `language_model.model.` and `language_model.lm_head`, a MoonViT
    vision tower (`vision_tower.*`) and a patch-merger projector (`mm_projector.*`) carried untouched.
    Sources: TensorRT-LLM's Kimi-K2.5 test config, NeMo AutoModel kimi_k25_vl, vLLM kimi_k25.py."""
    ct_int4(path)
    text = json.loads((path / "config.json").read_text())
    text["model_type"], text["architectures"] = "kimi_k2", ["DeepseekV3ForCausalLM"]
    torch.manual_seed(1)
    vision = {"vision_tower.patch_embed.proj.weight": torch.randn(32, 3, 14, 14),
              "vision_tower.patch_embed.proj.bias": torch.zeros(32),
              "vision_tower.patch_embed.pos_emb.weight": torch.randn(4, 4, 32),
              "vision_tower.encoder.blocks.0.wqkv.weight": torch.randn(96, 32),
              "vision_tower.encoder.blocks.0.wo.weight": torch.randn(32, 32),
              "vision_tower.encoder.final_layernorm.weight": torch.ones(32),
              "mm_projector.pre_norm.weight": torch.ones(32),
              "mm_projector.proj.0.weight": torch.randn(128, 128),
              "mm_projector.proj.2.weight": torch.randn(64, 128)}
    edit(path, add=vision, rename={"model.": "language_model.model.", "lm_head.": "language_model.lm_head."})
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "media_placeholder_token_id": 3, "tie_word_embeddings": False, "text_config": text,
              "vision_config": {"patch_size": 14, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "intermediate_size": 64, "merge_kernel_size": [2, 2]}}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def deepseek_mtp(path: Path, n: int = 1) -> Path:
    """DeepSeek-V3's published MTP layers: `model.layers.{L+k}.` = a MoE decoder layer (a copy of the
    last target layer's tensors) + enorm, hnorm, eh_proj [H, 2H], shared_head.{norm, head}, embed_tokens."""
    cfg = json.loads((path / "config.json").read_text())
    t, L, H = load_file(str(path / "model.safetensors")), cfg["num_hidden_layers"], cfg["hidden_size"]
    last, add = f"model.layers.{L - 1}.", {}
    for k in range(n):
        p = f"model.layers.{L + k}."
        add.update({p + name[len(last):]: v.clone() for name, v in t.items() if name.startswith(last)})
        add.update({p + "enorm.weight": torch.ones(H), p + "hnorm.weight": torch.ones(H),
                    p + "eh_proj.weight": torch.randn(H, 2 * H) / H, p + "shared_head.norm.weight": torch.ones(H),
                    p + "shared_head.head.weight": t["lm_head.weight"].clone(),
                    p + "embed_tokens.weight": t["model.embed_tokens.weight"].clone()})
    return edit(path, add=add, config={"num_nextn_predict_layers": n})


def qwen_mtp(path: Path, layer_prefix: str) -> Path:
    """Qwen3-Next / Qwen3.5's published `mtp.*`: fc [H, 2H], pre_fc_norm_embedding, pre_fc_norm_hidden,
    norm, and `mtp.layers.0.*` = a full-attention layer (a copy of target layer `layer_prefix`)."""
    t = load_file(str(path / "model.safetensors"))
    H = t[next(k for k in t if k.endswith("embed_tokens.weight"))].shape[1]
    add = {"mtp." + "layers.0." + k[len(layer_prefix):]: v.clone() for k, v in t.items() if k.startswith(layer_prefix)}
    add.update({"mtp.fc.weight": torch.randn(H, 2 * H) / H, "mtp.pre_fc_norm_embedding.weight": torch.zeros(H),
                "mtp.pre_fc_norm_hidden.weight": torch.zeros(H), "mtp.norm.weight": torch.zeros(H)})
    return edit(path, add=add)


def nemotron_mtp(path: Path) -> Path:
    """Nemotron 3's `mtp.layers.{0,1}` for pattern "*E": an attention layer with enorm, hnorm, eh_proj
    [H, 2H], then a MoE layer with final_layernorm (copies of backbone layers 1 and 3)."""
    t, H = load_file(str(path / "model.safetensors")), 64
    add = {}
    for src, dst in (("backbone.layers.1.", "mtp.layers.0."), ("backbone.layers.3.", "mtp.layers.1.")):
        add.update({dst + k[len(src):]: v.clone() for k, v in t.items() if k.startswith(src)})
    add.update({"mtp.layers.0.enorm.weight": torch.ones(H), "mtp.layers.0.hnorm.weight": torch.ones(H),
                "mtp.layers.0.eh_proj.weight": torch.randn(H, 2 * H) / H,
                "mtp.layers.1.final_layernorm.weight": torch.ones(H)})
    return edit(path, add=add, config={"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"})


# ---- quantized forms, as published ---------------------------------------------------------------

def _linear_names(t: dict, skip) -> list[str]:
    return [k for k, v in t.items() if k.endswith(".weight") and v.dim() == 2 and not any(s in k for s in skip)]


# what releases keep unquantized (DeepSeek-V3 README_WEIGHTS.md; Qwen3 FP8 modules_to_not_convert)
UNQUANTIZED = ("embed_tokens", "lm_head", "shared_head", "norm", "mlp.gate.", "mixer.gate.", "router", "eh_proj", "shared_expert_gate",
               "mtp.fc", "indexer.weights_proj", "in_proj_a", "in_proj_b", "in_proj_ba", "embeddings", "visual",
               "vision", "multi_modal_projector")


def _fp8_scalar(t: dict, k: str) -> dict:
    """Linear weight `k` as FP8 with one scale: F8_E4M3 [o, i], weight_scale F32 [], input_scale F32 []
    (static activations; `fp8` per tensor and ModelOpt FP8 store it alike)."""
    stem = k[: -len("weight")]
    return {k: t[k].to(torch.float8_e4m3fn), stem + "weight_scale": torch.tensor(1.0),
            stem + "input_scale": torch.tensor(1.0)}


def _modelopt_nvfp4(t: dict, k: str, input_scale: bool = True) -> dict:
    """Linear weight `k` in ModelOpt's NVFP4: U8 [o, i/2], weight_scale F8_E4M3 [o, i/16], weight_scale_2
    F32 [], and input_scale F32 [] unless its activations stay 16-bit (W4A16)."""
    o, i = t[k].shape
    stem = k[: -len("weight")]
    out = {k: torch.zeros(o, i // 2, dtype=torch.uint8),
           stem + "weight_scale": torch.ones(o, i // 16).to(torch.float8_e4m3fn), stem + "weight_scale_2": torch.tensor(1.0)}
    return {**out, stem + "input_scale": torch.tensor(1.0)} if input_scale else out


def fp8_block(path: Path, block: int = 16, skip: tuple = ()) -> Path:
    """DeepSeek-V3's FP8: every linear weight F8_E4M3 [o, i] + weight_scale_inv F32 [ceil(o/b), ceil(i/b)]."""
    t = load_file(str(path / "model.safetensors"))
    add = {}
    for k in _linear_names(t, UNQUANTIZED + skip):
        o, i = t[k].shape
        add[k] = t[k].to(torch.float8_e4m3fn)
        add[k[: -len("weight")] + "weight_scale_inv"] = torch.ones(math.ceil(o / block), math.ceil(i / block))
    return edit(path, add=add, config={"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                               "activation_scheme": "dynamic",
                                                               "weight_block_size": [block, block]}})


def ct_fp8_channel(path: Path, skip: tuple = ()) -> Path:
    """GLM-4.5-FP8's compressed-tensors FP8: weight F8_E4M3 [o, i] + weight_scale BF16 [o, 1]."""
    t = load_file(str(path / "model.safetensors"))
    add = {}
    for k in _linear_names(t, UNQUANTIZED + skip):
        add[k] = t[k].to(torch.float8_e4m3fn)
        add[k[: -len("weight")] + "weight_scale"] = torch.ones(t[k].shape[0], 1, dtype=torch.bfloat16)
    return edit(path, add=add, config={"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                         "strategy": "channel"}}},
        "ignore": ["lm_head", "re:.*mlp.gate$"]}})


def ct_nvfp4(path: Path, skip: tuple = ()) -> Path:
    """compressed-tensors NVFP4: weight_packed U8 [o, i/2], weight_scale F8_E4M3 [o, i/16],
    weight_global_scale F32 [1], input_global_scale F32 [1]; no `weight`."""
    t = load_file(str(path / "model.safetensors"))
    add, drop = {}, []
    for k in _linear_names(t, UNQUANTIZED + skip):
        o, i = t[k].shape
        stem = k[: -len("weight")]
        drop.append(k)
        add.update({stem + "weight_packed": torch.zeros(o, i // 2, dtype=torch.uint8),
                    stem + "weight_scale": torch.ones(o, i // 16).to(torch.float8_e4m3fn),
                    stem + "weight_global_scale": torch.ones(1), stem + "input_global_scale": torch.ones(1)})
    return edit(path, add=add, drop=drop, config={"quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                         "strategy": "tensor_group", "group_size": 16},
                                      "input_activations": {"num_bits": 4, "type": "float"}}},
        "ignore": ["lm_head"]}})


def fp8_per_tensor(path: Path, skip: tuple = ()) -> Path:
    """FP8 without blocks: weight F8_E4M3 [o, i], weight_scale F32 [] and (static activations) input_scale []."""
    t = load_file(str(path / "model.safetensors"))
    add = {n: v for k in _linear_names(t, UNQUANTIZED + skip) for n, v in _fp8_scalar(t, k).items()}
    return edit(path, add=add, config={"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})


def ct_int4(path: Path, group: int = 32) -> Path:
    """Kimi-K2-Thinking's compressed-tensors W4A16 on the routed experts only: weight_packed I32 [o, i/8],
    weight_scale BF16 [o, i/g], weight_shape I64 [2]; everything else unquantized."""
    t = load_file(str(path / "model.safetensors"))
    add, drop = {}, []
    for k in [k for k in _linear_names(t, UNQUANTIZED) if ".experts." in k]:
        o, i = t[k].shape
        stem = k[: -len("weight")]
        drop.append(k)
        add.update({stem + "weight_packed": torch.zeros(o, i // 8, dtype=torch.int32),
                    stem + "weight_scale": torch.ones(o, i // group, dtype=torch.bfloat16),
                    stem + "weight_shape": torch.tensor([o, i])})
    return edit(path, add=add, drop=drop, config={"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                         "strategy": "group", "group_size": group}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}})


def modelopt_fp8(path: Path, skip: tuple = ()) -> Path:
    """ModelOpt FP8: weight F8_E4M3 [o, i], weight_scale F32 [], input_scale F32 []."""
    t = load_file(str(path / "model.safetensors"))
    add = {n: v for k in _linear_names(t, UNQUANTIZED + skip) for n, v in _fp8_scalar(t, k).items()}
    return edit(path, add=add, config={"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                               "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}})


def modelopt_nvfp4(path: Path, hf_quant_file: bool = False, skip: tuple = ()) -> Path:
    """ModelOpt NVFP4: weight U8 [o, i/2], weight_scale F8_E4M3 [o, i/16], weight_scale_2 F32 [],
    input_scale F32 []; stated in config.json, or (older exports) in hf_quant_config.json alone."""
    t = load_file(str(path / "model.safetensors"))
    add = {n: v for k in _linear_names(t, UNQUANTIZED + skip + ("conv1d", "mixer.in_proj", "mixer.out_proj"))
           for n, v in _modelopt_nvfp4(t, k).items()}
    q = {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": ["lm_head"]}
    if hf_quant_file:
        (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": q}))
        return edit(path, add=add)
    return edit(path, add=add, config={"quantization_config": {"quant_method": "modelopt", **q}})


def mxfp8(path: Path, skip: tuple = (), scale: str = "weight_scale") -> Path:
    """MiniMax-style MXFP8 (vLLM modelopt.py ModelOptMxFp8Config.from_config): quant_method mxfp8,
    weight F8_E4M3 [o, i], weight_scale E8M0 [o, i/32] (one scale per 32 inputs of a row); MiniMax-M3's
    releases and M3.1's dspark/ write the scales as `weight_scale_inv` U8 (their published indexes)."""
    t = load_file(str(path / "model.safetensors"))
    add = {}
    for k in _linear_names(t, UNQUANTIZED + skip):
        o, i = t[k].shape
        add[k] = t[k].to(torch.float8_e4m3fn)
        scales = torch.full((o, i // 32), 127, dtype=torch.uint8)
        add[k[: -len("weight")] + scale] = scales if scale == "weight_scale_inv" else scales.view(torch.float8_e8m0fnu)
    return edit(path, add=add, config={"quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32],
                                                               "ignored_layers": ["lm_head"]}})


def modelopt_mixed(path: Path) -> Path:
    """ModelOpt MIXED_PRECISION (Nemotron 3.5's kind): `quantized_layers` names each quantized module and
    its format (vLLM modelopt.py ModelOptMixedPrecisionConfig). Here: routed experts W4A16_NVFP4, the
    dense MLP NVFP4 (both stored as modelopt_nvfp4 above), attention FP8 (as modelopt_fp8); the Mamba
    mixers, shared experts, router and lm_head are not listed and stay bf16."""
    t = load_file(str(path / "model.safetensors"))
    add, layers = {}, {}
    for k in _linear_names(t, UNQUANTIZED):
        module = k[: -len(".weight")]
        if ".experts." in k or ".mixer.up_proj" in k or ".mixer.down_proj" in k:
            layers[module] = {"quant_algo": "W4A16_NVFP4" if ".experts." in k else "NVFP4", "group_size": 16}
            add.update(_modelopt_nvfp4(t, k, input_scale=False))
        elif k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            layers[module] = {"quant_algo": "FP8"}
            add.update(_fp8_scalar(t, k))
    return edit(path, add=add, config={"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
        "quantized_layers": layers, "exclude_modules": ["lm_head"]}})


def mxfp4(path: Path) -> Path:
    """gpt-oss's MXFP4 experts: gate_up_proj_blocks U8 [E, 2I, H/32, 16] and _scales U8 [E, 2I, H/32]
    for gate_up_proj [E, H, 2I] (and down_proj likewise), the rest bf16."""
    t = load_file(str(path / "model.safetensors"))
    add, drop = {}, []
    for k, v in t.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, i, o = v.shape  # stored [E, in, out]
            drop.append(k)
            add[k + "_blocks"] = torch.zeros(E, o, i // 32, 16, dtype=torch.uint8)
            add[k + "_scales"] = torch.full((E, o, i // 32), 127, dtype=torch.uint8)
    return edit(path, add=add, drop=drop, config={"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}})


def deepseek_v4_fp8(path: Path, block: int = 16) -> Path:
    """DeepSeek-V4-Flash's published form (transformers quantizer_finegrained_fp8.py: per-block scales
    under `.scale`; FineGrainedFP8Config scale_fmt ue8m0, expert_dtype fp4; finegrained_fp8.py
    `_alloc_expert_proj`): linear weights F8_E4M3 [o, i] + `.scale` E8M0 [ceil(o/b), ceil(i/b)]; routed
    experts I8 [o, i/2] (two e2m1 per byte) + `.scale` E8M0 [o, ceil(i/32)]; the router, the norms, the
    hyper-connections, the embedding and the head stay float."""
    t = load_file(str(path / "model.safetensors"))
    add, e8m0 = {}, torch.float8_e8m0fnu
    # the DSpark heads stay float (vLLM's DSparkMarkovHead / DSparkConfidenceHead take no quant_config)
    for k in _linear_names(t, ("embed.", "head.weight", "norm", "ffn.gate.", "markov_head.", "confidence_head.")):
        o, i = t[k].shape
        stem = k[: -len("weight")]
        if ".experts." in k and ".shared_experts." not in k:
            add[k] = torch.zeros(o, i // 2, dtype=torch.int8)
            add[stem + "scale"] = torch.full((o, math.ceil(i / 32)), 127, dtype=torch.uint8).view(e8m0)
        else:
            add[k] = t[k].to(torch.float8_e4m3fn)
            add[stem + "scale"] = torch.full((math.ceil(o / block), math.ceil(i / block)), 127, dtype=torch.uint8).view(e8m0)
    return edit(path, add=add, config={"expert_dtype": "fp4", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [block, block],
        "activation_scheme": "dynamic"}})


# ---- building them -------------------------------------------------------------------------------

def build_ngram(target: Path, out: Path, **kw):
    """The manifest of `target` built with an n-gram drafter (or `drafter=`)."""
    from specpack.packager import BuildOptions, build

    return build(BuildOptions(target=target, drafter=kw.pop("drafter", "ngram"), out=out, **kw)).manifest


def refused(cli, target: Path, tmp_path: Path) -> str:
    """`specpack build` of `target` exits 2 and writes nothing; its stderr."""
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    code, _, err = cli("build", target, "--drafter", "ngram", "-o", out)
    assert code == 2 and not any(out.parent.iterdir()), err
    return err
