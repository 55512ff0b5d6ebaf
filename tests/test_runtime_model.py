"""Our decoder against transformers, the config reader, and checkpoint loading errors."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import tiny
from conftest import assert_decodes_incrementally
from eagle_fixtures import one_thread, target_dir  # noqa: F401
from specpack.errors import InputError, UnsupportedError
from specpack.families.dense import target_spec_from_config
from specpack.runtime.models.weights import load_target

TOL = 1e-4


def ids(n, seed=1):
    return torch.randint(0, tiny.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def hf_forward(model, tokens):
    with torch.no_grad():
        out = model(tokens[None], output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


@pytest.mark.parametrize("family,shards", [(f, 1) for f in tiny.FAMILIES] + [("llama", 3)])
def test_logits_match_transformers(family, shards):
    model = load_target(target_dir(family, shards))
    tokens = ids(48)
    ref, hidden = hf_forward(tiny.build_model(family), tokens)

    model.setup_cache(64)
    out = model(tokens, capture=(0, 2, 5))
    assert (out.logits - ref).abs().max() <= TOL
    assert (out.aux - torch.cat([hidden[0], hidden[2], hidden[5]], -1)).abs().max() <= TOL

    assert_decodes_incrementally(model, tokens, ref, TOL)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_tree_mask_matches_chains(family):
    model, hf = load_target(target_dir(family)), tiny.build_model(family)
    prefix, tokens = ids(20), ids(6, seed=3)
    parents = [-1, 0, 0, 1, 2, 2]  # node 0 is the last accepted token; two branches below it
    paths = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i, path in enumerate(paths):
        mask[i, path] = True
    depth = torch.tensor([len(p) - 1 for p in paths])

    model.setup_cache(64)
    model(prefix)
    tree = model(tokens, positions=20 + depth, mask=mask).logits
    for i, path in enumerate(paths):
        model.cache.length = 20
        chain = model(tokens[path]).logits[-1]
        ref = hf_forward(hf, torch.cat([prefix, tokens[path]]))[0][-1]
        assert (tree[i] - chain).abs().max() <= TOL
        assert (tree[i] - ref).abs().max() <= TOL


def base_config(**over):
    return {**tiny.tiny_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"], **over}


def test_spec_reads_families_and_both_rope_formats():
    for family in tiny.FAMILIES:
        spec = target_spec_from_config(tiny.read_json(target_dir(family) / "config.json"))
        assert (spec.hidden_size, spec.num_layers, spec.vocab_size, spec.eos_token_ids) == (64, 6, tiny.VOCAB, (2,))
        assert spec.attention_bias == (family == "qwen2") and spec.qk_norm == (family == "qwen3")
        assert spec.tie_word_embeddings == (family == "smollm")
        assert spec.head_dim == (32 if family == "qwen3" else 16)
        assert spec.kv_bytes_per_token() == 2 * 6 * 2 * spec.head_dim * 4
    new = target_spec_from_config(tiny.read_json(target_dir("llama3") / "config.json"))
    old_cfg = tiny.read_json(target_dir("llama3") / "config.json")
    del old_cfg["rope_parameters"]
    old = target_spec_from_config({**old_cfg, "rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    assert old == new and new.rope_scaling.kind == "llama3" and new.rope_theta == 500000.0


def test_spec_sliding_window_and_eos():
    spec = target_spec_from_config(base_config(sliding_window=128, architectures=["MistralForCausalLM"],
                                               eos_token_id=[2, 5]), {"eos_token_id": [5, 9]})
    assert spec.context_length == 128 and spec.eos_token_ids == (2, 5, 9)
    qwen = target_spec_from_config(base_config(architectures=["Qwen2ForCausalLM"], sliding_window=128,
                                               use_sliding_window=False))
    assert qwen.context_length == 512


def test_spec_errors():
    with pytest.raises(UnsupportedError) as e:
        target_spec_from_config(base_config(architectures=["GPT2LMHeadModel"]))
    assert "GPT2LMHeadModel" in e.value.message and "LlamaForCausalLM" in e.value.hint
    with pytest.raises(UnsupportedError) as e:
        target_spec_from_config(base_config(rope_parameters={"rope_type": "yarn", "factor": 4.0}, hidden_act="gelu"))
    assert len(e.value.problems) == 2 and "yarn" in e.value.problems[0]
    cfg = base_config()
    del cfg["hidden_size"], cfg["vocab_size"]
    with pytest.raises(InputError) as e:
        target_spec_from_config(cfg)
    assert e.value.problems == ["hidden_size: missing", "vocab_size: missing"]
    with pytest.raises(InputError) as e:
        target_spec_from_config(base_config(num_attention_heads=0, head_dim=None, hidden_size=-64))
    assert e.value.problems == ["hidden_size = -64: not a positive integer",
                                "num_attention_heads = 0: not a positive integer"]


def test_checkpoint_errors(tmp_path):
    sharded = shutil.copytree(target_dir("llama", 3), tmp_path / "sharded")
    for f in ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"):
        (sharded / f).unlink()
    with pytest.raises(InputError) as e:
        load_target(sharded)
    assert e.value.problems == ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]

    broken = shutil.copytree(target_dir("llama"), tmp_path / "broken")
    tensors = {k: v for k, v in tiny.build_model("llama").state_dict().items() if k != "model.norm.weight"}
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].clone()
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(InputError) as e:
        load_target(broken)
    assert len(e.value.problems) == 2
    assert "missing tensor model.norm.weight" in e.value.problems[0]
    assert "lm_head.weight has shape [383, 64], expected [384, 64]" in e.value.problems[1]

    (broken / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no safetensors checkpoint"):
        load_target(broken)
    (broken / "config.json").write_text(json.dumps(base_config(architectures=["BertModel"])))
    with pytest.raises(UnsupportedError):
        load_target(broken)


def test_weights_are_memory_mapped_and_tied():
    model = load_target(target_dir("smollm"))
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc to see mappings")
    ptr = model.embed_tokens.weight.data_ptr()
    spans = [line.split()[0].split("-") for line in open("/proc/self/maps") if "model.safetensors" in line]
    assert any(int(lo, 16) <= ptr < int(hi, 16) for lo, hi in spans), "the embedding is not a view of the file"
