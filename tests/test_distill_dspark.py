"""`specpack distill --head dspark`: a DSpark head trained on a tiny target's own outputs goes through
the DeepSpec converter, decodes greedy-identical and drafts far better than an untrained one; its
training forward is the runtime drafter's forward; it resumes exactly; bad options are clear errors."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

import tiny
from conftest import read_json
from eagle_fixtures import one_thread  # noqa: F401
from specpack.distill import distill
from specpack.distill.train import CHECKPOINT
from specpack.errors import InputError

WORDS = " ".join(tiny.CORPUS).split()
FAST = dict(draft_vocab=256, seq_len=64, gen_tokens=48, batch_size=8, progress=False, head="dspark")
OPTIONS = {"anchors": 16}  # blocks per window (the default 64 is for windows of 256 positions)


def word_prompts(n: int, seed: int) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 8))) for _ in range(n)]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in word_prompts(64, 0)))
    return {"root": root, "cache": root / "cache", "prompts": prompts}


def run(target, out, work, steps, **over):
    opts = {**FAST, "lr": 1e-2, "dspark": OPTIONS, **over}
    return distill(target, out, data=work["prompts"], self_generate=64, steps=steps, cache_dir=work["cache"], **opts)


@pytest.fixture(scope="module")
def trained(tiny_target, work):
    """A DSpark head distilled from the tiny target's greedy continuations of 64 word prompts."""
    result = run(tiny_target, work["root"] / "head", work, steps=150)
    assert result.finished
    return work["root"] / "head"


@pytest.fixture(scope="module")
def artifact(trained, tiny_target, tmp_path_factory):
    from specpack.packager import BuildOptions, build

    return build(BuildOptions(target=tiny_target, drafter=str(trained), out=tmp_path_factory.mktemp("art") / "a")).out


def mean_acceptance(model, prompts) -> float:
    als = []
    for ids in prompts:
        plain = model.generate(ids, max_new_tokens=48, speculative=False)
        spec = model.generate(ids, max_new_tokens=48, draft_len=5)
        assert spec.tokens == plain.tokens  # lossless
        als.append(spec.stats.acceptance_length)
    return sum(als) / len(als)


def test_distilled_head_builds_through_the_deepspec_converter_and_drafts_far_better(artifact, tiny_target, work,
                                                                                   tmp_path, cli):
    from transformers import AutoTokenizer

    import specpack

    drafter = read_json(artifact / "specpack.json")["drafter"]
    assert (drafter["kind"], drafter["source_layout"], drafter["algorithm"]) == ("block", "deepspec-dspark", "dspark")
    assert drafter["query_layout"] == "anchor_first" and drafter["draft_slots"] == 5
    assert drafter["target_features"]["layer_ids"] == [2, 4, 5]  # EAGLE-3's defaults: the same feature cache
    assert drafter["draft_vocab_size"] == 256 and drafter["embedding_source"] == "target"
    assert drafter["markov"] == {"rank": 64, "type": "vanilla"} and drafter["confidence"]["with_markov"]
    untrained = run(tiny_target, tmp_path / "untrained", work, steps=1, lr=1e-12).out
    assert cli("build", tiny_target, "--drafter", untrained, "-o", tmp_path / "art0")[0] == 0

    tok = AutoTokenizer.from_pretrained(tiny_target)
    held_out = [tok(p).input_ids for p in word_prompts(6, seed=99)]
    al = {name: mean_acceptance(specpack.load(art), held_out)
          for name, art in (("trained", artifact), ("untrained", tmp_path / "art0"))}
    assert al["untrained"] < 1.3, al
    assert al["trained"] > 1.6 and al["trained"] > al["untrained"] + 0.5, al


def test_export_layout_and_training_record(trained, work):
    from specpack.distill.data import Features

    cfg = read_json(trained / "config.json")
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["target_layer_ids"] == [1, 3, 4]  # output of
    assert (cfg["block_size"], cfg["num_hidden_layers"], cfg["markov_rank"]) == (5, 3, 64)
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (tiny.VOCAB, 256)
    feats = Features.load(next(work["cache"].glob("*/features.safetensors")))
    mask = cfg["mask_token_id"]
    assert not (feats.tokens == mask).any() and not (feats.pred == mask).any()  # a row no text uses
    names = set(load_file(trained / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.k_norm.weight", "norm.weight", "lm_head.weight",
            "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias", "d2t"} <= names
    assert not any(n.startswith("embed") for n in names) and not (trained / CHECKPOINT).exists()
    record = read_json(trained / "training.json")
    assert record["head"]["family"] == "dspark" and record["head"]["export_layout"] == "deepspec-dspark"
    assert record["training"]["l1_alpha"] == 0.9 and "ttt_steps" not in record["training"]
    validation = record["result"]["validation"]
    assert validation["draft_len"] == 5 and validation["agreement"][0] > 0.2
    assert len(validation["mean_confidence"]) == 5


def test_training_forward_is_the_runtime_drafter(trained, artifact, tiny_target):
    """Teacher-forced on the runtime's own drafts, the trainable head's block at an anchor gives the
    runtime's tokens and confidences (same context, positions, mask, Markov inputs)."""
    from specpack.distill.dspark import DSparkConfig, DSparkHead
    from specpack.runtime.drafters.block import load_block
    from specpack.runtime.models.weights import load_target

    target = load_target(tiny_target)
    drafter = load_block(None, artifact / "drafter", target)
    record = read_json(trained / "training.json")["head"]
    cfg = DSparkConfig(**{k: tuple(v) if k == "aux_layer_ids" else v for k, v in record.items()
                          if k in DSparkConfig.__dataclass_fields__})
    head = DSparkHead(cfg, target.embed_tokens.weight).eval()
    weights = load_file(trained / "model.safetensors")
    d2t = weights.pop("d2t")
    head.load_state_dict({**weights, "aux_scale": torch.ones(head.aux_scale.shape)})  # exported fc reads raw features

    seq = torch.randint(3, tiny.VOCAB, (30,), generator=torch.Generator().manual_seed(3))
    n = 21
    target.setup_cache(64)
    aux = target(seq[:n], capture=cfg.aux_layer_ids).aux
    drafter.reset(64)
    draft = drafter.propose(seq[:n], aux[: n - 1], 5)
    prev = torch.cat([seq[n - 1 : n], draft.tokens[:-1]])[None, None]
    with torch.no_grad():
        logits, confidence = head(aux[None, : n - 1], torch.arange(n - 1)[None], torch.tensor([[n - 1]]),
                                  torch.tensor([[n - 1]]), prev)
    ids = logits[0, 0].argmax(-1)
    assert (ids + d2t[ids]).tolist() == draft.tokens.tolist()
    assert torch.allclose(torch.sigmoid(confidence[0, 0]), draft.confidence, atol=1e-5)


def test_resume_gives_the_same_head_as_an_uninterrupted_run(tiny_target, work, tmp_path):
    opts = dict(checkpoint_every=4)
    whole = run(tiny_target, tmp_path / "whole", work, steps=10, **opts)
    part = run(tiny_target, tmp_path / "split", work, steps=10, stop_after=6, **opts)
    assert not part.finished and (tmp_path / "split" / CHECKPOINT).is_file()
    rest = run(tiny_target, tmp_path / "split", work, steps=10, **opts)
    assert whole.finished and rest.finished
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "split" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    run(tiny_target, tmp_path / "other", work, steps=10, stop_after=4, dspark={**OPTIONS, "ce_alpha": 0.5}, **opts)
    with pytest.raises(InputError, match="other settings"):  # a checkpoint of other DSpark settings
        run(tiny_target, tmp_path / "other", work, steps=10, dspark={**OPTIONS, "ce_alpha": 0.2})


def test_bad_dspark_options_are_reported_together(tiny_target, work, tmp_path):
    bad = {"block_size": 0, "layers": -1, "markov_rank": 1.5, "confidence_target": "sampled",
           "mask_token_id": tiny.VOCAB, "ce_alpha": 0, "l1_alpha": 0, "anchor": 3}
    with pytest.raises(InputError) as exc:
        run(tiny_target, tmp_path / "h", work, steps=1, dspark=bad)
    text = "\n".join(exc.value.problems)
    for part in ("block_size 0", "layers -1", "markov_rank 1.5", "confidence_target 'sampled'",
                 f"mask token id {tiny.VOCAB}", "unknown DSpark option 'anchor'"):
        assert part in text, part
    with pytest.raises(InputError, match=r"aux layer ids \[5, 2, 4\]: DeepSpec's layout needs them in increasing"):
        run(tiny_target, tmp_path / "h", work, steps=1, aux_layer_ids=(5, 2, 4))
    with pytest.raises(InputError, match="head 'medusa'"):
        run(tiny_target, tmp_path / "h", work, steps=1, head="medusa")
    assert not (tmp_path / "h").exists()


def test_cli_dspark_flags(tiny_target, work, tmp_path, cli):
    code, _, err = cli("distill", tiny_target, "-o", tmp_path / "h", "--data", work["prompts"], "--block-size", "4")
    assert code == 2 and "Traceback" not in err and "block_size (--block-size) given for an EAGLE-3 head" in err
    code, _, err = cli("distill", tiny_target, "-o", tmp_path / "h", "--data", work["prompts"],
                       "--distribution-loss", "soft-ce")
    assert code == 2 and "soft_ce_alpha (--distribution-loss) given for an EAGLE-3 head" in err
    code, _, err = cli("distill", tiny_target, "-o", tmp_path / "h", "--data", work["prompts"], "--head", "dspark",
                       "--draft-layers", "0", "--markov-rank", "0")
    assert code == 2 and "DSpark layers 0 must be a positive integer" in err and "markov_rank 0" in err
    code, out, err = cli("distill", tiny_target, "-o", tmp_path / "h", "--data", work["prompts"], "--head", "dspark",
                         "--block-size", "3", "--draft-layers", "1", "--markov-rank", "8", "--steps", "2",
                         "--seq-len", "32", "--batch-size", "2", "--draft-vocab", "128", "--distribution-loss",
                         "soft-ce", "--json")
    assert code == 0, err
    assert {k: json.loads(out)["record"]["training"][k] for k in ("l1_alpha", "soft_ce_alpha")} == \
        {"l1_alpha": 0.0, "soft_ce_alpha": 0.9}
    config = read_json(tmp_path / "h" / "config.json")
    assert (config["block_size"], config["num_hidden_layers"], config["markov_rank"]) == (3, 1, 8)


def test_demo_shows_the_dspark_head_when_there_is_one(trained, tiny_target, tmp_path, monkeypatch):
    """`make demo` builds and signs heads/smollm2-135m-dspark beside the other drafters, and skips it
    with a note when it is missing."""
    import shutil

    import specpack
    from specpack import demo
    from specpack.packager import keygen

    cache = tmp_path / "demo"
    shutil.copytree(tiny_target, cache / "smollm2-135m-instruct-f32")
    keygen(cache / "demo-signer", force=True)
    notes = []
    monkeypatch.setitem(demo.SHIPPED, "DSpark", (tmp_path / "missing", "bench/distill_smollm2_dspark.sh"))
    assert demo.prepare_head(cache, "DSpark", notes.append) is None
    assert "no DSpark head" in notes[-1] and "bench/distill_smollm2_dspark.sh" in notes[-1]
    monkeypatch.setitem(demo.SHIPPED, "DSpark", (trained, "bench/distill_smollm2_dspark.sh"))
    model = specpack.load(demo.prepare_head(cache, "DSpark", notes.append), public_key=cache / "demo-signer.pub")
    assert model.manifest.drafter.algorithm == "dspark"
    prompt = [5, 9, 14, 3, 22, 7, 40]
    assert model.generate(prompt, 16).tokens == model.generate(prompt, 16, speculative=False).tokens


def test_windows_wholly_inside_a_long_prompt_are_skipped():
    """A prompt longer than a window leaves windows with nothing the runtime drafts from: no anchors."""
    from specpack.distill.data import Features
    from specpack.distill.dspark import DSparkOptions
    from specpack.distill.dspark_train import DSparkBatches
    from specpack.distill.train import TrainConfig, windows

    n, H = 12, 4
    feats = Features(tokens=torch.arange(n), aux=torch.zeros(n, 2 * H, dtype=torch.float16),
                     final=torch.zeros(n, H, dtype=torch.float16), pred=torch.arange(n) % 5,
                     offsets=torch.tensor([0, n]), starts=torch.tensor([9]), groups=torch.tensor([0]))
    cfg = TrainConfig(seq_len=4, batch_size=2)
    wins = windows(feats, [0], cfg.seq_len)  # bases 0-3, 4-7, 8-10: the prompt runs to 8
    head = type("Head", (), {"block_size": 3})()
    b = DSparkBatches(feats, wins, torch.zeros(5, H), cfg, head, DSparkOptions(anchors=2), torch.arange(n))
    assert [w.start for w in b.wins] == [8]
    assert b.batch(b.wins)["anchor_pos"].tolist() == [[9, 10, 11]]  # every position after the prompt
    out = b.batch([b.wins[i] for i in b.indices(0)], step=0)
    assert out["anchor_pos"].shape == (2, 2) and out["valid"].any()


def test_soft_cross_entropy_is_the_weighted_mean_against_the_targets_distribution():
    """`soft_ce_alpha` (EAGLE-3's loss, not DeepSpec's): -sum(p_target · log q) per slot, weighted as
    the L1 term is (exp(-q / gamma) on the slots inside the text)."""
    from specpack.distill.dspark import DSparkOptions
    from specpack.distill.dspark_train import DSparkObjective
    from specpack.distill.vocab import DraftVocab

    g = torch.Generator().manual_seed(0)
    W, A, B, V = 2, 3, 4, 16
    logits, confidence = torch.randn(W, A, B, V, generator=g), torch.randn(W, A, B, generator=g)
    teacher = torch.randn(W, A, B, V, generator=g).softmax(-1)
    valid = torch.rand(W, A, B, generator=g) > 0.3
    b = {"aux": None, "ctx_pos": None, "anchors": None, "anchor_pos": None, "prev": None, "teacher": teacher,
         "valid": valid, "label": torch.randint(0, V, (W, A, B), generator=g)}
    vocab = DraftVocab(ids=torch.arange(V), target_size=V, coverage=1.0)
    options = DSparkOptions(ce_alpha=0.0, l1_alpha=0.0, soft_ce_alpha=1.0, confidence_alpha=0.0)
    loss, _ = DSparkObjective(None, options, vocab).losses(lambda *a: (logits, confidence), b, None, None)
    w = valid * torch.exp(-torch.arange(B) / options.loss_decay_gamma)
    soft = -(teacher * logits.log_softmax(-1)).sum(-1)
    assert torch.allclose(loss, (soft * w).sum() / w.sum())
    assert DSparkOptions(ce_alpha=0, l1_alpha=0, soft_ce_alpha=0.5).problems(V) == []
    assert "soft_ce_alpha -1" in " ".join(DSparkOptions(soft_ce_alpha=-1).problems(V))
