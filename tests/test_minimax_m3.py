"""MiniMax-M3 / M3.1 (issue 50): the release names transformers saves and loads, full and block-sparse
attention, dense and MoE layers, the legacy config keys, the v5 re-save, the MXFP8 release form; each
bad input refused with the rest, nothing written; the MTP modules it advertises are refused by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import family_fixtures as ff
from specpack.errors import ConversionError

KINDS = ["full+dense", "block_sparse+moe", "full+moe", "block_sparse+moe"]
P = "language_model.model."


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    return ff.make("minimax_m3_vl", tmp_path_factory.mktemp("m3") / "t")


def _copy(m3, tmp_path, name="t"):
    return shutil.copytree(m3, tmp_path / name)


_build, _refused = ff.build_ngram, ff.refused


def test_the_fixture_holds_the_release_names_transformers_loads(m3):
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    names = set(load_file(str(m3 / "model.safetensors")))
    assert {P + "layers.1.self_attn.index_q_proj.weight", P + "layers.1.block_sparse_moe.experts.0.w1.weight",
            P + "layers.1.block_sparse_moe.e_score_correction_bias", "language_model.lm_head.weight"} <= names
    _, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(m3, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())


def test_m3_builds_with_its_facts_stated(m3, tmp_path, cli):
    out = tmp_path / "art"
    a = _build(_copy(m3, tmp_path), out).target.arch
    assert (a.family, a.layer_kinds, a.tensor_prefix, a.text_config) == ("minimax_m3", KINDS, P, True)
    assert (a.experts.routed, a.experts.active, a.experts.shared, a.experts.shared_size) == (4, 2, 1, 32)
    # K and V (2 heads x 16) in every layer, plus one indexer key (16) per token on the sparse ones; fp32
    assert a.kv_bytes_per_token == (4 * 2 * 2 * 16 + 2 * 16) * 4
    assert cli("verify", out)[0] == 0
    code, shown, _ = cli("inspect", out)
    assert code == 0 and "2× block_sparse+moe" in shown, shown


def test_the_legacy_keys_and_the_v5_resave_read(m3, tmp_path):
    t = _copy(m3, tmp_path)
    cfg = json.loads((t / "config.json").read_text())
    text = cfg["text_config"]
    text.pop("layer_types"), text.pop("mlp_layer_types")
    text.update(sparse_attention_config={"sparse_attention_freq": [0, 1, 0, 1]}, moe_layer_freq=[0, 1, 1, 1])
    (t / "config.json").write_text(json.dumps(cfg))
    ff.edit(t, rename={P: "model.language_model.", "language_model.lm_head.": "lm_head."})
    a = _build(t, tmp_path / "art").target.arch
    assert (a.layer_kinds, a.tensor_prefix) == (KINDS, "model.language_model.")


def test_the_mxfp8_release_form_builds_and_an_8_bit_router_is_refused(m3, tmp_path, cli):
    skip = ("block_sparse_moe.gate.", "patch_merge_mlp")
    q = _build(ff.mxfp8(_copy(m3, tmp_path), skip=skip), tmp_path / "art").target.arch.quantization
    assert (q.scheme, q.block) == ("mxfp8", [1, 32]) and q.quantized_linear > 0
    t = ff.mxfp8(_copy(m3, tmp_path, "r"), skip=("patch_merge_mlp",))  # the router stored F8 too
    err = _refused(cli, t, tmp_path)
    assert f"{P}layers.1.block_sparse_moe.gate.weight is F8_E4M3" in err, err


def test_the_release_scale_name_weight_scale_inv_u8_builds(m3, tmp_path):
    """MiniMax-M3's MXFP8 checkpoints name the U8 scales `weight_scale_inv` (issue 60: 121 tensors were
    refused as missing `weight_scale`)."""
    t = ff.mxfp8(_copy(m3, tmp_path), skip=("block_sparse_moe.gate.", "patch_merge_mlp"), scale="weight_scale_inv")
    q = _build(t, tmp_path / "art").target.arch.quantization
    assert q.scheme == "mxfp8" and q.quantized_linear > 0


def _nested_index(t, **sparse):
    cfg = json.loads((t / "config.json").read_text())
    text = cfg["text_config"]
    text.pop("index_n_heads"), text.pop("index_head_dim")
    text["sparse_attention_config"] = {"use_sparse_attention": True, "sparse_block_size": 8, "sparse_topk_blocks": 2,
                                       "sparse_local_block": 1, **sparse}
    (t / "config.json").write_text(json.dumps(cfg))
    return t


def test_the_indexer_geometry_is_read_from_the_release_sparse_attention_config(m3, tmp_path, cli):
    """Releases state the indexer in the nested sparse_attention_config (vLLM minimax_m3.py reads
    sparse_num_index_heads / sparse_index_dim there), not in flat index_* keys with defaults."""
    t = _nested_index(_copy(m3, tmp_path), sparse_num_index_heads=2, sparse_index_dim=16)
    assert _build(t, tmp_path / "art").target.arch.layer_kinds == KINDS
    wrong = _nested_index(_copy(m3, tmp_path, "w"), sparse_num_index_heads=2, sparse_index_dim=32)
    err = _refused(cli, wrong, (tmp_path / "w2").mkdir() or tmp_path / "w2")
    assert f"tensor {P}layers.1.self_attn.index_q_proj.weight has shape [32, 64], expected [64, 64]" in err, err
    bad = _nested_index(_copy(m3, tmp_path, "b"), sparse_num_index_heads="2", sparse_index_dim=16)
    err = _refused(cli, bad, (tmp_path / "b2").mkdir() or tmp_path / "b2")
    assert "sparse_attention_config.sparse_num_index_heads = 2: not a positive integer" in err, err


def test_missing_and_misshapen_m3_tensors_are_refused_together(m3, tmp_path, cli):
    t = _copy(m3, tmp_path)
    tensors = load_file(str(t / "model.safetensors"))
    bias = P + "layers.2.block_sparse_moe.e_score_correction_bias"
    ff.edit(t, drop=[P + "layers.3.self_attn.index_k_norm.weight", P + "layers.0.mlp.up_proj.weight"],
            add={bias: tensors[bias][:-1].clone()})
    err = _refused(cli, t, tmp_path)
    for text in (f"missing tensor {P}layers.3.self_attn.index_k_norm.weight", f"missing tensor {P}layers.0.mlp.up_proj",
                 f"tensor {bias} has shape [3]"):
        assert text in err, err


@pytest.mark.parametrize("change, expect", [
    ({"layer_types": ["full_attention", "linear_attention", "full_attention", "full_attention"]},
     "layer_types[1] = 'linear_attention'"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types must list one type per layer (4)"),
])
def test_an_m3_config_this_family_cannot_check_is_refused(m3, tmp_path, cli, change, expect):
    t = _copy(m3, tmp_path)
    cfg = json.loads((t / "config.json").read_text())
    cfg["text_config"].update(change)
    (t / "config.json").write_text(json.dumps(cfg))
    assert expect in _refused(cli, t, tmp_path)


def test_the_mtp_modules_it_advertises_are_refused_by_name(m3, tmp_path):
    t = _copy(m3, tmp_path)
    cfg = json.loads((t / "config.json").read_text())
    cfg["text_config"]["num_mtp_modules"] = 3
    (t / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="advertises 3, whose tensor names no public source states"):
        _build(t, tmp_path / "art", drafter="mtp")
