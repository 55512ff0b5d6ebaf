"""Block drafters exported for vLLM, SGLang and TensorRT-LLM: each engine's method and draft-token
count, target layer ids in each engine's convention, round trips back through the importer, and
refusals that name the engines that can."""

import pytest
import torch
import yaml
from safetensors.torch import load_file

import block_layouts as bl
from conftest import read_json
from test_block_convert import _build, _same_head
from specpack.exports import ENGINES, export_engine
from specpack.errors import InputError, UnsupportedError

DRAFT_DIR = {"vllm": ".", "sglang": ".", "trtllm": "draft"}
# (layout, engine) pairs each engine represents (the others are refused: test_refusals_name_who_can)
SERVING = [e for e in ENGINES if e != "llama.cpp"]  # llama.cpp refuses block drafters (test_llamacpp_export)
ROUND_TRIPS = [("zlab-dflash", e) for e in SERVING] + [("deepspec-dspark", e) for e in SERVING] + \
    [("lilicorr", "vllm"), ("lilicorr-sequential", "trtllm"), ("deepseek-dflash", "trtllm"),
     ("nemotron35-dspark", "vllm"), ("speculators-dflash", "sglang")]


@pytest.fixture(scope="module")
def arts(tmp_path_factory, tiny_target):
    tmp = tmp_path_factory.mktemp("block-export")
    return {lay: _build(tmp, tiny_target, bl.write(lay, tmp / f"head-{lay}", tiny_target), f"art-{lay}")
            for lay in ("zlab-dflash", "deepspec-dspark", "lilicorr", "deepseek-dflash", "nemotron35-dspark")}


@pytest.mark.parametrize("layout, engine", ROUND_TRIPS)
def test_round_trip_import_export_import_gives_the_same_head(layout, engine, tmp_path, tiny_target):
    art = _build(tmp_path, tiny_target, bl.write(layout, tmp_path / "head", tiny_target))
    export_engine(art, engine, tmp_path / engine)
    back = _build(tmp_path, tiny_target, tmp_path / engine / DRAFT_DIR[engine], "back")
    _same_head(art, back)
    a, b = (read_json(x / "specpack.json")["drafter"] for x in (art, back))
    for key in ("algorithm", "query_layout", "draft_slots", "mask_token_id", "embedding_source", "markov", "lilicorr"):
        assert a.get(key) == b.get(key), key
    assert a["target_features"]["layer_ids"] == b["target_features"]["layer_ids"]


def test_vllm_dflash_writes_both_id_conventions_and_n_is_b_minus_1(arts, tmp_path):
    r = export_engine(arts["zlab-dflash"], "vllm", tmp_path / "v", tensor_parallel=2)
    cfg = read_json(tmp_path / "v/config.json")
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]  # vLLM reads these first: input of layer i
    assert cfg["dflash_config"]["target_layer_ids"] == cfg["target_layer_ids"] == [1, 4, 6]  # output of layer i
    assert (cfg["sample_from_anchor"], cfg["dspark_bonus_anchor"], cfg["dflash_config"]["sample_from_anchor"]) == \
        (False, True, False)
    assert cfg["dflash_config"]["mask_token_id"] == cfg["mask_token_id"] == 5
    assert r.config["speculative_config"] == {"method": "dflash", "model": str(tmp_path / "v"),
                                              "num_speculative_tokens": 3}
    assert (r.aux_layer_ids, r.aux_convention) == ([2, 5, 7], "input_of_layer")
    readme = (tmp_path / "v/README.md").read_text()
    assert "--tensor-parallel-size 2" in r.command and r.command in readme and "at most B-1 = 3" in readme


def test_vllm_dspark_method_and_n_is_b(arts, tmp_path):
    r = export_engine(arts["deepspec-dspark"], "vllm", tmp_path / "v")
    cfg = read_json(tmp_path / "v/config.json")
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and (cfg["sample_from_anchor"], cfg["dspark_bonus_anchor"]) \
        == (True, False)
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["enable_confidence_head"],
            cfg["confidence_head_with_markov"]) == (8, "vanilla", True, True)
    assert r.config["speculative_config"]["method"] == "dspark"
    assert r.config["speculative_config"]["num_speculative_tokens"] == 4
    names = set(load_file(tmp_path / "v/model.safetensors"))
    assert {"markov_head.markov_w1.weight", "confidence_head.proj.weight"} <= names


def test_vllm_lilicorr_config(arts, tmp_path):
    export_engine(arts["lilicorr"], "vllm", tmp_path / "v")
    cfg = read_json(tmp_path / "v/config.json")
    dc = cfg["dflash_config"]
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and dc["projector_type"] == "lilicorr"
    assert dc["lilicorr_enabled"] is True and dc["lilicorr_vector_eps"] == 1e-6 and dc["lilicorr_logit_scale"] == 10.0
    assert "LiLiCorrDraftModel` (PR #57934)" in (tmp_path / "v/README.md").read_text()


def test_sglang_counts_the_anchor_for_dflash_and_gamma_for_dspark(arts, tmp_path):
    r = export_engine(arts["zlab-dflash"], "sglang", tmp_path / "s", tensor_parallel=4)
    assert r.config["flags"]["--speculative-algorithm"] == "DFLASH"
    assert r.config["flags"]["--speculative-num-draft-tokens"] == "4"  # 3 draft tokens + the anchor
    assert (r.aux_layer_ids, r.aux_convention) == ([1, 4, 6], "output_of_layer")
    assert "--tp-size 4" in r.command
    r = export_engine(arts["deepspec-dspark"], "sglang", tmp_path / "d")
    assert r.config["flags"]["--speculative-algorithm"] == "DSPARK"
    assert r.config["flags"]["--speculative-dspark-block-size"] == "4"
    # the verify window stated too (issue 43): SGLang refuses any other than gamma + 1
    assert r.config["flags"]["--speculative-num-draft-tokens"] == "5"
    assert "--speculative-dspark-block-size 4" in r.command and "--speculative-num-draft-tokens 5" in r.command


def test_trtllm_decoding_configs(arts, tmp_path):
    def spec(name, out):
        export_engine(arts[name], "trtllm", tmp_path / out)
        return yaml.safe_load((tmp_path / out / "extra-llm-api-config.yml").read_text())["speculative_config"]

    assert spec("zlab-dflash", "f") == {"decoding_type": "DFlash", "max_draft_len": 3,
                                        "speculative_model_dir": str(tmp_path / "f/draft"), "mask_token_id": 5,
                                        "target_layer_ids": [1, 4, 6]}
    s = spec("deepspec-dspark", "s")
    assert (s["decoding_type"], s["max_draft_len"], s["block_size"], s["markov_rank"], s["markov_head_type"]) == \
        ("DSpark", 4, 4, 8, "vanilla")
    # DeepSeek's dflash_*_block7: anchor-first without a Markov head = DSpark with markov_rank 0
    s = spec("deepseek-dflash", "d")
    assert (s["decoding_type"], s["max_draft_len"], s["markov_rank"]) == ("DSpark", 4, 0)


def test_shorter_draft_len_and_too_long_one(arts, tmp_path):
    r = export_engine(arts["zlab-dflash"], "vllm", tmp_path / "v", draft_len=2)
    assert r.config["speculative_config"]["num_speculative_tokens"] == 2
    assert "Fewer draft tokens than trained slots" in (tmp_path / "v/README.md").read_text()
    for engine in ENGINES:
        with pytest.raises(InputError) as err:
            export_engine(arts["zlab-dflash"], engine, tmp_path / f"x-{engine}", draft_len=4)
        assert "3 trained draft slots" in str(err.value) and not (tmp_path / f"x-{engine}").exists()


@pytest.mark.parametrize("layout, changes, can, text", [
    ("deepseek-dflash", {}, "trtllm", "anchor-first"),
    ("nemotron35-dspark", {}, "vllm", "1+N layout is reserved"),
    ("lilicorr", {}, "vllm, trtllm", "PR #37462"),
    ("deepspec-dspark", {"markov": (8, "gated")}, "sglang, trtllm", "vanilla head only"),
    # llama.cpp concatenates the target states in the order its target_layers list them
    ("zlab-dflash", {"ids_out": (4, 1, 6)}, "llama.cpp", "not ascending"),
])
def test_refusals_name_who_can(layout, changes, can, text, tmp_path, tiny_target):
    art = _build(tmp_path, tiny_target, bl.write(layout, tmp_path / "head", tiny_target, **changes))
    refused = 0
    for engine in ENGINES:
        if engine in can:
            continue
        with pytest.raises(UnsupportedError) as err:
            export_engine(art, engine, tmp_path / engine)
        assert f"engines that can: {can}" in err.value.hint and not (tmp_path / engine).exists()
        refused += any(text in p for p in err.value.problems)
    assert refused


def test_mask_embedding_exports_to_vllm_only(tmp_path, tiny_target):
    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    torch.save(torch.randn(64), head / "mask_embedding.pt")
    art = _build(tmp_path, tiny_target, head)
    export_engine(art, "vllm", tmp_path / "v")
    saved = torch.load(tmp_path / "v/mask_embedding.pt", weights_only=True)
    assert saved["mask_token_id"] == 5 and saved["embedding"].shape == (64,)
    assert "mask_embedding" not in load_file(tmp_path / "v/model.safetensors")
    for engine in ("sglang", "trtllm"):
        with pytest.raises(UnsupportedError) as err:
            export_engine(art, engine, tmp_path / engine)
        assert "mask embedding" in " ".join(err.value.problems) and err.value.hint == "engines that can: vllm"


def test_causal_windowed_drafter_exports_to_vllm_only(tmp_path, tiny_target):
    head = bl.edit_config(bl.write("zlab-dflash", tmp_path / "head", tiny_target),
                          dflash={"causal": True, "use_swa": True, "swa_window_size": 16})
    art = _build(tmp_path, tiny_target, head)
    export_engine(art, "vllm", tmp_path / "v")
    cfg = read_json(tmp_path / "v/config.json")
    # vLLM's rule makes sliding layers causal already: layer_types + the window say it all
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 16
    assert "causal" not in cfg["dflash_config"]
    back = _build(tmp_path, tiny_target, tmp_path / "v", "back")
    _same_head(art, back)
    for engine in ("sglang", "trtllm"):
        with pytest.raises(UnsupportedError) as err:
            export_engine(art, engine, tmp_path / engine)
        assert "causal within the block" in " ".join(err.value.problems)


def test_profile_crossover_schedules(arts, tmp_path):
    """vLLM takes the schedule for every block method; TensorRT-LLM's DFlash path takes it and its
    DSpark mode does not (the README says so); a profile whose draft length the block cannot run is
    left out, with the reason."""
    from conftest import measured_profile, with_profiles

    dflash = with_profiles(arts["zlab-dflash"], tmp_path / "dflash", measured_profile("block", 2, 4))
    v = export_engine(dflash, "vllm", tmp_path / "dflash-vllm").config["speculative_config"]
    assert v["method"] == "dflash" and v["num_speculative_tokens"] == 2
    assert v["num_speculative_tokens_per_batch_size"] == [[1, 4, 2], [5, 1 << 16, 0]]
    export_engine(dflash, "trtllm", tmp_path / "dflash-trt")
    spec = yaml.safe_load((tmp_path / "dflash-trt/extra-llm-api-config.yml").read_text())["speculative_config"]
    assert spec["decoding_type"] == "DFlash" and spec["draft_len_schedule"] == {4: 2} and spec["max_draft_len"] == 2

    dspark = with_profiles(arts["deepspec-dspark"], tmp_path / "dspark", measured_profile("block", 4, 8))
    v = export_engine(dspark, "vllm", tmp_path / "dspark-vllm").config["speculative_config"]
    assert v["method"] == "dspark" and v["num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 1 << 16, 0]]
    export_engine(dspark, "trtllm", tmp_path / "dspark-trt")
    spec = yaml.safe_load((tmp_path / "dspark-trt/extra-llm-api-config.yml").read_text())["speculative_config"]
    assert spec["decoding_type"] == "DSpark" and "draft_len_schedule" not in spec
    assert "No `draft_len_schedule` written: TensorRT-LLM's DSpark mode" in (tmp_path / "dspark-trt/README.md").read_text()

    too_long = with_profiles(arts["zlab-dflash"], tmp_path / "long", measured_profile("block", 5, 8))
    v = export_engine(too_long, "vllm", tmp_path / "long-vllm").config["speculative_config"]
    assert v["num_speculative_tokens"] == 3 and "num_speculative_tokens_per_batch_size" not in v  # its 3 slots
    assert "cannot run this drafter with its 5 draft tokens" in (tmp_path / "long-vllm/README.md").read_text()
    with pytest.raises(InputError, match="5 draft tokens asked for"):
        export_engine(too_long, "vllm", tmp_path / "x", profile=measured_profile("block", 5, 8).name)
