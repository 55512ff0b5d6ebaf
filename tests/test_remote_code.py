"""A target's own code (auto_map, unknown tokenizer classes) is refused by build unless allowed, recorded when
allowed, and never run: not by build, inspect, verify or run, whatever stdin holds; Python files nothing
names (DeepSeek's inference/) are carried as files."""

import io
import json
import shutil
import sys

import pytest

AUTO_MAP = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}


def _target(tiny_target, tmp_path, tokenizer_class="EvilTokenizer", auto_map=True, code=True):
    """The tiny target with a tokenizer that names evil.py, which leaves a marker file when imported."""
    t = shutil.copytree(tiny_target, tmp_path / "target")
    marker = tmp_path / "MARKER"
    if code:
        (t / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                   "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class=tokenizer_class, **({"auto_map": AUTO_MAP} if auto_map else {}))
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    return t, marker


def _config_auto_map(tiny_target, tmp_path):
    t = shutil.copytree(tiny_target, tmp_path / "target")
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    return t


@pytest.mark.parametrize("case, reasons", [
    ("all", ["tokenizer_config.json: auto_map AutoTokenizer -> ['evil.EvilTokenizer', 'evil.EvilTokenizer']",
             "tokenizer_config.json: tokenizer_class EvilTokenizer is not a transformers class"]),
    ("unknown tokenizer class only", ["tokenizer_class EvilTokenizer is not a transformers class"]),
    ("config auto_map only", ["config.json: auto_map AutoConfig -> configuration_x.XConfig"]),
])
def test_build_refuses_a_target_that_needs_its_own_code(tiny_target, tmp_path, cli, case, reasons):
    if case == "config auto_map only":
        target, marker = _config_auto_map(tiny_target, tmp_path), tmp_path / "MARKER"
    else:
        target, marker = _target(tiny_target, tmp_path, tokenizer_class="TokenizersBackend"
                                 if case == "py file only" else "EvilTokenizer",
                                 auto_map=case == "all", code=case != "unknown tokenizer class only")
    code, out, err = cli("build", target, "--drafter", "ngram", "-o", tmp_path / "art")
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, out + err
    assert "needs code of its own" in err and "--allow-remote-code" in err
    for reason in reasons:
        assert reason in err
    assert not (tmp_path / "art").exists() and not marker.exists()


@pytest.fixture
def allowed(tiny_target, tmp_path, cli):
    """(artifact, marker): built with --allow-remote-code from a target whose tokenizer needs evil.py."""
    target, marker = _target(tiny_target, tmp_path)
    code, out, err = cli("build", target, "--drafter", "ngram", "-o", tmp_path / "art", "--allow-remote-code")
    assert code == 0, out + err
    return tmp_path / "art", marker


def test_python_files_no_loader_names_are_carried_as_files(tiny_target, tmp_path, cli):
    """DeepSeek-V4 releases ship `inference/` (DeepSeek's reference code and its config.json) with no
    auto_map: nothing executes it, so it is carried byte for byte and the target needs no code."""
    target = shutil.copytree(tiny_target, tmp_path / "target")
    (target / "inference").mkdir()
    (target / "inference" / "model.py").write_text("raise SystemExit('never imported')\n")
    (target / "inference" / "config.json").write_text('{"n_mtp_layers": 3}')
    code, out, err = cli("build", target, "--drafter", "ngram", "-o", tmp_path / "art")
    manifest = json.loads((tmp_path / "art" / "specpack.json").read_text())
    assert code == 0 and manifest["target"].get("remote_code") is None, out + err
    assert (tmp_path / "art" / "inference" / "model.py").read_bytes() == (target / "inference" / "model.py").read_bytes()


def test_allowed_code_is_recorded_in_the_manifest_and_shown(allowed, cli):
    art, marker = allowed
    remote = json.loads((art / "specpack.json").read_text())["target"]["remote_code"]
    assert remote["allowed"] is True and remote["files"] == ["evil.py"] and len(remote["reasons"]) == 2
    code, out, _ = cli("inspect", art)
    assert code == 0 and "remote code" in out and "evil.py" in out and "never runs it" in out
    assert json.loads(cli("inspect", art, "--json")[1])["target"]["remote_code"] == remote
    assert cli("verify", art)[0] == 0  # evil.py is listed and digested like any file
    assert not marker.exists()


@pytest.mark.parametrize("stdin", ["", "y\n"])
def test_run_never_runs_the_code_nor_asks(allowed, cli, monkeypatch, stdin):
    art, marker = allowed
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))  # closed stdin, or a user who would say yes
    code, out, err = cli("run", art, "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and "Traceback" not in err and "[y/N]" not in out + err, out + err
    assert "the tokenizer of" in err and "needs code of its own, which specpack never runs" in err
    assert not marker.exists()


def test_run_uses_the_library_tokenizer_when_transformers_has_the_class(tiny_target, tmp_path, cli, monkeypatch):
    target, marker = _target(tiny_target, tmp_path, tokenizer_class="TokenizersBackend")
    assert cli("build", target, "--drafter", "ngram", "-o", tmp_path / "art", "--allow-remote-code")[0] == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = cli("run", tmp_path / "art", "--prompt", "x", "--max-new-tokens", "2")
    assert code == 0, out + err
    assert not marker.exists()


@pytest.mark.parametrize("stdin", ["", "y\n"])
def test_the_tokenizer_loader_never_runs_code(tiny_target, tmp_path, monkeypatch, stdin):
    """However the artifact was made (by hand, by an older specpack): the code stays unrun."""
    from specpack.errors import InputError
    from specpack.runtime.api import load_tokenizer

    target, marker = _target(tiny_target, tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    with pytest.raises(InputError, match="needs code of its own"):
        load_tokenizer(target)
    assert not marker.exists()
