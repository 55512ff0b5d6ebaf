"""The batched engine: a request's tokens are the same alone or in any batch, with or without
speculation, whatever joins or leaves around it (interleaved arrivals, cancellations, EOS, stop
sequences, slot reuse), for every drafter kind and both CPU backends; seeded sampling too."""

import functools
import time

import numpy as np
import pytest
import torch

import eagle_fixtures as ef
import mtp_layouts as ml
import tiny
from eagle_fixtures import one_thread  # noqa: F401
from specpack.errors import InputError
from specpack.packager import BuildOptions, NgramParams, build
from specpack.runtime.drafters.base import TreeShape
from specpack.runtime.engine import Engine, Request, SamplingParams
from specpack.runtime.engine.cost import Acceptance, CostModel, choose
from specpack.runtime.spec_model import SpecModel

KINDS = ["ngram", "eagle3", "draft_model", "mtp-1", "mtp-2", "block"]


@functools.cache
def artifact(kind: str):
    """A built artifact of `kind` on a tiny target, exported to ONNX (cached per session)."""
    from test_draft_model import make_draft

    from specpack.exports.onnx import export_onnx

    tmp = ef.session_dir(f"engine-{kind}")
    target = ef.target_dir("llama")
    drafter = {"ngram": "ngram", "eagle3": str(_sglang_trained_head(tmp / "head"))}.get(kind)
    if kind == "draft_model":
        drafter = str(make_draft(tmp / "draft", target, layers=2))
    elif kind.startswith("mtp"):
        n = int(kind[-1])
        target, drafter = ml.make_target(tmp / "mtp", "mtp-mimo" if n == 2 else "mtp-deepseek", n).path, "mtp"
    elif kind == "block":
        drafter = str(_dspark_head(tmp / "dspark", target))
    out = build(BuildOptions(target=target, drafter=drafter, out=tmp / "art", ngram=NgramParams(1, 3, 4),
                             mtp_allow_reuse=kind == "mtp-1")).out
    export_onnx(out, progress=False)
    return out


def _dspark_head(out, target):
    """A DSpark head in DeepSpec's layout (a published one) whose Markov correction follows the
    target's greedy continuations of the test prompts: blocks get accepted."""
    import block_layouts as bl

    hf = tiny.build_model("llama")
    seqs = [ef.greedy_sequences(hf, torch.tensor([p]), 12)[0].tolist() for p in _prompts(tiny.VOCAB)]
    bigrams = {(a, b) for s in seqs for a, b in zip(s, s[1:])}
    return bl.bigram_dspark(out, target, bigrams, ids_out=(0, 2, 4))


def _sglang_trained_head(out):
    """The tests' trained EAGLE-3 head (drafts get accepted) in the SGLang layout `build` reads."""
    from safetensors.torch import load_file

    import eagle_layouts

    tensors = load_file(ef.trained_head("llama") / "model.safetensors")
    return eagle_layouts.write_sglang(out, tensors, tiny.tiny_config("llama"), aux_ids=[i - 1 for i in ef.AUX])


@functools.cache
def model(kind: str, backend: str) -> SpecModel:
    import specpack

    return specpack.load(artifact(kind), backend=backend)


def prompts(m: SpecModel, n: int = 6) -> list[list[int]]:
    return _prompts(m.target.spec.vocab_size, n)


def _prompts(vocab: int, n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, vocab, (8,), generator=g).tolist()
    # repeats give the n-gram drafter something to copy; lengths differ
    return [(base + torch.randint(3, vocab, (2 + i,), generator=g).tolist()) * (1 + i % 2) for i in range(n)]


def alone(m: SpecModel, req: Request) -> list[int]:
    """`req` decoded alone, without speculation."""
    return m.generate(req.prompt, req.max_new_tokens, temperature=req.params.temperature, top_k=req.params.top_k,
                      top_p=req.params.top_p, seed=req.seed,
                      eos_ids=req.eos, stop=req.stop, speculative=False).tokens


def drive(engine: Engine, arrivals: dict[int, list[Request]], cancel: dict[int, int] | None = None) -> dict:
    """Run the engine step by step: requests join at the step their key names (when a slot is
    free, else they wait); request i is cancelled once it has `cancel[i]` new tokens. Returns
    {request index: tokens} of the requests that finished."""
    index = {id(r): i for i, r in enumerate(r for s in sorted(arrivals) for r in arrivals[s])}
    waiting, seqs, out, step = [], {}, {}, 0
    while any(s >= step for s in arrivals) or waiting or engine.running:
        waiting += arrivals.get(step, [])
        while waiting and engine.has_room:
            r = waiting.pop(0)
            seqs[index[id(r)]] = engine.add(r)
        for i, after in (cancel or {}).items():
            if i in seqs and len(seqs[i].new) >= after and seqs[i] in engine.running:
                engine.cancel(seqs[i])
        for s in engine.step():
            if s.finish != "cancelled":
                out[next(i for i, q in seqs.items() if q is s)] = s.new
        step += 1
    return out


def requests(m: SpecModel, temperature: float = 0.0, spec: bool = True) -> list[Request]:
    ps = prompts(m)
    eos = m.target.spec.eos_token_ids
    spec_ = getattr(m.drafter, "spec", None)
    draft_len = spec_.num_layers if getattr(spec_, "allow_layer_reuse", True) is False else 3  # MTP without reuse
    reqs = [Request(p, 6 + 3 * i, SamplingParams(temperature), seed=100 + i, eos=eos, speculative=spec,
                    draft_len=draft_len) for i, p in enumerate(ps)]
    first = alone(m, reqs[1])  # request 1 stops at a token it emits, request 2 at a 2-token stop sequence
    reqs[1].eos = (first[3],)
    second = alone(m, reqs[2])
    reqs[2].stop = (tuple(second[4:6]),)
    return reqs


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_equals_single_requests(kind, backend):
    m = model(kind, backend)
    reqs = requests(m)
    want = [alone(m, r) for r in reqs]
    assert want[1][-1] in reqs[1].eos and len(want[1]) < reqs[1].max_new_tokens  # EOS and stop really cut
    assert len(want[2]) < reqs[2].max_new_tokens
    for slots in (1, 3):
        engine = Engine(m.target, m.drafter, slots=slots, max_len=64, prefill_chunk=5)
        got = drive(engine, {0: reqs[:2], 1: reqs[2:4], 4: reqs[4:]}, cancel={3: 1})
        assert set(got) == {0, 1, 2, 4, 5}  # 3 was cancelled
        for i, tokens in got.items():
            assert tokens == want[i], (kind, backend, slots, i)
        assert engine.free and len(engine.free) == slots  # every slot came back


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_drafts_are_lossless_alone_and_batched(kind, backend, monkeypatch):
    """Trees (and chains beside them in the same steps) give the tokens of plain decoding; the
    training prompts make the trained head's (and the draft model's) paths run through siblings,
    whose cache rows are then compacted."""
    m = model(kind, backend)
    reqs = requests(m)
    vocab = m.target.spec.vocab_size
    reqs += [Request([t % vocab for t in p], 10, eos=(), draft_len=reqs[0].draft_len)
             for p in ef.training_prompts()[:2].tolist()]
    for i, r in enumerate(reqs):
        r.tree = TreeShape(3, 8) if i % 3 else None
    want = [alone(m, r) for r in reqs]
    moved = []
    monkeypatch.setattr(m.target, "compact", lambda slot, src, dst, f=m.target.compact: moved.append(src) or
                        f(slot, src, dst), raising=False)
    for slots in (1, 3):
        engine = Engine(m.target, m.drafter, slots=slots, max_len=64, prefill_chunk=5)
        got = drive(engine, {0: reqs[:3], 1: reqs[3:5], 3: reqs[5:]}, cancel={3: 1})
        assert set(got) == set(range(len(reqs))) - {3}
        for i, tokens in got.items():
            assert tokens == want[i], (kind, backend, slots, i)
    assert moved or kind not in ("eagle3", "draft_model")


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek"])
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_sequence_gets_the_same_logits_bits_in_any_batch(backend, family):
    """Bit for bit, not just the argmax: each sequence's verification rows alone, then with others
    of other lengths and row counts (chains and a tree) in one forward. On ONNX Runtime that is one
    graph call over every sequence (the target graph's attention pads them to a common shape).
    DeepSeek-V3: MLA's latent cache and absorbed products, the router, experts that see one token
    alone and several in the batch."""
    from specpack.runtime.models.rows import Rows, Segment

    m = {"llama": lambda: model("ngram", backend), "deepseek": lambda: model("mtp-1", backend)}.get(
        family, lambda: _family_model(family, backend))()
    t, V = m.target, m.target.spec.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in (5, 300, 140, 20, 9)]  # beyond a 128-key block
    rows = (1, 4, 2, 3, 4)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    blocks = (None, None, None, None, tree)

    def verify(which):
        t.setup_cache(320, len(prompts))
        for s, p in enumerate(prompts):
            t.forward_rows(p, Rows.of([Segment(s, 0, len(p))]), logits_rows=[len(p) - 1])
        calls.clear()
        segs = [Segment(s, len(prompts[s]), rows[s], blocks[s]) for s in which]
        return t.forward_rows(torch.cat([prompts[s][: rows[s]] for s in which]), Rows.of(segs)).logits

    calls = []
    if backend == "onnxruntime":
        run = t._run
        t._run = lambda T, inputs, outputs: calls.append(T) or run(T, inputs, outputs)
    alone = [verify([s]) for s in range(len(prompts))]
    together = verify([3, 0, 4, 1, 2]).split([rows[s] for s in (3, 0, 4, 1, 2)])
    for s, got in zip((3, 0, 4, 1, 2), together):
        assert torch.equal(got, alone[s]), (backend, family, s, (got - alone[s]).abs().max())
    assert calls == ([] if backend == "torch" else [sum(rows)])  # one call for every sequence


@functools.cache
def _family_model(family: str, backend: str) -> SpecModel:
    """An n-gram artifact on a tiny `family` target, exported to ONNX."""
    import specpack
    from specpack.exports.onnx import export_onnx

    tmp = ef.session_dir(f"engine-{family}")
    out = build(BuildOptions(target=ef.target_dir(family), drafter="ngram", out=tmp / "art", ngram=NgramParams(1, 3, 4))).out
    export_onnx(out, progress=False)
    return specpack.load(out, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("kind", KINDS)
def test_lookup_drafts_are_lossless_and_the_drafter_catches_up_after_them(kind, backend, monkeypatch):
    """Request.lookup: steps whose context repeats verify a copy of what followed (no drafter call),
    the others the drafter's draft (chains and trees), which then first reads the features of every
    position committed meanwhile. Greedy and seeded sampling give plain decoding's tokens, alone and
    batched; a drafter whose drafts are lookups already (n-gram) is left as it is. Suffixes from one
    token: the tiny MTP target never repeats three."""
    from specpack.runtime.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "LOOKUP_N", (1, 4))
    m = model(kind, backend)
    copied = drafted = 0
    for temperature in (0.0, 0.9):
        reqs = requests(m, temperature)
        for i, r in enumerate(reqs):
            r.lookup, r.max_new_tokens = 6, r.max_new_tokens + 6
            r.tree = TreeShape(3, 8) if i % 3 == 2 else None
            r.params = SamplingParams(temperature, top_k=2)  # sampled, yet repeating: lookups hit
        want = [alone(m, r) for r in reqs]
        for slots in (1, 3):
            seqs = Engine(m.target, m.drafter, slots=slots, max_len=64, prefill_chunk=5).generate_all(reqs)
            assert [s.new for s in seqs] == want, (kind, backend, temperature, slots)
            assert all(s.stats.lookup_accepted <= s.stats.accepted for s in seqs)
            copied += sum(s.stats.lookup_steps for s in seqs)
            drafted += sum(s.stats.steps - s.stats.lookup_steps for s in seqs)
    assert (copied == 0) if kind == "ngram" else (copied and drafted), (copied, drafted)


@pytest.mark.parametrize("kind", ["eagle3", "draft_model", "mtp-2", "block"])
def test_after_lookup_steps_the_drafter_drafts_as_if_it_had_drafted_every_step(kind, monkeypatch):
    """The features of positions committed while lookups drafted reach the drafter at its next call:
    every draft it makes equals the first draft of a fresh sequence whose prompt is the context so
    far (a drafter that saw each position as it came)."""
    from specpack.runtime.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "LOOKUP_N", (1, 4))
    m = model(kind, "torch")
    calls = []
    draft = m.drafter.draft
    monkeypatch.setattr(m.drafter, "draft", lambda jobs: calls.append((jobs[0].context.tolist(), out := draft(jobs)))
                        or out, raising=False)
    reqs = [r for r in requests(m)[3:]]
    for r in reqs:
        r.lookup, r.max_new_tokens, r.eos, r.stop = 6, 24, (), ()
    seqs = Engine(m.target, m.drafter, slots=1, max_len=64).generate_all(reqs)
    assert sum(s.stats.lookup_steps for s in seqs) and len(calls) > len(reqs)
    made = list(calls)
    for context, got in made[:: max(1, len(made) // 8)]:
        calls.clear()
        Engine(m.target, m.drafter, slots=1, max_len=64).generate_all(
            [Request(context[:-1], reqs[0].draft_len + 2, draft_len=reqs[0].draft_len, eos=())])
        assert calls[0][0] == context
        want = got[0].tokens.tolist()  # drafted near the end of its budget: maybe shorter
        assert calls[0][1][0].tokens.tolist()[: len(want)] == want, (kind, len(context))


def test_with_a_cost_model_copies_are_cut_to_the_rows_worth_verifying(monkeypatch):
    """Where a row costs little (a flat curve) a lookup's copy is verified whole; where every row
    doubles the step, none of it is; the tokens stay plain decoding's either way."""
    from specpack.runtime.engine import engine as engine_module
    from specpack.runtime.engine.plan import Plan

    monkeypatch.setattr(engine_module, "LOOKUP_N", (1, 4))
    m = model("eagle3", "torch")
    verified = []
    monkeypatch.setattr(Plan, "verify", lambda self, s, d, f=Plan.verify: verified.append(d) or f(self, s, d))
    flat = CostModel((1, 8, 32, 64), (10.0, 10.2, 10.8, 40.0))
    steep = CostModel((1, 2, 4, 8, 16), (10.0, 20.0, 40.0, 80.0, 160.0))
    copied = {}
    for name, curve in (("flat", flat), ("steep", steep)):
        verified.clear()
        reqs = requests(m)[3:]
        for r in reqs:
            r.lookup, r.max_new_tokens, r.eos, r.stop = 6, 24, (), ()
        want = [alone(m, r) for r in reqs]
        engine = Engine(m.target, m.drafter, slots=3, max_len=64, cost=curve)
        assert [s.new for s in engine.generate_all(reqs)] == want, name
        copied[name] = [len(d) for d in verified if d.copied]
    assert copied["flat"] and max(copied["flat"]) >= 6
    assert not copied["steep"]


def test_the_acceptance_length_is_the_drafters_own():
    """A lookup's copy and a step without a draft count in the step figures (steps, tokens per step,
    accepted depth, the lookup counters), never in the drafter's acceptance length or per-position
    acceptance: that is what a profile hands the engine as the drafter's prior, and what a user reads
    to tell a well bound head from a broken one (issue 43: undrafted last steps made a DSpark head
    read 2.52 against its reference's 2.65)."""
    from specpack.runtime.engine.stats import GenerationStats

    s = GenerationStats()
    s.count(3, 2)
    s.count(8, 5, copied=True)
    s.count(0, 0)  # a request's last token: nothing left to draft for
    s.count(4, 1, probe=True)
    assert s.steps == 4 and s.drafted_steps == 2 and s.undrafted_steps == 1 and s.probe_steps == 1
    assert s.accepted == 8 and s.acceptance_length == 1 + 3 / 2 and s.tokens_per_step == 1 + 8 / 4
    assert s.depth_steps == [1, 1, 1, 0, 0, 1] and s.draft_len_steps == [1, 0, 0, 1, 1] and s.mean_draft_len == 3.5
    assert (s.lookup_steps, s.lookup_accepted) == (1, 5)
    assert s.position_tried == [2, 2, 1, 0] and s.position_acceptance == [1.0, 0.5, 0.0, 0.0]
    total = GenerationStats()
    total.add(s)
    total.add(s)
    assert total.to_dict() == {**s.to_dict(), **{k: 2 * v for k, v in s.to_dict().items()
                                                 if k in ("steps", "drafted_steps", "accepted", "lookup_steps",
                                                          "lookup_accepted", "probe_steps", "proposed",
                                                          "undrafted_steps")},
                               "depth_steps": [2, 2, 2, 0, 0, 2], "draft_len_steps": [2, 0, 0, 2, 2],
                               "position_tried": [4, 4, 2, 0], "position_accepted": [4, 2, 0, 0]}


def test_a_lookup_length_out_of_range_is_refused():
    m = model("eagle3", "torch")
    engine = Engine(m.target, m.drafter, slots=1, max_len=64)
    for bad in (-1, 17, 2.5):
        with pytest.raises(InputError, match="lookup draft length"):
            engine.add(Request([5, 6, 7], 4, lookup=bad))


@pytest.mark.parametrize("kind", ["ngram", "eagle3", "mtp-2"])
def test_seeded_sampling_is_the_same_in_any_batch(kind):
    m = model(kind, "torch")
    reqs = requests(m, temperature=0.9)
    want = [alone(m, r) for r in reqs]
    for slots, spec in ((4, True), (2, False), (6, True)):
        for r in reqs:
            r.speculative = spec
        got = drive(Engine(m.target, m.drafter, slots=slots, max_len=64), {0: reqs[:3], 2: reqs[3:]})
        assert [got[i] for i in range(len(reqs))] == want, (slots, spec)


def test_cost_model_drafts_while_cheap_and_stops_at_the_knee():
    flat = CostModel((1, 8, 32, 64), (10.0, 10.5, 11.5, 40.0))
    sure = [[0.9, 0.81, 0.73, 0.66]] * 4
    assert choose([4] * 4, sure, 4, flat) == [4, 4, 4, 4]  # 20 rows: still nearly flat
    one_cpu = CostModel((1, 2, 4, 8), (10.0, 11.0, 12.0, 14.0))  # one sequence: a drafted row costs 10%
    assert choose([4], [[0.05, 0.0025, 0, 0]], 1, one_cpu) == [0]  # drafts that mostly fail: none
    assert choose([4], [[0.8, 0.64, 0.5, 0.4]], 1, one_cpu) == [4]
    saturated = CostModel((1, 64), (10.0, 640.0))  # every row costs as much as the first
    assert choose([4] * 64, sure * 16, 64, saturated) == [0] * 64  # 64 sequences fill the compute: none
    assert choose([4, 4], [[0.9, 0.8, 0.7, 0.6], [0.2, 0.04, 0, 0]], 2, CostModel((1, 4, 8), (10, 12, 20))) \
        == [3, 0]  # the likelier sequence gets the rows
    with_draft_cost = CostModel((1, 64), (10.0, 10.0), draft_ratio=0.6)
    assert choose([4], [[0.5, 0.25, 0.1, 0.05]], 1, with_draft_cost) == [0]  # a head step costs more than it gains


def test_a_block_drafter_pays_one_head_step_for_its_whole_draft():
    """Priced a head step per position, a block drafter (one forward drafts every slot) looked five
    times dearer at depth 5 than it is, and the cost model kept its drafts short; priced as one
    step, it drafts the block. Drafts already made (a confidence head cuts them) cost only rows,
    weighed against the step's rate with their drafting in it."""
    from dataclasses import replace

    per_position = CostModel((1, 8), (10.0, 10.8), draft_ratio=0.3)
    parallel = replace(per_position, parallel_drafts=True)
    likely = [[0.7, 0.49, 0.34, 0.24, 0.17]]
    assert parallel.time(6, depth=5, jobs=1) == parallel.time(6, depth=1, jobs=1) < per_position.time(6, 5, 1)
    assert type(parallel.passes(5)) is int and parallel.passes(np.array([0, 1, 5])).tolist() == [0, 1, 1]
    assert choose([5], likely, 1, per_position) == [2] and choose([5], likely, 1, parallel) == [5]
    dear = CostModel((1, 8), (10.0, 10.8), draft_ratio=5.0)
    assert choose([4], likely, 1, dear) == [0] and choose([4], likely, 1, dear, drafted=True) == [4]
    # where a row costs 40% of a step, the rows alone pay for two positions; a draft that took 10 ms
    # or 40 ms is part of the step whatever is kept, so positions are weighed against that whole rate
    steep = CostModel((1, 2, 4, 8), (10.0, 14.0, 22.0, 38.0))
    assert [choose([5], likely, 1, steep, drafted=True, drafted_ms=ms) for ms in (0, 10, 40)] == [[2], [3], [5]]


def test_riding_rows_are_the_rows_a_step_takes_at_about_one_rows_cost():
    """The rows a verify takes within 10% of one row's step (tune's tree search starts there): the
    weight stream's share of the curve, up to its last point."""
    stream = CostModel((1, 2, 4, 8, 16), (12.0, 12.3, 12.6, 13.0, 20.0))
    assert stream.riding_rows() == 8  # 13.2 ms at most: 8 rows take 13.0, 9 take 13.9
    assert CostModel((1, 8, 16), (10.0, 10.5, 11.0)).riding_rows() == 16  # flat to the last point measured
    assert CostModel((1, 2), (10.0, 20.0)).riding_rows() == 1 and CostModel((1,), (5.0,)).riding_rows() == 1
    assert stream.riding_rows(slack=0.0) == 1


def test_the_measured_cost_curve_keeps_each_forwards_fastest_pass_and_never_falls(monkeypatch):
    """A busy moment lands on one pass of one point (here the one-row forward's first timed pass,
    35% slow, and a burst on the 8-row one): each point keeps its fastest pass, and a curve that
    measured 4 rows cheaper than 2 is lifted, never lowered below what fewer rows cost."""
    from types import SimpleNamespace

    from specpack.runtime.engine import cost

    true_ms = {1: 10.0, 2: 10.4, 4: 10.2, 8: 11.0, 16: 13.0}
    calls: dict = {}

    def fake(target, slot, start, rows):
        n = calls[(start, rows)] = calls.get((start, rows), 0) + 1
        ms = true_ms[rows] + (4.0 if start else 0.0)  # the key probe: 4 ms over 8 rows x 512 keys
        if (start, rows) == (0, 1) and n == 2 or (start, rows) == (0, 8) and n == 4:
            ms *= 1.35 if rows == 1 else 2.0
        return ms

    monkeypatch.setattr(cost, "_time_forward", fake)
    target = SimpleNamespace(cache=SimpleNamespace(max_len=1024))
    curve = cost.measure(target, (1, 2, 4, 8, 16), passes=3)
    assert curve.rows == (1, 2, 4, 8, 16) and curve.ms == (10.0, 10.4, 10.4, 11.0, 13.0)
    assert curve.key_ms == pytest.approx(4.0 / (8 * 512))
    assert all(n == 4 for n in calls.values())  # a warm-up pass, then three


def test_one_slow_draft_call_does_not_stop_speculation_for_good(monkeypatch):
    """A server's first draft call is cold (a busy neighbour makes any call slow): learned at face
    value it made drafts look dearer than they gain, and with no drafts the ratio was never measured
    again. One call now moves the estimate at most 4x its share, and while nobody drafts it drifts
    back to where it started, so the engine probes again."""
    m = model("eagle3", "torch")
    cost = CostModel((1, 4, 8, 64), (10.0, 10.5, 11.0, 40.0), draft_ratio=0.05)
    req = Request(ef.training_prompts()[0].tolist() * 2, 12, eos=(), draft_len=3)
    engine = Engine(m.target, m.drafter, slots=1, max_len=128, cost=cost)
    draft, ratios, calls = m.drafter.draft, [], []  # the learned ratio (and cost model) before each call

    def slow_first(jobs):
        ratios.append(engine.cost.draft_ratio)
        calls.append(engine.cost)
        time.sleep(0.3 if len(ratios) == 1 else 0.0)  # ~10x a target step of this cost model, per level
        return draft(jobs)

    monkeypatch.setattr(m.drafter, "draft", slow_first)
    first = engine.generate_all([req])[0]
    assert len(ratios) > 1 and first.stats.proposed > 3, "no draft after the slow call"
    x = cost.passes(3) * cost.step_ms(1)  # the first call's passes, in target time
    learned = calls[1]
    # the slow call counted as 4x its prediction, no more, at the fit's weight (0.2)
    assert learned.draft_call_ms + learned.draft_ratio * x == pytest.approx(0.8 * 0.05 * x + 0.2 * 4 * 0.05 * x)

    engine.cost = engine.cost.with_draft_ratio(5.0)  # as an uncapped slow call left it: no draft pays
    late = engine.generate_all([req] * 10)
    # no draft the cost model asks for (a probe at most), then, drifted back, it asks again
    assert late[0].stats.drafted_steps == late[0].stats.probe_steps
    assert late[-1].stats.drafted_steps > late[-1].stats.probe_steps
    assert all(s.new == first.new for s in late)


def test_after_a_step_nobody_drafts_in_lengths_are_chosen_every_fourth_step(monkeypatch):
    """Saturated (no draft pays), the same sequences are asked only every 4th step; a sequence that
    joins (prompt rows in the step, then a new set of sequences) is asked about at once."""
    m = model("ngram", "torch")
    saturated = CostModel((1, 64), (10.0, 640.0))
    engine = Engine(m.target, m.drafter, slots=3, max_len=64, cost=saturated)
    asked = []
    choose_ = engine._choose
    monkeypatch.setattr(engine, "_choose", lambda seqs, *a: asked.append(len(engine.steps_run)) or choose_(seqs, *a))
    engine.steps_run = []
    reqs = [Request(p, 12, eos=()) for p in prompts(m, 3)]
    for r in reqs[:2]:
        engine.add(r)
    for step in range(12):
        if step == 6:
            engine.add(reqs[2])
        engine.step()
        engine.steps_run.append(step)
    decoding = [n for n in asked if n not in (0, 6)]  # steps with prompt rows are always asked
    assert decoding[:2] == [1, 5] and 7 in asked  # quiet after step 1; the joiner's first decode step asked
    assert len(asked) < 12


def test_a_head_starts_drafting_only_where_drafts_pay_once_every_sequence_decodes(monkeypatch):
    """A head's first draft makes it catch up on the whole prompt. Rows here are dear up to 8 and
    nearly free past it: a sequence that finished its prefill while the others still prefill sees
    drafts priced on the flat part (the prefill rows are paid anyway), but once all four decode no
    draft pays, so it must not start then and waste the catch-up; alone, it drafts."""
    m = model("eagle3", "torch")
    cost = CostModel((1, 4, 8, 64), (10.0, 20.0, 60.0, 62.0))
    batch = [Request(p * 4, 8, eos=(), draft_len=3) for p in ef.training_prompts()[:4].tolist()]
    engine = Engine(m.target, m.drafter, slots=4, max_len=64, prefill_chunk=12, cost=cost)
    during_prefill = []
    draft = m.drafter.draft
    monkeypatch.setattr(m.drafter, "draft", lambda jobs: during_prefill.append(
        any(s.prefilling for s in engine.running)) or draft(jobs))
    seqs = engine.generate_all(batch)
    assert [s.new for s in seqs] == [alone(m, r) for r in batch]
    assert not any(during_prefill)  # (the last sequence left may draft: alone, drafts pay)
    solo = Engine(m.target, m.drafter, slots=4, max_len=64, prefill_chunk=12, cost=cost).generate_all(batch[:1])[0]
    assert solo.stats.proposed > 0 and solo.new == seqs[0].new


def _best_prefix_one_by_one(cands, sequences, base_rows, cost, contexts, base_keys, margin, sunk_rows, sunk_keys,
                            pending=None, widths=None, draft=False):
    """`cost._best_prefix` written as the loop it computes: each prefix priced in turn."""
    tokens, rows, depth, jobs, keys, absorbed = float(sequences), base_rows + sunk_rows, 0, 0, base_keys + sunk_keys, 0
    floor, own = cost.time(rows, keys=keys), cost.time(base_rows, keys=base_keys)
    base = best = tokens / own
    take = 0
    for n, (s, j, i) in enumerate(cands, 1):
        tokens, rows = tokens + s, rows + 1
        keys += contexts[i] + j if contexts else 0
        if draft:
            depth, jobs = max(depth, j), jobs + (j == 1) * (widths[i] if widths else 1)
            absorbed += pending[i] if pending and j == 1 else 0
        rate = tokens / (own + cost.time(rows, depth, jobs, keys, absorbed) - floor)
        if rate > best:
            best, take = rate, n
    return take if best >= base * (1 + margin) else 0


def test_the_cost_model_prices_every_prefix_as_one_by_one():
    from specpack.runtime.engine.cost import _best_prefix

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 17, (1,), generator=g))
        depth = int(torch.randint(1, 6, (1,), generator=g))
        limits = torch.randint(0, depth + 1, (n,), generator=g).tolist()
        survival = [torch.cumprod(torch.rand(depth, generator=g), 0).tolist() for _ in range(n)]
        if trial % 7 == 0:  # ties: the shorter draft first, then the lower sequence
            survival = [[0.5 ** j for j in range(1, depth + 1)] for _ in range(n)]
        cands = sorted(((s, j, i) for i, surv in enumerate(survival) for j, s in enumerate(surv[: limits[i]], 1)),
                       key=lambda c: (-c[0], c[1]))
        ms = torch.cumsum(torch.rand(5, generator=g) * 8, 0) + 10
        cost = CostModel((1, 4, 16, 32, 64), tuple(ms.tolist()), draft_ratio=float(torch.rand(1, generator=g)) / 4,
                         key_ms=float(torch.rand(1, generator=g)) * 1e-3)
        contexts = torch.randint(10, 900, (n,), generator=g).tolist() if trial % 2 else None
        pending = torch.randint(0, 300, (n,), generator=g).tolist() if trial % 3 else None
        widths = torch.randint(1, 4, (n,), generator=g).tolist() if trial % 5 == 0 else None
        sunk = int(torch.randint(0, 64, (1,), generator=g)) if trial % 4 == 0 else 0
        margin = 0.03 * (trial % 2)
        args = (n, n, cost, contexts, sum(contexts or []), margin, sunk, 7 * sunk)
        take = 0
        for draft in (False, True) if cands else ():
            take = _best_prefix_one_by_one(cands, *args, pending, widths, draft=draft)
            arrays = [np.asarray(c) for c in zip(*cands)]
            assert _best_prefix(*arrays, *args, pending, widths, draft=draft) == take, (trial, draft)
        lengths = [0] * n
        for _, j, i in cands[:take]:
            lengths[i] = max(lengths[i], j)
        assert choose(limits, survival, n, cost, contexts, sum(contexts or []), margin, pending, sunk, 7 * sunk,
                      widths) == lengths, trial


def test_acceptance_follows_the_record_and_drifts_back_to_the_prior():
    a = Acceptance([0.5, 0.5])
    for _ in range(10):
        a.update(2, 0)
    assert a.survival(2)[0] < 0.05
    for _ in range(60):
        a.update(0, 0)  # untried: back towards the prior, so the sequence is probed again
    assert a.survival(1)[0] > 0.4


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_engine_with_a_cost_model_stays_lossless(kind):
    m = model(kind, "torch")
    reqs = requests(m)
    for r in reqs[::2]:
        r.tree = TreeShape(3, 8)
    want = [alone(m, r) for r in reqs]
    cost = CostModel((1, 4, 8, 16), (10.0, 10.5, 11.5, 20.0))
    engine = Engine(m.target, m.drafter, slots=4, max_len=64, cost=cost)
    got = drive(engine, {0: reqs[:4], 3: reqs[4:]})
    assert [got[i] for i in range(len(reqs))] == want


def test_the_cost_model_verifies_the_tree_nodes_worth_their_rows():
    """The trained head is sure of its first choices: with rows priced, a tree of 12 is cut to the
    few nodes likely to survive, and the output stays the same."""
    m = model("eagle3", "torch")
    reqs = [Request(p, 24, eos=(), draft_len=4, tree=TreeShape(3, 12)) for p in ef.training_prompts()[:2].tolist()]
    want = [alone(m, r) for r in reqs]
    for cost, fewer in ((None, False), (CostModel((1, 2, 4, 8, 16), (10.0, 12.0, 16.0, 24.0, 40.0)), True)):
        for r, w in zip(reqs, want):
            seq = Engine(m.target, m.drafter, slots=1, max_len=64, cost=cost).generate_all([r])[0]
            assert seq.new == w and seq.stats.accepted > seq.stats.steps
            assert (seq.stats.proposed < 6 * seq.stats.steps) == fewer


def test_a_request_that_can_never_fit_is_refused():
    m = model("ngram", "torch")
    engine = Engine(m.target, m.drafter, slots=2, max_len=16)
    with pytest.raises(Exception, match="context holds 16"):
        engine.add(Request(list(range(3, 20)), 4))
    assert engine.has_room and not engine.running
