"""Artifact format v1: build → verify → inspect, for every EAGLE-3 layout and n-gram."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import eagle_layouts
from conftest import read_json

LAYOUTS = list(eagle_layouts.WRITERS)


def _write_head(kind, tmp_path, cfg, target, draft_vocab=256, **kw):
    t = eagle_layouts.random_head(cfg, draft_vocab=draft_vocab)
    if kind == "eagle3-sglang" and "embed" not in kw:
        from safetensors import safe_open

        with safe_open(target / "model.safetensors", "pt") as f:
            kw["embed"] = f.get_tensor("model.embed_tokens.weight")
    return t, eagle_layouts.WRITERS[kind](tmp_path / kind, t, cfg, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_builds_verifies_and_keeps_tensors_bit_identical(layout, tmp_path, tiny_target,
                                                                     tiny_cfg, keypair, cli):
    src, head = _write_head(layout, tmp_path, tiny_cfg, tiny_target)
    out = tmp_path / "art"
    code, stdout, err = cli("build", tiny_target, "--drafter", head, "-o", out, "--key",
                            keypair.private, "--json")
    assert code == 0, err + stdout
    assert json.loads(stdout)["signed"] is True
    code, stdout, err = cli("verify", out, "--key", keypair.public, "--json")
    assert code == 0, err + stdout
    assert json.loads(stdout)["signature_checked"] is True

    canonical = load_file(out / "drafter/model.safetensors")
    assert set(canonical) == set(src)  # t2d derived where the layout lacks it (ModelOpt)
    for name, tensor in src.items():
        assert canonical[name].dtype == tensor.dtype and torch.equal(canonical[name], tensor), name

    manifest = read_json(out / "specpack.json")
    d = manifest["drafter"]
    assert d["source_layout"] == layout and d["embedding_source"] == "target"
    assert d["aux_hidden_states"] == {"layer_ids": [2, 4, 5], "convention": "input_of_layer",
                                      "source_convention": "default", "produced_by": ["full+dense"] * 3}
    assert d["t2d_source"] == ("derived" if layout == "eagle3-modelopt" else "checkpoint")
    assert read_json(out / "drafter/config.json")["aux_layer_ids"] == [2, 4, 5]


@pytest.mark.parametrize("layout", ["eagle3-sglang", "eagle3-modelopt"])
def test_explicit_aux_ids_in_output_convention_are_converted(layout, tmp_path, tiny_target, tiny_cfg, cli):
    _, head = _write_head(layout, tmp_path, tiny_cfg, tiny_target, aux_ids=[1, 3, 4])
    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", head, "-o", out)[0] == 0
    aux = read_json(out / "specpack.json")["drafter"]["aux_hidden_states"]
    assert aux == {"layer_ids": [2, 4, 5], "convention": "input_of_layer", "source_ids": [1, 3, 4],
                   "source_convention": "output_of_layer", "produced_by": ["full+dense"] * 3}


def test_cli_aux_override(tmp_path, tiny_target, tiny_cfg, cli):
    _, head = _write_head("eagle3-official", tmp_path, tiny_cfg, tiny_target)
    out = tmp_path / "art"
    code, _, err = cli("build", tiny_target, "--drafter", head, "-o", out, "--aux-layer-ids", "1,3,6",
                       "--aux-convention", "input")
    assert code == 0, err
    assert read_json(out / "drafter/config.json")["aux_layer_ids"] == [1, 3, 6]


def test_ngram_artifact(tmp_path, tiny_target, cli):
    out = tmp_path / "art"
    code, _, err = cli("build", tiny_target, "--drafter", "ngram", "--ngram-max", "3", "--draft-len", "6",
                       "-o", out)
    assert code == 0, err
    d = read_json(out / "specpack.json")["drafter"]
    assert d == {"kind": "ngram", "min_n": 1, "max_n": 3, "draft_len": 6, "match": "latest"}
    assert not (out / "drafter").exists()
    code, stdout, _ = cli("verify", out)
    assert code == 0 and "UNSIGNED" in stdout


def test_ngram_artifact_that_copies_the_earliest_occurrence(tmp_path, tiny_target, cli):
    """`--ngram-match earliest` (vLLM's rule) is stated in the manifest and the card, and its drafts
    stay lossless."""
    import specpack

    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", "ngram", "--ngram-match", "earliest", "-o", out)[0] == 0
    assert read_json(out / "specpack.json")["drafter"]["match"] == "earliest"
    assert "followed its earliest earlier occurrence" in (out / "README.md").read_text()
    model = specpack.load(out)
    assert model.drafter.match == "earliest"
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    spec = model.generate(prompt, 24, draft_len=4, adaptive=False, eos_ids=())
    assert spec.tokens == model.generate(prompt, 24, speculative=False, eos_ids=()).tokens


def test_target_files_carried_byte_for_byte_and_hard_linked(tmp_path, tiny_target, cli):
    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", out)[0] == 0
    for name in os.listdir(tiny_target):
        assert (out / name).read_bytes() == (tiny_target / name).read_bytes(), name
    assert os.stat(out / "model.safetensors").st_ino == os.stat(tiny_target / "model.safetensors").st_ino
    files = {f["path"] for f in read_json(out / "specpack.json")["files"]}
    assert files == set(os.listdir(tiny_target)) | {"README.md"}


def test_artifact_loads_in_transformers_as_the_plain_target(tmp_path, tiny_target, tiny_cfg, cli):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, head = _write_head("eagle3-official", tmp_path, tiny_cfg, tiny_target)
    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", head, "-o", out)[0] == 0
    ids = AutoTokenizer.from_pretrained(out)("def add(a, b):", return_tensors="pt").input_ids
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(tiny_target).eval()(ids).logits
    assert torch.equal(got, want)


def test_inspect_summarises_bindings(tmp_path, tiny_target, tiny_cfg, cli):
    _, head = _write_head("eagle3-modelopt", tmp_path, tiny_cfg, tiny_target)
    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", head, "-o", out)[0] == 0
    code, text, _ = cli("inspect", out)
    assert code == 0
    assert "eagle3 from eagle3-modelopt" in text and "[2, 4, 5]" in text and "unsigned" in text
    code, js, _ = cli("inspect", out, "--json")
    data = json.loads(js)
    assert data["drafter"]["draft_vocab_size"] == 256 and data["signed"] is False
    assert data["memory"]["drafter_weight_bytes"] > 0


def test_sign_later_then_verify_with_upstream_model_signing(tmp_path, tiny_target, keypair, cli):
    from model_signing import verifying

    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", out)[0] == 0
    assert cli("sign", out, "--key", keypair.private)[0] == 0
    assert cli("verify", out, "--key", keypair.public)[0] == 0
    verifying.Config().use_elliptic_key_verifier(public_key=keypair.public).verify(out, out / "model.sig")


def test_wrong_key_fails(tmp_path, tiny_target, keypair, cli):
    from specpack.packager import keygen

    other = keygen(tmp_path / "other")
    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", out, "--key", keypair.private)[0] == 0
    code, _, err = cli("verify", out, "--key", other.public)
    assert code == 3 and "does not verify" in err


def test_schema_is_generated_from_models_and_checked_in():
    from specpack.schemas import SCHEMA_PATH, render_schema

    assert SCHEMA_PATH.read_text() == render_schema(), "run `python -m specpack.schemas`"


def test_manifest_validates_against_checked_in_schema(tmp_path, tiny_target, cli):
    import jsonschema

    from specpack.schemas import SCHEMA_PATH

    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", out)[0] == 0
    jsonschema.validate(read_json(out / "specpack.json"), json.loads(SCHEMA_PATH.read_text()))


def test_manifest_keeps_folder_names_not_local_paths(tmp_path, tiny_target, tiny_cfg, keypair, cli, monkeypatch):
    """`push` publishes specpack.json: it names the input folders, never where they were (issue 13,
    item 15); an artifact from before, with absolute paths, still verifies and loads."""
    import specpack
    from specpack.packager import sign_artifact

    _, head = _write_head("eagle3-official", tmp_path, tiny_cfg, tiny_target)
    monkeypatch.chdir(head)
    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", ".", "-o", out)[0] == 0
    text = (out / "specpack.json").read_text()
    manifest = json.loads(text)
    assert manifest["target"]["source"] == {"kind": "path", "path": tiny_target.name}
    assert manifest["drafter"]["source"] == {"kind": "path", "path": head.name}
    assert str(tmp_path) not in text and str(tiny_target.parent) not in text

    manifest["target"]["source"]["path"] = str(tiny_target)  # as older specpack wrote it
    manifest["drafter"]["source"]["path"] = str(head)
    (out / "specpack.json").write_text(json.dumps(manifest, indent=2))
    sign_artifact(out, keypair.private)
    assert specpack.load(out, public_key=keypair.public, require_signature=True).manifest.target.source.path == \
        str(tiny_target)
