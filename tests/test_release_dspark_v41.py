"""DeepSeek-V4.1-Flash (layout B, issue 60): the target (`DeepseekV41ForCausalLM`, its decoder in
`text_config`: CSA2 KV and index sources, engram tables, a router `bias_vl`, the vision tower carried) is
checked tensor by tensor, and its DSpark stages under `mtp.{k}.` (vLLM's DSparkV41DraftModel: sliding-only
layers with their own expert count, `markov_head.embed` / `head`, no hc_head, ids counting a layer's
input) are bound in place by `build --drafter bundled`; family_fixtures.deepseek_v41 cites each name."""

import json
import math
import shutil

import pytest
import torch

import family_fixtures as ff
from specpack.families import registry


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return ff.deepseek_v41(tmp_path_factory.mktemp("v41") / "DeepSeek-V4.1-Flash")


@pytest.fixture(scope="module")
def artifact(release, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "v41-dspark"
    ff.build_ngram(release, out, drafter="bundled")
    return out


def _manifest(artifact):
    return json.loads((artifact / "specpack.json").read_text())


def test_the_family_reads_the_csa2_schedule_and_the_engram(release):
    arch = registry.describe(json.loads((release / "config.json").read_text()))
    assert arch.family == "deepseek_v41" and arch.layer_kinds == ["sliding+moe"] * 2 + ["csa2+moe"] * 4
    assert (arch.details["kv_sources"], arch.details["index_sources"], arch.details["engram"]) == ([2, 4], [2, 4, 5],
                                                                                                   {1: 97})
    # a KV source caches its compressed entries and index keys beside the window; the layers it serves do not
    assert [layer.cache for layer in arch.layers] == [32, 32, 32 + (32 + 16) / 2, 32, 32 + 32 + 16, 32]


def test_bundled_binds_the_stages_in_place_with_every_fact_stated(artifact):
    m = _manifest(artifact)
    d = m["drafter"]
    assert d["kind"] == "release_dspark" and d["source_layout"] == "deepseek-v41-dspark" and d["location"] == "target"
    assert (d["layers"], d["layers_from"]) == (3, "config.json text_config num_nextn_predict_layers")
    assert (d["block_size"], d["noise_token_id"], d["target_layer_ids"]) == (5, 7, [3, 4, 5])
    assert d["target_layer_convention"] == "input_of_layer" and d["confidence"] == {"with_markov": True}
    assert "attention input" in d["resolved_from"]["target_layer_convention"]
    assert "deepseek_v41/nvidia/dspark.py" in d["resolved_from"]["query_causal"]
    assert d["shared_tensors"] == ["embed.weight", "head.weight"]
    assert m["target"]["arch"]["family"] == "deepseek_v41"


def test_the_artifact_holds_no_byte_twice(release, artifact):
    files = {f["path"]: f["size"] for f in _manifest(artifact)["files"]}
    assert not (artifact / "drafter").exists()
    carried = sum(p.stat().st_size for p in release.rglob("*") if p.is_file())
    assert sum(files.values()) - files["README.md"] == carried
    assert (artifact / "model.safetensors").read_bytes() == (release / "model.safetensors").read_bytes()


def test_verify_and_inspect_state_the_stages(release, artifact, cli):
    assert cli("verify", artifact)[0] == 0
    code, out, _ = cli("inspect", artifact)
    assert code == 0 and "release_dspark from deepseek-v41-dspark" in out and "[3, 4, 5] (input_of_layer)" in out, out
    assert "2× sliding+moe, 4× csa2+moe" in out and "the engines only" in out
    code, out, _ = cli("inspect", release, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["drafter_bundled"] == "dspark-stages", out
    assert "## Drafter: DSpark, as the release ships it (`deepseek-v41-dspark`)" in (artifact / "README.md").read_text()


def test_vllm_reads_the_stages_as_its_v41_draft(artifact, tmp_path, cli):
    code, out, err = cli("export", artifact, "--to", "vllm", "-o", tmp_path / "v", "--json")
    assert code == 0, err
    assert json.loads((tmp_path / "v" / "speculative_config.json").read_text()) == {"method": "dspark",
                                                                                  "num_speculative_tokens": 5}
    assert "DSparkV41DraftModel" in (tmp_path / "v" / "README.md").read_text()


@pytest.mark.parametrize("engine, expect", [("sglang", "no DeepSeek-V4.1 model"), ("trtllm", "V4.1's DSpark stages")])
def test_sglang_and_tensorrt_llm_are_refused_saying_why(artifact, tmp_path, cli, engine, expect):
    code, _, err = cli("export", artifact, "--to", engine, "-o", tmp_path / "e")
    assert code != 0 and expect in err and not (tmp_path / "e").exists(), err


def test_specpacks_runtime_declines_and_names_the_engines(artifact, cli):
    code, _, err = cli("run", artifact, "--prompt", "hi", "--max-new-tokens", "2")
    assert code != 0 and "--engine vllm" in err and "Traceback" not in err, err


def test_without_vision_or_confidence_head_it_binds_what_it_holds(tmp_path):
    """A text-only V4.1 has no router bias_vl; vLLM drops the confidence head a checkpoint lacks."""
    r = ff.deepseek_v41(tmp_path / "t", vision=False, confidence=False)
    d = ff.build_ngram(r, tmp_path / "art", drafter="bundled").drafter
    assert d.confidence is None and d.layers == 3


def test_the_fp8_release_form_binds(tmp_path):
    """FP8 e4m3 linears with ue8m0 `.scale` blocks, fp4 routed experts (expert_dtype in the
    quantization_config, as vLLM's DeepseekV41Config reads it), the engram table FP8 with its row scales."""
    r = ff.deepseek_v41(tmp_path / "t")
    _fp8(r)
    d = ff.build_ngram(r, tmp_path / "art", drafter="bundled").drafter
    assert d.quantization.scheme == "fp8-block" and d.quantization.expert_dtype == "fp4"
    assert d.quantization.quantized_linear > 0


def _fp8(r, block=16):
    from safetensors.torch import load_file

    t, add, e8m0 = load_file(str(r / "model.safetensors")), {}, torch.float8_e8m0fnu
    skip = ("embed", "head.weight", "norm", "ffn.gate.", "markov_head.", "confidence_head.", "aligner.")
    for k in [k for k, v in t.items() if k.endswith(".weight") and v.dim() == 2 and not any(s in k for s in skip)]:
        o, i = t[k].shape
        stem = k[: -len("weight")]
        if ".experts." in k and ".shared_experts." not in k:
            add[k], scale = torch.zeros(o, i // 2, dtype=torch.int8), (o, math.ceil(i / 32))
        else:
            add[k], scale = t[k].to(torch.float8_e4m3fn), (math.ceil(o / block), math.ceil(i / block))
        add[stem + "scale"] = torch.full(scale, 127, dtype=torch.uint8).view(e8m0)
    cfg = json.loads((r / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
                                  "weight_block_size": [block, block], "activation_scheme": "dynamic"}
    (r / "config.json").write_text(json.dumps(cfg))
    ff.edit(r, add=add)


def _text(**updates):
    def write(r):
        cfg = json.loads((r / "config.json").read_text())
        cfg["text_config"].update(updates)
        (r / "config.json").write_text(json.dumps(cfg))
    return write


def _drop(*names):
    return lambda r: ff.edit(r, drop=names)


MUTANTS = [
    ("engram table without its scales", _drop("layers.1.engram.embed.scale"),
     ["missing tensor layers.1.engram.embed.scale (expected F8_E8M0 [97, 1]"]),
    ("KV source without its index keys", _drop("layers.2.attn.indexer.wk.weight"),
     ["missing tensor layers.2.attn.indexer.wk.weight"]),
    ("ratio-2 compressor without its gate", _drop("layers.4.attn.compressor.wkv.weight"),
     ["missing tensor layers.4.attn.compressor.wkv.weight"]),
    ("router without bias_vl beside a vision tower", _drop("layers.3.ffn.gate.bias_vl"),
     ["missing tensor layers.3.ffn.gate.bias_vl"]),
    ("stages of another expert count", _text(dspark_n_routed_experts=3),
     ["tensor mtp.0.ffn.gate.weight has shape [2, 64], expected [3, 64]"]),
    ("Markov head under V4's names", lambda r: ff.edit(r, rename={"mtp.2.markov_head.embed.": "mtp.2.markov_head.markov_w1."}),
     ["missing tensor mtp.2.markov_head.embed.weight"]),
    ("target layer out of range", _text(dspark_target_layer_ids=[3, 4, 6]),
     ["dspark_target_layer_ids[2] = 6: not a target layer (0..5, input of layer i)"]),
    ("stage count contradicted", _text(n_mtp_layers=2),
     ["config.json text_config n_mtp_layers states 2 stages, but the weights hold mtp.2.*"]),
    ("index source before any KV source", _text(index_source_layer_ids=[1, 2]),
     ["compress_ratios entry is 0"]),
    ("KV source without a compressed branch", _text(kv_source_layer_ids=[0, 2, 4]),
     ["kv_source_layer_ids names layer 0, whose compress_ratios entry is 0"]),
    ("engram tables of another count", _text(engram_num_embeddings=[97, 5]), ["engram_layer_ids [1] and "]),
]


@pytest.mark.parametrize("case, mutate, expect", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_defective_release_is_refused_naming_the_defect(release, tmp_path, cli, case, mutate, expect):
    r = shutil.copytree(release, tmp_path / "r")
    mutate(r)
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    code, _, err = cli("build", r, "--drafter", "bundled", "-o", out)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert not any(out.parent.iterdir())
    for text in expect:
        assert text in err, err
