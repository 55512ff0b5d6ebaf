"""Tampering: one changed byte, an added file or a deleted one fails verification, by name."""

import json
import os

import pytest

from specpack.errors import InputError, VerificationError


@pytest.fixture
def artifact(tmp_path, tiny_target, keypair, cli):
    out = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", out, "--key", keypair.private)[0] == 0
    return out


def _tamper(artifact, name):
    path = artifact / name
    data = bytearray(path.read_bytes())
    path.unlink()  # the file may be a hard link to the source target: replace, never write through
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "README.md",
                                  "specpack.json"])
def test_changed_byte_fails_and_is_named(artifact, keypair, cli, name):
    _tamper(artifact, name)
    code, out, err = cli("verify", artifact, "--key", keypair.public)
    assert code == 3, out + err
    assert name in err


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_changed_byte_fails_without_key_too(artifact, cli, name):
    _tamper(artifact, name)
    code, out, err = cli("verify", artifact, "--json")
    assert code == 3
    data = json.loads(out)
    assert any(p.startswith(f"{name}: changed") for p in data["problems"])


def test_added_and_deleted_files_are_named(artifact, keypair, cli):
    (artifact / "extra.bin").write_bytes(b"x")
    (artifact / "generation_config.json").unlink()
    code, _, err = cli("verify", artifact, "--key", keypair.public)
    assert code == 3
    assert "extra.bin: extra file" in err and "generation_config.json: missing" in err


def test_tampered_manifest_with_matching_digests_fails_the_signature(artifact, keypair, cli):
    manifest = json.loads((artifact / "specpack.json").read_text())
    manifest["drafter"]["max_n"] = 2
    (artifact / "specpack.json").write_text(json.dumps(manifest))
    assert cli("verify", artifact)[0] == 0  # digests alone cannot see it ...
    code, _, err = cli("verify", artifact, "--key", keypair.public)
    assert code == 3 and "specpack.json: changed since signing" in err  # ... the signature does


def test_symlink_in_artifact_is_refused(artifact, cli, tmp_path):
    (tmp_path / "outside.txt").write_text("x")
    (artifact / "link.txt").symlink_to(tmp_path / "outside.txt")
    code, _, err = cli("verify", artifact)
    assert code == 3 and "link.txt: is a link" in err


def test_require_signature(tmp_path, tiny_target, cli):
    out = tmp_path / "unsigned"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", out)[0] == 0
    code, _, err = cli("verify", out, "--require-signature")
    assert code == 3 and "no public key" in err


def test_unsigned_artifact_with_key_is_refused(tmp_path, tiny_target, keypair, cli):
    out = tmp_path / "unsigned"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", out)[0] == 0
    code, _, err = cli("verify", out, "--key", keypair.public)
    assert code == 3 and "not signed" in err


@pytest.mark.parametrize("command", [("verify",), ("inspect",), ("run", "--prompt", "hi")])
def test_a_path_that_is_no_artifact_is_a_user_error_not_a_failed_verification(tmp_path, tiny_target, cli, command):
    """Exit 3 means an artifact failed verification; a missing path or a plain model directory is exit 2."""
    for path in (tmp_path / "missing", tiny_target if command[0] == "run" else tmp_path):
        code, _, err = cli(command[0], path, *command[1:])
        assert code == 2 and err.startswith("error: ") and "hint:" in err, err


# ---- every file is listed: nothing rides along (issue 13, item 1) ----

@pytest.mark.parametrize("name", [".git/config", "sub/.git/config", ".gitattributes", ".cache/huggingface/x",
                                  ".github/workflows/ci.yml", "drafter/.DS_Store", ".huggingface/y"])
def test_unlisted_files_at_any_depth_are_refused(artifact, keypair, cli, name):
    path = artifact / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[core]\n\tfsmonitor = "touch pwned"\n')
    code, _, err = cli("verify", artifact, "--key", keypair.public, "--require-signature")
    assert code == 3 and f"{name}: extra file, not in the manifest" in err


def test_empty_and_odd_entries_are_refused(artifact, cli):
    (artifact / "empty" / "deeper").mkdir(parents=True)
    os.mkfifo(artifact / "pipe")
    code, _, err = cli("verify", artifact)
    assert code == 3
    assert "empty/deeper/: is an empty folder" in err and "pipe: is not a regular file" in err


# ---- every path read through the artifact's files is a listed file inside it (item 2) ----

def _relist(art):
    """Rewrite the manifest's files list from what is on disk, as an attacker with the key would."""
    from specpack.packager.hashing import sha256_file

    manifest = json.loads((art / "specpack.json").read_text())
    files = sorted(p for p in art.rglob("*") if p.is_file() and p.name not in ("specpack.json", "model.sig"))
    manifest["files"] = [{"path": p.relative_to(art).as_posix(), "size": p.stat().st_size,
                          "sha256": sha256_file(p)} for p in files]
    (art / "specpack.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def _sign_anyway(art, key):
    """Sign whatever is there, as `sign` did before it checked read paths."""
    from specpack.packager.hashing import sha256_file
    from specpack.packager.signing import sign

    manifest = json.loads((art / "specpack.json").read_text())
    digests = {f["path"]: f["sha256"] for f in manifest["files"]}
    digests["specpack.json"] = sha256_file(art / "specpack.json")
    sign(art, digests, key, manifest["name"])


@pytest.fixture
def escaping(tmp_path, keypair):
    """The attack of the issue: a signed sharded artifact whose index names ../elsewhere/<last shard>."""
    import tiny
    from specpack.packager import BuildOptions, build

    target = tiny.make_target(tmp_path / "t", "llama", shards=2, num_hidden_layers=4)
    art = build(BuildOptions(target=target, drafter="ngram", out=tmp_path / "art", link=False)).out
    shard = _move_last_shard_elsewhere(art)
    _relist(art)
    return art, shard


def _move_last_shard_elsewhere(folder):
    """Move the last shard to ../elsewhere/ and make the index name it there; return its name."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder.parent / "elsewhere").mkdir()
    (folder / shard).rename(folder.parent / "elsewhere" / shard)
    index["weight_map"] = {k: (f"../elsewhere/{shard}" if v == shard else v) for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return shard


def test_escaping_weight_map_is_refused_at_sign_verify_and_run(escaping, keypair, cli):
    import specpack
    from specpack.packager import sign_artifact
    from specpack.runtime.models.weights import checkpoint_files

    art, shard = escaping
    problem = f"model.safetensors.index.json: names '../elsewhere/{shard}', a path outside its folder"
    with pytest.raises(VerificationError) as exc:
        sign_artifact(art, keypair.private)
    assert problem in exc.value.problems and not (art / "model.sig").exists()

    _sign_anyway(art, keypair.private)
    code, _, err = cli("verify", art, "--key", keypair.public, "--require-signature")
    assert code == 3 and problem in err
    code, _, err = cli("run", art, "--prompt", "hi", "--key", keypair.public, "--max-new-tokens", "2")
    assert code == 3 and problem in err
    with pytest.raises(VerificationError, match="cannot be loaded safely"):
        specpack.load(art, verify=False)
    with pytest.raises(InputError, match="names weight files outside the model"):
        checkpoint_files(art)  # the loader's own guard


def test_escaping_weight_map_is_refused_at_build(tmp_path, cli):
    import tiny

    target = tiny.make_target(tmp_path / "t", "llama", shards=2, num_hidden_layers=4)
    _move_last_shard_elsewhere(target)
    code, _, err = cli("build", target, "--drafter", "ngram", "-o", tmp_path / "art")
    assert code == 2 and "escapes its directory" in err and not (tmp_path / "art").exists()


def test_index_naming_an_unlisted_or_hidden_file_is_refused(artifact, cli):
    """Inside the artifact is not enough: the file must be listed (and so digested)."""
    (artifact / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": ".cache/w.safetensors"}}))
    _relist(artifact)
    (artifact / ".cache").mkdir()
    (artifact / ".cache/w.safetensors").write_bytes(b"x")
    code, _, err = cli("verify", artifact)
    assert code == 3 and ".cache/w.safetensors: extra file" in err
    assert "names '.cache/w.safetensors', which is not a file listed in the manifest" in err


def test_onnx_external_data_outside_the_export_is_refused(artifact, cli, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    weight = helper.make_tensor("w", TensorProto.FLOAT, [256], bytes(1024), raw=True)
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256])], [weight])
    model = helper.make_model(graph)
    onnx.external_data_helper.convert_model_to_external_data(model, location="../../../outside.bin",
                                                             size_threshold=0)
    folder = artifact / "exports/onnx"
    folder.mkdir(parents=True)
    (folder / "target.onnx").write_bytes(model.SerializeToString())  # onnx.save_model refuses '..' itself
    (folder / "weights.bin").write_bytes(b"\0" * 1024)
    io = {"inputs": [], "outputs": [{"name": "y", "dtype": "float32", "shape": [256]}]}
    index = {"opset": 17, "data_file": "exports/onnx/weights.bin", "max_verify_tokens": 5, "drafter_kind": "ngram",
             "exporter": "test", "graphs": [{"role": "target_step", "path": "exports/onnx/target.onnx",
                                             "num_layers": 1, **io}]}
    (folder / "index.json").write_text(json.dumps(index))
    _relist(artifact)
    code, _, err = cli("verify", artifact)
    assert code == 3 and "exports/onnx/target.onnx: names '../../../outside.bin', a path outside its folder" in err
