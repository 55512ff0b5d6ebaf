"""DeepSeek-V4 (issue 50): its release's tensor names (checked to load in transformers' own
DeepseekV4 model), every attention kind (sliding, CSA with its indexer, HCA), hyper-connections,
hash-routed layers, the legacy config keys, and its published FP8 form (ue8m0 `.scale`, fp4 experts)
build with every tensor checked; each bad input is refused with the rest, nothing written."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import family_fixtures as ff

KINDS = ["sliding+hash_moe", "csa+moe", "hca+moe", "csa+moe"]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return ff.make("deepseek_v4", tmp_path_factory.mktemp("v4") / "t")


def _copy(v4, tmp_path, name="t"):
    return shutil.copytree(v4, tmp_path / name)


_build, _refused = ff.build_ngram, ff.refused


def test_the_release_names_are_what_transformers_loads(v4):
    """The fixture's names (no `model.` prefix, `embed.weight`, `hc_head_fn`, `attn.wq_a`, `ffn.experts.
    {e}.w1`) load into transformers' DeepseekV4ForCausalLM with nothing missing or left over."""
    from transformers import AutoModelForCausalLM

    names = set(load_file(str(v4 / "model.safetensors")))
    assert {"embed.weight", "head.weight", "hc_head_fn", "layers.1.attn.indexer.compressor.ape"} <= names
    assert not any(n.startswith("model.") for n in names)
    _, info = AutoModelForCausalLM.from_pretrained(v4, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())


def test_v4_builds_with_its_facts_stated(v4, tmp_path, cli):
    out = tmp_path / "art"
    a = _build(_copy(v4, tmp_path), out).target.arch
    assert (a.family, a.layer_kinds, a.tensor_prefix) == ("deepseek_v4", KINDS, "")
    assert (a.experts.routed, a.experts.active, a.experts.shared) == (4, 2, 1)
    assert a.active_parameters < a.total_parameters and not a.runs and a.quantization is None
    # one shared K = V head of 32 per layer (its window) + CSA's entries (32 + indexer 16) / 4, HCA's 32 / 8; fp32
    assert a.kv_bytes_per_token == (4 * 32 + 2 * (32 + 16) / 4 + 32 / 8) * 4
    assert a.draft_len_start == 128 // 4 - 1  # four query heads read the one KV head
    assert cli("verify", out)[0] == 0
    code, shown, _ = cli("inspect", out)
    assert code == 0 and "deepseek_v4" in shown and "csa+moe" in shown, shown


def test_the_legacy_config_keys_read_as_transformers_folds_them(v4, tmp_path):
    """`compress_ratios` per layer (0: sliding only) and `num_hash_layers` instead of layer_types /
    mlp_layer_types (a list longer than the layers is cut, as transformers does)."""
    t = _copy(v4, tmp_path)
    cfg = json.loads((t / "config.json").read_text())
    for k in ("layer_types", "mlp_layer_types", "compress_rates"):
        cfg.pop(k)
    cfg.update(compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1)
    (t / "config.json").write_text(json.dumps(cfg))
    ff.edit(t, add={"layers.2.attn.compressor.ape": torch.zeros(128, 32)})  # HCA folds 128 tokens by default
    assert _build(t, tmp_path / "art").target.arch.layer_kinds == KINDS


def test_the_attention_kv_norm_may_be_named_either_way(v4, tmp_path):
    """transformers' mapping loads `attn.norm` and `attn.kv_norm` alike."""
    t = _copy(v4, tmp_path)
    ff.edit(t, rename={f"layers.{i}.attn.norm.": f"layers.{i}.attn.kv_norm." for i in range(4)})
    assert _build(t, tmp_path / "art").target.arch.family == "deepseek_v4"


def test_the_published_fp8_form_with_fp4_experts_builds(v4, tmp_path, cli):
    t = ff.deepseek_v4_fp8(_copy(v4, tmp_path))
    out = tmp_path / "art"
    q = _build(t, out).target.arch.quantization
    assert (q.scheme, q.scale_format, q.expert_dtype, q.block) == ("fp8-block", "ue8m0", "fp4", [16, 16])
    experts = 4 * 4 * 3  # four layers of four routed experts, three projections each
    assert q.quantized_linear >= experts + 4 * 7 and q.unquantized_linear == 1  # the head stays bf16
    code, shown, _ = cli("inspect", out)
    assert code == 0 and "ue8m0" in shown and "fp4 experts" in shown, shown


@pytest.mark.parametrize("change, expect", [
    (lambda t, n: {n["expert_scale"]: torch.ones(24, 3)}, "layers.1.ffn.experts.0.w1.scale"),  # wrong grid
    (lambda t, n: {n["expert"]: torch.zeros(24, 64, dtype=torch.int8)}, "layers.1.ffn.experts.0.w1.weight"),  # unpacked
    (lambda t, n: {n["block_scale"]: torch.ones(3, 4)}, "layers.1.attn.wq_a.scale"),
])
def test_a_v4_scale_or_packing_off_its_grid_is_refused(v4, tmp_path, cli, change, expect):
    t = ff.deepseek_v4_fp8(_copy(v4, tmp_path))
    names = {"expert_scale": "layers.1.ffn.experts.0.w1.scale", "expert": "layers.1.ffn.experts.0.w1.weight",
             "block_scale": "layers.1.attn.wq_a.scale"}
    ff.edit(t, add=change(t, names))
    err = _refused(cli, t, tmp_path)
    assert expect in err and "does not match its config" in err, err


def test_missing_and_misshapen_v4_tensors_are_refused_together(v4, tmp_path, cli):
    t = _copy(v4, tmp_path)
    tensors = load_file(str(t / "model.safetensors"))
    ff.edit(t, drop=["layers.1.attn.indexer.weights_proj.weight", "layers.2.attn.compressor.ape", "hc_head_fn"],
            add={"layers.3.hc_ffn_fn": tensors["layers.3.hc_ffn_fn"][:, :-1].clone(),
                 "layers.0.ffn.gate.tid2eid": tensors["layers.0.ffn.gate.tid2eid"].float()})
    err = _refused(cli, t, tmp_path)
    for name in ("missing tensor layers.1.attn.indexer.weights_proj.weight", "missing tensor layers.2.attn.compressor.ape",
                 "missing tensor hc_head_fn", "tensor layers.3.hc_ffn_fn has shape",
                 "layers.0.ffn.gate.tid2eid is F32, expected an integer table"):
        assert name in err, err


@pytest.mark.parametrize("config, expect", [
    ({"layer_types": ["sliding_attention", "banana", "heavily_compressed_attention", "sliding_attention"]},
     "layer_types[1] = 'banana'"),
    ({"layer_types": None, "compress_ratios": [0, 5, 8, 4]}, "compress_ratios[1] = 5"),
    ({"scoring_func": "tanh"}, "scoring_func 'tanh'"),
    ({"n_shared_experts": 2}, "n_shared_experts 2"),
    ({"o_groups": 3}, "o_groups 3 does not divide"),
    ({"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForConditionalGeneration"]}, "DeepSeek-V4.1"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16], "scale_fmt": "e5m2"}},
     "scale_fmt = 'e5m2'"),
])
def test_a_v4_config_this_family_cannot_check_is_refused(v4, tmp_path, cli, config, expect):
    t = _copy(v4, tmp_path)
    cfg = {**json.loads((t / "config.json").read_text()), **config}
    (t / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    err = _refused(cli, t, tmp_path)
    assert expect in err, err


def test_a_dspark_release_with_stages_cut_short_builds_as_a_target_and_inspect_says_what_bundled_lacks(v4, tmp_path, cli):
    """DSpark markers beside the legacy MTP key with only three stage tensors under mtp.{0,1,2}.*: the
    target builds with them carried byte for byte; inspect lists layout B with the build's own check
    (so it never says `bundled` binds what build refuses) and `--drafter bundled` refuses the same.
    The whole release binds: test_release_dspark_v4.py."""
    t = _copy(v4, tmp_path)
    ff.edit(t, add={"mtp.0.main_proj.weight": torch.zeros(64, 192), "mtp.1.attn_norm.weight": torch.ones(64),
                    "mtp.2.norm.weight": torch.ones(64)},
            config={"num_nextn_predict_layers": 1, "dspark_block_size": 5, "dspark_noise_token_id": 7,
                    "dspark_target_layer_ids": [1, 2, 3], "dspark_markov_rank": 8})
    code, shown, _ = cli("inspect", t, "--json")
    report = json.loads(shown)
    bundled = report["bundled"]
    assert code == 0 and [(b["layout"], b["kind"]) for b in bundled] == [("B", "release_dspark")], shown
    assert "stages [0, 1, 2] held under mtp.*" in bundled[0]["detail"] and report["drafter_bundled"] is None
    assert "missing tensor mtp.0.attn_norm.weight" in bundled[0]["why_not"]
    out = tmp_path / "art"
    assert _build(t, out).target.arch.family == "deepseek_v4"
    assert (out / "model.safetensors").read_bytes() == (t / "model.safetensors").read_bytes()
    code, _, err = cli("build", t, "--drafter", "bundled", "-o", tmp_path / "b")
    assert code == 2 and "no drafter specpack can bind" in err and not (tmp_path / "b").exists(), err
