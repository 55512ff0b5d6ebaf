"""DSpark stages inside a DeepSeek-V4 / V4-Pro release's own weights (layout B in docs/families.md,
DeepSeek-V4-Flash-DSpark), bound where they are: nothing is copied.

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
- dspark_block_size and dspark_noise_token_id are required; dspark_markov_rank defaults to 256; the
  stages keep a rolling window of the target's sliding_window; every block row attends the window and
  the whole block (`_build_dspark_topk_idxs`); main_proj reads the target's hidden states at
  dspark_target_layer_ids, each the output of layer i (the public DeepSeek-V4 DSpark ports record `h`
  after layers [40, 41, 42] of 43).
embed.weight and head.weight are the target's (`attach_target_modules`).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from specpack.converters.base import ConvertedDrafter
from specpack.converters.release_dspark.common import entry, markers
from specpack.converters.target_hf import Target, read_json
from specpack.errors import InputError, UnsupportedError
from specpack.families import quant
from specpack.families.base import Layer, Tensor, linear, vector

SPEC = "dspark-stages"  # the `--drafter` value that binds a release's own DSpark stages
LAYOUT = "deepseek-v4-dspark"
SOURCE = "vLLM models/deepseek_v4/dspark.py"
STAGE = re.compile(r"^mtp\.(\d+)\.")
DEFAULT_RANK = 256  # DSparkMarkovHead: getattr(config, "dspark_markov_rank", 256)
STAGE_LAYER = Layer("sliding", "moe")
DECODER = ("DeepSeek-V4 decoder layers: sliding-window attention over one shared K=V head with a grouped low-rank "
           "output, hyper-connections, top-k MoE with one shared expert")


def convert_in_target(target: Target) -> ConvertedDrafter:
    """The release's DSpark stages, every tensor checked as vLLM loads it, bound in place."""
    plan, problems = _plan(target)
    if problems:
        raise InputError(f"the DSpark stages in '{target.root}' cannot be bound ({len(problems)} problems)",
                         problems=problems, hint="the stages, their dspark_* keys and the target must come from "
                                                 "the same DeepSeek-V4 DSpark release")
    arch = target.checked.arch
    drafter, extra = entry(
        target, _found(target), plan["tensors"], target.checked.quant, plan["counts"], plan,
        source_layout=LAYOUT, source=target.info.source, location="target", decoder=DECODER, layers=plan["stages"],
        layers_from=plan["stages_from"], layer_kind=f"{STAGE_LAYER.attention}+{STAGE_LAYER.mlp}",
        sliding_window=arch.layers[0].window, query_causal=False)
    return ConvertedDrafter(entry=drafter, extra_weight_bytes=extra)


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
    plan, bad = markers(text, target, "config.json", f"vLLM's DSpark draft ({SOURCE})")
    rank = text.get("dspark_markov_rank")
    plan.update(rank=rank or DEFAULT_RANK, confidence=True, confidence_with_markov=True)
    plan["resolved_from"].update(
        markov_rank="config.json dspark_markov_rank" if rank else f"{SOURCE} default {DEFAULT_RANK}",
        target_layer_convention="output of layer i: the DeepSeek-V4 DSpark ports record h after each id",
        query_causal=f"{SOURCE} _build_dspark_topk_idxs: every block row attends the window and the whole block",
        sliding_window="the target's sliding_window (the stages' rolling KV window)")
    plan["stages"], plan["stages_from"], stage_bad = _stages(target.root, found)
    plan["resolved_from"]["layers"] = plan["stages_from"]
    bad += stage_bad
    if bad:
        return plan, bad
    plan["tensors"] = expected(arch, found, plan["stages"], len(plan["ids"]), plan["rank"])
    tensor_bad, plan["counts"] = quant.check_all(plan["tensors"], found, checked.quant)
    return plan, bad + tensor_bad


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


def _stages(root: Path, found: dict) -> tuple[int, str, list[str]]:
    """The stage count as vLLM takes it, and the held stages that contradict it."""
    held = sorted({int(m.group(1)) for n in found if (m := STAGE.match(n)) and len(m.group(1)) <= 6})
    stated, where = _inference_count(root)
    if stated is None:
        if not held:
            return 0, "none", ["the weights hold no mtp.{k}. tensor: the config declares DSpark stages the release "
                               "does not ship (a re-upload that dropped them?)"]
        return held[-1] + 1, "the weights' mtp.{k}. prefixes", []
    bad = [f"{where} states {stated} stages, but the weights hold mtp.{k}.* (vLLM would load {stated})"
           for k in held if k >= stated]
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
    config = read_json(root / "config.json", "target config")
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _found(target: Target) -> dict:
    return {name: meta for name, (_, meta) in target.tensors.items()}
