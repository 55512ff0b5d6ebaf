"""Draft models: a smaller causal LM with the target's tokenizer builds, verifies and runs losslessly."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from conftest import read_json
from eagle_fixtures import one_thread  # noqa: F401
from specpack.runtime.engine.sampling import Sampler, SamplingParams
from specpack.runtime.spec_model import SpecModel, load_drafter, load_target
from test_build_errors import _fails

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_draft(out, target, layers: int = 6):
    """The target's embedding, first `layers` layers, final norm and lm_head: a cheap draft that agrees
    with the target often enough to accept drafts. Tokenizer files copied from the target."""
    out.mkdir(parents=True)
    tensors = load_file(target / "model.safetensors")
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    cfg = read_json(target / "config.json")
    cfg.update(num_hidden_layers=layers, layer_types=(cfg.get("layer_types") or ["full_attention"] * layers)[:layers])
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(keep, out / "model.safetensors")
    for name in TOKENIZER_FILES:
        shutil.copy(target / name, out / name)
    return out


@pytest.fixture(scope="module")
def draft(tiny_target, tmp_path_factory):
    return make_draft(tmp_path_factory.mktemp("draft") / "d", tiny_target)


@pytest.fixture(scope="module")
def artifact(tiny_target, draft, tmp_path_factory):
    from specpack.packager import BuildOptions, build

    return build(BuildOptions(target=tiny_target, drafter=str(draft), out=tmp_path_factory.mktemp("a") / "art")).out


def test_builds_verifies_and_carries_the_draft_byte_for_byte(tiny_target, draft, tmp_path, keypair, cli):
    out = tmp_path / "art"
    code, _, err = cli("build", tiny_target, "--drafter", draft, "-o", out, "--key", keypair.private)
    assert code == 0, err
    assert cli("verify", out, "--key", keypair.public)[0] == 0
    code, text, _ = cli("inspect", out)
    assert code == 0 and "tokens with the target's ids" in text
    assert sorted(p.name for p in (out / "drafter").iterdir()) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (out / "drafter" / name).read_bytes() == (draft / name).read_bytes()
    assert os.stat(out / "drafter/model.safetensors").st_ino == os.stat(draft / "model.safetensors").st_ino
    m = read_json(out / "specpack.json")
    d = m["drafter"]
    assert (d["kind"], d["architecture"], d["num_layers"], d["weight_files"]) == \
        ("draft_model", "LlamaForCausalLM", 6, ["model.safetensors"])
    assert d["tokenizer"] == {"vocab_tokens": 384, "added_tokens": 5, "files_identical": True,
                              "special_tokens": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                                 "pad_token": "<unk>"},
                              "target_vocab_size": 384, "draft_vocab_size": 384,
                              "draft_tokenizer_sha256": m["target"]["tokenizer_sha256"]}
    assert m["memory"]["drafter_weight_bytes"] == (draft / "model.safetensors").stat().st_size - \
        8 - int.from_bytes((draft / "model.safetensors").read_bytes()[:8], "little")
    assert "## Drafter: draft model" in (out / "README.md").read_text()


def test_greedy_speculative_equals_plain(artifact):
    import specpack

    import eagle_fixtures as ef

    model = specpack.load(artifact)
    seqs = ef.greedy_sequences(tiny.build_model("llama", num_hidden_layers=8), ef.training_prompts(n=6), 12)
    al = []
    for i in range(6):
        prompt = seqs[i, : 8 + i % 5].tolist()
        plain = model.generate(prompt, 24, speculative=False, eos_ids=()).tokens
        for d in (1, 3, 6):
            got = model.generate(prompt, 24, draft_len=d, eos_ids=())
            assert got.tokens == plain, (i, d)
            al.append(got.stats.acceptance_length)
    assert sum(al) / len(al) > 1.2, al


def test_sampled_drafts_keep_the_accepted_rows(artifact):
    target = load_target(artifact)
    model = SpecModel(target, load_drafter("draft_model", None, artifact / "drafter", target))
    drafter = model.drafter
    drafter.reset(32)
    context = torch.tensor([1, 5, 9, 40, 41])
    draft = drafter.propose(context, None, 3, Sampler(SamplingParams(temperature=1.0), 0, 384))
    assert len(draft.tokens) == 3 and draft.tokens.max() < drafter.vocab
    assert len(drafter.seen[0]) == 5 + 2  # context + all drafts but the last
    nxt = torch.cat([context, draft.tokens[:1], torch.tensor([7])])  # one draft accepted, then the target's token
    assert drafter._valid_rows(0, nxt) == 6  # the accepted draft's row is kept
    got = model.generate([1, 5, 9, 40], 10, draft_len=3, temperature=0.7, seed=1, eos_ids=())
    assert len(got.tokens) == 10


# ---- bad inputs ----

def test_different_tokenizer(tiny_target, draft, tmp_path, cli):
    other = shutil.copytree(draft, tmp_path / "other")
    tiny.make_tokenizer(other, vocab_size=300)  # a smaller vocabulary...
    tok = read_json(other / "tokenizer.json")
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # ...in which two tokens also swapped ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    _fails(cli, tmp_path, tiny_target, "--drafter", other,
           text=["token strings have other ids in the draft's tokenizer", "tokens are only in the target's tokenizer",
                 "must share the target's tokenizer"])


def test_different_special_tokens(tiny_target, draft, tmp_path, cli):
    other = shutil.copytree(draft, tmp_path / "other")
    cfg = read_json(other / "tokenizer_config.json")
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|im_end|>"}))
    _fails(cli, tmp_path, tiny_target, "--drafter", other,
           text=["special token eos_token: draft '<|im_end|>', target '</s>'"])


def test_unsupported_family(tiny_target, tmp_path, cli):
    from transformers import GPT2Config, GPT2LMHeadModel

    other = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=384, n_embd=32, n_layer=1, n_head=2)).save_pretrained(other)
    _fails(cli, tmp_path, tiny_target, "--drafter", other,
           text=["draft model", "GPT2LMHeadModel", "is not supported", "LlamaForCausalLM"])


def test_the_target_itself_is_not_a_draft(tiny_target, tmp_path, cli):
    _fails(cli, tmp_path, tiny_target, "--drafter", tiny_target, text=["a draft must be smaller than the target"])


def test_draft_without_tokenizer(tiny_target, draft, tmp_path, cli):
    other = shutil.copytree(draft, tmp_path / "other")
    for name in TOKENIZER_FILES:
        (other / name).unlink()
    _fails(cli, tmp_path, tiny_target, "--drafter", other, text=["cannot load the draft model's tokenizer"])
