"""MTP layers: every published layout builds, verifies, matches the reference forward and runs losslessly."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import eagle_fixtures as ef
import mtp_layouts as ml
from conftest import read_json
from eagle_fixtures import one_thread  # noqa: F401
from specpack.errors import InputError, UnsupportedError
from specpack.packager import BuildOptions, build
from specpack.runtime.engine.sampling import Sampler, SamplingParams
from specpack.runtime.spec_model import SpecModel, load_drafter, load_target
from test_build_errors import _fails

# (layout, MTP layers, training steps): trained heads accept drafts, so rollback paths run too
CASES = {"mimo-1": ("mtp-mimo", 1, 80), "mimo-2": ("mtp-mimo", 2, 80), "deepseek-1": ("mtp-deepseek", 1, 40),
         "deepseek-2": ("mtp-deepseek", 2, 0)}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return {name: ml.make_target(tmp_path_factory.mktemp(name), layout, n, train_steps=steps)
            for name, (layout, n, steps) in CASES.items()}


@pytest.fixture(scope="module")
def artifacts(targets, tmp_path_factory):
    out = tmp_path_factory.mktemp("art")
    return {name: build(BuildOptions(target=t.path, drafter="mtp", out=out / name)).out for name, t in targets.items()}


def _model(art, **params):
    target = load_target(art)
    return SpecModel(target, load_drafter("mtp", params or None, art / "drafter", target))


@pytest.mark.parametrize("name", ["mimo-1", "deepseek-1"])
def test_in_target_mtp_builds_verifies_and_states_its_bindings(name, targets, tmp_path, keypair, cli):
    t, out = targets[name], tmp_path / "art"
    code, stdout, err = cli("build", t.path, "--drafter", "mtp", "-o", out, "--key", keypair.private, "--json")
    assert code == 0, err + stdout
    assert json.loads(stdout)["drafter"] == "mtp"
    code, stdout, err = cli("verify", out, "--key", keypair.public, "--json")
    assert code == 0 and json.loads(stdout)["signature_checked"], err
    d = read_json(out / "specpack.json")["drafter"]
    deepseek = t.layout == "mtp-deepseek"
    assert d["source_layout"] == t.layout and d["location"] == "target" and d["num_layers"] == 1
    assert d["concat_order"] == ("embedding_first" if deepseek else "hidden_first")
    assert d["target_hidden_state"] == ("final_norm_output" if deepseek else "last_layer_output")
    assert d["chain_hidden_state"] == ("pre_norm" if deepseek else "post_norm")
    assert d["duplicates_checked"] == (["model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"]
                                       if deepseek else [])
    assert d["allow_layer_reuse"] is False and "lm_head.weight" in d["shared_tensors"]
    assert sorted(p.name for p in (out / "drafter").iterdir()) == ["config.json"]  # nothing stored twice
    cfg = read_json(out / "drafter/config.json")
    assert cfg["tensors"]["layers.0.proj.weight"] == ml.mtp_prefix(t.layout, 0) + (
        "eh_proj.weight" if deepseek else "input_proj.weight")
    assert "## Drafter: MTP layers" in (out / "README.md").read_text()
    code, js, _ = cli("inspect", out, "--json")
    assert json.loads(js)["memory"]["drafter_weight_bytes"] > 0
    m = read_json(out / "specpack.json")
    if deepseek:  # MLA caches one latent per layer: layers × (kv_lora_rank + rope dim) × bytes
        cfg_t = read_json(t.path / "config.json")
        assert m["memory"]["target_kv_bytes_per_token"] == cfg_t["num_hidden_layers"] * (
            cfg_t["kv_lora_rank"] + cfg_t["qk_rope_head_dim"]) * 4
    code, text, err = cli("inspect", out)
    assert code == 0 and "layer reuse off" in text and "weights in target" in text, err


def _check_reference(t, model):
    """Drafts equal the reference forward over two rounds (round 2 after 4 accepted tokens), with
    more steps than layers (reuse) in round 2."""
    target, drafter = model.target, model.drafter
    hf = ml.hf_target(t)
    refs = [ml.RefLayer(t.layout, t.big, k, t.fusion) for k in range(t.n)]
    seq = torch.randint(3, 384, (20,), generator=torch.Generator().manual_seed(5))
    target.setup_cache(64)
    drafter.reset(64)
    feats = target(seq[:12], capture=drafter.capture_layers).aux
    assert drafter.propose(seq[:13], feats, t.n).tokens.tolist() == ml.ref_draft(refs, hf, seq[:13], t.n, t.layout)
    feats = target(seq[12:16], capture=drafter.capture_layers).aux
    want = ml.ref_draft(refs, hf, seq[:17], t.n + 2, t.layout)
    assert drafter.propose(seq[:17], feats, t.n + 2).tokens.tolist() == want


@pytest.mark.parametrize("name", list(CASES))
def test_drafts_match_the_reference_forward(name, targets, artifacts):
    _check_reference(targets[name], _model(artifacts[name], allow_layer_reuse=True))


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_speculative_equals_plain(name, targets, artifacts):
    t, model = targets[name], _model(artifacts[name], allow_layer_reuse=True)
    seqs = ef.greedy_sequences(ml.hf_target(t), ef.training_prompts(n=6), 12)
    al = []
    for i in range(6):
        prompt = seqs[i, : 8 + i % 5].tolist()
        plain = model.generate(prompt, 24, speculative=False, eos_ids=()).tokens
        for d in sorted({1, t.n, t.n + 2}):
            got = model.generate(prompt, 24, draft_len=d, eos_ids=())
            assert got.tokens == plain, (i, d)
            al.append(got.stats.acceptance_length)
    if CASES[name][2]:
        assert sum(al) / len(al) > 1.4, al  # trained: drafts get accepted, rollbacks are exercised


def test_sampled_drafts_follow_the_seed(artifacts):
    model = _model(artifacts["deepseek-1"], allow_layer_reuse=True)
    seq = torch.randint(3, 384, (10,), generator=torch.Generator().manual_seed(2))
    model.target.setup_cache(32)
    model.drafter.reset(32)
    feats = model.target(seq[:9], capture=model.drafter.capture_layers).aux

    def draw(seed):
        model.drafter.reset(32)
        return model.drafter.propose(seq, feats, 3, Sampler(SamplingParams(temperature=1.0), seed, 384)).tokens.tolist()

    draws = [draw(seed) for seed in (0, 0, 1, 2, 3)]
    assert draws[0] == draws[1] and len({tuple(d) for d in draws}) > 1  # keyed by (seed, position)
    got = model.generate(seq.tolist(), 12, draft_len=2, temperature=0.8, seed=0, eos_ids=())
    assert len(got.tokens) == 12


def test_more_draft_tokens_than_layers_needs_reuse(artifacts, tmp_path, targets):
    model = _model(artifacts["mimo-1"])
    with pytest.raises(InputError) as e:
        model.generate([5, 6, 7], 4, draft_len=3)
    assert "3 draft tokens asked for, but the MTP drafter has 1 layer(s)" in e.value.message
    assert "--mtp-allow-reuse" in e.value.hint
    assert len(model.generate([5, 6, 7], 4, draft_len=1).tokens) == 4
    res = build(BuildOptions(target=targets["mimo-1"].path, drafter="mtp", out=tmp_path / "a", mtp_allow_reuse=True))
    assert res.manifest.drafter.allow_layer_reuse and read_json(tmp_path / "a/drafter/config.json")["allow_layer_reuse"]
    assert len(_model(tmp_path / "a").generate([5, 6, 7], 4, draft_len=3).tokens) == 4


def test_separate_head_for_a_stripped_target(targets, artifacts, tmp_path, cli):
    t = targets["deepseek-1"]
    stripped, head = ml.split_head(t, tmp_path)
    _fails(cli, tmp_path, stripped, "--drafter", "mtp",
           text=["declares 1 MTP layer(s) but holds no MTP tensors: they were stripped", "--drafter DIR"])
    out = tmp_path / "art"
    assert cli("build", stripped, "--drafter", head, "-o", out)[0] == 0
    d = read_json(out / "specpack.json")["drafter"]
    assert d["location"] == "drafter" and d["weights"] == "drafter/model.safetensors"
    stored = load_file(out / "drafter/model.safetensors")
    assert "layers.0.block.mlp.experts.7.gate_proj.weight" in stored and len(stored) == len(read_json(
        artifacts["deepseek-1"] / "drafter/config.json")["tensors"])  # duplicates dropped, the rest kept
    for canonical, source in read_json(artifacts["deepseek-1"] / "drafter/config.json")["tensors"].items():
        assert torch.equal(stored[canonical], load_file(head / "model.safetensors")[source]), canonical
    assert cli("verify", out)[0] == 0
    model = _model(out)
    prompt = [5, 9, 31, 7, 100, 12]
    assert model.generate(prompt, 16, draft_len=1, eos_ids=()).tokens == \
        model.generate(prompt, 16, speculative=False, eos_ids=()).tokens


def test_qwen3_next_layout_builds(tmp_path, cli):
    target = ml.make_qwen3_next(tmp_path)
    out = tmp_path / "art"
    code, _, err = cli("build", target, "--drafter", "mtp", "-o", out)
    assert code == 0, err
    d = read_json(out / "specpack.json")["drafter"]
    assert (d["source_layout"], d["concat_order"], d["target_hidden_state"], d["chain_hidden_state"]) == \
        ("mtp-qwen3-next", "embedding_first", "final_norm_output", "post_norm")
    cfg = read_json(out / "drafter/config.json")
    assert cfg["norm_offset"] == 1.0 and cfg["tensors"]["layers.0.proj.weight"] == "mtp.fc.weight"
    assert cfg["tensors"]["layers.0.block.self_attn.q_norm.weight"] == "mtp.layers.0.self_attn.q_norm.weight"
    assert cli("verify", out)[0] == 0
    with pytest.raises(UnsupportedError, match="Qwen3NextForCausalLM"):
        load_target(out)  # hybrid linear attention: built and checked, not run


# ---- bad inputs: the message, and nothing written ----

def _copy(t, tmp_path):
    return shutil.copytree(t.path, tmp_path / "t")


def test_partly_present_mtp_lists_what_is_missing(targets, tmp_path, cli):
    path = _copy(targets["deepseek-1"], tmp_path)
    ml.edit_weights(path, drop=["model.layers.3.eh_proj.weight", "model.layers.3.mlp.experts.5.up_proj.weight"])
    _fails(cli, tmp_path, path, "--drafter", "mtp",
           text=["missing tensor model.layers.3.eh_proj.weight",
                 "missing tensor model.layers.3.mlp.experts.5.up_proj.weight"])


def test_missing_layer_and_misshapen_tensor(targets, tmp_path, cli):
    path = _copy(targets["mimo-2"], tmp_path)
    names = [n for n in load_file(path / "model.safetensors") if n.startswith("model.mtp_layers.1.")]
    ml.edit_weights(path, drop=names, model__mtp_layers__0__input_proj__weight=torch.zeros(64, 100))
    _fails(cli, tmp_path, path, "--drafter", "mtp",
           text=["tensor model.mtp_layers.0.input_proj.weight has shape [64, 100], expected [64, 128]",
                 "MTP layer 1 (model.mtp_layers.1.*): none of its"])


def test_duplicated_embedding_or_head_that_differ(targets, tmp_path, cli):
    path = _copy(targets["deepseek-1"], tmp_path)
    ml.edit_weights(path, model__layers__3__embed_tokens__weight=torch.zeros(384, 64),
                    model__layers__3__shared_head__head__weight=torch.ones(384, 64))
    _fails(cli, tmp_path, path, "--drafter", "mtp",
           text=["model.layers.3.embed_tokens.weight differs from the target's model.embed_tokens.weight",
                 "model.layers.3.shared_head.head.weight differs from the target's lm_head.weight"])


def test_architecture_without_mtp_mapping(tiny_target, tmp_path, cli):
    _fails(cli, tmp_path, tiny_target, "--drafter", "mtp",
           text=["(dense) has no MTP modules: its config states none", "use an EAGLE-3 head"])


def test_target_released_without_mtp(targets, tmp_path, cli):
    stripped, _ = ml.split_head(targets["mimo-1"], tmp_path)
    cfg = read_json(stripped / "config.json")
    cfg["num_nextn_predict_layers"] = 0
    (stripped / "config.json").write_text(json.dumps(cfg))
    _fails(cli, tmp_path, stripped, "--drafter", "mtp", text=["has no MTP modules: its config states none"])


def test_head_made_for_another_target(targets, tmp_path, cli):
    _, head = ml.split_head(targets["mimo-1"], tmp_path)
    _fails(cli, tmp_path, targets["deepseek-1"].path, "--drafter", head,
           text=["maps to no canonical name", "missing tensor 'model.mtp_layers.0.self_attn.kv_b_proj.weight'"])
