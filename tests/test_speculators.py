"""EAGLE-3 heads in the vLLM speculators layout: same canonical head as the other layouts, verifier checked."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import eagle_fixtures as ef
import eagle_layouts
from conftest import read_json
from eagle_fixtures import one_thread, target_dir  # noqa: F401
from test_build_errors import _fails


def write_speculators(out, tensors, cfg, aux_ids=None, verifier=None, **layer_over):
    """Eagle3Speculator layout: `layers.0.*` names, nested `transformer_layer_config` written like
    `to_diff_dict` (fields equal to LlamaConfig's defaults left out), `speculators_config.verifier`."""
    out.mkdir(parents=True, exist_ok=True)
    layer = {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads": 4, "num_key_value_heads": cfg.num_key_value_heads, "num_hidden_layers": 1,
             "vocab_size": cfg.vocab_size, "rms_norm_eps": 1e-5, "max_position_embeddings": 512, **layer_over}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.1.0", "draft_vocab_size": tensors["lm_head.weight"].shape[0],
              "norm_before_residual": False, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": aux_ids, "transformer_layer_config": layer,
              "speculators_config": {
                  "algorithm": "eagle3", "default_proposal_method": "greedy",
                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                        "accept_tolerance": 0.0}],
                  "verifier": verifier if verifier is not None else {
                      "name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": ["LlamaForCausalLM"]}}}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out


@pytest.fixture
def head(tiny_cfg):
    return eagle_layouts.random_head(tiny_cfg, draft_vocab=256)


def test_builds_the_same_canonical_head_as_the_official_layout(tmp_path, tiny_target, tiny_cfg, head, keypair, cli):
    spec = write_speculators(tmp_path / "spec", head, tiny_cfg)
    official = eagle_layouts.write_official(tmp_path / "official", head, tiny_cfg)
    for name, src in (("a", spec), ("b", official)):
        code, _, err = cli("build", tiny_target, "--drafter", src, "-o", tmp_path / name, "--key", keypair.private)
        assert code == 0, err
    assert cli("verify", tmp_path / "a", "--key", keypair.public)[0] == 0
    a, b = load_file(tmp_path / "a/drafter/model.safetensors"), load_file(tmp_path / "b/drafter/model.safetensors")
    assert a.keys() == b.keys() == head.keys() and all(torch.equal(a[k], head[k]) for k in head)
    assert read_json(tmp_path / "a/drafter/config.json") == read_json(tmp_path / "b/drafter/config.json")
    d = read_json(tmp_path / "a/specpack.json")["drafter"]
    assert d["source_layout"] == "eagle3-speculators"
    assert d["aux_hidden_states"] == {"layer_ids": [2, 4, 5], "convention": "input_of_layer",
                                      "source_convention": "default", "produced_by": ["full+dense"] * 3}


def test_explicit_aux_ids_count_input_of_layer(tmp_path, tiny_target, tiny_cfg, head, cli):
    src = write_speculators(tmp_path / "spec", head, tiny_cfg, aux_ids=[1, 3, 6])
    assert cli("build", tiny_target, "--drafter", src, "-o", tmp_path / "art")[0] == 0
    assert read_json(tmp_path / "art/specpack.json")["drafter"]["aux_hidden_states"] == {
        "layer_ids": [1, 3, 6], "convention": "input_of_layer", "source_ids": [1, 3, 6],
        "source_convention": "input_of_layer", "produced_by": ["full+dense"] * 3}


def test_trained_head_runs_losslessly_with_high_acceptance(tmp_path):
    """A head trained on input-of-layer features (1, 3, 4): a wrong convention would collapse acceptance."""
    import specpack
    from specpack.packager import BuildOptions, build
    from transformers import AutoConfig

    trained = ef.trained_head("llama")
    tensors = {k: v for k, v in load_file(trained / "model.safetensors").items()}
    src = write_speculators(tmp_path / "spec", tensors, AutoConfig.from_pretrained(target_dir("llama")),
                            aux_ids=list(ef.AUX))
    build(BuildOptions(target=target_dir("llama"), drafter=str(src), out=tmp_path / "art"))
    model = specpack.load(tmp_path / "art")
    seqs = ef.greedy_sequences(__import__("tiny").build_model("llama"), ef.training_prompts(), 12)
    al = []
    for i in range(6):
        prompt = seqs[i, : 8 + i % 5].tolist()
        got = model.generate(prompt, 24, draft_len=4, eos_ids=())
        assert got.tokens == model.generate(prompt, 24, speculative=False, eos_ids=()).tokens
        al.append(got.stats.acceptance_length)
    assert sum(al) / len(al) > 2.0, al


@pytest.mark.parametrize("verifier, text", [
    ({"name_or_path": "Qwen/Qwen2.5-7B", "architectures": ["Qwen2ForCausalLM"]},
     "speculators_config.verifier.architectures = ['Qwen2ForCausalLM'], this target's is 'LlamaForCausalLM'"),
    ({}, "speculators_config.verifier is missing"),
])
def test_verifier_that_is_not_the_target(tmp_path, tiny_target, tiny_cfg, head, cli, verifier, text):
    src = write_speculators(tmp_path / "spec", head, tiny_cfg, verifier=verifier or {"x": 1})
    if not verifier:
        cfg = read_json(src / "config.json")
        del cfg["speculators_config"]["verifier"]
        (src / "config.json").write_text(json.dumps(cfg))
    _fails(cli, tmp_path, tiny_target, "--drafter", src, text=[text])


def test_verifier_name_must_match_the_targets_when_both_name_one(tmp_path, tiny_target, tiny_cfg, head, cli):
    target = shutil.copytree(tiny_target, tmp_path / "t")
    cfg = read_json(target / "config.json")
    (target / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "HuggingFaceTB/SmolLM2-135M"}))
    src = write_speculators(tmp_path / "spec", head, tiny_cfg)
    _fails(cli, tmp_path, target, "--drafter", src,
           text=["the drafter was made for another target: speculators_config.verifier.name_or_path = "
                 "'meta-llama/Llama-3.1-8B-Instruct', this target's is 'HuggingFaceTB/SmolLM2-135M'",
                 "--allow-target-mismatch"])
    code, _, _ = cli("build", target, "--drafter", src, "-o", tmp_path / "anyway", "--allow-target-mismatch")
    assert code == 0
    d = read_json(tmp_path / "anyway/specpack.json")["drafter"]
    assert d["target_mismatch_allowed"] is True
    assert {m["stated_in"]: m["matches"] for m in d["made_for"]} == {
        "speculators_config.verifier.architectures": True, "speculators_config.verifier.name_or_path": False}
    code, out, _ = cli("inspect", tmp_path / "anyway")
    assert "MISMATCH: target 'HuggingFaceTB/SmolLM2-135M'" in out and "--allow-target-mismatch" in out
    assert "| made for |" in (tmp_path / "anyway/README.md").read_text()


def test_unsupported_heads_and_bad_tensors_listed_together(tmp_path, tiny_target, tiny_cfg, head, cli):
    del head["norm.weight"]
    src = write_speculators(tmp_path / "spec", head, tiny_cfg, num_hidden_layers=2, model_type="qwen3")
    _fails(cli, tmp_path, tiny_target, "--drafter", src,
           text=["unsupported: transformer_layer_config.model_type 'qwen3'", "unsupported: 2 decoder layers",
                 "missing tensor 'norm.weight'"])


# what a head states about its target is type-checked and compared exactly (issue 63 item 2)
MADE_FOR = [
    ({"architectures": "XXLlamaForCausalLMXX"}, "verifier.architectures = XXLlamaForCausalLMXX: not a list"),
    ({"architectures": 5}, "verifier.architectures = 5: not a list of architecture names"),
    ({"architectures": ["XXLlamaForCausalLMXX"]}, "verifier.architectures = ['XXLlamaForCausalLMXX'], this target's"),
    ({"architectures": ["LlamaForCausalLM"], "name_or_path": 7}, "verifier.name_or_path = 7: not a string"),
]


@pytest.mark.parametrize("verifier, text", MADE_FOR, ids=["substring", "number", "another name", "name a number"])
def test_a_verifier_of_the_wrong_type_or_name_is_refused(tmp_path, tiny_target, tiny_cfg, head, cli, verifier, text):
    src = write_speculators(tmp_path / "spec", head, tiny_cfg, verifier=verifier)
    _fails(cli, tmp_path, tiny_target, "--drafter", src, text=[text])


def test_a_hub_name_the_target_cannot_confirm_is_recorded_unchecked(tmp_path, tiny_target, tiny_cfg, head, cli):
    """A local target names no hub id: the verifier's name is stated as unchecked, never as matching."""
    src = write_speculators(tmp_path / "spec", head, tiny_cfg,
                            verifier={"name_or_path": "some-org/another-model", "architectures": ["LlamaForCausalLM"]})
    assert cli("build", tiny_target, "--drafter", src, "-o", tmp_path / "art")[0] == 0
    made_for = {m["stated_in"]: m.get("matches") for m in read_json(tmp_path / "art/specpack.json")["drafter"]["made_for"]}
    assert made_for["speculators_config.verifier.name_or_path"] is None
    assert "unchecked: the target states none" in cli("inspect", tmp_path / "art")[1]


@pytest.mark.parametrize("value", ["6", 6.0, True, 0])
def test_num_target_layers_of_the_wrong_type_is_refused(tmp_path, tiny_target, value, cli):
    import block_layouts as bl

    head = bl.write("zlab-dflash", tmp_path / "head", tiny_target)
    bl.edit_config(head, update={"num_target_layers": value})
    code, _, err = cli("build", tiny_target, "--drafter", head, "-o", tmp_path / "art")
    assert code == 2 and "num_target_layers" in err and not (tmp_path / "art").exists(), err
