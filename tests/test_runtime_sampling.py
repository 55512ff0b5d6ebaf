"""Speculative sampling keeps the target's distribution; a wrong accept rule is caught by the same test;
seeded sampling gives the same tokens with and without speculation."""

import math

import pytest
import torch

import block_fixtures as bf
from eagle_fixtures import one_thread  # noqa: F401
from specpack.runtime.drafters.block import load_block
from specpack.runtime.engine import engine
from specpack.families.dense import target_spec_from_config
from specpack.runtime.drafters.eagle3 import Eagle3Drafter, eagle3_spec_from_config
from specpack.runtime.models.dense import Transformer
from specpack.runtime.drafters.base import TreeShape
from specpack.runtime.drafters.draft_model import DraftModelDrafter
from specpack.runtime.drafters.ngram import NgramDrafter
from specpack.runtime.engine.sampling import SamplingParams, process_logits
from specpack.runtime.spec_model import SpecModel

V = 4  # a tiny vocab: the first 3 tokens have V**3 = 64 outcomes
PROMPT = [0, 1, 2, 3, 0, 1, 2]  # repeats, so the n-gram drafter proposes
RUNS = 600


@pytest.fixture(scope="module")
def target():
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": V,
           "max_position_embeddings": 64}
    torch.manual_seed(0)
    return Transformer(target_spec_from_config(cfg)).requires_grad_(False)


@pytest.fixture(scope="module")
def eagle(target):
    cfg = {"kind": "eagle3", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
           "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "target_hidden_size": 32, "aux_layer_ids": [0, 1, 1],
           "draft_vocab_size": 3, "target_vocab_size": V}
    torch.manual_seed(1)
    head = Eagle3Drafter(eagle3_spec_from_config(cfg), target.embed_tokens).requires_grad_(False)
    with torch.no_grad():
        head.d2t.copy_(torch.tensor([0, 2, 3]) - torch.arange(3))  # token 1 is outside the draft vocab
        head.lm_head.weight.mul_(3)  # a confident head, unlike the target
    return head


def exact_distribution(target, params):
    """P(first three tokens) under the target alone: [V, V, V]."""
    def dist(seq):
        target.setup_cache(16)
        return process_logits(target(torch.tensor(seq)).logits[-1:], params)[0]

    p = torch.zeros(V, V, V)
    first = dist(PROMPT)
    for a in range(V):
        second = dist(PROMPT + [a])
        for b in range(V):
            p[a, b] = first[a] * second[b] * dist(PROMPT + [a, b])
    return p.flatten()


def chi_square(model, params, exact, speculative_on=True, tree=None):
    """Pearson's statistic of RUNS seeded samples against `exact` (cells expecting < 5 pooled),
    and the critical value at significance 1e-3 (Wilson–Hilferty)."""
    counts = torch.zeros(V, V, V)
    for seed in range(RUNS):  # a tree run generates one token more, so that its second step drafts 2 deep
        r = model.generate(PROMPT, 3 + (tree is not None), draft_len=2, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, seed=seed, eos_ids=(), speculative=speculative_on,
                           tree=tree)
        counts[tuple(r.tokens[:3])] += 1
    expected, counts = exact * RUNS, counts.flatten()
    small = expected < 5
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected.clamp_min(1e-9)).sum())
    df = len(expected) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def always_accept(drafts, target):
    """A deliberately wrong rule: keep every draft, then the target's token after them."""
    return len(drafts), drafts + target[len(drafts) : len(drafts) + 1]


PARAMS = {"t1": SamplingParams(temperature=1.0), "t0.7-k3-p0.9": SamplingParams(temperature=0.7, top_k=3, top_p=0.9)}


def block_head(target, path, algorithm):
    """A random block drafter for the tiny target: DFlash over 3 of the 4 tokens (d2t), DSpark with
    its Markov correction, LiLiCorr walking 2 candidates per slot."""
    over = {"dflash": {"draft_vocab": 3}, "lilicorr": {},
            "dspark": {"layout": "anchor_first", "markov": {"rank": 4, "type": "vanilla"}}}[algorithm]
    cfg = bf.block_config({"hidden_size": 32, "vocab_size": V}, algorithm, layer_ids=(0, 1), hidden_size=32,
                          num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, **over)
    if algorithm == "lilicorr":
        cfg["lilicorr"] = {**cfg["lilicorr"], "candidate_topk": 2, "hidden_size": 16, "logit_scale": 100.0}
    return load_block(None, bf.write_block(path, cfg, bf.random_weights(cfg, 1)), target)


@pytest.fixture(scope="module", params=["eagle3", "ngram", "dflash", "dspark", "lilicorr"])
def drafter(request, eagle, target, tmp_path_factory):
    if request.param in ("eagle3", "ngram"):
        return eagle if request.param == "eagle3" else NgramDrafter(1, 3)
    return block_head(target, tmp_path_factory.mktemp("block"), request.param)


def test_plain_sampling_matches_the_exact_distribution(target):
    stat, critical = chi_square(SpecModel(target), PARAMS["t1"], exact_distribution(target, PARAMS["t1"]), False)
    assert stat < critical


@pytest.mark.parametrize("name", PARAMS)
def test_speculative_sampling_keeps_the_distribution(target, drafter, name):
    stat, critical = chi_square(SpecModel(target, drafter), PARAMS[name], exact_distribution(target, PARAMS[name]))
    assert stat < critical


def test_the_bound_rejects_a_wrong_accept_rule(target, drafter, monkeypatch):
    monkeypatch.setattr(engine, "accept", always_accept)
    stat, critical = chi_square(SpecModel(target, drafter), PARAMS["t1"], exact_distribution(target, PARAMS["t1"]))
    assert stat > 5 * critical


def test_process_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    assert torch.allclose(process_logits(logits, SamplingParams(1.0)), logits.softmax(-1))
    assert torch.allclose(process_logits(logits, SamplingParams(0.5)), (logits / 0.5).softmax(-1))
    top2 = process_logits(logits, SamplingParams(1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2[0, :2], logits[0, :2].softmax(-1))
    p = logits.softmax(-1)[0]  # ≈ [0.61, 0.22, 0.14, 0.03, 0.004]
    nucleus = process_logits(logits, SamplingParams(1.0, top_p=0.8))
    assert (nucleus[0, :2] > 0).all() and (nucleus[0, 2:] == 0).all() and p[0] < 0.8 < p[:2].sum()
    assert (process_logits(logits, SamplingParams(1.0, top_p=0.5))[0, 1:] == 0).all()


def test_sampling_is_reproducible(target, eagle):
    model = SpecModel(target, eagle)
    runs = [model.generate(PROMPT, 12, draft_len=3, temperature=1.0, seed=7, eos_ids=()).tokens for _ in range(2)]
    assert runs[0] == runs[1]


# ---- draft trees: the keyed-sample rule over siblings ----

TREE = TreeShape(2, 5)  # two children per node, five nodes: siblings at both depths


def first_child(tokens, parents, target):
    """A deliberately wrong tree rule: follow the first child whatever the target's token."""
    path = []
    while kids := [i for i, p in enumerate(parents) if p == (path[-1] if path else -1)]:
        path.append(kids[0])
    return path, [tokens[n] for n in path] + [target(path[-1] if path else -1)]


@pytest.fixture(scope="module", params=["eagle3", "ngram", "draft_model", "dflash", "dspark"])
def tree_drafter(request, eagle, target, tmp_path_factory):
    if request.param == "draft_model":
        torch.manual_seed(2)
        return DraftModelDrafter(Transformer(target.spec).requires_grad_(False), V)
    if request.param in ("dflash", "dspark"):
        return block_head(target, tmp_path_factory.mktemp("block"), request.param)
    return eagle if request.param == "eagle3" else NgramDrafter(1, 3)


def test_tree_sampling_keeps_the_distribution(target, tree_drafter):
    params = PARAMS["t0.7-k3-p0.9"] if isinstance(tree_drafter, Eagle3Drafter) else PARAMS["t1"]
    stat, critical = chi_square(SpecModel(target, tree_drafter), params, exact_distribution(target, params),
                                tree=TREE)
    assert stat < critical


def test_the_bound_rejects_a_wrong_tree_rule(target, eagle, monkeypatch):
    monkeypatch.setattr(engine, "accept_tree", first_child)
    stat, critical = chi_square(SpecModel(target, eagle), PARAMS["t1"], exact_distribution(target, PARAMS["t1"]),
                                tree=TREE)
    assert stat > 5 * critical


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_trees_branch_and_sample_the_same_tokens_as_plain_decoding(target, eagle, kind, tmp_path):
    """Seeded sampling: the same tokens with trees, chains or no speculation; and the trees branch."""
    model = SpecModel(target, eagle if kind == "eagle3" else block_head(target, tmp_path, kind))
    runs = [model.generate(PROMPT, 12, draft_len=3, temperature=1.0, seed=s, eos_ids=(), **kw)
            for s in range(8) for kw in ({"tree": TREE}, {}, {"speculative": False})]
    assert all(runs[i].tokens == runs[i + 1].tokens == runs[i + 2].tokens for i in range(0, len(runs), 3))
    assert sum(r.stats.proposed for r in runs[::3]) > sum(r.stats.proposed for r in runs[1::3])
