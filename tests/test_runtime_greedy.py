"""Greedy speculative decoding is token-identical to plain decoding, whatever the drafter."""

import pytest
import torch

import eagle_fixtures as ef
import tiny
from eagle_fixtures import one_thread, target_dir  # noqa: F401
from specpack.runtime.drafters.ngram import lookup
from specpack.runtime.spec_model import SpecModel, load_drafter, load_target

NEW = 32


@pytest.fixture(scope="module")
def target():
    return load_target(target_dir("llama"))


@pytest.fixture(scope="module")
def prompts():
    """24 prompts: prefixes of the sequences the trained head learned from, of varied length."""
    seqs = ef.greedy_sequences(tiny.build_model("llama"), ef.training_prompts(), 12)
    return [seqs[i, : 8 + i % 5].tolist() for i in range(24)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    plain = SpecModel(target)
    return [plain.generate(p, NEW, speculative=False, eos_ids=()).tokens for p in prompts]


@pytest.fixture(scope="module", params=["ngram", "eagle3-random", "eagle3-trained"])
def spec_model(request, target, tmp_path_factory):
    if request.param == "ngram":
        drafter = load_drafter("ngram", {"min_n": 1, "max_n": 3}, None, target)
    elif request.param == "eagle3-random":
        head = ef.random_head(tmp_path_factory.mktemp("h"), target_dir("llama"))
        drafter = load_drafter("eagle3", None, head, target)
    else:
        drafter = load_drafter("eagle3", None, ef.trained_head("llama"), target)
    return request.param, SpecModel(target, drafter)


def test_greedy_identical(spec_model, prompts, reference):
    kind, model = spec_model
    stats = []
    for i, (prompt, want) in enumerate(zip(prompts, reference)):
        got = model.generate(prompt, NEW, draft_len=1 + i % 8, eos_ids=())
        assert got.tokens == want, f"prompt {i}, draft length {1 + i % 8}"
        assert got.finish_reason == "length"
        stats.append(got.stats)
    al = sum(s.acceptance_length for s in stats) / len(stats)
    assert {"ngram": 1.3 < al, "eagle3-random": al < 1.2, "eagle3-trained": al > 2.5}[kind], al


def test_eos_inside_an_accepted_draft(spec_model, prompts, reference):
    _, model = spec_model
    cut = 0
    for i, (prompt, want) in enumerate(zip(prompts, reference)):
        eos = want[6 + i % 7]  # a token the model emits; stop at its first occurrence
        expect = want[: want.index(eos) + 1]
        chunks = []
        got = model.generate(prompt, NEW, draft_len=8, eos_ids=[eos], on_tokens=chunks.append)
        assert got.tokens == expect and got.finish_reason == "eos"
        assert sum(chunks, []) == expect
        s = got.stats
        cut += 1 + s.steps + s.accepted > s.new_tokens  # accepted tokens after the EOS were dropped
    if spec_model[0] != "eagle3-random":
        assert cut > 0, "no prompt put the EOS inside an accepted draft"


def test_max_tokens_and_context_mid_draft(spec_model, prompts, reference):
    _, model = spec_model
    for n in range(1, 12):
        got = model.generate(prompts[n], n, draft_len=8, eos_ids=())
        assert got.tokens == reference[n][:n] and got.finish_reason == "length"
    short = SpecModel(model.target, model.drafter, context_length=len(prompts[0]) + 7)
    got = short.generate(prompts[0], NEW, draft_len=5, eos_ids=())
    assert got.tokens == reference[0][:7] and got.finish_reason == "context"


def test_stop_sequence(target, prompts, reference):
    model = SpecModel(target, load_drafter("ngram", None, None, target))
    want = reference[3]
    stop = want[9:11]
    got = model.generate(prompts[3], NEW, draft_len=4, eos_ids=(), stop=[stop])
    end = next(i for i in range(len(want)) if want[i - 1 : i + 1] == stop) + 1
    assert got.tokens == want[:end] and got.finish_reason == "stop"


def test_stats_add_up(target, prompts):
    model = SpecModel(target, load_drafter("eagle3", None, ef.trained_head("llama"), target))
    s = model.generate(prompts[0], NEW, draft_len=4, eos_ids=()).stats
    assert s.new_tokens == NEW == 1 + s.steps + s.accepted
    assert s.acceptance_length == pytest.approx(1 + s.accepted / s.steps)
    assert s.position_tried[0] == s.steps and s.position_accepted[0] <= s.steps
    assert all(0 <= r <= 1 for r in s.position_acceptance) and len(s.position_acceptance) == 4
    assert s.draft_s > 0 and s.verify_s > 0 and s.tokens_per_s > 0
    assert set(s.to_dict()) >= {"acceptance_length", "position_acceptance", "tokens_per_s", "draft_s", "verify_s"}
    plain = model.generate(prompts[0], NEW, speculative=False, eos_ids=()).stats
    assert plain.steps == NEW - 1 and plain.acceptance_length == 1.0


def test_ngram_lookup():
    t = torch.tensor
    assert lookup(t([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]), 1, 3, 2).tolist() == [4, 5]  # most recent occurrence
    assert lookup(t([7, 8, 5, 1, 2, 9, 2]), 1, 3, 3).tolist() == [9, 2, 9]  # 1-gram; copy runs on
    assert lookup(t([4, 4, 4, 4]), 2, 3, 5).tolist() == [4, 4, 4, 4, 4]
    assert lookup(t([1, 2, 3, 4]), 1, 3, 3).tolist() == []
    assert lookup(t([5]), 1, 3, 3).tolist() == []
    assert lookup(t([1, 2, 3, 1, 2, 3, 1, 2]), 3, 3, 4).tolist() == [3, 1, 2, 3]


def earliest_reference(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's ngram proposer's rule, by brute force: the longest suffix of length max_n..min_n that
    occurred earlier, its first occurrence, the k tokens after it cut at the context's end."""
    size = len(seq)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for start in range(size - n):
            if seq[start: start + n] == seq[size - n:]:
                return seq[start + n: start + n + k]
    return []


def test_ngram_lookup_of_the_earliest_occurrence():
    t = torch.tensor
    assert lookup(t([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]), 1, 3, 2, "earliest").tolist() == [9, 1]
    assert lookup(t([7, 8, 5, 1, 2, 9, 2]), 1, 3, 3, "earliest").tolist() == [9, 2]  # stops at the end
    assert lookup(t([4, 4, 4, 4]), 2, 3, 5, "earliest").tolist() == [4]
    assert lookup(t([1, 2, 3, 4]), 1, 3, 3, "earliest").tolist() == []
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        seq = torch.randint(0, 4, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
        for min_n, max_n, k in ((1, 3, 4), (2, 4, 8), (3, 3, 2)):
            want = earliest_reference(seq.tolist(), min_n, max_n, k)
            assert lookup(seq, min_n, max_n, k, "earliest").tolist() == want, (trial, seq.tolist())


@pytest.mark.parametrize("match", ["latest", "earliest"])
@pytest.mark.parametrize("min_n, max_n, vocab", [(1, 3, 3), (2, 4, 5), (1, 1, 2), (3, 3, 4), (1, 3, 50)])
def test_the_suffix_index_drafts_what_the_scan_drafts(min_n, max_n, vocab, match):
    """The drafter's per-slot index (dictionaries updated with each step's tokens) against the
    stateless scan, on contexts that grow a few tokens a step, and on a context it did not index
    (a slot reused without start, a shorter or different context): indexed afresh."""
    from specpack.runtime.drafters.ngram import SuffixIndex

    g = torch.Generator().manual_seed(min_n * 100 + vocab)
    for trial in range(20):
        seq = torch.randint(0, vocab, (120,), generator=g)
        index, size = SuffixIndex(min_n, max_n, match), 1
        while size < len(seq):
            for k in (1, 4):
                want = lookup(seq[:size], min_n, max_n, k, match)
                assert torch.equal(index.lookup(seq[:size], k), want), (trial, size)
            size += int(torch.randint(1, 4, (1,), generator=g))
        other = torch.randint(0, vocab, (40,), generator=g)
        assert torch.equal(index.lookup(other, 3), lookup(other, min_n, max_n, 3, match))
        longer = torch.cat([other[:-1], (other[-2:-1] + 1) % vocab, other[:7]])  # last indexed token differs
        assert torch.equal(index.lookup(longer, 3), lookup(longer, min_n, max_n, 3, match))


def test_half_precision_runs(prompts):
    """bf16 weights, caches and features run end to end (exactness is per precision: not compared)."""
    target = load_target(target_dir("llama"), dtype=torch.bfloat16)
    assert target.lm_head.weight.dtype == torch.bfloat16
    model = SpecModel(target, load_drafter("eagle3", None, ef.trained_head("llama"), target))
    assert model.drafter.fc.weight.dtype == torch.bfloat16
    for temperature in (0.0, 1.0):
        got = model.generate(prompts[0], 12, draft_len=4, temperature=temperature, seed=0, eos_ids=())
        assert len(got.tokens) == 12
