"""What every block-drafter layout shares: reading the files, settling each binding from what the
checkpoint states (or a `specpack build` flag), the checks against the target, and the canonical
drafter (docs/format.md: drafter/config.json + model.safetensors, tensors renamed, never changed).

A family module (dflash, dspark, lilicorr) turns one published layout into a `Reading`: tensors under
canonical names, the drafter's decoder config flattened, and *statements* — every place its config
(or the layout's own published model code) says which algorithm, query layout, mask token, block size
or target layers it uses. `build` settles each binding from the statements: they must agree, and a
flag may only supply a binding nobody states or pick one of two the checkpoint states. Then every
check runs and all problems are reported at once.

Sources (read with the search tool):
- z-lab/dflash dflash/model.py @ 44947fbf7111: `hidden_states[layer_id + 1]` (target ids count output
  of layer i), fc over len(ids) x hidden, context K/V = k_proj/v_proj of hidden_norm(fc(ctx)) with no
  input_layernorm, q/k RMSNorm, o_proj bias = attention_bias, queries [anchor, mask...] with slot k
  predicting its own position (fill-in); the target layer ids silently default when missing.
- deepseek-ai/DeepSpec deepspec/modeling/dspark/{common,markov_head,qwen3/*}.py @ afdfa7c9382a:
  output-of ids with -1 = the embeddings, strictly increasing; slot k predicts anchor+k+1
  (anchor-first); embed_tokens/lm_head are frozen copies of the target's; markov_head.* and
  confidence_head.proj.*; dflash_*_block7 configs are the same builder with markov_rank 0.
- vllm-project/vllm qwen3_dflash.py @ 036a00d1: per-layer causality / sliding window resolution
  (`_resolve_layer_attention`), attention sinks, mask_embedding.pt, no `mask_hidden`, is_neox_style;
  eagle3_utils.py @ 0cfdd2e1: eagle_aux_hidden_state_layer_ids (input of layer i) take precedence,
  dflash_config.target_layer_ids and top-level target_layer_ids get +1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from specpack.converters.base import (BLOCK_ALGORITHM_FLAG, BLOCK_LAYOUT_FLAG, MASK_TOKEN_FLAG,
                                      TARGET_LAYERS_FLAG, AuxOverride, BlockOverrides)
from specpack.converters.target_hf import INDEX_NAME, Target, read_json, read_weight_map
from specpack.converters.target_hf import read_config as _checked_config
from specpack.errors import InputError

log = logging.getLogger(__name__)

LAYER_WEIGHTS = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo") + \
    ("self_attn.q_norm.weight", "self_attn.k_norm.weight") + \
    tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")) + \
    ("input_layernorm.weight", "post_attention_layernorm.weight")
LAYER_BIASES = tuple(f"self_attn.{p}_proj.bias" for p in "qkvo")
SINK = "self_attn.attention_sink_bias"
MARKOV = {"vanilla": ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"),
          "gated": ("markov_head.gate_proj.weight", "markov_head.gate_proj.bias"),
          "rnn": ("markov_head.joint_proj.weight", "markov_head.joint_proj.bias")}
CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")
FLAGS = {"algorithm": BLOCK_ALGORITHM_FLAG, "query_layout": BLOCK_LAYOUT_FLAG, "mask_token_id": MASK_TOKEN_FLAG,
         "block_size": None, "markov_rank": None}
WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class Reading:
    """One published layout read into canonical names, with what its config states."""

    layout: str
    path: Path
    config: dict  # the drafter's decoder config, flat (speculators: its transformer_layer_config)
    raw: dict  # config.json as written
    tensors: dict  # canonical name -> tensor
    names: dict  # canonical name -> name in the source (for messages)
    says: dict = field(default_factory=dict)  # binding -> [(value, where)]
    ids: list = field(default_factory=list)  # [(ids, "input_of_layer"|"output_of_layer", where)]
    problems: list = field(default_factory=list)
    lilicorr: dict | None = None  # LiLiCorr correlator geometry (LiLiCorrGeometry fields)
    attention: tuple | None = None  # (per-layer causal, per-layer window) when the layout defines its own rule
    made_for: list = field(default_factory=list)  # schemas.MadeFor: what it states about the target it was made for

    def say(self, binding: str, value, where: str) -> None:
        if value is not None:
            self.says.setdefault(binding, []).append((value, where))

    def source_name(self, canonical: str) -> str:
        return self.names.get(canonical, canonical)


def has_weights(path: Path) -> bool:
    return any((path / n).is_file() for n in (*WEIGHT_NAMES, INDEX_NAME))


def tensor_names(path: Path) -> set[str]:
    """Names only, from the safetensors headers when there are any (nothing loaded)."""
    from specpack.converters.safetensors_header import read_header

    if (path / INDEX_NAME).is_file():
        return set(read_weight_map(path))
    if (path / "model.safetensors").is_file():
        return set(read_header(path / "model.safetensors"))
    return set(load_tensors(path))


def load_tensors(path: Path) -> dict:
    """The drafter's tensors: sharded safetensors (with their index), model.safetensors, or a
    weights-only pytorch_model.bin."""
    from specpack.converters import eagle3

    if not (path / INDEX_NAME).is_file():
        return eagle3.load_tensors(path)
    from safetensors.torch import load_file

    weight_map = read_weight_map(path)
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or "/" in shard or shard.startswith(".") or not (path / shard).is_file():
            raise InputError(f"'{path}': the weight index names shard {shard!r}, which is not a file beside it",
                             hint="download every shard listed in model.safetensors.index.json")
        tensors.update(load_file(path / shard))
    return tensors


def load_mask_embedding(path: Path, mask_token_id) -> tuple[object, list[str]]:
    """A separate `mask_embedding.pt` (a raw tensor, or {"mask_token_id", "embedding"}) as vLLM reads
    it (qwen3_dflash.py @ 036a00d1 `_read_mask_embedding`); (tensor or None, problems)."""
    file = path / "mask_embedding.pt"
    if not file.is_file():
        return None, []
    import pickle

    import torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        return None, [f"mask_embedding.pt is not a plain tensor file: {str(exc).splitlines()[0]}"]
    if isinstance(state, dict):
        if "mask_token_id" in state and mask_token_id is not None and state["mask_token_id"] != mask_token_id:
            return None, [f"mask_embedding.pt is for mask token {state['mask_token_id']}, the config's mask "
                          f"token is {mask_token_id}"]
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor):
        return None, ["mask_embedding.pt holds neither a tensor nor {'mask_token_id', 'embedding'}"]
    return state.reshape(-1), []


def dflash_config(raw: dict) -> dict:
    value = raw.get("dflash_config")
    return value if isinstance(value, dict) else {}


def state_mask_token(r: Reading) -> None:
    """Every place vLLM looks for the mask token (`get_parallel_drafting_token_id`): dflash_config,
    top level, dspark_noise_token_id; all that are present must agree."""
    dc = dflash_config(r.raw)
    r.say("mask_token_id", dc.get("mask_token_id"), "dflash_config.mask_token_id")
    r.say("mask_token_id", r.raw.get("mask_token_id"), "mask_token_id")
    r.say("mask_token_id", r.raw.get("dspark_noise_token_id"), "dspark_noise_token_id")


def state_block_size(r: Reading) -> None:
    r.say("block_size", r.raw.get("block_size"), "block_size")
    r.say("block_size", dflash_config(r.raw).get("block_size"), "dflash_config.block_size")
    r.say("block_size", r.raw.get("dspark_block_size"), "dspark_block_size")


def state_anchor_markers(r: Reading) -> None:
    """`sample_from_anchor` (top level or in dflash_config; true = anchor-first) and its opposite,
    `dspark_bonus_anchor` (true = fill-in): vLLM revisions read one or the other (dspark/speculator.py
    @ 02957b5a vs @ 6534e066), so both count and must agree."""
    for where, value in (("sample_from_anchor", r.raw.get("sample_from_anchor")),
                         ("dflash_config.sample_from_anchor", dflash_config(r.raw).get("sample_from_anchor"))):
        if isinstance(value, bool):
            r.say("query_layout", "anchor_first" if value else "fill_in", f"{where} = {str(value).lower()}")
    bonus = r.raw.get("dspark_bonus_anchor")
    if isinstance(bonus, bool):
        r.say("query_layout", "fill_in" if bonus else "anchor_first", f"dspark_bonus_anchor = {str(bonus).lower()}")


def size(config: dict, key: str) -> int:
    """config[key] when it is a positive integer, else 0 (the geometry checks report it)."""
    value = config.get(key)
    return value if is_int(value) and value > 0 else 0


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def state_target_ids(r: Reading, *places) -> None:
    """`places`: (ids, convention, where) as this layout writes them."""
    for ids, convention, where in places:
        if ids is None:
            continue
        if isinstance(ids, list) and ids and all(is_int(i) for i in ids):
            r.ids.append((ids, convention, where))
        else:
            r.problems.append(f"{where} = {ids!r} is not a list of layer ids")


def resolve(r: Reading, binding: str, flag_value=None):
    """(value, what settled it) for `binding`; a problem (naming the flag) when it cannot be settled."""
    said = r.says.get(binding, [])
    values = list(dict.fromkeys(v for v, _ in said))
    where = "; ".join(f"{w} says {v}" for v, w in said)
    flag = FLAGS.get(binding)
    flag_name = flag.split()[0] if flag else None
    if not values:
        if flag_value is not None:
            return flag_value, f"flag {flag_name}"
        r.problems.append(f"{binding.replace('_', ' ')}: the checkpoint does not state it"
                          + (f" and no engine agrees on a default; pass {flag}" if flag else ""))
        return None, None
    if len(values) == 1 and flag_value in (None, values[0]):
        return values[0], "; ".join(dict.fromkeys(w for _, w in said))
    if len(values) > 1 and flag_value in values:
        return flag_value, f"flag {flag_name} (the checkpoint disagrees with itself: {where})"
    if len(values) > 1:
        r.problems.append(f"{binding.replace('_', ' ')}: the checkpoint disagrees with itself ({where})"
                          + (f"; pass {flag} to say which is right" if flag else ""))
    else:
        r.problems.append(f"{binding.replace('_', ' ')}: {flag_name} {flag_value} contradicts the checkpoint "
                          f"({where}); a flag only settles what the checkpoint leaves open")
    return None, None


def resolve_target_ids(r: Reading, override: AuxOverride | None, layers: int):
    """(input-of ids, source ids, source convention, what settled it). Every statement is converted to
    input of layer i (output of layer i = input of layer i + 1) and all must agree."""
    stated = [([int(i) + (1 if conv == "output_of_layer" else 0) for i in ids], ids, conv, where)
              for ids, conv, where in r.ids]
    if override is not None:
        shift = 1 if override.convention == "output_of_layer" else 0
        stated_in = [s[0] for s in stated]
        mine = [i + shift for i in override.ids]
        if stated_in and any(s != mine for s in stated_in):
            r.problems.append(f"target layer ids: the flag gives {list(override.ids)} ({override.convention}) = "
                              f"input of layers {mine}, the checkpoint states " + _ids_text(stated)
                              + "; a flag only settles what the checkpoint leaves open")
            return None
        return mine, list(override.ids), override.convention, "flag --target-layer-ids/--aux-layer-ids"
    if not stated:
        r.problems.append("target layer ids: the checkpoint does not state which target layers feed fc (z-lab and "
                          "SGLang would silently pick evenly spaced defaults); pass " + TARGET_LAYERS_FLAG)
        return None
    if any(s[0] != stated[0][0] for s in stated):
        r.problems.append("target layer ids: the checkpoint states them twice and they disagree (off by one is the "
                          "classic convention mix-up): " + _ids_text(stated) + f"; pass {TARGET_LAYERS_FLAG}")
        return None
    ids_in, ids, conv, _ = stated[0]
    return ids_in, [int(i) for i in ids], conv, "; ".join(s[3] for s in stated)


def _ids_text(stated) -> str:
    return "; ".join(f"{where} = {list(ids)} ({conv.replace('_', ' ')} i: input of layers {ids_in})"
                     for ids_in, ids, conv, where in stated)


def id_problems(ids_in: list[int], layers: int) -> list[str]:
    """Input-of ids must name distinct layers 0..L-1. Input of layer L (the last layer's output) is
    refused: HF's hidden_states[L] is post-norm while engines capture the pre-norm stream
    (DeepSpec forbids the final layer for that reason: eval/base_evaluator.py @ afdfa7c)."""
    problems = []
    if len(set(ids_in)) != len(ids_in):
        problems.append(f"target layer ids {ids_in} (input of layer i) repeat a layer")
    problems += [f"target layer id {i} (input of layer i) is outside [0, {layers - 1}] for a {layers}-layer target"
                 + (": that is the final layer's output, which engines capture pre-norm and HF reports "
                    "post-norm" if i == layers else "") for i in ids_in if not 0 <= i <= layers - 1]
    return problems


def flag_problems(block: BlockOverrides | None) -> list[str]:
    if block is None:
        return []
    out = []
    if block.layout is not None and block.layout not in ("fill_in", "anchor_first"):
        out.append(f"--block-layout {block.layout!r}: choose fill_in or anchor_first")
    if block.algorithm is not None and block.algorithm not in ("dflash", "dspark", "lilicorr"):
        out.append(f"--block-algorithm {block.algorithm!r}: choose dflash, dspark or lilicorr")
    if block.mask_token_id is not None and block.mask_token_id < 0:
        out.append(f"--mask-token-id {block.mask_token_id}: must be a token id (>= 0)")
    return out


def read_config(path: Path) -> dict:
    return _checked_config(path / "config.json")


def source_of(path: Path, source):
    from specpack.schemas import Source

    return source or Source.local(path)


def check_target(target: Target) -> None:
    """Block drafters bind to target layers by id: the target must be of a family whose layers
    specpack reads (families/), so each feature layer's kind can be stated."""
    from specpack.errors import UnsupportedError
    from specpack.families import FAMILIES

    if target.checked is None:
        raise UnsupportedError(f"block drafters bind to a target's layers, and {target.info.architecture} is not a "
                               "family specpack reads", hint="known families: " + ", ".join(FAMILIES))


def state_sinks(r: Reading, layers: int) -> None:
    """Attention sinks: the config flags vLLM reads (dflash_config.attention_sink_bias, else
    add_swa_attention_sink_bias) and the tensors themselves; a flag that lost its tensors, or
    tensors whose flag is gone (vLLM would drop them), disagree."""
    dc = dflash_config(r.raw)
    r.say("attention_sinks", dc.get("attention_sink_bias"), "dflash_config.attention_sink_bias")
    r.say("attention_sinks", r.raw.get("attention_sink_bias"), "attention_sink_bias")
    r.say("attention_sinks", r.raw.get("add_swa_attention_sink_bias"), "add_swa_attention_sink_bias")
    found = [f"layers.{i}.{SINK}" in r.tensors for i in range(layers)]
    if all(found) or not any(found):
        r.say("attention_sinks", all(found) and layers > 0, "the layers' attention_sink_bias tensors")
    else:
        r.problems.append(f"attention_sink_bias tensors exist for layers {[i for i, f in enumerate(found) if f]} "
                          f"only, of {layers}")


def state_all_ids(r: Reading) -> None:
    """Every key engines read target layer ids from (vLLM eagle3_utils.py @ 0cfdd2e1):
    eagle_aux_hidden_state_layer_ids counts input of layer i; dflash_config.target_layer_ids,
    top-level target_layer_ids and dspark_target_layer_ids count output of layer i."""
    state_target_ids(
        r, (r.raw.get("eagle_aux_hidden_state_layer_ids"), "input_of_layer", "eagle_aux_hidden_state_layer_ids"),
        (dflash_config(r.raw).get("target_layer_ids"), "output_of_layer", "dflash_config.target_layer_ids"),
        (r.raw.get("target_layer_ids"), "output_of_layer", "target_layer_ids"),
        (r.raw.get("dspark_target_layer_ids"), "output_of_layer", "dspark_target_layer_ids"))


def state_own_tables(r: Reading) -> None:
    """Nemotron 3.5 configs say whether the drafter ships its own embedding / lm_head
    (has_embed_tokens, has_lm_head: sglang dflash_utils.py @ 00731f0b); the tensors must agree."""
    for key, name in (("has_embed_tokens", "embed_tokens.weight"), ("has_lm_head", "lm_head.weight")):
        if isinstance(r.raw.get(key), bool) and r.raw[key] != (name in r.tensors):
            r.problems.append(f"{key} is {str(r.raw[key]).lower()} but the checkpoint "
                              f"{'lacks' if r.raw[key] else 'has'} {name}")


UNSUPPORTED_TENSORS = (("prefix_gru.", "Domino's prefix GRU"), ("embed_proj.", "Domino's embedding projection"),
                       (".attention_conv.", "DFlash2 grouped convolutions"),
                       (".mlp_conv.", "DFlash2 grouped convolutions"),
                       ("candidate_selector.", "the DFlash2 candidate selector"))


def unsupported_variant(raw: dict, names) -> list[str]:
    """DFlash variants specpack does not run: refused with the reason, never half-imported
    (their markers: vLLM docs dflash.md @ 331c781e, qwen3_dflash2.py @ 030da624; SGLang
    parse_dflash_draft_config @ 00731f0b)."""
    dc, out = dflash_config(raw), []
    projector = dc.get("projector_type", raw.get("projector_type"))
    if projector == "domino":
        out.append("Domino (projector_type domino: a causal prefix GRU over the DFlash backbone)")
    elif projector not in (None, "dflash", "dspark", "lilicorr"):
        out.append(f"projector_type {projector!r}")
    if dc.get("conv_kernel_size") or dc.get("conv_group_size"):
        out.append("DFlash2 grouped convolutions (conv_kernel_size / conv_group_size)")
    if dc.get("selector_rank") or dc.get("selector_top_k"):
        out.append("the DFlash2 candidate selector (selector_rank / selector_top_k)")
    for marker, what in UNSUPPORTED_TENSORS:
        hits = sorted(n for n in names if marker in n or n.startswith(marker))
        if hits:
            out.append(f"{what} (tensors {', '.join(hits[:3])}{', ...' if len(hits) > 3 else ''})")
    return list(dict.fromkeys(out))


def speculators_flat(raw: dict) -> dict | None:
    """A speculators config's decoder config as speculators itself rebuilds it (transformer_layer_config
    is a Qwen3Config `to_diff_dict`, defaults restored by the same class: models/dflash/config.py @
    c05b95b3); None when the layer is not a Qwen3 layer."""
    from transformers import Qwen3Config

    layer = dict(raw.get("transformer_layer_config") or {})
    if layer.get("model_type", "qwen3") != "qwen3":
        return None
    return Qwen3Config(**layer).to_dict()


def speculators_attention(flat: dict, raw: dict, layers: int) -> tuple[list, list]:
    """speculators' own rule (models/dflash/config.py @ c05b95b3): full-attention layers are always
    non-causal within the block; sliding layers are causal unless sliding_window_non_causal."""
    types = flat.get("layer_types") or ["full_attention"] * layers
    non_causal = bool(raw.get("sliding_window_non_causal", False))
    causal = [t == "sliding_attention" and not non_causal for t in types]
    return causal, [flat.get("sliding_window") if t == "sliding_attention" else None for t in types]
