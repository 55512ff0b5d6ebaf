"""Acceptance is measured right and defaults draft where drafts pay (issue 43), for heads trained in
the session and published in their trainers' layouts (trained_heads.py): EAGLE-3 as SpecForge, the
official release and ModelOpt ship it, DFlash as z-lab's, DSpark as DeepSpec's, LiLiCorr as
ModelOpt's `LiLiCorrDraftModel`.

Through `specpack run`, `specpack serve` and the batched engine:
- `--draft-len D` drafts D every step, and the drafter's acceptance length is its reference
  forward's at D (within 3%; the same counts, bar float near-ties);
- with default settings on a target where drafts pay (a cost curve as a memory-bound target's:
  more rows cost nothing), every step but a request's last drafts the full D, and the acceptance
  length again is the reference's;
- with default settings and the cost model measured on this machine (a target this small may not
  pay for drafts), every draft the engine verified is accepted exactly as far as the reference
  accepts it at the engine's own length, and `run --json` says how many steps drafted and why not
  the others; where drafts cannot pay, it says so, and the acceptance length counts no undrafted step.
"""

import json

import pytest
import torch

import trained_heads as th
from eagle_fixtures import one_thread  # noqa: F401
from specpack.runtime.engine.cost import CostModel

KINDS = {"eagle3-sglang": 4, "eagle3-official": 4, "eagle3-modelopt": 4, "dflash": 4, "dspark": 5,
         "lilicorr": 4}  # -> D
ALGORITHMS = ("eagle3-sglang", "dflash", "dspark", "lilicorr")
PROMPTS = range(6)  # of th.PROMPTS
TOLERANCE = 0.03
# the share of steps that draft when drafts are free: all but those after a run of misses. LiLiCorr's tiny
# random drafter has the longest such runs, and their number moves with the CPU's float paths (the same
# greedy tokens and acceptance): 68.4+ of 76 steps drafted on AVX-512 machines, 67-68 on an AVX2-only EPYC
FULL = 0.85


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """kind -> a built artifact of the trained head in its published layout."""
    from specpack.cli import main as _  # noqa: F401  (the CLI package registers every command)
    from specpack.converters.base import AuxOverride
    from specpack.packager import BuildOptions, build

    root, out = tmp_path_factory.mktemp("acceptance"), {}
    for kind in KINDS:
        if kind.startswith("eagle3"):
            head, flags = th.eagle3_layout(kind.split("-")[1], root / f"head-{kind}")
            aux = AuxOverride(tuple(int(i) for i in flags[1].split(",")), "input_of_layer") if flags else None
        else:
            head, aux = th.block_layout(kind, root / f"head-{kind}"), None
        out[kind] = build(BuildOptions(target=th.ef.target_dir("llama"), drafter=str(head), out=root / kind,
                                       aux=aux)).out
    return out


def reference_drafts(kind: str):
    return th.eagle3_drafts() if kind.startswith("eagle3") else th.block_drafts(kind)


@pytest.fixture
def memory_bound(monkeypatch):
    """The cost curve run and serve measure at start, replaced by a memory-bound target's: 50 ms a
    forward whatever its rows, so every draft pays whatever this machine's timings."""
    from specpack.runtime.spec_model import SpecModel

    monkeypatch.setattr(SpecModel, "measure_cost", lambda self, rows=(1, 2, 4, 8): CostModel(
        tuple(rows), (50.0,) * len(rows)))


@pytest.fixture
def compute_bound(monkeypatch):
    """A curve where every row past the first costs a whole forward: no draft can pay."""
    from specpack.runtime.spec_model import SpecModel

    monkeypatch.setattr(SpecModel, "measure_cost", lambda self, rows=(1, 2, 4, 8): CostModel(
        tuple(rows), tuple(50.0 * r for r in rows)))


@pytest.fixture
def steps_log(monkeypatch):
    """Every verification any generation counts, in order: (its stats object, k, accepted, copied)."""
    from specpack.runtime.engine.stats import GenerationStats

    log, count = [], GenerationStats.count

    def logged(self, k, a, proposed=None, copied=False, probe=False):
        log.append((self, k, a, copied))
        return count(self, k, a, proposed, copied, probe)

    monkeypatch.setattr(GenerationStats, "count", logged)
    return log


def _steps(log, prompt_tokens: int) -> list:
    """The logged verifications of the generation with this many prompt tokens (the start-up
    measurements' engines decode too, from a one-token prompt), then the log emptied."""
    out = [(k, a, copied) for stats, k, a, copied in log if stats.prompt_tokens == prompt_tokens]
    log.clear()
    return out


def replay(kind: str, b: int, tokens: list[int], steps: list) -> tuple[int, int, bool]:
    """(tokens the engine accepted of its drafter's drafts, tokens the reference's drafts at the same
    lengths from the same contexts would have kept, whether every draft was as long as the request
    left room for) over one generation of prompt b."""
    draft, prompt = reference_drafts(kind), th.prompt_ids()[b]
    context, n, end = prompt + tokens, len(prompt) + 1, len(prompt) + len(tokens)
    mine = theirs = 0
    full = True
    for k, a, copied in steps:
        if k and not copied:
            drafted = draft(b, context[:n], k)
            theirs += next((i for i in range(k) if drafted[i] != context[n + i]), k)
            mine += a
            full &= k == min(KINDS[kind], end - n - 1)
        n += a + 1
    return mine, theirs, full


def _run(cli, artifact, b: int, *flags) -> dict:
    code, out, err = cli("run", artifact, "--prompt", th.PROMPTS[b], "--max-new-tokens", th.NEW, "--json", *flags)
    assert code == 0, err
    return json.loads(out)


def _acceptance(runs) -> float:
    drafted = sum(r["drafted_steps"] for r in runs)
    return 1 + sum(r["accepted"] - r["lookup_accepted"] for r in runs) / max(drafted, 1)


def _near(got: float, want: float) -> bool:
    return abs(got - want) <= TOLERANCE * want


def _drafted_every_step(runs) -> bool:
    """Every step drafted but, at most, each request's last (one token left: nothing to draft for)."""
    return all(r["steps"] - 1 <= r["drafted_steps"] <= r["steps"] for r in runs)


@pytest.mark.parametrize("kind", KINDS)
def test_run_draft_len_acceptance_is_the_references(artifacts, cli, kind):
    D = KINDS[kind]
    runs = [_run(cli, artifacts[kind], b, "--draft-len", D) for b in PROMPTS]
    assert [r["token_ids"] for r in runs] == [th.greedy(b) for b in PROMPTS]
    assert all(r["speculation"]["mode"] == "fixed" for r in runs) and _drafted_every_step(runs)
    want = th.reference_acceptance(reference_drafts(kind), D, PROMPTS)
    assert want > 1.5, "the trained head should be good enough for the comparison to mean something"
    assert _near(_acceptance(runs), want), (_acceptance(runs), want)


@pytest.mark.parametrize("kind", KINDS)
def test_run_defaults_draft_in_full_where_drafts_pay(artifacts, cli, memory_bound, steps_log, kind):
    """Drafts cost nothing here, so the cost model drafts in full on every step but the few after a
    run of misses long enough that not even a free draft promises anything (the 3% margin); the
    acceptance length over them is the reference's at D, and every draft kept what the
    reference's would have."""
    D, runs, mine, theirs = KINDS[kind], [], 0, 0
    for b in PROMPTS:
        runs.append(_run(cli, artifacts[kind], b))
        got, want, full = replay(kind, b, runs[-1]["token_ids"], _steps(steps_log, runs[-1]["prompt_tokens"]))
        mine, theirs = mine + got, theirs + want
        assert full, runs[-1]["speculation"]
    assert [r["token_ids"] for r in runs] == [th.greedy(b) for b in PROMPTS]
    assert all(r["speculation"]["mode"] == "cost model" and r["draft_len"] == D for r in runs)
    drafted, steps = sum(r["drafted_steps"] for r in runs), sum(r["steps"] for r in runs)
    assert drafted >= FULL * steps, [r["speculation"]["decision"] for r in runs]
    assert mine == pytest.approx(theirs, rel=TOLERANCE)
    want = th.reference_acceptance(reference_drafts(kind), D, PROMPTS)
    assert _near(_acceptance(runs), want) or drafted < steps - len(runs), (_acceptance(runs), want)


@pytest.mark.parametrize("kind", ALGORITHMS)
def test_run_defaults_say_when_drafts_cannot_pay(artifacts, cli, compute_bound, kind):
    runs = [_run(cli, artifacts[kind], b) for b in PROMPTS[:3]]
    assert [r["token_ids"] for r in runs] == [th.greedy(b) for b in PROMPTS[:3]]
    for r in runs:
        spec = r["speculation"]
        assert r["drafted_steps"] == r["probe_steps"] <= 2, spec  # what it drafted, it drafted to learn
        assert f"drafted on {r['drafted_steps']} of {r['steps']} steps" in spec["decision"]
        assert "--draft-len" in spec["decision"] and spec["verify_ms"] >= 50 * KINDS[kind] and spec["draft_ms"] >= 0
        drafted = r["accepted"] - r["lookup_accepted"]
        assert r["acceptance_length"] == (1 + drafted / r["drafted_steps"] if r["drafted_steps"] else 1.0)
    fixed = [_run(cli, artifacts[kind], b, "--draft-len", KINDS[kind]) for b in PROMPTS[:3]]
    assert _drafted_every_step(fixed)  # --draft-len drafts as given whatever the cost model would say


@pytest.mark.parametrize("kind", ALGORITHMS)
def test_run_defaults_accept_what_the_reference_accepts_at_the_engines_lengths(artifacts, cli, steps_log, kind):
    """The cost model measured here decides (a target this small may or may not pay for drafts):
    whatever it drafted, each verification kept as many tokens as the reference's drafts at that
    length would have, and the figures `run --json` reports add up to those steps."""
    mine = theirs = 0
    for b in PROMPTS:
        r = _run(cli, artifacts[kind], b)
        steps = _steps(steps_log, r["prompt_tokens"])
        assert r["token_ids"] == th.greedy(b) and len(steps) == r["steps"]
        assert r["drafted_steps"] == sum(1 for k, _, copied in steps if k and not copied)
        assert f"drafted on {r['drafted_steps']} of {r['steps']} steps" in r["speculation"]["decision"]
        got, want, _ = replay(kind, b, r["token_ids"], steps)
        mine, theirs = mine + got, theirs + want
    assert mine == pytest.approx(theirs, rel=TOLERANCE)


@pytest.mark.parametrize("kind", ALGORITHMS)
def test_serve_acceptance_is_the_references(artifacts, memory_bound, steps_log, kind):
    """One client at a time through the OpenAI API: the server's /metrics acceptance length is the
    drafter's, every draft kept what the reference's would have."""
    openai = pytest.importorskip("openai")
    from specpack.serving.serve import ServerThread, prepare

    plan = prepare(artifacts[kind])
    steps_log.clear()
    tok, mine, theirs, texts = th._tokenizer("llama"), 0, 0, []
    with ServerThread(plan.app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        for b in PROMPTS:
            texts.append(client.completions.create(model=plan.model_name, prompt=th.PROMPTS[b], max_tokens=th.NEW,
                                                   temperature=0).choices[0].text)
            got, want, _ = replay(kind, b, th.greedy(b), _steps(steps_log, len(th.prompt_ids()[b])))
            mine, theirs = mine + got, theirs + want
        metrics = _metrics(srv.url)
    assert texts == [tok.decode(th.greedy(b)) for b in PROMPTS]
    assert mine == pytest.approx(theirs, rel=TOLERANCE) and mine == metrics["specpack_draft_tokens_accepted_total"]
    drafted = metrics["specpack_drafted_steps_total"]
    assert metrics["specpack_acceptance_length"] == pytest.approx(1 + mine / drafted)
    assert drafted >= FULL * metrics["specpack_spec_steps_total"]
    want = th.reference_acceptance(reference_drafts(kind), KINDS[kind], PROMPTS)
    assert _near(metrics["specpack_acceptance_length"], want) or drafted < metrics["specpack_spec_steps_total"] - len(
        PROMPTS), (metrics["specpack_acceptance_length"], want)


def _metrics(url: str) -> dict:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#") and "{" not in line.split()[0]}


@pytest.mark.parametrize("kind", ALGORITHMS)
def test_batched_engine_acceptance_is_the_references(artifacts, steps_log, kind):
    """Six sequences decoding together, priced as a memory-bound target: each drafts in full, and
    each draft keeps what the reference's would have."""
    import specpack
    from specpack.runtime.engine import Engine, Request

    D = KINDS[kind]
    model = specpack.load(artifacts[kind])
    cost = model.price(CostModel((1, 8, 64), (50.0, 50.0, 50.0)), D)
    steps_log.clear()
    engine = Engine(model.target, model.drafter, slots=len(PROMPTS), max_len=128, cost=cost)
    with torch.inference_mode():
        done = engine.generate_all([Request(th.prompt_ids()[b], th.NEW, eos=(), draft_len=D) for b in PROMPTS])
    assert [g.new for g in done] == [th.greedy(b) for b in PROMPTS]
    mine = theirs = 0
    for b, g in zip(PROMPTS, done):
        got, want, full = replay(kind, b, g.new, [(k, a, c) for stats, k, a, c in steps_log if stats is g.stats])
        mine, theirs = mine + got, theirs + want
        assert full
    assert mine == pytest.approx(theirs, rel=TOLERANCE)
    drafted, steps = sum(g.stats.drafted_steps for g in done), sum(g.stats.steps for g in done)
    assert drafted >= FULL * steps
