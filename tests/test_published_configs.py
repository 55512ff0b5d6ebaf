"""Published releases' config.json files (tests/published_configs, cited in SOURCES.md) are never
refused: every field passes the type checks, the family describes the model, and a tiny checkpoint
carrying each file's non-geometry fields builds. Hardening that refuses a published value fails here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import family_fixtures
from specpack.families import check_config, describe

PUBLISHED = Path(__file__).parent / "published_configs"
FAMILY = {"nemotron_nano_9b_v2.json": "nemotron_h", "minimax_m2.json": "minimax_m2"}
# what shapes the tiny checkpoint's tensors stays the tiny fixture's own; every other published field is carried
GEOMETRY = {"hidden_size", "intermediate_size", "mlp_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "attention_head_dim", "rotary_dim", "vocab_size", "max_position_embeddings",
            "num_local_experts", "num_experts_per_tok", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
            "conv_kernel", "chunk_size", "time_step_rank", "hybrid_override_pattern", "attn_type_list",
            "quantization_config", "torch_dtype"}


def published(name: str) -> dict:
    return json.loads((PUBLISHED / name).read_text())


def test_every_published_config_is_listed_with_its_source():
    files = sorted(p.name for p in PUBLISHED.glob("*.json"))
    sources = (PUBLISHED / "SOURCES.md").read_text()
    assert files == sorted(FAMILY) and all(f"`{f}`" in sources for f in files)


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_a_published_config_passes_every_field_check_and_is_described(name):
    config = published(name)
    check_config(config)
    arch = describe(config)
    assert arch.family == FAMILY[name] and arch.num_layers == config["num_hidden_layers"]


def test_the_published_values_that_were_refused_are_read_as_they_mean():
    assert published("nemotron_nano_9b_v2.json")["time_step_limit"] == [0.0, math.inf]
    minimax = describe(published("minimax_m2.json"))
    assert minimax.experts.shared == 0 and minimax.experts.routed == 256


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_a_tiny_checkpoint_carrying_a_published_config_builds(name, tmp_path):
    target = family_fixtures.make(FAMILY[name], tmp_path / "target")
    cfg = json.loads((target / "config.json").read_text())
    cfg.update({k: v for k, v in published(name).items() if k not in GEOMETRY})
    (target / "config.json").write_text(json.dumps(cfg))
    manifest = family_fixtures.build_ngram(target, tmp_path / "art", allow_remote_code="auto_map" in cfg)
    assert manifest.target.model_type == FAMILY[name] and manifest.target.remote_code.allowed


@pytest.mark.parametrize("limit", [[0.0, {"__float__": "Infinity"}], [0.001, 0.1], [0.0, 1e30]])
def test_every_spelling_of_a_time_step_limit_is_accepted(limit):
    check_config({"model_type": "nemotron_h", "time_step_limit": limit})


@pytest.mark.parametrize("limit", [[0.0, math.nan], [math.inf, math.inf], [0.5, 0.1], [-1.0, 1.0], [0.0], "inf"])
def test_a_time_step_limit_that_bounds_nothing_sensible_is_refused(limit):
    from specpack.errors import InputError

    with pytest.raises(InputError) as err:
        check_config({"model_type": "nemotron_h", "time_step_limit": limit})
    assert "time_step_limit" in str(err.value.problems)
