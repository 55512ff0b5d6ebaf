"""The greedy screen (kernels/screen.py): a screened row's argmax is the full head's, ties included,
its candidates' logits are the full head's bit for bit, rows it cannot decide are computed in full,
and decoding with it gives the tokens decoding without it gives (plain and speculative, batched,
greedy and sampled sequences side by side)."""

import functools

import pytest
import torch

from specpack.runtime import kernels
from specpack.runtime.engine import Engine
from specpack.runtime.kernels import screen as ks
from specpack.runtime.kernels.tuning import pack
from test_engine import alone, artifact, drive, requests

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernel: {kernels.unavailable_reason()}")
FORMATS = ["fp32", "fp16", "bf16", "int8"]


def head(fmt: str, V: int = 1003, K: int = 200, seed: int = 0):
    """A packed head with duplicated rows (exact ties: the first must win) and a zero row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, K, generator=g) * 0.05
    w[500], w[900] = w[7], w[7]
    w[11] = 0
    return pack(w, weights=fmt)


def inputs(n: int, K: int = 200, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, K, generator=torch.Generator().manual_seed(seed)) * 3


def check(full: torch.Tensor, screened: torch.Tensor) -> int:
    """Each screened row's argmax is the full row's and its finite entries are the full row's bits;
    returns the most candidates a row kept."""
    most = 0
    for f, s in zip(full, screened):
        kept = torch.isfinite(s)
        assert torch.equal(s[kept], f[kept])
        assert int(s.argmax()) == int(f.argmax())
        most = max(most, int(kept.sum()))
    return most


@pytest.mark.parametrize("fmt", FORMATS)
def test_screened_rows_give_the_full_argmax_and_bits(fmt):
    packed = head(fmt)
    sc = ks.GreedyScreen.of(packed)
    x = inputs(40)
    x[3] = packed.dense()[7] * 50  # its own row wins: a three-way exact tie among 7, 500, 900
    full = packed(x)
    assert int(full[3].argmax()) == 7
    for rows in (slice(0, 1), slice(0, 9), slice(0, 32)):
        most = check(full[rows], sc.logits(x[rows].contiguous(), range(len(x[rows]))))
        assert most < 100  # the screen kept few: it did screen
    for isa in (0, 1, 2, 3):  # the tile sets give the same bits, so the recomputed columns match each
        packed.isa = isa
        check(packed(x[:9]), sc.logits(x[:9], range(9)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_rows_keep_every_logit(fmt):
    packed = head(fmt)
    sc = ks.GreedyScreen.of(packed)
    x = inputs(7)
    full, got = packed(x), sc.logits(x, [1, 4])
    for r in (0, 2, 3, 5, 6):
        assert torch.equal(got[r], full[r])
    check(full[[1, 4]], got[[1, 4]])
    assert torch.equal(sc.logits(x, []), full)
    many = inputs(ks.MAX_ROWS_WITHOUT_VNNI + 1)
    check(packed(many), sc.logits(many, range(len(many))))
    sc.max_rows = ks.MAX_ROWS_WITHOUT_VNNI  # as on a CPU without VNNI: wide products get the full head
    assert torch.equal(sc.logits(many, range(len(many))), packed(many))
    with pytest.raises(IndexError, match="outside the 7 rows"):
        sc.logits(x, [2, 7])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_near_ties_at_every_scale(fmt, scale):
    """Rows aimed between pairs of columns a hair apart (so the cheap pass's order and the full
    head's often differ), at small and large magnitudes, K a multiple of no block size."""
    g = torch.Generator().manual_seed(int(scale * 1000) % 997)
    V, K = 509, 77
    w = torch.randn(V, K, generator=g) * 0.05
    for a in range(0, 40, 2):
        hair = torch.randn(K, generator=g) * 1e-4
        w[a + 1] = w[a] + hair - (hair @ w[a]) / (w[a] @ w[a]) * w[a]
    packed = pack(w, weights=fmt)
    sc = ks.GreedyScreen.of(packed)
    pairs = torch.randint(0, 20, (64,), generator=g) * 2
    x = (packed.dense()[pairs] * 40 + torch.randn(64, K, generator=g) * 0.05) * scale
    check(packed(x), sc.logits(x, range(64)))


def test_rows_it_cannot_decide_are_computed_in_full():
    packed = head("fp32")
    sc = ks.GreedyScreen.of(packed)
    x = inputs(3)
    x[1, 5] = float("nan")
    x[2] = 0  # every logit 0: every column a candidate, past CAP
    full, got = packed(x), sc.logits(x, range(3))
    check(full[:1], got[:1])
    assert torch.equal(got[1].isnan(), full[1].isnan())
    assert torch.equal(got[2], full[2])


def test_a_wrong_bound_is_caught():
    """Near-ties (column 21 is column 20 plus a hair orthogonal to it, so which wins depends on
    each row's noise): the true bounds keep both, bounds of zero keep the cheap pass's favourite,
    which on some rows is not the full head's: the check can fail."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 64, generator=g) * 0.05
    hair = torch.randn(64, generator=g) * 1e-4
    w[21] = w[20] + hair - (hair @ w[20]) / (w[20] @ w[20]) * w[20]
    packed = pack(w, weights="fp32")
    sc = ks.GreedyScreen.of(packed)
    x = w[20] * 40 + torch.randn(32, 64, generator=g) * 0.05
    full = packed(x)
    check(full, sc.logits(x, range(32)))
    sc.bounds.zero_()
    got = sc.logits(x, range(32))
    assert any(int(f.argmax()) != int(s.argmax()) for f, s in zip(full, got))


def test_what_gets_a_screen(monkeypatch):
    assert ks.GreedyScreen.of(head("w8a8")) is None  # w8a8 is the cheap pass itself
    assert ks.GreedyScreen.of(pack(torch.randn(40, 16), torch.randn(40))) is None  # a bias
    monkeypatch.setenv("SPECPACK_GREEDY_SCREEN", "0")
    assert ks.GreedyScreen.of(head("fp32")) is None


@functools.cache
def model(kind: str, weights: str):
    import specpack

    return specpack.load(artifact(kind), weights=weights)


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("kind", ["ngram", "eagle3", "mtp-2", "draft_model"])
def test_decoding_with_the_screen_gives_the_tokens_without(kind, weights):
    """Greedy and sampled requests batched, with speculation, against each decoded alone without
    speculation and without the screen."""
    m = model(kind, weights)
    screen = m.target.screen
    assert screen is not None
    reqs = requests(m)[:3] + requests(m, temperature=0.8)[3:]
    try:
        m.target.screen = None
        want = [alone(m, r) for r in reqs]
    finally:
        m.target.screen = screen
    calls = []
    original = screen.logits
    screen.logits = lambda x, rows: calls.append(len(rows)) or original(x, rows)
    try:
        engine = Engine(m.target, m.drafter, slots=3, max_len=64, prefill_chunk=5)
        got = drive(engine, {0: reqs[:2], 1: reqs[2:4], 4: reqs[4:]})
    finally:
        del screen.logits
    assert [got[i] for i in range(len(reqs))] == want
    assert calls  # the greedy rows went through the screen


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_mtp_drafts_through_the_screen_draft_the_same(weights):
    """MTP layers draft through the target's head: greedy chains go through the screen and draft
    what the full head drafts (the same acceptance, step for step); a tree job keeps every logit."""
    from specpack.runtime.drafters.base import TreeShape

    m = model("mtp-2", weights)
    screen = m.target.screen
    prompt = requests(m)[0].prompt
    runs = {}
    for on in (True, False):
        m.target.screen = screen if on else None
        try:
            r = m.generate(prompt, 24, draft_len=2, adaptive=False)
            t = m.generate(prompt, 24, draft_len=2, adaptive=False, tree=TreeShape(2, 4))
        finally:
            m.target.screen = screen
        runs[on] = (r.tokens, r.stats.accepted, r.stats.steps, t.tokens, t.stats.accepted, t.stats.steps)
    assert runs[True] == runs[False]
    drafting, seen = [], []
    draft, original = m.drafter.draft, screen.logits

    def traced(jobs):
        drafting.append(True)
        try:
            return draft(jobs)
        finally:
            drafting.pop()

    m.drafter.draft = traced
    screen.logits = lambda x, rows: seen.append(bool(drafting)) or original(x, rows)
    try:
        m.generate(prompt, 8, draft_len=2, adaptive=False)
        chain = list(seen)
        seen.clear()
        m.generate(prompt, 8, draft_len=2, adaptive=False, tree=TreeShape(2, 4))
    finally:
        del screen.logits, m.drafter.draft
    assert any(chain) and not any(seen)  # the chain's drafting used the screen, the tree's did not


def test_a_draft_model_drafts_its_greedy_chains_through_its_own_screen():
    m = model("draft_model", "fp32")
    screen = m.drafter.model.screen
    assert screen is not None and m.drafter.vocab == m.drafter.model.spec.vocab_size
    seen, original = [], screen.logits
    screen.logits = lambda x, rows: seen.append(list(rows)) or original(x, rows)
    try:
        m.generate(requests(m)[0].prompt, 8, draft_len=3, adaptive=False)
    finally:
        del screen.logits
    assert seen and all(rows == [0] for rows in seen)  # one greedy chain: its row, every step
    from specpack.runtime.drafters.draft_model import DraftModelDrafter

    padded = DraftModelDrafter(m.drafter.model, m.drafter.model.spec.vocab_size - 1)  # rows past the target's
    assert padded.screen_head() is False
