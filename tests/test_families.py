"""This year's release families (issue 44): every family's tiny checkpoint, as transformers saves it
and as releases publish it (MTP modules, multimodal prefixes, FP8 / NVFP4 / MXFP4 forms), builds with
every tensor checked; the manifest, `inspect` and the card state layer kinds, experts, KV and state
bytes, MTP and quantization; every mis-shapen, missing or mis-quantized tensor is refused with the
rest, nothing half-written; `run` refuses what specpack's runtime does not decode, naming the engine
that serves it."""

import json
import shutil

import pytest

import family_fixtures as ff
from specpack.errors import UnsupportedError
from specpack.packager import BuildOptions, build

# family -> (families/ module, layer kinds, routed experts)
EXPECTED = {
    "deepseek_v3": ("deepseek", ["mla+dense"] + ["mla+moe"] * 2, 4),
    "deepseek_v32": ("deepseek", ["mla_sparse+dense"] + ["mla_sparse+moe"] * 2, 4),
    "deepseek_v4": ("deepseek_v4", ["sliding+hash_moe", "csa+moe", "hca+moe", "csa+moe"], 4),
    "glm_moe_dsa": ("deepseek", ["mla_sparse+dense"] + ["mla_sparse+moe"] * 2, 4),
    "glm4_moe": ("glm4_moe", ["full+dense"] + ["full+moe"] * 2, 4),
    "qwen3_moe": ("qwen3_moe", ["full+dense"] + ["full+moe"] * 2, 4),
    "qwen3_next": ("qwen3_next", ["linear+moe"] * 3 + ["full+moe"], 4),
    "qwen3_5": ("qwen3_next", ["linear+dense"] * 3 + ["full+dense"], 0),
    "qwen3_5_moe": ("qwen3_next", ["linear+moe"] * 3 + ["full+moe"], 4),
    "minimax_m2": ("minimax_m2", ["full+moe"] * 3, 4),
    "minimax_m3_vl": ("minimax_m3", ["full+dense", "block_sparse+moe", "full+moe", "block_sparse+moe"], 4),
    "gpt_oss": ("gpt_oss", ["sliding+moe", "full+moe", "sliding+moe"], 4),
    "nemotron_h": ("nemotron_h", ["mamba+none", "full+none", "none+dense", "none+moe"], 4),
    "llama4": ("llama4", ["chunked+dense", "chunked+moe", "chunked+dense", "full+moe"], 4),
    "gemma3": ("gemma3", ["sliding+dense"] * 5 + ["full+dense", "sliding+dense"], 0),
    "mistral3": ("dense", ["full+dense"] * 3, 0),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> its tiny checkpoint as transformers saves it (made once, copied by each test)."""
    root = tmp_path_factory.mktemp("families")
    return {f: ff.make(f, root / f) for f in ff.FAMILIES}


def _copy(made, family, tmp_path, name="t"):
    return shutil.copytree(made[family], tmp_path / name)


def _build(target, out, **kw):
    return build(BuildOptions(target=target, drafter=kw.pop("drafter", "ngram"), out=out, **kw)).manifest


@pytest.mark.parametrize("family", ff.FAMILIES)
def test_every_family_builds_with_every_tensor_checked(made, family, tmp_path, cli):
    module, kinds, routed = EXPECTED[family]
    out = tmp_path / "art"
    arch = _build(_copy(made, family, tmp_path), out).target.arch
    assert (arch.family, arch.layer_kinds) == (module, kinds)
    assert (arch.experts.routed if arch.experts else 0) == routed
    if routed:
        assert arch.active_parameters < arch.total_parameters
    assert arch.quantization is None and arch.kv_bytes_per_token > 0
    assert cli("verify", out)[0] == 0
    assert cli("export", out, "--to", "vllm", "-o", tmp_path / "v")[0] == 0
    code, shown, _ = cli("inspect", out)
    assert code == 0 and module in shown and f"{kinds.count(kinds[-1])}× {kinds[-1]}" in shown, shown


def test_kv_bytes_count_attention_layers_only_and_state_is_per_sequence(made, tmp_path):
    """Qwen3-Next: 1 full-attention layer of 4 caches K and V (2 x 2 heads x 16, fp32 here), the
    3 Gated DeltaNet layers hold conv (K-1 inputs of 2*16+32 channels) and SSM (4 x 8 x 8) state."""
    a = _build(_copy(made, "qwen3_next", tmp_path), tmp_path / "art").target.arch
    assert a.kv_bytes_per_token == 1 * 2 * 2 * 16 * 4
    assert a.state_bytes_per_sequence == 3 * ((2 * 2 * 8 + 4 * 8) * 3 * 4 + 4 * 8 * 8 * 4)
    nemo = _build(_copy(made, "nemotron_h", tmp_path, "n"), tmp_path / "n-art").target.arch
    assert nemo.kv_bytes_per_token == 1 * 2 * 2 * 16 * 4  # one attention layer ("*") of four


def test_draft_len_start_is_per_family(made, tmp_path):
    """D = 128 / G - 1: GQA groups 4 / 2 = 2 -> 63; MLA (every head reads one latent) 4 -> 31."""
    assert _build(_copy(made, "qwen3_moe", tmp_path), tmp_path / "q").target.arch.draft_len_start == 63
    assert _build(_copy(made, "deepseek_v3", tmp_path, "d"), tmp_path / "d-art").target.arch.draft_len_start == 31


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "gpt_oss", "llama4", "glm4_moe"])
def test_a_missing_and_a_misshapen_tensor_are_refused_together(made, family, tmp_path, cli):
    from safetensors.torch import load_file

    t = _copy(made, family, tmp_path)
    tensors = load_file(str(t / "model.safetensors"))
    layer = sorted(k for k in tensors if ".layers.1." in k and tensors[k].dim() == 2)
    drop, bad = layer[0], layer[-1]
    ff.edit(t, drop=[drop], add={bad: tensors[bad][:, :-1].clone()})
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    code, _, err = cli("build", t, "--drafter", "ngram", "-o", out)
    assert code == 2 and f"missing tensor {drop}" in err and f"tensor {bad} has shape" in err, err
    assert not any(out.parent.iterdir())


def test_published_multimodal_prefixes_and_v5_resaves_both_build(made, tmp_path):
    """Mistral 3 as published (`language_model.model.`) and as transformers v5 re-saves it
    (`model.language_model.`, a top-level lm_head); the vision tower is carried untouched."""
    t = _copy(made, "mistral3", tmp_path)
    ff.edit(t, rename={"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head."})
    m = _build(t, tmp_path / "art")
    assert m.target.arch.tensor_prefix == "model.language_model." and m.target.arch.text_config
    assert (tmp_path / "art" / "model.safetensors").read_bytes() == (t / "model.safetensors").read_bytes()


# ---- quantized checkpoints ------------------------------------------------------------------------

SCHEMES = {  # fixture -> (family, manifest scheme)
    "fp8_block": ("deepseek_v3", "fp8-block"),
    "fp8_per_tensor": ("qwen3_next", "fp8"),
    "ct_int4": ("deepseek_v3", "ct-int4"),
    "modelopt_fp8": ("llama4", "modelopt-fp8"),
    "ct_fp8_channel": ("glm4_moe", "ct-fp8"),
    "ct_nvfp4": ("qwen3_moe", "ct-nvfp4"),
    "modelopt_nvfp4": ("nemotron_h", "modelopt-nvfp4"),
    "modelopt_mixed": ("nemotron_h", "modelopt-mixed"),
    "mxfp4": ("gpt_oss", "mxfp4"),
}


@pytest.mark.parametrize("form", SCHEMES)
def test_quantized_checkpoints_are_checked_per_scheme(made, form, tmp_path):
    family, scheme = SCHEMES[form]
    t = getattr(ff, form)(_copy(made, family, tmp_path))
    m = _build(t, tmp_path / "art")
    q = m.target.arch.quantization
    assert q.scheme == scheme and q.quantized_linear > 0
    assert not m.target.arch.runs  # specpack decodes unquantized checkpoints
    assert m.memory.target_weight_bytes == sum((t / f).stat().st_size for f in ["model.safetensors"]) - \
        _header_bytes(t / "model.safetensors")


def _header_bytes(path) -> int:
    import struct

    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_modelopt_mixed_precision_holds_each_module_to_the_format_quantized_layers_states(made, tmp_path, cli):
    """MIXED_PRECISION: a listed module stored in the other format, a listed module left bf16, an unlisted
    module stored quantized, a format specpack cannot check, and no quantized_layers at all: each
    refused, naming the tensor or the module."""
    import torch
    from safetensors.torch import load_file

    t = ff.modelopt_mixed(_copy(made, "nemotron_h", tmp_path))
    q = _build(t, tmp_path / "art").target.arch.quantization
    assert (q.scheme, q.kv_cache) == ("modelopt-mixed", "fp8") and q.quantized_linear == 8 + 2 + 4
    good = load_file(str(t / "model.safetensors"))
    cfg = json.loads((t / "config.json").read_text())
    layers = cfg["quantization_config"]["quantized_layers"]
    attn, expert = "backbone.layers.1.mixer.q_proj", "backbone.layers.3.mixer.experts.0.up_proj"

    def refused(name, tensors=None, quantized_layers=None, *expected):
        case = shutil.copytree(t, tmp_path / name)
        if tensors is not None:
            ff.edit(case, add=tensors)
        if quantized_layers is not None:
            c = json.loads((case / "config.json").read_text())
            c["quantization_config"]["quantized_layers"] = quantized_layers
            (case / "config.json").write_text(json.dumps(c))
        out = tmp_path / f"{name}-out" / "art"
        out.parent.mkdir()
        code, _, err = cli("build", case, "--drafter", "ngram", "-o", out)
        assert code == 2 and all(e in err for e in expected), err
        assert not any(out.parent.iterdir())

    # the attention projection listed FP8 but holding an NVFP4 payload
    refused("swapped", {attn + ".weight": torch.zeros(64, 32, dtype=torch.uint8)}, None, f"tensor {attn}.weight is U8")
    # an expert listed W4A16_NVFP4 but its packed weight replaced by bf16 (the scales still beside it)
    refused("plain", {expert + ".weight": torch.zeros(24, 64, dtype=torch.bfloat16)}, None, f"{expert}.weight")
    # the Mamba in_proj is not listed, yet stored FP8
    mamba = "backbone.layers.0.mixer.in_proj.weight"
    refused("unlisted", {mamba: good[mamba].to(torch.float8_e4m3fn)}, None, mamba, "not in quantized_layers")
    refused("unknown-algo", None, {**layers, attn: {"quant_algo": "INT8_SQ"}}, "INT8_SQ", attn)
    refused("no-layers", None, {}, "states no quantized_layers")


def test_modelopt_states_its_scheme_in_hf_quant_config_too(made, tmp_path):
    t = ff.modelopt_nvfp4(_copy(made, "nemotron_h", tmp_path), hf_quant_file=True)
    q = _build(t, tmp_path / "art").target.arch.quantization
    assert (q.scheme, q.kv_cache) == ("modelopt-nvfp4", "fp8")


@pytest.mark.parametrize("form, family, tensor_suffix, change", [
    ("fp8_block", "deepseek_v3", "o_proj.weight_scale_inv", "shape"),
    ("fp8_block", "deepseek_v3", "kv_b_proj.weight_scale_inv", "drop"),
    ("ct_nvfp4", "qwen3_moe", "o_proj.weight_scale", "shape"),
    ("mxfp4", "gpt_oss", "down_proj_scales", "shape"),
    ("modelopt_nvfp4", "nemotron_h", "up_proj.weight_scale", "dtype"),
])
def test_a_scale_that_does_not_match_its_weight_is_refused(made, form, family, tensor_suffix, change, tmp_path, cli):
    import torch
    from safetensors.torch import load_file

    t = getattr(ff, form)(_copy(made, family, tmp_path))
    tensors = load_file(str(t / "model.safetensors"))
    name = sorted(k for k in tensors if k.endswith(tensor_suffix))[-1]
    v = tensors[name]
    if change == "drop":
        ff.edit(t, drop=[name])
    elif change == "shape":
        ff.edit(t, add={name: torch.cat([v, v[..., :1]], dim=-1)})
    else:
        ff.edit(t, add={name: v.to(torch.float32)})
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    code, _, err = cli("build", t, "--drafter", "ngram", "-o", out)
    assert code == 2 and name in err and "does not match its config" in err, err
    assert not any(out.parent.iterdir())


def test_a_quantized_target_of_an_unknown_family_is_refused(tiny_target, tmp_path):
    t = shutil.copytree(tiny_target, tmp_path / "t")
    cfg = json.loads((t / "config.json").read_text())
    cfg.update(architectures=["Mystery7ForCausalLM"], model_type="mystery7",
               quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    (t / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="no tensor of it could be checked"):
        _build(t, tmp_path / "art")
    assert not (tmp_path / "art").exists()


# ---- MTP modules inside the target --------------------------------------------------------------

@pytest.mark.parametrize("family, add, layout", [
    ("deepseek_v3", lambda t: ff.deepseek_mtp(t), "mtp-deepseek"),
    ("glm4_moe", lambda t: ff.deepseek_mtp(t), "mtp-deepseek"),
    ("qwen3_next", lambda t: ff.qwen_mtp(t, "model.layers.3."), "mtp-qwen3-next"),
    ("qwen3_5", lambda t: ff.qwen_mtp(t, "model.language_model.layers.3."), "mtp-qwen3-next"),
    ("nemotron_h", lambda t: ff.nemotron_mtp(t), "mtp-nemotron-h"),
])
def test_mtp_modules_in_the_target_are_counted(made, family, add, layout, tmp_path):
    mtp = _build(add(_copy(made, family, tmp_path)), tmp_path / "art").target.arch.mtp
    assert (mtp.layout, mtp.held) == (layout, 1)


def test_a_config_that_states_mtp_its_weights_do_not_hold_says_so(made, tmp_path):
    """A quantized re-upload keeps num_nextn_predict_layers and drops the layers."""
    t = ff.edit(_copy(made, "deepseek_v3", tmp_path), config={"num_nextn_predict_layers": 1})
    mtp = _build(t, tmp_path / "art").target.arch.mtp
    assert (mtp.stated, mtp.held) == (1, 0)


# ---- what runs where ------------------------------------------------------------------------------

def test_run_refuses_a_family_the_runtime_does_not_decode_naming_the_engines(made, tmp_path, cli):
    out = tmp_path / "art"
    _build(_copy(made, "minimax_m2", tmp_path), out)
    code, _, err = cli("run", out, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "not minimax_m2" in err and "specpack serve ART --engine vllm" in err, err


def test_dense_deepseek_and_qwen3_moe_targets_run_unquantized(made, tmp_path):
    assert _build(_copy(made, "deepseek_v3", tmp_path), tmp_path / "art").target.arch.runs
    assert _build(_copy(made, "qwen3_moe", tmp_path, "q"), tmp_path / "q-art").target.arch.runs
    assert not _build(ff.ct_nvfp4(_copy(made, "qwen3_moe", tmp_path, "n")), tmp_path / "n-art").target.arch.runs


def test_kimi_k2_reads_as_deepseek_v3_and_runs(made, tmp_path, cli):
    """Kimi-K2 ships DeepSeek-V3's architecture under model_type kimi_k2 (no MTP modules)."""
    t = ff.edit(_copy(made, "deepseek_v3", tmp_path), config={"model_type": "kimi_k2", "num_nextn_predict_layers": 0})
    out = tmp_path / "art"
    arch = _build(t, out).target.arch
    assert (arch.family, arch.runs, arch.mtp) == ("deepseek", True, None)
    code, _, err = cli("run", out, "--prompt", "hi", "--max-new-tokens", "4")
    assert code == 0, err


def test_kimi_k25_builds_from_its_wrapper_with_int4_experts_and_its_vision_tower_carried(made, tmp_path, cli):
    """Kimi-K2.5: DeepSeek-V3's decoder in a `kimi_k2` text_config under `language_model.`, its INT4
    experts stated inside text_config; every tensor checked per scheme, the vision tower carried
    untouched, `run` refused naming the engines, a packed expert weight of the wrong shape refused."""
    import torch
    from safetensors.torch import load_file

    t = ff.kimi_k25(_copy(made, "deepseek_v3", tmp_path))
    out = tmp_path / "art"
    target = _build(t, out).target
    arch = target.arch
    assert (target.model_type, target.architecture) == ("kimi_k25", "KimiK25ForConditionalGeneration")
    assert (arch.family, arch.tensor_prefix, arch.text_config) == ("deepseek", "language_model.model.", True)
    assert arch.layer_kinds == ["mla+dense"] + ["mla+moe"] * 2 and arch.experts.routed == 4
    assert arch.quantization.scheme == "ct-int4" and not arch.runs
    assert (out / "model.safetensors").read_bytes() == (t / "model.safetensors").read_bytes()
    assert cli("verify", out)[0] == 0 and cli("export", out, "--to", "vllm", "-o", tmp_path / "v")[0] == 0
    code, _, err = cli("run", out, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "specpack serve ART --engine vllm" in err, err

    name = sorted(k for k in load_file(str(t / "model.safetensors")) if k.endswith("experts.0.up_proj.weight_packed"))[-1]
    ff.edit(t, add={name: torch.zeros(24, 3, dtype=torch.int32)})
    bad = tmp_path / "bad" / "art"
    bad.parent.mkdir()
    code, _, err = cli("build", t, "--drafter", "ngram", "-o", bad)
    assert code == 2 and name in err and name.startswith("language_model.model.layers."), err
    assert not any(bad.parent.iterdir())


def test_kimi_k25_binds_an_eagle3_head_and_vllm_reads_its_routing_from_text_config(made, tmp_path):
    """vLLM's KimiK25ForConditionalGeneration implements SupportsEagle3 (models/kimi_k25.py), so a head
    on it exports; its DeepSeek decoder reads the routing keys from text_config, whose absence is refused."""
    from specpack.exports import export_engine

    t = ff.kimi_k25(_copy(made, "deepseek_v3", tmp_path))
    m = _build(t, tmp_path / "art", drafter=str(_eagle3_head(t, tmp_path / "head", ids=(-1, 0, 1))))
    assert m.drafter.aux_hidden_states.produced_by == ["embedding", "mla+dense", "mla+moe"]
    export_engine(tmp_path / "art", "vllm", tmp_path / "v")
    assert json.loads((tmp_path / "v/config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]

    cfg = json.loads((t / "config.json").read_text())
    del cfg["text_config"]["scoring_func"]
    (t / "config.json").write_text(json.dumps(cfg))
    _build(t, tmp_path / "art2")
    with pytest.raises(UnsupportedError) as e:
        export_engine(tmp_path / "art2", "vllm", tmp_path / "v2")
    assert any("text_config does not state `scoring_func`" in p for p in e.value.problems)


# ---- drafters bound to every family -------------------------------------------------------------

@pytest.mark.parametrize("family, add, layout", [
    ("deepseek_v3", lambda t: ff.fp8_block(ff.deepseek_mtp(t)), "mtp-deepseek"),
    ("glm4_moe", lambda t: ff.ct_fp8_channel(ff.deepseek_mtp(t)), "mtp-deepseek"),
    ("qwen3_next", lambda t: ff.qwen_mtp(t, "model.layers.3."), "mtp-qwen3-next"),
    ("qwen3_5_moe", lambda t: ff.qwen_mtp(t, "model.language_model.layers.3."), "mtp-qwen3-next"),
    ("qwen3_5", lambda t: ff.qwen_mtp(t, "model.language_model.layers.3."), "mtp-qwen3-next"),
    ("deepseek_v32", lambda t: ff.deepseek_mtp(t), "mtp-deepseek"),
    ("nemotron_h", lambda t: ff.nemotron_mtp(t), "mtp-nemotron-h"),
])
def test_mtp_in_the_target_binds_as_its_family_names_it_and_exports_to_vllm(made, family, add, layout, tmp_path):
    """`--drafter mtp` on each family (quantized MTP blocks checked per scheme too), and vLLM's `mtp`."""
    from specpack.exports import export_engine

    target = add(_copy(made, family, tmp_path))
    m = _build(target, tmp_path / "art", drafter="mtp")
    d = m.drafter
    assert (d.kind, d.source_layout, d.location, d.num_layers) == ("mtp", layout, "target", 1)
    assert d.shared_tensors[0] == m.target.arch.tensor_prefix.replace("layers.", "") + "embed_tokens.weight" or \
        d.shared_tensors[0] == "backbone.embeddings.weight"
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), "pt") as f:  # every canonical name points at a held tensor
        held = set(f.keys())
    assert set(json.loads((tmp_path / "art/drafter/config.json").read_text())["tensors"].values()) <= held
    r = export_engine(tmp_path / "art", "vllm", tmp_path / "v")
    assert json.loads((tmp_path / "v/speculative_config.json").read_text())["method"] == "mtp" and r.draft_len == 1


def test_sglang_and_trtllm_refuse_nemotron_mtp_they_were_not_checked_for(made, tmp_path):
    from specpack.exports import export_engine

    _build(ff.nemotron_mtp(_copy(made, "nemotron_h", tmp_path)), tmp_path / "art", drafter="mtp")
    for engine in ("sglang", "trtllm"):
        with pytest.raises(UnsupportedError, match="not checked against"):
            export_engine(tmp_path / "art", engine, tmp_path / engine)


def test_minimax_m2_advertises_mtp_it_never_published(made, tmp_path):
    t = ff.edit(_copy(made, "minimax_m2", tmp_path), config={"use_mtp": True, "num_mtp_modules": 3})
    from specpack.errors import ConversionError

    with pytest.raises(ConversionError, match="advertises 3, whose weights were never published"):
        _build(t, tmp_path / "art", drafter="mtp")


def _eagle3_head(target, out, ids):
    """An SGLang-layout EAGLE-3 head of the target's own geometry, aux ids counted output of layer i."""
    from types import SimpleNamespace

    import eagle_layouts

    cfg = json.loads((target / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    g = SimpleNamespace(hidden_size=text["hidden_size"], vocab_size=text["vocab_size"],
                        num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
                        head_dim=None if "kv_lora_rank" in text else text.get("head_dim"),
                        intermediate_size=text.get("intermediate_size") or 96)
    head = eagle_layouts.write_sglang(out, eagle_layouts.random_head(g), g)
    c = json.loads((head / "config.json").read_text())
    c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    (head / "config.json").write_text(json.dumps(c))
    return head


def test_an_eagle3_head_on_a_hybrid_target_states_what_each_feature_layer_is(made, tmp_path):
    """Qwen3-Next: the features are the outputs of layers 0, 1 and 2, Gated DeltaNet layers all (its only
    full-attention layer is the last, whose output no engine captures)."""
    from specpack.exports import export_engine

    target = _copy(made, "qwen3_next", tmp_path)
    m = _build(target, tmp_path / "art", drafter=str(_eagle3_head(target, tmp_path / "head", ids=(0, 1, 2))))
    aux = m.drafter.aux_hidden_states
    assert aux.layer_ids == [1, 2, 3] and aux.produced_by == ["linear+moe"] * 3
    assert export_engine(tmp_path / "art", "vllm", tmp_path / "v").engine == "vllm"


def test_vllm_refuses_aux_features_where_its_model_captures_none(made, tmp_path):
    """vLLM's Glm4MoeForCausalLM implements no SupportsEagle3: an EAGLE-3 head on GLM-4.5 builds (the
    binding is sound) and its vLLM export is refused with the reason."""
    from specpack.exports import export_engine

    target = _copy(made, "glm4_moe", tmp_path)
    m = _build(target, tmp_path / "art", drafter=str(_eagle3_head(target, tmp_path / "head", ids=(-1, 0, 1))))
    assert m.drafter.aux_hidden_states.produced_by == ["embedding", "full+dense", "full+moe"]
    with pytest.raises(UnsupportedError, match="implements no SupportsEagle3") as e:
        export_engine(tmp_path / "art", "vllm", tmp_path / "v")
    assert "bind another drafter" in e.value.hint


def test_build_says_when_the_target_holds_mtp_modules_the_drafter_does_not_use(made, tmp_path, cli):
    target = ff.qwen_mtp(_copy(made, "qwen3_next", tmp_path), "model.layers.3.")
    code, out, err = cli("build", target, "--drafter", "ngram", "-o", tmp_path / "art")
    assert code == 0 and "note: the target holds 1 MTP module(s) (mtp-qwen3-next): `--drafter mtp`" in out + err
    stripped = ff.edit(_copy(made, "deepseek_v3", tmp_path, "d"), config={"num_nextn_predict_layers": 1})
    code, out, err = cli("build", stripped, "--drafter", "ngram", "-o", tmp_path / "d-art", "--json")
    assert code == 0 and json.loads(out)["notes"] == [
        "the target's config states 1 MTP module(s) (num_nextn_predict_layers), but its weights hold none"]


EAGLE3_ON = ["qwen3_moe", "qwen3_next", "minimax_m2", "gpt_oss", "nemotron_h", "deepseek_v3", "llama4", "mistral3",
             "gemma3", "glm4_moe"]
VLLM_NO_AUX = {"gemma3", "glm4_moe"}  # vLLM's model implements no SupportsEagle3


@pytest.mark.parametrize("family", EAGLE3_ON)
def test_an_eagle3_head_binds_to_every_family_and_exports_where_vllm_captures_features(made, family, tmp_path):
    from specpack.exports import export_engine

    target = _copy(made, family, tmp_path)
    m = _build(target, tmp_path / "art", drafter=str(_eagle3_head(target, tmp_path / "head", ids=(-1, 0, 1))))
    kinds = EXPECTED[family][1]
    assert m.drafter.aux_hidden_states.produced_by == ["embedding", kinds[0], kinds[1]]
    if family in VLLM_NO_AUX:
        with pytest.raises(UnsupportedError, match="SupportsEagle3"):
            export_engine(tmp_path / "art", "vllm", tmp_path / "v")
    else:
        export_engine(tmp_path / "art", "vllm", tmp_path / "v")
        spec = json.loads((tmp_path / "v/config.json").read_text())
        assert spec["speculators_model_type"] == "eagle3" and spec["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


DFLASH_ON = ["qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "gpt_oss", "minimax_m2", "glm4_moe", "nemotron_h",
             "deepseek_v3", "llama4", "mistral3", "gemma3"]


@pytest.mark.parametrize("family", DFLASH_ON)
def test_a_dflash_head_binds_to_every_family(made, family, tmp_path):
    """z-lab's DFlash layout over MoE, hybrid, MLA and multimodal targets: its feature layers' kinds
    stated; vLLM's export refused where its model captures no aux hidden states."""
    import block_layouts as bl

    target = _copy(made, family, tmp_path)
    head = bl.Head(block_size=4, ids_out=(0, 1))
    d = bl.write_zlab(tmp_path / "head", head, bl.canonical_tensors(head, target), target)
    m = _build(target, tmp_path / "art", drafter=str(d))
    kinds = EXPECTED[family][1]
    assert m.drafter.target_features.produced_by == kinds[:2]
    if family in VLLM_NO_AUX:
        from specpack.exports import export_engine

        with pytest.raises(UnsupportedError, match="SupportsEagle3"):
            export_engine(tmp_path / "art", "vllm", tmp_path / "v")


@pytest.mark.parametrize("engine, name", [("vllm", "gpt_oss_mxfp4"), ("sglang", "mxfp4")])
def test_an_export_states_the_quantization_as_its_engine_names_it(made, engine, name, tmp_path):
    from specpack.exports import export_engine

    t = ff.mxfp4(_copy(made, "gpt_oss", tmp_path))
    _build(t, tmp_path / "art")
    export_engine(tmp_path / "art", engine, tmp_path / engine)
    readme = (tmp_path / engine / "README.md").read_text()
    assert f"reads it from the checkpoint's config as `{name}`" in readme and "gpt_oss family" in readme


def test_an_eagle3_head_of_its_own_geometry_runs_on_an_mla_target_losslessly(made, tmp_path):
    """DeepSeek-V3 runs on specpack's runtime: a Llama-shaped full-vocabulary head (no d2t: the identity
    map) over its MLA decoder drafts, and greedy output equals plain decoding."""
    import specpack

    target = _copy(made, "deepseek_v3", tmp_path)
    out = tmp_path / "art"
    m = _build(target, out, drafter=str(_eagle3_head(target, tmp_path / "head", ids=(-1, 0, 1))))
    assert m.drafter.vocab_map == "identity"
    model = specpack.load(out)
    prompt = [5, 6, 7, 8, 9, 5, 6]
    spec = model.generate(prompt, 16, draft_len=3, adaptive=False, eos_ids=())
    assert spec.tokens == model.generate(prompt, 16, speculative=False, eos_ids=()).tokens
    assert spec.stats.drafted_steps > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h"])
def test_a_small_dense_draft_model_binds_to_a_moe_or_hybrid_target(made, family, tmp_path):
    """A one-layer Qwen3 draft sharing the target's tokenizer (the fixtures' common one), exported as
    vLLM's `draft_model`."""
    import tiny

    from specpack.exports import export_engine

    draft = tmp_path / "draft"
    tiny.build_model("qwen3", num_hidden_layers=1, layer_types=["full_attention"], hidden_size=32, intermediate_size=32,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16).save_pretrained(draft)
    tiny.make_tokenizer(draft)
    m = _build(_copy(made, family, tmp_path), tmp_path / "art", drafter=str(draft))
    assert m.drafter.kind == "draft_model" and m.drafter.tokenizer.files_identical
    export_engine(tmp_path / "art", "vllm", tmp_path / "v")
    assert json.loads((tmp_path / "v/README.md").read_text().split("--speculative-config '")[1].split("'")[0])[
        "method"] == "draft_model"


# ---- the exports each engine takes, per family (exports/_common.NO_EAGLE3_CAPTURE, MTP tables) --------------

EAGLE3_EXPORTS = {  # 4+-layer fixtures, aux ids 0, 1, 2 (output of layer i): engine -> exported or refused
    "qwen3_next": {"vllm": True, "sglang": True, "trtllm": True},
    "qwen3_5": {"vllm": True, "sglang": False, "trtllm": True},
    "nemotron_h": {"vllm": True, "sglang": False, "trtllm": True},
    "llama4": {"vllm": True, "sglang": True, "trtllm": True},
    "gemma3": {"vllm": False, "sglang": False, "trtllm": False},
}


@pytest.mark.parametrize("family", EAGLE3_EXPORTS)
def test_eagle3_exports_follow_what_each_engine_captures(made, family, tmp_path):
    from specpack.exports import export_engine

    target = _copy(made, family, tmp_path)
    _build(target, tmp_path / "art", drafter=str(_eagle3_head(target, tmp_path / "head", ids=(0, 1, 2))))
    for engine, exported in EAGLE3_EXPORTS[family].items():
        if exported:
            export_engine(tmp_path / "art", engine, tmp_path / engine)
        else:
            with pytest.raises(UnsupportedError, match="cannot feed a eagle3 drafter"):
                export_engine(tmp_path / "art", engine, tmp_path / engine)


MTP_EXPORTS = {  # family -> engine -> exported (True) or the words of its refusal
    "deepseek_v3": (lambda t: ff.deepseek_mtp(t), {"sglang": True, "trtllm": True}),
    "glm4_moe": (lambda t: ff.deepseek_mtp(t), {"sglang": True, "trtllm": True}),
    "qwen3_next": (lambda t: ff.qwen_mtp(t, "model.layers.3."), {"sglang": True, "trtllm": True}),
    "qwen3_5_moe": (lambda t: ff.qwen_mtp(t, "model.language_model.layers.3."),
                    {"sglang": "Qwen3_5ForCausalLMMTP", "trtllm": True}),
    "nemotron_h": (lambda t: ff.nemotron_mtp(t), {"sglang": "NemotronHForCausalLMMTP", "trtllm": "NemotronHMTP"}),
}


@pytest.mark.parametrize("family", MTP_EXPORTS)
def test_mtp_exports_follow_what_each_engine_runs(made, family, tmp_path):
    from specpack.exports import export_engine

    add, expected = MTP_EXPORTS[family]
    _build(add(_copy(made, family, tmp_path)), tmp_path / "art", drafter="mtp")
    for engine, outcome in expected.items():
        if outcome is True:
            export_engine(tmp_path / "art", engine, tmp_path / engine)
        else:
            with pytest.raises(UnsupportedError, match=outcome):
                export_engine(tmp_path / "art", engine, tmp_path / engine)


@pytest.mark.parametrize("layout", ["lilicorr", "vllm-dspark", "speculators-dspark"])
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "gpt_oss"])
def test_dspark_and_lilicorr_heads_bind_to_hybrid_and_moe_targets(made, family, layout, tmp_path):
    import block_layouts as bl

    target = _copy(made, family, tmp_path)
    _, head = bl.WRITERS[layout]
    head = bl.Head(**{**head.__dict__, "ids_out": (0, 1)})
    d = bl.WRITERS[layout][0](tmp_path / "head", head, bl.canonical_tensors(head, target), target)
    m = _build(target, tmp_path / "art", drafter=str(d))
    assert m.drafter.algorithm in ("dspark", "lilicorr")
    assert m.drafter.target_features.produced_by == EXPECTED[family][1][:2]


@pytest.mark.parametrize("layout", ["published", "resaved", "untied"])
def test_mistral3_runs_its_text_decoder_as_transformers_does(made, tmp_path, cli, layout):
    """Mistral 3's decoder (text_config, under `language_model.model.` as published or
    `model.language_model.` as transformers v5 re-saves it; its own head at `language_model.lm_head`
    as Mistral-Small-3.1 ships, or tied) runs in specpack's runtime: logits equal transformers'
    Mistral3ForConditionalGeneration on text, speculation equals plain; the vision tower is carried,
    never run."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    from specpack.runtime.spec_model import SpecModel, load_drafter, load_target

    t = _copy(made, "mistral3", tmp_path)
    if layout == "resaved":
        ff.edit(t, rename={"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head."})
    elif layout == "untied":
        head = torch.randn(ff.V, 64, generator=torch.Generator().manual_seed(5))
        ff.edit(t, add={"language_model.lm_head.weight": head}, config={"tie_word_embeddings": False})
    out = tmp_path / "art"
    assert _build(t, out).target.arch.runs
    tokens = torch.randint(0, ff.V, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = Mistral3ForConditionalGeneration.from_pretrained(t).eval()(input_ids=tokens[None]).logits[0]
    model = load_target(t)
    model.setup_cache(32)
    assert (model(tokens).logits - ref).abs().max() <= 1e-4 and ref.abs().max() > 0.1
    spec = SpecModel(model, load_drafter("ngram", {"min_n": 1, "max_n": 3}, None, model))
    prompt = (tokens[:6].tolist() * 3)[:16]
    assert spec.generate(prompt, 16, draft_len=3, eos_ids=()).tokens == \
        spec.generate(prompt, 16, speculative=False, eos_ids=()).tokens
    code, _, err = cli("run", out, "--prompt", "hi", "--max-new-tokens", "4", "--draft-len", "2")
    assert code == 0, err
