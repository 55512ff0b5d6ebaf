"""Configs that were accepted as valid though nothing can run them (issue 63 items 9 and 10): each is
refused with exit 2, naming the field, in no time, nothing written. Each row edits a tiny checkpoint of
the family the field belongs to."""

import json
import time

import pytest

import family_fixtures as ff


def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def _set(**updates):
    def edit(cfg):
        _text(cfg).update(updates)
    return edit


def _qc(**updates):
    def edit(cfg):
        cfg["quantization_config"].update(updates)
    return edit


def _drop_qc(key):
    def edit(cfg):
        cfg["quantization_config"].pop(key)
    return edit


def _ct(path):
    return ff.ct_fp8_channel(ff.make("glm4_moe", path))


def _v4_fp8(path):
    return ff.deepseek_v4_fp8(ff.make("deepseek_v4", path))


CASES = [
    ("llama4 no_rope_layers shorter than its layers", "llama4", lambda p: ff.make("llama4", p),
     _set(no_rope_layers=[1, 1]), "no_rope_layers lists 2 entries"),
    ("llama4 moe_layers beyond its layers", "llama4", lambda p: ff.make("llama4", p), _set(moe_layers=[1, 99]),
     "moe_layers names layers [99]"),
    ("llama4 moe_layers 1e9", "llama4", lambda p: ff.make("llama4", p), _set(moe_layers=[1e9]),
     "moe_layers = [1000000000.0]: not a list of non-negative integers"),
    ("experts per token above the experts", "qwen3_moe", lambda p: ff.make("qwen3_moe", p),
     _set(num_experts_per_tok=9), "9 experts per token (num_experts_per_tok) but 4 routed experts"),
    ("an empty hybrid pattern", "nemotron_h", lambda p: ff.make("nemotron_h", p),
     lambda cfg: (cfg.pop("layers_block_type"), cfg.update(hybrid_override_pattern="", num_hidden_layers=4)),
     "hybrid_override_pattern must give one of M * - E per layer"),
    ("kv_cache_scheme a string", "glm4_moe", _ct, _qc(kv_cache_scheme="x"),
     "quantization_config.kv_cache_scheme = x: not an FP8 cache scheme"),
    ("ue8m0 scales with scale_fmt removed", "deepseek_v4", _v4_fp8, _drop_qc("scale_fmt"),
     "states no scale_fmt (float scales), but"),
    ("MiniMax-M3 rotary_dim beyond its head", "minimax_m3_vl", lambda p: ff.make("minimax_m3_vl", p),
     _set(rotary_dim=1000000000), "rotary_dim 1000000000 > head_dim 16"),
]


@pytest.mark.parametrize("case, family, make, edit, expect", CASES, ids=[c[0] for c in CASES])
def test_a_config_nothing_can_run_is_refused_naming_the_field(tmp_path, cli, case, family, make, edit, expect):
    target = make(tmp_path / family)
    cfg = json.loads((target / "config.json").read_text())
    edit(cfg)
    (target / "config.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    err = ff.refused(cli, target, tmp_path)
    assert time.perf_counter() - start < 10 and "Traceback" not in err  # a bound, not a timing claim
    assert expect in err, err


def test_a_valid_kv_cache_scheme_is_stated(tmp_path):
    target = _ct(tmp_path / "glm")
    cfg = json.loads((target / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    (target / "config.json").write_text(json.dumps(cfg))
    assert ff.build_ngram(target, tmp_path / "art").target.arch.quantization.kv_cache == "fp8"
