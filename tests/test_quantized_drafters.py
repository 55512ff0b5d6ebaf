"""Quantized drafters, block drafters and EAGLE-3 heads (FP8 blocks / per tensor / per channel, NVFP4
from ModelOpt and compressed-tensors), are carried as published: every linear weight checked against its scheme as a
target's are, weights and scales bit for bit, the scheme stated in the manifest, `inspect`, the card
and the exports; specpack's runtime declines them by name. An 8-bit tensor no scheme gives it is
refused. The quantized forms are family_fixtures' (written from each published format)."""

import json

import pytest
import torch
from safetensors.torch import load_file

import block_layouts as bl
import eagle_layouts as el
import family_fixtures as ff
from conftest import read_json
from test_block_convert import _build, _refused
from specpack.errors import ConversionError
from specpack.exports import export_engine
from specpack.packager import BuildOptions, build

HEADS = ("markov_head", "confidence_head")  # ModelOpt's quantize_drafter leaves them float (PR #2027)
SCHEMES = {  # name -> (writer, scheme in the manifest)
    "fp8-block": (lambda p: ff.fp8_block(p, skip=HEADS), "fp8-block"),
    "fp8-tensor": (lambda p: ff.fp8_per_tensor(p, skip=HEADS), "fp8"),
    "ct-fp8-channel": (lambda p: ff.ct_fp8_channel(p, skip=HEADS), "ct-fp8"),
    "ct-nvfp4": (lambda p: ff.ct_nvfp4(p, skip=HEADS), "ct-nvfp4"),
    "modelopt-nvfp4": (lambda p: ff.modelopt_nvfp4(p, skip=HEADS), "modelopt-nvfp4"),
    "modelopt-nvfp4-file": (lambda p: ff.modelopt_nvfp4(p, hf_quant_file=True, skip=HEADS), "modelopt-nvfp4"),
    "modelopt-fp8": (lambda p: ff.modelopt_fp8(p, skip=HEADS), "modelopt-fp8"),
    "mxfp8": (lambda p: ff.mxfp8(p, skip=HEADS), "mxfp8"),
}
LAYOUTS = ("zlab-dflash", "deepspec-dspark")


def _quantized(tmp_path, target, scheme: str, layout: str = "zlab-dflash"):
    head = bl.write(layout, tmp_path / "head", target)
    return SCHEMES[scheme][0](head)


def _bytes_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _linears(tensors: dict) -> list[str]:
    """The drafter's projections and fc, under either stored name (compressed-tensors: weight_packed)."""
    return [n for n in tensors if n.endswith(("_proj.weight", "_proj.weight_packed"))
            or n in ("fc.weight", "fc.weight_packed")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_quantized_drafter_is_carried_bit_for_bit_and_stated(scheme, layout, tmp_path, tiny_target):
    head = _quantized(tmp_path, tiny_target, scheme, layout)
    source = load_file(head / "model.safetensors")
    art = _build(tmp_path, tiny_target, head)
    entry = read_json(art / "specpack.json")["drafter"]
    q = entry["quantization"]
    assert q["scheme"] == SCHEMES[scheme][1]
    kept = {"lm_head.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"} & set(source)
    assert (q["quantized_linear"], q["unquantized_linear"]) == (len(_linears(source)), len(kept))
    assert entry["dtype"] == "float32"  # the float tensors' dtype, not the packed weights'
    stored = load_file(art / "drafter/model.safetensors")
    carried = {n for n in source if "embed_tokens" not in n and "lm_head" not in n}  # shared with the target
    assert set(stored) == carried
    for name in carried:
        assert stored[name].dtype == source[name].dtype and _bytes_equal(stored[name], source[name]), name
    config = read_json(art / "drafter/config.json")
    stated = read_json(head / "config.json").get("quantization_config") or \
        {"quant_method": "modelopt", **read_json(head / "hf_quant_config.json")["quantization"]}
    assert config["quantization_config"] == stated


def test_parameters_count_unpacked_weights(tmp_path, tiny_target):
    plain = read_json(_build(tmp_path, tiny_target, bl.write("zlab-dflash", tmp_path / "plain", tiny_target),
                             "plain-art") / "specpack.json")["drafter"]
    packed = read_json(_build(tmp_path, tiny_target, _quantized(tmp_path, tiny_target, "ct-nvfp4")) /
                       "specpack.json")["drafter"]
    assert packed["parameters"] == plain["parameters"]  # NVFP4 packs two weights a byte; scales are not weights
    assert packed["quantization"]["group"] == 16


def test_inspect_card_and_runtime_state_the_scheme(tmp_path, tiny_target, cli):
    art = _build(tmp_path, tiny_target, _quantized(tmp_path, tiny_target, "fp8-block"))
    code, out, _ = cli("inspect", art)
    assert code == 0 and "quantization" in out and "fp8-block (fp8)" in out
    assert "| quantization | fp8-block (fp8)" in (art / "README.md").read_text()
    code, _, err = cli("run", art, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "drafter cannot run on specpack's own runtime" in err and "fp8-block" in err
    assert "--engine vllm" in err


def test_the_vllm_export_carries_the_scheme_and_imports_back(tmp_path, tiny_target):
    art = _build(tmp_path, tiny_target, _quantized(tmp_path, tiny_target, "modelopt-nvfp4"))
    export_engine(art, "vllm", tmp_path / "vllm")
    config = read_json(tmp_path / "vllm/config.json")
    assert config["quantization_config"]["quant_algo"] == "NVFP4"
    assert "quantized: modelopt-nvfp4" in (readme := (tmp_path / "vllm/README.md").read_text())
    assert "vllm reads it from the draft config as `modelopt_fp4`" in readme
    back = _build(tmp_path, tiny_target, tmp_path / "vllm", "back")
    a, b = (read_json(x / "specpack.json")["drafter"] for x in (art, back))
    assert a["quantization"] == b["quantization"]
    ta, tb = (load_file(x / "drafter/model.safetensors") for x in (art, back))
    assert set(ta) == set(tb) and all(_bytes_equal(ta[n], tb[n]) for n in ta)


# ---- refusals: one error listing the problem, nothing written ---------------------------------------

def _fp8(t):
    return t.to(torch.float8_e4m3fn)


def test_an_8bit_weight_without_a_quantization_config_is_refused(tmp_path, tiny_target):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    t = load_file(head / "model.safetensors")
    bl.edit_tensors(head, update={"layers.0.self_attn.q_proj.weight": _fp8(t["layers.0.self_attn.q_proj.weight"])})
    _refused(tmp_path, tiny_target, head, "tensor 'layers.0.self_attn.q_proj.weight' is F8_E4M3",
             "states no quantization_config")


def test_an_8bit_norm_under_a_scheme_is_refused(tmp_path, tiny_target):
    head = _quantized(tmp_path, tiny_target, "fp8-block")
    t = load_file(head / "model.safetensors")
    bl.edit_tensors(head, update={"norm.weight": _fp8(t["norm.weight"])})
    _refused(tmp_path, tiny_target, head, "tensor 'norm.weight' is F8_E4M3", "leaves it unquantized")


def test_a_scale_of_the_wrong_grid_is_refused(tmp_path, tiny_target):
    head = _quantized(tmp_path, tiny_target, "fp8-block")
    bl.edit_tensors(head, update={"fc.weight_scale_inv": torch.ones(3, 3)})
    _refused(tmp_path, tiny_target, head, "tensor fc.weight_scale_inv is F32 [3, 3], expected")


def test_a_missing_scale_is_refused(tmp_path, tiny_target):
    head = _quantized(tmp_path, tiny_target, "modelopt-nvfp4")
    bl.edit_tensors(head, drop=("layers.1.mlp.down_proj.weight_scale",))
    _refused(tmp_path, tiny_target, head, "missing tensor layers.1.mlp.down_proj.weight_scale")


def test_an_activation_scale_that_is_not_one_number_is_refused(tmp_path, tiny_target):
    head = _quantized(tmp_path, tiny_target, "modelopt-fp8")
    bl.edit_tensors(head, update={"fc.input_scale": torch.ones(4)})
    _refused(tmp_path, tiny_target, head, "tensor fc.input_scale is F32 [4], expected one float")


def test_a_scale_with_no_weight_is_refused(tmp_path, tiny_target):
    head = _quantized(tmp_path, tiny_target, "fp8-block")
    bl.edit_tensors(head, update={"norm.weight_scale_inv": torch.ones(1)})
    _refused(tmp_path, tiny_target, head, "tensor 'norm.weight_scale_inv' maps to no canonical name")


def test_a_quantization_config_over_float_weights_is_refused(tmp_path, tiny_target):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    bl.edit_config(head, update={"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    _refused(tmp_path, tiny_target, head, "none of the", "linear weights is stored quantized")


def test_a_scheme_specpack_cannot_check_is_refused(tmp_path, tiny_target):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    bl.edit_config(head, update={"quantization_config": {"quant_method": "awq", "bits": 4}})
    err = _refused(tmp_path, tiny_target, head, "quant_method 'awq' is not a scheme specpack can check")
    assert isinstance(err, ConversionError)


# ---- EAGLE-3 heads ---------------------------------------------------------------------------------

EAGLE_AUX = [1, 3, 5]  # output of layer i, as the SGLang and ModelOpt layouts count them


def _eagle(tmp_path, tiny_cfg, layout: str, scheme: str):
    head = el.WRITERS[layout](tmp_path / "eagle", el.random_head(tiny_cfg, draft_vocab=256), tiny_cfg,
                              aux_ids=EAGLE_AUX)
    return SCHEMES[scheme][0](head)


@pytest.mark.parametrize("layout", ["eagle3-sglang", "eagle3-modelopt"])
@pytest.mark.parametrize("scheme", ["fp8-block", "ct-nvfp4", "modelopt-nvfp4"])
def test_a_quantized_eagle3_head_is_carried_and_exported(layout, scheme, tmp_path, tiny_target, tiny_cfg, cli):
    head = _eagle(tmp_path, tiny_cfg, layout, scheme)
    art = build(BuildOptions(target=tiny_target, drafter=str(head), out=tmp_path / "art")).out
    entry = read_json(art / "specpack.json")["drafter"]
    assert entry["kind"] == "eagle3" and entry["quantization"]["scheme"] == SCHEMES[scheme][1]
    assert (entry["quantization"]["quantized_linear"], entry["quantization"]["unquantized_linear"]) == (8, 1)
    stored, source = load_file(art / "drafter/model.safetensors"), load_file(head / "model.safetensors")
    scales = {n for n in source if "_scale" in n}
    assert scales and {n.replace("midlayer.", "layers.0.") for n in scales} <= set(stored)
    for n in scales:
        assert _bytes_equal(stored[n.replace("midlayer.", "layers.0.")], source[n]), n
    code, _, err = cli("run", art, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and f"quantized ({SCHEMES[scheme][1]})" in err
    export_engine(art, "vllm", tmp_path / "vllm")
    assert read_json(tmp_path / "vllm/config.json")["quantization_config"] == \
        read_json(head / "config.json")["quantization_config"]
    back = build(BuildOptions(target=tiny_target, drafter=str(tmp_path / "vllm"), out=tmp_path / "back")).out
    assert read_json(back / "specpack.json")["drafter"]["quantization"] == entry["quantization"]
    again = load_file(back / "drafter/model.safetensors")
    assert set(again) == set(stored) and all(_bytes_equal(again[n], stored[n]) for n in stored)


def test_an_8bit_eagle3_weight_without_a_scheme_is_refused(tmp_path, tiny_target, tiny_cfg):
    t = el.random_head(tiny_cfg, draft_vocab=256)
    t["layers.0.mlp.up_proj.weight"] = _fp8(t["layers.0.mlp.up_proj.weight"])
    head = el.write_sglang(tmp_path / "eagle", t, tiny_cfg, aux_ids=EAGLE_AUX)
    with pytest.raises(ConversionError) as err:
        build(BuildOptions(target=tiny_target, drafter=str(head), out=tmp_path / "refused"))
    assert "tensor 'midlayer.mlp.up_proj.weight' is F8_E4M3" in str(err.value)
    assert not (tmp_path / "refused").exists()


def test_mxfp8_scales_named_weight_scale_inv_are_carried_as_weight_scale(tmp_path, tiny_target):
    """MiniMax's releases name MXFP8 scales `weight_scale_inv` (their published indexes); the canonical drafter
    carries them, bytes unchanged, as `weight_scale`, the name vLLM's MXFP8 linear reads."""
    head = _quantized(tmp_path, tiny_target, "mxfp8")
    before = load_file(head / "model.safetensors")["fc.weight_scale"]
    bl.edit_tensors(head, rename={"fc.weight_scale": "fc.weight_scale_inv"})
    out = tmp_path / "art"
    build(BuildOptions(target=tiny_target, drafter=str(head), out=out))
    carried = load_file(out / "drafter" / "model.safetensors")
    assert "fc.weight_scale_inv" not in carried and torch.equal(carried["fc.weight_scale"].view(torch.uint8),
                                                                before.view(torch.uint8))


def test_mxfp8_states_its_one_block(tmp_path, tiny_target):
    head = _quantized(tmp_path, tiny_target, "mxfp8")
    bl.edit_config(head, update={"quantization_config": {"quant_method": "mxfp8", "weight_block_size": [128, 128]}})
    _refused(tmp_path, tiny_target, head, "weight_block_size of an mxfp8 checkpoint must be [1, 32]")


def _mixed(tmp_path, tiny_target, extra: dict | None = None):
    """ModelOpt MIXED_PRECISION over a DFlash drafter: the attention projections FP8 (as family_fixtures'
    modelopt_fp8 stores them), each listed in quantized_layers; everything else float."""
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    t = load_file(head / "model.safetensors")
    attention = [k for k in t if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]
    bl.edit_tensors(head, update={n: v for k in attention for n, v in ff._fp8_scalar(t, k).items()})
    layers = {k.removesuffix(".weight"): {"quant_algo": "FP8"} for k in attention} | (extra or {})
    return bl.edit_config(head, update={"quantization_config": {"quant_method": "modelopt", "quant_algo":
                                                                "MIXED_PRECISION", "quantized_layers": layers}})


def test_a_mixed_precision_drafter_holds_each_module_to_its_listed_format(tmp_path, tiny_target):
    entry = read_json(_build(tmp_path, tiny_target, _mixed(tmp_path, tiny_target)) / "specpack.json")["drafter"]
    q = entry["quantization"]
    assert (q["scheme"], q["quantized_linear"], q["unquantized_linear"]) == ("modelopt-mixed", 8, 7)


def test_quantized_layers_naming_a_module_the_drafter_lacks_is_refused(tmp_path, tiny_target):
    head = _mixed(tmp_path, tiny_target, {"layers.9.self_attn.q_proj": {"quant_algo": "FP8"}})
    _refused(tmp_path, tiny_target, head, "quantized_layers names layers.9.self_attn.q_proj, a module the drafter")
