"""DSpark stages inside a DeepSeek-V4 / V4-Pro / V4.1 release's own weights (layout B in docs/families.md,
DeepSeek-V4-Flash-DSpark, DeepSeek-V4.1-Flash), bound where they are: nothing is copied.

    convert_in_target(target) -> ConvertedDrafter    # `--drafter dspark-stages` (what `bundled` binds)
    problems(target)          -> every defect, or []  # the same check, for `inspect`

DeepSeek-V4 (`deepseek_v4`): every fact follows vLLM's DeepSeek-V4 DSpark draft module
(models/deepseek_v4/dspark.py, "parameter names and weight loading matching the DSpark checkpoint"):
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

DeepSeek-V4.1 (`deepseek_v41`, keys in `text_config`): vLLM's DSparkV41DraftModel
(models/deepseek_v41/nvidia/dspark.py `DSparkDeepseekV4ForCausalLM.load_weights` / `_remap_dspark_name`):
- stage k is one V4.1 decoder layer past the backbone (`layers.{num_hidden_layers + k}`): sliding-window
  attention only (transformers DeepseekV41TextConfig: "DSpark draft layers are sliding-window-only"), no
  engram, its MoE with `dspark_n_routed_experts` / `dspark_num_experts_per_tok` (vLLM deepseek_v41
  DeepseekV4MoE), the router's `bias_vl` where the release has a vision tower;
- stage 0 adds `main_proj` and `main_norm` as V4; the last stage adds `norm`, the Markov head as the
  checkpoint names it (`markov_head.embed` / `markov_head.head` -> markov_w1 / markov_w2) and, when
  shipped, `confidence_head.proj` (vLLM drops the head when the checkpoint has none); no learned hc_head
  ("v4.1 has no learned hc_head");
- the stage count is `n_mtp_layers`, else `num_nextn_predict_layers`, else 3 (`num_dspark_layers`);
- dspark_target_layer_ids name the *input* of layer i (transformers: "Backbone layers whose attention
  input (mean over the hc streams) feeds the draft model"; vLLM model.py captures the aux state at
  layer i's pre, i.e. the previous layer's post).
embed.weight and head.weight are the target's (`attach_target_modules`; V4.1: `has_own_embed_tokens =
False`, `has_own_lm_head = False`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from specpack.converters.base import ConvertedDrafter
from specpack.converters.release_dspark.common import entry, markers
from specpack.converters.target_hf import Target
from specpack.errors import InputError, UnsupportedError
from specpack.families import quant
from specpack.families.base import Layer, Tensor, linear, vector

SPEC = "dspark-stages"  # the `--drafter` value that binds a release's own DSpark stages
STAGE = re.compile(r"^mtp\.(\d+)\.")
DEFAULT_RANK = 256  # DSparkMarkovHead: getattr(config, "dspark_markov_rank", 256)
STAGE_LAYER = Layer("sliding", "moe")
DECODER = ("DeepSeek-V4 decoder layers: sliding-window attention over one shared K=V head with a grouped low-rank "
           "output, hyper-connections, top-k MoE with one shared expert")


@dataclass(frozen=True)
class Release:
    """What differs between the releases that keep DSpark stages in their weights."""

    family: str
    layout: str
    source: str
    convention: str  # the manifest's target_layer_convention
    convention_why: str
    markov: tuple[str, str]  # the Markov head's two factors, as the checkpoint names them
    hc_head: bool  # the last stage carries a learned hc_head
    confidence_required: bool
    causal_why: str  # where the source states that a block's rows attend the whole block


V4 = Release("deepseek_v4", "deepseek-v4-dspark", "vLLM models/deepseek_v4/dspark.py", "output_of_layer",
             "output of layer i: the DeepSeek-V4 DSpark ports record h after each id",
             ("markov_head.markov_w1", "markov_head.markov_w2"), hc_head=True, confidence_required=True,
             causal_why="vLLM models/deepseek_v4/dspark.py _build_dspark_topk_idxs: every block row attends the window "
                        "and the whole block")
V41 = Release("deepseek_v41", "deepseek-v41-dspark", "vLLM models/deepseek_v41/nvidia/dspark.py", "input_of_layer",
              "input of layer i: transformers DeepseekV41TextConfig (\"attention input (mean over the hc streams)\"), "
              "as vLLM deepseek_v41 model.py captures it at layer i's pre",
              ("markov_head.embed", "markov_head.head"), hc_head=False, confidence_required=False,
              causal_why="vLLM models/deepseek_v41/nvidia/dspark.py: \"to implement non-causal attention\", the "
                         "block's future query tokens join each row's top-k indices")
RELEASES = {r.family: r for r in (V4, V41)}
LAYOUT, SOURCE = V4.layout, V4.source  # DeepSeek-V4's: `--drafter dspark-stages` names it; both bind here
LAYOUTS = tuple(r.layout for r in RELEASES.values())


def convert_in_target(target: Target) -> ConvertedDrafter:
    """The release's DSpark stages, every tensor checked as vLLM loads it, bound in place."""
    release, plan, problems = _plan(target)
    if problems:
        raise InputError(f"the DSpark stages in '{target.root}' cannot be bound ({len(problems)} problems)",
                         problems=problems, hint="the stages, their dspark_* keys and the target must come from "
                                                 "the same DeepSeek-V4 DSpark release")
    arch = target.checked.arch
    drafter, extra = entry(
        target, _found(target), plan["tensors"], target.checked.quant, plan["counts"], plan,
        source_layout=release.layout, source=target.info.source, location="target", decoder=DECODER,
        layers=plan["stages"], layers_from=plan["stages_from"],
        layer_kind=f"{STAGE_LAYER.attention}+{STAGE_LAYER.mlp}", sliding_window=arch.layers[0].window,
        query_causal=False)
    return ConvertedDrafter(entry=drafter, extra_weight_bytes=extra)


def problems(target: Target) -> list[str]:
    """Every defect that keeps `convert_in_target` from binding the stages ([] when it binds them)."""
    try:
        return _plan(target)[2]
    except (InputError, UnsupportedError) as exc:
        return [exc.message]


def _plan(target: Target) -> tuple[Release, dict, list[str]]:
    """What binding the stages takes (tensors, counts, the dspark_* facts) and every problem at once."""
    checked = target.checked
    release = RELEASES.get(checked.arch.family) if checked else None
    if release is None:
        family = checked.arch.family if checked else target.info.architecture
        raise UnsupportedError(f"DSpark stages inside the target are bound for DeepSeek-V4 and V4.1 releases "
                               f"({V4.source}, {V41.source}); this target is {family}",
                               hint="pass the drafter's directory, 'mtp' or 'ngram'")
    arch, found = checked.arch, _found(target)
    text = _text(target.files_reader)
    where = "config.json" + (" text_config" if arch.text_config else "")
    plan, bad = markers(text, target, where, f"vLLM's DSpark draft ({release.source})", release.convention)
    rank = text.get("dspark_markov_rank")
    plan.update(rank=rank or DEFAULT_RANK, confidence_with_markov=True, convention=release.convention)
    plan["resolved_from"].update(
        markov_rank=f"{where} dspark_markov_rank" if rank else f"{release.source} default {DEFAULT_RANK}",
        target_layer_convention=release.convention_why,
        query_causal=release.causal_why,
        sliding_window="the target's sliding_window (the stages' rolling KV window)")
    count = _stages if release is V4 else _v41_stages
    plan["stages"], plan["stages_from"], stage_bad = count(target.files_reader, text, found)
    plan["resolved_from"]["layers"] = plan["stages_from"]
    plan["confidence"] = release.confidence_required or f"mtp.{plan['stages'] - 1}.confidence_head.proj.weight" in found
    bad += stage_bad
    if bad:
        return release, plan, bad
    plan["tensors"] = expected(release, arch, text, found, plan)
    tensor_bad, plan["counts"] = quant.check_all(plan["tensors"], found, checked.quant)
    return release, plan, bad + tensor_bad


def expected(release: Release, arch, text: dict, found: dict, plan: dict) -> dict[str, Tensor]:
    """Every tensor the stages hold, as the release's vLLM DSpark draft names and shapes them."""
    H, V, rank, stages = arch.hidden_size, arch.vocab_size, plan["rank"], plan["stages"]
    out: dict[str, Tensor] = {}
    for k in range(stages):
        p = f"mtp.{k}."
        out.update(_stage_layer(release, arch, text, found, p))
        if k == 0:
            out.update({p + "main_proj.weight": linear(H, H * len(plan["ids"])), p + "main_norm.weight": vector(H)})
    last = f"mtp.{stages - 1}."
    w1, w2 = release.markov
    out.update({last + "norm.weight": vector(H), f"{last}{w1}.weight": Tensor((V, rank)),
                f"{last}{w2}.weight": Tensor((V, rank))})
    if plan["confidence"]:
        out[last + "confidence_head.proj.weight"] = Tensor((1, H + rank))
    if release.hc_head:
        hc = arch.details["hc_mult"]
        out.update({last + "hc_head_fn": Tensor((hc, hc * H)), last + "hc_head_base": vector(hc),
                    last + "hc_head_scale": vector(1)})
    return out


def _stage_layer(release: Release, arch, text: dict, found: dict, p: str) -> dict[str, Tensor]:
    """One stage's decoder layer: a sliding-window, top-k MoE layer of the target's family."""
    kv_norm = "kv_norm" if p + "attn.kv_norm.weight" in found else "norm"
    stage_arch = replace(arch, details={**arch.details, "kv_norm": kv_norm})
    if release is V4:
        from specpack.families.deepseek_v4 import layer_tensors

        return layer_tensors(stage_arch, p, STAGE_LAYER)
    from specpack.families import deepseek_v41

    return deepseek_v41.layer_tensors(stage_arch, p, None, deepseek_v41.stage_experts(arch, text))


def _stages(reader, text: dict, found: dict) -> tuple[int, str, list[str]]:
    """DeepSeek-V4's stage count as vLLM takes it, and the held stages that contradict it."""
    held = _held(found)
    stated, where = _inference_count(reader)
    if stated is None:
        if not held:
            return 0, "none", [NONE_HELD]
        return held[-1] + 1, "the weights' mtp.{k}. prefixes", []
    return stated, where, _beyond(held, stated, where)


def _v41_stages(reader, text: dict, found: dict) -> tuple[int, str, list[str]]:
    """DeepSeek-V4.1's: n_mtp_layers, else num_nextn_predict_layers, else 3 (vLLM num_dspark_layers)."""
    key = next((k for k in ("n_mtp_layers", "num_nextn_predict_layers") if text.get(k)), None)
    stated, where = (text[key], f"config.json text_config {key}") if key else (3, f"{V41.source} default 3")
    if not 0 < stated <= 64:
        return 1, where, [f"{where} = {stated}: not a stage count (1..64)"]
    held = _held(found)
    if not held:
        return stated, where, [NONE_HELD]
    return stated, where, _beyond(held, stated, where)


NONE_HELD = ("the weights hold no mtp.{k}. tensor: the config declares DSpark stages the release does not ship "
             "(a re-upload that dropped them?)")


def _held(found: dict) -> list[int]:
    return sorted({int(m.group(1)) for n in found if (m := STAGE.match(n)) and len(m.group(1)) <= 6})


def _beyond(held: list[int], stated: int, where: str) -> list[str]:
    return [f"{where} states {stated} stages, but the weights hold mtp.{k}.* (vLLM would load {stated})"
            for k in held if k >= stated]


def _inference_count(reader) -> tuple[int | None, str]:
    """`inference/config.json` `n_mtp_layers`, where the release ships its reference code's config."""
    rel, where = "inference/config.json", "inference/config.json n_mtp_layers"
    if not reader.exists(rel):
        return None, where
    path = reader.label(rel)
    try:
        n = reader.json(rel, "DeepSeek's reference config").get("n_mtp_layers")
    except InputError:
        raise InputError(f"{path} is not a JSON object", hint="it is DeepSeek's reference config; restore it") from None
    if n is None or n == 0:
        return None, where
    if not (isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 64):
        raise InputError(f"{path}: n_mtp_layers = {str(n)[:40]}: not a stage count (1..64)")
    return n, where


def _text(reader) -> dict:
    config = reader.json("config.json", "target config")
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _found(target: Target) -> dict:
    return {name: meta for name, (_, meta) in target.tensors.items()}
