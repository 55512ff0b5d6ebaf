"""Our DeepSeek-V3-style decoder (MLA + MoE) against transformers' DeepseekV3ForCausalLM, and its loader."""

import json

import pytest
import torch

from conftest import assert_decodes_incrementally
import mtp_layouts as ml
from eagle_fixtures import one_thread  # noqa: F401
from specpack.errors import InputError, UnsupportedError
from specpack.families.deepseek import deepseek_spec_from_config
from specpack.runtime.models.deepseek import DeepseekTransformer
from specpack.runtime.spec_model import SpecModel, load_drafter, load_target

TOL = 1e-4
VARIANTS = {  # yarn + q LoRA (as DeepSeek-V3 ships), and plain RoPE with a direct q_proj
    "yarn-qlora": {},
    "default-rope-q_proj": {"q_lora_rank": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                            "rope_interleave": False},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(1)
    hf = DeepseekV3ForCausalLM(ml.deepseek_config(3, **VARIANTS[request.param])).eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("ds")
    hf.save_pretrained(path, safe_serialization=True)
    return load_target(path), hf, path


def ids(n, seed=1):
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed))


def hf_run(hf, tokens, capture=()):
    """logits [T, V] and the hidden states entering the `capture` layers (forward pre-hooks)."""
    seen = {}
    hooks = [hf.model.layers[i].register_forward_pre_hook(lambda m, a, i=i: seen.update({i: a[0][0]}))
             for i in capture]
    with torch.no_grad():
        logits = hf(tokens[None]).logits[0]
    for h in hooks:
        h.remove()
    return logits, torch.cat([seen[i] for i in capture], -1) if capture else None


def test_logits_and_captures_match_transformers(pair):
    model, hf, _ = pair
    assert isinstance(model, DeepseekTransformer)
    tokens = ids(48)
    ref, aux = hf_run(hf, tokens, capture=(0, 2))
    model.setup_cache(64)
    out = model(tokens, capture=(0, 2))
    assert (out.logits - ref).abs().max() <= TOL
    assert (out.aux - aux).abs().max() <= TOL
    assert ref.abs().max() > 1  # not a degenerate model
    routed = model.layers[2].mlp.gate(torch.randn(48, 64))[0]
    assert routed.unique().numel() > 4  # the router spreads tokens over experts

    assert_decodes_incrementally(model, tokens, ref, TOL)


def test_tree_mask_matches_chains(pair):
    model, _, _ = pair
    prefix, tokens = ids(20), ids(5, seed=3)
    parents = [-1, 0, 0, 1, 2]
    paths = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i, path in enumerate(paths):
        mask[i, path] = True
    model.setup_cache(64)
    model(prefix)
    tree = model(tokens, positions=20 + torch.tensor([len(p) - 1 for p in paths]), mask=mask).logits
    for i, path in enumerate(paths):
        model.cache.length = 20
        assert (tree[i] - model(tokens[path]).logits[-1]).abs().max() <= TOL


def test_the_speculative_loop_runs_unchanged(pair):
    model, _, _ = pair
    spec = SpecModel(model, load_drafter("ngram", {"min_n": 1, "max_n": 3}, None, model))
    prompt = (ids(6, seed=4).tolist() * 3)[:16]
    plain = spec.generate(prompt, 20, speculative=False, eos_ids=())
    for d in (1, 4):
        assert spec.generate(prompt, 20, draft_len=d, eos_ids=()).tokens == plain.tokens
    assert model.spec.kv_bytes_per_token(2) == 3 * (16 + 8) * 2  # layers × (latent + rope key) × bytes


def test_cpu_kernels_leave_the_absorbed_matrix_readable(pair):
    """The torch backend packs every fp32 nn.Linear for its CPU kernel; MLA reads kv_b_proj whole
    (absorbed into queries and output), so packing must leave it alone."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels

    _, _, path = pair
    plain, packed = load_target(path), load_target(path)
    if not use_cpu_kernels(packed):
        pytest.skip("the CPU kernels are unavailable here")
    for m in (plain, packed):
        m.setup_cache(16)
    tokens = ids(12)
    assert (packed(tokens).logits - plain(tokens).logits).abs().max() <= TOL


def test_narrow_weights_leave_the_router_and_absorbed_products_exact(pair):
    """Under --weights int8 every linear layer is quantized, but routing decides which experts run
    and MLA's absorbed products were never linear layers: both go on the packed kernel (row-exact)
    with the weight's own values."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels

    _, _, path = pair
    model = load_target(path)
    if not use_cpu_kernels(model, "int8"):
        pytest.skip("the CPU kernels are unavailable here")
    gate, attn = model.layers[1].mlp.gate, model.layers[1].self_attn
    assert torch.equal(gate.packed.dense(), gate.weight)
    s = attn.s
    w = attn.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, -1)
    for h, (keys, values) in enumerate(attn.heads):
        assert torch.equal(keys.dense(), w[h, : s.qk_nope_head_dim].T)
        assert torch.equal(values.dense(), w[h, s.qk_nope_head_dim :])


def test_bf16_keeps_the_router_in_fp32(pair):
    _, _, path = pair
    model = load_target(path, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32
    model.setup_cache(16)
    assert model(ids(8)).logits.isfinite().all()


def test_unsupported_features_are_listed(pair):
    _, _, path = pair
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(topk_method="greedy", scoring_func="softmax", hidden_act="gelu",
               quantization_config={"quant_method": "fp8"},
               rope_parameters={"rope_type": "longrope", "rope_theta": 1.0})
    with pytest.raises(UnsupportedError) as e:
        deepseek_spec_from_config(cfg)
    text = "\n".join(e.value.problems)
    for part in ("longrope", "topk_method 'greedy'", "scoring_func 'softmax'", "hidden_act 'gelu'", "quantised"):
        assert part in text
    del cfg["kv_lora_rank"]
    with pytest.raises(InputError, match="lacks required fields"):
        deepseek_spec_from_config(cfg)
    with pytest.raises(InputError) as e:
        deepseek_spec_from_config({**cfg, "kv_lora_rank": 8, "num_attention_heads": 0, "hidden_size": -64})
    assert e.value.problems == ["hidden_size = -64: not a positive integer",
                                "num_attention_heads = 0: not a positive integer"]


def test_legacy_rope_scaling_config_reads_the_same(pair):
    _, _, path = pair
    cfg = json.loads((path / "config.json").read_text())
    legacy = {**cfg, "rope_theta": cfg["rope_parameters"]["rope_theta"],
              "rope_scaling": {**cfg["rope_parameters"], "type": cfg["rope_parameters"]["rope_type"]}}
    del legacy["rope_parameters"]
    assert deepseek_spec_from_config(legacy) == deepseek_spec_from_config(cfg)


def test_checkpoint_with_missing_expert(pair, tmp_path):
    import shutil

    _, _, path = pair
    broken = shutil.copytree(path, tmp_path / "broken")
    ml.edit_weights(broken, drop=["model.layers.2.mlp.experts.3.down_proj.weight", "model.norm.weight"])
    with pytest.raises(InputError) as e:
        load_target(broken)
    assert {p.split(" (")[0] for p in e.value.problems} == {
        "missing tensor model.layers.2.mlp.experts.3.down_proj.weight", "missing tensor model.norm.weight"}


def test_a_target_whose_layers_are_all_dense_holds_no_experts(tmp_path):
    """n_routed_experts with first_k_dense_replace >= the layer count: no layer routes, so no expert
    is asked of the checkpoint (it was refused for 'the config claims 8 experts')."""
    from transformers import DeepseekV3ForCausalLM

    from specpack.converters import target_hf

    hf = DeepseekV3ForCausalLM(ml.deepseek_config(2, first_k_dense_replace=2)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert target_hf.load(tmp_path).info.num_hidden_layers == 2
    model = load_target(tmp_path)
    model.setup_cache(16)
    assert (model(ids(6)).logits - hf_run(hf, ids(6))[0]).abs().max() <= TOL
