"""MTP exports for vLLM, SGLang and TensorRT-LLM: the SGLang NextN checkpoint holds the canonical
tensors byte for byte and round-trips through specpack's importer; config-only exports match the
manifest and name target tensors that exist in the artifact's shards under the names each engine's
loader reads; bindings an engine computes differently are refused, naming the engines that can."""

import json
import shutil
import struct

import pytest
import yaml

import mtp_layouts as ml
from conftest import read_json
from specpack.exports import ENGINES, export_engine
from specpack.converters.safetensors_header import read_header
from specpack.errors import InputError, UnsupportedError
from specpack.packager import BuildOptions, build

L = ml.L  # target layers of the fixtures: DeepSeek's MTP layer k is model.layers.{L + k}


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """layout name -> artifact: in-target MTP of each family, one with layer reuse, MiMo and Qwen3-Next
    with two MTP layers, and one whose MTP layer was stored apart (target stripped)."""
    tmp = tmp_path_factory.mktemp("mtp-export")
    ds = ml.make_target(tmp / "ds", "mtp-deepseek", 1)
    mimo2 = ml.make_target(tmp / "mimo2", "mtp-mimo", 2)
    targets = {"deepseek": ds.path, "mimo": ml.make_target(tmp / "mimo", "mtp-mimo", 1).path,
               "mimo-2": mimo2.path, "qwen3-next": ml.make_qwen3_next(tmp / "q3n"),
               "qwen3-next-2": ml.make_qwen3_next(tmp / "q3n2", n=2)}
    out = {name: build(BuildOptions(target=t, drafter="mtp", out=tmp / f"art-{name}")).out
           for name, t in targets.items()}
    out["deepseek-reuse"] = build(BuildOptions(target=ds.path, drafter="mtp", out=tmp / "art-reuse",
                                               mtp_allow_reuse=True)).out
    stripped, head = ml.split_head(ds, tmp / "split")
    out["deepseek-apart"] = build(BuildOptions(target=stripped, drafter=str(head),
                                               out=tmp / "art-apart")).out
    out["stripped"] = stripped
    return out


def _shards(art) -> dict:
    """Tensor name -> (file, header entry) over the artifact's target shards."""
    out = {}
    for rel in read_json(art / "specpack.json")["target"]["weight_files"]:
        out.update({n: (art / rel, m) for n, m in read_header(art / rel).items()})
    return out


def _raw(path, meta) -> bytes:
    with open(path, "rb") as f:
        f.seek(8 + struct.unpack("<Q", f.read(8))[0] + meta.start)
        return f.read(meta.end - meta.start)


def _canonical_bytes(art) -> dict:
    """Canonical MTP name -> (dtype, shape, raw bytes), wherever the artifact keeps the tensor."""
    d = read_json(art / "specpack.json")["drafter"]
    if d["location"] == "drafter":
        path = art / d["weights"]
        return {n: (m.dtype, m.shape, _raw(path, m)) for n, m in read_header(path).items()}
    shards = _shards(art)
    return {c: (shards[s][1].dtype, shards[s][1].shape, _raw(*shards[s]))
            for c, s in read_json(art / "drafter/config.json")["tensors"].items()}


def _mapping(art) -> dict:
    return read_json(art / "drafter/config.json")["tensors"]


# ---- SGLang NextN: weights written ----

@pytest.mark.parametrize("name", ["deepseek", "deepseek-apart"])
def test_sglang_nextn_checkpoint_is_the_canonical_layer_byte_for_byte(name, arts, tmp_path):
    art = arts[name]
    r = export_engine(art, "sglang", tmp_path / "sg", tensor_parallel=4)
    out = tmp_path / "sg"
    cfg, target_cfg = read_json(out / "config.json"), read_json(art / "config.json")
    assert cfg["architectures"] == ["DeepseekV3ForCausalLMNextN"] and cfg["num_hidden_layers"] == 1
    assert {k: v for k, v in cfg.items() if k not in ("architectures", "num_hidden_layers")} == \
        {k: v for k, v in target_cfg.items() if k not in ("architectures", "num_hidden_layers")}
    # export_deepseek_nextn.py's naming: layer L -> layer 0, no embedding / head copies
    header = read_header(out / "model.safetensors")
    assert all(n.startswith("model.layers.0.") for n in header)
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in header)
    canonical = _canonical_bytes(art)
    published = {c: s.replace(f"model.layers.{L}.", "model.layers.0.")
                 for c, s in _mapping(arts["deepseek"]).items()}
    assert set(header) == set(published.values())
    for c, s in published.items():
        assert (header[s].dtype, header[s].shape, _raw(out / "model.safetensors", header[s])) == canonical[c], c
    for flag in ("--tp-size 4", "--speculative-algorithm EAGLE", f"--speculative-draft-model-path {out}",
                 "--speculative-num-steps 1", "--speculative-eagle-topk 1", "--speculative-num-draft-tokens 2",
                 f"--model-path {art}"):
        assert flag in r.command
    readme = (out / "README.md").read_text()
    assert r.command in readme and "## Bindings" in readme and "embedding first" in readme
    assert r.aux_layer_ids is None and r.kind == "mtp"


def test_sglang_nextn_round_trips_through_the_importer(arts, tmp_path):
    """Renamed back to the published layer index (what export_deepseek_nextn.py undid), the NextN
    tensors build into an artifact, on the stripped target, with the same canonical bytes."""
    from safetensors.torch import load_file, save_file

    export_engine(arts["deepseek"], "sglang", tmp_path / "sg")
    head = tmp_path / "head"
    head.mkdir()
    tensors = load_file(tmp_path / "sg/model.safetensors")
    save_file({n.replace("model.layers.0.", f"model.layers.{L}."): t for n, t in tensors.items()},
              head / "model.safetensors")
    shutil.copyfile(arts["deepseek"] / "config.json", head / "config.json")
    back = build(BuildOptions(target=arts["stripped"], drafter=str(head), out=tmp_path / "back")).out
    assert _canonical_bytes(back) == _canonical_bytes(arts["deepseek"])


# ---- config-only exports: the engine reads the target ----

def _under(shards, prefix) -> set:
    return {n for n in shards if n.startswith(prefix)}


def test_vllm_configs_name_tensors_the_loaders_find(arts, tmp_path):
    for name, prefix in (("deepseek", f"model.layers.{L}."), ("mimo", "model.mtp_layers."),
                         ("qwen3-next", "mtp.")):
        art, out = arts[name], tmp_path / name
        r = export_engine(art, "vllm", out, tensor_parallel=2)
        spec = read_json(out / "speculative_config.json")
        assert spec == {"method": "mtp", "num_speculative_tokens": 1}
        assert r.config == {"speculative_config": spec}
        assert sorted(p.name for p in out.iterdir()) == ["README.md", "speculative_config.json"]
        assert "--tensor-parallel-size 2" in r.command and '"method":"mtp"' in r.command
        shards, d = _shards(art), read_json(art / "specpack.json")["drafter"]
        # vLLM's loaders take every tensor under the MTP prefix (deepseek_mtp.py: the spec layers
        # L..L+n-1, embedding and head copies included; mimo_mtp.py: model.mtp_layers.*;
        # qwen3_next_mtp.py: mtp.*), plus the shared embedding / lm_head for MiMo and Qwen3-Next
        assert _under(shards, prefix) == set(_mapping(art).values()) | set(d["duplicates_checked"])
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(shards)
        # n_predict comes from the target config, and must be the manifest's layer count
        cfg = read_json(art / "config.json")
        assert (cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers")) == d["num_layers"] == 1
        assert f"`{prefix}" in (out / "README.md").read_text()


def test_sglang_qwen3_next_and_trtllm_deepseek_read_the_target(arts, tmp_path):
    art = arts["qwen3-next"]
    r = export_engine(art, "sglang", tmp_path / "sg", tensor_parallel=2)
    assert f"--speculative-draft-model-path {art}" in r.command
    assert "--speculative-algorithm EAGLE" in r.command
    assert _under(_shards(art), "mtp.") == set(_mapping(art).values())
    assert read_json(tmp_path / "sg/launch_flags.json")["--speculative-num-steps"] == "1"

    art = arts["deepseek"]
    r = export_engine(art, "trtllm", tmp_path / "trt", tensor_parallel=2)
    # llm_args.py MTPDecodingConfig: max_draft_len; num_nextn_predict_layers is deprecated (PR #12341)
    assert yaml.safe_load((tmp_path / "trt/extra-llm-api-config.yml").read_text()) == {
        "speculative_config": {"decoding_type": "MTP", "max_draft_len": 1}}
    assert "--tp_size 2" in r.command and "--backend pytorch" in r.command
    # TensorRT-LLM builds the MTP module from model.layers.{L}.* and shares embedding and head
    d = read_json(art / "specpack.json")["drafter"]
    mtp_layer = _under(_shards(art), f"model.layers.{L}.")
    assert mtp_layer - set(d["duplicates_checked"]) == set(_mapping(art).values())
    assert read_json(art / "config.json")["num_nextn_predict_layers"] == d["num_layers"]


def test_trtllm_qwen3_next_reads_the_mtp_layer_from_the_target(arts, tmp_path):
    """modeling_qwen3_next.py Qwen3NextMTP binds as the canonical Qwen3-Next MTP (embedding first,
    final-norm output in, zero-centred norms, normed output chained); its weight mapper reads mtp.*."""
    art = arts["qwen3-next"]
    r = export_engine(art, "trtllm", tmp_path / "trt", tensor_parallel=2)
    assert r.config == {"speculative_config": {"decoding_type": "MTP", "max_draft_len": 1}}
    assert sorted(p.name for p in (tmp_path / "trt").iterdir()) == ["README.md", "extra-llm-api-config.yml"]
    assert _under(_shards(art), "mtp.") == set(_mapping(art).values())
    readme = (tmp_path / "trt/README.md").read_text()
    for text in ("embedding first", "the target's final-norm output", "`mtp.*`", 'marks MTP "No"',
                 "num_nextn_predict_layers"):
        assert text in readme, text


def test_remote_code_targets_get_the_trust_flag(arts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(arts["qwen3-next"], art)
    cfg = read_json(art / "config.json")
    (art / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoConfig": "x.Config"}}))
    manifest = read_json(art / "specpack.json")  # keep the digest in step (unsigned artifact)
    from specpack.packager.hashing import sha256_file

    for f in manifest["files"]:
        if f["path"] == "config.json":
            f.update(size=(art / "config.json").stat().st_size, sha256=sha256_file(art / "config.json"))
    (art / "specpack.json").write_text(json.dumps(manifest))
    assert "--trust-remote-code" in export_engine(art, "vllm", tmp_path / "v").command
    assert "--trust-remote-code" in export_engine(art, "sglang", tmp_path / "s").command


# ---- draft length, layer reuse and refusals ----

def test_more_tokens_than_layers_needs_the_artifacts_reuse(arts, tmp_path):
    with pytest.raises(InputError, match="2 draft tokens asked for, but the MTP drafter has 1 layer"):
        export_engine(arts["deepseek"], "vllm", tmp_path / "x", draft_len=2)
    assert not (tmp_path / "x").exists()
    r = export_engine(arts["deepseek-reuse"], "vllm", tmp_path / "v", draft_len=3)
    assert read_json(tmp_path / "v/speculative_config.json")["num_speculative_tokens"] == 3
    assert "layer reuse" in (tmp_path / "v/README.md").read_text() and r.config["speculative_config"]
    # SGLang and TensorRT-LLM chain the post-norm output; this DeepSeek drafter chains the pre-norm one
    for engine in ("sglang", "trtllm"):
        with pytest.raises(UnsupportedError) as err:
            export_engine(arts["deepseek-reuse"], engine, tmp_path / engine, draft_len=3)
        assert err.value.hint == "engines that can: vllm"
        assert any("before the MTP final norm" in p for p in err.value.problems)
        assert not (tmp_path / engine).exists()


@pytest.mark.parametrize("name, draft_len, refusing, hint, says", [
    ("mimo", 1, {"sglang", "trtllm", "llama.cpp"}, "vllm", ["the target's final-norm output", "has no MiMo model"]),
    ("qwen3-next-2", 1, {"sglang", "trtllm", "llama.cpp"}, "vllm", ["TensorRT-LLM's loader takes 1 MTP layer(s)"]),
    ("mimo-2", 1, {"sglang", "trtllm", "llama.cpp"}, "vllm", ["loader takes 1 MTP layer(s); this drafter has 2"]),
    ("mimo-2", 2, set(ENGINES), "vllm with --draft-len 1", ["runs MTP layer 0 at every draft step"]),
    ("deepseek-apart", 1, {"vllm", "trtllm"}, "sglang, llama.cpp",
     ["lacks them (they are in drafter/model.safetensors)"]),
])
def test_what_an_engine_cannot_run_is_refused_naming_who_can(name, draft_len, refusing, hint, says, arts,
                                                               tmp_path):
    for engine in ENGINES:
        out = tmp_path / engine
        if engine not in refusing:  # (the tiny tokenizer's GPT-2 split stated for llama.cpp)
            export_engine(arts[name], engine, out, draft_len=draft_len, gguf_pre="gpt-2" if engine == "llama.cpp" else None)
            continue
        with pytest.raises(UnsupportedError) as err:
            export_engine(arts[name], engine, out, draft_len=draft_len)
        assert err.value.hint == f"engines that can: {hint}", engine
        assert not out.exists() and not list(tmp_path.glob(f".{engine}.*"))
    problems = []
    for engine in refusing:
        with pytest.raises(UnsupportedError) as err:
            export_engine(arts[name], engine, tmp_path / "again", draft_len=draft_len)
        problems += err.value.problems
    for text in says:
        assert any(text in p for p in problems), (text, problems)


def test_profile_crossover_schedules(arts, tmp_path):
    """One MTP layer (repeated: TensorRT-LLM's MTP-Eagle) takes the schedule on both engines; several
    layers run as TensorRT-LLM's vanilla MTP, which ignores it: the README says so instead."""
    from conftest import measured_profile, with_profiles

    one = with_profiles(arts["deepseek-reuse"], tmp_path / "one", measured_profile("mtp", 2, 4))
    v = export_engine(one, "vllm", tmp_path / "one-vllm").config["speculative_config"]
    assert v == {"method": "mtp", "num_speculative_tokens": 2,
                 "num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 1 << 16, 0]]}
    one = with_profiles(arts["deepseek"], tmp_path / "one-layer", measured_profile("mtp", 1, 4))
    export_engine(one, "trtllm", tmp_path / "one-trt")
    assert yaml.safe_load((tmp_path / "one-trt/extra-llm-api-config.yml").read_text())["speculative_config"] == {
        "decoding_type": "MTP", "max_draft_len": 1, "draft_len_schedule": {4: 1}}
    ds2 = ml.make_target(tmp_path / "ds2", "mtp-deepseek", 2)
    two = build(BuildOptions(target=ds2.path, drafter="mtp", out=tmp_path / "base2")).out
    two = with_profiles(two, tmp_path / "two", measured_profile("mtp", 1, 4))
    export_engine(two, "trtllm", tmp_path / "two-trt")
    spec = yaml.safe_load((tmp_path / "two-trt/extra-llm-api-config.yml").read_text())["speculative_config"]
    assert spec == {"decoding_type": "MTP", "max_draft_len": 1}
    assert "these 2 MTP layers as vanilla MTP" in (tmp_path / "two-trt/README.md").read_text()
