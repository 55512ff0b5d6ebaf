"""`specpack export ART --to llama.cpp` of an MTP drafter (issue 64 item 1): a DeepSeek-V3 target as llama.cpp's
`deepseek2` GGUF with the MTP layer as its nextn block, checked against the names, shapes and keys the pinned
llama.cpp loads (src/models/deepseek2.cpp load_arch_hparams / load_arch_tensors, written out below) and read
back to the artifact's tensors; what llama.cpp's draft-mtp would run otherwise than the artifact is refused.
tests/engines/test_llamacpp.py runs the export in a real llama-server."""

import json

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

import mtp_layouts as ml

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from specpack.packager import BuildOptions, build

    root = tmp_path_factory.mktemp("ds-lc")
    t = ml.make_target(root / "ds", "mtp-deepseek", 1, rope_parameters=DEFAULT_ROPE)
    return t, build(BuildOptions(target=t.path, drafter="mtp", out=root / "art")).out


def _export(cli, artifact, out, *args, json_out: bool = True):
    return cli("export", artifact, "--to", "llama.cpp", "-o", out, "--gguf-pre", "gpt-2", *args,
               *(("--json",) if json_out else ()))


def _expected_shapes(c: dict, layers: int) -> dict:
    """deepseek2.cpp load_arch_tensors, as ggml `ne` (fastest dimension first), for the tiny config `c`."""
    H, V, heads, lora, rope = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v, q, E, ff = c["qk_nope_head_dim"], c["v_head_dim"], c["q_lora_rank"], c["n_routed_experts"], c["moe_intermediate_size"]
    out = {"token_embd.weight": (H, V), "output_norm.weight": (H,), "output.weight": (H, V)}
    for i in range(layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (H,), p + "attn_q_a_norm.weight": (q,), p + "attn_kv_a_norm.weight": (lora,),
                    p + "attn_q_a.weight": (H, q), p + "attn_q_b.weight": (q, heads * (nope + rope)),
                    p + "attn_kv_a_mqa.weight": (H, lora + rope), p + "attn_k_b.weight": (nope, lora, heads),
                    p + "attn_v_b.weight": (lora, v, heads), p + "attn_output.weight": (heads * v, H),
                    p + "ffn_norm.weight": (H,)})
        if i < c["first_k_dense_replace"]:
            out.update({p + "ffn_gate.weight": (H, c["intermediate_size"]), p + "ffn_up.weight": (H, c["intermediate_size"]),
                        p + "ffn_down.weight": (c["intermediate_size"], H)})
        else:
            out.update({p + "ffn_gate_inp.weight": (H, E), p + "exp_probs_b.bias": (E,),
                        p + "ffn_gate_exps.weight": (H, ff, E), p + "ffn_up_exps.weight": (H, ff, E),
                        p + "ffn_down_exps.weight": (ff, H, E), p + "ffn_gate_shexp.weight": (H, ff),
                        p + "ffn_up_shexp.weight": (H, ff), p + "ffn_down_shexp.weight": (ff, H)})
    n = c["num_hidden_layers"]
    out.update({f"blk.{n}.nextn.eh_proj.weight": (2 * H, H), f"blk.{n}.nextn.enorm.weight": (H,),
                f"blk.{n}.nextn.hnorm.weight": (H,), f"blk.{n}.nextn.embed_tokens.weight": (H, V),
                f"blk.{n}.nextn.shared_head_head.weight": (H, V), f"blk.{n}.nextn.shared_head_norm.weight": (H,)})
    return out


def test_the_mtp_layer_is_written_as_the_target_ggufs_nextn_block(deepseek, tmp_path, cli):
    t, art = deepseek
    code, out, err = _export(cli, art, tmp_path / "lc")
    assert code == 0, err
    result = json.loads(out)
    assert "--spec-type draft-mtp" in result["command"] and "--spec-draft-model" not in result["command"]
    c = json.loads((t.path / "config.json").read_text())
    L = c["num_hidden_layers"]
    r = gguf.GGUFReader(str(tmp_path / "lc/target-f32.gguf"))
    assert {t.name: tuple(int(x) for x in t.shape) for t in r.tensors} == _expected_shapes(c, L + 1)
    kv = {f.name: f.contents() for f in r.fields.values() if f.name.startswith("deepseek2.")}
    assert kv["deepseek2.nextn_predict_layers"] == 1 and kv["deepseek2.block_count"] == L + 1
    assert kv["deepseek2.attention.head_count_kv"] == 1 and kv["deepseek2.attention.q_lora_rank"] == c["q_lora_rank"]
    assert kv["deepseek2.attention.key_length"] == c["kv_lora_rank"] + c["qk_rope_head_dim"]
    assert kv["deepseek2.attention.key_length_mla"] == c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    assert kv["deepseek2.expert_gating_func"] == 2 and kv["deepseek2.expert_group_count"] == c["n_group"]
    assert kv["deepseek2.expert_group_used_count"] == c["topk_group"] and kv["deepseek2.expert_weights_norm"]
    assert kv["deepseek2.expert_weights_scale"] == pytest.approx(c["routed_scaling_factor"])
    assert kv["deepseek2.leading_dense_block_count"] == c["first_k_dense_replace"]


def test_every_tensor_reads_back_as_the_artifacts(deepseek, tmp_path, cli):
    """k_b / v_b join back into kv_b_proj, the stacked experts split back per expert, the nextn block is the
    artifact's MTP layer: nothing is lost or moved."""
    from specpack.converters.gguf_deepseek2 import join_kv_b

    t, art = deepseek
    assert _export(cli, art, tmp_path / "lc")[0] == 0
    src = load_file(str(art / "model.safetensors"))
    got = {t.name: np.asarray(t.data).reshape([int(x) for x in reversed(t.shape)]) for t in
           gguf.GGUFReader(str(tmp_path / "lc/target-f32.gguf")).tensors}
    L, E = 3, 8
    for i in (1, L):  # an MoE trunk layer and the nextn block
        p = f"model.layers.{i}."
        kv_b = join_kv_b(got[f"blk.{i}.attn_k_b.weight"], got[f"blk.{i}.attn_v_b.weight"])
        np.testing.assert_array_equal(kv_b, src[p + "self_attn.kv_b_proj.weight"].numpy())
        for e in range(E):
            np.testing.assert_array_equal(got[f"blk.{i}.ffn_up_exps.weight"][e], src[p + f"mlp.experts.{e}.up_proj.weight"].numpy())
        np.testing.assert_array_equal(got[f"blk.{i}.exp_probs_b.bias"], src[p + "mlp.gate.e_score_correction_bias"].numpy())
    for leaf, name in (("eh_proj", "nextn.eh_proj"), ("enorm", "nextn.enorm"), ("shared_head.norm", "nextn.shared_head_norm")):
        np.testing.assert_array_equal(got[f"blk.{L}.{name}.weight"], src[f"model.layers.{L}.{leaf}.weight"].numpy())


def test_a_draft_length_past_one_is_refused_saying_why(deepseek, tmp_path, cli):
    """llama.cpp hands draft step 2 the nextn block's output after shared_head_norm; DeepSeek's MTP chains it
    before (deepseek2.cpp graph_mtp: h_nextn after the head norm)."""
    from specpack.packager import BuildOptions, build

    t, _ = deepseek
    art = build(BuildOptions(target=t.path, drafter="mtp", out=tmp_path / "art", mtp_allow_reuse=True)).out
    code, _, err = _export(cli, art, tmp_path / "lc", "--draft-len", "2", json_out=False)
    assert code == 2 and "after the MTP final norm" in err and "--draft-len 1 is unaffected" in err, err
    assert not (tmp_path / "lc").exists()


def test_inspect_says_llamacpp_serves_the_mtp_artifact(deepseek, cli):
    _, art = deepseek
    code, out, _ = cli("inspect", art, "--json")
    assert code == 0 and json.loads(out)["engines"]["llama.cpp"] == []


def test_two_mtp_layers_are_refused(tmp_path, cli):
    from specpack.packager import BuildOptions, build

    t = ml.make_target(tmp_path / "ds2", "mtp-deepseek", 2, rope_parameters=DEFAULT_ROPE)
    art = build(BuildOptions(target=t.path, drafter="mtp", out=tmp_path / "art")).out
    code, _, err = _export(cli, art, tmp_path / "lc", json_out=False)
    assert code == 2 and "takes 1 MTP layer(s); this drafter has 2" in err, err


def test_an_mtp_layer_in_a_llama_gguf_is_refused(tmp_path, cli):
    from specpack.packager import BuildOptions, build

    t = ml.make_target(tmp_path / "mimo", "mtp-mimo", 1)
    art = build(BuildOptions(target=t.path, drafter="mtp", out=tmp_path / "art")).out
    code, _, err = _export(cli, art, tmp_path / "lc", json_out=False)
    assert code == 2 and "MiMoForCausalLM" in err, err


@pytest.mark.parametrize("change, says", [
    (dict(num_hidden_layers=27), "Lite model without q_lora_rank"),
    (dict(q_lora_rank=None), "model with q_lora_rank"),
    (dict(topk_method="group_limited_greedy"), "top-2 scores (noaux_tc) only"),
])
def test_a_config_llamacpp_would_read_otherwise_is_refused(change, says):
    from specpack.exports.llamacpp import target_problems

    config = {**ml.deepseek_config(3).to_dict(), "architectures": ["DeepseekV3ForCausalLM"], **change}
    assert target_problems({**config, "architectures": ["DeepseekV3ForCausalLM"]}) != []
    assert any(says in p for p in target_problems(config)), target_problems(config)


@pytest.mark.parametrize("change, says", [(dict(first_k_dense_replace=4), "MoE FFN"),
                                          (dict(q_lora_rank=None), "low-rank query path")])
def test_an_mtp_layer_llamacpps_graph_cannot_run_is_named(change, says):
    """deepseek2.cpp graph_mtp asserts an MoE FFN and q_lora_rank > 0 in the nextn block."""
    from specpack.exports._llamacpp_deepseek2 import nextn_problems

    config = ml.deepseek_config(3).to_dict()
    assert nextn_problems(config) == []
    assert any(says in p for p in nextn_problems({**config, **change}))


# ---- import-gguf: a deepseek2 GGUF's nextn block as the target's MTP layer (issue 64 item 2) ----------

@pytest.fixture(scope="module")
def exported(deepseek, tmp_path_factory):
    from specpack.exports import export_engine

    _, art = deepseek
    return export_engine(art, "llama.cpp", tmp_path_factory.mktemp("ds-exp") / "lc", gguf_pre="gpt-2").out / "target-f32.gguf"


def test_a_deepseek2_gguf_imports_back_bit_for_bit_with_its_nextn_block(deepseek, exported, tmp_path, cli):
    """Every tensor, the MTP layer's included, as the artifact holds it; `build --drafter mtp` binds the nextn
    block as the MTP drafter, which drafts as the original artifact's does."""
    import torch

    import specpack

    t, art = deepseek
    code, out, err = cli("import-gguf", exported, "-o", tmp_path / "imp", "--json")
    assert code == 0, err
    src, got = load_file(str(art / "model.safetensors")), load_file(str(tmp_path / "imp/model.safetensors"))
    assert set(got) == set(src) and all(torch.equal(got[k], src[k]) for k in src)
    config = json.loads((tmp_path / "imp/config.json").read_text())
    original = json.loads((t.path / "config.json").read_text())
    for key in ("num_hidden_layers", "num_nextn_predict_layers", "n_group", "topk_group", "scoring_func", "topk_method",
                "routed_scaling_factor", "norm_topk_prob", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "n_shared_experts"):
        assert config[key] == original[key], key
    assert cli("build", tmp_path / "imp", "--drafter", "mtp", "-o", tmp_path / "art")[0] == 0
    a, b = specpack.load(art), specpack.load(tmp_path / "art")
    with torch.inference_mode():
        for p in ([1, 5, 17, 33, 90], [1, 200, 7, 7, 42, 19]):
            ra, rb = (m.generate(p, 16, draft_len=1, adaptive=False, eos_ids=()) for m in (a, b))
            assert ra.tokens == rb.tokens and ra.stats.accepted == rb.stats.accepted


def test_inspect_says_a_deepseek2_gguf_holds_an_mtp_layer(exported, cli):
    code, out, _ = cli("inspect", exported, "--json")
    info = json.loads(out)
    assert code == 0 and info["architecture"] == "deepseek2" and info["nextn_predict_layers"] == 1
    assert info["nextn_tensors"] == 6


@pytest.mark.parametrize("keys, drop, says", [
    ({"deepseek2.nextn_predict_layers": 0}, (), "nextn_predict_layers is 0, but its nextn tensors are in blocks [3]"),
    ({"deepseek2.nextn_predict_layers": 2, "deepseek2.block_count": 5}, (), "block_count 5 > the 4 blocks"),
    ({}, ("blk.3.nextn.eh_proj.weight",), "blk.3.nextn.eh_proj.weight: missing"),
    ({"deepseek2.attention.key_length_mla": None}, (), "deepseek2.attention.key_length_mla"),
    ({"deepseek2.expert_gating_func": 1}, (), "softmax routing in 4 expert groups"),
])
def test_a_deepseek2_gguf_that_contradicts_itself_is_refused(exported, tmp_path, cli, keys, drop, says):
    import gguf_fixtures as gf

    bad = gf.rewrite_gguf(exported, tmp_path / "bad.gguf", keys, drop)
    code, _, err = cli("import-gguf", bad, "-o", tmp_path / "imp")
    assert code == 2 and says in err and not (tmp_path / "imp").exists(), err


def test_nextn_predict_layers_behind_its_tensors_is_refused(exported, tmp_path, cli):
    """A file claiming one nextn layer whose block holds none (the trunk of a --no-mtp conversion with the key
    left in): the block count says 4, the tensors stop at block 2."""
    import gguf

    import gguf_fixtures as gf

    drop = tuple(t.name for t in gguf.GGUFReader(str(exported)).tensors if t.name.startswith("blk.3."))
    bad = gf.rewrite_gguf(exported, tmp_path / "bad.gguf", {}, drop)
    code, _, err = cli("import-gguf", bad, "-o", tmp_path / "imp")
    assert code == 2 and "block_count 4 > the 3 blocks" in err, err


def test_yarn_is_written_as_llamacpp_reads_it_and_imports_back(tmp_path, cli):
    """DeepSeek-V3's YaRN (factor, original context, betas, mscale_all_dim as yarn_log_multiplier / 0.1, as
    conversion/base.py and DeepseekV2Model write it); import-gguf reads the same rope_parameters back."""
    from specpack.packager import BuildOptions, build

    t = ml.make_target(tmp_path / "yarn", "mtp-deepseek", 1)  # mtp_layouts' default: YaRN factor 4
    art = build(BuildOptions(target=t.path, drafter="mtp", out=tmp_path / "art")).out
    assert _export(cli, art, tmp_path / "lc")[0] == 0
    r = gguf.GGUFReader(str(tmp_path / "lc/target-f32.gguf"))
    kv = {f.name: f.contents() for f in r.fields.values() if ".rope." in f.name}
    assert kv["deepseek2.rope.scaling.type"] == "yarn" and kv["deepseek2.rope.scaling.factor"] == 4.0
    assert kv["deepseek2.rope.scaling.original_context_length"] == 128
    assert kv["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    assert cli("import-gguf", tmp_path / "lc/target-f32.gguf", "-o", tmp_path / "imp")[0] == 0
    back = json.loads((tmp_path / "imp/config.json").read_text())["rope_parameters"]
    original = json.loads((t.path / "config.json").read_text())["rope_parameters"]
    assert {k: back[k] for k in original} == pytest.approx(original)


@pytest.mark.parametrize("rope, says", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.707,
      "mscale_all_dim": 1.0}, "mscale 0.707 and mscale_all_dim 1.0"),
    ({"rope_type": "linear", "factor": 2.0}, "reads YaRN only"),
])
def test_a_rope_llamacpp_would_scale_otherwise_is_refused(rope, says):
    from specpack.exports._llamacpp_deepseek2 import rope_problems

    assert any(says in p for p in rope_problems(rope)) and rope_problems(None) == []


def test_an_mtp_layer_stored_apart_writes_the_same_gguf(tmp_path, cli):
    """A target stripped of its MTP layer, the layer bound from a head directory (drafter/model.safetensors
    holds it in canonical names): the nextn block is written from there, the same GGUF tensor for tensor."""
    from specpack.packager import BuildOptions, build

    t = ml.make_target(tmp_path / "ds", "mtp-deepseek", 1)
    whole = build(BuildOptions(target=t.path, drafter="mtp", out=tmp_path / "whole")).out
    stripped, head = ml.split_head(t, tmp_path / "split")
    apart = build(BuildOptions(target=stripped, drafter=str(head), out=tmp_path / "apart")).out
    tensors = []
    for art in (whole, apart):
        assert _export(cli, art, tmp_path / f"lc-{art.name}")[0] == 0
        reader = gguf.GGUFReader(str(tmp_path / f"lc-{art.name}/target-f32.gguf"))
        tensors.append({t.name: np.asarray(t.data) for t in reader.tensors})
    # the head directory drops DeepSeek's embedding / head copies: llama.cpp then uses token_embd / output
    nextn_copies = {"blk.3.nextn.embed_tokens.weight", "blk.3.nextn.shared_head_head.weight"}
    assert set(tensors[0]) - set(tensors[1]) <= nextn_copies and set(tensors[1]) <= set(tensors[0])
    for name, data in tensors[1].items():
        np.testing.assert_array_equal(data, tensors[0][name], err_msg=name)


# ---- build --drafter X.gguf: a deepseek2 GGUF's nextn block as the MTP head of a target without one ------

def test_a_gguf_nextn_block_is_the_mtp_head_of_a_target_shipped_without_it(deepseek, exported, tmp_path, cli):
    """A target shipped without its MTP layer, and the layer in llama.cpp's files: the whole target GGUF, or
    an `--mtp`-style file holding only the nextn block and the shared embedding / norm / head. Either binds
    as the MTP drafter and drafts as the original artifact does."""
    import gguf as gguf_py
    import torch

    import gguf_fixtures as gf
    import specpack

    t, art = deepseek
    stripped, _ = ml.split_head(t, tmp_path / "split")
    trunk = tuple(x.name for x in gguf_py.GGUFReader(str(exported)).tensors
                  if x.name.startswith("blk.") and int(x.name.split(".")[1]) < 3)
    mtp_only = gf.rewrite_gguf(exported, tmp_path / "mtp-only.gguf", {}, trunk)
    a = specpack.load(art)
    for source in (exported, mtp_only):
        out = tmp_path / f"art-{source.stem}"
        code, _, err = cli("build", stripped, "--drafter", source, "-o", out)
        assert code == 0, err
        m = _manifest_of(out)
        assert m["drafter"]["kind"] == "mtp" and m["drafter"]["location"] == "drafter"
        assert m["drafter"]["source"]["path"] == source.name
        b = specpack.load(out)
        with torch.inference_mode():
            for p in ([1, 5, 17, 33, 90], [1, 200, 7, 7, 42, 19]):
                ra, rb = (x.generate(p, 16, draft_len=1, adaptive=False, eos_ids=()) for x in (a, b))
                assert ra.tokens == rb.tokens and ra.stats.accepted == rb.stats.accepted


def _manifest_of(art):
    return json.loads((art / "specpack.json").read_text())


def test_a_gguf_nextn_block_for_another_target_is_refused(exported, tmp_path, cli, tiny_target):
    """A DeepSeek MTP layer offered to a Llama target: refused by the MTP checks, nothing written."""
    code, _, err = cli("build", tiny_target, "--drafter", exported, "-o", tmp_path / "art")
    assert code == 2 and not (tmp_path / "art").exists(), err
    assert "nextn block follows 3 layers of width 64" in err and "made for another model" in err, err
