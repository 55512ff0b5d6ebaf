"""Exports for vLLM, SGLang and TensorRT-LLM: layouts, aux ids in each engine's convention,
serve commands, round trips back through specpack's own importer, and refusals that name the
engines that can."""

import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

import eagle_layouts
from conftest import read_json
from specpack.converters import eagle3
from specpack.converters.base import AuxOverride
from specpack.exports import ENGINES, export_engine
from specpack.errors import InputError, OutputError, UnsupportedError, VerificationError
from specpack.packager import BuildOptions, NgramParams, build

AUX_IN = [1, 3, 6]  # explicit, not the defaults: a convention mix-up would show
AUX_OUT = [0, 2, 5]


def _head(tmp_path, tiny_cfg, tiny_target, embed=None, **config_over):
    t = eagle_layouts.random_head(tiny_cfg, draft_vocab=256)
    if embed is None:
        with safe_open(tiny_target / "model.safetensors", "pt") as f:
            embed = f.get_tensor("model.embed_tokens.weight")
    head = eagle_layouts.write_sglang(tmp_path / "head", t, tiny_cfg, embed=embed)
    if config_over:
        cfg = read_json(head / "config.json")
        (head / "config.json").write_text(json.dumps({**cfg, **config_over}))
    return head


def _build(tmp_path, tiny_target, drafter, aux=AUX_IN, name="art"):
    opts = BuildOptions(target=tiny_target, drafter=str(drafter), out=tmp_path / name,
                        aux=AuxOverride(tuple(aux), "input_of_layer") if aux else None)
    return build(opts).out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_target, tiny_cfg):
    tmp = tmp_path_factory.mktemp("export")
    return _build(tmp, tiny_target, _head(tmp, tiny_cfg, tiny_target))


def _canonical(art):
    return load_file(art / "drafter/model.safetensors")


def _assert_same_tensors(got: dict, want: dict):
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_vllm_speculators_layout(artifact, tmp_path):
    r = export_engine(artifact, "vllm", tmp_path / "vllm", tensor_parallel=2, draft_len=3)
    cfg = read_json(tmp_path / "vllm/config.json")
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX_IN  # vLLM counts input of layer i
    assert cfg["norm_before_residual"] is False  # explicit: vLLM defaults it to true
    assert cfg["draft_vocab_size"] == 256 and cfg["target_hidden_size"] == 64
    layer = cfg["transformer_layer_config"]
    assert layer["vocab_size"] == 384 and layer["num_hidden_layers"] == 1
    assert layer["tie_word_embeddings"] is False
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": str(artifact.absolute()),
                                "architectures": ["LlamaForCausalLM"]}
    # the canonical names are the speculators names: the weights are the artifact's, bit for bit
    assert (tmp_path / "vllm/model.safetensors").read_bytes() == \
        (artifact / "drafter/model.safetensors").read_bytes()
    assert (r.aux_layer_ids, r.aux_convention) == (AUX_IN, "input_of_layer")
    assert "--tensor-parallel-size 2" in r.command and '"method":"eagle3"' in r.command
    assert r.command in (tmp_path / "vllm/README.md").read_text()


def test_vllm_round_trip(artifact, tmp_path, tiny_target):
    """Through specpack's importer once it reads the speculators layout (issue 5); until then by
    reading the exported tensors back (names are identical) and the config's aux ids."""
    export_engine(artifact, "vllm", tmp_path / "vllm")
    if "eagle3-speculators" in eagle3.LAYOUTS:
        back = _build(tmp_path, tiny_target, tmp_path / "vllm", aux=None, name="back")
        _assert_same_tensors(_canonical(back), _canonical(artifact))
        assert read_json(back / "specpack.json")["drafter"]["aux_hidden_states"]["layer_ids"] == AUX_IN
    else:
        _assert_same_tensors(load_file(tmp_path / "vllm/model.safetensors"), _canonical(artifact))
        assert read_json(tmp_path / "vllm/config.json")["eagle_aux_hidden_state_layer_ids"] == AUX_IN


@pytest.mark.parametrize("engine, head_dir", [("sglang", "."), ("trtllm", "draft")])
def test_sglang_and_trtllm_layouts_round_trip_through_the_importer(engine, head_dir, artifact,
                                                                   tmp_path, tiny_target):
    r = export_engine(artifact, engine, tmp_path / engine, tensor_parallel=4)
    head = tmp_path / engine / head_dir
    cfg = read_json(head / "config.json")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX_OUT  # output of layer i
    names = set(load_file(head / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in names and not any(n.startswith("layers.") for n in names)
    assert (r.aux_layer_ids, r.aux_convention) == (AUX_OUT, "output_of_layer")

    back = _build(tmp_path, tiny_target, head, aux=None, name="back")
    _assert_same_tensors(_canonical(back), _canonical(artifact))
    aux = read_json(back / "specpack.json")["drafter"]["aux_hidden_states"]
    assert aux == {"layer_ids": AUX_IN, "convention": "input_of_layer", "source_ids": AUX_OUT,
                   "source_convention": "output_of_layer", "produced_by": ["full+dense"] * len(AUX_IN)}


def test_sglang_command(artifact, tmp_path):
    r = export_engine(artifact, "sglang", tmp_path / "sg", tensor_parallel=4, draft_len=5)
    for flag in ("--tp-size 4", "--speculative-algorithm EAGLE3", "--speculative-num-steps 5",
                 "--speculative-eagle-topk 1", "--speculative-num-draft-tokens 6",
                 f"--speculative-draft-model-path {tmp_path / 'sg'}", f"--model-path {artifact}"):
        assert flag in r.command
    assert r.command in (tmp_path / "sg/README.md").read_text()


def test_trtllm_config_and_command(artifact, tmp_path):
    r = export_engine(artifact, "trtllm", tmp_path / "trt", tensor_parallel=4, draft_len=3)
    spec = yaml.safe_load((tmp_path / "trt/extra-llm-api-config.yml").read_text())["speculative_config"]
    assert spec == {"decoding_type": "Eagle3", "max_draft_len": 3,
                    "speculative_model_dir": str(tmp_path / "trt/draft"), "eagle3_one_model": True,
                    "eagle3_layers_to_capture": AUX_OUT}
    assert "--tp_size 4" in r.command and "--backend pytorch" in r.command
    assert f"--extra_llm_api_options {tmp_path / 'trt/extra-llm-api-config.yml'}" in r.command


def test_ngram_exports(tmp_path, tiny_target):
    art = build(BuildOptions(target=tiny_target, drafter="ngram", out=tmp_path / "art",
                             ngram=NgramParams(2, 5, 6))).out
    v = export_engine(art, "vllm", tmp_path / "v")
    assert read_json(tmp_path / "v/speculative_config.json") == {
        "method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert '"method":"ngram"' in v.command
    assert "copies what followed the suffix's *earliest* occurrence" in (tmp_path / "v/README.md").read_text()
    early = build(BuildOptions(target=tiny_target, drafter="ngram", out=tmp_path / "early",
                               ngram=NgramParams(2, 5, 6, "earliest"))).out
    export_engine(early, "vllm", tmp_path / "v-early")
    assert "earliest" not in (tmp_path / "v-early/README.md").read_text()
    s = export_engine(art, "sglang", tmp_path / "s", tensor_parallel=2)
    # SGLang 0.5.10+ (server_args.py): the trie depth bounds match + proposal; the window flags are gone
    assert read_json(tmp_path / "s/launch_flags.json") == {
        "--speculative-algorithm": "NGRAM", "--speculative-num-draft-tokens": "7",
        "--speculative-ngram-max-trie-depth": "11"}
    assert "--tp-size 2" in s.command and "match-window" not in s.command and "branch-length" not in s.command
    readme = (tmp_path / "s/README.md").read_text()
    assert "Needs SGLang 0.5.10 or later" in readme and "minimum n (2)" in readme
    export_engine(art, "trtllm", tmp_path / "t")
    spec = yaml.safe_load((tmp_path / "t/extra-llm-api-config.yml").read_text())["speculative_config"]
    assert spec == {"decoding_type": "NGram", "max_draft_len": 6, "max_matching_ngram_size": 5}
    assert "minimum n (2)" in (tmp_path / "t/README.md").read_text()


@pytest.mark.parametrize("case, refusing, can", [
    ("norm_before_residual", {"sglang", "trtllm", "llama.cpp"}, "vllm"),
    ("own_embedding", {"sglang", "trtllm"}, "vllm, llama.cpp"),
    # input of layer 0 is SGLang's id -1: captured before layer 0 as hidden + residual, residual None
    ("embedding_layer", {"sglang", "trtllm"}, "vllm, llama.cpp"),
    # llama.cpp concatenates the states in the order its target_layers list them (common/speculative.cpp)
    ("unsorted", set(ENGINES) - {"llama.cpp"}, "llama.cpp"),
    ("narrow_own_embedding", set(), ""),  # SGLang keeps a narrower head's own embedding (set_embed)
])
def test_unrepresentable_heads_are_refused_naming_who_can(case, refusing, can, tmp_path, tiny_target,
                                                          tiny_cfg):
    aux, over, embed = AUX_IN, {}, None
    if case == "norm_before_residual":
        over = {"norm_before_residual": True}
    elif case == "own_embedding":
        embed = torch.randn(tiny_cfg.vocab_size, tiny_cfg.hidden_size)
    elif case == "embedding_layer":
        aux = [0, 3, 6]
    elif case == "unsorted":
        aux = [6, 1, 3]
    head = (eagle_layouts.write_narrow(tmp_path / "head", tiny_cfg, 32, embed=True) if case.startswith("narrow")
            else _head(tmp_path, tiny_cfg, tiny_target, embed, **over))
    art = _build(tmp_path, tiny_target, head, aux)
    for engine in ENGINES:
        out = tmp_path / f"out-{engine}"
        if engine not in refusing:  # the tiny tokenizer's pre-tokenizer is stated for llama.cpp
            export_engine(art, engine, out, **({"gguf_pre": "gpt-2"} if engine == "llama.cpp" else {}))
            continue
        with pytest.raises(UnsupportedError) as err:
            export_engine(art, engine, out)
        assert f"engines that can: {can}" in err.value.hint and err.value.problems
        assert not out.exists()


def test_a_narrow_head_without_its_own_embedding_is_never_exported(tmp_path, tiny_target, tiny_cfg,
                                                                    monkeypatch):
    """Builds refuse such a head (test_build_errors); an artifact that holds one anyway (built before
    they did) is refused by every engine: nothing can feed its 32-wide layer token embeddings."""
    monkeypatch.setattr(eagle3, "_embedding_problems", lambda *a: [])
    art = _build(tmp_path, tiny_target, eagle_layouts.write_narrow(tmp_path / "head", tiny_cfg, 32))
    assert read_json(art / "specpack.json")["drafter"]["embedding_source"] == "target"
    for engine in ENGINES:
        with pytest.raises(UnsupportedError) as err:
            export_engine(art, engine, tmp_path / engine)
        assert err.value.hint == "engines that can: none of the export engines; serve it with specpack"
        assert any("the head (hidden 32) has no embedding of its own" in p for p in err.value.problems)
        assert not (tmp_path / engine).exists()


def test_bad_inputs(artifact, tmp_path):
    with pytest.raises(InputError, match="unknown engine 'tgi'"):
        export_engine(artifact, "tgi", tmp_path / "x")
    with pytest.raises(InputError, match="invalid export options"):
        export_engine(artifact, "vllm", tmp_path / "x", draft_len=0)
    (tmp_path / "taken").mkdir()
    with pytest.raises(OutputError):
        export_engine(artifact, "vllm", tmp_path / "taken")
    assert not (tmp_path / "x").exists()


def test_tampered_artifact_is_not_exported(artifact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    weights = copy / "drafter/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(VerificationError):
        export_engine(copy, "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))


def test_vllm_config_validates_with_speculators(artifact, tmp_path):
    """The speculators package's own config classes accept the export (skipped when absent: its
    pip dependencies would replace this venv's transformers)."""
    config_mod = pytest.importorskip("speculators.models.eagle3.config")
    export_engine(artifact, "vllm", tmp_path / "vllm")
    cfg = config_mod.Eagle3SpeculatorConfig.model_validate(read_json(tmp_path / "vllm/config.json"))
    assert cfg.eagle_aux_hidden_state_layer_ids == AUX_IN and cfg.draft_vocab_size == 256
    assert cfg.speculators_config.proposal_methods[0].speculative_tokens >= 1


# ---- the measured concurrency crossover as the engines' batch-size schedules ----

def _yaml_spec(out):
    return yaml.safe_load((out / "extra-llm-api-config.yml").read_text())["speculative_config"]


def test_profile_crossover_becomes_the_engines_schedules(artifact, tmp_path):
    """The fastest valid cuda profile: its draft length up to its max concurrency, none above (vLLM's
    inclusive ranges from 1; TensorRT-LLM's batch-size keys, the smallest equal to max_draft_len)."""
    from conftest import measured_profile, with_profiles

    cpu = measured_profile("eagle3", 5, 2, device="cpu", backend="torch", speedup=3.0)  # faster, but not on cuda
    never = measured_profile("eagle3", speculative=False, backend="onnxruntime", speedup=4.0)
    slower = measured_profile("eagle3", 2, 4, gpu="NVIDIA A100", speedup=1.2)
    best = measured_profile("eagle3", 3, 8, concurrency=(1, 4, 8, 16))
    art = with_profiles(artifact, tmp_path / "art", cpu, never, slower, best)
    v = export_engine(art, "vllm", tmp_path / "vllm")
    assert v.config["speculative_config"]["num_speculative_tokens"] == 3  # the profile's draft length
    assert v.config["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 8, 3], [9, 1 << 16, 0]]
    assert '"num_speculative_tokens_per_batch_size":[[1,8,3],[9,65536,0]]' in v.command
    readme = (tmp_path / "vllm/README.md").read_text()
    assert "## Draft length by concurrency" in readme and best.id in readme and "up to 8 concurrent" in readme
    t = export_engine(art, "trtllm", tmp_path / "trtllm")
    spec = _yaml_spec(tmp_path / "trtllm")
    assert spec["draft_len_schedule"] == {8: 3} and spec["max_draft_len"] == 3 and "max_concurrency" not in spec
    assert t.config["speculative_config"]["draft_len_schedule"] == {8: 3}
    assert "min_runtime_draft_len" in (tmp_path / "trtllm/README.md").read_text()
    s = export_engine(art, "sglang", tmp_path / "sglang")
    assert "per_batch" not in s.command and "has no batch-size draft-length setting" in \
        (tmp_path / "sglang/README.md").read_text()


def test_a_crossover_measured_with_prompt_lookup_is_written_with_a_note(artifact, tmp_path):
    """The engines do not run specpack's prompt lookup beside a head: the README says the crossover
    was measured with it."""
    from conftest import measured_profile, with_profiles

    art = with_profiles(artifact, tmp_path / "art", measured_profile("eagle3", 3, 8, lookup=8))
    v = export_engine(art, "vllm", tmp_path / "vllm")
    assert v.config["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 8, 3], [9, 1 << 16, 0]]
    readme = " ".join((tmp_path / "vllm/README.md").read_text().split())
    assert "with prompt lookup (copies of up to 8 tokens" in readme and "--lookups none" in readme


def test_choosing_the_profile_and_the_draft_length(artifact, tmp_path):
    from conftest import measured_profile, with_profiles

    cpu = measured_profile("eagle3", 4, 2, concurrency=(1, 2), device="cpu", backend="torch")
    best = measured_profile("eagle3", 3, 16, concurrency=(1, 4, 16))
    never = measured_profile("eagle3", speculative=False, backend="onnxruntime")
    art = with_profiles(artifact, tmp_path / "art", cpu, best, never)
    spec = export_engine(art, "vllm", tmp_path / "none", profile="none").config["speculative_config"]
    assert "num_speculative_tokens_per_batch_size" not in spec
    # a draft length of its own: the default profile is left out, and the README says why
    r = export_engine(art, "vllm", tmp_path / "own", draft_len=2)
    assert "num_speculative_tokens_per_batch_size" not in r.config["speculative_config"]
    assert "was not used (it measured 3 draft tokens, not the 2 asked for)" in (tmp_path / "own/README.md").read_text()
    # a named profile, even a cpu one, brings its draft length; the README warns where it was measured
    r = export_engine(art, "vllm", tmp_path / "cpu", profile=cpu.name)
    assert r.config["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 1 << 16, 0]]
    readme = (tmp_path / "cpu/README.md").read_text()
    assert "not measured on cuda" in readme and "highest concurrency measured" in readme  # 2 was the top level
    with pytest.raises(InputError, match="--draft-len 2 differs") as e:
        export_engine(art, "vllm", tmp_path / "x", draft_len=2, profile=best.id[:6])
    assert "--profile none" in e.value.hint
    with pytest.raises(InputError, match="never paid"):
        export_engine(art, "vllm", tmp_path / "x", profile=never.name)
    with pytest.raises(InputError, match="no profile named 'nope'") as e:
        export_engine(art, "trtllm", tmp_path / "x", profile="nope")
    assert best.name in e.value.hint and not (tmp_path / "x").exists()


def test_edited_profiles_are_not_used(artifact, tmp_path):
    from conftest import measured_profile, with_profiles

    from specpack.packager.artifact import read_manifest

    art = with_profiles(artifact, tmp_path / "art", measured_profile("eagle3", 3, 8))
    manifest_path = art / "specpack.json"
    data = json.loads(manifest_path.read_text())
    data["profiles"][0]["settings"]["max_concurrency"] = 64  # an edit after tuning: its id no longer matches
    manifest_path.write_text(json.dumps(data))
    assert read_manifest(art).profiles[0].settings.max_concurrency == 64
    r = export_engine(art, "vllm", tmp_path / "vllm")
    assert "num_speculative_tokens_per_batch_size" not in r.config["speculative_config"]
    with pytest.raises(InputError, match="not valid") as e:
        export_engine(art, "vllm", tmp_path / "named", profile=data["profiles"][0]["name"])
    assert any("edited" in p for p in e.value.problems)


def test_ngram_schedules(tmp_path, tiny_target):
    from conftest import measured_profile, with_profiles

    art = build(BuildOptions(target=tiny_target, drafter="ngram", out=tmp_path / "base",
                             ngram=NgramParams(2, 5, 6))).out
    art = with_profiles(art, tmp_path / "art", measured_profile("ngram", 4, 2, concurrency=(1, 2, 4)))
    v = export_engine(art, "vllm", tmp_path / "vllm").config["speculative_config"]
    assert v["num_speculative_tokens"] == 4 and v["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 1 << 16, 0]]
    assert read_json(tmp_path / "vllm/speculative_config.json") == v
    export_engine(art, "trtllm", tmp_path / "trtllm")
    assert _yaml_spec(tmp_path / "trtllm")["draft_len_schedule"] == {2: 4}


def test_cli_export_with_a_profile(artifact, tmp_path, cli):
    from conftest import measured_profile, with_profiles

    p = measured_profile("eagle3", 3, 8)
    art = with_profiles(artifact, tmp_path / "art", p)
    code, out, err = cli("export", art, "--to", "trtllm", "-o", tmp_path / "t", "--profile", p.name, "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["speculative_config"]["draft_len_schedule"] == {"8": 3}
    code, out, err = cli("export", art, "--to", "vllm", "-o", tmp_path / "v", "--profile", "nope")
    assert code == 2 and "error: the artifact has no profile named 'nope'" in err and "Traceback" not in err


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_a_tensor_parallel_size_that_does_not_split_the_target_is_refused(tmp_path, tiny_target, cli, tp):
    """SmolLM2 (9 heads, 3 KV heads) exported with --tensor-parallel-size 4 is refused by vLLM at start;
    the export refuses it first and names the sizes that work (issue 63 item 7)."""
    from specpack.packager import read_manifest

    art = tmp_path / "art"
    assert cli("build", tiny_target, "--drafter", "ngram", "-o", art)[0] == 0
    t = read_manifest(art).target
    code, _, err = cli("export", art, "--to", "vllm", "--tp", tp, "-o", tmp_path / "v")
    splits = t.num_attention_heads % tp == 0 and t.intermediate_size % tp == 0 and \
        (t.num_key_value_heads % tp == 0 or tp % t.num_key_value_heads == 0)
    assert (code == 0) == splits, err
    assert not (splits and tp == 3)  # the tiny target's 4 heads never split three ways
    if not splits:
        assert code == 2 and f"--tp {tp} does not split this target" in err and "valid tensor-parallel sizes: 1" in err
