"""Configs written to break `build` (issue 49): each is refused with an `error:` line naming the field,
in bounded memory and time, and nothing is written. One table: the base checkpoint, what the case
changes, and what the error must say."""

import json
import math
import shutil
import tracemalloc

import pytest
import torch

import family_fixtures as ff

PEAK_BYTES = 500 * 2**20  # what one refused case may allocate (Python objects, traced)


@pytest.fixture(scope="module")
def bases(tmp_path_factory, tiny_target):
    """A plain Llama target and one quantized checkpoint per config kind the table attacks."""
    root = tmp_path_factory.mktemp("bases")
    made = {f: ff.make(f, root / f) for f in ("glm4_moe", "qwen3_moe", "nemotron_h", "deepseek_v3")}

    def quantized(form, family):
        return getattr(ff, form)(shutil.copytree(made[family], root / form))

    return {"llama": tiny_target, "ct_fp8": quantized("ct_fp8_channel", "glm4_moe"),
            "ct_nvfp4": quantized("ct_nvfp4", "qwen3_moe"), "mixed": quantized("modelopt_mixed", "nemotron_h"),
            "hf_quant": ff.modelopt_nvfp4(shutil.copytree(made["nemotron_h"], root / "hfq"), hf_quant_file=True),
            "fp8_block": quantized("fp8_block", "deepseek_v3"), "deepseek": made["deepseek_v3"]}


def _set(**updates):
    return lambda cfg: cfg.update(updates)


def _rope(**params):
    return lambda cfg: cfg["rope_parameters"].update(params)


def _ct_weights(**updates):
    return lambda cfg: cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(updates)


def _qc(**updates):
    return lambda cfg: cfg["quantization_config"].update(updates)


def _drop_qc(cfg):
    del cfg["quantization_config"]


def _list_groups(cfg):
    q = cfg["quantization_config"]
    q["config_groups"] = list(q["config_groups"].values())


def _list_weights(cfg):
    g = cfg["quantization_config"]["config_groups"]["group_0"]
    g["weights"] = [g["weights"]]


def _missing_module(cfg):
    cfg["quantization_config"]["quantized_layers"]["backbone.layers.1.mixer.nonexistent_proj"] = {"quant_algo": "FP8"}


def _hf_quant_list(target):
    path = target / "hf_quant_config.json"
    path.write_text(json.dumps({"quantization": [json.loads(path.read_text())["quantization"]]}))


def _long_module_name(target):
    """A tensor whose module name makes `(a|aa)+$` backtrack exponentially (the reporter's 23 s)."""
    ff.edit(target, add={"a" * 40 + "!.weight": torch.zeros(1)})


CASES = {
    # 1. sizes bounded by the checkpoint's own tensor list before anything is built from them
    "layers 10^9": ("llama", _set(num_hidden_layers=10**9), None, ["num_hidden_layers 1,000,000,000 > the 75 tensors"]),
    "layers 2^64": ("llama", _set(num_hidden_layers=2**64), None, ["num_hidden_layers 18,446,744,073,709,551,616 >"]),
    "layers 10^7": ("llama", _set(num_hidden_layers=10**7), None, ["num_hidden_layers 10,000,000 > the 75 tensors"]),
    "mtp 10^9": ("llama", _set(num_nextn_predict_layers=10**9), None, ["num_nextn_predict_layers 1,000,000,000 >"]),
    "hidden 10^12": ("llama", _set(hidden_size=10**12), None, ["hidden_size 1,000,000,000,000 > the"]),
    # 2. wrong JSON types: the field and the type it must be
    "rope_parameters str": ("llama", _set(rope_parameters="x"), None, ["rope_parameters = 'x': not a JSON object"]),
    "rope_scaling str": ("llama", _set(rope_scaling="x"), None, ["rope_scaling = 'x': not a JSON object"]),
    "architectures dict": ("llama", _set(architectures={"a": 1}), None,
                           ["architectures = {'a': 1}: not a list of strings"]),
    "text_config list": ("llama", _set(text_config=[1]), None, ["text_config = [1]: not a JSON object"]),
    "model_type list": ("llama", _set(model_type=["llama"]), None, ["model_type = ['llama']: not a string"]),
    "eos str": ("llama", _set(eos_token_id="x"), None, ["eos_token_id = 'x': not a token id or a list of them"]),
    "eps str": ("llama", _set(rms_norm_eps="x"), None, ["rms_norm_eps = 'x': not a finite number above 0"]),
    "tie str": ("llama", _set(tie_word_embeddings="yes"), None, ["tie_word_embeddings = 'yes': not true or false"]),
    "hidden_act list": ("llama", _set(hidden_act=["silu"]), None, ["hidden_act = ['silu']: not a string"]),
    "layer_types str": ("llama", _set(layer_types="full_attention"), None, ["layer_types = 'full_attention': not a"]),
    "heads float": ("llama", _set(num_attention_heads=4.0), None, ["num_attention_heads = 4.0: not a positive integer"]),
    "per-type rope": ("llama", _set(rope_parameters={"full_attention": {"rope_theta": "x"}}), None,
                      ["rope_parameters.full_attention.rope_theta = 'x': not a finite number above 0"]),
    "text_config field": ("llama", _set(text_config={"hidden_size": "64"}), None,
                          ["text_config.hidden_size = '64': not a positive integer"]),
    "deepseek routing": ("deepseek", _set(n_routed_experts="8"), None, ["n_routed_experts = '8': not a positive"]),
    # 3. values no engine could run
    "layer_types unknown": ("llama", _set(layer_types=["full_attention"] * 7 + ["banana"]), None,
                            ["layer_types[7] = 'banana': not one of full_attention, sliding_attention"]),
    "sliding_window < 0": ("llama", _set(sliding_window=-5), None, ["sliding_window = -5: not a positive integer"]),
    "rope_theta NaN": ("llama", _rope(rope_theta=math.nan), None, ["rope_parameters.rope_theta = nan: not a finite"]),
    "rope_theta inf": ("llama", _set(rope_theta=math.inf), None, ["rope_theta = inf: not a finite number"]),
    "partial rotary 2": ("llama", _set(partial_rotary_factor=2), None, ["partial_rotary_factor = 2: not a number in"]),
    # 6. quantization configs
    "ct group_size str": ("ct_nvfp4", _ct_weights(group_size="16"), None,
                          ["config_groups.group_0.weights.group_size = '16': not a positive integer"]),
    "ct group_size list": ("ct_nvfp4", _ct_weights(group_size=[16]), None, ["group_size = [16]: not a positive"]),
    "ct group_size 32.5": ("ct_nvfp4", _ct_weights(group_size=32.5), None, ["group_size = 32.5: not a positive"]),
    "ct group_size 0": ("ct_nvfp4", _ct_weights(group_size=0), None, ["group_size = 0: not a positive integer"]),
    "ct num_bits list": ("ct_nvfp4", _ct_weights(num_bits=[4]), None, ["weights.num_bits = [4]: not a positive"]),
    "ct weights list": ("ct_nvfp4", _list_weights, None, ["config_groups.group_0.weights = [{"]),
    "ct config_groups list": ("ct_nvfp4", _list_groups, None, ["quantization_config.config_groups = [{"]),
    "ct block, no structure": ("ct_fp8", _ct_weights(strategy="block"), None,
                               ["strategy is 'block', but block_structure is missing"]),
    "ct ignore bad regex": ("ct_fp8", _qc(ignore=["lm_head", "re:(unclosed"]), None,
                            ["quantization_config.ignore: 're:(unclosed' does not compile"]),
    "ct targets bad regex": ("ct_fp8", lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
        targets=["re:*bad"]), None, ["config_groups.group_0.targets: 're:*bad' does not compile"]),
    "ct ignore backtracks": ("ct_fp8", _qc(ignore=["lm_head", "re:(a|aa)+$"]), _long_module_name,
                             ["quantization_config.ignore 're:(a|aa)+$' takes more than"]),
    "ct ignore quantized": ("ct_fp8", _qc(ignore=["lm_head", "re:.*self_attn.q_proj$"]), None,
                            ["leaves model.layers.0.self_attn.q_proj unquantized"]),
    "modelopt kv int": ("mixed", _qc(kv_cache_quant_algo=8), None,
                        ["quantization_config.kv_cache_quant_algo = 8: not a string"]),
    "modelopt group 32.5": ("mixed", _qc(group_size=32.5), None, ["quantization_config.group_size = 32.5: not a"]),
    "modelopt missing module": ("mixed", _missing_module, None,
                                ["quantized_layers names backbone.layers.1.mixer.nonexistent_proj, a module the "
                                 "model does not have"]),
    "modelopt layer not object": ("mixed", lambda c: c["quantization_config"]["quantized_layers"].update(x="FP8"),
                                  None, ["quantization_config.quantized_layers.x = 'FP8': not a JSON object"]),
    "hf_quant_config list": ("hf_quant", None, _hf_quant_list, ["hf_quant_config.json quantization = [{"]),
    "fp8 config removed": ("fp8_block", _drop_qc, None,
                           ["is F8_E4M3: stored quantized, but config.json states no quantization_config"]),
    "fp8 config, plain weights": ("llama", _set(quantization_config={"quant_method": "fp8",
                                                                     "weight_block_size": [16, 16]}), None,
                                  ["states fp8-block (fp8 16x16 blocks), but none of the 57 linear weights is stored "
                                   "quantized"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES)
def test_a_hostile_config_is_refused_naming_the_field_in_bounded_memory(bases, case, tmp_path, cli):
    base, change_config, change_files, expected = CASES[case]
    target = shutil.copytree(bases[base], tmp_path / "t")
    if change_config:
        cfg = json.loads((target / "config.json").read_text())
        change_config(cfg)
        (target / "config.json").write_text(json.dumps(cfg))
    if change_files:
        change_files(target)
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    tracemalloc.start()
    try:
        code, _, err = cli("build", target, "--drafter", "ngram", "-o", out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    for text in expected:
        assert text in err, f"{text!r} not in {err}"
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MB traced"
    assert not any(out.parent.iterdir()), "a refused build left files behind"


def test_the_unquantized_and_quantized_bases_build(bases, tmp_path, cli):
    """The table's bases are valid: each refusal is the case's change, not the base."""
    for name in ("llama", "ct_fp8", "ct_nvfp4", "mixed", "hf_quant", "fp8_block"):
        code, _, err = cli("build", bases[name], "--drafter", "ngram", "-o", tmp_path / name)
        assert code == 0, f"{name}: {err}"


def test_an_ignore_entry_naming_no_module_is_stated_not_refused(bases, tmp_path, cli, caplog):
    target = shutil.copytree(bases["ct_fp8"], tmp_path / "t")
    cfg = json.loads((target / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:vision_tower.*")
    (target / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("build", target, "--drafter", "ngram", "-o", tmp_path / "art")
    assert code == 0, err
    assert "ignore entries that name no module of the checkpoint: re:vision_tower.*" in caplog.text + err


def test_ignore_patterns_share_one_time_budget():
    from specpack.errors import InputError
    from specpack.families import quant

    q = quant.Quant("ct-fp8", "compressed-tensors", ignore=("re:(a|aa)+$",))
    assert quant.ignored(q, {"aa", "lm_head"}) == {"aa": "re:(a|aa)+$"}
    with pytest.raises(InputError, match="takes more than 2 s"):
        quant.ignored(q, {"a" * 40 + "!"})


DRAFTER_CASES = {  # an EAGLE-3 head's config.json (its own layout), read through the same table
    "head layers 10^9": ({"num_hidden_layers": 10**9}, "num_hidden_layers 1,000,000,000 > the"),
    "head rope_scaling str": ({"rope_scaling": "x"}, "rope_scaling = 'x': not a JSON object"),
    "head rope_theta NaN": ({"rope_theta": math.nan}, "rope_theta = nan: not a finite number"),
    "head eps str": ({"rms_norm_eps": "x"}, "rms_norm_eps = 'x': not a finite number above 0"),
    "head architectures dict": ({"architectures": {"a": 1}}, "architectures = {'a': 1}: not a list of strings"),
    "head eagle_config list": ({"eagle_config": [1]}, "eagle_config = [1]: not a JSON object"),
    "head aux ids str": ({"eagle_aux_hidden_state_layer_ids": "1,2"},
                         "eagle_aux_hidden_state_layer_ids = '1,2': not a list of integers"),
    "head tie str": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings = 'yes': not true or false"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", DRAFTER_CASES)
def test_a_hostile_drafter_config_is_refused_naming_the_field(tiny_target, tiny_cfg, case, tmp_path, cli):
    import eagle_layouts

    updates, expected = DRAFTER_CASES[case]
    head = eagle_layouts.write_official(tmp_path / "head", eagle_layouts.random_head(tiny_cfg, draft_vocab=256),
                                        tiny_cfg)
    cfg = json.loads((head / "config.json").read_text())
    cfg.update(updates)
    (head / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out" / "art"
    out.parent.mkdir()
    code, _, err = cli("build", tiny_target, "--drafter", head, "-o", out)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err and expected in err, err
    assert not any(out.parent.iterdir())
