"""DSpark stages inside a DeepSeek-V4 / V4-Pro release's own weights (shared/RELEASES.md layout B,
DeepSeek-V4-Flash-DSpark) -> drafter kind `dspark_stages`, bound where they are: nothing is copied.

    convert_in_target(target) -> ConvertedDrafter    # `--drafter dspark-stages` (what `bundled` binds)
    problems(target)          -> every defect, or []  # the same check, for `inspect`

Every fact follows vLLM's DeepSeek-V4 DSpark draft module (models/deepseek_v4/dspark.py, "parameter
names and weight loading matching the DSpark checkpoint"):
- stage k lives under `mtp.{k}.` and is one DeepSeek-V4 decoder layer (`DeepSeekV4DSparkLayer(
  DeepseekV4DecoderLayer)`, layer index num_hidden_layers + k: sliding-window attention, top-k MoE), so
  its attention, experts and hyper-connections carry the target layer's names and shapes;
- stage 0 adds `main_proj` [H, H x len(dspark_target_layer_ids)] (FP8 with its `.scale`, dequantized
  with 128-blocks) and `main_norm` [H]; the last stage adds `norm` [H], `markov_head.markov_w1` /
  `markov_w2` [V, dspark_markov_rank] (float), `confidence_head.proj` [1, H + rank] (no bias) and
  `hc_head_{fn [hc, hc x H], base [hc], scale [1]}`;
- `.scale` reads as `weight_scale_inv`, or `weight_scale` for fp4 experts (`_EXPERT_SCALE_RE`): the
  target's own fp8-block form (families/quant.py), so the same check applies;
- the stage count is `inference/config.json` `n_mtp_layers`, else the index's `mtp.{k}.` prefixes
  (`_read_dspark_num_layers`); the legacy `num_nextn_predict_layers: 1` is not it;
- dspark_block_size and dspark_noise_token_id are required; dspark_markov_rank defaults to 256;
  main_proj reads the target's hidden states at dspark_target_layer_ids, each the output of layer i
  (the public DeepSeek-V4 DSpark ports record `h` after layers [40, 41, 42] of 43).
embed.weight and head.weight are the target's (`attach_target_modules`).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from specpack.converters.base import ConvertedDrafter
from specpack.converters.target_hf import Target, _dtype_bytes, _numel, quantization_entry
from specpack.errors import InputError, UnsupportedError
from specpack.families import quant
from specpack.families.base import Layer, Tensor, linear, vector
from specpack.schemas import BlockConfidence, BlockMarkov, DSparkStagesDrafter

KIND = "dspark_stages"
SPEC = "dspark-stages"  # the `--drafter` value that binds a release's own DSpark stages
LAYOUT = "deepseek-v4-dspark"
SOURCE = "vLLM models/deepseek_v4/dspark.py"
STAGE = re.compile(r"^mtp\.(\d+)\.")
DEFAULT_RANK = 256  # DSparkMarkovHead: getattr(config, "dspark_markov_rank", 256)
STAGE_LAYER = Layer("sliding", "moe")


def convert_in_target(target: Target) -> ConvertedDrafter:
    """The release's DSpark stages, every tensor checked as vLLM loads it, bound in place."""
    plan, problems = _plan(target)
    if problems:
        raise InputError(f"the DSpark stages in '{target.root}' cannot be bound ({len(problems)} problems)",
                         problems=problems, hint="the stages, their dspark_* keys and the target must come from "
                                                 "the same DeepSeek-V4 DSpark release")
    arch, found = target.checked.arch, _found(target)
    tensors = plan["tensors"]
    q = target.checked.quant
    names = {n for name, t in tensors.items() for n in quant.stored_names(name, t, q) if n in found}
    stage_bytes = sum(found[n].numel * _dtype_bytes(found[n].dtype) for n in names)
    entry = DSparkStagesDrafter(
        source_layout=LAYOUT, source=target.info.source, stages=plan["stages"], stages_from=plan["stages_from"],
        stage_layer=f"{STAGE_LAYER.attention}+{STAGE_LAYER.mlp}", block_size=plan["block_size"], noise_token_id=plan["noise_token_id"],
        target_layer_ids=plan["ids"], target_layer_convention="output_of_layer",
        markov=BlockMarkov(rank=plan["rank"], type="vanilla"), confidence=BlockConfidence(with_markov=True),
        quantization=quantization_entry(q, plan["counts"]), tensors=len(names),
        parameters=sum(_numel(t.shape) for t in tensors.values()), shared_tensors=[arch.embed, arch.lm_head or arch.embed],
        resolved_from=plan["resolved_from"])
    return ConvertedDrafter(entry=entry, extra_weight_bytes=stage_bytes)


def problems(target: Target) -> list[str]:
    """Every defect that keeps `convert_in_target` from binding the stages ([] when it binds them)."""
    try:
        return _plan(target)[1]
    except (InputError, UnsupportedError) as exc:
        return [exc.message]


def _plan(target: Target) -> tuple[dict, list[str]]:
    """What binding the stages takes (tensors, counts, the dspark_* facts) and every problem at once."""
    checked = target.checked
    if checked is None or checked.arch.family != "deepseek_v4":
        family = checked.arch.family if checked else target.info.architecture
        raise UnsupportedError(f"DSpark stages inside the target are bound for DeepSeek-V4 releases ({SOURCE}); "
                               f"this target is {family}", hint="pass the drafter's directory, 'mtp' or 'ngram'")
    arch, found = checked.arch, _found(target)
    text = _text(target.root)
    out, bad = _markers(text, arch)
    out["stages"], out["stages_from"], stage_bad = _stages(target.root, found)
    bad += stage_bad
    out["resolved_from"]["stages"] = out["stages_from"]
    if bad:
        return out, bad
    out["tensors"] = expected(arch, found, out["stages"], len(out["ids"]), out["rank"])
    tensor_bad, out["counts"] = quant.check_all(out["tensors"], found, checked.quant)
    return out, bad + tensor_bad


def expected(arch, found: dict, stages: int, features: int, rank: int) -> dict[str, Tensor]:
    """Every tensor the `stages` stages hold, as vLLM's DSpark draft names and shapes them."""
    from specpack.families.deepseek_v4 import layer_tensors

    H, hc, V = arch.hidden_size, arch.details["hc_mult"], arch.vocab_size
    kv_norm = "kv_norm" if "mtp.0.attn.kv_norm.weight" in found else "norm"
    stage_arch = replace(arch, details={**arch.details, "kv_norm": kv_norm})
    out: dict[str, Tensor] = {}
    for k in range(stages):
        p = f"mtp.{k}."
        out.update(layer_tensors(stage_arch, p, STAGE_LAYER))
        if k == 0:
            out.update({p + "main_proj.weight": linear(H, H * features), p + "main_norm.weight": vector(H)})
        if k == stages - 1:
            out.update({p + "norm.weight": vector(H), p + "markov_head.markov_w1.weight": Tensor((V, rank)),
                        p + "markov_head.markov_w2.weight": Tensor((V, rank)),
                        p + "confidence_head.proj.weight": Tensor((1, H + rank)),
                        p + "hc_head_fn": Tensor((hc, hc * H)), p + "hc_head_base": vector(hc),
                        p + "hc_head_scale": vector(1)})
    return out


def _markers(text: dict, arch) -> tuple[dict, list[str]]:
    """dspark_block_size, dspark_noise_token_id, dspark_target_layer_ids and dspark_markov_rank, each
    checked against the target (config.json's types are checked before: families/fields.py)."""
    bad, resolved = [], {}
    block, noise, ids = (text.get(k) for k in ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids"))
    rank = text.get("dspark_markov_rank")
    for key, value in (("dspark_block_size", block), ("dspark_noise_token_id", noise), ("dspark_target_layer_ids", ids)):
        if value is None:
            bad.append(f"config.json states no {key}: vLLM's DSpark draft requires it ({SOURCE})")
        else:
            resolved[key.removeprefix("dspark_")] = f"config.json {key}"
    if isinstance(noise, int) and noise >= arch.vocab_size:
        bad.append(f"dspark_noise_token_id {noise} is outside the target's vocabulary (0..{arch.vocab_size - 1})")
    if ids is not None:
        bad += _id_problems(ids, arch.num_layers)
    resolved["markov_rank"] = "config.json dspark_markov_rank" if rank else f"{SOURCE} default {DEFAULT_RANK}"
    resolved["target_layer_convention"] = "output of layer i: the DeepSeek-V4 DSpark ports record h after each id"
    resolved["query_block"] = f"{SOURCE} forward_embed: [last token, noise x (block - 1)], one block a step"
    return {"block_size": block, "noise_token_id": noise, "ids": list(ids or []), "rank": rank or DEFAULT_RANK,
            "resolved_from": resolved}, bad


def _id_problems(ids: list[int], layers: int) -> list[str]:
    bad = [f"dspark_target_layer_ids[{i}] = {v}: not a target layer (0..{layers - 1}, output of layer i)"
           for i, v in enumerate(ids[:64]) if not 0 <= v < layers]
    if not ids:
        bad.append("dspark_target_layer_ids is empty: main_proj reads at least one target layer")
    elif len(set(ids)) != len(ids):
        bad.append(f"dspark_target_layer_ids {ids[:16]} names a layer twice")
    return bad


def _stages(root: Path, found: dict) -> tuple[int, str, list[str]]:
    """The stage count as vLLM takes it, and the held stages that contradict it."""
    held = sorted({int(m.group(1)) for n in found if (m := STAGE.match(n)) and len(m.group(1)) <= 6})
    stated, where = _inference_count(root)
    if stated is None:
        if not held:
            return 0, "none", ["the weights hold no mtp.{k}. tensor: the config declares DSpark stages the release "
                               "does not ship (a re-upload that dropped them?)"]
        return held[-1] + 1, "the weights' mtp.{k}. prefixes", []
    extra = [k for k in held if k >= stated]
    bad = [f"{where} states {stated} stages, but the weights hold mtp.{k}.* (vLLM would load {stated})" for k in extra]
    return stated, where, bad


def _inference_count(root: Path) -> tuple[int | None, str]:
    """`inference/config.json` `n_mtp_layers`, where the release ships its reference code's config."""
    path = root / "inference" / "config.json"
    where = "inference/config.json n_mtp_layers"
    if not path.is_file():
        return None, where
    try:
        n = json.loads(path.read_text()).get("n_mtp_layers")
    except (ValueError, AttributeError):
        raise InputError(f"{path} is not a JSON object", hint="it is DeepSeek's reference config; restore it") from None
    if n is None or n == 0:
        return None, where
    if not (isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 64):
        raise InputError(f"{path}: n_mtp_layers = {str(n)[:40]}: not a stage count (1..64)")
    return n, where


def _text(root: Path) -> dict:
    from specpack.converters.target_hf import read_json

    config = read_json(root / "config.json", "target config")
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _found(target: Target) -> dict:
    return {name: meta for name, (_, meta) in target.tensors.items()}

