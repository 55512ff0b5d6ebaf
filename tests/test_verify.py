"""Tampering: one changed byte, an added file or a deleted one fails verification, by name."""

import json

import pytest


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


def test_not_an_artifact(tmp_path, cli):
    code, _, err = cli("verify", tmp_path)
    assert code == 3 and "not a specpack artifact" in err
