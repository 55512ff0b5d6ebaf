"""The EAGLE-3 head against an independent reference forward, and its load-time checks."""

import json
import shutil

import pytest
import torch

import eagle_fixtures as ef
import tiny
from eagle_fixtures import one_thread, target_dir  # noqa: F401
from specpack.errors import InputError
from specpack.runtime.drafters.eagle3 import load_eagle3
from specpack.runtime.engine.sampling import Sampler, SamplingParams
from specpack.runtime.models.weights import load_target


@pytest.fixture(scope="module")
def llama():
    return load_target(target_dir("llama")), tiny.build_model("llama")


def features(hf, seq):
    """aux features [S, 3H] of `seq` from transformers (hidden_states[i] = input of layer i)."""
    with torch.no_grad():
        hidden = hf(seq[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i][0] for i in ef.AUX], -1)


def check_against_reference(head_dir, target, hf):
    drafter = load_eagle3(None, head_dir, target)
    w, cfg = ef.load_weights(head_dir)
    embed = w.get("embed_tokens.weight", hf.get_input_embeddings().weight.detach())
    seq = ef.greedy_sequences(hf, torch.randint(3, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(5)),
                              16)[0]
    feats = features(hf, seq)
    drafter.reset(64)
    # round 1: target positions 0..11 known, x_12 is the target's latest token
    got = drafter.propose(seq[:13], feats[:12], 5).tokens.tolist()
    assert got == ef.ref_draft(w, cfg, embed, feats[:12], seq[1:13], 5)
    # round 2: four more positions accepted; the draft steps of round 1 must have been dropped
    got = drafter.propose(seq[:17], feats[12:16], 7).tokens.tolist()
    assert got == ef.ref_draft(w, cfg, embed, feats[:16], seq[1:17], 7)
    return got


def test_random_head_matches_reference(llama, tmp_path):
    check_against_reference(ef.random_head(tmp_path / "h", target_dir("llama")), *llama)


def test_own_embedding_and_norm_before_residual(llama, tmp_path):
    head = ef.random_head(tmp_path / "h", target_dir("llama"), seed=3, embedding="drafter", norm_before_residual=True)
    check_against_reference(head, *llama)


def test_trained_head_matches_reference(llama):
    target, hf = llama
    drafted = check_against_reference(ef.trained_head("llama"), target, hf)
    assert len(set(drafted)) > 1


def test_sampled_drafts_live_on_the_draft_vocab_and_follow_the_seed(llama, tmp_path):
    target, hf = llama
    head_dir = ef.random_head(tmp_path / "h", target_dir("llama"), draft_vocab=50)
    drafter = load_eagle3(None, head_dir, target)
    seq = torch.randint(3, tiny.VOCAB, (10,), generator=torch.Generator().manual_seed(2))
    in_vocab = set((torch.arange(50) + ef.load_weights(head_dir)[0]["d2t"]).tolist())

    def sampled(seed):
        drafter.reset(32)
        return drafter.propose(seq, features(hf, seq)[:9], 4, Sampler(SamplingParams(temperature=1.0), seed,
                                                                      tiny.VOCAB)).tokens.tolist()

    drafts = [sampled(seed) for seed in range(6)]
    assert all(set(d) <= in_vocab and len(d) == 4 for d in drafts)
    assert sampled(3) == drafts[3]  # the noise is keyed by (seed, position)
    assert len({tuple(d) for d in drafts}) > 1


def test_head_for_another_target_is_refused(llama, tmp_path):
    target, _ = llama
    head = ef.random_head(tmp_path / "h", target_dir("llama"), aux=(1, 3, 6))
    cfg = json.loads((head / "config.json").read_text())
    cfg.update(target_hidden_size=32, target_vocab_size=500)
    (head / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError) as e:
        load_eagle3(None, head, target)
    text = "\n".join(e.value.problems)
    for part in ("target_hidden_size is 32", "target_vocab_size is 500", "aux layer id 6", "fc.weight has shape"):
        assert part in text


def test_broken_vocab_map_and_missing_tensors(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    target, _ = llama
    head = ef.random_head(tmp_path / "h", target_dir("llama"))
    w = load_file(str(head / "model.safetensors"))
    w["d2t"][0] = tiny.VOCAB + 5
    save_file(w, str(head / "model.safetensors"))
    with pytest.raises(InputError, match="vocabulary map"):
        load_eagle3(None, head, target)
    del w["norm.weight"], w["fc.weight"]
    save_file(w, str(head / "model.safetensors"))
    with pytest.raises(InputError) as e:
        load_eagle3(None, head, target)
    assert sum("missing tensor" in p for p in e.value.problems) == 2
    shutil.rmtree(head)
    with pytest.raises(InputError, match="no config.json"):
        load_eagle3(None, head, target)
