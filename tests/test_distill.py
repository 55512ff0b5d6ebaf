"""`specpack distill`: a head trained on a tiny target's own outputs builds, drafts well, resumes
exactly, matches the runtime head step for step, and bad inputs get clear errors."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

import eagle_fixtures as ef
import tiny
from conftest import read_json
from eagle_fixtures import one_thread  # noqa: F401
from specpack.distill import distill
from specpack.distill.data import FIELDS, Features, builtin_prompts, read_jsonl
from specpack.distill.head import HeadConfig, TrainableHead
from specpack.distill.data import Sampling, generate
from specpack.distill.train import CHECKPOINT, split
from specpack.distill.vocab import build_vocab
from specpack.errors import InputError, UnsupportedError

WORDS = " ".join(tiny.CORPUS).split()
FAST = dict(draft_vocab=256, seq_len=64, gen_tokens=48, lr=3e-3, batch_size=8, progress=False)


def word_prompts(n: int, seed: int) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 8))) for _ in range(n)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return {"root": root, "cache": root / "cache",
            "prompts": write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in word_prompts(64, 0)])}


@pytest.fixture(scope="module")
def trained(tiny_target, work):
    """A head distilled from the tiny target's greedy continuations of 64 word prompts (~5 s)."""
    out = work["root"] / "head"
    result = distill(tiny_target, out, data=work["prompts"], self_generate=64, steps=300,
                     cache_dir=work["cache"], **FAST)
    assert result.finished
    return out


def test_distilled_head_builds_and_drafts_far_better_than_an_untrained_one(trained, tiny_target, tmp_path, cli):
    from transformers import AutoTokenizer

    import specpack
    from specpack.runtime.drafters.eagle3 import load_eagle3
    from specpack.runtime.spec_model import SpecModel
    from specpack.runtime.models.weights import load_target

    assert cli("build", tiny_target, "--drafter", trained, "-o", tmp_path / "art")[0] == 0
    drafter = read_json(tmp_path / "art" / "specpack.json")["drafter"]
    assert drafter["source_layout"] == "eagle3-sglang" and drafter["draft_vocab_size"] == 256
    assert drafter["aux_hidden_states"]["layer_ids"] == [2, 4, 5]  # default (2, L//2, L-3), input of layer
    trained_model = specpack.load(tmp_path / "art")
    target = load_target(tiny_target)
    untrained = ef.random_head(tmp_path / "untrained", tiny_target, draft_vocab=256, aux=(2, 4, 5))
    untrained_model = SpecModel(target, load_eagle3(None, untrained, target))

    tok = AutoTokenizer.from_pretrained(tiny_target)
    held_out = [tok(p).input_ids for p in word_prompts(8, seed=99)]
    al = {}
    for name, model in (("trained", trained_model), ("untrained", untrained_model)):
        als = []
        for ids in held_out:
            plain = model.generate(ids, max_new_tokens=48, speculative=False)
            spec = model.generate(ids, max_new_tokens=48, draft_len=4)
            assert spec.tokens == plain.tokens  # lossless
            als.append(spec.stats.acceptance_length)
        al[name] = sum(als) / len(als)
    assert al["untrained"] < 1.2
    assert al["trained"] > 1.4 and al["trained"] > al["untrained"] + 0.3, al


def test_training_record_and_export_layout(trained, tiny_target):
    cfg = read_json(trained / "config.json")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang counts outputs
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (tiny.VOCAB, 256)
    names = set(load_file(trained / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(n.startswith("layers.") or n.startswith("embed") for n in names)
    assert not (trained / CHECKPOINT).exists()
    record = read_json(trained / "training.json")
    assert record["data"]["self_generate"] == 64 and record["data"]["tokens"] > 1000
    assert record["vocab"]["size"] == 256 and 0 < record["vocab"]["coverage"] <= 1
    assert record["result"]["steps_done"] == 300 and record["training"]["ttt_steps"] >= 2
    assert record["result"]["validation"]["agreement"][0] > 0.2


def test_rerun_with_same_settings_is_a_no_op(trained, tiny_target, work):
    before = (trained / "model.safetensors").stat().st_mtime_ns
    result = distill(tiny_target, trained, data=work["prompts"], self_generate=64, steps=300,
                     cache_dir=work["cache"], **FAST)
    assert result.finished and (trained / "model.safetensors").stat().st_mtime_ns == before


def test_resume_gives_the_same_head_as_an_uninterrupted_run(tiny_target, work, tmp_path):
    opts = dict(data=work["prompts"], self_generate=64, steps=12, checkpoint_every=4, cache_dir=work["cache"], **FAST)
    whole = distill(tiny_target, tmp_path / "whole", **opts)
    part = distill(tiny_target, tmp_path / "split", stop_after=6, **opts)
    assert not part.finished and (tmp_path / "split" / CHECKPOINT).is_file()
    assert not (tmp_path / "split" / "model.safetensors").exists()
    rest = distill(tiny_target, tmp_path / "split", **opts)
    assert whole.finished and rest.finished
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "split" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_from_other_settings_is_refused(tiny_target, work, tmp_path):
    opts = dict(data=work["prompts"], self_generate=64, steps=12, cache_dir=work["cache"], **FAST)
    distill(tiny_target, tmp_path / "h", stop_after=4, checkpoint_every=4, seed=1, **opts)
    with pytest.raises(InputError, match="other settings"):
        distill(tiny_target, tmp_path / "h", seed=2, **opts)
    assert distill(tiny_target, tmp_path / "h", seed=2, resume=False, **opts).finished


def test_ttt_steps_match_the_runtime_drafter(trained, tiny_target, tmp_path, cli):
    """The trainable head's TTT step k is exactly runtime draft step k+1 (same tokens, positions, keys)."""
    from specpack.runtime.drafters.eagle3 import load_eagle3
    from specpack.runtime.models.weights import load_target

    assert cli("build", tiny_target, "--drafter", trained, "-o", tmp_path / "art")[0] == 0
    target = load_target(tiny_target)
    drafter = load_eagle3(None, tmp_path / "art" / "drafter", target)
    record = read_json(trained / "training.json")["head"]
    head_cfg = HeadConfig(**{k: tuple(v) if k == "aux_layer_ids" else v for k, v in record.items()
                             if k in HeadConfig.__dataclass_fields__})
    head = TrainableHead(head_cfg, target.embed_tokens.weight).eval()
    weights = load_file(trained / "model.safetensors")
    state = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items() if k not in ("d2t", "t2d")}
    head.load_state_dict({**state, "aux_scale": torch.ones(head.aux_scale.shape)})  # exported fc reads raw features
    draft_ids = torch.arange(256) + weights["d2t"]

    seq = torch.randint(3, tiny.VOCAB, (30,), generator=torch.Generator().manual_seed(3))
    m, K = 21, 4
    target.setup_cache(64)
    drafter.reset(64)
    aux = target(seq[:m], capture=head_cfg.aux_layer_ids).aux
    drafts = drafter.propose(seq[:m], aux[: m - 1], K).tokens
    # teacher-force the runtime's own drafts: base m-2, step k reads token x_{m-1+k}
    tokens = torch.cat([seq[1:m], drafts[: K - 1]])[None]
    feats = torch.cat([aux[: m - 1], torch.zeros(K - 1, aux.shape[1])])[None]
    with torch.no_grad():
        logits = head(feats, tokens, torch.arange(tokens.shape[1])[None], K)
    assert [int(draft_ids[lg[0, m - 2].argmax()]) for lg in logits] == drafts.tolist()


def test_vocab_takes_the_most_predicted_tokens():
    pred = torch.tensor([5, 5, 5, 7, 7, 9])
    tokens = torch.tensor([1, 1, 2, 3])
    v = build_vocab(pred, tokens, target_size=12, size=4)
    assert v.ids.tolist() == [1, 5, 7, 9]  # predicted ones first, then by frequency in the text
    assert torch.equal(v.ids, torch.arange(4) + v.d2t)
    assert v.t2d.sum() == 4 and bool(v.t2d[v.ids].all()) and v.coverage == 1.0


def test_builtin_prompts_are_fixed_and_cover_chat_and_code():
    prompts = builtin_prompts()
    assert prompts == builtin_prompts() and len(set(prompts)) == len(prompts) >= 100
    assert any("story" in p for p in prompts) and any("Python function" in p for p in prompts)


def test_features_round_trip(tmp_path):
    f = Features(tokens=torch.arange(5), aux=torch.randn(5, 6).half(), final=torch.randn(5, 2).half(),
                 pred=torch.arange(5), offsets=torch.tensor([0, 2, 5]), starts=torch.tensor([0, 1]),
                 groups=torch.tensor([0, 1]))
    f.save(tmp_path / "f.safetensors")
    g = Features.load(tmp_path / "f.safetensors")
    assert all(torch.equal(getattr(f, k), getattr(g, k)) for k in FIELDS)
    assert g.sequence(1) == slice(2, 5)


def test_sampled_continuations_add_text_labelled_with_the_target_argmax(tiny_target, tmp_path):
    """Pass 0 is the greedy continuation, the others are sampled (seeded, so a re-run repeats them);
    every position's label is the target's argmax, and validation holds out whole seed groups."""
    from transformers import AutoModelForCausalLM

    prompts = [[5 + i, 9, 11 + i] for i in range(6)]
    sampling = Sampling(passes=3, temperature=1.0, seed=7)
    for d in "abc":
        (tmp_path / d).mkdir()
    feats = generate(tiny_target, prompts, 16, (), (1, 2), tmp_path / "a", sampling, batch_size=4)
    again = generate(tiny_target, prompts, 16, (), (1, 2), tmp_path / "b", sampling, batch_size=4)
    greedy = generate(tiny_target, prompts, 16, (), (1, 2), tmp_path / "c", Sampling(), batch_size=4)
    seqs = [feats.tokens[feats.sequence(i)].tolist() for i in range(len(feats.starts))]
    assert len(seqs) == 18 and feats.groups.tolist() == list(range(6)) * 3
    assert all(torch.equal(getattr(feats, k), getattr(again, k)) for k in FIELDS)
    assert seqs[:6] == [greedy.tokens[greedy.sequence(i)].tolist() for i in range(6)]
    assert sum(seqs[i] != seqs[i + 6] for i in range(6)) >= 4  # sampled text differs from greedy
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    for i in (0, 7, 14):
        span = feats.sequence(i)
        logits = model(feats.tokens[span][None]).logits[0]
        assert torch.equal(feats.pred[span], logits.argmax(-1))
    train, val = split(feats, 0.34, seed=0)
    held = set(feats.groups[val].tolist())
    assert len(held) == 2 and len(val) == 6 and not held & set(feats.groups[train].tolist())


def test_sampling_options_are_checked(tiny_target, work, tmp_path):
    with pytest.raises(InputError) as exc:
        distill(tiny_target, tmp_path / "h", data=work["prompts"], samples=0, temperature=0.0, steps=1)
    assert "samples per prompt 0" in str(exc.value) and "temperature 0.0" in str(exc.value)
    with pytest.raises(InputError, match="needs --self-generate"):
        distill(tiny_target, tmp_path / "h", data=work["prompts"], samples=2, steps=1)


# ---- bad inputs ----

def test_missing_data_file(tiny_target, tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        distill(tiny_target, tmp_path / "h", data=tmp_path / "nope.jsonl", steps=1)


def test_malformed_data_file_names_every_bad_line(tiny_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n\n[1, 2]\n{"messages": [{"role": "user"}]}\n{"other": 1}\n')
    with pytest.raises(InputError) as exc:
        distill(tiny_target, tmp_path / "h", data=bad, steps=1)
    problems = exc.value.problems
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 4", "line 5", "line 6"]
    assert "not JSON" in problems[0] and "messages" in problems[2]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InputError, match="no records"):
        read_jsonl(empty)


@pytest.mark.parametrize("vocab", [0, -3, tiny.VOCAB + 1])
def test_draft_vocab_out_of_range(tiny_target, work, tmp_path, vocab):
    with pytest.raises(InputError) as exc:
        distill(tiny_target, tmp_path / "h", data=work["prompts"], draft_vocab=vocab, steps=1)
    assert "draft vocab" in str(exc.value) and f"1..{tiny.VOCAB}" in exc.value.hint


def test_no_data_and_bad_options_are_reported_together(tiny_target, tmp_path):
    with pytest.raises(InputError) as exc:
        distill(tiny_target, tmp_path / "h", steps=0, aux_layer_ids=(1, 1, 9))
    text = str(exc.value)
    assert "no data" in text and "steps 0" in text and "aux layer ids [1, 1, 9]" in text


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "DeepseekV3ForCausalLM"])
def test_unsupported_target_family(tiny_target, work, tmp_path, arch):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = read_json(target / "config.json")
    (target / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    with pytest.raises(UnsupportedError, match=arch):
        distill(target, tmp_path / "h", data=work["prompts"], steps=1)


def test_cli_reports_bad_options_at_once(tiny_target, tmp_path, cli):
    code, _, err = cli("distill", tiny_target, "-o", tmp_path / "head", "--draft-vocab", "0")
    assert code == 2 and "Traceback" not in err
    assert "draft vocab 0 must be a positive integer" in err and "no data" in err
    assert not (tmp_path / "head").exists()


def test_given_text_and_conversations_train_without_generation(tiny_target, tmp_path):
    rows = [{"text": t} for t in tiny.CORPUS]
    rows += [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": tiny.CORPUS[1]}]},
             {"prompt": "def add(a, b):", "completion": "\n    return a + b\n"}]
    data = write_jsonl(tmp_path / "text.jsonl", rows)
    result = distill(tiny_target, tmp_path / "h", data=data, steps=4, cache_dir=tmp_path / "cache", **FAST)
    record = read_json(tmp_path / "h" / "training.json")
    assert result.finished and record["data"]["source"] == "file" and record["data"]["sequences"] == len(rows)
    assert record["data"]["generated_tokens"] == 0 and (tmp_path / "h" / "model.safetensors").is_file()


def test_cli_trains_and_reports_bad_input_without_traceback(tiny_target, tmp_path, cli):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in tiny.CORPUS])
    code, out, err = cli("distill", tiny_target, "-o", tmp_path / "h", "--data", data, "--draft-vocab", "0")
    assert code == 2 and "draft vocab 0 must be a positive integer" in err and "Traceback" not in err
    code, out, err = cli("distill", tiny_target, "-o", tmp_path / "h", "--data", data, "--draft-vocab", "128",
                         "--steps", "3", "--seq-len", "32", "--batch-size", "2", "--keep-lm-head", "--dtype",
                         "float16", "--json")
    assert code == 0, err
    record = json.loads(out)["record"]
    assert json.loads(out)["finished"] and (tmp_path / "h" / "model.safetensors").is_file()
    assert record["training"]["batch_size"] == 2 and record["training"]["train_lm_head"] is False
    assert record["head"]["dtype"] == "float16"
    assert {t.dtype for t in load_file(tmp_path / "h" / "model.safetensors").values()} >= {torch.float16}


def test_cli_aux_layers_for_a_target_too_shallow_for_the_default(tmp_path, cli):
    """EAGLE-3's default features (inputs of layers 2, L/2, L-3) collide on a 6-layer target: the error
    says which flag picks others, and `--aux-layers` trains with them."""
    from eagle_fixtures import target_dir

    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in tiny.CORPUS])
    args = ("distill", target_dir("llama"), "-o", tmp_path / "h", "--data", data, "--steps", "2", "--seq-len", "32")
    code, _, err = cli(*args)
    assert code == 2 and "[2, 3, 3] (default for a 6-layer target)" in err and "--aux-layers" in err, err
    code, out, err = cli(*args, "--aux-layers", "1,3,5", "--json")
    assert code == 0, err
    assert json.loads(out)["record"]["head"]["aux_layer_ids"] == [1, 3, 5]
