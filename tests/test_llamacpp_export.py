"""`specpack export ART --to llama.cpp` (issue 64 item 1): the target as a llama.cpp GGUF at the precision
asked and an EAGLE-3 head as llama.cpp's drafter GGUF, each read back by specpack's own GGUF readers bit
for bit (the head also against gguf_fixtures.write_eagle3_gguf, written from the vendored converter); the
tokenizer's pre-tokenizer named by llama.cpp's hash rule or stated; what llama.cpp cannot load is refused.
tests/engines/test_llamacpp.py runs the exports in a real llama-server."""

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import eagle_layouts
import gguf_fixtures as gf

AUX_IN = [1, 3, 6]


@pytest.fixture
def artifact(tmp_path, tiny_target, tiny_cfg, cli):
    head = eagle_layouts.random_head(tiny_cfg, draft_vocab=256)
    drafter = gf.write_eagle3_gguf(tmp_path / "head.gguf", head, tiny_cfg, AUX_IN, tiny_cfg.vocab_size)
    code, _, err = cli("build", tiny_target, "--drafter", drafter, "-o", tmp_path / "art")
    assert code == 0, err
    return tmp_path / "art"


def _export(cli, artifact, out, *args):
    return cli("export", artifact, "--to", "llama.cpp", "-o", out, "--gguf-pre", "gpt-2", *args, "--json")


def _types(path):
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_the_head_reads_back_as_the_same_canonical_head(artifact, tmp_path, tiny_target, cli):
    code, out, err = _export(cli, artifact, tmp_path / "lc")
    assert code == 0, err
    files = json.loads(out)["files"]
    assert {"target-f32.gguf", "draft-eagle3-f32.gguf", "llama_server.json", "README.md"} <= set(files)
    assert "--spec-type draft-eagle3" in json.loads(out)["command"]
    code, _, err = cli("build", tiny_target, "--drafter", tmp_path / "lc/draft-eagle3-f32.gguf", "-o", tmp_path / "again")
    assert code == 0, err
    mine, source = (load_file(a / "drafter/model.safetensors") for a in (tmp_path / "again", artifact))
    assert set(mine) == set(source)
    for name in source:
        assert torch.equal(mine[name], source[name]), name
    back = json.loads((tmp_path / "again/specpack.json").read_text())["drafter"]["aux_hidden_states"]["layer_ids"]
    assert back == AUX_IN  # input of layer i, in llama.cpp and in specpack


def test_the_head_carries_the_keys_llamacpps_converter_writes(artifact, tmp_path, tiny_cfg, cli):
    assert _export(cli, artifact, tmp_path / "lc")[0] == 0
    ours = gguf.GGUFReader(str(tmp_path / "lc/draft-eagle3-f32.gguf"))
    ref = gguf.GGUFReader(str(gf.write_eagle3_gguf(tmp_path / "ref.gguf", eagle_layouts.random_head(tiny_cfg, 256),
                                                   tiny_cfg, AUX_IN, tiny_cfg.vocab_size)))
    keys = {k for k in ref.fields if k.startswith("eagle3.")}
    assert keys <= set(ours.fields), keys - set(ours.fields)
    for k in ("eagle3.target_layers", "eagle3.target_hidden_size", "eagle3.attention.head_count", "eagle3.block_count"):
        assert ours.fields[k].contents() == ref.fields[k].contents(), k
    assert {t.name for t in ref.tensors} == {t.name for t in ours.tensors}
    assert "tokenizer.ggml.tokens" in ours.fields  # llama.cpp sizes the draft vocabulary from it


def test_the_target_imports_back_bit_for_bit(artifact, tmp_path, tiny_target, cli):
    assert _export(cli, artifact, tmp_path / "lc")[0] == 0
    code, _, err = cli("import-gguf", tmp_path / "lc/target-f32.gguf", "-o", tmp_path / "back")
    assert code == 0, err
    mine, source = load_file(tmp_path / "back/model.safetensors"), load_file(tiny_target / "model.safetensors")
    assert set(mine) == set(source)
    for name in source:
        assert torch.equal(mine[name], source[name]), name  # q/k permuted out and back
    from transformers import AutoTokenizer

    text = "The quick brown fox <|im_start|> jumps"
    a, b = (AutoTokenizer.from_pretrained(p) for p in (tmp_path / "back", tiny_target))
    assert a(text).input_ids == b(text).input_ids


@pytest.mark.parametrize("kind, weight", [("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")])
def test_each_precision_follows_the_converters_type_rule(artifact, tmp_path, cli, kind, weight):
    assert _export(cli, artifact, tmp_path / "lc", "--gguf-type", kind)[0] == 0
    target = _types(tmp_path / f"lc/target-{kind}.gguf")
    assert target["blk.0.attn_q.weight"] == weight and target["token_embd.weight"] == weight
    assert target["blk.0.attn_norm.weight"] == "F32" and target["output_norm.weight"] == "F32"
    head = _types(tmp_path / f"lc/draft-eagle3-{kind}.gguf")
    assert head["fc.weight"] == weight and head["d2t"] == "I64" and head["blk.0.attn_norm_2.weight"] == "F32"


def test_q8_0_reads_back_within_its_block_rounding(artifact, tmp_path, tiny_target, cli):
    assert _export(cli, artifact, tmp_path / "lc", "--gguf-type", "q8_0")[0] == 0
    r = gguf.GGUFReader(str(tmp_path / "lc/target-q8_0.gguf"))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
    src = load_file(tiny_target / "model.safetensors")["model.layers.0.mlp.up_proj.weight"].numpy()
    amax = np.abs(src).reshape(src.shape[0], -1, 32).max(-1)  # one Q8_0 block: 32 values, one f16 scale amax / 127
    bound = amax / 127 * 0.5 + amax * 2.0**-10  # half a step, plus the scale's own f16 rounding over 127 steps
    assert np.all(np.abs(w - src).reshape(src.shape[0], -1, 32).max(-1) <= bound)


def test_an_unknown_pre_tokenizer_is_refused_naming_the_flag(artifact, tmp_path, cli):
    code, _, err = cli("export", artifact, "--to", "llama.cpp", "-o", tmp_path / "lc")
    assert code != 0 and "--gguf-pre" in err and "pre-tokenizer" in err and not (tmp_path / "lc").exists(), err


def test_options_of_another_engine_are_refused(artifact, tmp_path, cli):
    code, _, err = cli("export", artifact, "--to", "vllm", "-o", tmp_path / "v", "--gguf-type", "q8_0")
    assert code == 2 and "llama.cpp's" in err and not (tmp_path / "v").exists(), err
    code, _, err = cli("export", artifact, "--to", "llama.cpp", "-o", tmp_path / "lc", "--tp", "2")
    assert code == 2 and "llama-server runs one process" in err, err


def test_ngram_uses_llamacpps_own_lookup(tmp_path, tiny_target, cli):
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", tmp_path / "art")[0] == 0
    code, out, err = _export(cli, tmp_path / "art", tmp_path / "lc")
    assert code == 0 and "--spec-type ngram-simple" in json.loads(out)["command"], err
    assert "llama.cpp's own" in (tmp_path / "lc/README.md").read_text()


def test_inspect_states_which_engines_serve_the_artifact(artifact, cli):
    code, out, _ = cli("inspect", artifact, "--json")
    engines = json.loads(out)["engines"]
    assert code == 0 and engines["llama.cpp"] == [] and set(engines) == {"vllm", "sglang", "trtllm", "llama.cpp"}
    code, out, _ = cli("inspect", artifact)
    assert code == 0 and "export engines" in out and "llama.cpp" in out.split("export engines")[1].splitlines()[0]


@pytest.fixture(scope="module")
def block_arts(tmp_path_factory, tiny_target):
    import block_layouts as bl
    from test_block_convert import _build

    tmp = tmp_path_factory.mktemp("block-llamacpp")
    return {lay: _build(tmp, tiny_target, bl.write(lay, tmp / f"head-{lay}", tiny_target), f"art-{lay}")
            for lay in ("deepspec-dspark", "zlab-dflash", "lilicorr", "nemotron35-dspark")}


@pytest.mark.parametrize("layout, algorithm, anchor", [("deepspec-dspark", "dspark", True),
                                                       ("zlab-dflash", "dflash", False)])
def test_a_block_head_is_written_as_llamacpps_dflash_draft(block_arts, tmp_path, cli, layout, algorithm, anchor):
    art = block_arts[layout]
    code, out, err = _export(cli, art, tmp_path / "lc")
    assert code == 0, err
    assert f"--spec-type draft-{algorithm}" in json.loads(out)["command"]
    r = gguf.GGUFReader(str(tmp_path / f"lc/draft-{algorithm}-f32.gguf"))
    fields = {k: f.contents() for k, f in r.fields.items() if k.startswith("dflash.") or k.endswith("mask_token_id")}
    m = json.loads((art / "specpack.json").read_text())["drafter"]
    assert fields["dflash.target_layers"] == m["target_features"]["layer_ids"]  # input of layer i, as llama.cpp reads
    assert (fields["dflash.block_size"], fields["dflash.sample_from_anchor"]) == (m["block_size"], anchor)
    assert fields["tokenizer.ggml.mask_token_id"] == m["mask_token_id"] and fields["dflash.attention.causal"] is False
    assert fields["dflash.has_confidence_head"] == ("confidence" in m)
    held = {t.name: t for t in r.tensors}
    assert "output.weight" not in held and "token_embd.weight" not in held  # the target's, through ctx_other
    canonical = load_file(art / "drafter/model.safetensors")
    pairs = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "layers.0.self_attn.q_norm.weight": "blk.0.attn_q_norm.weight",
             "layers.1.mlp.down_proj.weight": "blk.1.ffn_down.weight"}
    if algorithm == "dspark":
        pairs["markov_head.markov_w1.weight"] = "markov_w1.weight"
    for name, g in pairs.items():
        t = held[g]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        assert np.array_equal(w, canonical[name].float().numpy()), name


@pytest.mark.parametrize("layout, says", [("lilicorr", "LiLiCorr correlator has no llama.cpp draft type"),
                                          ("nemotron35-dspark", "an own embedding with the target's lm_head")])
def test_what_llamacpps_draft_cannot_hold_is_refused(block_arts, tmp_path, cli, layout, says):
    code, _, err = cli("export", block_arts[layout], "--to", "llama.cpp", "-o", tmp_path / "lc", "--gguf-pre", "gpt-2")
    assert code != 0 and says in err and not (tmp_path / "lc").exists(), err


@pytest.mark.parametrize("layout, algorithm", [("deepspec-dspark", "dspark"), ("zlab-dflash", "dflash")])
def test_a_block_gguf_reads_back_as_the_same_head(block_arts, tmp_path, tiny_target, cli, layout, algorithm):
    """Export, then `build --drafter draft.gguf` (issue 64 item 2): the same canonical head, every binding
    the same (the ids as llama.cpp counts them, input of layer i, are specpack's own)."""
    from test_block_convert import _same_head

    art = block_arts[layout]
    assert _export(cli, art, tmp_path / "lc")[0] == 0
    code, _, err = cli("build", tiny_target, "--drafter", tmp_path / f"lc/draft-{algorithm}-f32.gguf", "-o",
                       tmp_path / "back")
    assert code == 0, err
    a, b = (json.loads((x / "specpack.json").read_text())["drafter"] for x in (art, tmp_path / "back"))
    assert b["source_layout"] == "llamacpp-dflash" and b["target_features"]["layer_ids"] == a["target_features"]["layer_ids"]
    for key in ("algorithm", "query_layout", "block_size", "draft_slots", "mask_token_id", "markov", "confidence",
                "embedding_source", "lm_head_source", "layer_causal"):
        assert a.get(key) == b.get(key), key
    mine, source = (load_file(x / "drafter/model.safetensors") for x in (tmp_path / "back", art))
    assert set(mine) - {"t2d"} == set(source) - {"t2d"}
    for name in set(source) - {"t2d"}:
        assert torch.equal(mine[name], source[name].float()), name


def test_a_block_gguf_for_another_target_is_refused(block_arts, tmp_path, cli):
    import tiny

    assert _export(cli, block_arts["deepspec-dspark"], tmp_path / "lc")[0] == 0
    wider = tiny.make_target(tmp_path / "wider", "llama", num_hidden_layers=8, hidden_size=96, intermediate_size=192)
    code, _, err = cli("build", wider, "--drafter", tmp_path / "lc/draft-dspark-f32.gguf", "-o", tmp_path / "art")
    assert code == 2 and "width" in err and not (tmp_path / "art").exists(), err


def test_a_target_gguf_passed_as_a_drafter_is_refused_naming_its_architecture(artifact, tmp_path, tiny_target, cli):
    assert _export(cli, artifact, tmp_path / "lc")[0] == 0
    code, _, err = cli("build", tiny_target, "--drafter", tmp_path / "lc/target-f32.gguf", "-o", tmp_path / "no")
    assert code != 0 and "'llama' GGUF" in err and "import-gguf" in err and not (tmp_path / "no").exists(), err


def test_inspect_says_what_a_gguf_is_made_for(artifact, block_arts, tmp_path, cli):
    """`inspect FILE.gguf`: a drafter's target width, vocabulary and layers, a target's nextn layers."""
    assert _export(cli, artifact, tmp_path / "e3")[0] == 0
    code, out, _ = cli("inspect", tmp_path / "e3/draft-eagle3-f32.gguf", "--json")
    d = json.loads(out)
    assert code == 0 and (d["role"], d["drafter"], d["target_layers"], d["draft_vocab_size"]) == ("drafter", "EAGLE-3",
                                                                                                 AUX_IN, 256)
    assert d["target_hidden_size"] == json.loads((artifact / "specpack.json").read_text())["target"]["hidden_size"]
    assert _export(cli, block_arts["deepspec-dspark"], tmp_path / "ds")[0] == 0
    code, out, _ = cli("inspect", tmp_path / "ds/draft-dspark-f32.gguf")
    assert code == 0 and "DSpark (llama.cpp drafter GGUF)" in out and "anchor-first" in out and "Markov rank 8" in out
    code, out, _ = cli("inspect", tmp_path / "e3/target-f32.gguf", "--json")
    d = json.loads(out)
    assert code == 0 and (d["role"], d["architecture"], d["nextn_predict_layers"]) == ("target", "llama", 0)


def test_a_scaled_rope_stated_the_transformers_v5_way_is_refused(tmp_path, tiny_target, cli):
    """transformers v5 writes no `rope_scaling`, only `rope_parameters`: a llama3-scaled target written that
    way is scaled all the same, and this export does not write llama.cpp's rope factors yet."""
    import shutil

    target = shutil.copytree(tiny_target, tmp_path / "scaled")
    config = json.loads((target / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (target / "config.json").write_text(json.dumps(config))
    assert cli("build", target, "--drafter", "ngram", "-o", tmp_path / "art")[0] == 0
    code, _, err = cli("export", tmp_path / "art", "--to", "llama.cpp", "-o", tmp_path / "lc", "--gguf-pre", "gpt-2")
    assert code == 2 and "rope scaling" in err and "llama3" in err and not (tmp_path / "lc").exists(), err
