"""Qwen3-MoE in specpack's runtime: our decoder (runtime/models/dense.py with moe.py's routed experts)
against transformers' Qwen3MoeForCausalLM, speculation lossless on it, and the artifact's `run`."""

import json

import pytest
import torch

import tiny
from conftest import assert_decodes_incrementally
from eagle_fixtures import one_thread, target_dir  # noqa: F401
from specpack.errors import InputError
from specpack.families.dense import target_spec_from_config
from specpack.runtime.models.dense import MLP
from specpack.runtime.models.moe import SparseMoE
from specpack.runtime.spec_model import SpecModel, load_drafter, load_target

TOL = 1e-4
FAMILIES = ("qwen3-moe", "qwen3-moe-plain")  # top-k weights renormalized, and not


def ids(n, seed=1):
    return torch.randint(0, tiny.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_captures_match_transformers(family):
    model, hf = load_target(target_dir(family)), tiny.build_model(family)
    assert [type(b.mlp).__name__ for b in model.layers] == ["MLP"] + ["SparseMoE"] * 5  # mlp_only_layers [0]
    tokens = ids(48)
    with torch.no_grad():
        out = hf(tokens[None], output_hidden_states=True)
    ref, hidden = out.logits[0], [h[0] for h in out.hidden_states]
    model.setup_cache(64)
    got = model(tokens, capture=(0, 2, 5))
    assert (got.logits - ref).abs().max() <= TOL and ref.abs().max() > 0.1
    assert (got.aux - torch.cat([hidden[0], hidden[2], hidden[5]], -1)).abs().max() <= TOL
    routed = model.layers[1].mlp.gate(torch.randn(48, 64))[0]
    assert routed.unique().numel() > 4  # the router spreads tokens over the experts

    assert_decodes_incrementally(model, tokens, ref, TOL)


def test_the_cpu_kernels_and_bf16_keep_the_router_exact():
    """Packed for the CPU kernel, the logits stay those of the fp32 model (layers with experts never
    run fused); in bf16 the router stays fp32."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels

    plain, packed = load_target(target_dir("qwen3-moe")), load_target(target_dir("qwen3-moe"))
    if not use_cpu_kernels(packed):
        pytest.skip("the CPU kernels are unavailable here")
    for m in (plain, packed):
        m.setup_cache(16)
    tokens = ids(12)
    assert (packed(tokens).logits - plain(tokens).logits).abs().max() <= TOL
    narrow = load_target(target_dir("qwen3-moe"), dtype=torch.bfloat16)
    assert narrow.layers[1].mlp.gate.weight.dtype == torch.float32
    assert narrow.layers[1].mlp.experts[0].down_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("drafter", ["ngram", "eagle3"])
def test_speculative_greedy_equals_plain(drafter, tmp_path):
    from eagle_fixtures import random_head

    model = load_target(target_dir("qwen3-moe"))
    head = random_head(tmp_path / "head", target_dir("qwen3-moe")) if drafter == "eagle3" else None
    d = load_drafter(drafter, {"min_n": 1, "max_n": 3} if drafter == "ngram" else None, head, model)
    spec = SpecModel(model, d)
    for seed in range(3):
        prompt = (ids(6, seed=seed).tolist() * 3)[:16]
        plain = spec.generate(prompt, 24, speculative=False, eos_ids=())
        for k in (1, 4):
            assert spec.generate(prompt, 24, draft_len=k, eos_ids=()).tokens == plain.tokens, (seed, k)


def test_an_artifact_runs_with_speculation_equal_to_plain(tmp_path, cli):
    out = tmp_path / "art"
    code, _, err = cli("build", target_dir("qwen3-moe"), "--drafter", "ngram", "-o", out)
    assert code == 0, err
    arch = json.loads((out / "specpack.json").read_text())["target"]["arch"]
    assert arch["runs"] and arch["family"] == "qwen3_moe"
    runs = {}
    for flag in ("--no-spec", "--draft-len"):
        args = ["run", out, "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json"]
        code, shown, err = cli(*args, *([flag] if flag == "--no-spec" else [flag, "4"]))
        assert code == 0, err
        runs[flag] = json.loads(shown)["token_ids"]
    assert runs["--no-spec"] == runs["--draft-len"]


def test_a_config_without_its_routing_is_refused():
    cfg = tiny.read_json(target_dir("qwen3-moe") / "config.json")
    assert target_spec_from_config(cfg).moe_layers == (1, 2, 3, 4, 5)
    del cfg["num_experts_per_tok"]
    with pytest.raises(InputError, match="lacks its routing"):
        target_spec_from_config(cfg)


def test_the_router_keeps_the_top_k_of_the_softmax_renormalized_or_not():
    x = torch.randn(5, 8)
    for renormalize in (True, False):
        moe = SparseMoE(8, 4, 6, 2, renormalize, MLP)
        torch.nn.init.normal_(moe.gate.weight)
        ids, weights = moe.gate(x)
        probs = (x @ moe.gate.weight.T).softmax(-1)
        assert torch.equal(ids.sort(-1).values, probs.topk(2, dim=-1).indices.sort(-1).values)
        want = probs.gather(1, ids)
        assert torch.allclose(weights, want / want.sum(-1, keepdim=True) if renormalize else want)


def test_batched_greedy_equals_single_requests(tmp_path):
    """The batched engine (CPU kernels, chunked prefill, requests joining and leaving): each request's
    tokens equal its own decoding alone without speculation."""
    import specpack
    from specpack.packager import BuildOptions, NgramParams, build
    from specpack.runtime.engine import Engine
    from test_engine import alone, drive, requests

    art = build(BuildOptions(target=target_dir("qwen3-moe"), drafter="ngram", out=tmp_path / "art",
                             ngram=NgramParams(1, 3, 4))).out
    m = specpack.load(art, backend="torch")
    reqs = requests(m)
    want = [alone(m, r) for r in reqs]
    for slots in (1, 3):
        engine = Engine(m.target, m.drafter, slots=slots, max_len=64, prefill_chunk=5)
        got = drive(engine, {0: reqs[:2], 1: reqs[2:4], 4: reqs[4:]})
        assert got == dict(enumerate(want)), slots


def test_fused_experts_build_and_are_refused_by_run_saying_why(tmp_path, cli):
    """Experts re-saved as 3-D tensors (`experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]):
    checked and packaged, but `run` (which reads one MLP per expert, as Qwen3-MoE is published) refuses
    before loading, saying why and naming the engines."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = shutil.copytree(target_dir("qwen3-moe"), tmp_path / "t")
    t = load_file(str(target / "model.safetensors"))
    for i in range(1, 6):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [torch.cat([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")]) for e in range(8)]
        t[p + "gate_up_proj"] = torch.stack(gate_up)
        t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(t, str(target / "model.safetensors"))
    out = tmp_path / "art"
    assert cli("build", target, "--drafter", "ngram", "-o", out)[0] == 0
    arch = json.loads((out / "specpack.json").read_text())["target"]["arch"]
    assert arch["experts"]["layout"] == "fused" and not arch["runs"]
    code, _, err = cli("run", out, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and "stored fused" in err and "--engine vllm" in err, err
