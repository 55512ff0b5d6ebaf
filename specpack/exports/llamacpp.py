"""llama.cpp (`llama-server`): the target as a GGUF at the precision asked, the drafter as llama.cpp
loads it, and the exact `llama-server` command.

Follows the llama.cpp the llama-cpp-python 0.3.36 sdist vendors (_gguf.LLAMACPP), read there:
- the target: `conversion/llama.py` LlamaModel (arch `llama`, q/k rows permuted, `vocab_size`),
  `conversion/base.py` (hparams, the tensor type rule, the gpt2 tokenizer and its pre-tokenizer hash);
- an EAGLE-3 head: LlamaModel with `is_eagle3` writes arch `eagle3`, `fc`, `blk.0.*` with the head's
  `hidden_norm` as `attn_norm_2`, `output_norm`, `output` (the draft vocabulary's head), `token_embd`
  only when the head has its own, `d2t` as absolute target ids (I64), the target's tokenizer, and
  `eagle3.target_layers` / `target_hidden_size` / `norm_before_residual` / `norm_before_fc`;
  `src/models/eagle3.cpp` requires exactly three target layers and reads them, as `common/
  speculative.cpp` extracts them, as the *input* of layer i: specpack's own convention, kept as is;
- a DFlash / DSpark head: `conversion/qwen.py` DFlashModel / DSparkModel write arch `dflash` (Qwen3 layers,
  `fc`, `hidden_norm` as `enc.output_norm`, `markov_w1` / `markov_w2`, `conf_proj`, `d2t`; `dflash.
  target_layers` = layer i's input, `dflash.block_size`, `dflash.sample_from_anchor`, causality, the mask
  token); `src/models/dflash.cpp` shares the target's embedding and lm_head with a head that has neither;
- an MTP layer: a DeepSeek-V3 target as arch `deepseek2` with the layer as its nextn block, drafted by
  `--spec-type draft-mtp` from the target file itself (_llamacpp_deepseek2.py says where each rule is read);
- n-gram: llama.cpp's own lookup (`--spec-type ngram-simple`, common/speculative.cpp), which matches
  the context by its own rule: its acceptance is llama.cpp's, not the artifact's;
- `common/arg.cpp`: `-m`, `--spec-draft-model` (`-md`), `--spec-type`, `--spec-draft-n-max`,
  `--spec-draft-n-min`.
Everything else (other MTP layouts, LiLiCorr, other target architectures) is refused, saying why. The
files are written one tensor at a time (_gguf.Tensors), so memory holds one tensor, not the model.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from specpack.converters import eagle3_gguf
from specpack.converters.block import llamacpp as block_gguf
from specpack.exports import _gguf, _mtp, _llamacpp_deepseek2 as _deepseek2
from specpack.exports._common import (EngineExport, ExportContext, embedding_problems, quote, target_tensors,
                                      write_json)

NAME = "llama.cpp"
# the targets this export writes, as llama.cpp's arch of that name
ARCHITECTURES = {"LlamaForCausalLM": "llama", "DeepseekV3ForCausalLM": "deepseek2"}
TARGET = "target-{type}.gguf"
DRAFT = "draft-eagle3-{type}.gguf"
# canonical name -> llama.cpp name: the readers' tables (converters/eagle3_gguf, converters/block/llamacpp)
# inverted, so what is written reads back
EAGLE3_NAMES = {canonical: name for name, canonical in eagle3_gguf.NAMES.items()}
BLOCK_NAMES = {canonical: name for name, canonical in block_gguf.NAMES.items()}
LAYER_NAMES = {canonical: name for name, canonical in block_gguf.LAYER.items()}


def limits(manifest, draft_len: int = 1) -> list[str]:
    problems = []
    if ARCHITECTURES.get(manifest.target.architecture) == "deepseek2":
        problems += _deepseek2.rope_problems(manifest.target.rope_scaling)
    elif _scaled(manifest.target.rope_scaling or {}):
        problems.append(f"the target's rope scaling ({manifest.target.rope_scaling}): not written by this export yet")
    if manifest.target.architecture not in ARCHITECTURES:
        problems.append(f"this export writes {', '.join(ARCHITECTURES)} targets as llama.cpp GGUFs, not "
                        f"{manifest.target.architecture}")
    if manifest.target.arch is not None and manifest.target.arch.quantization is not None:
        problems.append(f"quantized target weights ({manifest.target.arch.quantization.scheme}): not written by this "
                        "export yet")
    d = manifest.drafter
    if ARCHITECTURES.get(manifest.target.architecture) == "deepseek2":
        return problems + _deepseek2_limits(manifest, draft_len)
    if d.kind == "eagle3":
        ids = d.aux_hidden_states.layer_ids
        if len(ids) != 3:
            problems.append(f"llama.cpp's EAGLE-3 reads exactly three target layers (src/models/eagle3.cpp); this "
                            f"head reads {len(ids)}")
        if getattr(d, "norm_before_residual", False):
            problems.append("a head with norm_before_residual: not written by this export yet")
        problems += embedding_problems(manifest)  # (llama.cpp concatenates the states in the order listed)
    elif d.kind == "block":
        problems += _block_problems(d)
    elif d.kind == "mtp":
        problems += _mtp.problems("llama.cpp", _deepseek2.MTP, manifest, draft_len)
    elif d.kind != "ngram":
        problems.append(WHY_NOT.get(d.kind, f"llama.cpp export of {d.kind} drafters is not implemented"))
    return problems


def _scaled(rope: dict) -> bool:
    kinds = [rope.get("rope_type", rope.get("type"))] + [v.get("rope_type") for v in rope.values() if isinstance(v, dict)]
    return any(k not in (None, "default") for k in kinds)


def _deepseek2_limits(manifest, draft_len: int) -> list[str]:
    d, problems = manifest.drafter, []
    if d.kind == "mtp":
        problems += _mtp.problems("llama.cpp", _deepseek2.MTP, manifest, draft_len)
    elif d.kind != "ngram":
        problems.append(f"a {d.kind} drafter on a deepseek2 target: not written by this export yet (its MTP layer "
                        "or n-gram lookup are)")
    return problems


def target_problems(config: dict) -> list[str]:
    """What llama.cpp would read otherwise in the target's config.json."""
    arch = ARCHITECTURES.get((config.get("architectures") or [""])[0])
    return _deepseek2.target_problems(config) if arch == "deepseek2" else []


def _block_problems(d) -> list[str]:
    """What llama.cpp's `dflash` draft (src/models/dflash.cpp, common/speculative.cpp) cannot hold of a
    canonical block drafter, or what this export has not verified in llama-server."""
    checks = [(d.algorithm == "lilicorr", "a LiLiCorr correlator has no llama.cpp draft type"),
              (d.algorithm == "dflash" and d.query_layout == "anchor_first",
               "llama.cpp drafts anchor-first blocks only as DSpark (sample_from_anchor with a Markov head)"),
              (d.markov is not None and d.markov.type != "vanilla",
               f"llama.cpp's DSpark reads the vanilla Markov head only, not {d.markov.type if d.markov else ''}"),
              (len(set(d.layer_causal)) > 1, f"per-layer causality {d.layer_causal}: llama.cpp sets one for the draft"),
              (any(w is not None for w in d.sliding_window), "sliding-window draft layers: not written by this "
                                                             "export yet"),
              (d.mask_embedding, "a trained mask embedding: not written by this export yet"),
              (d.rope_style != "neox", "interleaved RoPE: not written by this export yet"),
              (d.attention_sinks, "attention sinks: not written by this export yet"),
              (d.lm_head_source == "target" and d.embedding_source == "drafter",
               "an own embedding with the target's lm_head: llama.cpp scores a draft without `output` with its "
               "token_embd (src/models/dflash.cpp), which would be the drafter's")]
    return [why for bad, why in checks if bad]


WHY_NOT = {"release_dspark": "a release's DSpark stages run in the release's own architecture, which llama.cpp's "
                             "DSpark drafter GGUF does not hold",
           "draft_model": "a draft model: convert it with llama.cpp's convert_hf_to_gguf.py and pass it as -md "
                          "(--spec-type draft-simple); not written by this export yet"}


def write_target(ctx: ExportContext) -> tuple[Path, str]:
    """The artifact's target as a llama.cpp GGUF, one tensor in memory at a time; (its path, the
    tokenizer's pre-tokenizer name)."""
    from specpack.converters.gguf import gguf_name

    config = {**json.loads((ctx.artifact / "config.json").read_text()), "rope_theta": ctx.manifest.target.rope_theta}
    if ARCHITECTURES[ctx.manifest.target.architecture] == "deepseek2":
        return _deepseek2.write_target(ctx, config)
    path = ctx.out / TARGET.format(type=ctx.gguf_type)
    writer = _gguf.open_writer(path, "llama", ctx.artifact.name)
    _gguf.add_llama_hparams(writer, "llama", config, ctx.gguf_type)
    pre = _gguf.add_tokenizer(writer, ctx.artifact, ctx.gguf_pre)
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    plan = _gguf.Tensors(ctx.gguf_type)
    for name, (file, meta) in sorted(target_tensors(ctx).items()):
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        g = gguf_name(name)
        h = heads if ".attn_q." in g else kv if ".attn_k." in g else None
        plan.add(g, meta.shape, lambda file=file, name=name, h=h: _permuted(file, name, h))
    plan.write(writer)
    return path, pre


def _permuted(file: Path, name: str, heads: int | None) -> np.ndarray:
    w = _gguf.load_f32(file, name)
    return _gguf.permute(w, heads) if heads else w


def _plan_head(gguf_type: str, tensors: dict, rename, heads: dict | None = None) -> _gguf.Tensors:
    """A canonical head's tensors under llama.cpp's names (`rename`: canonical name -> GGUF name, None to
    leave out), `d2t` as absolute target ids, the q/k rows of `heads` (canonical name -> heads) permuted."""
    plan = _gguf.Tensors(gguf_type)
    for name, t in sorted(tensors.items()):
        g = rename(name)
        if g is None:
            continue
        if name == "d2t":
            ids = t.numpy().reshape(-1).astype(np.int64)
            plan.add(g, ids.shape, lambda ids=ids: ids + np.arange(ids.size, dtype=np.int64), integer=True)
            continue
        h = (heads or {}).get(name)
        plan.add(g, tuple(t.shape), lambda t=t, h=h: _gguf.permute(t.float().numpy(), h) if h else t.float().numpy())
    return plan


def write_eagle3(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    """The target GGUF and the head as llama.cpp's EAGLE-3 drafter GGUF."""
    target, pre = write_target(ctx)
    cfg = head
    path = ctx.out / DRAFT.format(type=ctx.gguf_type)
    writer = _gguf.open_writer(path, "eagle3", f"{ctx.artifact.name} EAGLE-3 head")
    sizes = {"hidden_size": cfg["hidden_size"], "num_attention_heads": cfg["num_attention_heads"],
             "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
             "intermediate_size": cfg["intermediate_size"], "rms_norm_eps": cfg["rms_norm_eps"],
             "rope_theta": cfg["rope_theta"], "max_position_embeddings": cfg["max_position_embeddings"],
             "vocab_size": cfg["target_vocab_size"]}
    _gguf.add_llama_hparams(writer, "eagle3", sizes, ctx.gguf_type, layers=1)
    writer.add_array("eagle3.target_layers", [int(i) for i in cfg["aux_layer_ids"]])
    writer.add_uint32("eagle3.target_hidden_size", int(cfg["target_hidden_size"]))
    writer.add_bool("eagle3.norm_before_residual", bool(cfg.get("norm_before_residual", False)))
    writer.add_bool("eagle3.norm_before_fc", False)
    _gguf.add_tokenizer(writer, ctx.artifact, pre)
    heads = {"layers.0.self_attn.q_proj.weight": cfg["num_attention_heads"],
             "layers.0.self_attn.k_proj.weight": cfg["num_key_value_heads"]}
    _plan_head(ctx.gguf_type, tensors, EAGLE3_NAMES.get, heads).write(writer)  # t2d left out, as the converter does
    flags = {"--spec-draft-model": path.name, "--spec-type": "draft-eagle3", "--spec-draft-n-max": ctx.draft_len,
             "--spec-draft-n-min": 0}
    notes = [f"target layers {cfg['aux_layer_ids']} as the input of layer i (llama.cpp's convention and "
             "specpack's: written as they are)",
             "the head's reduced vocabulary maps back through d2t (absolute target ids)" if "d2t" in tensors else
             "the head drafts over the target's full vocabulary"]
    return _export(ctx, target, flags, notes)


def write_ngram(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    target, _ = write_target(ctx)
    d = ctx.manifest.drafter
    flags = {"--spec-type": "ngram-simple", "--spec-draft-n-max": ctx.draft_len, "--spec-draft-n-min": 0}
    notes = [f"n-gram lookup is llama.cpp's own (ngram-simple), not the artifact's rule (n = {d.min_n}..{d.max_n}): "
             "llama.cpp decides what to draft and its acceptance is its own"]
    return _export(ctx, target, flags, notes)


def _export(ctx: ExportContext, target: Path, flags: dict, notes: list[str]) -> EngineExport:
    config = {"target": target.name, "gguf_type": ctx.gguf_type, "flags": {k: str(v) for k, v in flags.items()},
              "llama_cpp": _gguf.LLAMACPP}
    write_json(ctx.out / "llama_server.json", config)
    out = ctx.final_out
    args = " \\\n  ".join(f"{k} {quote(str(out / v)) if k == '--spec-draft-model' else v}" for k, v in flags.items())
    command = f"llama-server -m {quote(str(out / target.name))} \\\n  {args}"
    notes = [f"Written for {_gguf.LLAMACPP}; the target GGUF is {ctx.gguf_type} (norms and 1-D tensors F32, as "
             "llama.cpp's converter writes them)."] + notes
    return EngineExport(command, config, notes)


BLOCK_DRAFT = "draft-{algorithm}-{type}.gguf"


def write_block(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    """The target GGUF and a DFlash / DSpark head as llama.cpp's `dflash` drafter GGUF (conversion/qwen.py
    DFlashModel, DSparkModel): Qwen3-style layers, `fc`, `hidden_norm` as `enc.output_norm`, the Markov
    and confidence heads, `d2t` as absolute ids; `dflash.target_layers` = layer i's input (the converter
    writes the source's output ids + 1), `dflash.block_size`, `dflash.sample_from_anchor`, causality."""
    from specpack.errors import UnsupportedError

    d, cfg = ctx.manifest.drafter, head
    missing = [f"layers.{i}.self_attn.{n}_norm.weight" for i in range(cfg["num_layers"]) for n in ("q", "k")
               if f"layers.{i}.self_attn.{n}_norm.weight" not in tensors]
    unknown = sorted(n for n in tensors if n not in BLOCK_NAMES and n != "t2d" and _layer_name(n) is None)
    if missing or unknown:
        raise UnsupportedError("llama.cpp's DFlash draft layers are Qwen3 layers (q/k norms required; "
                               "src/models/dflash.cpp)", problems=[f"missing {n}" for n in missing[:4]] +
                               [f"tensor {n}: no llama.cpp name" for n in unknown[:4]])
    target, pre = write_target(ctx)
    path = ctx.out / BLOCK_DRAFT.format(algorithm=d.algorithm, type=ctx.gguf_type)
    writer = _gguf.open_writer(path, "dflash", f"{ctx.artifact.name} {d.algorithm} head")
    sizes = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "intermediate_size", "rms_norm_eps", "rope_theta")}
    sizes.update(max_position_embeddings=ctx.manifest.target.max_position_embeddings, vocab_size=cfg["vocab_size"],
                 num_hidden_layers=cfg["num_layers"])
    _gguf.add_llama_hparams(writer, "dflash", sizes, ctx.gguf_type, key_length=True)
    writer.add_array("dflash.target_layers", [int(i) for i in cfg["target_layer_ids"]])
    writer.add_uint32("dflash.block_size", int(d.block_size))
    writer.add_bool("dflash.sample_from_anchor", d.query_layout == "anchor_first")
    writer.add_bool("dflash.has_confidence_head", "confidence_head.proj.weight" in tensors)
    writer.add_bool("dflash.attention.causal", bool(d.layer_causal[0]))
    if d.logit_scale is not None:
        writer.add_float32("dflash.logit_scale", float(d.logit_scale))
    _gguf.add_tokenizer(writer, ctx.artifact, pre)
    writer.add_uint32("tokenizer.ggml.mask_token_id", int(d.mask_token_id))
    _plan_head(ctx.gguf_type, tensors, lambda n: BLOCK_NAMES.get(n) or _layer_name(n)).write(writer)  # not t2d
    spec_type = "draft-dspark" if d.markov is not None else "draft-dflash"
    flags = {"--spec-draft-model": path.name, "--spec-type": spec_type, "--spec-draft-n-max": ctx.draft_len,
             "--spec-draft-n-min": 0}
    shared = ("shares the target's embedding and lm_head (no token_embd / output in the draft: llama.cpp's ctx_other)"
              if d.lm_head_source == "target" else "scores with its own lm_head" +
              (" over a reduced vocabulary, mapped back by d2t" if "d2t" in tensors else ""))
    notes = [f"the head {shared}",
             f"target layers {cfg['target_layer_ids']} as the input of layer i (`dflash.target_layers`; llama.cpp's "
             "converter writes a source's output-of-layer ids + 1)",
             f"block {d.block_size} ({d.query_layout.replace('_', '-')}: sample_from_anchor "
             f"{d.query_layout == 'anchor_first'}), mask token {d.mask_token_id}, "
             f"{'causal' if d.layer_causal[0] else 'non-causal'} within the block",
             "with --spec-draft-p-min P > 0 llama.cpp cuts a DSpark draft where its confidence head falls under P "
             "(default 0: the whole block, as specpack's figures count it)" if d.confidence is not None else
             "no confidence head: keep --spec-draft-p-min 0 (llama.cpp refuses a DSpark draft without one otherwise)"]
    return _export(ctx, target, flags, notes)


def _layer_name(name: str) -> str | None:
    head, _, rest = name.partition(".")
    if head != "layers":
        return None
    i, _, leaf = rest.partition(".")
    return f"blk.{i}.{LAYER_NAMES[leaf]}" if leaf in LAYER_NAMES and i.isdigit() else None


def write_mtp(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    """The target GGUF with the MTP layer as its nextn block; llama-server drafts from the target itself."""
    target, _ = write_target(ctx)
    d, L = ctx.manifest.drafter, ctx.manifest.target.num_hidden_layers
    flags = {"--spec-type": "draft-mtp", "--spec-draft-n-max": ctx.draft_len, "--spec-draft-n-min": 0}
    notes = [f"the MTP layer is the target GGUF's nextn block `blk.{L}.nextn.*` (deepseek2.nextn_predict_layers 1), "
             "as llama.cpp's converter writes GLM-4.7-Flash's; its own converter leaves DeepSeek-V3's out",
             "no -md: llama-server builds the MTP draft context from the target model"]
    reads = f"the nextn block `blk.{L}.*` this export writes into the target GGUF"
    bindings = _mtp.bindings(ctx, "llama.cpp", _deepseek2.MTP[d.source_layout], reads)
    return replace(_export(ctx, target, flags, notes), bindings=bindings)


KINDS = {"eagle3": write_eagle3, "ngram": write_ngram, "block": write_block, "mtp": write_mtp}
