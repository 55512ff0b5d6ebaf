"""`serve --engine` keeps its promises (issue 49), against a fake engine (tests/fake_engine.py) that
records its argv, its command line as `ps` shows it and its environment: the API key reaches vLLM and
SGLang and never a command line, TensorRT-LLM (which takes no key) is refused beyond loopback, and a
file changed between the verify and the engine's load stops the engine."""

import json
import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from specpack import engines
from specpack.errors import UnsupportedError, VerificationError

TESTS = Path(__file__).parent
KEY = "s3cret-key-0123"
MODULES = {"vllm": "vllm/entrypoints/openai/api_server.py", "sglang": "sglang/launch_server.py"}


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_target):
    from specpack.packager import BuildOptions, NgramParams, build

    return build(BuildOptions(target=tiny_target, drafter="ngram", out=tmp_path_factory.mktemp("e") / "art",
                              ngram=NgramParams(1, 3, 4))).out


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Every engine's executable a fake: `python` (vLLM's and SGLang's) runs the fake's modules."""
    root = tmp_path / "engine"
    for module in MODULES.values():
        parts = Path(module).parts
        for i in range(1, len(parts)):
            (root / "pkgs" / Path(*parts[:i]) / "__init__.py").parent.mkdir(parents=True, exist_ok=True)
            (root / "pkgs" / Path(*parts[:i]) / "__init__.py").touch()
        (root / "pkgs" / module).write_text("from fake_engine import main\nmain()\n")
    python = _script(root / "bin/python", f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    _script(root / "bin/vllm", "#!/bin/sh\nexit 1\n")
    trt = _script(root / "bin/trtllm-serve", f'#!/bin/sh\nexec {sys.executable} {TESTS / "fake_engine.py"} "$@"\n')
    monkeypatch.setenv("SPECPACK_VLLM", str(root / "bin/vllm"))
    monkeypatch.setenv("SPECPACK_SGLANG", str(python))
    monkeypatch.setenv("SPECPACK_TRTLLM", str(trt))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root / "pkgs"), str(TESTS)]))
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_ENGINE_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("FAKE_ENGINE_SERVE_S", "2")
    for name in ("VLLM_API_KEY", "SPECPACK_API_KEY", "FAKE_ENGINE_TAMPER"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "record.json"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cli, artifact, engine, *args):
    return cli("serve", artifact, "--engine", engine, "--port", _port(), *args)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_api_key_reaches_the_engine_and_no_command_line(artifact, fake, cli, engine):
    code, out, err = _serve(cli, artifact, engine, "--api-key", KEY, "--host", "0.0.0.0")
    assert code == 0, err
    seen = json.loads(fake.read_text())
    assert not any(KEY in a for a in seen["cmdline"]), "the key is on the engine's command line (ps shows it)"
    assert KEY not in out + err
    if engine == "vllm":  # vLLM reads VLLM_API_KEY (its api_server: args.api_key or envs.VLLM_API_KEY)
        assert seen["env"]["VLLM_API_KEY"] == KEY
    else:  # SGLang's own --api-key, appended inside the process; the variable carrying it removed
        assert seen["argv"][-2:] == ["--api-key", KEY] and engines.KEY_ENV not in seen["env"]
        assert seen["argv"][0].endswith("sglang/launch_server.py")  # the launcher runs as __main__


def test_the_key_from_specpack_api_key_reaches_vllm_too(artifact, fake, cli, monkeypatch):
    monkeypatch.setenv("SPECPACK_API_KEY", KEY)
    code, _, err = _serve(cli, artifact, "vllm")
    assert code == 0, err
    assert json.loads(fake.read_text())["env"]["VLLM_API_KEY"] == KEY


def test_an_engine_beyond_loopback_without_a_key_gets_serves_warning(artifact, fake, cli, caplog):
    code, _, err = _serve(cli, artifact, "vllm", "--host", "0.0.0.0")
    assert code == 0, err
    assert "serving on 0.0.0.0 with no API key: anyone who can reach it can use the model" in caplog.text
    caplog.clear()
    assert _serve(cli, artifact, "vllm")[0] == 0 and "no API key" not in caplog.text  # loopback: no warning


@pytest.mark.parametrize("args, text", [
    (("--api-key", KEY), "takes no API key, so --api-key would be dropped"),
    (("--host", "0.0.0.0"), "takes no API key, so on 0.0.0.0 anyone who can reach it could use it"),
])
def test_trtllm_takes_no_key_so_it_is_refused_one_and_refused_beyond_loopback(artifact, fake, cli, args, text):
    code, _, err = _serve(cli, artifact, "trtllm", *args)
    assert code == 2 and text in err and "Traceback" not in err, err
    assert not fake.exists(), "the engine was started"
    assert _serve(cli, artifact, "trtllm")[0] == 0 and fake.exists()  # on loopback without a key it starts


def test_a_file_changed_between_the_verify_and_the_load_stops_the_engine(artifact, fake, cli, tmp_path, monkeypatch):
    import shutil

    art = shutil.copytree(artifact, tmp_path / "art")
    monkeypatch.setenv("FAKE_ENGINE_TAMPER", str(art / "config.json"))
    monkeypatch.setenv("FAKE_ENGINE_SERVE_S", "60")
    code, _, err = _serve(cli, art, "vllm")
    assert code == 3 and "are not the files verified before it started: it was stopped" in err, err
    assert "config.json: changed" in err
    assert json.loads(fake.read_text()).get("stopped") == "SIGTERM"


def test_a_changed_export_stops_the_engine_too(artifact, fake, monkeypatch):
    launch = engines.prepare(artifact, "vllm", port=_port())
    exported = launch.export_dir / launch.export_digests[0][0]
    monkeypatch.setenv("FAKE_ENGINE_TAMPER", str(exported))
    monkeypatch.setenv("FAKE_ENGINE_SERVE_S", "60")
    with pytest.raises(VerificationError) as e:
        engines.run(launch, poll_s=0.2)
    assert f"{exported}: changed since the export wrote it" in e.value.problems
    assert json.loads(fake.read_text()).get("stopped") == "SIGTERM"


def test_the_engine_server_used_by_tune_rechecks_as_well(artifact, fake, tmp_path, monkeypatch):
    import shutil

    from specpack.engines.server import EngineServer

    art = shutil.copytree(artifact, tmp_path / "art")
    monkeypatch.setenv("FAKE_ENGINE_TAMPER", str(art / "tokenizer.json"))
    monkeypatch.setenv("FAKE_ENGINE_SERVE_S", "60")
    with pytest.raises(VerificationError, match="it was stopped"):
        with EngineServer(engines.prepare(art, "vllm", port=_port()), start_timeout=60):
            pass
    assert json.loads(fake.read_text()).get("stopped") == "SIGTERM"


def test_an_unchanged_artifact_passes_the_recheck(artifact, fake):
    engines.recheck(engines.prepare(artifact, "vllm", port=_port()))
    with pytest.raises(UnsupportedError):
        engines.prepare(artifact, "trtllm", api_key=KEY)


@pytest.mark.parametrize("extra, option", [
    (("--host", "0.0.0.0"), "--host: set by specpack; use --host"),
    (("--api-key", KEY), "--api-key: set by specpack; use --api-key (or SPECPACK_API_KEY)"),
    ((f"--api_key={KEY}",), "--api-key: set by specpack"),
    (("--served-model-name", "other"), "use --model-name"),
    (("--model", "/somewhere/else"), "use the ARTIFACT argument"),
    (("--speculative-config", "{}"), "use the artifact's drafter"),
])
def test_engine_flags_specpack_sets_are_refused_after_the_separator(artifact, fake, cli, extra, option):
    """`-- --host 0.0.0.0` would listen everywhere with no key and no warning; `-- --api-key K` would put
    the key on the engine's command line and in specpack's `starting:` line (issue 63 item 5)."""
    code, out, err = _serve(cli, artifact, "vllm", "--host", "127.0.0.1", "--", *extra)
    assert code == 2 and option in err and KEY not in out + err and "Traceback" not in err, err
    assert not fake.exists(), "the engine was started"


def test_other_engine_flags_pass_through(artifact, fake, cli):
    code, _, err = _serve(cli, artifact, "vllm", "--", "--max-model-len", "512")
    assert code == 0, err
    assert json.loads(fake.read_text())["argv"][-2:] == ["--max-model-len", "512"]


def test_a_swap_put_back_after_the_load_passes_the_recheck_so_others_must_not_be_able_to_write(
        artifact, fake, cli, tmp_path, monkeypatch):
    """The hole (issue 63 item 1): a weight changed while the engine loads it and put back afterwards passes
    the re-hash. Only someone who can write the files can do that, so an artifact anyone else could write
    (a group-writable file or directory, up to /) is refused before the engine starts (StrictModes)."""
    import shutil

    art = shutil.copytree(artifact, tmp_path / "shared" / "art")
    monkeypatch.setenv("FAKE_ENGINE_SWAP", str(art / "model.safetensors"))
    (art / "model.safetensors").chmod(0o664)
    code, _, err = _serve(cli, art, "vllm")
    assert code == 3 and "could be changed by another user" in err and "model.safetensors: writable by its group" in err
    assert not fake.exists(), "the engine was started"
    (art / "model.safetensors").chmod(0o644)
    (tmp_path / "shared").chmod(0o777)
    code, _, err = _serve(cli, art, "vllm")
    assert code == 3 and "shared: writable by its group and everyone" in err and not fake.exists(), err
    (tmp_path / "shared").chmod(0o755)
    code, _, err = _serve(cli, art, "vllm")  # yours alone: it starts (a swap by you is yours to make)
    assert code == 0 and json.loads(fake.read_text())["loaded_swapped"], err


def test_a_file_owned_by_another_user_is_refused(artifact, fake, cli, tmp_path):
    import shutil

    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    art = shutil.copytree(artifact, tmp_path / "art")
    os.chown(art / "config.json", 4242, -1)
    code, _, err = _serve(cli, art, "vllm")
    assert code == 3 and "config.json: owned by uid 4242" in err and not fake.exists(), err
