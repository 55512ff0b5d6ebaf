"""DeepSeek-V4-Flash-DSpark (layout B, issue 60): the DSpark stages inside the target's own weights
(`mtp.{k}.*`, named and shaped as vLLM's DeepSeek-V4 DSpark draft loads them; family_fixtures.
deepseek_v4_dspark cites each name) are bound where they are by `build --drafter bundled`, stated in
the manifest, shown by `inspect` (directory and artifact), exported to vLLM and SGLang and refused for
TensorRT-LLM; every defect is refused by name, all at once, nothing written."""

import json
import shutil

import pytest
import torch

import family_fixtures as ff


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return ff.deepseek_v4_dspark(ff.make("deepseek_v4", tmp_path_factory.mktemp("v4d") / "DeepSeek-V4-Flash-DSpark"))


@pytest.fixture(scope="module")
def artifact(release, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "v4-dspark"
    ff.build_ngram(release, out, drafter="bundled")
    return out


def _copy(release, tmp_path):
    return shutil.copytree(release, tmp_path / "r")


def test_bundled_binds_the_stages_in_place_with_every_fact_stated(release, artifact):
    m = json.loads((artifact / "specpack.json").read_text())
    d = m["drafter"]
    assert d["kind"] == "release_dspark" and d["source_layout"] == "deepseek-v4-dspark" and d["location"] == "target"
    assert (d["layers"], d["layers_from"], d["layer_kind"]) == (3, "inference/config.json n_mtp_layers", "sliding+moe")
    assert (d["sliding_window"], d["query_causal"], d["files"]) == (8, False, [])  # the fixture's sliding_window
    assert (d["block_size"], d["noise_token_id"], d["target_layer_ids"]) == (5, 7, [1, 2, 3])
    assert d["target_layer_convention"] == "output_of_layer" and d["markov"] == {"rank": 8, "type": "vanilla"}
    assert d["shared_tensors"] == ["embed.weight", "head.weight"] and "quantization" not in d
    assert d["resolved_from"]["block_size"] == "config.json dspark_block_size"
    assert m["target"]["arch"]["family"] == "deepseek_v4" and m["target"].get("remote_code") is None


def test_the_artifact_holds_no_byte_twice(release, artifact):
    """The stages stay in the target's shard; no drafter/ folder; inference/ carried as files."""
    files = {f["path"]: f["size"] for f in json.loads((artifact / "specpack.json").read_text())["files"]}
    assert not (artifact / "drafter").exists()
    carried = sum(p.stat().st_size for p in release.rglob("*") if p.is_file() and p.name != "README.md")
    assert sum(files.values()) - files["README.md"] == carried
    assert (artifact / "model.safetensors").read_bytes() == (release / "model.safetensors").read_bytes()
    assert "inference/model.py" in files


def test_verify_and_inspect_state_the_stages(release, artifact, cli):
    assert cli("verify", artifact)[0] == 0
    code, out, _ = cli("inspect", artifact)
    assert code == 0 and "3 sliding+moe in the target's own weight files" in out, out
    assert "5 draft tokens, noise token 7, non-causal within the block" in out
    assert "[1, 2, 3] (output_of_layer)" in out and "markov rank 8" in out
    code, out, _ = cli("inspect", release, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["drafter_bundled"] == "dspark-stages", out
    assert [(b["layout"], b["kind"]) for b in shown["bundled"]] == [("B", "release_dspark")]


def test_the_card_states_the_stages(artifact):
    card = (artifact / "README.md").read_text()
    assert "## Drafter: DSpark, as the release ships it (`deepseek-v4-dspark`)" in card


def test_vllm_reads_the_stages_from_the_target(artifact, tmp_path, cli):
    code, out, err = cli("export", artifact, "--to", "vllm", "-o", tmp_path / "v", "--json")
    assert code == 0, err
    spec = json.loads((tmp_path / "v" / "speculative_config.json").read_text())
    assert spec == {"method": "dspark", "num_speculative_tokens": 5}
    assert "--speculative-config" in json.loads(out)["command"]


def test_sglang_follows_its_bundled_rule(artifact, tmp_path, cli):
    code, out, err = cli("export", artifact, "--to", "sglang", "-o", tmp_path / "s", "--json")
    flags = json.loads((tmp_path / "s" / "launch_flags.json").read_text())
    assert code == 0 and flags == {"--speculative-algorithm": "DSPARK"}, err
    assert "--speculative-draft-model-path" not in json.loads(out)["command"]


def test_tensorrt_llm_is_refused_saying_why(artifact, tmp_path, cli):
    code, _, err = cli("export", artifact, "--to", "trtllm", "-o", tmp_path / "t")
    assert code != 0 and "no deepseek-v4-dspark draft" in err and not (tmp_path / "t").exists(), err


def test_a_draft_length_other_than_the_block_is_refused(artifact, tmp_path, cli):
    code, _, err = cli("export", artifact, "--to", "vllm", "--draft-len", "3", "-o", tmp_path / "v")
    assert code == 2 and "dspark_block_size" in err and "--draft-len 5" in err, err


def test_specpacks_runtime_declines_and_names_the_engines(artifact, cli):
    code, _, err = cli("run", artifact, "--prompt", "hi", "--max-new-tokens", "2")
    assert code != 0 and "--engine vllm" in err and "Traceback" not in err, err


def test_the_fp8_release_form_binds_its_scaled_stages(tmp_path):
    """The published form: FP8 e4m3 stages with ue8m0 `.scale` blocks (main_proj included), fp4 routed
    experts with their `.scale`, the Markov and confidence heads float."""
    r = ff.deepseek_v4_fp8(ff.deepseek_v4_dspark(ff.make("deepseek_v4", tmp_path / "t")))
    d = ff.build_ngram(r, tmp_path / "art", drafter="bundled").drafter
    assert d.kind == "release_dspark" and d.quantization.scheme == "fp8-block" and d.quantization.expert_dtype == "fp4"
    assert d.quantization.quantized_linear > 0


def test_the_stage_count_comes_from_the_index_without_inference_config(tmp_path):
    """DeepSeek-V4-Pro-DSpark as a variant: other layer ids, two stages, no inference/ folder."""
    r = ff.deepseek_v4_dspark(ff.make("deepseek_v4", tmp_path / "pro"), stages=2, ids=(0, 3), inference=False)
    d = ff.build_ngram(r, tmp_path / "art", drafter="bundled").drafter
    assert (d.layers, d.layers_from, d.target_layer_ids) == (2, "the weights' mtp.{k}. prefixes", [0, 3])


def _drop(name):
    return lambda r: ff.edit(r, drop=(name,))


def _config(**updates):
    return lambda r: ff.edit(r, config=updates)


def _f8_markov(r):
    w = "mtp.2.markov_head.markov_w1.weight"
    return ff.edit(r, add={w: torch.zeros(384, 8, dtype=torch.float8_e4m3fn)})


def _inference(n):
    def write(r):
        (r / "inference" / "config.json").write_text(json.dumps({"n_mtp_layers": n}))
    return write


MUTANTS = [
    ("missing stage tensor", _drop("mtp.1.attn.wkv.weight"), ["missing tensor mtp.1.attn.wkv.weight"]),
    ("missing markov head", _drop("mtp.2.markov_head.markov_w2.weight"),
     ["missing tensor mtp.2.markov_head.markov_w2.weight"]),
    ("main_proj of another width", lambda r: ff.edit(r, add={"mtp.0.main_proj.weight": torch.zeros(64, 128)}),
     ["tensor mtp.0.main_proj.weight has shape [64, 128], expected [64, 192]"]),
    ("F8 markov weight", _f8_markov, ["tensor mtp.2.markov_head.markov_w1.weight is F8_E4M3"]),
    ("target layer out of range", _config(dspark_target_layer_ids=[1, 2, 9]),
     ["dspark_target_layer_ids[2] = 9: not a target layer (0..3"]),
    ("noise token outside the vocab", _config(dspark_noise_token_id=384),
     ["dspark_noise_token_id 384 is outside the target's vocabulary (0..383)"]),
    ("no block size", lambda r: _without(r, "dspark_block_size"), ["states no dspark_block_size"]),
    ("stage count contradicted", _inference(2), ["inference/config.json n_mtp_layers states 2 stages, but the weights "
                                                 "hold mtp.2.*"]),
    ("two defects at once", lambda r: (_drop("mtp.0.main_norm.weight")(r), _config(dspark_noise_token_id=999)(r)),
     ["dspark_noise_token_id 999"]),
]


def _without(r, key):
    cfg = json.loads((r / "config.json").read_text())
    cfg.pop(key)
    (r / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case, mutate, expect", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_defective_release_is_refused_naming_the_defect(release, tmp_path, cli, case, mutate, expect):
    r = _copy(release, tmp_path)
    mutate(r)
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    code, _, err = cli("build", r, "--drafter", "bundled", "-o", out)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert not any(out.parent.iterdir())
    for text in expect:
        assert text in err, err


def test_the_scale_of_a_stage_off_its_grid_is_refused(tmp_path, cli):
    r = ff.deepseek_v4_fp8(ff.deepseek_v4_dspark(ff.make("deepseek_v4", tmp_path / "t")))
    e8m0 = torch.full((3, 3), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    ff.edit(r, add={"mtp.0.main_proj.scale": e8m0})
    code, _, err = cli("build", r, "--drafter", "bundled", "-o", tmp_path / "art")
    assert code == 2 and "mtp.0.main_proj.scale" in err and not (tmp_path / "art").exists(), err
