"""The canonical block drafter's config (docs/format.md): read, checked, and the tensors it implies.

One spec covers DFlash, DSpark and LiLiCorr. Every field that binds the head to its target is
required: a default here would be exactly the silent mis-binding the canonical form exists to
prevent. Pure Python (no torch), like models/config.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpack.errors import InputError, UnsupportedError
from specpack.families.dense import RopeScaling, rope_from_config
from specpack.families.base import size_problems

ALGORITHMS = ("dflash", "dspark", "lilicorr")
LAYOUTS = ("fill_in", "anchor_first")
SOURCES = ("target", "drafter")
ROPE_STYLES = ("neox", "interleaved")
MARKOV_TYPES = ("vanilla", "gated", "rnn")
SIZES = ("block_size", "draft_slots", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "target_hidden_size", "vocab_size", "target_vocab_size",
         "draft_vocab_size")
REQUIRED = ("algorithm", "query_layout", "rms_norm_eps", "target_layer_ids", "target_layer_convention",
            "mask_token_id", "mask_embedding", "embedding", "lm_head", "rope_theta", "rope_style", "layer_causal")
LILICORR_FIELDS = ("candidate_topk", "num_layers", "num_heads", "mlp_ratio", "factor_dim", "vector_eps",
                   "logit_scale")
HINT = "re-run `specpack build` (the converter writes every field of the canonical block drafter)"


@dataclass(frozen=True)
class MarkovSpec:
    rank: int
    type: str  # vanilla | gated | rnn (DeepSpec markov_head.py)


@dataclass(frozen=True)
class LiLiCorrSpec:
    candidate_topk: int
    hidden_size: int  # the correlator's width (the config's null / 0 resolved to the backbone's)
    num_layers: int
    num_heads: int
    mlp_ratio: float
    factor_dim: int
    vector_eps: float
    logit_scale: float

    @property
    def mlp_size(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


@dataclass(frozen=True)
class BlockSpec:
    algorithm: str  # dflash | dspark | lilicorr
    query_layout: str  # fill_in: [anchor, mask x N], slot q predicts q; anchor_first: [anchor, mask x N-1], q+1
    block_size: int
    draft_slots: int  # N
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool  # q, k, v and o_proj (z-lab / DeepSpec: o_proj bias=config.attention_bias)
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]  # input of target layer i (= hidden_states[i]), in fc's order
    vocab_size: int  # input vocab: embedding rows (target ids)
    target_vocab_size: int
    draft_vocab_size: int  # < target_vocab_size: d2t maps draft ids to target ids
    mask_token_id: int
    mask_embedding: bool  # a tensor `mask_embedding` [H] replaces embed(mask_token_id)
    embedding: str  # target | drafter
    lm_head: str  # target | drafter
    rope_theta: float
    rope_scaling: RopeScaling | None
    rope_style: str  # neox (half split) | interleaved (pairs)
    layer_causal: tuple[bool, ...]
    logit_scale: float | None
    markov: MarkovSpec | None
    confidence_with_markov: bool | None  # None: no confidence head
    lilicorr: LiLiCorrSpec | None

    # what dense.Block reads besides the sizes above
    qk_norm = True

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias

    @property
    def block_len(self) -> int:
        """Query rows per block: the anchor and its mask slots."""
        return self.draft_slots + (self.query_layout == "fill_in")

    @property
    def first_prediction(self) -> int:
        """The block row that predicts the first draft token."""
        return int(self.query_layout == "fill_in")

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def block_spec_from_config(cfg: dict) -> BlockSpec:
    """Read a canonical block drafter config.json dict. InputError lists every missing or bad field;
    UnsupportedError names what the torch runtime cannot run yet."""
    problems = size_problems(cfg, SIZES) + [f"{k}: missing" for k in REQUIRED if cfg.get(k) is None]
    if cfg.get("kind", "block") != "block":
        problems.append(f"kind is {cfg.get('kind')!r}, expected 'block'")
    for key, options in (("algorithm", ALGORITHMS), ("query_layout", LAYOUTS), ("embedding", SOURCES),
                         ("lm_head", SOURCES), ("rope_style", ROPE_STYLES)):
        if cfg.get(key) is not None and cfg[key] not in options:
            problems.append(f"{key} {cfg[key]!r} (expected one of {', '.join(options)})")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    theta, scaling, rope_problems = rope_from_config(cfg)
    problems += rope_problems + _binding_problems(cfg) + _head_problems(cfg)
    if problems:
        raise InputError("the block drafter config is not usable", problems=problems, hint=HINT)
    _refuse_unsupported(cfg)
    return _spec(cfg, theta, scaling)


def _binding_problems(cfg: dict) -> list[str]:
    """Layer ids, slots, vocabularies, mask token and per-layer lists (only where they were given)."""
    problems = []
    convention = cfg.get("target_layer_convention")
    if convention is not None and convention != "input_of_layer":
        problems.append(f"target_layer_convention {convention!r} (the canonical ids are 'input_of_layer')")
    ids = cfg.get("target_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(_int(i) and i >= 0 for i in ids)):
        problems.append(f"target_layer_ids {ids!r} (a non-empty list of layer indices)")
    B, N, layout = cfg.get("block_size"), cfg.get("draft_slots"), cfg.get("query_layout")
    if _int(B) and _int(N) and layout in LAYOUTS:
        most = B - 1 if layout == "fill_in" else B
        if not 1 <= N <= most:
            problems.append(f"draft_slots {N} with block_size {B} and query_layout {layout} (1..{most}: "
                            f"{'B - 1' if layout == 'fill_in' else 'B'} slots were trained)")
    V, Vt, Vd, mask = (cfg.get(k) for k in ("vocab_size", "target_vocab_size", "draft_vocab_size", "mask_token_id"))
    if _int(Vd) and _int(Vt) and Vd > Vt:
        problems.append(f"draft_vocab_size {Vd} exceeds target_vocab_size {Vt}")
    if mask is not None and (not _int(mask) or mask < 0 or (_int(V) and mask >= V)):
        problems.append(f"mask_token_id {mask!r} is not a token of the {V}-token input vocabulary")
    for key in ("mask_embedding", "attention_bias"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            problems.append(f"{key} {cfg[key]!r} (true or false)")
    n = cfg.get("num_layers")
    causal = cfg.get("layer_causal")
    if causal is not None and not (isinstance(causal, list) and all(isinstance(c, bool) for c in causal)
                                   and len(causal) == n):
        problems.append(f"layer_causal {causal!r} (one true/false per layer, {n} layers)")
    window = cfg.get("sliding_window")
    if window is not None and not (isinstance(window, list) and len(window) == n):
        problems.append(f"sliding_window {window!r} (null, or one null / window size per layer)")
    problems += [f"{k} {cfg[k]!r} (a number)" for k in ("rms_norm_eps", "logit_scale")
                 if cfg.get(k) is not None and not _number(cfg[k])]
    return problems


def _head_problems(cfg: dict) -> list[str]:
    """The Markov, confidence and LiLiCorr blocks against the algorithm and layout."""
    algorithm, markov, conf, lili = cfg.get("algorithm"), cfg.get("markov"), cfg.get("confidence"), cfg.get("lilicorr")
    problems = []
    if algorithm != "dspark":
        problems += [f"{name} head given for algorithm {algorithm!r} (only dspark has one)"
                     for name, block in (("markov", markov), ("confidence", conf)) if block is not None]
    if markov is not None and not (isinstance(markov, dict) and _int(markov.get("rank"))
                                   and markov.get("type") in MARKOV_TYPES):
        problems.append(f"markov {markov!r} (expected {{rank: positive int, type: {' | '.join(MARKOV_TYPES)}}})")
    if conf is not None and not (isinstance(conf, dict) and isinstance(conf.get("with_markov"), bool)):
        problems.append(f"confidence {conf!r} (expected {{with_markov: true | false}})")
    elif conf is not None and conf["with_markov"] and markov is None:
        problems.append("confidence.with_markov is true but there is no markov head")
    if (algorithm == "lilicorr") != (lili is not None):
        problems.append("lilicorr: required for algorithm lilicorr, and only for it")
    if algorithm == "lilicorr":
        problems += _lilicorr_problems(cfg, lili)
    return problems


def _lilicorr_problems(cfg: dict, lili) -> list[str]:
    if lili is None:
        return []
    if not isinstance(lili, dict):
        return [f"lilicorr {lili!r} (expected an object)"]
    problems = [f"lilicorr.{k}: missing" for k in LILICORR_FIELDS if lili.get(k) is None]
    problems += [f"lilicorr.{k} = {lili[k]!r}: not a positive integer" for k in
                 ("candidate_topk", "num_layers", "num_heads", "factor_dim") if lili.get(k) is not None
                 and not (_int(lili[k]) and lili[k] > 0)]
    problems += [f"lilicorr.{k} = {lili[k]!r}: not a number" for k in ("mlp_ratio", "vector_eps", "logit_scale")
                 if lili.get(k) is not None and not _number(lili[k])]
    if _int(lili.get("candidate_topk")) and _int(cfg.get("target_vocab_size")) \
            and lili["candidate_topk"] > cfg["target_vocab_size"]:
        problems.append(f"lilicorr.candidate_topk {lili['candidate_topk']} exceeds the vocabulary")
    width = lili.get("hidden_size") or cfg.get("hidden_size")
    if _int(width) and _int(lili.get("num_heads")) and width % lili["num_heads"]:
        problems.append(f"lilicorr.num_heads {lili['num_heads']} does not divide its width {width}")
    if cfg.get("query_layout") != "fill_in":
        problems.append("lilicorr needs query_layout fill_in (its slots predict their own positions)")
    if cfg.get("draft_vocab_size") != cfg.get("target_vocab_size"):
        problems.append("lilicorr candidates need the full target vocabulary (no reduced draft vocab)")
    return problems


def _refuse_unsupported(cfg: dict) -> None:
    unsupported = []
    if any(w is not None for w in cfg.get("sliding_window") or []):
        unsupported.append(f"sliding_window {cfg['sliding_window']} (sliding-window draft layers)")
    if cfg.get("conv") is not None:
        unsupported.append("conv (DFlash2 grouped convolutions)")
    if unsupported:
        raise UnsupportedError("the torch runtime cannot run this block drafter yet", problems=unsupported,
                               hint="serve it with an engine that supports it (specpack export), or use "
                                    "another drafter")


def _spec(cfg: dict, theta: float, scaling: RopeScaling | None) -> BlockSpec:
    markov, conf, lili = cfg.get("markov"), cfg.get("confidence"), cfg.get("lilicorr")
    return BlockSpec(
        algorithm=cfg["algorithm"], query_layout=cfg["query_layout"], block_size=cfg["block_size"],
        draft_slots=cfg["draft_slots"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], rms_norm_eps=float(cfg["rms_norm_eps"]),
        attention_bias=bool(cfg.get("attention_bias", False)), target_hidden_size=cfg["target_hidden_size"],
        target_layer_ids=tuple(cfg["target_layer_ids"]), vocab_size=cfg["vocab_size"],
        target_vocab_size=cfg["target_vocab_size"], draft_vocab_size=cfg["draft_vocab_size"],
        mask_token_id=cfg["mask_token_id"], mask_embedding=cfg["mask_embedding"], embedding=cfg["embedding"],
        lm_head=cfg["lm_head"], rope_theta=theta, rope_scaling=scaling, rope_style=cfg["rope_style"],
        layer_causal=tuple(cfg["layer_causal"]),
        logit_scale=None if cfg.get("logit_scale") is None else float(cfg["logit_scale"]),
        markov=None if markov is None else MarkovSpec(markov["rank"], markov["type"]),
        confidence_with_markov=None if conf is None else conf["with_markov"],
        lilicorr=None if lili is None else LiLiCorrSpec(
            candidate_topk=lili["candidate_topk"], hidden_size=lili.get("hidden_size") or cfg["hidden_size"],
            num_layers=lili["num_layers"], num_heads=lili["num_heads"], mlp_ratio=float(lili["mlp_ratio"]),
            factor_dim=lili["factor_dim"], vector_eps=float(lili["vector_eps"]),
            logit_scale=float(lili["logit_scale"])))


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- the tensors a spec implies --------------------------------------------------------------

def block_tensor_shapes(s: BlockSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the canonical model.safetensors for `s` (docs/format.md)."""
    H, V, Vd = s.hidden_size, s.vocab_size, s.draft_vocab_size
    shapes = {"fc.weight": (H, len(s.target_layer_ids) * s.target_hidden_size), "hidden_norm.weight": (H,),
              "norm.weight": (H,)}
    for i in range(s.num_layers):
        shapes.update(_layer_shapes(s, f"layers.{i}."))
    optional = {"embed_tokens.weight": ((V, H), s.embedding == "drafter"),
                "lm_head.weight": ((Vd, H), s.lm_head == "drafter"),
                "d2t": ((Vd,), Vd < s.target_vocab_size), "mask_embedding": ((H,), s.mask_embedding)}
    shapes.update({name: shape for name, (shape, present) in optional.items() if present})
    return {**shapes, **_markov_shapes(s), **_confidence_shapes(s), **lilicorr_shapes(s)}


def _layer_shapes(s: BlockSpec, p: str) -> dict[str, tuple[int, ...]]:
    H, q, kv, I = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    a = p + "self_attn."
    shapes = {a + "q_proj.weight": (q, H), a + "k_proj.weight": (kv, H), a + "v_proj.weight": (kv, H),
              a + "o_proj.weight": (H, q), a + "q_norm.weight": (s.head_dim,), a + "k_norm.weight": (s.head_dim,),
              p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
              p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    if s.attention_bias:
        shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                       a + "o_proj.bias": (H,)})
    return shapes


def _markov_shapes(s: BlockSpec) -> dict[str, tuple[int, ...]]:
    """DeepSpec names. markov_w1 embeds the previous token (target ids, input vocab); markov_w2
    projects to the draft vocab (vLLM qwen3_dspark.py @ 0302ff40: DSparkMarkovHead)."""
    if s.markov is None:
        return {}
    r, H, p = s.markov.rank, s.hidden_size, "markov_head."
    shapes = {p + "markov_w1.weight": (s.vocab_size, r), p + "markov_w2.weight": (s.draft_vocab_size, r)}
    if s.markov.type == "gated":
        shapes.update({p + "gate_proj.weight": (r, H + r), p + "gate_proj.bias": (r,)})
    elif s.markov.type == "rnn":
        shapes.update({p + "joint_proj.weight": (3 * r, 2 * r + H), p + "joint_proj.bias": (3 * r,)})
    return shapes


def _confidence_shapes(s: BlockSpec) -> dict[str, tuple[int, ...]]:
    if s.confidence_with_markov is None:
        return {}
    width = s.hidden_size + (s.markov.rank if s.confidence_with_markov else 0)
    return {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}


def lilicorr_shapes(s: BlockSpec) -> dict[str, tuple[int, ...]]:
    """vLLM lilicorr.py @ 08f95fe5 (LiLiCorrHead) names and shapes; every linear has a bias
    (vLLM ReplicatedLinear / SGLang ReplicatedLinear and nn.Linear defaults)."""
    c = s.lilicorr
    if c is None:
        return {}
    H, h, k, F, B, nh, m = s.hidden_size, c.hidden_size, c.candidate_topk, c.factor_dim, s.block_size, c.num_heads, \
        c.mlp_size
    linears = {"pass_hidden_proj": (h, H), "context_proj": (h, H), "feature_mlp.up_proj": (h, 5),
               "feature_mlp.down_proj": (h, h), "factor_input_proj": (h, 3 * h), "out_head": (F, h),
               "in_head": (F, h), "anchor_out_head": (F, h)}
    if h != H:
        linears["token_proj"] = (h, H)
    for i in range(c.num_layers):
        linears.update({f"layers.{i}.attn.out_proj": (h, h), f"layers.{i}.mlp.up_proj": (m, h),
                        f"layers.{i}.mlp.down_proj": (h, m)})
    shapes = {}
    for name, (out, inp) in linears.items():
        shapes.update({f"{name}.weight": (out, inp), f"{name}.bias": (out,)})
    shapes.update({"feature_norm.weight": (5,), "feature_norm.bias": (5,), "slot_embedding": (1, 1, B - 1, 1, h),
                   "rank_embedding": (1, 1, 1, k, h), "relative_slot_bias": (nh, 2 * B - 1), "same_slot_bias": (nh,),
                   "output_norm.weight": (h,), "anchor_norm.weight": (h,)})
    for i in range(c.num_layers):
        shapes.update({f"layers.{i}.attn_norm.weight": (h,), f"layers.{i}.mlp_norm.weight": (h,),
                       f"layers.{i}.attn.in_proj_weight": (3 * h, h), f"layers.{i}.attn.in_proj_bias": (3 * h,)})
    return {"lilicorr." + name: shape for name, shape in shapes.items()}
