"""llama.cpp (`llama-server`, built by `make llama-server` from the pinned llama-cpp-python sdist) on
specpack's `export --to llama.cpp`, for SmolLM2 with the shipped EAGLE-3 and DSpark heads and n-gram, and
for the trained EAGLE-3, DFlash and DSpark heads of the wide tiny Llama, and for a trained DeepSeek-V3 MTP
layer written into the target GGUF's nextn block:

(a) greedy tokens through llama-server with speculation == llama-server without == specpack's own;
(b) each head's acceptance in llama.cpp (its `timings`: draft_n_accepted / draft_n) within 5% of
    specpack's at the same draft length. llama.cpp cuts a draft whose token probability falls under
    --spec-draft-p-min; the comparison runs at p-min 0, so both draft D tokens at every step.
llama.cpp's n-gram lookup is its own rule, so only its tokens are compared."""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import eagle_fixtures as ef
from engine_report import record
from cases import root, smollm2, wide  # noqa: F401  (fixtures)

pytestmark = pytest.mark.engines
TOLERANCE = 0.05
NEAR_TIE = 1e-3  # logits this close may round either way between two engines' fp32 paths
NEW, D = 48, 4


@pytest.fixture(scope="session")
def llama_server():
    path = os.environ.get("SPECPACK_LLAMA_SERVER")
    assert path and Path(path).is_file(), ("the engine suite needs SPECPACK_LLAMA_SERVER: a llama-server built from "
                                          "the pinned sdist (`make llama-server`; `make test-engines` builds it)")
    return path


@pytest.fixture(scope="session")
def exports(smollm2, tmp_path_factory):
    from specpack.exports import export_engine

    _, arts, prompts = smollm2
    out = tmp_path_factory.mktemp("llamacpp")
    made = {kind: export_engine(arts[kind], "llama.cpp", out / kind, draft_len=5 if kind == "dspark" else D)
            for kind in ("eagle3", "dspark", "ngram")}
    return made, arts, prompts


class Server:
    """llama-server on an export's files (the flags its llama_server.json states, plus `extra`)."""

    def __init__(self, binary: str, export: Path, speculative: bool = True, extra: tuple = ()):
        spec = json.loads((export / "llama_server.json").read_text())
        flags = [a for k, v in spec["flags"].items() for a in (k, str(export / v) if k == "--spec-draft-model" else v)]
        self.port = _port()
        self.args = [binary, "-m", str(export / spec["target"]), "--port", str(self.port), "-t", "2", "-c", "2048",
                     "-np", "1", *(flags if speculative else []), *extra]

    def __enter__(self):
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{self.port}.log", "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            assert self.proc.poll() is None, f"llama-server exited: {Path(self.log.name).read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError("llama-server did not become ready")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()

    def complete(self, prompt: list[int], new: int) -> tuple[list[int], int, int]:
        """(greedy tokens up to the end-of-sequence token, draft tokens proposed, of them accepted). Not
        `ignore_eos`: llama.cpp then bans the token outright, another greedy sequence."""
        body = {"prompt": prompt, "n_predict": new, "temperature": 0, "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        t = out.get("timings", {})
        return out["tokens"], t.get("draft_n", 0), t.get("draft_n_accepted", 0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(binary, export, prompts, speculative=True, extra=(), new: int = NEW):
    with Server(binary, export, speculative, extra) as srv:
        return [srv.complete(p, new) for p in prompts]


def _specpack(artifact, prompts, D: int = D):
    """(speculative tokens, plain tokens, draft tokens proposed, accepted) of specpack at draft length D, the
    last two per prompt, each stopping at the end-of-sequence token as llama-server does."""
    import specpack

    model = specpack.load(artifact)
    with torch.inference_mode():
        spec = [model.generate(p, NEW, draft_len=D, adaptive=False) for p in prompts]
        plain = [model.generate(p, NEW, speculative=False).tokens for p in prompts]
    drafted = [sum(k * n for k, n in enumerate(r.stats.draft_len_steps)) for r in spec]
    return [r.tokens for r in spec], plain, drafted, [r.stats.accepted for r in spec]


def _near_tie(artifact, prompt: list[int], ours: list[int], theirs: list[int]) -> float:
    """Where specpack's and llama.cpp's plain texts part, how far apart the two tokens' logits are in specpack's
    fp32 target (0 for texts that do not part)."""
    import specpack

    j = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if j is None:
        return 0.0
    model = specpack.load(artifact)
    model.target.setup_cache(len(prompt) + j + 1)
    with torch.inference_mode():
        logits = model.target(torch.tensor(prompt + ours[:j])).logits[-1]
    return abs(logits[ours[j]] - logits[theirs[j]]).item()


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_smollm2_shipped_heads(llama_server, exports, kind):
    made, arts, prompts = exports
    out, D = made[kind].out, made[kind].draft_len
    _check_head(llama_server, out, arts[kind], prompts, D, "SmolLM2-135M (llama.cpp f32 GGUF)", kind)


def test_smollm2_ngram_tokens(llama_server, exports):
    made, arts, prompts = exports
    out = made["ngram"].out
    spec = _serve(llama_server, out, prompts)
    _, mine_plain, _, _ = _specpack(arts["ngram"], prompts)
    record(target="SmolLM2-135M (llama.cpp f32 GGUF)", drafter="ngram (llama.cpp's own ngram-simple)", D=D, loads=True,
           equal="yes" if [s[0] for s in spec] == mine_plain else "NO",
           note=f"llama.cpp drafted {sum(s[1] for s in spec)}, accepted {sum(s[2] for s in spec)}")
    assert [s[0] for s in spec] == mine_plain


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_tiny_trained_heads(llama_server, wide, tmp_path, kind):
    """The trained heads on the wide tiny Llama (trained_heads.py), whose byte-level BPE llama.cpp's
    converter does not name: its GPT-2 split is stated with --gguf-pre gpt-2."""
    from specpack.exports import export_engine
    from specpack.schemas.manifest import default_draft_len
    from specpack.packager import read_manifest

    arts, prompts = wide
    D = default_draft_len(read_manifest(arts[kind]))
    out = export_engine(arts[kind], "llama.cpp", tmp_path / kind, draft_len=D, gguf_pre="gpt-2").out
    _check_head(llama_server, out, arts[kind], prompts, D, "tiny Llama (wide, llama.cpp f32 GGUF)", kind)


def _check_head(binary, out, artifact, prompts, D: int, target: str, kind: str) -> None:
    """llama-server on the export (at p-min 0, then plain) against specpack on the artifact at draft length
    D: the row recorded, each engine's speculative tokens its plain ones, the two engines' tokens equal but where
    a near tie of the target's logits parts them (a CPU's float paths round it either way: on an AVX2-only EPYC
    one prompt of 12 of the tiny wide Llama parts at token 31), acceptance rates within TOLERANCE over the
    prompts whose texts agree."""
    spec = _serve(binary, out, prompts, extra=("--spec-draft-p-min", "0"))
    plain = _serve(binary, out, prompts, speculative=False)
    mine, mine_plain, drafted, accepted = _specpack(artifact, prompts, D)
    assert mine == mine_plain  # specpack's own guarantee
    assert [s[0] for s in spec] == [p[0] for p in plain]  # llama.cpp's
    same = [i for i in range(len(prompts)) if plain[i][0] == mine_plain[i]]
    ties = {i: _near_tie(artifact, prompts[i], mine_plain[i], plain[i][0]) for i in range(len(prompts)) if i not in same}
    rate_llama = sum(spec[i][2] for i in same) / max(1, sum(spec[i][1] for i in same))
    rate_mine = sum(accepted[i] for i in same) / max(1, sum(drafted[i] for i in same))
    record(target=target, drafter=f"{kind} (llama-server)", D=D, loads=True,
           equal="yes" if len(same) == len(prompts) else f"{len(same)} of {len(prompts)} prompts (near ties)",
           al_vllm=1 + rate_llama * D, al_specpack=1 + rate_mine * D,
           note=f"acceptance rate llama.cpp {rate_llama:.3f}, specpack {rate_mine:.3f}")
    assert all(gap <= NEAR_TIE for gap in ties.values()), ties
    assert len(ties) <= len(prompts) // 4, ties
    assert abs(rate_llama / rate_mine - 1) <= TOLERANCE, (rate_llama, rate_mine)


def test_tiny_deepseek_v3_mtp(llama_server, root, tmp_path):
    """DeepSeek-V3's MTP layer (MLA, grouped sigmoid MoE routing, YaRN rope), trained on the target's own continuations,
    exported into the target GGUF's nextn block (arch deepseek2): llama-server drafts from the target file
    (--spec-type draft-mtp) at D = 1, the one draft length whose bindings llama.cpp shares with the artifact.
    llama.cpp's CPU MLA rounds its logits about 1e-3 off specpack's (and transformers') fp32 ones, so near
    ties part the texts of this tiny model: tokens and acceptance are compared where llama.cpp's speculative,
    llama.cpp's plain and specpack's plain texts agree, and how many agree is recorded."""
    import mtp_layouts as ml

    import specpack
    from specpack.exports import export_engine
    from specpack.packager import BuildOptions, build

    t = ml.make_target(root / "ds-llamacpp", "mtp-deepseek", 1, train_steps=150)  # YaRN, as DeepSeek-V3
    art = build(BuildOptions(target=t.path, drafter="mtp", out=root / "deepseek-mtp-llamacpp")).out
    seqs = ef.greedy_sequences(ml.hf_target(t), ef.training_prompts(48), 8)
    prompts = [seqs[i].tolist() for i in range(len(seqs))]
    out = export_engine(art, "llama.cpp", tmp_path / "mtp", draft_len=1, gguf_pre="gpt-2").out
    spec = _serve(llama_server, out, prompts, extra=("--spec-draft-p-min", "0"))
    plain = _serve(llama_server, out, prompts, speculative=False)
    model = specpack.load(art)
    with torch.inference_mode():
        mine = [model.generate(p, NEW, draft_len=1, adaptive=False) for p in prompts]
        mine_plain = [model.generate(p, NEW, speculative=False).tokens for p in prompts]
    assert [r.tokens for r in mine] == mine_plain  # specpack's own guarantee
    assert [s[0] for s in spec] == [p[0] for p in plain]  # llama.cpp's
    same = [i for i in range(len(prompts)) if plain[i][0] == mine_plain[i]]
    rate_llama = sum(spec[i][2] for i in same) / max(1, sum(spec[i][1] for i in same))
    rate_mine = sum(mine[i].stats.accepted for i in same) / max(1, sum(mine[i].stats.drafted_steps for i in same))
    record(target="tiny DeepSeek-V3 (llama.cpp f32 deepseek2 GGUF)", drafter="mtp (llama-server draft-mtp)", D=1,
           loads=True, equal=f"{len(same)} of {len(prompts)} prompts", al_vllm=1 + rate_llama, al_specpack=1 + rate_mine,
           note=f"acceptance rate llama.cpp {rate_llama:.3f}, specpack {rate_mine:.3f}, over the agreeing prompts")
    assert len(same) >= len(prompts) // 2, f"{len(same)} of {len(prompts)}"
    assert abs(rate_llama / rate_mine - 1) <= TOLERANCE, (rate_llama, rate_mine)
