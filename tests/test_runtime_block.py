"""Block drafters (DFlash, DSpark, LiLiCorr): drafts and confidences equal an independent reference
over several rounds, a batch drafts what each sequence drafts alone, greedy speculative output is
plain greedy output, and unusable heads are refused with every problem named."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import block_fixtures as bf
import block_reference as ref
import eagle_fixtures as ef
import tiny
from eagle_fixtures import one_thread, target_dir  # noqa: F401
from specpack.errors import InputError, UnsupportedError
from specpack.runtime.drafters.base import DraftJob, TreeShape
from specpack.runtime.drafters.block import load_block
from specpack.runtime.drafters.tree import depths
from specpack.runtime import kernels
from specpack.runtime.engine.sampling import Sampler, SamplingParams
from specpack.families.dense import target_spec_from_config
from specpack.runtime.models.dense import Transformer
from specpack.runtime.spec_model import SpecModel, load_drafter, load_target

LILI_SAME_WIDTH = {"candidate_topk": 2, "hidden_size": None, "num_layers": 1, "num_heads": 4, "mlp_ratio": 1.5,
                   "factor_dim": 8, "vector_eps": 1e-6, "logit_scale": 5.0}
VARIANTS = {
    "dflash": {},
    "dflash-anchor-first": {"layout": "anchor_first"},
    # own (bigger) embedding and head, reduced vocab, mask embedding, interleaved RoPE, biases, scale, a causal layer
    "dflash-everything": {"block_size": 5, "embedding": "drafter", "vocab_size": 400, "mask_token_id": 399,
                          "draft_vocab": 200, "mask_embedding": True, "rope_style": "interleaved",
                          "attention_bias": True, "logit_scale": 1.5, "layer_causal": [True, False]},
    "dspark": {"algorithm": "dspark", "layout": "anchor_first"},
    "dspark-gated-fill-in": {"algorithm": "dspark", "markov": {"rank": 8, "type": "gated"},
                             "confidence": {"with_markov": False}},
    "dspark-rnn-reduced": {"algorithm": "dspark", "layout": "anchor_first", "draft_vocab": 200,
                           "markov": {"rank": 8, "type": "rnn"}},
    "dspark-no-markov": {"algorithm": "dspark", "markov": None, "confidence": {"with_markov": False}},
    "lilicorr": {"algorithm": "lilicorr", "block_size": 5},
    "lilicorr-same-width": {"algorithm": "lilicorr", "lilicorr": LILI_SAME_WIDTH, "lm_head": "drafter"},
}


@pytest.fixture(scope="module")
def llama():
    return load_target(target_dir("llama")), tiny.build_model("llama")


def target_cfg() -> dict:
    return tiny.read_json(target_dir("llama") / "config.json")


def head(path, variant: str, seed: int = 0):
    return bf.random_block(path, target_cfg(), seed, **VARIANTS[variant])


def features(hf, seq):
    """[S, 3H]: the input hidden states of the capture layers (hidden_states[i]) of `seq`."""
    with torch.no_grad():
        hidden = hf(seq[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i][0] for i in bf.LAYER_IDS], -1)


def sequence(hf, seed: int, new: int = 12):
    prompt = torch.randint(3, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(seed))
    return ef.greedy_sequences(hf, prompt, new)[0]


def sampler(seed):
    return None if seed is None else Sampler(SamplingParams(temperature=1.0), seed, tiny.VOCAB)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "sampled"])
def test_drafts_match_the_reference_over_rounds(llama, tmp_path, variant, seed):
    target, hf = llama
    head_dir = head(tmp_path / "h", variant)
    drafter = load_block(None, head_dir, target)
    w, cfg = bf.load_head(head_dir)
    embed, lm_head = hf.get_input_embeddings().weight.detach(), hf.lm_head.weight.detach()
    seq = sequence(hf, 5)
    feats, N = features(hf, seq), cfg["draft_slots"]
    drafter.reset(64)
    committed, seen = 0, set()
    # each round: the context grows by the accepted drafts + 1; the rest of the last block is dropped
    for n, k in ((9, N), (12, 2), (13, N), (17, N + 2)):
        got = drafter.propose(seq[:n], feats[committed : n - 1], k, sampler(seed))
        want, conf = ref.ref_draft(w, cfg, embed, lm_head, feats[: n - 1], seq[:n], k, sampler(seed))
        committed = n - 1
        assert got.tokens.tolist() == want, f"round with {n} tokens"
        assert len(want) == min(k, N)
        if conf is None:
            assert got.confidence is None
        else:
            assert got.confidence.dtype == torch.float32
            torch.testing.assert_close(got.confidence, torch.tensor(conf), atol=1e-5, rtol=1e-5)
        seen.update(want)
    assert len(seen) > 1  # not a constant


@pytest.mark.parametrize("variant", ["dflash-everything", "dspark", "lilicorr"])
def test_a_batch_drafts_what_each_sequence_drafts_alone(llama, tmp_path, variant):
    target, hf = llama
    drafter = load_block(None, head(tmp_path / "h", variant), target)
    seqs = [sequence(hf, s) for s in (1, 2, 3)]
    feats = [features(hf, s) for s in seqs]
    rounds = [(9, 14, 11), (12, 15, 16)]  # context lengths per sequence, per round
    alone = []
    for i, (seq, f) in enumerate(zip(seqs, feats)):
        drafter.reset(64)
        sampled = sampler(7) if i == 1 else None
        alone.append([drafter.propose(seq[:r[i]], f[prev[i] - 1 if prev else 0 : r[i] - 1], 8, sampled)
                      for prev, r in zip([None] + rounds[:-1], rounds)])
    drafter.reserve(4, 64)
    slots = (3, 0, 2)
    for slot in slots:
        drafter.start(slot)
    for t, r in enumerate(rounds):
        jobs = [DraftJob(slot, seq[:r[i]], f[(rounds[t - 1][i] - 1 if t else 0) : r[i] - 1], (8, 2, 3)[i],
                         sampler(7) if i == 1 else None)
                for i, (slot, seq, f) in enumerate(zip(slots, seqs, feats))]
        for i, d in enumerate(drafter.draft(jobs)):
            want = alone[i][t]
            assert d.tokens.tolist() == want.tokens[: len(d.tokens)].tolist()
            if want.confidence is not None:
                torch.testing.assert_close(d.confidence, want.confidence[: len(d.tokens)])


# ---- through the engine ----

@pytest.fixture(scope="module")
def prompts():
    seqs = ef.greedy_sequences(tiny.build_model("llama"), ef.training_prompts(), 12)
    return [seqs[i, : 8 + i % 5].tolist() for i in range(6)]


@pytest.fixture(scope="module")
def plain(llama, prompts):
    model = SpecModel(llama[0])
    return [model.generate(p, 20, speculative=False, eos_ids=()).tokens for p in prompts]


@pytest.mark.parametrize("variant", ["dflash", "dflash-anchor-first", "dspark", "dspark-rnn-reduced", "lilicorr"])
def test_greedy_speculative_equals_plain(llama, prompts, plain, tmp_path, variant):
    target = llama[0]
    model = SpecModel(target, load_drafter("block", None, head(tmp_path / "h", variant), target))
    for i, (prompt, want) in enumerate(zip(prompts, plain)):
        got = model.generate(prompt, 20, draft_len=1 + i % 6, eos_ids=())
        assert got.tokens == want, f"prompt {i}"
        tree = model.generate(prompt, 20, draft_len=2 + i % 5, eos_ids=(), tree=TreeShape(2 + i % 2, 4 + i))
        assert tree.tokens == want, f"prompt {i}, tree"
    assert model.drafter.tree_drafts == (variant != "lilicorr")


@pytest.mark.parametrize("variant", ["dflash", "dspark", "dspark-rnn-reduced"])
def test_trees_follow_the_slots_joint_distribution(llama, tmp_path, variant):
    """A block drafter's tree is the top of its own joint distribution: a node's score is the product
    along its path of each slot's probability after the token before it (DSpark: the Markov bias of
    that token, and the rnn type's state along the path); the root's children are the first slot's
    top-k, and every node of a deeper level hangs under one of the k likeliest of the level above."""
    target = llama[0]
    drafter = load_drafter("block", None, head(tmp_path / "h", variant), target)
    seq = sequence(llama[1], 3)
    target.setup_cache(64)
    job = DraftJob(0, seq, target(seq, capture=drafter.capture_layers).aux[:-1], 4, None, TreeShape(3, 24))
    drafter.reset(64)
    draft = drafter.draft([job])[0]
    parents, tokens = draft.parents.tolist(), draft.tokens.tolist()
    assert len(tokens) > 20 and max(depths(parents)) > 2  # 3 + 9 + 9 (+ 9 where N > 3) candidates
    drafter.reset(64)
    with torch.inference_mode():
        drafter._absorb([job])
        out = drafter._block([job])

    def probs(path):  # each slot's distribution along `path` (node ids), the anchor before it
        prev, state, out_probs = seq[-1:], None, []
        for q in range(len(path) + 1):
            logits = out.logits[0, q].float()
            if drafter.markov_head is not None:
                _, bias, state = drafter.markov_head.step(prev, out.hidden[0, q][None], state)
                logits = logits + bias[0]
            out_probs.append(drafter._scaled(logits).softmax(-1))
            prev = torch.tensor([tokens[path[q]]]) if q < len(path) else prev
        return out_probs

    index = {int(t): i for i, t in enumerate(drafter.draft_to_target)}
    for n in range(len(tokens)):
        path = [n]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        dist = probs(path[:-1])
        want = torch.tensor([float(d[index[tokens[m]]]) for d, m in zip(dist, path)]).prod()
        assert float(draft.scores[n]) == pytest.approx(float(want), rel=1e-4), (n, path)
        top = drafter.draft_to_target[dist[-1].topk(3).indices].tolist()
        assert tokens[n] in top, (n, path)  # among its parent's top-3 children
    for d in range(2, max(depths(parents)) + 1):  # expanded parents: the likeliest of their level
        level = [n for n, dn in enumerate(depths(parents)) if dn == d - 1]
        best = sorted(level, key=lambda n: -float(draft.scores[n]))[:3]
        assert {parents[n] for n, dn in enumerate(depths(parents)) if dn == d} <= set(best)


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernel")
def test_greedy_equals_plain_on_the_packed_cpu_kernels(prompts, tmp_path):
    """What the torch backend runs on the CPU: every linear layer of target and drafter packed."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels

    threads = torch.get_num_threads()
    target = load_target(target_dir("llama"))
    try:
        use_cpu_kernels(target)
        plain = [SpecModel(target).generate(p, 20, speculative=False, eos_ids=()).tokens for p in prompts[:3]]
        for variant in ("dflash-everything", "dspark-rnn-reduced", "lilicorr"):
            drafter = load_block(None, head(tmp_path / variant, variant), target)
            assert use_cpu_kernels(drafter) > 0
            model = SpecModel(target, drafter)
            for prompt, want in zip(prompts, plain):
                assert model.generate(prompt, 20, draft_len=4, eos_ids=()).tokens == want
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernel")
@pytest.mark.parametrize("variant", ["dflash-everything", "dspark", "lilicorr"])
def test_packed_drafter_runs_fused_as_the_module_path_does(llama, tmp_path, variant):
    """On the packed kernel a drafter's draft forward is two C calls (FusedBlock: the context's fc,
    hidden_norm and every layer's keys and values; the query blocks' embedding, layers, final norm
    and lm_head), or, with fused layers alone, one C call per run of layers of the same causality
    (dflash-everything: a causal layer, then a non-causal one; its own embedding, mask embedding
    and head): the cache, the query block's hidden states and logits are the module path's within
    fp32 rounding, for two sequences drafted together at different lengths."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels
    from specpack.runtime.kernels.layers import FusedBlock, FusedLayers

    _, hf = llama
    threads = torch.get_num_threads()
    try:
        target = load_target(target_dir("llama"))
        use_cpu_kernels(target)  # the target's lm_head packed too: every variant's head runs fused
        drafter = load_block(None, head(tmp_path / "h", variant), target)
        assert use_cpu_kernels(drafter) > 0 and isinstance(drafter.fused, FusedLayers)
        assert isinstance(drafter.fused_block, FusedBlock)
        seqs = [sequence(hf, 5), sequence(hf, 6)]
        jobs = [DraftJob(0, seqs[0][:9], features(hf, seqs[0])[:8], 4, None),
                DraftJob(1, seqs[1][:6], features(hf, seqs[1])[:5], 2, None)]
        runs = {}
        with torch.inference_mode():
            for path in ("block", "layers", "modules"):
                drafter.fused_block = None if path != "block" else drafter.fused_block
                drafter.fused = None if path == "modules" else drafter.fused
                drafter.reserve(2, 64)
                drafter._absorb(jobs)
                kv = [c[:, slot, :, :n].clone() for c in (drafter.cache.k, drafter.cache.v)
                      for slot, n in ((0, 8), (1, 5))]  # each slot's context (the block's rows are scratch)
                runs[path] = kv, drafter._block(jobs)
    finally:
        torch.set_num_threads(threads)
    (kv, want) = runs["modules"]
    assert kv[0].abs().sum() > 0
    for path in ("block", "layers"):
        got_kv, got = runs[path]
        torch.testing.assert_close(got_kv, kv, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=0)
        for name in ("logits", "log_probs", "embeds"):
            if getattr(want, name) is not None:
                torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-4, rtol=0)
        if want.candidates is not None:
            assert torch.equal(got.candidates, want.candidates)


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernel")
def test_a_fused_block_reads_an_embedding_of_gguf_blocks_a_row_at_a_time(llama, tmp_path):
    """A target kept in GGUF blocks embeds with a BlockEmbedding: the fused draft forward dequantizes the rows it
    embeds (gguf_rows.c) instead of an fp32 table of the whole vocabulary, and drafts what the module path does
    with the same blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from specpack.runtime.kernels.accelerate import use_cpu_kernels
    from specpack.runtime.kernels.gguf import BlockEmbedding, Blocks
    from specpack.runtime.kernels.layers import FusedBlock

    _, hf = llama
    target = load_target(target_dir("llama"))
    use_cpu_kernels(target)
    table = target.embed_tokens.weight.detach().numpy().astype(np.float32)
    raw = torch.from_numpy(quantize(table, GGMLQuantizationType.Q8_0))
    blocks = BlockEmbedding(Blocks.of("Q8_0", raw, table.shape[1]))
    target.embed_tokens = blocks
    drafter = load_block(None, head(tmp_path / "h", "dspark"), target)
    use_cpu_kernels(drafter)
    assert drafter.embed_tokens is blocks and isinstance(drafter.fused_block, FusedBlock)
    seq = sequence(hf, 5)
    jobs = [DraftJob(0, seq[:9], features(hf, seq)[:8], 4, None)]
    runs = {}
    with torch.inference_mode():
        for path in ("block", "modules"):
            if path == "modules":
                drafter.fused_block, drafter.fused = None, None
            drafter.reserve(1, 64)
            drafter._absorb(jobs)
            runs[path] = drafter._block(jobs)
    assert blocks._dense is None  # no fp32 table was made
    torch.testing.assert_close(runs["block"].hidden, runs["modules"].hidden, atol=1e-5, rtol=0)
    torch.testing.assert_close(runs["block"].logits, runs["modules"].logits, atol=1e-4, rtol=0)


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernel")
def test_a_fused_block_reads_a_table_left_in_its_file_and_says_when_the_file_shrank(llama, tmp_path):
    """An fp32 table left in its file (FileEmbedding, as a target packed at load keeps it): the fused draft reads
    its rows with pread and drafts what the module path does; a file cut short after loading is an OSError,
    never a stale row."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels
    from specpack.runtime.kernels.layers import FusedBlock
    from specpack.runtime.models.weights import FileEmbedding

    _, hf = llama
    target = load_target(target_dir("llama"))
    use_cpu_kernels(target)
    table = target.embed_tokens.weight.detach().float().contiguous()
    path = tmp_path / "table.bin"
    path.write_bytes(b"\0" * 64 + table.numpy().tobytes())
    target.embed_tokens = FileEmbedding(path, 64, table)
    drafter = load_block(None, head(tmp_path / "h", "dspark"), target)
    use_cpu_kernels(drafter)
    assert isinstance(drafter.fused_block, FusedBlock)
    seq = sequence(hf, 5)
    jobs = [DraftJob(0, seq[:9], features(hf, seq)[:8], 4, None)]
    with torch.inference_mode():
        drafter.reserve(1, 64)
        drafter._absorb(jobs)
        fused = drafter._block(jobs)
        fb, layers = drafter.fused_block, drafter.fused
        drafter.fused_block, drafter.fused = None, None
        drafter.reserve(1, 64)
        drafter._absorb(jobs)
        want = drafter._block(jobs)
        torch.testing.assert_close(fused.logits, want.logits, atol=1e-4, rtol=0)
        drafter.fused_block, drafter.fused = fb, layers
        with open(path, "r+b") as f:
            f.truncate(64)
        drafter.reserve(1, 64)
        drafter._absorb(jobs)
        with pytest.raises(OSError, match="could not be read"):
            drafter._block(jobs)


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernel")
def test_fused_block_refuses_rows_past_its_cache_tables_and_embedding(llama, tmp_path):
    """The C calls index the cache, the RoPE tables and the embedding unchecked: a position past the
    reserve, a slot past the cache or a token id past the embedding is an IndexError, as on the module
    path, with the cache untouched (never a write past it)."""
    from specpack.runtime.kernels.accelerate import use_cpu_kernels

    _, hf = llama
    target = load_target(target_dir("llama"))
    use_cpu_kernels(target)
    drafter = load_block(None, head(tmp_path / "h", "dspark"), target)
    use_cpu_kernels(drafter)
    fb = drafter.fused_block
    assert fb is not None
    drafter.reserve(2, 8)
    size, T, vocab = drafter.cache.max_len, drafter.spec.block_len, len(drafter.embed_tokens.weight)
    feats = features(hf, sequence(hf, 5))[:3]
    before = drafter.cache.k.clone(), drafter.cache.v.clone()
    bad = {"position": (lambda: fb.context(feats, [(0, size - 2, 3)], drafter.cache), "positions"),
           "block position": (lambda: fb.draft([(0, size - T + 1, 5)], 0, T, 1, drafter.cache), "positions"),
           "slot": (lambda: fb.draft([(2, 0, 5)], 0, T, 1, drafter.cache), "slots"),
           "token": (lambda: fb.draft([(0, 0, vocab)], 0, T, 1, drafter.cache), "token ids"),
           "negative token": (lambda: fb.draft([(1, 0, -1)], 0, T, 1, drafter.cache), "token ids")}
    with torch.inference_mode():
        for name, (call, says) in bad.items():
            with pytest.raises(IndexError, match=says):
                call()
            assert torch.equal(drafter.cache.k, before[0]) and torch.equal(drafter.cache.v, before[1]), name
        fb.draft([(0, size - T, 5)], 0, T, 1, drafter.cache)  # the last block that fits runs


def small_target(vocab: int = 8):
    """A 2-layer target over a tiny vocabulary: random drafts are often right, so blocks get accepted."""
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": vocab, "max_position_embeddings": 64}
    torch.manual_seed(0)
    return Transformer(target_spec_from_config(cfg)).requires_grad_(False), {**cfg, "vocab_size": vocab}


def small_head(path, target_cfg: dict, bigrams=(), **over):
    """A random head for `small_target`; a DSpark head's Markov correction set to the given target
    bigrams (prev -> next, a one-hot W1 and a strong W2), so its drafts follow the target."""
    cfg = bf.block_config(target_cfg, layer_ids=(0, 1), hidden_size=32, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, **over)
    V = target_cfg["vocab_size"]
    if cfg["lilicorr"]:
        cfg["lilicorr"] = {**cfg["lilicorr"], "candidate_topk": 3, "hidden_size": 16}
    if cfg["markov"]:
        cfg["markov"] = {"rank": V, "type": "vanilla"}
    w = bf.random_weights(cfg, 3)
    if cfg["markov"]:
        w["markov_head.markov_w1.weight"] = torch.eye(V)
        w["markov_head.markov_w2.weight"] = torch.zeros(V, V)
        for a, b in bigrams:
            w["markov_head.markov_w2.weight"][b, a] = 30.0
    return bf.write_block(path, cfg, w)


@pytest.mark.parametrize("variant", ["dflash", "dspark", "lilicorr"])
def test_accepted_blocks_keep_greedy_output(tmp_path, variant):
    target, cfg = small_target()
    plain = SpecModel(target)
    prompts = [torch.randint(0, 8, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    wants = [plain.generate(p, 24, speculative=False, eos_ids=()).tokens for p in prompts]
    bigrams = {(a, b) for want in wants for a, b in zip(want, want[1:])}
    over = {"algorithm": variant, "layout": "anchor_first" if variant == "dspark" else "fill_in", "block_size": 5}
    model = SpecModel(target, load_block(None, small_head(tmp_path / "h", cfg, bigrams, **over), target))
    accepted = 0
    for prompt, want in zip(prompts, wants):
        got = model.generate(prompt, 24, draft_len=4, eos_ids=())
        assert got.tokens == want
        accepted += got.stats.accepted
    assert accepted > 20  # multi-row context updates were exercised


def test_confidence_trims_drafts_through_the_cost_model(tmp_path, monkeypatch):
    """DSpark's confidence head: the engine verifies only the drafted positions the cost model says
    are worth a row, and the output stays the plain greedy output. Without the confidences (an
    optimistic record alone) every drafted position is verified."""
    from specpack.runtime.drafters.base import Draft
    from specpack.runtime.engine import Engine, Request
    from specpack.runtime.engine import engine as eng
    from specpack.runtime.engine.cost import CostModel

    target, cfg = small_target()
    prompts = [torch.randint(0, 8, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    wants = [SpecModel(target).generate(p, 24, speculative=False, eos_ids=()).tokens for p in prompts]
    drafter = load_block(None, small_head(tmp_path / "h", cfg, algorithm="dspark", layout="anchor_first",
                                          block_size=5), target)

    def verified() -> int:
        rows = CostModel((1, 24), (10.0, 56.0))  # a row costs 20% of a step: worth it only when likely accepted
        done = Engine(target, drafter, slots=4, max_len=64, cost=rows, prior=(0.99,) * 5).run(
            [Request(p, 24, draft_len=5) for p in prompts])
        assert [r.tokens for r in done] == wants
        return sum(r.stats.proposed for r in done)

    with_confidence = verified()
    draft = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda jobs: [Draft(d.tokens) for d in draft(jobs)])
    assert with_confidence < verified()



def test_a_confidence_head_is_asked_for_the_whole_block(tmp_path, monkeypatch):
    """A block costs one forward whatever its length and the confidence head then cuts it to what is
    worth verifying: the engine asks for every slot (the record's survival, lowered by those cuts,
    would otherwise ask for ever fewer), within what is left to generate."""
    from specpack.runtime.engine import Engine, Request
    from specpack.runtime.engine.cost import CostModel

    target, cfg = small_target()
    prompt = torch.randint(0, 8, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    want = SpecModel(target).generate(prompt, 24, speculative=False, eos_ids=()).tokens
    drafter = load_block(None, small_head(tmp_path / "h", cfg, algorithm="dspark", layout="anchor_first",
                                          block_size=5), target)
    draft, asked = drafter.draft, []  # (draft length asked, the most it could be)

    def record(jobs):
        asked.extend((j.k, min(5, 24 - (len(j.context) - len(prompt)) - 1)) for j in jobs)
        return draft(jobs)

    monkeypatch.setattr(drafter, "draft", record)
    engine = Engine(target, drafter, slots=1, max_len=64, cost=CostModel((1, 24), (10.0, 56.0)), prior=(0.99,) * 5)
    assert engine.cost.parallel_drafts
    assert engine.run([Request(prompt, 24, draft_len=5)])[0].tokens == want
    assert len(asked) > 2 and all(k == most for k, most in asked)


def test_drafts_the_confidence_head_always_cuts_stop_being_asked_for(tmp_path, monkeypatch):
    """Positions cut after drafting count as not accepted in the acceptance record: a drafter whose
    every position is cut stops being asked (bar an occasional probe) instead of costing a draft
    forward every step for nothing."""
    from specpack.runtime.drafters.base import Draft
    from specpack.runtime.engine import Engine, Request
    from specpack.runtime.engine import engine as eng
    from specpack.runtime.engine.cost import CostModel

    target, cfg = small_target()
    prompts = [torch.randint(0, 8, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    wants = [SpecModel(target).generate(p, 48, speculative=False, eos_ids=()).tokens for p in prompts]
    drafter = load_block(None, small_head(tmp_path / "h", cfg, algorithm="dspark", layout="anchor_first",
                                          block_size=5), target)
    draft, asked = drafter.draft, []

    def hopeless(jobs):
        asked.append(len(jobs))
        return [Draft(d.tokens, confidence=torch.zeros(len(d.tokens))) for d in draft(jobs)]

    monkeypatch.setattr(drafter, "draft", hopeless)
    done = Engine(target, drafter, slots=4, max_len=64, cost=CostModel((1, 24), (10.0, 56.0)),
                  prior=(0.99,) * 5).run([Request(p, 48, draft_len=5) for p in prompts])
    assert [r.tokens for r in done] == wants
    assert sum(r.stats.proposed for r in done) == 0
    # the records fall from their 0.99 prior within a dozen misses at the confident pace (the test
    # below), then the engine only probes: one sequence at a time, once every PROBE_EVERY steps
    together = max((i for i, n in enumerate(asked) if n > 1), default=-1) + 1
    probes, engine_steps = asked[together:], max(r.stats.steps for r in done)
    assert together <= 12 and set(probes) <= {1}, asked
    assert len(probes) <= engine_steps // eng.PROBE_EVERY + 1, (asked, engine_steps)


def test_a_confidence_heads_record_outlasts_a_few_misses_not_many(tmp_path):
    """A drafter that rates its own drafts consults the acceptance record only to decide whether to
    draft its block: its sequences' record runs three times slower (CONFIDENT_RECORD_PACE). A few
    misses in a row stop the block's drafting at the usual pace (five from the flat prior; acceptance
    comes back: 0.41 tokens kept a step after three misses on HumanEval, BENCHMARKS.md); at its own it
    still drafts after twelve, and a long run of misses stops it too."""
    from specpack.runtime.engine import Engine, Request
    from specpack.runtime.engine import engine as eng
    from specpack.runtime.engine.cost import Acceptance, CostModel, choose

    cost = CostModel((1, 8), (10.0, 10.8), draft_ratio=0.2, parallel_drafts=True)

    def drafts_after(misses: int, pace: tuple[float, float]) -> bool:
        record = Acceptance(eng.DEFAULT_PRIOR, *pace)
        for _ in range(misses):
            record.update(5, 0)
        return choose([5], [record.survival(5)], 1, cost) != [0]

    assert drafts_after(4, eng.RECORD_PACE) and not drafts_after(5, eng.RECORD_PACE)
    assert drafts_after(12, eng.CONFIDENT_RECORD_PACE) and not drafts_after(30, eng.CONFIDENT_RECORD_PACE)

    target, cfg = small_target()
    paces = {}
    for variant in ("dspark", "dflash"):
        drafter = load_block(None, small_head(tmp_path / variant, cfg, algorithm=variant, layout="anchor_first",
                                              block_size=5), target)
        seq = Engine(target, drafter, slots=1, max_len=64, cost=cost).add(Request([1, 2, 3], 4, draft_len=5))
        paces[variant] = (seq.acceptance.weight, seq.acceptance.relax)
    assert paces == {"dspark": eng.CONFIDENT_RECORD_PACE, "dflash": eng.RECORD_PACE}


def test_a_block_drafter_drafts_at_most_its_draft_slots(tmp_path):
    """A longer draft asked of a block drafter is the same draft: `max_draft_len` says where it stops
    (tune sweeps draft lengths and tree depths up to it)."""
    from specpack.tuning.tune import max_draft_len

    target, cfg = small_target()
    drafter = load_block(None, small_head(tmp_path / "h", cfg, algorithm="dspark", layout="anchor_first",
                                          block_size=5), target)
    assert drafter.max_draft_len == drafter.spec.draft_slots == max_draft_len(drafter) == 5
    model, prompt = SpecModel(target, drafter), [1, 2, 3, 4, 5]
    five, eight = (model.generate(prompt, 16, draft_len=d, adaptive=False, eos_ids=()) for d in (5, 8))
    assert five.tokens == eight.tokens and five.stats.proposed == eight.stats.proposed > 0


def test_half_precision_runs(tmp_path):
    """bf16 weights, caches and features run end to end for every algorithm (not compared: exactness
    is per precision); the confidence head stays fp32."""
    target = load_target(target_dir("llama"), dtype=torch.bfloat16)
    prompt = list(range(3, 12))
    for variant in ("dflash-everything", "dspark", "lilicorr"):
        model = SpecModel(target, load_block(None, head(tmp_path / variant, variant), target))
        assert model.drafter.fc.weight.dtype == torch.bfloat16
        if model.drafter.confidence_head is not None:
            assert model.drafter.confidence_head.proj.weight.dtype == torch.float32
        for temperature in (0.0, 1.0):
            got = model.generate(prompt, 10, draft_len=4, temperature=temperature, seed=0, eos_ids=())
            assert len(got.tokens) == 10


# ---- refusals ----

def test_config_problems_are_listed_together():
    cfg = bf.block_config(target_cfg(), algorithm="dflash", layout="fill_in", draft_slots=4,
                          markov={"rank": 4, "type": "vanilla"}, rope_style="yarn", layer_causal=[False],
                          target_layer_convention="output_of_layer", embedding=None, mask_token_id=10_000)
    with pytest.raises(InputError) as e:
        bf.random_weights(cfg)
    text = "\n".join(e.value.problems)
    for part in ("draft_slots 4 with block_size 4", "markov head given for algorithm 'dflash'", "rope_style 'yarn'",
                 "layer_causal", "target_layer_convention 'output_of_layer'", "embedding: missing",
                 "mask_token_id 10000"):
        assert part in text
    assert e.value.hint


@pytest.mark.parametrize("over, part", [
    ({"algorithm": "lilicorr", "layout": "anchor_first"}, "lilicorr needs query_layout fill_in"),
    ({"algorithm": "lilicorr", "draft_vocab": 200}, "full target vocabulary"),
    ({"algorithm": "lilicorr", "lilicorr": None}, "required for algorithm lilicorr"),
    ({"algorithm": "dspark", "markov": None}, "with_markov is true but there is no markov head"),
    ({"algorithm": "dspark", "markov": {"rank": 4, "type": "lstm"}}, "markov {'rank': 4, 'type': 'lstm'}"),
    ({"layout": "anchor_first", "draft_slots": 5}, "draft_slots 5 with block_size 4"),
])
def test_inconsistent_heads_are_refused(over, part):
    with pytest.raises(InputError) as e:
        bf.random_weights(bf.block_config(target_cfg(), **over))
    assert any(part in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize("over, part", [({"sliding_window": [None, 128]}, "sliding_window"),
                                        ({"conv": {"kernel_size": 4, "group_size": 8}}, "conv")])
def test_what_the_runtime_cannot_run_yet_is_named(over, part):
    with pytest.raises(UnsupportedError) as e:
        bf.random_weights(bf.block_config(target_cfg(), **over))
    assert part in e.value.problems[0] and e.value.hint


def test_head_for_another_target_is_refused(llama, tmp_path):
    target = llama[0]
    path = head(tmp_path / "h", "dflash")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(target_hidden_size=32, target_vocab_size=500, target_layer_ids=[1, 3, 6], hidden_size=48)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError) as e:
        load_block(None, path, target)
    text = "\n".join(e.value.problems)
    for part in ("target_hidden_size is 32", "target_vocab_size is 500", "target layer id 6",
                 "cannot use the target's embedding", "fc.weight has shape"):
        assert part in text


def test_missing_unexpected_and_broken_tensors(llama, tmp_path):
    target = llama[0]
    path = head(tmp_path / "h", "dspark-rnn-reduced")
    w = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["confidence"] = None  # the file still holds the head: it must not be dropped silently
    (path / "config.json").write_text(json.dumps(cfg))
    del w["markov_head.joint_proj.bias"], w["norm.weight"]
    save_file(w, str(path / "model.safetensors"))
    with pytest.raises(InputError) as e:
        load_block(None, path, target)
    problems = e.value.problems
    assert sum("missing tensor" in p for p in problems) == 2
    assert sum("unexpected tensor confidence_head" in p for p in problems) == 2

    path = head(tmp_path / "h2", "dspark-rnn-reduced")
    w = load_file(str(path / "model.safetensors"))
    good = w["d2t"].clone()
    w["d2t"][3] = tiny.VOCAB
    save_file(w, str(path / "model.safetensors"))
    with pytest.raises(InputError, match="vocabulary map"):
        load_block(None, path, target)
    w["d2t"] = good
    w["layers.0.self_attn.attention_sink_bias"] = torch.zeros(bf.HEADS)
    save_file(w, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedError, match="attention sinks"):
        load_block(None, path, target)
    (path / "config.json").unlink()
    with pytest.raises(InputError, match="no config.json"):
        load_block(None, path, target)
