"""MiniMax-M3.1 with its published `dspark/` draft (layout C, issue 60): DSparkMiniMaxDraftModel read
with its nested keys, prefix and MXFP8 `weight_scale_inv` scales (family_fixtures.minimax_m31_dspark
cites the released schema), bound to the target's embedding and lm_head, carried once; inspect,
verify and the card state it; every engine export is refused saying why; each defect is refused by
name, all at once, nothing written."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import family_fixtures as ff

P = ff.DSPARK_M31


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return ff.minimax_m31_dspark(ff.make("minimax_m3_vl", tmp_path_factory.mktemp("m31") / "MiniMax-M3.1"))


@pytest.fixture(scope="module")
def artifact(release, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "m31-dspark"
    ff.build_ngram(release, out, drafter="bundled")
    return out


def _manifest(artifact) -> dict:
    return json.loads((artifact / "specpack.json").read_text())


def test_bundled_binds_the_dspark_folder_with_every_fact_stated(artifact):
    d = _manifest(artifact)["drafter"]
    assert (d["kind"], d["source_layout"], d["location"]) == ("release_dspark", "minimax-m31-dspark", "drafter")
    assert (d["layers"], d["layer_kind"], d["sliding_window"]) == (2, "sliding+dense", 16)
    assert (d["block_size"], d["noise_token_id"], d["target_layer_ids"]) == (7, 380, [0, 2, 3])
    assert d["query_causal"] is False and "ENCODER_ONLY" in d["resolved_from"]["query_causal"]
    assert d["markov"] == {"rank": 8, "type": "vanilla"} and d["confidence"] == {"with_markov": True}
    assert d["quantization"]["scheme"] == "mxfp8" and d["quantization"]["quantized_linear"] == 14
    assert d["shared_tensors"] == ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight"]
    assert "Gemma RMSNorm" in d["decoder"] and d["source"]["subfolder"] == "dspark"


def test_the_folder_is_stored_once_byte_for_byte(release, artifact):
    sizes = {f["path"]: f["size"] for f in _manifest(artifact)["files"]}
    carried = sum(p.stat().st_size for p in release.rglob("*") if p.is_file() and p.name != "README.md")
    assert sum(sizes.values()) - sizes["README.md"] == carried  # every release byte once, the card beside them
    files = set(sizes)
    assert not any(f.startswith("dspark/") for f in files)
    shard = "model-00001-of-00001.safetensors"
    assert {"drafter/config.json", "drafter/model.safetensors.index.json", f"drafter/{shard}"} <= files
    assert (artifact / "drafter" / shard).read_bytes() == (release / "dspark" / shard).read_bytes()
    assert (artifact / "drafter" / "config.json").read_bytes() == (release / "dspark" / "config.json").read_bytes()


def test_verify_inspect_and_the_card_state_it(release, artifact, cli):
    assert cli("verify", artifact)[0] == 0
    code, out, _ = cli("inspect", artifact)
    assert code == 0 and "2 sliding+dense in drafter/ (3 files, byte for byte)" in out, out
    assert "7 draft tokens, noise token 380, non-causal within the block, window 16" in out
    assert "minimax-m31-dspark" in (artifact / "README.md").read_text()
    code, out, _ = cli("inspect", release, "--json")
    shown = json.loads(out)
    assert code == 0 and [(b["layout"], b["kind"]) for b in shown["bundled"]] == [("C", "release_dspark")], out
    assert shown["drafter_bundled"].endswith("dspark")


@pytest.mark.parametrize("engine, why", [("vllm", "registers no DSparkMiniMaxDraftModel"),
                                         ("sglang", "fork's patch set"), ("trtllm", "no minimax-m31-dspark draft")])
def test_every_engine_export_is_refused_saying_why(artifact, tmp_path, cli, engine, why):
    code, _, err = cli("export", artifact, "--to", engine, "-o", tmp_path / engine)
    assert code != 0 and why in err and not (tmp_path / engine).exists(), err


def test_the_folder_passed_by_path_binds_the_same(release, tmp_path):
    d = ff.build_ngram(release, tmp_path / "art", drafter=str(release / "dspark")).drafter
    assert d.kind == "release_dspark" and d.source_layout == "minimax-m31-dspark"


def test_an_unquantized_draft_binds_too(tmp_path):
    r = ff.minimax_m31_dspark(ff.make("minimax_m3_vl", tmp_path / "t"), mxfp8=False)
    d = ff.build_ngram(r, tmp_path / "art", drafter="bundled").drafter
    assert d.quantization is None and d.tensors == 7 + 2 * 11


def _text(**updates):
    def edit(r):
        cfg = json.loads((r / "dspark" / "config.json").read_text())
        cfg["text_config"].update(updates)
        (r / "dspark" / "config.json").write_text(json.dumps(cfg))
    return edit


def _tensors(drop=(), add=None):
    def edit(r):
        shard = r / "dspark" / "model-00001-of-00001.safetensors"
        t = {k: v for k, v in load_file(str(shard)).items() if k not in drop}
        t.update(add or {})
        save_file(t, str(shard))
        index = json.loads((r / "dspark" / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: shard.name for k in t}
        (r / "dspark" / "model.safetensors.index.json").write_text(json.dumps(index))
    return edit


L0 = P + "layers.0.decoder_layer."
MUTANTS = [
    ("missing layer tensor", _tensors(drop=(L0 + "self_attn.k_proj.weight",)),
     [f"missing tensor {L0}self_attn.k_proj.weight"]),
    ("scale off its grid", _tensors(add={L0 + "mlp.down_proj.weight_scale_inv": torch.zeros(64, 3, dtype=torch.uint8)}),
     [f"{L0}mlp.down_proj.weight_scale_inv is U8 [64, 3]"]),
    ("F8 markov weight", _tensors(add={P + "markov_head.markov_w1.weight": torch.zeros(384, 8, dtype=torch.float8_e4m3fn)}),
     [f"tensor {P}markov_head.markov_w1.weight is F8_E4M3"]),
    ("fc of another width", _tensors(add={P + "fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}),
     [f"tensor {P}fc.weight has shape [64, 128], expected [64, 192]"]),
    ("target layer out of range", _text(dspark_target_layer_ids=[0, 2, 4]),
     ["dspark_target_layer_ids[2] = 4: not a target layer (0..3"]),
    ("noise token outside the vocab", _text(dspark_noise_token_id=400),
     ["dspark_noise_token_id 400 is outside the target's vocabulary (0..383)"]),
    ("another hidden size", _text(hidden_size=128), ["text_config.hidden_size = 128 but the target's is 64"]),
    ("another vocab", _text(vocab_size=512), ["text_config.vocab_size = 512 but the target's is 384"]),
    ("a gated Markov head", _text(dspark_markov_head_type="gated"), ["text_config.dspark_markov_head_type = 'gated'"]),
    ("MoE layers", _text(moe_layer_freq=[1, 0]), ["text_config.moe_layer_freq = [1, 0]"]),
    ("an unknown tensor", _tensors(add={P + "extra.weight": torch.zeros(2, dtype=torch.bfloat16)}),
     [f"tensor {P}extra.weight is not part of the DSparkMiniMaxDraftModel schema"]),
    ("defects of every kind at once", lambda r: (_text(dspark_noise_token_id=999, hidden_size=32)(r),
                                                 _tensors(drop=(P + "final_norm.weight",))(r)),
     ["dspark_noise_token_id 999", "hidden_size = 32", "missing tensor"]),
]


@pytest.mark.parametrize("case, mutate, expect", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_defective_dspark_folder_is_refused_naming_the_defect(release, tmp_path, cli, case, mutate, expect):
    r = shutil.copytree(release, tmp_path / "r")
    mutate(r)
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    code, _, err = cli("build", r, "--drafter", str(r / "dspark"), "-o", out)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert not any(out.parent.iterdir())
    for text in expect:
        assert text in err, err


def test_bundled_names_the_defect_too(release, tmp_path, cli):
    """`inspect` and `build --drafter bundled` say why a dspark/ folder is not bound, not "no known layout"."""
    r = shutil.copytree(release, tmp_path / "r")
    _text(dspark_noise_token_id=400)(r)
    code, out, _ = cli("inspect", r, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["drafter_bundled"] is None and "dspark_noise_token_id 400" in shown["bundled"][0]["why_not"]
    code, _, err = cli("build", r, "--drafter", "bundled", "-o", tmp_path / "art")
    assert code == 2 and "dspark_noise_token_id 400" in err and not (tmp_path / "art").exists(), err


def test_a_deepseek_target_is_not_a_minimax_draft_target(tmp_path, release, cli):
    t = ff.make("deepseek_v4", tmp_path / "v4")
    code, _, err = cli("build", t, "--drafter", str(release / "dspark"), "-o", tmp_path / "art")
    assert code == 2 and "MiniMax-M3.1's DSpark draft" in err, err


def test_a_dspark_link_out_of_the_release_is_not_bundled(release, tmp_path, cli):
    """Its bytes come from outside the release: `bundled` refuses it, saying so; passed by path it binds,
    and the manifest records the folder it came from, not the release (issue 63 item 4)."""
    elsewhere = shutil.copytree(release / "dspark", tmp_path / "elsewhere-dspark")
    r = shutil.copytree(release, tmp_path / "r", ignore=shutil.ignore_patterns("dspark"))
    (r / "dspark").symlink_to(elsewhere, target_is_directory=True)
    code, out, _ = cli("inspect", r, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["drafter_bundled"] is None and "outside the release" in shown["bundled"][0]["detail"]
    code, _, err = cli("build", r, "--drafter", "bundled", "-o", tmp_path / "art")
    assert code != 0 and "resolves outside the release" in err and not (tmp_path / "art").exists(), err
    assert cli("build", r, "--drafter", r / "dspark", "-o", tmp_path / "by-path")[0] == 0
    source = _manifest(tmp_path / "by-path")["drafter"]["source"]
    assert source["path"] == "elsewhere-dspark" and "subfolder" not in source
