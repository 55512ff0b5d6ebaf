"""MiniMax-M3.1's published `dspark/` draft (layout C in docs/families.md, `DSparkMiniMaxDraftModel`):
read with its nested keys, prefix and MXFP8 scales, checked tensor by tensor, bound to the target's
embedding and lm_head, and carried byte for byte (once: build.py takes its folder out of the target).

    detect(path)            -> LAYOUT or None
    convert(path, target)   -> ConvertedDrafter

Sources: the public schema validator of the released checkpoint (minimax_m31_dspark_checkpoint.py
`validate_schema`, schema `minimax_m31_dspark_preview2`): architectures ["DSparkMiniMaxDraftModel"],
the DSpark keys in `text_config`, five sliding-attention layers, moe_layer_freq all 0, no sparse
attention, no hybrid context fusion, use_gemma_norm, a vanilla Markov head, a confidence head with
the Markov embedding, quant_method mxfp8 [1, 32]; tensors under `language_model.model.dspark.`: `fc`
[H, H x len(ids)], `hidden_norm`, `final_norm`, `markov_head.markov_w1/w2` [V, rank],
`confidence_head.proj` weight [1, H + rank] and bias [1], per layer `layers.{i}.decoder_layer.`
{input_layernorm, post_attention_layernorm, self_attn.{q_norm, k_norm}} and the q/k/v/o, gate/up/down
projections (F8_E4M3 + `weight_scale_inv` U8 [rows, cols / 32]); `language_model.model.embed_tokens`
and `language_model.lm_head` required from the target. The SGLang port (minimax_m3_dspark.py) builds
the layers as MiniMax-M3 decoder layers (gemma norms, per-head q/k norm, partial rotary, swigluoai),
captures the target's post-layer outputs (the last layer's included) and maps the same names.
Query causality within the block: the two ports disagree; the rtp-llm port states its source ("Training
demo MiniMaxDSparkAttention is ENCODER_ONLY: query tokens can attend later query tokens"), so the
block is non-causal unless the config itself says otherwise.
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters.base import ConvertedDrafter
from specpack.converters.release_dspark.common import entry, markers
from specpack.converters.release_files import LocalFiles
from specpack.converters.target_hf import Target, headers_of, read_json
from specpack.errors import InputError, UnsupportedError
from specpack.families import quant
from specpack.families.base import Tensor, linear, vector
from specpack.families.fields import check_config
from specpack.schemas import Source

ARCHITECTURE = "DSparkMiniMaxDraftModel"
LAYOUT = "minimax-m31-dspark"
PREFIX = "language_model.model.dspark."
VALIDATOR = "minimax_m31_dspark_checkpoint.py validate_schema"
CAUSALITY = ("the rtp-llm MiniMax-M3.1 DSpark port: 'Training demo MiniMaxDSparkAttention is ENCODER_ONLY: query "
             "tokens can attend later query tokens within the SWA' (an SGLang port uses a causal block, unsourced)")
SIZES = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "dspark_markov_rank", "sliding_window")
# what the released schema fixes, and what a drafter of another shape would mean
STRUCTURE = {"dspark_markov_head_type": ("vanilla", "the SGLang port builds the vanilla Markov head only"),
             "dspark_hybrid_context_fusion": (False, "hybrid context fusion is not in any public loader"),
             "sparse_attention_config": (None, "the draft layers are dense attention"),
             "dspark_use_dense_ffn": (True, "the draft layers have dense MLPs")}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def detect(path: Path) -> str | None:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return None
    config = read_json(config_path, "drafter config")
    return LAYOUT if config.get("architectures") == [ARCHITECTURE] else None


def check(folder, target: Target) -> tuple:
    """The `dspark/` draft a release reader holds (release_files: a directory, or the folder of a hub release
    read by range requests) checked against `target` from its config and headers; one InputError lists
    every problem. (text config, files, tensors found, expected, scheme, counts, bindings)."""
    where = folder.label()
    if target.checked is None or target.checked.arch.family != "minimax_m3":
        family = target.checked.arch.family if target.checked else target.info.architecture
        raise UnsupportedError(f"'{where}' is MiniMax-M3.1's DSpark draft ({ARCHITECTURE}); this target is {family}",
                               hint="bind it to its MiniMax-M3.1 release")
    config = folder.json("config.json", "drafter config")
    text = _text(config, Path(where))
    files, tensors = headers_of(folder)
    found = {n: meta for n, (_, meta) in tensors.items()}
    q = _scheme(config, Path(where))
    bind, bad = _bindings(text, target)
    expected, counts = {}, {}
    if "rank" in bind:  # the sizes are there: check every tensor too, whatever else is wrong
        expected = _expected(text, target, bind)
        tensor_bad, counts = quant.check_all(expected, found, q)
        bad += tensor_bad + _unclaimed(expected, found, q)
    if bad:
        raise InputError(f"'{where}' ({ARCHITECTURE}) cannot be bound to target '{target.files_reader.label()}' "
                         f"({len(bad)} problems)", problems=bad,
                         hint="the dspark/ folder and the target must come from the same MiniMax-M3.1 release")
    return text, files, found, expected, q, counts, bind


def convert(path: Path, target: Target) -> ConvertedDrafter:
    """The `dspark/` draft at `path` checked against `target` (`check`), as a drafter."""
    path = Path(path)
    text, files, found, expected, q, counts, bind = check(LocalFiles(path), target)
    inside = _inside(path, target.root)
    drafter, extra = entry(
        target, found, expected, q, counts, bind, source_layout=LAYOUT,
        source=target.info.source if inside else Source.local(path.resolve()), location="drafter",
        files=files, decoder=_decoder(text), layers=text["num_hidden_layers"],
        layers_from="dspark/config.json text_config.num_hidden_layers", layer_kind="sliding+dense",
        sliding_window=text["sliding_window"], query_causal=bind["query_causal"])
    return ConvertedDrafter(entry=drafter, files={f: path / f for f in files}, extra_weight_bytes=extra)


def _inside(path: Path, root: Path) -> bool:
    """The folder is the release's own (it resolves inside the target's directory)."""
    try:
        path.resolve().relative_to(Path(root).resolve())
    except ValueError:
        return False
    return True


def _text(config: dict, path: Path) -> dict:
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise InputError(f"{path / 'config.json'}: {ARCHITECTURE} keeps its DSpark keys in text_config, which is "
                         f"{'missing' if text is None else 'not a JSON object'}", hint=f"see {VALIDATOR}")
    try:
        check_config(config)
    except InputError as exc:
        raise InputError(f"{path / 'config.json'}: {exc.message}", problems=exc.problems, hint=exc.hint) from None
    return text


def _scheme(config: dict, path: Path):
    try:
        return quant.scheme(config, None)
    except (InputError, UnsupportedError) as exc:
        raise InputError(f"{path / 'config.json'}: {exc.message}", problems=exc.problems, hint=exc.hint) from None


def _bindings(text: dict, target: Target) -> tuple[dict, list[str]]:
    """Every key the drafter is read for, checked against the released schema and the target."""
    bind, bad = markers(text, target, "dspark/config.json text_config", f"the {ARCHITECTURE} loaders")
    t = target.info
    missing = [f"dspark/config.json text_config.{k} is missing or not a positive integer" for k in SIZES
               if not (isinstance(text.get(k), int) and not isinstance(text.get(k), bool) and text[k] > 0)]
    if missing:
        return bind, bad + missing
    bad += [f"text_config.{k} = {text[k]} but the target's is {v}" for k, v in
            (("hidden_size", t.hidden_size), ("vocab_size", t.vocab_size)) if text[k] != v]
    bad += [f"text_config.{k} = {text.get(k)!r}: {why} ({VALIDATOR} expects {want!r})"
            for k, (want, why) in STRUCTURE.items() if text.get(k, want) != want]
    fusion = text.get("dspark_config") if isinstance(text.get("dspark_config"), dict) else {}
    if fusion.get("hybrid_context_fusion", False) is not False:
        bad.append("text_config.dspark_config.hybrid_context_fusion is not false: not in any public loader")
    bad += _layer_problems(text)
    if text.get("enable_confidence_head") is not True and text.get("confidence_head_with_markov"):
        bad.append("confidence_head_with_markov without enable_confidence_head")
    causal = text.get("is_causal", fusion.get("causal"))
    bind.update(rank=text["dspark_markov_rank"], confidence=text.get("enable_confidence_head") is True,
                confidence_with_markov=bool(text.get("confidence_head_with_markov")),
                query_causal=bool(causal) if isinstance(causal, bool) else False)
    bind["resolved_from"].update(
        markov_rank="dspark/config.json text_config.dspark_markov_rank",
        query_causal="dspark/config.json text_config.is_causal" if isinstance(causal, bool) else CAUSALITY,
        target_layer_convention="output of layer i: the SGLang port captures the target's post-layer outputs, the "
                                "last layer's included")
    return bind, bad


def _layer_problems(text: dict) -> list[str]:
    n, bad = text["num_hidden_layers"], []
    types, moe = text.get("layer_types"), text.get("moe_layer_freq")
    if types != ["sliding_attention"] * n:
        bad.append(f"text_config.layer_types = {str(types)[:80]}: the draft's {n} layers are sliding_attention "
                   f"({VALIDATOR})")
    if moe is not None and moe != [0] * n:
        bad.append(f"text_config.moe_layer_freq = {str(moe)[:80]}: the draft's layers are dense (all 0)")
    ffn = text.get("dspark_ffn_hidden_size", text.get("dense_intermediate_size"))
    if not (isinstance(ffn, int) and ffn > 0):
        bad.append("text_config states no dspark_ffn_hidden_size (nor dense_intermediate_size)")
    elif text.get("dense_intermediate_size", ffn) != ffn:
        bad.append(f"text_config.dspark_ffn_hidden_size {ffn} != dense_intermediate_size "
                   f"{text['dense_intermediate_size']}")
    return bad


def _expected(text: dict, target: Target, bind: dict) -> dict[str, Tensor]:
    """Every tensor of the released schema, at this drafter's sizes."""
    H, V, r = text["hidden_size"], text["vocab_size"], bind["rank"]
    q, kv = text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]
    ffn = text.get("dspark_ffn_hidden_size", text.get("dense_intermediate_size"))
    p = PREFIX
    # fc stays BF16 in the release (the validator; rtp-llm loads it with disable_quantization)
    out = {p + "fc.weight": Tensor((H, H * len(bind["ids"]))), p + "hidden_norm.weight": vector(H),
           p + "final_norm.weight": vector(H), p + "markov_head.markov_w1.weight": Tensor((V, r)),
           p + "markov_head.markov_w2.weight": Tensor((V, r))}
    if bind["confidence"]:
        width = H + (r if bind["confidence_with_markov"] else 0)
        out.update({p + "confidence_head.proj.weight": Tensor((1, width)), p + "confidence_head.proj.bias": vector(1)})
    shapes = dict(zip(PROJECTIONS, ((q, H), (kv, H), (kv, H), (H, q), (ffn, H), (ffn, H), (H, ffn))))
    for i in range(text["num_hidden_layers"]):
        root = f"{p}layers.{i}.decoder_layer."
        out.update({root + n + ".weight": vector(H) for n in ("input_layernorm", "post_attention_layernorm")})
        out.update({root + f"self_attn.{n}.weight": vector(text["head_dim"]) for n in ("q_norm", "k_norm")})
        out.update({root + n + ".weight": linear(*shape) for n, shape in shapes.items()})
    return out


def _unclaimed(expected: dict, found: dict, q) -> list[str]:
    """Tensors the released schema does not have (its validator refuses them; engines would skip them)."""
    claimed = {n for name, t in expected.items() for n in quant.stored_names(name, t, q)}
    return [f"tensor {n} is not part of the {ARCHITECTURE} schema" for n in sorted(found) if n not in claimed][:20]


def _decoder(text: dict) -> str:
    norm = "Gemma RMSNorm (weight + 1)" if text.get("use_gemma_norm") else "RMSNorm"
    rotary = f"RoPE on {text['rotary_dim']} of {text['head_dim']} dims" if text.get("rotary_dim") else "RoPE"
    return (f"MiniMax-M3 dense decoder layers: {norm}, per-head q/k norm, {rotary}, "
            f"{text.get('hidden_act', 'swigluoai')} MLP")
