"""Block drafters (DFlash, DSpark, LiLiCorr) written in every published layout, with the published
config keys and tensor names, for a tiny target. Sources: see specpack/converters/block/*.py."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specpack.converters.block.common import CONFIDENCE, LAYER_WEIGHTS, MARKOV

LILICORR = {"candidate_topk": 2, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "mlp_ratio": 2.0,
            "factor_dim": 8, "vector_eps": 1e-6, "logit_scale": 10.0}
SEQUENTIAL = (("feature_norm.", "feature_mlp.0."), ("feature_mlp.up_proj.", "feature_mlp.1."),
              ("feature_mlp.down_proj.", "feature_mlp.3."), (".mlp.up_proj.", ".mlp.0."), (".mlp.down_proj.", ".mlp.2."))
MODELOPT = {MARKOV["vanilla"][0]: "markov_w1.weight", MARKOV["vanilla"][1]: "markov_w2.weight",
            MARKOV["gated"][0]: "gate_proj.weight", MARKOV["gated"][1]: "gate_proj.bias",
            MARKOV["rnn"][0]: "joint_proj.weight", MARKOV["rnn"][1]: "joint_proj.bias",
            CONFIDENCE[0]: "confidence_proj.weight", CONFIDENCE[1]: "confidence_proj.bias"}


@dataclass(frozen=True)
class Head:
    """What a test drafter is: geometry, bindings and heads (canonical meaning)."""

    block_size: int = 4
    layers: int = 2
    ids_out: tuple = (1, 4, 6)  # output of layer i (z-lab / DeepSpec); input of layer i is i + 1
    mask_token_id: int = 5
    markov: tuple | None = None  # (rank, type)
    confidence: bool = False  # with the Markov embedding when there is a Markov head
    lilicorr: dict | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def ids_in(self) -> list[int]:
        return [i + 1 for i in self.ids_out]


DFLASH = Head()
DSPARK = Head(markov=(8, "vanilla"), confidence=True)
LILI = Head(lilicorr=LILICORR)


def target_geometry(target_dir: Path) -> dict:
    """The sizes a block drafter of the target takes, as its family reads them (text_config, a hybrid
    pattern's layer count, MLA's head width); the drafter's FFN is the target's dense width, else an
    expert's."""
    from specpack.families import describe

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    text, a = cfg.get("text_config") or cfg, describe(cfg)
    theta = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return {"hidden": a.hidden_size, "heads": a.num_heads, "kv": a.num_kv_heads, "head_dim": a.head_dim,
            "inter": a.intermediate_size or a.experts.size, "vocab": a.vocab_size, "layers": a.num_layers,
            "theta": theta, "eps": text.get("rms_norm_eps", 1e-6), "config": cfg}


def target_tensor(target_dir: Path, name: str) -> torch.Tensor:
    with safe_open(Path(target_dir) / "model.safetensors", "pt") as f:
        return f.get_tensor(name)


def canonical_tensors(head: Head, target_dir: Path) -> dict:
    """Random canonical-named tensors of `head` for the target at `target_dir`."""
    g, t = torch.Generator().manual_seed(head.seed), target_geometry(target_dir)
    h, q, kv = t["hidden"], t["heads"] * t["head_dim"], t["kv"] * t["head_dim"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    shapes = dict(zip(LAYER_WEIGHTS, ((q, h), (kv, h), (kv, h), (h, q), (t["head_dim"],), (t["head_dim"],),
                                      (t["inter"], h), (t["inter"], h), (h, t["inter"]), (h,), (h,))))
    out = {"fc.weight": w(h, len(head.ids_out) * h), "hidden_norm.weight": 1 + w(h), "norm.weight": 1 + w(h)}
    for k in range(head.layers):
        out.update({f"layers.{k}.{n}": w(*s) for n, s in shapes.items()})
    if head.markov:
        r, kind = head.markov
        out.update({MARKOV["vanilla"][0]: w(t["vocab"], r), MARKOV["vanilla"][1]: w(t["vocab"], r)})
        if kind == "gated":
            out.update({MARKOV["gated"][0]: w(r, h + r), MARKOV["gated"][1]: w(r)})
        if kind == "rnn":
            out.update({MARKOV["rnn"][0]: w(3 * r, 2 * r + h), MARKOV["rnn"][1]: w(3 * r)})
    if head.confidence:
        width = h + (head.markov[0] if head.markov else 0)
        out.update({CONFIDENCE[0]: w(1, width), CONFIDENCE[1]: w(1)})
    if head.lilicorr:
        from specpack.converters.block import lilicorr

        out.update({n: w(*s) for n, s in lilicorr.shapes(head.lilicorr, h, head.block_size).items()})
    return out


def _qwen3_config(head: Head, t: dict) -> dict:
    return {"model_type": "qwen3", "hidden_size": t["hidden"], "num_hidden_layers": head.layers,
            "num_attention_heads": t["heads"], "num_key_value_heads": t["kv"], "head_dim": t["head_dim"],
            "intermediate_size": t["inter"], "hidden_act": "silu", "rms_norm_eps": t["eps"], "vocab_size": t["vocab"],
            "max_position_embeddings": 512, "rope_theta": t["theta"], "rope_scaling": None, "attention_bias": False,
            "tie_word_embeddings": False, "layer_types": ["full_attention"] * head.layers}


def _zlab_config(head: Head, t: dict, arch: str = "DFlashDraftModel") -> dict:
    return {**_qwen3_config(head, t), "architectures": [arch], "block_size": head.block_size,
            "dflash_config": {"mask_token_id": head.mask_token_id, "target_layer_ids": list(head.ids_out)},
            "num_target_layers": t["layers"]}


def _save(out: Path, config: dict, tensors: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out


def _copies(target_dir: Path) -> dict:
    """The target's embedding and lm_head, as DeepSpec and speculators ship them."""
    from specpack.families import describe

    a = describe(json.loads((Path(target_dir) / "config.json").read_text()))  # the names its family gives them
    return {"embed_tokens.weight": target_tensor(target_dir, a.embed).clone(),
            "lm_head.weight": target_tensor(target_dir, a.lm_head or a.embed).clone()}


def write_zlab(out, head, tensors, target_dir):
    t = target_geometry(target_dir)
    return _save(out, {**_zlab_config(head, t), "transformers_version": "4.57.1"}, tensors)


def write_modelopt_dflash(out, head, tensors, target_dir):
    t = target_geometry(target_dir)
    return _save(out, {**_zlab_config(head, t), "torch_dtype": "float32", "initializer_range": 0.02}, tensors)


def _speculators_config(head, t, kind: str) -> dict:
    layer = {k: v for k, v in _qwen3_config(head, t).items() if v is not None}
    return {"architectures": ["DFlashSpeculator" if kind == "dflash" else "DSparkSpeculator"],
            "speculators_model_type": kind, "speculators_version": "0.7.0", "transformer_layer_config": layer,
            "draft_vocab_size": t["vocab"], "block_size": head.block_size, "target_hidden_size": t["hidden"],
            "aux_hidden_state_layer_ids": head.ids_in, "mask_token_id": head.mask_token_id,
            "sliding_window_non_causal": False,
            "speculators_config": {"algorithm": kind, "proposal_methods": [], "default_proposal_method": "greedy",
                                   "verifier": {"name_or_path": "local", "architectures": [t["config"]["architectures"][0]]}}}


def write_speculators_dflash(out, head, tensors, target_dir):
    t = target_geometry(target_dir)
    config = {**_speculators_config(head, t, "dflash"), "sample_from_anchor": False}
    return _save(out, config, {**tensors, **_copies(target_dir)})


def _lilicorr_config(head, t):
    dc = {f"lilicorr_{k}": v for k, v in head.lilicorr.items()}
    config = _zlab_config(head, t, "LiLiCorrDraftModel")
    config["dflash_config"].update(dc, lilicorr_enabled=True, projector_type="lilicorr")
    return config


def write_lilicorr(out, head, tensors, target_dir):
    return _save(out, _lilicorr_config(head, target_geometry(target_dir)), tensors)


def sequential_names(tensors: dict) -> dict:
    def old(name):
        if not name.startswith("lilicorr."):
            return name
        for new, was in SEQUENTIAL:
            name = name.replace(new, was)
        return name
    return {old(k): v for k, v in tensors.items()}


def write_lilicorr_sequential(out, head, tensors, target_dir):
    return _save(out, _lilicorr_config(head, target_geometry(target_dir)), sequential_names(tensors))


def _deepspec_config(head, t) -> dict:
    config = copy.deepcopy(t["config"])  # DeepSpec's build_draft_config: a copy of the target config + fields
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=t["layers"], num_hidden_layers=head.layers,
                  block_size=head.block_size, tie_word_embeddings=False, layer_types=["full_attention"] * head.layers,
                  mask_token_id=head.mask_token_id, target_layer_ids=list(head.ids_out), num_anchors=512,
                  enable_confidence_head=head.confidence, markov_rank=head.markov[0] if head.markov else 0)
    if head.confidence:
        config["confidence_head_with_markov"] = bool(head.markov)
    if head.markov:
        config["markov_head_type"] = head.markov[1]
    return config


def write_deepspec(out, head, tensors, target_dir):
    return _save(out, _deepspec_config(head, target_geometry(target_dir)), {**tensors, **_copies(target_dir)})


def _dspark_fields(head) -> dict:
    return {"markov_rank": head.markov[0] if head.markov else 0,
            "markov_head_type": head.markov[1] if head.markov else "vanilla",
            "enable_confidence_head": head.confidence, "confidence_head_with_markov": bool(head.markov)}


def write_speculators_dspark(out, head, tensors, target_dir):
    t = target_geometry(target_dir)
    config = {**_speculators_config(head, t, "dspark"), "sample_from_anchor": True, **_dspark_fields(head)}
    return _save(out, config, {**tensors, **_copies(target_dir)})


def write_modelopt_dspark(out, head, tensors, target_dir):
    t = target_geometry(target_dir)
    config = _zlab_config(head, t)
    config["dflash_config"].update(projector_type="dspark", shift_label=True, markov_rank=head.markov[0],
                                   markov_head_type=head.markov[1], use_confidence_head=head.confidence)
    return _save(out, config, {MODELOPT.get(k, k): v for k, v in tensors.items()})


def write_specforge(out, head, tensors, target_dir):
    t = target_geometry(target_dir)
    config = {**_zlab_config(head, t, "DSparkDraftModel"), **_dspark_fields(head)}
    return _save(out, config, tensors)


def write_vllm_dspark(out, head, tensors, target_dir):
    t = target_geometry(target_dir)
    config = {**_zlab_config(head, t, "Qwen3DSparkModel"), **_dspark_fields(head), "sample_from_anchor": True,
              "dspark_bonus_anchor": False, "eagle_aux_hidden_state_layer_ids": head.ids_in}
    return _save(out, config, tensors)


def write_nemotron35(out, head, tensors, target_dir, arch="Qwen3DSparkModel"):
    """Nemotron 3.5's layout (unquantized): own embedding, no lm_head, both id conventions, fill-in."""
    t = target_geometry(target_dir)
    config = {**_zlab_config(head, t, arch), "has_embed_tokens": True, "has_lm_head": False,
              "eagle_aux_hidden_state_layer_ids": head.ids_in, "target_layer_ids": list(head.ids_out),
              "sample_from_anchor": False}
    config["dflash_config"]["sample_from_anchor"] = False
    if head.markov:
        config.update(_dspark_fields(head), dspark_markov_rank=head.markov[0], dspark_bonus_anchor=True)
    g = torch.Generator().manual_seed(head.seed + 7)
    own = torch.randn(t["vocab"], t["hidden"], generator=g) * 0.05
    return _save(out, config, {**tensors, "embed_tokens.weight": own})


WRITERS = {
    "zlab-dflash": (write_zlab, DFLASH), "modelopt-dflash": (write_modelopt_dflash, DFLASH),
    "speculators-dflash": (write_speculators_dflash, DFLASH),
    "lilicorr": (write_lilicorr, LILI), "lilicorr-sequential": (write_lilicorr_sequential, LILI),
    "deepspec-dspark": (write_deepspec, DSPARK), "deepseek-dflash": (write_deepspec, DFLASH),
    "speculators-dspark": (write_speculators_dspark, DSPARK), "modelopt-dspark": (write_modelopt_dspark, DSPARK),
    "specforge-dspark": (write_specforge, DSPARK), "vllm-dspark": (write_vllm_dspark, DSPARK),
    "nemotron35-dspark": (write_nemotron35, DSPARK),
    "nemotron35-dflash": (lambda o, h, t, d: write_nemotron35(o, h, t, d, "DFlashDraftModel"), DFLASH),
}
# layouts that hold the same drafter (same canonical head) when written from the same tensors
GROUPS = {"fill-in DFlash": ("zlab-dflash", "modelopt-dflash", "speculators-dflash"),
          "LiLiCorr": ("lilicorr", "lilicorr-sequential"),
          "anchor-first DSpark": ("deepspec-dspark", "speculators-dspark", "modelopt-dspark", "specforge-dspark",
                                  "vllm-dspark")}


def write(layout: str, out: Path, target_dir: Path, head: Head | None = None, **changes) -> Path:
    """The drafter `layout` holds (or `head`), written into `out` in that layout."""
    writer, default = WRITERS[layout]
    head = replace(head or default, **changes)
    return writer(Path(out), head, canonical_tensors(head, target_dir), target_dir)


def edit_config(path: Path, update: dict | None = None, drop: tuple = (), dflash: dict | None = None,
                drop_dflash: tuple = ()) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(update or {})
    for key in drop:
        config.pop(key, None)
    dc = config.setdefault("dflash_config", {}) if (dflash or drop_dflash) else config.get("dflash_config")
    if dc is not None:
        dc.update(dflash or {})
        for key in drop_dflash:
            dc.pop(key, None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def edit_tensors(path: Path, update: dict | None = None, drop: tuple = (), rename: dict | None = None) -> Path:
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    for key in drop:
        tensors.pop(key, None)
    tensors = {(rename or {}).get(k, k): v for k, v in tensors.items()}
    tensors.update(update or {})
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def bigram_dspark(out: Path, target_dir: Path, bigrams, layout: str = "deepspec-dspark", **changes) -> Path:
    """A DSpark head written in `layout` whose Markov correction proposes the given target bigrams
    (prev -> next): a one-hot markov_w1 and a strong markov_w2, so its drafts follow the target's
    own continuations and get accepted (the rest of the head is random)."""
    V = target_geometry(target_dir)["vocab"]
    writer, default = WRITERS[layout]
    head = replace(default, markov=(V, "vanilla"), **changes)
    tensors = canonical_tensors(head, target_dir)
    w2 = torch.zeros(V, V)
    for a, b in bigrams:
        w2[b, a] = 30.0
    tensors.update({MARKOV["vanilla"][0]: torch.eye(V), MARKOV["vanilla"][1]: w2})
    return writer(Path(out), head, tensors, target_dir)
